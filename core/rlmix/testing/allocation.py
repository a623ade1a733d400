"""A synthetic env with known per-task success rates, for testing rollout-allocation plugins
(``rlmix_sample`` wrappers that decide which prompts get rollouts and how many) at an exactly
counted rollout budget, with no model."""

from __future__ import annotations

import random
from typing import Any

import torch

import rlmix
from rlmix.types import GenerationRequest, Prompt, RolloutBatch, Run


class KnownRateEnv:
    """Tasks ``task i`` with known success rates ``rates[i]``: a completion is ``"1"`` (correct)
    with that probability. It is env, rollout engine and scorer at once (register it as one
    plugin). Real steps walk the task list in order (epochs); negative step keys (the extra
    prompts wrappers ask for) draw a seeded random subset. ``generated`` counts every
    completion, so a test can assert equal rollout budgets."""

    def __init__(self, rates: list[float], seed: int = 0) -> None:
        self.rates = rates
        self.gen = torch.Generator().manual_seed(seed)
        self.generated = 0

    @rlmix.hookimpl
    def rlmix_prompts(self, run: Run, step: int) -> list[Prompt]:
        size, total = int(run.config.train.prompts_per_step), len(self.rates)
        if step >= 0:
            idx = [(step * size + i) % total for i in range(size)]
        else:
            idx = random.Random(step).sample(range(total), size)
        return [Prompt(messages=[{"role": "user", "content": f"task {i}"}], answer=i,
                       id=f"step{step}-{j}") for j, i in enumerate(idx)]

    @rlmix.hookimpl
    def rlmix_generate(self, run: Run, request: GenerationRequest) -> RolloutBatch:
        n = len(request.prompts) * request.n
        draws = torch.cat([torch.rand(request.n, generator=self.gen) < self.rates[p.answer]
                           for p in request.prompts]).long()
        self.generated += n
        cmask = torch.tensor([[0.0, 1.0, 1.0]]).repeat(n, 1)
        ids = torch.tensor([p.answer for p in request.prompts]).repeat_interleave(request.n)
        return RolloutBatch(
            group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
            tokens=torch.stack([ids, draws, torch.full_like(draws, 9)], 1),
            attention_mask=torch.ones(n, 3, dtype=torch.long), completion_mask=cmask,
            behavior_logp=-0.5 * cmask, policy_version=torch.zeros(n, dtype=torch.long),
            texts=["1" if d else "0" for d in draws.tolist()],
            prompts=[p for p in request.prompts for _ in range(request.n)])

    @rlmix.hookimpl
    def rlmix_score(self, run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        return {"correct": torch.tensor([float(t == "1") for t in batch.texts])}


def flat_groups(batch: RolloutBatch) -> list[bool]:
    """Per group: do all its rewards agree (a zero-advantage group)?"""
    assert batch.rewards is not None
    out = []
    for g in range(batch.num_groups):
        r = batch.rewards[batch.group == g]
        out.append(bool((r.max() - r.min()) <= 1e-8))
    return out


def sample_steps(run: Run, env: Any, steps: int) -> list[tuple[int, list[bool], RolloutBatch]]:
    """Sample and score ``steps`` steps through ``run.sample`` (every sampling wrapper applies);
    per step: ``(completions generated, flat_groups, batch)``."""
    from rlmix.loop import score

    rows = []
    for step in range(steps):
        run.step = step
        before = env.generated
        batch = run.sample(run.hook.rlmix_prompts(run=run, step=step))
        score(run, batch)
        rows.append((env.generated - before, flat_groups(batch), batch))
    return rows
