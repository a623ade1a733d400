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
