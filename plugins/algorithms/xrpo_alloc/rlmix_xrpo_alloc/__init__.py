"""XRPO's rollout allocator (exploration side) as an ``rlmix_sample`` wrapper.

The owner samples ``train.group_size`` rollouts per prompt; the rest of the step's budget
(``prompts_per_step * budget_per_prompt``) is handed out ``chunk`` at a time, each chunk to the
prompt whose success-rate estimate would shrink the most: the drop of the confidence-interval
half-width ``z * s * (1/sqrt(n) - 1/sqrt(n + chunk))``, with ``s`` the Bernoulli standard
deviation at the posterior mean and ``n`` the prompt's effective sample count (this step's
rollouts plus decayed history from ``run.state["xrpo_alloc"]``).

``allocate_by_gain`` (the greedy allocator) lives in ``rlmix.sampling``, shared with
``trace_alloc``.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import rlmix
from rlmix.sampling import (
    allocate_by_gain,
    count_rollouts,
    generate,
    pad_id,
    prompt_key,
    regroup,
    score,
)
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "xrpo_alloc"
MAX_HISTORY = 100_000  # prompts remembered (least recently seen forgotten first)


@dataclass
class Settings:
    budget_per_prompt: int = 0  # rollouts per step / prompts_per_step; 0 = 2 * group_size
    chunk: int = 2  # extra rollouts handed out at a time
    z: float = 1.96  # the interval's normal quantile
    history_decay: float = 0.9  # weight of a prompt's past outcomes each time it comes back
    threshold: float = 0.5  # a rollout succeeds when its reward is above this
    key: str = "text"  # prompt identity: "text" or "id"

    def __post_init__(self) -> None:
        if self.budget_per_prompt < 0:
            raise ValueError(f"budget_per_prompt must be >= 0, got {self.budget_per_prompt}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.z <= 0:
            raise ValueError(f"z must be > 0, got {self.z}")
        if not 0.0 <= self.history_decay <= 1.0:
            raise ValueError(f"history_decay must be in [0, 1], got {self.history_decay}")
        if self.key not in ("text", "id"):
            raise ValueError(f"key must be 'text' or 'id', got {self.key!r}")


def interval_shrink(wins: float, n: float, c: int, z: float = 1.96) -> float:
    """``z * s * (1/sqrt(n) - 1/sqrt(n + c))``: how much ``c`` more rollouts narrow the
    confidence interval of a success rate seen ``wins`` times in ``n`` (``s`` at the Beta(1, 1)
    posterior mean, so a never-seen or all-same prompt still has a positive spread)."""
    p = (wins + 1.0) / (n + 2.0)
    s = math.sqrt(p * (1.0 - p))
    n = max(n, 1e-9)
    return z * s * (1.0 / math.sqrt(n) - 1.0 / math.sqrt(n + c))


def _state(run: Run) -> dict[str, Any]:
    return run.state.setdefault(NAME, {"rollouts": 0, "history": {}, "extra": {}})


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    _state(run)


@rlmix.hookimpl(wrapper=True)
def rlmix_sample(run: Run, prompts: list[Prompt]
                 ) -> Generator[None, RolloutBatch, RolloutBatch]:
    first = yield
    s: Settings = run.settings(NAME)
    state = _state(run)
    k = int(run.config.train.group_size)
    budget = len(prompts) * (s.budget_per_prompt or 2 * k)
    keys = [prompt_key(p, s.key) for p in first.prompts]
    ok = (score(run, first) > s.threshold).tolist()
    order = list(dict.fromkeys(keys))
    by_key = dict(zip(keys, first.prompts))
    wins = {key: 0.0 for key in order}
    seen = {key: 0.0 for key in order}
    for key, o in zip(keys, ok):
        wins[key] += o
        seen[key] += 1
    past = {key: state["history"].get(key, (0.0, 0.0)) for key in order}
    eff_w = [wins[q] + s.history_decay * past[q][0] for q in order]
    eff_n = [seen[q] + s.history_decay * past[q][1] for q in order]
    extra = allocate_by_gain(
        lambda i, e: interval_shrink(eff_w[i], eff_n[i] + e, s.chunk, s.z),
        len(order), budget - len(first), s.chunk)
    parts, row_keys = [first], list(keys)
    for q, e in zip(order, extra):
        if e > 0:
            part = generate(run, [by_key[q]], e)
            part_ok = (score(run, part) > s.threshold).tolist()
            wins[q] += sum(part_ok)
            seen[q] += len(part)
            parts.append(part)
            row_keys += [q] * len(part)
    for q in order:  # decayed history + this step (most recent last, bounded)
        state["history"].pop(q, None)
        state["history"][q] = (s.history_decay * past[q][0] + wins[q],
                               s.history_decay * past[q][1] + seen[q])
    while len(state["history"]) > MAX_HISTORY:
        state["history"].pop(next(iter(state["history"])))
    generated = sum(len(p) for p in parts)
    count_rollouts(run, NAME, generated)
    state["extra"] = dict(zip(order, extra))
    stats = {
        "xrpo_alloc/rollouts": float(generated),
        "xrpo_alloc/extra_rollouts": float(sum(extra)),
        "xrpo_alloc/max_extra": float(max(extra) if extra else 0)}
    for key, value in stats.items():  # written with the step's metrics
        run.log(key, value)
    return regroup(parts, row_keys, pad_id(run))
