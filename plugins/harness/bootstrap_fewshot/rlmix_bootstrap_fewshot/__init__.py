"""Bootstrapped few-shot demonstrations, selected on a validation set (DSPy's BootstrapFewShot
with random search; Khattab et al., 2023, arXiv:2310.03714).

The program is the policy plus the harness. The plugin

1. **bootstraps**: runs the program (optionally under a *teacher* harness) once on each training
   task and keeps the traces whose metric reaches ``threshold`` as candidate demonstrations
   (``input`` = the task as the student sees it, ``output`` = what the program answered); with
   ``max_rounds > 1`` the tasks that failed are retried at ``round_temperature``;
2. **proposes** demo sets: the zero-shot seed (no demos), the first ``max_demos`` demos in
   bootstrap order, and seeded random subsets of ``max_demos`` demos, ``num_candidates`` sets in
   all besides the seed (distinct sets only);
3. **selects**: scores each set on the validation tasks, ``candidates_per_step`` sets per
   ``rlmix_evolve`` call, and applies the best so far as worked examples appended to the harness
   component ``component`` after its starting text.

One metric call is one scored rollout of one task; the budget is never overspent (a step does
only what still fits). All state lives in ``run.state["bootstrap_fewshot"]``, so a checkpointed
run resumes where it stopped.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    Task,
    guard_heldout,
    mean,
    score_tasks,
    split_pool,
    task_prompts,
    user_text,
)

import rlmix
from rlmix.types import HarnessUpdate, RolloutBatch, Run

NAME = "bootstrap_fewshot"


@dataclass
class Settings:
    component: str = "system"  # harness component the demos are appended to (after its text)
    header: str = "Worked examples of tasks solved correctly:"
    max_demos: int = 4  # demos per candidate set (k)
    num_candidates: int = 8  # demo sets tried besides the zero-shot seed (K)
    train_size: int = 16  # tasks the demos are bootstrapped from
    val_size: int = 8  # tasks every demo set is scored on (selection)
    heldout_size: int = 0  # tasks never searched; scored for the seed and each new best
    threshold: float = 1.0  # a trace becomes a demo when its metric is >= this
    max_rounds: int = 1  # bootstrap passes; passes after the first retry the failed tasks
    round_temperature: float = 0.7  # sampling temperature of the retry passes
    candidates_per_step: int = 2  # demo sets scored per rlmix_evolve call
    budget: int = 200  # metric calls (one scored rollout of one task), bootstrap included
    metric: str = ""  # reward term to maximise, e.g. arith.correct; "" = the weighted reward
    temperature: float = 0.0  # bootstrap and validation rollouts (0 = greedy)
    max_new_tokens: int = 0  # task rollouts; 0 = sampling.max_new_tokens
    task_step_base: int = 3_000_000  # tasks are rlmix_prompts(run, task_step_base + k)
    demo_chars: int = 400  # each demo's input and output are cut to this many characters
    teacher: dict[str, str] = field(default_factory=dict)  # harness components to bootstrap with
    seed: int = 0  # the random demo subsets

    def __post_init__(self) -> None:
        if not self.component:
            raise ValueError("component: name the harness component the demos go into")
        if self.max_demos < 1:
            raise ValueError(f"max_demos: must be >= 1, got {self.max_demos}")
        if self.num_candidates < 1:
            raise ValueError(f"num_candidates: must be >= 1, got {self.num_candidates}")
        if self.train_size < 1 or self.val_size < 1:
            raise ValueError("train_size: train_size and val_size must be >= 1")
        if self.heldout_size < 0:
            raise ValueError("heldout_size: must be >= 0")
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds: must be >= 1, got {self.max_rounds}")
        if self.round_temperature < 0 or self.temperature < 0:
            raise ValueError("temperature: temperature and round_temperature must be >= 0")
        if self.candidates_per_step < 1:
            raise ValueError("candidates_per_step: must be >= 1")
        if self.budget < self.train_size + self.val_size:
            raise ValueError(f"budget: must cover bootstrapping and the zero-shot validation "
                             f"(train_size + val_size = {self.train_size + self.val_size}), got "
                             f"{self.budget}")
        if self.max_new_tokens < 0 or self.demo_chars < 1:
            raise ValueError("max_new_tokens: max_new_tokens must be >= 0 and demo_chars >= 1")


# ---------------------------------------------------------------- pure parts


def passing_demos(inputs: Sequence[str], outputs: Sequence[str], scores: Sequence[float],
                  threshold: float, chars: int = 400) -> list[dict[str, Any]]:
    """The traces whose score is ``>= threshold``, as ``{"input", "output", "score", "row"}``;
    a repeated input keeps its first passing trace."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for row, (x, y, s) in enumerate(zip(inputs, outputs, scores)):
        if float(s) >= threshold and x not in seen:
            seen.add(x)
            out.append({"input": x[:chars], "output": y[:chars], "score": float(s), "row": row})
    return out


def candidate_sets(pool_size: int, k: int, n: int, rng: random.Random) -> list[list[int]]:
    """Demo sets (lists of indices into the pool): ``[]`` (zero-shot) first, then the first
    ``k`` demos in pool order, then seeded random subsets of ``min(k, pool_size)`` demos (in
    random order), up to ``n`` sets besides the zero-shot one; no two sets hold the same demos."""
    sets: list[list[int]] = [[]]
    if pool_size == 0:
        return sets
    size = min(k, pool_size)
    seen = {()}
    first = list(range(size))
    sets.append(first)
    seen.add(tuple(first))
    tries = 0
    while len(sets) < n + 1 and tries < 20 * n:
        tries += 1
        pick = rng.sample(range(pool_size), size)
        key = tuple(sorted(pick))
        if key not in seen:
            seen.add(key)
            sets.append(pick)
    return sets


def render_demos(demos: Sequence[dict[str, Any]], header: str, preamble: str = "") -> str:
    """``preamble``, then ``header`` and the demos as numbered input / output pairs."""
    parts = [preamble.strip()] if preamble.strip() else []
    if demos:
        lines = [header]
        for n, d in enumerate(demos, 1):
            lines += [f"Example {n}", f"Input: {d['input']}", f"Output: {d['output']}"]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def best_candidate(val: Sequence[Sequence[float] | None]) -> int:
    """The scored set with the best mean validation score; ties go to the earlier set (so to
    zero-shot, then to fewer searched-for sets)."""
    scored = [(mean(v), -c) for c, v in enumerate(val) if v is not None]
    return -max(scored)[1]


# ---------------------------------------------------------------- tasks and scoring


def run_tasks(run: Run, harness: dict[str, str], tasks: Sequence[Task],
              temperature: float | None = None) -> tuple[list[float], RolloutBatch]:
    """One scored rollout per task under ``harness``; counts the metric calls."""
    s = run.settings(NAME)
    scores, batch = score_tasks(run, harness, tasks,
                                temperature=s.temperature if temperature is None else temperature,
                                max_new_tokens=s.max_new_tokens or None, metric=s.metric,
                                owner=NAME)
    run.state[NAME]["metric_calls"] += len(tasks)
    return scores, batch


def _tasks(state: dict[str, Any], name: str) -> list[Task]:
    return [(int(a), int(b)) for a, b in state["tasks"][name]]


def harness_with(state: dict[str, Any], run: Run, c: int) -> dict[str, str]:
    """The run's harness with candidate ``c``'s demos rendered into the component."""
    s = run.settings(NAME)
    demos = [state["pool"][i] for i in state["candidates"][c]]
    return {**run.harness, s.component: render_demos(demos, s.header, state["preamble"])}


def split(run: Run) -> dict[str, list[Task]]:
    s = run.settings(NAME)
    out = split_pool(run, {"search": s.train_size, "selection": s.val_size,
                           "heldout": s.heldout_size}, s.task_step_base)
    return {"train": out["search"], "val": out["selection"], "heldout": out["heldout"]}


def bootstrap(run: Run) -> dict[str, Any]:
    """Bootstrap the demo pool, propose the demo sets and score the zero-shot seed."""
    s = run.settings(NAME)
    sets = split(run)
    preamble = run.harness.get(s.component, "")
    state = run.state[NAME] = {
        "tasks": {k: [list(t) for t in v] for k, v in sets.items()}, "preamble": preamble,
        "pool": [], "candidates": [], "val": [], "heldout": {}, "metric_calls": 0,
        "heldout_calls": 0, "rounds": [], "applied": 0, "history": []}
    student = dict(run.harness)
    teacher = {**student, **{str(k): str(v) for k, v in s.teacher.items()}}
    todo = list(sets["train"])
    for r in range(s.max_rounds):
        room = s.budget - s.val_size - state["metric_calls"]
        todo = todo[:max(0, room)]
        if not todo:
            break
        temperature = s.temperature if r == 0 else s.round_temperature
        scores, batch = run_tasks(run, teacher, todo, temperature)
        prompts = batch.prompts if teacher == student else task_prompts(run, student, todo)
        found = passing_demos([user_text(p) for p in prompts], batch.texts, scores,
                              s.threshold, s.demo_chars)
        known = {d["input"] for d in state["pool"]}
        fresh = [d for d in found if d["input"] not in known]
        for d in fresh:
            d["task"] = list(todo[d.pop("row")])
        state["pool"] += fresh
        state["rounds"].append({"round": r, "tasks": len(todo), "passed": len(fresh)})
        passed = {tuple(d["task"]) for d in fresh}
        todo = [t for t in todo if tuple(t) not in passed]
    rng = random.Random(f"bootstrap_fewshot-{s.seed}")
    state["candidates"] = candidate_sets(len(state["pool"]), s.max_demos, s.num_candidates, rng)
    state["val"] = [None] * len(state["candidates"])
    zero, _ = run_tasks(run, harness_with(state, run, 0), _tasks(state, "val"))
    state["val"][0] = zero
    _score_heldout(run, 0)
    return state


def _score_heldout(run: Run, c: int) -> None:
    state = run.state[NAME]
    tasks = _tasks(state, "heldout")
    if not tasks or str(c) in state["heldout"]:
        return
    guard_heldout(run, tasks)
    calls = state["metric_calls"]
    scores, _ = run_tasks(run, harness_with(state, run, c), tasks)
    state["metric_calls"] = calls  # held-out scoring is reporting, not search
    state["heldout_calls"] += len(tasks)
    state["heldout"][str(c)] = mean(scores)


def iterate(run: Run) -> HarnessUpdate | None:
    """One step of the search: bootstrap on the first call, then score up to
    ``candidates_per_step`` demo sets on the validation tasks; returns the harness update when
    the best set changed."""
    s = run.settings(NAME)
    state = run.state.get(NAME) or bootstrap(run)
    val = _tasks(state, "val")
    scored = 0
    for c, v in enumerate(state["val"]):
        if scored >= s.candidates_per_step:
            break
        if v is not None:
            continue
        if state["metric_calls"] + len(val) > s.budget:
            break
        scores, _ = run_tasks(run, harness_with(state, run, c), val)
        state["val"][c] = scores
        state["history"].append({"step": run.step, "candidate": c, "val": mean(scores),
                                 "metric_calls": state["metric_calls"]})
        scored += 1
    best = best_candidate(state["val"])
    if best == state["applied"]:
        return None
    state["applied"] = best
    _score_heldout(run, best)
    seed_val = mean(state["val"][0])
    return HarnessUpdate(
        components={s.component: harness_with(state, run, best)[s.component]},
        evidence=(f"demo set {best} ({len(state['candidates'][best])} demos from a pool of "
                  f"{len(state['pool'])}): validation mean {mean(state['val'][best]):.3f} over "
                  f"{len(val)} tasks (zero-shot {seed_val:.3f}); {state['metric_calls']} metric "
                  f"calls"),
        parent_version=run.harness_version, source=NAME)


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return iterate(run)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if not state:
        return
    best = state["applied"]
    p = "bootstrap_fewshot/"
    metrics[p + "metric_calls"] = state["metric_calls"]
    metrics[p + "demos"] = len(state["pool"])
    metrics[p + "scored"] = sum(v is not None for v in state["val"])
    metrics[p + "best"] = best
    metrics[p + "best_val"] = mean(state["val"][best])
    metrics[p + "zero_shot_val"] = mean(state["val"][0])
    if str(best) in state["heldout"]:
        metrics[p + "heldout"] = state["heldout"][str(best)]
        metrics[p + "zero_shot_heldout"] = state["heldout"]["0"]
