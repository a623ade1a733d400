"""Acceptance gates for harness evolution: a flip gate and a search / selection / held-out split.

Two pieces any harness plugin can use:

* ``flip_gate(before, after, tolerance, threshold)``: per-task scores of the current harness and
  of a proposal on a fixed check set; the proposal passes when the tasks that flip from pass to
  fail are at most ``tolerance`` (a fraction of the check set), whatever it gains elsewhere.
* ``split_tasks(ids, sizes, seed)``: disjoint search, selection and held-out sets, so that the
  figure a run reports comes from tasks the search never saw. ``Gates.guard_heldout`` refuses a
  held-out task that was ever handed to the search.

Listed in a manifest (``plugins: [..., gates, gepa]``), the plugin puts a ``Gates`` object in
``run.resources["rlmix.gates"]`` at configure time; harness plugins look it up there (they never
import this package), use it when it is present, and skip gating when it is not.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import rlmix
from rlmix.types import Run

RESOURCE = "rlmix.gates"
SETS = ("search", "selection", "heldout")


@dataclass
class Settings:
    flip_tolerance: float = 0.0  # pass->fail flips allowed, as a fraction of the check set
    pass_threshold: float = 0.5  # a task passes when its score is >= this
    shuffle: bool = True  # assign tasks to the three sets at random (seeded), not in order
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.flip_tolerance <= 1.0:
            raise ValueError(f"flip_tolerance: must be in [0, 1], got {self.flip_tolerance}")


@dataclass
class GateResult:
    """The verdict of a gate: ``regressions`` (pass->fail) and ``fixes`` (fail->pass) are
    indices into the check set."""

    passed: bool
    regressions: list[int] = field(default_factory=list)
    fixes: list[int] = field(default_factory=list)
    allowed: int = 0
    reason: str = ""


def passes(scores: Sequence[float], threshold: float = 0.5) -> list[bool]:
    return [float(s) >= threshold for s in scores]


def flip_gate(before: Sequence[float], after: Sequence[float], tolerance: float = 0.0,
              threshold: float = 0.5) -> GateResult:
    """Pass when at most ``floor(tolerance * n)`` check tasks go from pass to fail."""
    if len(before) != len(after):
        raise ValueError(f"flip gate: {len(before)} scores before, {len(after)} after; the check "
                         "set must be the same tasks in the same order")
    if not 0.0 <= tolerance <= 1.0:
        raise ValueError(f"flip gate: tolerance must be in [0, 1], got {tolerance}")
    was, now = passes(before, threshold), passes(after, threshold)
    regressions = [i for i, (a, b) in enumerate(zip(was, now)) if a and not b]
    fixes = [i for i, (a, b) in enumerate(zip(was, now)) if b and not a]
    allowed = int(tolerance * len(before) + 1e-9)
    ok = len(regressions) <= allowed
    reason = (f"{len(regressions)} pass->fail flips (allowed {allowed}), {len(fixes)} fail->pass "
              f"on {len(before)} check tasks")
    return GateResult(ok, regressions, fixes, allowed, reason)


@dataclass
class TaskSplit:
    search: list[Any]
    selection: list[Any]
    heldout: list[Any]

    def __post_init__(self) -> None:
        keys = [_key(x) for x in (*self.search, *self.selection, *self.heldout)]
        if len(set(keys)) != len(keys):
            raise ValueError("task split: a task is in more than one set")


def _key(task: Any) -> Hashable:
    return tuple(task) if isinstance(task, list) else task


def split_tasks(ids: Sequence[Any], sizes: dict[str, int], seed: int = 0,
                shuffle: bool = True) -> TaskSplit:
    """Disjoint ``search``, ``selection`` and ``heldout`` lists of the sizes asked for, drawn from
    ``ids`` (distinct tasks). Missing sizes are 0; asking for more tasks than given is an error."""
    unknown = set(sizes) - set(SETS)
    if unknown:
        raise ValueError(f"task split: unknown set(s) {sorted(unknown)}; sets are "
                         f"{', '.join(SETS)}")
    want = {name: int(sizes.get(name, 0)) for name in SETS}
    if any(v < 0 for v in want.values()):
        raise ValueError(f"task split: negative size in {want}")
    if len({_key(x) for x in ids}) != len(ids):
        raise ValueError("task split: the task ids are not distinct")
    total = sum(want.values())
    if total > len(ids):
        raise ValueError(f"task split: {total} tasks asked for ({want}), only {len(ids)} given")
    order = list(ids)
    if shuffle:
        random.Random(f"gates-split-{seed}").shuffle(order)
    a, b = want["search"], want["search"] + want["selection"]
    return TaskSplit(order[:a], order[a:b], order[b:total])


class Gates:
    """The gates of one run (``run.resources["rlmix.gates"]``)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.seen: set[Hashable] = set()  # tasks handed to a search
        self.checks = 0
        self.rejected = 0
        self.last: GateResult | None = None

    def split(self, ids: Sequence[Any], sizes: dict[str, int]) -> TaskSplit:
        s = self.settings
        out = split_tasks(ids, sizes, s.seed, s.shuffle)
        self.mark_seen([*out.search, *out.selection])
        return out

    def mark_seen(self, tasks: Sequence[Any]) -> None:
        self.seen.update(_key(t) for t in tasks)

    def guard_heldout(self, tasks: Sequence[Any]) -> None:
        """Raise if any of ``tasks`` was handed to a search (the figure would be contaminated)."""
        leaked = [t for t in tasks if _key(t) in self.seen]
        if leaked:
            raise ValueError(f"gates: {len(leaked)} held-out task(s) were seen by the search, "
                             f"e.g. {leaked[0]!r}")

    def check(self, before: Sequence[float], after: Sequence[float]) -> GateResult:
        s = self.settings
        result = flip_gate(before, after, s.flip_tolerance, s.pass_threshold)
        self.checks += 1
        self.rejected += 0 if result.passed else 1
        self.last = result
        return result


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    run.resources[RESOURCE] = Gates(run.settings("gates"))


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    gates = run.resources.get(RESOURCE)
    if gates is not None and gates.checks:
        metrics["gates/checks"] = gates.checks
        metrics["gates/rejected"] = gates.rejected
