"""Toy worlds for harness search with sparse feedback: a task is right or wrong, nothing more,
so a proposer cannot read the next edit off the traces and the search itself is the story.

A world scores a harness (its component texts) by the fraction of tasks answered right. Task
``(step, i)`` has a difficulty level ``(step * prompts_per_step + i) % levels``; the
``LandscapeModel`` rollout engine answers it right exactly when ``level < score * levels``, so
a harness's mean over ``levels`` consecutive tasks is its score.

- ``Landscape``: the component ``instructions`` holds space-separated edit tokens (a *path*);
  ``value(path)`` is its score and ``children(path)`` the tokens a proposer may append
  (``landscape_proposer``). ``deceptive_landscape`` has a stepping stone.
- ``ComponentWorld``: several components, each holding one option token; ``value`` scores the
  tuple of options (epistatic tables), ``component_proposer`` offers a random option for the
  component the prompt names. ``trap_world`` has a local optimum one edit from its start.

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
class ComponentWorld:
    """``components`` each hold one token of ``options``; ``value(tokens)`` scores the tuple
    of tokens in component order."""

    components: tuple[str, ...]
    options: tuple[str, ...]
    value: Callable[[tuple[str, ...]], float]
    levels: int = 8

    def score_of(self, harness: dict[str, str]) -> float:
        return float(self.value(tuple(harness.get(c, "").strip() for c in self.components)))


def trap_world() -> ComponentWorld:
    """Three components ``c1 c2 c3`` with options ``A B C``; the best harness is ``B C B``
    (8/8). ``c1 = A, c2 = A`` is a weaker synergy (+3/8) than ``c1 = B, c2 = C`` (+5/8), and
    ``c3`` adds 2/8 with ``B`` only inside the strong synergy, else 1/8 with ``A``. From the
    start ``A A B`` (4/8, with ``c3`` already right), overwriting ``c3`` with ``A`` scores 5/8
    (it loses the right ``c3``), and from ``A A A`` every single edit scores lower: a
    one-candidate search that accepts what does not lose is trapped there."""

    def value(t: tuple[str, ...]) -> float:
        c1, c2, c3 = t
        eighths = 1
        strong = c1 == "B" and c2 == "C"
        if c1 == "A" and c2 == "A":
            eighths += 3
        elif strong:
            eighths += 5
        if strong and c3 == "B":
            eighths += 2
        elif c3 == "A":
            eighths += 1
        return eighths / 8

    return ComponentWorld(components=("c1", "c2", "c3"), options=("A", "B", "C"), value=value)


def _harness_of(world: Landscape | ComponentWorld, harness: dict[str, str]) -> float:
    if isinstance(world, ComponentWorld):
        return world.score_of(harness)
    return world.score(path_of(harness.get("instructions", "")))


def _components(world: Landscape | ComponentWorld) -> tuple[str, ...]:
    return world.components if isinstance(world, ComponentWorld) else ("instructions",)


@dataclass
class LandscapeEnv:
    """Prompts ``Task {step}.{i}.`` followed by ``[name] text`` for each of the world's
    components; reward term ``correct``; no feedback."""

    world: Landscape | ComponentWorld
    prompts_made: int = 0

    @rlmix.hookimpl
    def rlmix_prompts(self, run: Any, step: int) -> list[Prompt]:
        parts = " ".join(f"[{c}] {run.harness.get(c, '')}" for c in _components(self.world))
        out = []
        for i in range(int(run.config.train.prompts_per_step)):
            out.append(Prompt(messages=[{"role": "user", "content": f"Task {step}.{i}. {parts}"}],
                              answer=f"{step}.{i}", id=f"{step}-{i}"))
        self.prompts_made += len(out)
        return out

    @rlmix.hookimpl
    def rlmix_score(self, run: Any, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        right = [float(t == f"ANSWER {p.answer}") for t, p in zip(batch.texts, batch.prompts)]
        return {"correct": torch.tensor(right)}


_PART = re.compile(r"\[(\w+)\] ([^\[]*)")


class LandscapeModel:
    """The rollout engine of a world: right on a task exactly when its level is below the
    prompt's harness score times ``levels``. Counts its rollouts."""

    def __init__(self, world: Landscape | ComponentWorld) -> None:
        self.world = world
        self.calls = 0

    def answer(self, run: Any, prompt: Prompt) -> str:
        user = prompt.messages[-1]["content"]
        found = _TASK.match(user)
        step, i = int(found.group(1)), int(found.group(2))
        harness = {k: v.strip() for k, v in _PART.findall(user[found.end():])}
        per_step = int(run.config.train.prompts_per_step)
        level = (step * per_step + i) % self.world.levels
        ok = level < round(_harness_of(self.world, harness) * self.world.levels)
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


def component_proposer(world: ComponentWorld, seed: int = 0) -> Callable[[str], str]:
    """A scripted reflection LM for a ``ComponentWorld``: finds the component the prompt names
    (``called "<name>"``) and the texts it lists between ``` fences, and answers with an option
    drawn at random (seeded) among those not listed, or among all when every one is. It reads
    no feedback (there is none)."""
    rng = random.Random(seed)

    def reply(prompt: str) -> str:
        listed = {t.strip() for t in _FENCE.findall(prompt)}
        fresh = [o for o in world.options if o not in listed] or list(world.options)
        return "```\n" + rng.choice(fresh) + "\n```"

    return reply


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


def landscape_plugins(world: Landscape | ComponentWorld) -> dict[str, Any]:
    """``{"landenv": env, "landmodel": model}`` for ``rlmix.testing.make_run``; the metric is
    ``landenv.correct``."""
    return {"landenv": LandscapeEnv(world), "landmodel": LandscapeModel(world)}


def path_world() -> ComponentWorld:
    """Two components ``c1 c2`` starting at ``s``. ``x`` in ``c1`` or ``y`` in ``c2`` each add
    one family of tasks (0.25 -> 0.5); both together solve everything (1.0); ``z`` anywhere
    breaks what its component solved (0.25 or less). With ``path_proposer`` the first edit of
    either line makes the other's fix conflict: only recombining the two lines reaches 1.0."""

    def value(t: tuple[str, ...]) -> float:
        c1, c2 = t
        if "z" in t:
            return 0.0 if t == ("z", "z") else 0.25
        return {("s", "s"): 0.25, ("x", "s"): 0.5, ("s", "y"): 0.5, ("x", "y"): 1.0}.get(t, 0.0)

    return ComponentWorld(components=("c1", "c2"), options=("s", "x", "y", "z"), value=value)


_EDIT = re.compile(r"^Edit: (\w+)$", re.M)
_COMPONENT = re.compile(r"Component (\w+):\n```\n(.*?)\n```", re.S)


def path_proposer() -> Callable[[str], str]:
    """A scripted reflection LM for ``path_world``: asked (``Edit: <name>``) to change one
    component, it reads the ``Component <name>:`` blocks and writes that component's fix as
    the context allows: ``x`` for ``c1`` (``y`` for ``c2``) while the other component is still
    ``s``, else the conflicting ``z`` (its fix written against the other line's edit)."""

    def reply(prompt: str) -> str:
        target = _EDIT.search(prompt).group(1)
        current = {k: v.strip() for k, v in _COMPONENT.findall(prompt)}
        other = current.get("c2" if target == "c1" else "c1", "s")
        fix = ("x" if target == "c1" else "y") if other == "s" else "z"
        return "```\n" + fix + "\n```"

    return reply
