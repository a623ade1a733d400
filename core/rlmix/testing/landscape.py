"""A toy world for harness search where the harness is a path of edits through a fixed
landscape of scores, and the feedback is sparse: a task is right or wrong, nothing more.

The harness component ``instructions`` holds space-separated edit tokens; the tuple of tokens
is the *path*. A ``Landscape`` maps each path to the fraction of tasks answered right under it
and lists the tokens a proposer may append to it (its children). Task ``(step, i)`` has a
difficulty level ``(step * prompts_per_step + i) % levels``; the ``LandscapeModel`` rollout
engine answers it right exactly when ``level < score(path) * levels``, so a path's mean over
``levels`` consecutive tasks is its score. The scorer's feedback says only right or wrong, so
a proposer cannot read the next edit off the traces: ``landscape_proposer`` appends a random
child token (seeded). Which node a search expands is then the whole story.

Test fixtures only: nothing here is a shipped default.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.types import Prompt, RolloutBatch

Path = tuple[str, ...]
_TASK = re.compile(r"^Task (\d+)\.(\d+)\.")
_FENCE = re.compile(r"```\n(.*?)\n```", re.S)


def path_of(text: str) -> Path:
    return tuple(text.split())


@dataclass
class Landscape:
    """``value(path)``: the fraction of tasks right under ``path``; ``children(path)``: the
    tokens a proposer may append (``()`` for a leaf)."""

    value: Callable[[Path], float]
    children: Callable[[Path], tuple[str, ...]]
    levels: int = 8

    def score(self, path: Path) -> float:
        return float(self.value(tuple(path)))


def deceptive_landscape(plateau_depth: int = 6) -> Landscape:
    """A root scoring 3/8 with two children: ``g`` (4/8), whose descendants all stay at 4/8 (a
    plateau), and the stepping stone ``s`` (2/8, worse than its parent and its sibling), whose
    child ``s a`` scores 5/8 and grandchild ``s a b`` 8/8. Only the stepping stone's line
    reaches 1.0."""
    line = {(): 3 / 8, ("s",): 2 / 8, ("s", "a"): 5 / 8, ("s", "a", "b"): 1.0}

    def value(path: Path) -> float:
        return 4 / 8 if path[:1] == ("g",) else line.get(path, 0.0)

    def children(path: Path) -> tuple[str, ...]:
        if path == ():
            return ("g", "s")
        if path[0] == "g":
            return ("x", "y", "z") if len(path) < plateau_depth else ()
        return {("s",): ("a",), ("s", "a"): ("b",)}.get(path, ())

    return Landscape(value=value, children=children)


@dataclass
class LandscapeEnv:
    """Prompts ``Task {step}.{i}. {instructions}``; reward term ``correct``; no feedback."""

    world: Landscape
    prompts_made: int = 0

    @rlmix.hookimpl
    def rlmix_prompts(self, run: Any, step: int) -> list[Prompt]:
        text = run.harness.get("instructions", "")
        out = []
        for i in range(int(run.config.train.prompts_per_step)):
            user = f"Task {step}.{i}. {text}".strip()
            out.append(Prompt(messages=[{"role": "user", "content": user}],
                              answer=f"{step}.{i}", id=f"{step}-{i}"))
        self.prompts_made += len(out)
        return out

    @rlmix.hookimpl
    def rlmix_score(self, run: Any, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        right = [float(t == f"ANSWER {p.answer}") for t, p in zip(batch.texts, batch.prompts)]
        return {"correct": torch.tensor(right)}


class LandscapeModel:
    """The rollout engine of the world: right on a task exactly when its level is below the
    prompt's path score times ``levels``. Counts its rollouts."""

    def __init__(self, world: Landscape) -> None:
        self.world = world
        self.calls = 0

    def answer(self, run: Any, prompt: Prompt) -> str:
        user = prompt.messages[-1]["content"]
        found = _TASK.match(user)
        step, i = int(found.group(1)), int(found.group(2))
        path = path_of(user[found.end():])
        per_step = int(run.config.train.prompts_per_step)
        level = (step * per_step + i) % self.world.levels
        ok = level < round(self.world.score(path) * self.world.levels)
        return f"ANSWER {step}.{i}" if ok else "no idea"

    @rlmix.hookimpl
    def rlmix_generate(self, run: Any, request: Any) -> RolloutBatch:
        texts = [self.answer(run, p) for p in request.prompts for _ in range(request.n)]
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


def landscape_proposer(world: Landscape, seed: int = 0) -> Callable[[str], str]:
    """A scripted reflection LM: reads the first ```-fenced text of the prompt as a path and
    answers with that path plus one of its children (the same text for a leaf). Asked again
    about the same path it proposes the next child in turn, from a starting child drawn at
    random (seeded): a real proposer asked twice tries another edit. It reads nothing else of
    the prompt."""
    rng = random.Random(seed)
    asked: dict[Path, int] = {}
    start: dict[Path, int] = {}

    def reply(prompt: str) -> str:
        found = _FENCE.search(prompt)
        path = path_of(found.group(1) if found else "")
        options = world.children(path)
        if not options:
            return "```\n" + " ".join(path) + "\n```"
        first = start.setdefault(path, rng.randrange(len(options)))
        k = asked[path] = asked.get(path, -1) + 1
        return "```\n" + " ".join((*path, options[(first + k) % len(options)])) + "\n```"

    return reply


def landscape_plugins(world: Landscape) -> dict[str, Any]:
    """``{"landenv": env, "landmodel": model}`` for ``rlmix.testing.make_run``; the metric is
    ``landenv.correct``."""
    return {"landenv": LandscapeEnv(world), "landmodel": LandscapeModel(world)}
