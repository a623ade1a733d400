"""CASCADE: an episodic case memory whose shown case is chosen by a contextual bandit.

CASCADE (seed 000, paragraph 94) learns at deployment time without touching weights: it keeps
an explicit episodic memory of cases and treats *which case to reuse* for a new task as a
contextual bandit (LinUCB), so the choice trades exploring cases against exploiting the ones
that helped, with a no-regret guarantee; cases are accumulated, selected and refined.

In rlmix:

1. **selection, per prompt** (a wrapper on ``rlmix_prompts``): the ``candidates`` cases most
   similar to the task (word Jaccard) are the arms; each arm ``c`` has a ridge model
   ``(A_c, b_c)`` over the pair features ``x(task, c) = [1, similarity, success rate of c, exp(-age
   / age_scale), hashed words of the task]``; the case with the highest upper confidence bound
   ``theta_c . x + alpha * sqrt(x^T A_c^-1 x)`` (``theta_c = A_c^-1 b_c``) is rendered into the
   harness component ``component`` and the env's prompt rebuilt under it
   (``select: nearest`` shows the most similar case: the retrieval baseline);
2. **reward** (``rlmix_evolve``): the prompt's mean metric with that case shown updates the arm,
   ``A_c += x x^T``, ``b_c += r x``, and the case's shown / win counts;
3. **add and refine**: each solved prompt becomes a case ``(task, solution, outcome)``, unless a
   case with the same solution and a similar task (``dedup``) exists, which it refines (count,
   mean outcome, freshness); beyond ``max_cases`` the case with the lowest posterior success rate
   (then the least recently used) is evicted with its arm.

Everything is in ``run.state["cascade"]`` (checkpointed): cases, arms, counters.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from rlmix_harness import (
    cut,
    inside_rendering,
    mean,
    metric_values,
    prompts_under,
    rendering,
    similarity,
    user_text,
    words,
)

import rlmix
from rlmix import loop
from rlmix.types import HarnessUpdate, Prompt, RolloutBatch, Run

NAME = "cascade"
SELECTS = ("linucb", "nearest")
BASE_FEATURES = 4  # bias, similarity, success rate, freshness


@dataclass
class Settings:
    component: str = "system"  # harness component the chosen case is appended to
    header: str = "A solved case from memory:"
    select: str = "linucb"  # linucb (the bandit) | nearest (most similar case: the baseline)
    candidates: int = 4  # arms per task: the most similar cases
    alpha: float = 0.5  # exploration weight of the confidence bonus
    ridge: float = 1.0  # A_c starts at ridge * I
    hash_dims: int = 16  # task words hashed into this many features
    age_scale: float = 20.0  # freshness = exp(-(step - last refined) / age_scale)
    max_cases: int = 32  # memory cap: the lowest posterior success rate is evicted
    dedup: float = 0.5  # a solved task this similar to a case with its solution refines it
    success_threshold: float = 0.5  # metric >= this is a success (a case is added, a win)
    metric: str = ""  # reward term, e.g. arith.correct; "" = the weighted reward
    text_chars: int = 200  # a stored task or solution is cut to this many characters

    def __post_init__(self) -> None:
        rlmix.check_choices(self, select=SELECTS)
        if not self.component:
            raise ValueError("component: name the harness component the case goes into")
        if self.candidates < 1:
            raise ValueError(f"candidates: must be >= 1, got {self.candidates}")
        if self.alpha < 0:
            raise ValueError(f"alpha: must be >= 0, got {self.alpha}")
        if self.ridge <= 0:
            raise ValueError(f"ridge: must be > 0, got {self.ridge}")
        if self.hash_dims < 0:
            raise ValueError(f"hash_dims: must be >= 0, got {self.hash_dims}")
        if self.age_scale <= 0:
            raise ValueError(f"age_scale: must be > 0, got {self.age_scale}")
        if self.max_cases < 1:
            raise ValueError(f"max_cases: must be >= 1, got {self.max_cases}")
        if not 0.0 < self.dedup <= 1.0:
            raise ValueError(f"dedup: must be in (0, 1], got {self.dedup}")
        if self.text_chars < 16:
            raise ValueError(f"text_chars: must be >= 16, got {self.text_chars}")


# ---------------------------------------------------------------- features and LinUCB (pure)


def hashed_words(text: str, dims: int) -> list[float]:
    """The task's word set hashed (crc32) into ``dims`` buckets, L2-normalised."""
    out = [0.0] * dims
    if not dims:
        return out
    for w in words(text):
        out[zlib.crc32(w.encode()) % dims] += 1.0
    norm = math.sqrt(sum(v * v for v in out))
    return [v / norm for v in out] if norm else out


def success_rate(case: dict[str, Any]) -> float:
    """Posterior mean of the case's win rate when shown: ``(wins + 1) / (shown + 2)``."""
    return (float(case["wins"]) + 1.0) / (float(case["shown"]) + 2.0)


def pair_features(task: str, case: dict[str, Any], step: int, s: Settings) -> list[float]:
    """``[1, similarity, success rate, freshness, hashed task words...]``."""
    fresh = math.exp(-max(0, step - int(case["refined"])) / s.age_scale)
    return [1.0, similarity(task, case["task"]), success_rate(case), fresh,
            *hashed_words(task, s.hash_dims)]


def new_arm(dim: int, ridge: float) -> dict[str, torch.Tensor]:
    return {"A": torch.eye(dim, dtype=torch.float64) * ridge,
            "b": torch.zeros(dim, dtype=torch.float64)}


def ucb(arm: dict[str, torch.Tensor], x: Sequence[float], alpha: float) -> tuple[float, float]:
    """``(theta . x, alpha * sqrt(x^T A^-1 x))`` with ``theta = A^-1 b``."""
    xv = torch.tensor(list(x), dtype=torch.float64)
    a_inv_x = torch.linalg.solve(arm["A"], xv)
    theta = torch.linalg.solve(arm["A"], arm["b"])
    return float(theta @ xv), alpha * math.sqrt(max(0.0, float(xv @ a_inv_x)))


def update_arm(arm: dict[str, torch.Tensor], x: Sequence[float], reward: float) -> None:
    """``A += x x^T``, ``b += reward * x``."""
    xv = torch.tensor(list(x), dtype=torch.float64)
    arm["A"] += torch.outer(xv, xv)
    arm["b"] += reward * xv


def nearest(task: str, cases: Sequence[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The ``k`` cases most similar to ``task`` (newer first among equals)."""
    return sorted(cases, key=lambda c: (-similarity(task, c["task"]), -int(c["id"])))[:k]


def choose(task: str, cases: Sequence[dict[str, Any]], arms: dict[int, Any], step: int,
           s: Settings) -> tuple[dict[str, Any] | None, list[dict[str, Any]], list[float]]:
    """``(chosen case, candidates, its features)``: the highest UCB among the most similar
    cases (``linucb``), or the most similar case (``nearest``); ties go to the more similar."""
    cands = nearest(task, cases, s.candidates)
    if not cands:
        return None, [], []
    feats = [pair_features(task, c, step, s) for c in cands]
    if s.select == "nearest":
        return cands[0], cands, feats[0]
    scores = [sum(ucb(arms[int(c["id"])], x, s.alpha)) for c, x in zip(cands, feats)]
    best = max(range(len(cands)), key=lambda j: (round(scores[j], 12), -j))
    return cands[best], cands, feats[best]


def render(case: dict[str, Any], header: str) -> str:
    return (f"{header}\nTask: {case['task']}\nSolution: {case['solution']}\n"
            f"Outcome: solved (score {float(case['outcome']):.2g})")


def evict(cases: list[dict[str, Any]], arms: dict[int, Any], cap: int) -> list[dict[str, Any]]:
    """Drop cases beyond ``cap``: lowest posterior success rate first, then least recently
    refined, then oldest; their arms go with them. Returns the evicted cases."""
    if len(cases) <= cap:
        return []
    ranked = sorted(cases, key=lambda c: (success_rate(c), int(c["refined"]), int(c["id"])))
    gone = ranked[:len(cases) - cap]
    ids = {int(c["id"]) for c in gone}
    cases[:] = [c for c in cases if int(c["id"]) not in ids]
    for i in ids:
        arms.pop(i, None)
    return gone


# ---------------------------------------------------------------- state


def state_of(run: Run) -> dict[str, Any]:
    state = run.state.get(NAME)
    if state is None:
        state = run.state[NAME] = {"cases": [], "arms": {}, "next_id": 0, "steps": 0,
                                   "added": 0, "refined": 0, "evicted": 0, "shown": 0,
                                   "log": []}
    return state


def dim_of(s: Settings) -> int:
    return BASE_FEATURES + s.hash_dims


def add_case(state: dict[str, Any], task: str, solution: str, outcome: float, step: int,
             s: Settings) -> str:
    """Refine the case with the same solution and a task at least ``dedup`` similar, or add a
    new one with a fresh arm. Returns ``"refined"`` or ``"added"``."""
    twins = [c for c in state["cases"] if c["solution"] == solution
             and similarity(task, c["task"]) >= s.dedup]
    if twins:
        twin = max(twins, key=lambda c: (similarity(task, c["task"]), int(c["id"])))
        twin["count"] += 1
        twin["outcome"] += (outcome - twin["outcome"]) / twin["count"]
        twin["refined"] = step
        return "refined"
    cid = int(state["next_id"])
    state["next_id"] += 1
    state["cases"].append({"id": cid, "task": task, "solution": solution, "outcome": outcome,
                           "count": 1, "shown": 0, "wins": 0, "born": step, "refined": step})
    state["arms"][cid] = new_arm(dim_of(s), s.ridge)
    return "added"


# ---------------------------------------------------------------- the hooks' work


def with_cases(run: Run, step: int, prompts: list[Prompt]) -> list[Prompt]:
    """Each prompt rebuilt by the env with its chosen case appended to ``component``; each
    carries ``info["cascade"]``: the case shown, the candidates and the chosen features."""
    s = run.settings(NAME)
    state = state_of(run)
    cases, arms = list(state["cases"]), state["arms"]  # snapshot: evolve may edit the list
    rendered: dict[int, list[Prompt]] = {}
    out = []
    for i, p in enumerate(prompts):
        task = cut(user_text(p), s.text_chars)
        case, cands, x = choose(task, cases, arms, step, s)
        record = {"case": None if case is None else int(case["id"]), "features": x,
                  "task": task,
                  "candidates": [{"id": int(c["id"]), "solution": c["solution"]}
                                 for c in cands]}
        q = p
        if case is not None:
            cid = int(case["id"])
            if cid not in rendered:
                base = run.harness.get(s.component, "")
                harness = {**run.harness,
                           s.component: f"{base}\n\n{render(case, s.header)}".strip()}
                with rendering(run, NAME):
                    rendered[cid] = prompts_under(run, harness, [step])[step]
            q = rendered[cid][i]
        out.append(Prompt(messages=q.messages, answer=q.answer, id=q.id,
                          info={**q.info, NAME: record}))
    return out


def evolve(run: Run, batch: RolloutBatch) -> None:
    s = run.settings(NAME)
    state = state_of(run)
    if batch.rewards is None:
        loop.score(run, batch)
    values = metric_values(batch, s.metric, NAME)
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(batch.group.tolist()):
        groups.setdefault(int(g), []).append(row)
    by_id = {int(c["id"]): c for c in state["cases"]}
    shown_rewards, counts = [], {"added": 0, "refined": 0}
    for rows in groups.values():
        meta = batch.prompts[rows[0]].info.get(NAME) or {}
        reward = mean([values[r] for r in rows])
        cid = meta.get("case")
        if cid is not None and int(cid) in by_id:  # evicted since it was shown: nothing to credit
            update_arm(state["arms"][int(cid)], meta["features"], reward)
            case = by_id[int(cid)]
            case["shown"] += 1
            case["wins"] += int(reward >= s.success_threshold)
            shown_rewards.append(reward)
        best = max(rows, key=lambda r: (values[r], -r))
        if values[best] >= s.success_threshold:
            task = meta.get("task") or cut(user_text(batch.prompts[best]), s.text_chars)
            kind = add_case(state, task, cut(batch.texts[best].strip(), s.text_chars),
                            values[best], run.step, s)
            counts[kind] += 1
    gone = evict(state["cases"], state["arms"], s.max_cases)
    state["added"] += counts["added"]
    state["refined"] += counts["refined"]
    state["evicted"] += len(gone)
    state["shown"] += len(shown_rewards)
    state["steps"] += 1
    last = {"accuracy": mean(values), "shown_reward": mean(shown_rewards),
            "cases": float(len(state["cases"])), "added": float(counts["added"]),
            "refined": float(counts["refined"]), "evicted": float(len(gone))}
    state["log"].append({"step": run.step, **last})
    del state["log"][:-50]
    for k, v in last.items():
        run.log(f"{NAME}/{k}", v)


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    state_of(run)


@rlmix.hookimpl(wrapper=True)
def rlmix_prompts(run: Run, step: int) -> Generator[None, Any, Any]:
    prompts = yield
    if not prompts or inside_rendering(run, NAME):
        return prompts
    return with_cases(run, int(step), list(prompts))


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    evolve(run, batch)
    return None  # the harness is unchanged: the case is added per prompt


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if state:
        metrics[f"{NAME}/memory"] = len(state["cases"])
        metrics[f"{NAME}/evicted_total"] = state["evicted"]
