"""A toy world for harness-evolution tests, where the harness text alone decides the score.

Task ``(step, i)`` has a topic (``topic_of(step, i)``, by default ``t{(step + i) % 4}``). The
``HintModel`` rollout engine answers a topic right exactly when the topic's hint word appears in
the harness part of the prompt (the system message and the instructions after the question), and
no word that *conflicts* with the topic appears there. The scorer's feedback names the missing
(or the conflicting) word, so a reflection model that reads feedback can fix the harness, and one
that does not, cannot. ``hint_reflection`` is such a reader, scripted.

Test fixtures only: nothing here is a shipped default.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

import rlmix
from rlmix.types import Prompt, RolloutBatch

HINTS = {"t0": "alpha", "t1": "beta", "t2": "gamma", "t3": "delta"}
_QUESTION = re.compile(r"^Question [\d.]+ on topic (t\d+)\.")


def default_topic(step: int, i: int) -> str:
    return f"t{(step + i) % 4}"


class HintEnv:
    """Prompts ``Question {step}.{i} on topic {t}. {harness instructions}`` (with the harness
    ``system`` text as a system message); reward term ``correct``; feedback in ``info["hint"]``.

    ``topic_of(step, i)`` picks each task's topic (a stream shifts it with ``step``);
    ``hints`` maps topic -> the word that solves it; ``conflicts`` maps topic -> words that make
    the model fail it even with the hint present."""

    def __init__(self, topic_of: Callable[[int, int], str] = default_topic,
                 hints: dict[str, str] | None = None,
                 conflicts: dict[str, set[str]] | None = None) -> None:
        self.topic_of = topic_of
        self.hints = dict(hints or HINTS)
        self.conflicts = {k: set(v) for k, v in (conflicts or {}).items()}

    @rlmix.hookimpl
    def rlmix_prompts(self, run: Any, step: int) -> list[Prompt]:
        out = []
        for i in range(int(run.config.train.prompts_per_step)):
            topic = self.topic_of(step, i)
            user = f"Question {step}.{i} on topic {topic}. {run.harness.get('instructions', '')}"
            messages = [{"role": "user", "content": user.strip()}]
            if run.harness.get("system"):
                messages.insert(0, {"role": "system", "content": run.harness["system"]})
            out.append(Prompt(messages=messages, answer=topic, id=f"{step}-{i}",
                              info={"topic": topic}))
        return out

    @rlmix.hookimpl
    def rlmix_score(self, run: Any, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        correct = []
        for info, text, prompt in zip(batch.info, batch.texts, batch.prompts):
            topic = prompt.answer
            ok = text.endswith(f"ANSWER {topic}")
            correct.append(float(ok))
            if ok:
                info["hint"] = {}
            else:
                words = set(harness_words(prompt))
                bad = sorted(self.conflicts.get(topic, set()) & words)
                info["hint"] = ({"hint": f"the instructions must not have the word {bad[0]}"}
                                if bad else
                                {"hint": f"the instructions lack the word {self.hints[topic]}"})
        return {"correct": torch.tensor(correct)}


def harness_words(prompt: Prompt) -> list[str]:
    """The words of the harness part of a HintEnv prompt (system text and instructions)."""
    user = prompt.messages[-1]["content"]
    parts = [m["content"] for m in prompt.messages[:-1]] + [_QUESTION.sub("", user)]
    return " ".join(parts).replace(".", " ").replace(",", " ").split()


class HintModel:
    """A rollout engine: ``ANSWER {topic}`` when the topic's hint word is in the harness and
    none of its conflicting words is, else ``no idea``. Counts the rollouts it made."""

    def __init__(self, env: HintEnv) -> None:
        self.env = env
        self.calls = 0

    def answer(self, prompt: Prompt) -> str:
        topic = _QUESTION.match(prompt.messages[-1]["content"]).group(1)
        words = set(harness_words(prompt))
        ok = self.env.hints[topic] in words and not (self.env.conflicts.get(topic, set()) & words)
        return f"ANSWER {topic}" if ok else "no idea"

    @rlmix.hookimpl
    def rlmix_generate(self, run: Any, request: Any) -> RolloutBatch:
        texts = [self.answer(p) for p in request.prompts for _ in range(request.n)]
        prompts = [p for p in request.prompts for _ in range(request.n)]
        n = len(texts)
        self.calls += n
        return RolloutBatch(group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
                            tokens=torch.zeros(n, 2, dtype=torch.long),
                            attention_mask=torch.ones(n, 2, dtype=torch.long),
                            completion_mask=torch.tensor([[0.0, 1.0]] * n),
                            behavior_logp=torch.zeros(n, 2),
                            policy_version=torch.zeros(n, dtype=torch.long), texts=texts,
                            prompts=prompts)


def hint_reflection(prompt: str) -> str:
    """A scripted reflection LM that reads feedback: takes the first ```-fenced text of the
    prompt, adds every word the traces say is missing, drops every word they say must not be
    there, and answers with the result between ``` lines."""
    found = re.search(r"```\n(.*?)\n```", prompt, re.S)
    current = found.group(1) if found else ""
    missing = sorted(set(re.findall(r"lack the word (\w+)", prompt)))
    banned = set(re.findall(r"must not have the word (\w+)", prompt))
    words = [w for w in current.split() if w not in banned]
    words += [w for w in missing if w not in words]
    return "```\n" + " ".join(words).strip() + "\n```"


def hint_plugins(env: HintEnv | None = None) -> dict[str, Any]:
    """``{"hintenv": env, "hintmodel": HintModel(env)}`` for ``rlmix.testing.make_run``."""
    env = env or HintEnv()
    return {"hintenv": env, "hintmodel": HintModel(env)}
