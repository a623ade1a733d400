"""Envs for testing rollout-allocation plugins (``rlmix_sample`` wrappers and owners that decide
which prompts get rollouts and how many) at an exactly counted rollout budget: ``KnownRateEnv``
(known per-task success rates, no model) and ``ToyPolicyEnv`` (completions sampled from a
trainable ``ToyPolicy``, with ``toy_policy_loop`` to train it through the run's hooks)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

import rlmix
from rlmix import loop, ops
from rlmix.testing import ToyPolicy
from rlmix.types import GenerationRequest, Minibatch, Normalizers, Prompt, RolloutBatch, Run


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


class ToyPolicyEnv:
    """One-token prompts answered by a ``ToyPolicy`` (sampled at the requested temperature);
    ``reward_fn(batch) -> {term: tensor}`` scores; ``generated`` counts completions."""

    def __init__(self, policy: ToyPolicy, reward_fn: Callable[[RolloutBatch], dict[str, Any]],
                 seed: int = 0) -> None:
        self.policy, self.reward_fn = policy, reward_fn
        self.gen = torch.Generator().manual_seed(seed)
        self.generated = 0

    @rlmix.hookimpl
    def rlmix_prompts(self, run: Run, step: int) -> list[Prompt]:
        return [Prompt(messages=[{"role": "user", "content": f"p{i}"}], answer=i)
                for i in range(int(run.config.train.prompts_per_step))]

    @rlmix.hookimpl
    def rlmix_generate(self, run: Run, request: GenerationRequest) -> RolloutBatch:
        pol, t = self.policy, max(float(request.temperature), 1e-4)
        n = len(request.prompts) * request.n
        with torch.no_grad():
            logp = torch.log_softmax(pol.logits / t, -1)
            draws = torch.multinomial(logp.exp().repeat(n, 1), 1, generator=self.gen).view(n, -1)
            behavior = torch.cat([torch.zeros(n, 1), logp.gather(-1, draws.T).T], 1)
        self.generated += n
        length = pol.length
        cmask = torch.cat([torch.zeros(n, 1), torch.ones(n, length)], 1)
        return RolloutBatch(
            group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
            tokens=torch.cat([torch.zeros(n, 1, dtype=torch.long), draws], 1),
            attention_mask=torch.ones(n, length + 1, dtype=torch.long), completion_mask=cmask,
            behavior_logp=behavior * cmask,
            policy_version=torch.full((n,), run.policy_version, dtype=torch.long),
            texts=[" ".join(map(str, row)) for row in draws.tolist()],
            prompts=[p for p in request.prompts for _ in range(request.n)])

    @rlmix.hookimpl
    def rlmix_score(self, run: Run, batch: RolloutBatch) -> dict[str, Any]:
        return self.reward_fn(batch)


def toy_policy_loop(run: Run, env: ToyPolicyEnv, steps: int, lr: float = 0.1,
                    on_batch: Callable[[RolloutBatch], None] | None = None) -> None:
    """Train ``env.policy`` through the run's hooks: ``run.sample`` (so sample wrappers apply),
    the core's scoring, ``rlmix_advantage``, ``rlmix_clip``; Adam on the toy's logits."""
    opt = torch.optim.Adam(env.policy.parameters(), lr=lr)
    for step in range(steps):
        run.step = step
        batch = run.sample(run.hook.rlmix_prompts(run=run, step=step))
        loop.score(run, batch)
        if on_batch is not None:
            on_batch(batch)
        batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
        logp, entropy = env.policy.logprobs(batch)
        norm = Normalizers(tokens=float(batch.completion_mask.sum()), sequences=float(len(batch)),
                           norm_constant=float(env.policy.length))
        terms = run.hook.rlmix_clip(run=run, mb=Minibatch(batch=batch, normalizers=norm),
                                    logp=logp, entropy=entropy)
        loss = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, norm)
        opt.zero_grad()
        loss.backward()
        opt.step()


def sample_steps(run: Run, env: Any, steps: int) -> list[tuple[int, list[bool], RolloutBatch]]:
    """Sample and score ``steps`` steps through ``run.sample`` (every sampling wrapper applies);
    per step: ``(completions generated, flat_groups, batch)``."""
    rows = []
    for step in range(steps):
        run.step = step
        before = env.generated
        batch = run.sample(run.hook.rlmix_prompts(run=run, step=step))
        loop.score(run, batch)
        rows.append((env.generated - before, flat_groups(batch), batch))
    return rows
