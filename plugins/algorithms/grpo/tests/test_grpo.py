"""Tests of the GRPO plugin: its math against hand-computed values, its hooks through a fake run,
its settings checks, the paper's claim on the toy policy, and parity with verl when installed."""

from __future__ import annotations

import math
import statistics

import pytest
import rlmix_grpo
import torch
from rlmix_grpo import clipped_surrogate, group_normalized_advantage, kl_estimate

import rlmix
from rlmix.testing import ToyPolicy, make_batch, make_run, toy_train
from rlmix.types import Minibatch, Normalizers

# ---------------------------------------------------------------- group_normalized_advantage


def test_group_scale_hand_computed_with_agreeing_group_and_group_of_one():
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = sqrt(1/3)
    # group 1: all 2 -> every advantage 0 (std 0, eps keeps it finite)
    # group 2: a single sample -> 0 (nothing to compare against)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])
    eps = 1e-6
    adv = group_normalized_advantage(rewards, group, "group", eps)
    std0 = math.sqrt(1.0 / 3.0)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    expected[:4] /= std0 + eps
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)
    assert (adv[4:] == 0).all()


def test_group_scale_uses_unbiased_std_plus_eps():
    rewards = torch.tensor([3.0, 1.0, 0.0])  # mean 4/3
    group = torch.zeros(3, dtype=torch.long)
    eps = 0.5  # large, so adding it to the std (not the variance) is visible
    mean = 4.0 / 3.0
    unbiased = math.sqrt(sum((r - mean) ** 2 for r in (3.0, 1.0, 0.0)) / 2)
    assert unbiased == pytest.approx(statistics.stdev([3.0, 1.0, 0.0]))
    expected = torch.tensor([(r - mean) / (unbiased + eps) for r in (3.0, 1.0, 0.0)])
    adv = group_normalized_advantage(rewards, group, "group", eps)
    torch.testing.assert_close(adv, expected)
    biased = statistics.pstdev([3.0, 1.0, 0.0])
    assert not torch.allclose(adv, torch.tensor([(r - mean) / (biased + eps)
                                                 for r in (3.0, 1.0, 0.0)]))


def test_batch_scale_divides_group_centred_rewards_by_the_batch_std():
    values = [1.0, 0.0, 0.0, 1.0, 3.0, 1.0]
    rewards = torch.tensor(values)
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    eps = 1e-6
    centred = [0.5, -0.5, -0.5, 0.5, 1.0, -1.0]  # group means 0.5 and 2.0
    batch_std = statistics.stdev(values)  # unbiased, over the whole batch
    expected = torch.tensor([c / (batch_std + eps) for c in centred])
    torch.testing.assert_close(group_normalized_advantage(rewards, group, "batch", eps),
                               expected)


def test_none_scale_only_centres_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 7.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0])
    torch.testing.assert_close(group_normalized_advantage(rewards, group, "none"), expected)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_agreeing_rewards_give_zero_never_nan(scale):
    rewards = torch.full((6,), 0.7)
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = group_normalized_advantage(rewards, group, scale)
    assert torch.isfinite(adv).all()
    assert (adv.abs() < 1e-6).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_single_sample_batch_is_zero(scale):
    adv = group_normalized_advantage(torch.tensor([4.0]), torch.tensor([0]), scale)
    assert torch.isfinite(adv).all() and float(adv[0]) == 0.0


def test_interleaved_group_ids_match_contiguous_ones():
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(12, generator=g)
    group = torch.arange(3).repeat_interleave(4)
    perm = torch.randperm(12, generator=g)
    for scale in ("group", "batch", "none"):
        direct = group_normalized_advantage(rewards, group, scale)
        shuffled = group_normalized_advantage(rewards[perm], group[perm], scale)
        torch.testing.assert_close(shuffled, direct[perm])


def test_unknown_scale_raises():
    with pytest.raises(ValueError, match="scale"):
        group_normalized_advantage(torch.ones(2), torch.zeros(2, dtype=torch.long), "max")


# ---------------------------------------------------------------- clipped_surrogate

EPS_LOW, EPS_HIGH = 0.1, 0.3  # asymmetric: bounds at 0.9 and 1.3

# (ratio, advantage, hand-computed loss = -min(r A, clip(r, 0.9, 1.3) A), clipped branch taken)
SURROGATE_CASES = [
    (1.1, 1.0, -1.1, False),   # A > 0, inside the bounds
    (1.25, 2.0, -2.5, False),  # A > 0, above 1 + eps_low but below 1 + eps_high: not clipped
    (1.5, 1.0, -1.3, True),    # A > 0, above 1 + eps_high: clipped at 1.3
    (0.5, 1.0, -0.5, False),   # A > 0, below 1 - eps_low: the unclipped (smaller) term stays
    (0.95, -2.0, 1.9, False),  # A < 0, inside
    (0.85, -1.0, 0.9, True),   # A < 0, below 1 - eps_low (above 1 - eps_high): clipped at 0.9
    (0.5, -1.0, 0.9, True),    # A < 0, far below: clipped at 0.9
    (1.5, -1.0, 1.5, False),   # A < 0, above 1 + eps_high: the unclipped (larger loss) stays
    (2.0, 0.0, 0.0, False),    # A == 0: no loss, no clipping
]


def test_clipped_surrogate_hand_computed_asymmetric():
    ratio = torch.tensor([c[0] for c in SURROGATE_CASES], dtype=torch.float64)
    adv = torch.tensor([c[1] for c in SURROGATE_CASES], dtype=torch.float64)
    old = torch.linspace(-3.0, -0.5, len(SURROGATE_CASES), dtype=torch.float64)
    logp = old + ratio.log()
    loss, clipped = clipped_surrogate(logp, old, adv, EPS_LOW, EPS_HIGH)
    torch.testing.assert_close(loss, torch.tensor([c[2] for c in SURROGATE_CASES],
                                                  dtype=torch.float64))
    assert clipped.tolist() == [c[3] for c in SURROGATE_CASES]


def test_clipped_tokens_carry_no_gradient_and_others_carry_minus_a_r():
    ratio = torch.tensor([c[0] for c in SURROGATE_CASES], dtype=torch.float64)
    adv = torch.tensor([c[1] for c in SURROGATE_CASES], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    logp = (old + ratio.log()).requires_grad_(True)
    loss, clipped = clipped_surrogate(logp, old, adv, EPS_LOW, EPS_HIGH)
    loss.sum().backward()
    # d/dlogp of -r A is -r A (r = exp(logp - old)); the clipped branch is constant in logp
    expected = torch.where(clipped, torch.zeros_like(adv), -ratio * adv)
    torch.testing.assert_close(logp.grad, expected)


def test_clipped_surrogate_at_ratio_one_is_minus_advantage():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g)
    adv = torch.randn(4, 1, generator=g).expand(4, 6)
    loss, clipped = clipped_surrogate(logp, logp.clone(), adv, 0.2, 0.28)
    torch.testing.assert_close(loss, -adv)
    assert not clipped.any()


# ---------------------------------------------------------------- kl_estimate


def test_kl_estimators_match_their_formulas():
    g = torch.Generator().manual_seed(1)
    logp = -3 * torch.rand(5, 7, generator=g, dtype=torch.float64)
    ref = -3 * torch.rand(5, 7, generator=g, dtype=torch.float64)
    r = torch.exp(ref - logp)  # pi_ref / pi at tokens sampled from pi
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), -torch.log(r))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), 0.5 * torch.log(r) ** 2)
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), (r - 1) - torch.log(r))
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert (kl_estimate(logp, ref, "k2") >= 0).all()
    for est in ("k1", "k2", "k3"):
        assert kl_estimate(logp, logp, est).abs().max() == 0


def test_k1_and_k3_are_unbiased_for_kl_pi_to_ref():
    # the exact expectation under pi of the per-sample estimate is KL(pi || ref) for k1 and k3
    g = torch.Generator().manual_seed(2)
    logp = torch.log_softmax(torch.randn(50, generator=g, dtype=torch.float64), 0)
    ref = torch.log_softmax(torch.randn(50, generator=g, dtype=torch.float64), 0)
    p = logp.exp()
    kl = float((p * (logp - ref)).sum())
    reverse = float((ref.exp() * (ref - logp)).sum())
    assert kl > 0 and abs(kl - reverse) > 1e-3  # the direction matters on these inputs
    for est in ("k1", "k3"):
        assert float((p * kl_estimate(logp, ref, est)).sum()) == pytest.approx(kl, rel=1e-9)


def test_unknown_kl_estimator_raises():
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")


# ---------------------------------------------------------------- hooks through a fake run


def _minibatch(batch):
    normalizers = Normalizers(tokens=float(batch.completion_mask.sum()),
                              sequences=float(len(batch)), norm_constant=5.0)
    return Minibatch(batch=batch, normalizers=normalizers)


def _random_logp(batch, seed=5):
    g = torch.Generator().manual_seed(seed)
    return (-3 * torch.rand(batch.tokens.shape, generator=g) * batch.completion_mask)


def test_advantage_hook_reads_settings():
    run = make_run({"grpo": rlmix_grpo}, ["grpo.scale=none"])
    batch = make_batch(rewards=torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 1.0, 3.0]))
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25,
                                                  0.0, 0.0, -1.0, 1.0]))
    run = make_run({"grpo": rlmix_grpo}, ["grpo.eps=0.25"])
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    torch.testing.assert_close(adv, group_normalized_advantage(batch.rewards, batch.group,
                                                               "group", 0.25))


def test_clip_hook_single_update_takes_ratio_against_detached_logp():
    run = make_run({"grpo": rlmix_grpo}, ["grpo.scale=none"])  # epochs 1, one update: auto
    batch = make_batch()
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    logp = _random_logp(batch).requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.ones_like(logp))
    assert terms.mode == "seq-mean-token-mean"
    torch.testing.assert_close(terms.mask, batch.completion_mask)
    adv = batch.token_advantages()
    # ratio 1 exactly: the loss is -A on every token, and its gradient is -A too
    torch.testing.assert_close(terms.loss, -adv)
    (terms.loss * terms.mask).sum().backward()
    torch.testing.assert_close(logp.grad, -adv * batch.completion_mask)
    assert terms.metrics["clip/fraction"] == 0.0
    assert terms.metrics["entropy"] == pytest.approx(1.0)
    assert "kl" not in terms.metrics


@pytest.mark.parametrize("overrides, uses_behavior", [
    (["train.epochs=2"], True),                   # auto, several optimizer steps: behaviour
    (["train.updates_per_epoch=2"], True),
    (["grpo.old_logp=behavior"], True),           # explicit, one step
    (["grpo.old_logp=detached", "train.epochs=2"], False),
])
def test_clip_hook_old_logp_choice(overrides, uses_behavior):
    run = make_run({"grpo": rlmix_grpo}, ["grpo.eps_low=0.1", "grpo.eps_high=0.3", *overrides])
    batch = make_batch()
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    logp = _random_logp(batch)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    old = batch.behavior_logp if uses_behavior else logp
    expected, clipped = clipped_surrogate(logp, old, batch.token_advantages(), 0.1, 0.3)
    torch.testing.assert_close(terms.loss, expected)
    frac = float((clipped.float() * batch.completion_mask).sum() / batch.completion_mask.sum())
    assert terms.metrics["clip/fraction"] == pytest.approx(frac)
    if uses_behavior:
        assert frac > 0  # random log-probs move the ratio out of the bounds somewhere


def test_auto_takes_behaviour_logp_for_samples_of_an_older_policy_version():
    # one update per batch, but the samples came from an earlier version (asynchronous
    # sampling): the current weights are not the sampler's, so the ratio needs the behaviour
    run = make_run({"grpo": rlmix_grpo})
    batch = make_batch()
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    logp = _random_logp(batch)
    run.policy_version = 1
    batch.policy_version[::2] = 1  # half fresh, half one version behind
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    expected, _ = clipped_surrogate(logp, batch.behavior_logp, batch.token_advantages(),
                                    0.2, 0.2)
    torch.testing.assert_close(terms.loss, expected)


def test_clip_hook_passes_the_loss_mode_through():
    run = make_run({"grpo": rlmix_grpo}, ["grpo.loss_mode=seq-mean-token-sum-norm"])
    batch = make_batch()
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    logp = _random_logp(batch)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    assert terms.mode == "seq-mean-token-sum-norm"


def _perturb(model, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_against_a_frozen_reference(estimator):
    run = make_run({"grpo": rlmix_grpo}, ["grpo.beta=0.1", f"grpo.kl_estimator={estimator}"],
                   with_policy=True)
    rlmix_grpo.rlmix_configure(run)
    reference = run.plugin_resources("grpo")["reference"]
    assert reference is not run.policy.model
    assert not any(p.requires_grad for p in reference.parameters())
    batch = make_batch(vocab=200)
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    mb = _minibatch(batch)

    # at the start the policy is the reference: kl is ~0 and the loss is the plain surrogate
    logp, entropy = run.policy.logprobs(run, batch)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
    assert abs(terms.metrics["kl"]) < 1e-6
    torch.testing.assert_close(terms.loss, -batch.token_advantages(), atol=1e-6, rtol=0)

    # after a change of weights: loss = surrogate + beta * kl_estimate(logp, ref_logp)
    _perturb(run.policy.model)
    logp, entropy = run.policy.logprobs(run, batch)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
    with torch.no_grad():
        ref_logp, _ = run.policy.logprobs(run, batch, model=reference)
    kl = kl_estimate(logp.detach(), ref_logp, estimator)
    mask = batch.completion_mask
    assert float((kl.abs() * mask).sum()) > 1e-3
    surrogate, _ = clipped_surrogate(logp.detach(), logp.detach(), batch.token_advantages(),
                                     0.2, 0.2)
    torch.testing.assert_close(terms.loss.detach() * mask, (surrogate + 0.1 * kl) * mask,
                               atol=1e-5, rtol=1e-5)
    assert terms.metrics["kl"] == pytest.approx(float((kl * mask).sum() / mask.sum()), abs=1e-6)
    terms.loss.sum().backward()  # the KL term reaches the policy's weights, not the reference's
    assert all(p.grad is None for p in reference.parameters())


def test_beta_without_configure_fails_loudly_and_beta_zero_allocates_nothing():
    run = make_run({"grpo": rlmix_grpo}, ["grpo.beta=0.1"])
    batch = make_batch()
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    logp = _random_logp(batch)
    with pytest.raises(RuntimeError, match="reference"):
        run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                            entropy=torch.zeros_like(logp))
    run = make_run({"grpo": rlmix_grpo}, with_policy=True)
    rlmix_grpo.rlmix_configure(run)
    assert "reference" not in run.plugin_resources("grpo")


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("override", [
    "grpo.scale=max", "grpo.loss_mode=sum", "grpo.kl_estimator=k4", "grpo.old_logp=old",
    "grpo.eps_low=1.0", "grpo.eps_low=-0.1", "grpo.eps_high=-0.2", "grpo.beta=-1",
    "grpo.clip=0.2",
])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="grpo"):
        make_run({"grpo": rlmix_grpo}, [override])


def test_settings_defaults():
    s = rlmix_grpo.Settings()
    assert (s.scale, s.eps, s.eps_low, s.eps_high, s.beta, s.kl_estimator, s.loss_mode,
            s.old_logp) == ("group", 1e-6, 0.2, 0.2, 0.0, "k3", "seq-mean-token-mean", "auto")
    with pytest.raises(ValueError):
        rlmix_grpo.Settings(loss_mode="mean")


# ---------------------------------------------------------------- the claim, on the toy policy


class ZeroAdvantage:
    """A baseline estimator that gives every sample advantage 0 (so nothing is learned)."""

    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        return torch.zeros(len(batch))


def _fraction_of_zeros(batch):
    return (batch.tokens[:, 1:] == 0).float().mean(-1)


def test_grpo_learns_the_toy_task_and_beats_zero_advantage():
    steps = 200
    toy = ToyPolicy(vocab=6, length=4, seed=0)
    history = toy_train(make_run({"grpo": rlmix_grpo}), toy, _fraction_of_zeros, steps=steps)
    start, end = sum(history[:3]) / 3, sum(history[-20:]) / 20
    assert start < 0.4  # chance is 1/6
    assert end > 0.9
    assert float(torch.softmax(toy.logits.detach(), -1)[:, 0].min()) > 0.9

    baseline = toy_train(make_run({"grpo": rlmix_grpo, "zero": ZeroAdvantage}),
                         ToyPolicy(vocab=6, length=4, seed=0), _fraction_of_zeros, steps=steps)
    assert sum(baseline[-20:]) / 20 < 0.4
    assert end - sum(baseline[-20:]) / 20 > 0.5


# ---------------------------------------------------------------- parity with verl


@pytest.mark.parity
def test_parity_with_verl():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    import numpy as np
    from verl.workers.config import ActorConfig

    from rlmix import ops

    g = torch.Generator().manual_seed(7)
    n_groups, group_size, width = 4, 5, 9
    batch = make_batch(n_groups, group_size, prompt_len=2, completion_len=width - 2, seed=3,
                       rewards=torch.randint(0, 4, (n_groups * group_size,), generator=g).float())
    batch.rewards[:group_size] = 1.0  # one group whose rewards all agree
    mask = batch.completion_mask[:, 2:]
    n = len(batch)

    token_rewards = torch.zeros_like(mask)
    last = mask.sum(-1).long() - 1
    token_rewards[torch.arange(n), last] = batch.rewards
    for scale, norm in (("group", True), ("none", False)):
        theirs, _ = core_algos.compute_grpo_outcome_advantage(
            token_rewards, mask, np.array(batch.group.tolist()), epsilon=1e-6,
            norm_adv_by_std_in_grpo=norm)
        ours = group_normalized_advantage(batch.rewards, batch.group, scale, 1e-6)
        torch.testing.assert_close(ours[:, None] * mask, theirs, atol=1e-5, rtol=1e-5)

    adv = group_normalized_advantage(batch.rewards, batch.group, "group")[:, None].expand_as(mask)
    old = -3 * torch.rand(mask.shape, generator=g)
    logp = old + (2 * torch.rand(mask.shape, generator=g) - 1)  # ratios in [1/e, e], below 3
    config = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=0.1,
                         clip_ratio_high=0.3, ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    normalizers = Normalizers(tokens=float(mask.sum()), sequences=float(n), norm_constant=7.0)
    loss, clipped = clipped_surrogate(logp, old, adv, 0.1, 0.3)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        theirs, metrics = core_algos.compute_policy_loss_vanilla(
            old, logp, adv, mask, loss_agg_mode=mode, config=config)
        torch.testing.assert_close(ops.aggregate_loss(loss, mask, mode, normalizers), theirs,
                                   atol=1e-5, rtol=1e-5)
    assert float(ops.masked_mean(clipped.float(), mask)) == pytest.approx(
        metrics["actor/pg_clipfrac"], abs=1e-6)
    for ours_name, theirs_name in (("k1", "k1"), ("k2", "k2"), ("k3", "low_var_kl")):
        torch.testing.assert_close(kl_estimate(logp, old, ours_name),
                                   core_algos.kl_penalty_forward(logp, old, theirs_name))
