"""Tests of the REINFORCE++ plugin: token rewards, returns-to-go and batch whitening against
hand-computed values, edge cases, the hook with a frozen reference on the tiny-random model,
settings, the paper's claims (global normalisation is not inflated by a near-agreeing group;
the KL enters each token's advantage only through the tokens after it), learning on the toy
task, and parity with verl when it is installed."""

from __future__ import annotations

import math
import statistics

import pytest
import rlmix_reinforce_pp
import torch
from rlmix_reinforce_pp import (
    batch_whiten,
    kl_estimate,
    last_token_index,
    reinforce_pp_advantage,
    returns_to_go,
    token_rewards,
)

import rlmix
from rlmix import ops
from rlmix.testing import ToyPolicy, make_batch, make_run, toy_train
from rlmix.types import LossTerms

# ---------------------------------------------------------------- the pieces


def test_token_rewards_hand_computed_with_ragged_and_empty_rows():
    kl = torch.tensor([[9.0, 1.0, 2.0, 3.0], [9.0, 0.5, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    rewards = torch.tensor([10.0, 20.0, 30.0])
    out = token_rewards(rewards, kl, mask, beta=0.1)
    expected = torch.tensor([[0.0, -0.1, -0.2, -0.3 + 10.0],
                             [0.0, -0.05 + 20.0, 0.0, 0.0],  # a single token: KL and reward
                             [0.0, 0.0, 0.0, 0.0]])          # no tokens: no reward placed
    torch.testing.assert_close(out, expected)
    assert last_token_index(mask).tolist() == [3, 1, 0]


def test_returns_to_go_hand_computed_with_gamma_and_a_masked_gap():
    r = torch.tensor([[0.0, 1.0, 2.0, 100.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]], dtype=torch.float64)  # col 3: tool output
    torch.testing.assert_close(returns_to_go(r, mask, 1.0),
                               torch.tensor([[0.0, 6.0, 5.0, 0.0, 3.0]], dtype=torch.float64))
    # gamma counts completion tokens only: G_4 = 3, G_2 = 2 + .5 * 3, G_1 = 1 + .5 * 3.5
    torch.testing.assert_close(returns_to_go(r, mask, 0.5),
                               torch.tensor([[0.0, 2.75, 3.5, 0.0, 3.0]], dtype=torch.float64))


def test_batch_whiten_uses_every_completion_token_of_the_batch():
    values = torch.tensor([[5.0, 1.0, 2.0], [5.0, 4.0, 5.0], [7.0, 3.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    picked = [1.0, 2.0, 4.0, 3.0, 9.0]
    mean, std = statistics.mean(picked), statistics.stdev(picked)  # unbiased, over tokens
    out = batch_whiten(values, mask, eps=0.0)
    expected = torch.where(mask > 0, (values - mean) / std, torch.zeros_like(values))
    torch.testing.assert_close(out, expected)
    eps = 0.5
    torch.testing.assert_close(batch_whiten(values, mask, eps)[0, 1],
                               torch.tensor((1.0 - mean) / math.sqrt(std**2 + eps),
                                            dtype=torch.float64))


def test_without_kl_every_token_of_a_row_gets_its_token_weighted_standardised_reward():
    rewards = torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, returns = reinforce_pp_advantage(rewards, torch.zeros_like(mask), mask, beta=0.5,
                                          eps=0.0)
    token_values = [1.0, 1.0, 1.0, 0.0, 3.0, 3.0]  # each reward once per token of its row
    mean, std = statistics.mean(token_values), statistics.stdev(token_values)
    expected = ((rewards[:, None] - mean) / std) * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, rewards[:, None] * mask)


def test_kl_to_go_hand_computed():
    rewards = torch.tensor([1.0, -1.0], dtype=torch.float64)
    kl = torch.tensor([[0.2, 0.4, 0.6], [1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    _, returns = reinforce_pp_advantage(rewards, kl, mask, beta=0.5)
    # G_t = r - beta * sum_{s >= t} KL_s
    expected = torch.tensor([[1 - 0.6, 1 - 0.5, 1 - 0.3], [-1.5, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(returns, expected)


def test_the_group_baseline_centres_each_reward_on_its_group():
    rewards = torch.tensor([1.0, 0.0, 4.0, 2.0], dtype=torch.float64)
    group = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 2, dtype=torch.float64)
    _, returns = reinforce_pp_advantage(rewards, torch.zeros_like(mask), mask, 0.0, group=group)
    torch.testing.assert_close(returns[:, 0], torch.tensor([0.5, -0.5, 1.0, -1.0],
                                                           dtype=torch.float64))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators(estimator):
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    log_r = ref - logp
    expected = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": log_r.exp() - 1 - log_r}[estimator]
    torch.testing.assert_close(kl_estimate(logp, ref, estimator), expected)


# ---------------------------------------------------------------- edge cases


def test_identical_rewards_without_kl_give_zero_never_nan():
    mask = make_batch().completion_mask
    for value in (0.0, 0.7, 5.0):
        adv, _ = reinforce_pp_advantage(torch.full((8,), value), torch.zeros_like(mask), mask,
                                        0.1)
        assert torch.isfinite(adv).all() and float(adv.abs().max()) < 1e-6


def test_a_single_completion_token_in_the_batch_and_fully_masked_rows():
    mask = torch.zeros(3, 4)
    mask[1, 2] = 1.0
    kl = torch.rand(3, 4)
    adv, returns = reinforce_pp_advantage(torch.tensor([1.0, 2.0, 3.0]), kl, mask, 0.1)
    assert torch.isfinite(adv).all() and (adv == 0).all()
    assert float(returns[1, 2]) == pytest.approx(2.0 - 0.1 * float(kl[1, 2]))
    assert (returns[[0, 2]] == 0).all()
    # fully masked rows next to normal ones: zero there, and the others unaffected by them
    mask = make_batch().completion_mask
    rewards = torch.arange(8.0)
    full, _ = reinforce_pp_advantage(rewards, torch.zeros_like(mask), mask, 0.1)
    mask2 = mask.clone()
    mask2[3] = 0
    part, _ = reinforce_pp_advantage(rewards, torch.zeros_like(mask), mask2, 0.1)
    assert torch.isfinite(part).all() and (part[3] == 0).all()
    keep = [i for i in range(8) if i != 3]
    alone, _ = reinforce_pp_advantage(rewards[keep], torch.zeros_like(mask[keep]), mask[keep],
                                      0.1)
    torch.testing.assert_close(part[keep], alone)
    assert not torch.allclose(full[keep], alone)


# ---------------------------------------------------------------- the hook


def _perturb(model, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def test_hook_with_a_frozen_reference_on_the_tiny_model():
    run = make_run({"reinforce_pp": rlmix_reinforce_pp},
                   ["reinforce_pp.beta=0.5", "train.grad_accum=3"], with_policy=True)
    rlmix_reinforce_pp.rlmix_configure(run)
    reference = run.plugin_resources("reinforce_pp")["reference"]
    assert reference is not run.policy.model and not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    assert "reinforce_pp" not in run.state
    batch = make_batch(vocab=200)
    mask = batch.completion_mask

    # at the start the policy is the reference: KL 0, the same as beta 0
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    assert adv.shape == batch.tokens.shape
    no_kl, _ = reinforce_pp_advantage(batch.rewards, torch.zeros_like(mask), mask, 0.5)
    torch.testing.assert_close(adv, no_kl, atol=1e-5, rtol=1e-5)

    _perturb(run.policy.model)
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    with torch.no_grad():
        logp, _ = run.policy.logprobs(run, batch)
        ref_logp, _ = run.policy.logprobs(run, batch, model=reference)
    kl = kl_estimate(logp, ref_logp, "k1")
    assert float((kl * mask).abs().sum()) > 1e-2
    expected, _ = reinforce_pp_advantage(batch.rewards, kl, mask, 0.5)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(adv, no_kl, atol=1e-3)


def test_hook_can_take_the_behaviour_logprobs_and_the_group_baseline():
    run = make_run({"reinforce_pp": rlmix_reinforce_pp},
                   ["reinforce_pp.beta=0.2", "reinforce_pp.policy_logp=behavior",
                    "reinforce_pp.kl_estimator=k3", "reinforce_pp.baseline=group",
                    "reinforce_pp.gamma=0.9"], with_policy=True)
    rlmix_reinforce_pp.rlmix_configure(run)
    batch = make_batch(vocab=200)
    with torch.no_grad():
        ref_logp, _ = run.policy.logprobs(run, batch,
                                          model=run.plugin_resources("reinforce_pp")["reference"])
    kl = kl_estimate(batch.behavior_logp, ref_logp, "k3")
    expected, _ = reinforce_pp_advantage(batch.rewards, kl, batch.completion_mask, 0.2, 0.9,
                                         batch.group)
    torch.testing.assert_close(run.hook.rlmix_advantage(run=run, batch=batch), expected,
                               atol=1e-5, rtol=1e-5)


def test_beta_zero_needs_no_reference_and_beta_without_configure_fails():
    run = make_run({"reinforce_pp": rlmix_reinforce_pp}, ["reinforce_pp.beta=0"],
                   with_policy=True)
    rlmix_reinforce_pp.rlmix_configure(run)
    assert "reference" not in run.plugin_resources("reinforce_pp")
    batch = make_batch()
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    expected, _ = reinforce_pp_advantage(batch.rewards, torch.zeros(batch.tokens.shape),
                                         batch.completion_mask, 0.0)
    torch.testing.assert_close(adv, expected)
    run = make_run({"reinforce_pp": rlmix_reinforce_pp})
    with pytest.raises(RuntimeError, match="reference"):
        run.hook.rlmix_advantage(run=run, batch=batch)


@pytest.mark.parametrize("override", ["reinforce_pp.beta=-1", "reinforce_pp.gamma=1.5",
                                      "reinforce_pp.kl_estimator=k4",
                                      "reinforce_pp.baseline=batch", "reinforce_pp.eps=-1",
                                      "reinforce_pp.policy_logp=old", "reinforce_pp.lam=0.9"])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="reinforce_pp"):
        make_run({"reinforce_pp": rlmix_reinforce_pp}, [override])


def test_settings_defaults():
    s = rlmix_reinforce_pp.Settings()
    assert (s.beta, s.kl_estimator, s.gamma, s.baseline, s.eps, s.policy_logp) == (
        0.01, "k1", 1.0, "none", 1e-8, "recompute")


# ---------------------------------------------------------------- the claims


def test_global_normalisation_does_not_inflate_a_nearly_agreeing_group():
    # the paper's argument against per-prompt normalisation: a group whose rewards barely differ
    # gets unit-size advantages from its own tiny std; over the batch they stay tiny
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.99, 1.0, 0.0, 0.0, 1.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    mask = torch.ones(8, 3)
    per_group = (rewards - ops.group_mean(rewards, group)) / (ops.group_std(rewards, group)
                                                              + 1e-6)
    ours, _ = reinforce_pp_advantage(rewards, torch.zeros_like(mask), mask, 0.0, group=group)
    assert float(per_group[:4].abs().max()) > 1.0  # 0.01 of reward became a full std
    assert float(ours[:4].abs().max()) < 0.05
    assert float(ours[4:].abs().min()) > 0.5  # the informative group keeps its signal


def test_a_tokens_return_depends_only_on_the_kl_at_and_after_it():
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 6, dtype=torch.float64)
    kl = torch.rand(2, 6, generator=g, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    _, base = reinforce_pp_advantage(rewards, kl, mask, 0.3)
    bumped = kl.clone()
    bumped[0, 3] += 1.0
    _, moved = reinforce_pp_advantage(rewards, bumped, mask, 0.3)
    delta = moved - base
    torch.testing.assert_close(delta[0, :4], torch.full((4,), -0.3, dtype=torch.float64))
    assert (delta[0, 4:] == 0).all() and (delta[1] == 0).all()


class PolicyGradient:
    """A local loss owner: plain REINFORCE, -A * logp per token (no other plugin needed)."""

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        return LossTerms(loss=-mb.batch.token_advantages() * logp,
                         mask=mb.batch.completion_mask, mode="token-mean")


def _fraction_of_zeros(batch):
    return (batch.tokens[:, 1:] == 0).float().mean(-1)


def test_reinforce_pp_learns_the_toy_task():
    history = toy_train(make_run({"pg": PolicyGradient, "reinforce_pp": rlmix_reinforce_pp},
                                 ["reinforce_pp.beta=0"]),
                        ToyPolicy(vocab=6, length=4, seed=0), _fraction_of_zeros, steps=150)
    assert sum(history[:3]) / 3 < 0.4
    assert sum(history[-20:]) / 20 > 0.85


# ---------------------------------------------------------------- parity with verl


def _parity_case(seed=5):
    g = torch.Generator().manual_seed(seed)
    n, t = 10, 7
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    mask[2, 1] = 0.0  # a masked gap inside a completion (tool output)
    mask[2, :4] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    logp = -3 * torch.rand(n, t, generator=g)
    ref = logp + 0.5 * torch.randn(n, t, generator=g)
    rewards = torch.randint(0, 3, (n,), generator=g).float()
    return rewards, logp, ref, mask


@pytest.mark.parity
@pytest.mark.parametrize("ours_name, verl_name", [("k1", "kl"), ("k2", "mse"),
                                                  ("k3", "low_var_kl")])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_parity_with_verl_reinforce_plus_plus(ours_name, verl_name, gamma):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from verl.trainer.config import AlgoConfig

    rewards, logp, ref, mask = _parity_case()
    beta = 0.1
    # verl's token rewards (ray_trainer.apply_kl_penalty): token_level_scores (the reward on the
    # last response token) - beta * kl_penalty(old_log_prob, ref_log_prob) * response_mask
    scores = torch.zeros_like(mask)
    scores[torch.arange(len(rewards)), last_token_index(mask)] = rewards
    kld = core_algos.kl_penalty(logp, ref, verl_name)
    assert float(kld.abs().max()) < 10  # inside verl's clamp of low_var_kl
    theirs_rewards = scores - beta * kld * mask
    kl = kl_estimate(logp, ref, ours_name)
    torch.testing.assert_close(token_rewards(rewards, kl, mask, beta), theirs_rewards,
                               atol=1e-6, rtol=1e-5)

    theirs_adv, theirs_returns = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        theirs_rewards, mask, config=AlgoConfig(gamma=gamma))
    ours_adv, ours_returns = reinforce_pp_advantage(rewards, kl, mask, beta, gamma)
    torch.testing.assert_close(ours_returns, theirs_returns, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_adv, theirs_adv, atol=1e-5, rtol=1e-5)


@pytest.mark.parity
def test_parity_with_verl_reinforce_plus_plus_baseline():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    import numpy as np

    rewards, _, _, mask = _parity_case(seed=6)
    group = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2])  # no group of one (verl keeps r_i there)
    scores = torch.zeros_like(mask)
    scores[torch.arange(len(rewards)), last_token_index(mask)] = rewards
    theirs, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        scores, mask, np.array(group.tolist()))
    ours, _ = reinforce_pp_advantage(rewards, torch.zeros_like(mask), mask, 0.0, 1.0, group)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
