"""AR3PO (Adaptive Rollout and Response Reuse Policy Optimization) as an ``rlmix_sample``
wrapper.

* **Adaptive rollout.** The owner samples ``train.group_size`` responses per prompt (stage 1).
  Prompts with no successful response yet get another ``group_size`` responses, stage after
  stage, up to ``stages`` stages; prompts already solved stop. The step's budget is
  ``prompts_per_step * budget_per_prompt`` rollouts; what the solved prompts save goes to new
  prompts from ``rlmix_prompts`` (negative step keys), so the budget is spent exactly.
* **Response reuse.** A correct response of every prompt is cached in ``run.state["ar3po"]``;
  a group that is still all-wrong after its stages gets its prompt's cached correct response
  added (not generated, so not counted in the budget), which gives it a non-zero advantage.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.sampling import count_rollouts, generate, pad_id, prompt_key, regroup, score
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "ar3po"
KEY_OFFSET = 3_000_000  # extra prompts of step s, round r come from step -(OFFSET + s*1000 + r)


@dataclass
class Settings:
    budget_per_prompt: int = 0  # rollouts per step / prompts_per_step; 0 = 2 * group_size
    stages: int = 2  # at most this many stages of group_size rollouts for one prompt
    threshold: float = 0.5  # a response is correct when its reward is above this
    reuse: bool = True  # add a cached correct response to groups that stay all-wrong
    new_prompts: bool = True  # spend what solved prompts save on new prompts
    max_cached_prompts: int = 10000  # the cache forgets the least recently used beyond this
    key: str = "text"  # prompt identity for the cache: "text" or "id"

    def __post_init__(self) -> None:
        if self.budget_per_prompt < 0:
            raise ValueError(f"budget_per_prompt must be >= 0, got {self.budget_per_prompt}")
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")
        if self.max_cached_prompts < 0:
            raise ValueError("max_cached_prompts must be >= 0")
        if self.key not in ("text", "id"):
            raise ValueError(f"key must be 'text' or 'id', got {self.key!r}")


def next_stage(wins: dict[str, int], stages: dict[str, int], max_stages: int, stage_size: int,
               remaining: int) -> list[tuple[str, int]]:
    """The next adaptive-rollout stage: ``[(key, n)]`` for the prompts with no success yet and
    fewer than ``max_stages`` stages, ``stage_size`` each (in order) while ``remaining`` lasts."""
    out = []
    for k, w in wins.items():
        if remaining <= 0:
            break
        if w == 0 and stages[k] < max_stages:
            n = min(stage_size, remaining)
            out.append((k, n))
            remaining -= n
    return out


def reuse_rows(wins: dict[str, int], cache: dict[str, Any]) -> list[str]:
    """Keys of the groups that are all-wrong and have a cached correct response."""
    return [k for k, w in wins.items() if w == 0 and k in cache]


def _state(run: Run) -> dict[str, Any]:
    return run.state.setdefault(NAME, {"rollouts": 0, "cache": {}, "reused": 0,
                                       "groups": 0, "zero_adv_groups": 0})


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s: Settings = run.settings(NAME)
    if s.budget_per_prompt and s.budget_per_prompt < int(run.config.train.group_size):
        raise rlmix.ConfigError(f"ar3po.budget_per_prompt ({s.budget_per_prompt}) is below "
                                f"train.group_size ({run.config.train.group_size})")
    _state(run)


def _flat(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    g = int(group.max()) + 1
    r = rewards.double()
    hi = torch.full((g,), -torch.inf, dtype=torch.float64).scatter_reduce(0, group, r, "amax")
    lo = torch.full((g,), torch.inf, dtype=torch.float64).scatter_reduce(0, group, r, "amin")
    return (hi - lo) <= 1e-8


@rlmix.hookimpl(wrapper=True)
def rlmix_sample(run: Run, prompts: list[Prompt]
                 ) -> Generator[None, RolloutBatch, RolloutBatch]:
    first = yield
    s: Settings = run.settings(NAME)
    state = _state(run)
    k = int(run.config.train.group_size)
    budget = len(prompts) * (s.budget_per_prompt or 2 * k)
    parts, keys = [first], [prompt_key(p, s.key) for p in first.prompts]
    ok = score(run, first) > s.threshold
    wins: dict[str, int] = {}
    stages: dict[str, int] = {}
    by_key: dict[str, Prompt] = {}
    for key, p, o in zip(keys, first.prompts, ok.tolist()):
        wins[key] = wins.get(key, 0) + int(o)
        stages[key] = 1
        by_key.setdefault(key, p)
    correct: dict[str, RolloutBatch] = {}

    def remember(part: RolloutBatch, part_keys: list[str], part_ok: torch.Tensor) -> None:
        for i, (key, o) in enumerate(zip(part_keys, part_ok.tolist())):
            if o:
                correct[key] = part.select([i])

    remember(first, keys, ok)
    remaining = budget - len(first)
    stats = {"stage_rollouts": 0, "new_prompt_rollouts": 0}
    rounds = 0
    while remaining > 0:
        plan = next_stage(wins, stages, s.stages, k, remaining)
        kind = "stage_rollouts"
        if not plan and s.new_prompts and remaining >= 2:
            rounds += 1
            fresh = run.hook.rlmix_prompts(
                run=run, step=-(KEY_OFFSET + run.step * 1000 + rounds)) or []
            plan = []
            for p in fresh:
                key = prompt_key(p, s.key)
                if key in wins or remaining <= 0:
                    continue
                n = min(k, remaining)
                if n < 2:
                    break
                by_key[key], wins[key], stages[key] = p, 0, 0
                plan.append((key, n))
                remaining -= n
            remaining += sum(n for _, n in plan)
            kind = "new_prompt_rollouts"
            if not plan and rounds < 8:
                continue
        if not plan:  # nothing left to spend on: the first prompt's group takes the rest
            plan = [(next(iter(wins)), remaining)]
        for key, n in plan:
            part = generate(run, [by_key[key]], n)
            part_keys = [key] * len(part)
            part_ok = score(run, part) > s.threshold
            remember(part, part_keys, part_ok)
            parts.append(part)
            keys.extend(part_keys)
            wins[key] += int(part_ok.sum())
            stages[key] += 1
            remaining -= len(part)
            stats[kind] += len(part)
    generated = sum(len(p) for p in parts)
    count_rollouts(run, NAME, generated)
    cache = state["cache"]
    reused = 0
    if s.reuse:
        for key in reuse_rows(wins, cache):
            row = cache[key]
            row.group = torch.zeros(1, dtype=torch.long)
            row.rewards, row.reward_terms, row.advantages = None, {}, None
            parts.append(row)
            keys.append(key)
            reused += 1
    for key, row in correct.items():  # the newest correct response of every solved prompt
        cache.pop(key, None)
        cache[key] = row
    while len(cache) > s.max_cached_prompts:
        cache.pop(next(iter(cache)))
    batch = regroup(parts, keys, pad_id(run))
    rewards = score(run, batch)
    flat = _flat(rewards, batch.group)
    state["reused"] += reused
    state["groups"] += len(flat)
    state["zero_adv_groups"] += int(flat.sum())
    stats = {
        "ar3po/rollouts": float(generated), "ar3po/reused": float(reused),
        "ar3po/stage_rollouts": float(stats["stage_rollouts"]),
        "ar3po/new_prompt_rollouts": float(stats["new_prompt_rollouts"]),
        "ar3po/groups": float(len(flat)), "ar3po/zero_adv_groups": float(flat.sum())}
    for key, value in stats.items():  # written with the step's metrics
        run.log(key, value)
    return batch
