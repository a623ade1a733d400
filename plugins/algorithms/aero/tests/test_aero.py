"""Tests of the AERO plugin: the Beta-binomial math by hand and by numerical integration, the
allocation rule, selective rejection, the sampling wrapper on a synthetic env whose prompts have
known success rates, checkpointing of the posteriors, and the paper's claim (fewer rollouts
wasted on zero-advantage groups than GRPO at the same rollout budget)."""

from __future__ import annotations

import math
import random

import pytest
import rlmix_aero
import torch
from rlmix_aero import (
    all_same_probability,
    break_probability,
    dead_groups,
    flat_groups,
    next_allocation,
    pool_keys,
    prompt_key,
    prune_rows,
    select_prompts,
)

import rlmix
from rlmix import checkpoint
from rlmix.loop import score
from rlmix.testing import make_run
from rlmix.types import Prompt, RolloutBatch

# ---------------------------------------------------------------- Beta-binomial math


def _integrated_all_same(a, b, n, steps=200_000):
    # E_p[p^n + (1-p)^n] under Beta(a, b), by the midpoint rule
    p = (torch.arange(steps, dtype=torch.float64) + 0.5) / steps
    log_pdf = ((a - 1) * p.log() + (b - 1) * (1 - p).log()
               - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)))
    return float((log_pdf.exp() * (p**n + (1 - p) ** n)).mean())


def test_all_same_probability_by_hand():
    # uniform prior: P(k) = 1/(n+1) for every k, so P(k in {0, n}) = 2/(n+1)
    assert all_same_probability(1, 1, 8) == pytest.approx(2 / 9)
    # Beta(2, 1), n=2: P(k=0) = B(2,3)/B(2,1) = (1/12)/(1/2) = 1/6, P(k=2) = B(4,1)/B(2,1) = 1/2
    assert all_same_probability(2, 1, 2) == pytest.approx(1 / 6 + 1 / 2)
    # after 8 successes from a uniform prior: P(8 more successes) = 9/17, P(8 failures) tiny
    assert all_same_probability(9, 1, 8) == pytest.approx(9 / 17 + math.exp(
        math.lgamma(9) + math.lgamma(9) - math.lgamma(18) - math.lgamma(9) - math.lgamma(1)
        + math.lgamma(10)))
    assert all_same_probability(3, 4, 1) == 1.0  # one rollout is always "all the same"


@pytest.mark.parametrize("a, b, n", [(1.0, 1.0, 4), (1.5, 1.2, 8), (3.0, 7.0, 8),
                                     (20.0, 2.0, 16), (2.5, 2.5, 2)])
def test_all_same_probability_matches_numerical_integration(a, b, n):
    assert all_same_probability(a, b, n) == pytest.approx(_integrated_all_same(a, b, n),
                                                          rel=1e-4)


def test_all_same_probability_falls_with_group_size_and_with_mixed_evidence():
    assert all_same_probability(1, 1, 16) < all_same_probability(1, 1, 8)
    assert all_same_probability(5, 5, 8) < all_same_probability(1, 1, 8)  # seen 4 of 8
    assert all_same_probability(1, 9, 8) > 0.5  # seen 0 of 8


def test_break_probability_by_hand():
    # all-wrong group, Beta(1, 9): P(2 more failures) = 9/10 * 10/11 = 9/11
    assert break_probability(1, 9, 2, all_correct=False) == pytest.approx(2 / 11)
    # all-correct group, Beta(9, 1): P(2 more successes) = 9/11 too
    assert break_probability(9, 1, 2, all_correct=True) == pytest.approx(2 / 11)
    # Beta(2, 3), one more rollout: P(success) = 2/5
    assert break_probability(2, 3, 1, all_correct=False) == pytest.approx(2 / 5)
    assert break_probability(2, 3, 1, all_correct=True) == pytest.approx(3 / 5)
    assert break_probability(2, 3, 0, all_correct=True) == 0.0


# ---------------------------------------------------------------- selection and allocation


def test_select_prompts_keeps_pool_order_without_evidence_and_skips_known_dead_ones():
    assert select_prompts([(1, 1)] * 6, 3, 8) == [0, 1, 2]
    # candidate 0 was all-correct before, 1 all-wrong, 4 was mixed: 4 first, then unknowns
    posteriors = [(9, 1), (1, 9), (1, 1), (1, 1), (5, 5), (1, 1)]
    assert select_prompts(posteriors, 3, 8) == [2, 3, 4]
    assert select_prompts(posteriors, 1, 8) == [4]


def test_next_allocation_rescues_the_likeliest_tie_breaker_first():
    # groups (a, b, successes, count); group 0 mixed, 1 all-wrong (fresh), 2 all-wrong (hopeless)
    groups = [(5, 5, 4, 8), (1, 9, 0, 8), (1, 41, 0, 40)]
    action = next_allocation(groups, [(1, 1)], remaining=6, group_size=8, chunk=2,
                             min_break=0.1, reject_above=0.5)
    assert action == ("rescue", 1, 2)  # 2/11 = 0.18 beats 2/43
    # the chunk shrinks to what is left
    assert next_allocation(groups, [], 1, 8, 2, 0.1, 0.5) == ("rescue", 1, 1)


def test_next_allocation_starts_a_new_group_when_no_rescue_is_likely_enough():
    groups = [(5, 5, 4, 8), (1, 41, 0, 40)]  # the all-wrong one: P(break) = 2/43 < 0.1
    cands = [(1, 9), (1, 1), (5, 5)]
    # the candidate least likely to be all-same (the mixed one, index 2) with a whole group
    assert next_allocation(groups, cands, 12, 8, 2, 0.1, 0.5) == ("new", 2, 8)
    # fewer than a group left: a smaller group
    assert next_allocation(groups, cands, 3, 8, 2, 0.1, 0.5) == ("new", 2, 3)
    # only known-dead candidates are left: extend the smallest group instead
    assert next_allocation(groups, [(1, 30), (30, 1)], 6, 8, 2, 0.1, 0.5) == ("extend", 0, 6)
    # one rollout left, no rescue worth it: it extends the smallest group
    assert next_allocation(groups, cands, 1, 8, 2, 0.1, 0.5) == ("extend", 0, 1)
    assert next_allocation([], [], 4, 8, 2, 0.1, 0.5) is None
    assert next_allocation(groups, cands, 0, 8, 2, 0.1, 0.5) is None


def test_dead_groups_and_prune_rows_by_hand():
    success = torch.tensor([1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 0], dtype=torch.bool)
    group = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3])
    # group 0: 1 of 6 (mixed), 1: all correct, 2: all wrong, 3: 2 of 3
    assert dead_groups(success, group).tolist() == [False, True, True, False]
    keep = prune_rows(success, group, k=2.0, generator=torch.Generator().manual_seed(0))
    # group 0 keeps its success and ceil(2 * 1) = 2 of its 5 failures; nothing else changes
    assert bool(keep[0])
    assert int(keep[1:6].sum()) == 2
    assert keep[6:].all()
    assert int(prune_rows(success, group, k=0.1).sum()) == 15 - 4  # max(1, ceil(0.1)) = 1
    assert prune_rows(success, group, k=0.0).all()


def test_flat_groups_by_hand():
    rewards = torch.tensor([1.0, 1.0, 0.5, 0.5, 0.2, 0.3, 7.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert flat_groups(rewards, group).tolist() == [True, True, False, True]


def test_pool_keys_are_negative_and_never_repeat_across_steps():
    seen = set()
    for step in range(50):
        keys = pool_keys(step, 3)
        assert len(keys) == 2 and all(k < 0 for k in keys)
        assert not seen & set(keys)
        seen |= set(keys)
    assert pool_keys(7, 1) == []


def test_prompt_key_uses_text_or_id():
    p = Prompt(messages=[{"role": "user", "content": "1+1?"}], id="train-3-0")
    q = Prompt(messages=[{"role": "user", "content": "1+1?"}], id="train-9-2")
    assert prompt_key(p, "text") == prompt_key(q, "text")
    assert prompt_key(p, "id") != prompt_key(q, "id")
    assert prompt_key(Prompt(messages=p.messages), "id") == prompt_key(p, "text")


# ---------------------------------------------------------------- a synthetic env


class SyntheticEnv:
    """Prompts ``task i`` with known success rates ``rates[i]``; a completion is "1" (success)
    with that probability. Real steps walk the task list in order (epochs); negative step keys
    (AERO's extra candidates) draw a seeded random subset."""

    def __init__(self, rates, seed=0):
        self.rates = rates
        self.gen = torch.Generator().manual_seed(seed)
        self.generated = 0

    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        size, total = int(run.config.train.prompts_per_step), len(self.rates)
        if step >= 0:
            idx = [(step * size + i) % total for i in range(size)]
        else:
            idx = random.Random(step).sample(range(total), size)
        return [Prompt(messages=[{"role": "user", "content": f"task {i}"}], answer=i,
                       id=f"step{step}-{j}") for j, i in enumerate(idx)]

    @rlmix.hookimpl
    def rlmix_generate(self, run, request):
        n = len(request.prompts) * request.n
        draws = torch.cat([torch.rand(request.n, generator=self.gen) < self.rates[p.answer]
                           for p in request.prompts]).long()
        self.generated += n
        width = 3
        cmask = torch.tensor([[0.0, 1.0, 1.0]]).repeat(n, 1)
        ids = torch.tensor([p.answer for p in request.prompts]).repeat_interleave(request.n)
        return RolloutBatch(
            group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
            tokens=torch.stack([ids, draws, torch.full_like(draws, 9)], 1),
            attention_mask=torch.ones(n, width, dtype=torch.long), completion_mask=cmask,
            behavior_logp=-0.5 * cmask, policy_version=torch.zeros(n, dtype=torch.long),
            texts=["1" if d else "0" for d in draws.tolist()],
            prompts=[p for p in request.prompts for _ in range(request.n)])

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        return {"correct": torch.tensor([float(t == "1") for t in batch.texts])}


# 24 tasks: 8 impossible, 4 trivial, 4 rare (5%), 4 at 30%, 4 at 60%
RATES = [0.0] * 8 + [1.0] * 4 + [0.05] * 4 + [0.3] * 4 + [0.6] * 4
random.Random(0).shuffle(RATES)
BASE = ["train.prompts_per_step=4", "train.group_size=8"]


def _run(env, overrides=(), aero=True, **kw):
    plugins = {"env": env, "aero": rlmix_aero} if aero else {"env": env}
    return make_run(plugins, [*BASE, *overrides], **kw)


def _steps(run, env, steps, start=0):
    """Sample ``steps`` steps; per step: (rollouts generated, groups, dead groups, rollouts in
    dead groups, rows in the batch)."""
    out = []
    for step in range(start, start + steps):
        run.step = step
        before = env.generated
        batch = run.sample(run.hook.rlmix_prompts(run=run, step=step))
        score(run, batch)
        dead = dead_groups(batch.rewards > 0.5, batch.group)
        out.append((env.generated - before, len(dead), int(dead.sum()),
                    int(dead[batch.group].sum()), len(batch), batch))
    return out


def test_wrapper_keeps_the_budget_and_counts_every_outcome_in_the_posterior():
    env = SyntheticEnv(RATES, seed=1)
    run = _run(env, ["aero.drop_dead=false"])
    steps = _steps(run, env, 12)
    state = run.state["aero"]
    wins: dict[str, int] = {}
    total: dict[str, int] = {}
    for generated, _, _, _, rows, batch in steps:
        assert generated == 4 * 8 == rows  # the step budget, exactly, and nothing dropped
        g = batch.group
        assert (g[1:] >= g[:-1]).all()  # groups contiguous
        for p, r in zip(batch.prompts, batch.rewards.tolist()):
            k = prompt_key(p, "text")
            wins[k] = wins.get(k, 0) + int(r > 0.5)
            total[k] = total.get(k, 0) + 1
        assert len({prompt_key(p, "text") for p in batch.prompts}) == batch.num_groups
    for k, n in total.items():
        a, b = state["posterior"][k]
        assert (a - 1, b - 1) == (wins[k], n - wins[k])
    assert state["rollouts"] == 12 * 32 and state["steps"] == 12


def test_without_evidence_and_without_a_reserve_aero_samples_what_grpo_samples():
    overrides = ["aero.rescue_fraction=0", "aero.pool_factor=1", "aero.drop_dead=false"]
    env_a, env_g = SyntheticEnv(RATES, seed=3), SyntheticEnv(RATES, seed=3)
    a = _steps(_run(env_a, overrides), env_a, 1)[0][-1]
    g = _steps(_run(env_g, aero=False), env_g, 1)[0][-1]
    assert a.texts == g.texts and a.group.tolist() == g.group.tolist()
    assert [p.answer for p in a.prompts] == [p.answer for p in g.prompts]


def test_drop_dead_removes_all_same_groups_but_never_empties_the_batch():
    env = SyntheticEnv(RATES, seed=2)
    run = _run(env)
    dropped = 0
    for step in range(6):
        run.step = step
        batch = run.sample(run.hook.rlmix_prompts(run=run, step=step))
        stats = run.pending_metrics  # what aero logged for the step
        assert stats["aero/rollouts"] == 32
        wasted = round(stats["aero/wasted_fraction"] * 32)
        if stats["aero/dead_groups"] < stats["aero/groups"]:
            # binary rewards: the all-same groups are exactly the zero-advantage ones
            assert len(batch) == 32 - wasted
            assert not dead_groups(batch.rewards > 0.5, batch.group).any()
            dropped += wasted
        assert batch.group.tolist() == sorted(batch.group.tolist())
        assert batch.group.max() + 1 == len(batch.group.unique())  # renumbered 0..G-1
    assert dropped > 0
    # everything impossible: every group dead, the batch is kept whole (advantages all zero)
    env = SyntheticEnv([0.0] * 8)
    run = _run(env)
    generated, groups, dead, _, rows, _ = _steps(run, env, 1)[0]
    assert generated == rows == 32 and dead == groups


class ShapedEnv(SyntheticEnv):
    """Adds a second reward term that varies within every group (a shaping term)."""

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        return {"correct": torch.tensor([float(t == "1") for t in batch.texts]),
                "shaping": 0.01 * torch.arange(len(batch), dtype=torch.float32)}


def test_drop_dead_keeps_all_same_success_groups_whose_total_reward_still_varies():
    env = ShapedEnv([0.0, 1.0] * 4, seed=0)
    run = _run(env)
    generated, groups, dead, _, rows, batch = _steps(run, env, 1)[0]
    assert dead == groups > 0  # every group is all-correct or all-wrong ...
    assert rows == generated == 32  # ... but none has a zero advantage: nothing is dropped


def test_prune_k_downsamples_failures_of_low_success_groups():
    env = SyntheticEnv([0.2] * 8, seed=5)
    run = _run(env, ["aero.prune_k=1.0", "aero.rescue_fraction=0", "aero.pool_factor=1"])
    *_, rows, batch = _steps(run, env, 1)[0]
    success = batch.rewards > 0.5
    for g in batch.group.unique().tolist():
        rows_g = batch.group == g
        c, n = int(success[rows_g].sum()), int(rows_g.sum())
        if 0 < c:
            assert n - c <= max(1, c)  # at most ceil(1 * c) failures kept
    assert rows < 32
    assert run.pending_metrics["aero/dropped_samples"] == 32 - rows


def test_the_step_logs_its_metrics_and_the_settings_are_checked():
    env = SyntheticEnv(RATES, seed=0)
    run = _run(env)
    _steps(run, env, 1)
    metrics = run.drain_metrics()  # what the loop writes with the step's line
    assert metrics["aero/rollouts"] == 32.0
    assert metrics["aero/owner_rollouts"] == 24.0  # a quarter of the budget held back
    assert (metrics["aero/rescue_rollouts"] + metrics["aero/new_prompt_rollouts"]
            + metrics["aero/owner_rollouts"]) <= 32.0
    assert 0.0 <= metrics["aero/wasted_fraction"] <= 1.0
    assert all(isinstance(v, float) for v in metrics.values())


@pytest.mark.parametrize("override", [
    "aero.key=hash", "aero.prior_a=0", "aero.pool_factor=0", "aero.rescue_fraction=1.0",
    "aero.rescue_chunk=0", "aero.min_break=2", "aero.reject_above=-1", "aero.prune_k=-1",
    "aero.forget=0", "aero.budget=3",
])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="aero"):
        make_run({"aero": rlmix_aero}, [override])


def test_forget_relaxes_pooled_evidence_toward_the_prior():
    env = SyntheticEnv([0.0] * 4)
    run = _run(env, ["aero.forget=0.5", "aero.pool_factor=1", "train.prompts_per_step=4"])
    key = prompt_key(Prompt(messages=[{"role": "user", "content": "task 0"}]), "text")
    run.state["aero"] = {"posterior": {key: (1.0, 21.0)}, "steps": 0, "rollouts": 0,
                         "dead_groups": 0, "groups": 0}
    run.step = 0
    batch = run.sample(run.hook.rlmix_prompts(run=run, step=0))
    n = sum(prompt_key(p, "text") == key for p in batch.prompts)
    # decayed to (1, 1 + 0.5 * 20) = (1, 11), then every one of its n rollouts failed
    assert run.state["aero"]["posterior"][key] == (1.0, 11.0 + n)


# ---------------------------------------------------------------- checkpointing


def test_posteriors_survive_a_checkpoint_and_the_restored_run_decides_the_same(tmp_path):
    env = SyntheticEnv(RATES, seed=4)
    run = _run(env, with_policy=True)
    run.out_dir = tmp_path
    _steps(run, env, 7)
    run.step = 7
    saved = {k: tuple(v) for k, v in run.state["aero"]["posterior"].items()}
    folder = checkpoint.save(run)
    _steps(run, env, 1, start=7)
    chosen = run.plugin_resources("aero")["selected"]

    fresh = _run(SyntheticEnv(RATES, seed=99), with_policy=True)
    fresh.out_dir = tmp_path
    checkpoint.restore(fresh, folder)
    assert fresh.step == 7
    assert {k: tuple(v) for k, v in fresh.state["aero"]["posterior"].items()} == saved
    assert fresh.state["aero"]["steps"] == 7
    _steps(fresh, fresh.pm.get_plugin("env"), 1, start=7)
    assert fresh.plugin_resources("aero")["selected"] == chosen


# ---------------------------------------------------------------- the claim


@pytest.mark.parametrize("overrides, ratio, late_max", [
    ([], 0.75, 0.35),                        # the defaults: a pool of twice the step's prompts
    (["aero.pool_factor=3"], 0.45, 0.15),    # a wider pool screens out more dead tasks
])
def test_aero_wastes_fewer_rollouts_on_zero_advantage_groups_than_grpo_at_equal_budget(
        overrides, ratio, late_max):
    steps = 36  # six passes over the 24 tasks
    env_g, env_a = SyntheticEnv(RATES, seed=11), SyntheticEnv(RATES, seed=11)
    grpo = _steps(_run(env_g, aero=False), env_g, steps)
    aero = _steps(_run(env_a, ["aero.drop_dead=false", *overrides]), env_a, steps)
    budget_g = sum(s[0] for s in grpo)
    budget_a = sum(s[0] for s in aero)
    assert budget_g == budget_a == steps * 32  # the same total rollout budget

    def summary(rows):
        wasted = sum(s[3] for s in rows) / sum(s[0] for s in rows)
        informative = sum(s[1] - s[2] for s in rows)  # groups with a nonzero advantage
        dead_share = sum(s[2] for s in rows) / sum(s[1] for s in rows)
        return wasted, informative, dead_share

    wasted_g, informative_g, dead_g = summary(grpo)
    wasted_a, informative_a, dead_a = summary(aero)
    # GRPO on this task mix: about 60% of rollouts land in all-same groups, every pass
    assert wasted_g > 0.55 and summary(grpo[24:])[0] > 0.55
    assert wasted_a < ratio * wasted_g
    assert dead_a < ratio * dead_g
    assert informative_a > 1.2 * informative_g
    # once the posteriors have seen the tasks, AERO mostly stops sampling dead ones
    assert summary(aero[24:])[0] < late_max
