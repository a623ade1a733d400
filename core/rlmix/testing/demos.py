"""Sparse-feedback hint worlds and demonstrations, for testing harness search that learns from
competent trajectories rather than from feedback.

``SparseHintEnv`` is ``rlmix.testing.harness.HintEnv`` whose scorer says only right or wrong:
no feedback names a missing word, so a reflection model reading the agent's own traces has
nothing to go on. ``hint_demos`` writes competent trajectories for some topics: the expert's
output says what it recalled (``Recall beta. ANSWER t1``). ``demo_reader`` is a scripted
reflection LM that imitates what it is shown: it adds to the fenced text every word an expert
output in a ``Demonstration`` block says it recalled, and otherwise edits blindly; it reads
nothing else.

Test fixtures only: nothing here is a shipped default.
"""

from __future__ import annotations

import random
import re
from typing import Any

import torch

import rlmix
from rlmix.testing.harness import HINTS, HintEnv
from rlmix.types import RolloutBatch


class SparseHintEnv(HintEnv):
    """A ``HintEnv`` whose feedback is empty: a task is right or wrong, nothing more."""

    @rlmix.hookimpl
    def rlmix_score(self, run: Any, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        terms = HintEnv.rlmix_score(self, run, batch)
        for info in batch.info:
            info.pop("hint", None)
        return terms


def hint_demos(topics: list[str], hints: dict[str, str] | None = None) -> list[dict[str, str]]:
    """One competent trajectory per topic: ``{"input", "output"}`` as a demonstration file
    holds them (JSON lines)."""
    hints = dict(hints or HINTS)
    return [{"input": f"Question on topic {t}.", "output": f"Recall {hints[t]}. ANSWER {t}"}
            for t in topics]


_DEMO = re.compile(r"Demonstration \d+.*?Expert output: (.*?)(?:\n|$)", re.S)
_FENCE = re.compile(r"```\n(.*?)\n```", re.S)


FILLER = ("carefully", "briefly", "exactly", "step", "check", "think", "simply", "clearly",
          "first", "then", "verify", "focus")  # generic edits; no hint word among them


def demo_reader(seed: int = 0) -> Any:
    """A scripted reflection LM: the first ```-fenced text of the prompt plus every word that a
    demonstration's expert output says it recalled (``Recall <word>``), between ``` lines.
    Shown no demonstration with anything new, it edits blindly: it appends a generic word
    (``FILLER``, drawn with ``seed``), as a proposer with sparse feedback and nothing else to
    go on would."""
    rng = random.Random(seed)

    def reply(prompt: str) -> str:
        found = _FENCE.search(prompt)
        current = found.group(1) if found else ""
        recalled = [w for out in _DEMO.findall(prompt) for w in re.findall(r"Recall (\w+)", out)]
        words = current.split()
        new = [w for w in recalled if w not in words]
        words += new or [rng.choice(FILLER)]
        return "```\n" + " ".join(words).strip() + "\n```"

    return reply


# ---------------------------------------------------------------- a world where answers leak

_REFERENCE = re.compile(r"\(Reference: the correct answer is (\w+)\.\)")
_LITERAL = re.compile(r"(\d+\.\d+)\s*->\s*(\w+)")


class LeakModel:
    """A rollout engine for ``HintEnv`` prompts that also *memorises*: it answers a task right
    when its topic's hint word is in the harness (``Recall <hint>. ANSWER <topic>``, general
    competence) or when the harness holds the literal ``<step>.<i> -> <topic>`` for that very
    task (memorisation: it helps no other task). Shown the ground truth
    (``(Reference: the correct answer is <topic>.)`` in the prompt) it answers as a competent
    run would, naming the hint it recalls: the reference trajectory."""

    def __init__(self, env: HintEnv) -> None:
        self.env = env
        self.calls = 0

    def answer(self, prompt: Any) -> str:
        from rlmix.testing.harness import _QUESTION, harness_words

        user = prompt.messages[-1]["content"]
        found = _QUESTION.match(user)
        topic = found.group(1)
        task = re.match(r"^Question ([\d.]+) ", user).group(1)
        reference = _REFERENCE.search(user)
        if reference:
            return f"Recall {self.env.hints[reference.group(1)]}. ANSWER {reference.group(1)}"
        words = set(harness_words(prompt))
        literal = dict(_LITERAL.findall(" ".join(m["content"] for m in prompt.messages)))
        if self.env.hints[topic] in words or literal.get(task) == topic:
            return f"Recall {self.env.hints[topic]}. ANSWER {topic}"
        return "no idea"

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


def leaky_proposer() -> Any:
    """A scripted reflection LM for failure patterns: the first time it is asked about a pattern
    it writes the literal answers of the pattern's tasks into the text (``<task> -> <answer>``,
    from the ``Task <id> answer <a>`` lines of the prompt); asked again about the same pattern
    it adds the pattern's signal words (``Signal: ...``) instead. Half its edits leak."""
    asked: dict[str, int] = {}

    def reply(prompt: str) -> str:
        found = _FENCE.search(prompt)
        current = found.group(1) if found else ""
        signal = re.search(r"Signal: (.*)", prompt)
        words = signal.group(1).split() if signal else []
        key = " ".join(words)
        asked[key] = asked.get(key, 0) + 1
        if asked[key] == 1:
            pairs = re.findall(r"Task ([\d.]+) answer (\w+)", prompt)
            new = current + " " + " ".join(f"{t} -> {a}" for t, a in pairs)
        else:
            new = " ".join([*current.split(), *[w for w in words if w not in current.split()]])
        return "```\n" + new.strip() + "\n```"

    return reply


# ---------------------------------------------------------------- a label-free hint world


class LabelFreeHintEnv(HintEnv):
    """A ``HintEnv`` whose scorer refuses to be called: a label-free method must never read a
    reward. ``accuracy(batch)`` is the test's own check, outside the run."""

    @rlmix.hookimpl
    def rlmix_score(self, run: Any, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        raise AssertionError("a label-free method read a reward")

    @staticmethod
    def accuracy(batch: RolloutBatch) -> float:
        right = [t.endswith(f"ANSWER {p.answer}") for t, p in zip(batch.texts, batch.prompts)]
        return sum(right) / max(1, len(right))


class GuessingHintModel(LeakModel):
    """A rollout engine for ``HintEnv`` prompts: with the topic's hint in the harness it
    answers ``ANSWER <topic>`` every time; without it, sampled (temperature > 0), it guesses a
    topic at random, so its answers disagree with each other; greedy, it answers the first
    topic. Self-consistency is high exactly where it is right."""

    def __init__(self, env: HintEnv, seed: int = 0) -> None:
        super().__init__(env)
        self.rng = random.Random(seed)
        self.temperature = 0.0

    def answer(self, prompt: Any) -> str:
        from rlmix.testing.harness import _QUESTION, harness_words

        topic = _QUESTION.match(prompt.messages[-1]["content"]).group(1)
        if self.env.hints[topic] in set(harness_words(prompt)):
            return f"ANSWER {topic}"
        topics = sorted(self.env.hints)
        return f"ANSWER {self.rng.choice(topics) if self.temperature > 0 else topics[0]}"

    @rlmix.hookimpl
    def rlmix_generate(self, run: Any, request: Any) -> RolloutBatch:
        self.temperature = float(request.temperature)
        return LeakModel.rlmix_generate(self, run, request)
