"""Tests of GRPO-RoC: the quality measure and the down-sampling rule by hand, the wrapper's
over-sampling and budget, settings checks, and the claim: trained with outcome-only reward at
the same number of generated rollouts, RoC's responses are correct *and* clean more often than
GRPO's (a higher full reward per rollout)."""

from __future__ import annotations

import pytest
import rlmix_roc
import torch
from rlmix_roc import quality, resample_on_correct

import rlmix
from rlmix.testing import ToyPolicy, make_run
from rlmix.testing.allocation import ToyPolicyEnv as ToyEnv
from rlmix.testing.allocation import toy_policy_loop as toy_loop
from rlmix.types import Prompt


def test_quality_sums_terms_and_subtracts_info_penalties():
    terms = {"env.clean": torch.tensor([1.0, 0.0, 2.0])}
    info = [{"tool_errors": 2}, {}, {"tool_errors": 1, "format_errors": 1}]
    q = quality(terms, info, ["env.clean"], ["tool_errors", "format_errors"])
    assert q.tolist() == [-1.0, 0.0, 0.0]
    with pytest.raises(rlmix.ConfigError, match="quality_terms"):
        quality(terms, info, ["env.missing"], [])


def test_resample_on_correct_keeps_failures_in_proportion_and_the_cleanest_successes():
    correct = torch.tensor([True, True, True, True, False, False, True, True])
    q = torch.tensor([-3.0, 0.0, -1.0, -2.0, 0.0, 0.0, -5.0, 0.0])
    kept = resample_on_correct(correct, q, 4, torch.Generator().manual_seed(0))
    assert len(kept) == 4
    wrong = [i for i in kept if not correct[i]]
    right = [i for i in kept if correct[i]]
    assert len(wrong) == 1  # round(4 * 2 / 8)
    assert sorted(right) == [1, 2, 7]  # the three best qualities (0, 0, -1)


def test_resample_on_correct_fills_a_short_side_and_keeps_small_groups_whole():
    correct = torch.tensor([False] * 7 + [True])
    kept = resample_on_correct(correct, torch.zeros(8), 4, torch.Generator().manual_seed(1))
    assert 7 in kept and len(kept) == 4  # round(4*7/8) = 4 failures, but the success stays
    correct = torch.tensor([False] * 6 + [True] * 2)
    kept = resample_on_correct(correct, torch.tensor([0.0] * 6 + [1.0, 0.0]), 4)
    assert kept[-1] == 6 and len(kept) == 4  # 3 failures and the better success
    all_right = resample_on_correct(torch.ones(4, dtype=torch.bool), torch.tensor(
        [3.0, 1.0, 2.0, 0.0]), 2)
    assert all_right == [0, 2]
    assert resample_on_correct(torch.ones(3, dtype=torch.bool), torch.zeros(3), 4) == [0, 1, 2]


def test_failures_are_kept_uniformly():
    correct = torch.tensor([False] * 4 + [True] * 4)
    counts = torch.zeros(4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):
        for i in resample_on_correct(correct, torch.zeros(8), 4, gen):
            if i < 4:
                counts[i] += 1
    assert counts.sum() == 2000 * 2 and (counts / 1000 - 1).abs().max() < 0.1


def _reward(batch):
    draws = batch.tokens[:, 1:]
    correct = (draws[:, 0] == 1).float()
    errors = (draws[:, 1:] == 0).sum(-1).float()
    for row, e in zip(batch.info, errors.tolist()):
        row["tool_errors"] = e
    return {"correct": correct, "clean": (errors == 0).float()}


def _run(env, roc=True, group_size=4, overrides=()):
    plugins = {"env": env, "grpo": pytest.importorskip("rlmix_grpo")}  # the baseline
    if roc:
        plugins["roc"] = rlmix_roc
    return make_run(plugins, ["train.prompts_per_step=4", f"train.group_size={group_size}",
                              "score.weights.env.clean=0", *overrides])


def test_wrapper_oversamples_and_cuts_groups_back():
    env = ToyEnv(ToyPolicy(vocab=6, length=4), _reward)
    run = _run(env)
    batch = run.sample(run.hook.rlmix_prompts(run=run, step=0))
    assert env.generated == 4 * 8 == run.state["roc"]["rollouts"]
    assert len(batch) == 16 and torch.bincount(batch.group).tolist() == [4, 4, 4, 4]
    stats = run.pending_metrics
    assert stats["roc/correct_quality_kept"] >= stats["roc/correct_quality_all"]


@pytest.mark.parametrize("override", ["roc.oversample=0"])
def test_bad_settings_are_rejected_naming_the_setting(override):
    with pytest.raises(rlmix.ConfigError, match="oversample"):
        _run(ToyEnv(ToyPolicy(), _reward), overrides=[override])


def test_claim_cleaner_correct_responses_and_more_full_reward_per_rollout_than_grpo():
    steps = 60
    results = {}
    for name, roc, group_size in (("grpo", False, 8), ("roc", True, 4)):
        torch.manual_seed(0)
        env = ToyEnv(ToyPolicy(vocab=6, length=4), _reward, seed=0)
        run = _run(env, roc=roc, group_size=group_size)
        full = []
        toy_loop(run, env, steps, lr=0.1,
                 on_batch=lambda b, full=full: full.append(float(
                     (b.reward_terms["env.correct"] * b.reward_terms["env.clean"]).mean())))
        generated = env.generated
        if roc:
            assert run.state["roc"]["rollouts"] == generated
        probe = env.rlmix_generate(run, rlmix.GenerationRequest(
            prompts=[Prompt(messages=[])], n=4000, temperature=1.0))
        terms = _reward(probe)
        results[name] = (generated, float((terms["correct"] * terms["clean"]).mean()),
                         float(1 - terms["clean"][terms["correct"] > 0].mean()))
    assert results["grpo"][0] == results["roc"][0] == steps * 32  # equal generated budget
    # both learn the answer; only RoC learns to make no tool errors on the way
    assert results["roc"][2] < 0.5 * results["grpo"][2]  # errors among correct responses
    assert results["roc"][1] > results["grpo"][1] + 0.15  # full reward per rollout
