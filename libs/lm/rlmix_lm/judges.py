"""A scripted judge: a test double of an ``rlmix_lm`` model that answers with structured verdicts.

Reward plugins that ask a model for a verdict (a flaw flag, a process score and a critique, a
preference between two candidates) take an ``rlmix_lm`` model; tests put a ``ScriptedJudge``
where the plugin looks its model up (``run.resources["<plugin>.lm"]``). The judge reads the
prompt it is sent and returns ``verdict(prompt_text)``: a dict is sent back as JSON, a string
as it is (so a test can script malformed replies: prose, truncated JSON, wrong types).

``every_kth_malformed(k, verdict)`` wraps a verdict function so that every k-th call answers
garbage instead, for the "a malformed verdict is counted and scored 0, never a crash" checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

Verdict = Callable[[str], "dict[str, Any] | str"]

MALFORMED_REPLIES = ("I think it is fine.", '{"score": ', '{"score": "high"}', "[1, 2]", "")


def prompt_text(prompt: Any) -> str:
    """A chat or a string, as one string (the contents joined by new lines)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


class ScriptedJudge:
    """Answers ``complete`` / ``complete_batch`` like an ``rlmix_lm.LM``, with
    ``verdict(prompt_text)`` serialised as JSON (dicts) or returned raw (strings). Records every
    prompt in ``prompts``; ``calls`` is how many replies it gave."""

    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict
        self.prompts: list[str] = []

    @property
    def calls(self) -> int:
        return len(self.prompts)

    def complete(self, prompt: Any, max_new_tokens: int = 256, temperature: float = 0.0) -> str:
        text = prompt_text(prompt)
        self.prompts.append(text)
        answer = self.verdict(text)
        return answer if isinstance(answer, str) else json.dumps(answer)

    def complete_batch(self, prompts: Sequence[Any], max_new_tokens: int = 256,
                       temperature: float = 0.0) -> list[str]:
        return [self.complete(p, max_new_tokens, temperature) for p in prompts]


def every_kth_malformed(k: int, verdict: Verdict) -> Verdict:
    """``verdict``, except that calls k, 2k, 3k, ... answer one of ``MALFORMED_REPLIES`` (in
    turn) instead."""
    if k < 1:
        raise ValueError("k must be >= 1")
    count = {"n": 0}

    def answer(text: str) -> dict[str, Any] | str:
        count["n"] += 1
        if count["n"] % k == 0:
            return MALFORMED_REPLIES[(count["n"] // k - 1) % len(MALFORMED_REPLIES)]
        return verdict(text)

    return answer
