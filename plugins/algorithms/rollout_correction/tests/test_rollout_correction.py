"""Tests of the rollout-correction plugin: TIS / MIS / AIS weights against hand-computed values,
the clip wrapper around an owner's loss (an inline surrogate, and rlmix-grpo when installed),
edge cases (single tokens, fully masked rows, extreme ratios), the AIS diagnostics, the paper's
claim (bias reduction against a known on-policy gradient on fake-quantised rollouts, exactly by
enumeration and by sampling many batches), and parity with verl's rollout-correction weights
when verl is installed."""

from __future__ import annotations

import itertools
import math

import pytest
import rlmix_rollout_correction as rc
import torch
from rlmix_rollout_correction import (
    Settings,
    ais_diagnostics,
    correction,
    log_ratio,
    masked_weights,
    truncated_weights,
)

import rlmix
from rlmix import ops
from rlmix.testing import ToyPolicy, make_batch, make_run
from rlmix.types import LossTerms, Minibatch, Normalizers

# ---------------------------------------------------------------- weights by hand

# two rows, 3 completion columns after one prompt column; row 1 has a single token
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
LOG_RHO = torch.tensor([[0.0, math.log(3.0), math.log(0.25), math.log(1.5)],
                        [0.0, math.log(0.8), 0.0, 0.0]])
BEHAVIOR = torch.tensor([[0.0, -2.0, -1.0, -0.5], [0.0, -1.0, 0.0, 0.0]])
TRAIN = BEHAVIOR + LOG_RHO


def test_log_ratio_token_and_sequence():
    torch.testing.assert_close(log_ratio(TRAIN, BEHAVIOR, MASK, "token"), LOG_RHO * MASK)
    seq = log_ratio(TRAIN, BEHAVIOR, MASK, "sequence")
    row0 = math.log(3.0 * 0.25 * 1.5)  # the product of the row's ratios: 1.125
    torch.testing.assert_close(seq, torch.tensor([[0.0, row0, row0, row0],
                                                  [0.0, math.log(0.8), 0.0, 0.0]]))


def test_truncated_and_masked_weights_by_hand():
    rho = torch.tensor([3.0, 0.25, 1.5, 0.8, 2.0, 0.5])
    lr = rho.log()
    torch.testing.assert_close(truncated_weights(lr, 2.0), torch.tensor([2.0, 0.25, 1.5, 0.8,
                                                                         2.0, 0.5]))
    w, keep = masked_weights(lr, 0.5, 2.0)
    # the bounds are inclusive: 2.0 and 0.5 stay, 3.0 and 0.25 go
    assert keep.tolist() == [False, False, True, True, True, True]
    torch.testing.assert_close(w, torch.tensor([0.0, 0.0, 1.5, 0.8, 2.0, 0.5]))


@pytest.mark.parametrize("mode, level, weights, keep", [
    ("tis", "token", [[1, 2.0, 0.25, 1.5], [1, 0.8, 1, 1]], None),
    ("tis", "sequence", [[1, 1.125, 1.125, 1.125], [1, 0.8, 1, 1]], None),
    ("mis", "token", [[1, 0, 0, 1.5], [1, 0.8, 1, 1]], [[1, 0, 0, 1], [1, 1, 1, 1]]),
    ("mis", "sequence", [[1, 1.125, 1.125, 1.125], [1, 0.8, 1, 1]], None),
    ("none", "token", [[1, 1, 1, 1], [1, 1, 1, 1]], None),
])
def test_correction_weights_and_mask_by_hand(mode, level, weights, keep):
    w, k, metrics = correction(TRAIN, BEHAVIOR, MASK, torch.ones_like(MASK),
                               Settings(mode=mode, level=level, cap=2.0))
    torch.testing.assert_close(w * MASK, torch.tensor(weights) * MASK)
    expected_keep = torch.ones(2, 4) if keep is None else torch.tensor(keep, dtype=torch.float)
    torch.testing.assert_close(k.float(), expected_keep)
    assert not w.requires_grad
    assert metrics["rollout_correction/masked_fraction"] == pytest.approx(
        0.5 if (mode, level) == ("mis", "token") else 0.0)
    if level == "token":
        # tokens 3.0, 0.25, 1.5, 0.8: mean 1.3875, max 3, one above the cap of 2
        assert metrics["rollout_correction/ratio_mean"] == pytest.approx(1.3875)
        assert metrics["rollout_correction/ratio_max"] == pytest.approx(3.0)
        assert metrics["rollout_correction/truncated_fraction"] == pytest.approx(0.25)


def test_mis_sequence_drops_whole_rows_and_lower_defaults_to_one_over_cap():
    train = BEHAVIOR + torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, math.log(0.4), 0.0, 0.0]])
    w, keep, _ = correction(train, BEHAVIOR, MASK, torch.ones_like(MASK),
                            Settings(mode="mis", level="sequence", cap=4.0))
    # row 0: e^2 = 7.4 > 4; row 1: 0.4 >= 1/4, kept with weight 0.4
    assert keep[0, 1:].tolist() == [False, False, False] and keep[1].all()
    assert float(w[1, 1]) == pytest.approx(0.4)
    _, keep, _ = correction(train, BEHAVIOR, MASK, torch.ones_like(MASK),
                            Settings(mode="mis", level="sequence", cap=8.0, lower=0.5))
    assert keep[0].all() and not keep[1, 1]  # 7.4 <= 8 kept; 0.4 < 0.5 dropped


# ---------------------------------------------------------------- AIS diagnostics


def test_ais_diagnostics_by_hand():
    # four tokens, ratios 2, 1, 1, 0.5 (cap 4, so untruncated), advantages 1, -1, 1, -1
    lr = torch.tensor([[math.log(2.0), 0.0, 0.0, math.log(0.5)]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    d = ais_diagnostics(lr, adv, mask, cap=4.0, level="token", kl_scale=0.05)
    w = [2.0, 1.0, 1.0, 0.5]
    reliability = sum(w) ** 2 / (4 * sum(x * x for x in w))  # 20.25 / 25 = 0.81
    kl = sum(x - 1 - math.log(x) for x in w) / 4
    severity = 1 - math.exp(-kl / 0.05)
    variance = sum(x * x for x in w) / 4  # |A| = 1 everywhere: the mean of w^2 = 1.5625
    assert d["reliability"] == pytest.approx(reliability)
    assert d["kl"] == pytest.approx(kl)
    assert d["severity"] == pytest.approx(severity)
    assert d["variance"] == pytest.approx(variance)
    assert d["lambda"] == pytest.approx(severity * reliability / variance)


def test_ais_lambda_is_zero_on_policy_and_grows_with_the_mismatch():
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(64, 6)
    adv = torch.randn(64, 1, generator=g).expand(64, 6)
    noise = torch.randn(64, 6, generator=g)
    lams = [ais_diagnostics(scale * noise, adv, mask, cap=2.0)["lambda"]
            for scale in (0.0, 0.01, 0.03, 0.1)]
    assert lams[0] == 0.0  # no mismatch: no intervention, the plain gradient
    assert lams[0] < lams[1] < lams[2] < lams[3] <= 1.0


def test_ais_lambda_backs_off_when_the_weights_are_degenerate():
    mask = torch.ones(1, 32)
    adv = torch.ones(1, 32)
    moderate = torch.full((1, 32), 0.2) * torch.tensor([1.0, -1.0]).repeat(16)
    degenerate = torch.full((1, 32), -1.0)
    degenerate[0, 0] = 6.0  # one weight at the cap, the rest tiny: ESS ~ 1
    d_mod = ais_diagnostics(moderate, adv, mask, cap=50.0, kl_scale=0.01)
    d_deg = ais_diagnostics(degenerate, adv, mask, cap=50.0, kl_scale=0.01)
    assert d_deg["severity"] > d_mod["severity"] > 0.5  # both are severe mismatches
    assert d_deg["reliability"] < 0.2 < d_mod["reliability"]
    assert d_deg["variance"] > 10 * d_mod["variance"]
    assert d_deg["lambda"] < 0.1 * d_mod["lambda"]


def test_ais_weight_interpolates_between_one_and_the_truncated_weight():
    w_tis, _, _ = correction(TRAIN, BEHAVIOR, MASK, torch.ones_like(MASK), Settings(cap=2.0))
    w_ais, _, m = correction(TRAIN, BEHAVIOR, MASK, torch.ones_like(MASK),
                             Settings(mode="ais", cap=2.0, kl_scale=0.1))
    lam = m["rollout_correction/ais_lambda"]
    assert 0.0 < lam < 1.0
    torch.testing.assert_close(w_ais * MASK, ((1 - lam) + lam * w_tis) * MASK)
    for key in ("reliability", "severity", "variance", "kl"):
        assert f"rollout_correction/ais_{key}" in m


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("mode", ["tis", "mis", "ais", "none"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_no_nan_for_masked_rows_single_tokens_and_extreme_ratios(mode, level):
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    train = torch.tensor([[0.0, -0.1, -200.0], [0.0, -1.0, -1.0], [0.0, -0.5, 0.0]])
    behavior = torch.tensor([[0.0, -150.0, -0.1], [0.0, -300.0, 0.0], [0.0, -0.5, 0.0]])
    adv = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    w, keep, metrics = correction(train, behavior, mask, adv, Settings(mode=mode, level=level))
    assert torch.isfinite(w).all()
    assert all(math.isfinite(v) for v in metrics.values())
    w, keep, metrics = correction(train, behavior, torch.zeros(3, 3), adv,
                                  Settings(mode=mode, level=level))
    assert torch.isfinite(w).all() and all(math.isfinite(v) for v in metrics.values())
    assert metrics["rollout_correction/masked_fraction"] == 0.0
    if mode == "ais":
        assert metrics["rollout_correction/ais_lambda"] == 0.0


# ---------------------------------------------------------------- the wrapper around an owner


class Surrogate:
    """A minimal owner: group-normalised advantages and GRPO's single-update surrogate
    ``-A * exp(logp - logp.detach())`` (gradient ``-A grad logp``). Inline, so these tests run
    with this plugin alone installed; the composition with rlmix-grpo is tested below."""

    def __init__(self, mode="seq-mean-token-mean"):
        self.mode = mode

    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        r, g = batch.rewards, batch.group
        return (r - ops.group_mean(r, g)) / (ops.group_std(r, g) + 1e-6)

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        adv = mb.batch.token_advantages().to(logp.dtype)
        return LossTerms(loss=-adv * torch.exp(logp - logp.detach()),
                         mask=mb.batch.completion_mask.to(logp.dtype), mode=self.mode,
                         metrics={"owner/metric": 1.0})


def _minibatch(batch):
    return Minibatch(batch=batch, normalizers=Normalizers(
        tokens=float(batch.completion_mask.sum()), sequences=float(len(batch)),
        norm_constant=5.0))


def _run(*overrides, **kw):
    return make_run({"pg": Surrogate(), "rollout_correction": rc}, list(overrides), **kw)


@pytest.mark.parametrize("mode", ["tis", "mis", "ais"])
def test_clip_wrapper_weights_the_owners_loss_and_mask(mode):
    batch = make_batch(seed=4)
    run = _run(f"rollout_correction.mode={mode}", "rollout_correction.kl_scale=0.5")
    plain = make_run({"pg": Surrogate()})
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    g = torch.Generator().manual_seed(0)
    logp = (batch.behavior_logp + 0.6 * torch.randn(batch.tokens.shape, generator=g)) \
        * batch.completion_mask
    logp.requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    base = plain.hook.rlmix_clip(run=plain, mb=_minibatch(batch), logp=logp,
                                 entropy=torch.zeros_like(logp))
    weight, keep, _ = correction(logp.detach(), batch.behavior_logp, batch.completion_mask,
                                 batch.token_advantages(), Settings(mode=mode, kl_scale=0.5))
    mask = batch.completion_mask
    torch.testing.assert_close(terms.loss * mask, base.loss * weight * mask)
    torch.testing.assert_close(terms.mask, base.mask * keep)
    assert terms.mode == base.mode
    assert "rollout_correction/ratio_mean" in terms.metrics and "owner/metric" in terms.metrics
    # the gradient is the owner's, scaled per token by the (detached) weight
    (ops.aggregate_loss(terms.loss, terms.mask, terms.mode, _minibatch(batch).normalizers)
     ).backward()
    grad = logp.grad.clone()
    logp.grad = None
    (ops.aggregate_loss(base.loss * weight, base.mask * keep, base.mode,
                        _minibatch(batch).normalizers)).backward()
    torch.testing.assert_close(grad, logp.grad)
    if mode == "mis":
        assert terms.metrics["rollout_correction/masked_fraction"] > 0


def test_several_updates_take_the_ratio_against_the_step_start_log_probs():
    run = _run("train.epochs=2", with_policy=True)
    batch = make_batch(vocab=200, seed=2)
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    stored = batch.extras[rc.OLD_LOGP]
    start, _ = run.policy.logprobs(run, batch)
    torch.testing.assert_close(stored, start.detach())
    # the policy moves (a second epoch): the weight still uses the stored log-probs
    with torch.no_grad():
        for p in run.policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    logp, entropy = run.policy.logprobs(run, batch)
    mb = next(iter(run.minibatches(batch)))
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
    weight, _, _ = correction(stored, batch.behavior_logp, batch.completion_mask,
                              batch.token_advantages(), Settings())
    plain = make_run({"pg": Surrogate()}, ["train.epochs=2"])
    base = plain.hook.rlmix_clip(run=plain, mb=mb, logp=logp, entropy=entropy)
    mask = batch.completion_mask
    torch.testing.assert_close(terms.loss * mask, base.loss * weight * mask)
    # one update per batch: nothing is recomputed
    run1 = _run(with_policy=True)
    b1 = make_batch(vocab=200, seed=2)
    b1.advantages = run1.hook.rlmix_advantage(run=run1, batch=b1)
    assert rc.OLD_LOGP not in b1.extras


def test_composes_with_the_grpo_plugin():
    rlmix_grpo = pytest.importorskip("rlmix_grpo")
    batch = make_batch(seed=6)
    run = make_run({"grpo": rlmix_grpo, "rollout_correction": rc},
                   ["rollout_correction.mode=mis", "grpo.old_logp=behavior"])
    plain = make_run({"grpo": rlmix_grpo}, ["grpo.old_logp=behavior"])
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    g = torch.Generator().manual_seed(1)
    logp = (batch.behavior_logp + 0.6 * torch.randn(batch.tokens.shape, generator=g)) \
        * batch.completion_mask
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    base = plain.hook.rlmix_clip(run=plain, mb=_minibatch(batch), logp=logp,
                                 entropy=torch.zeros_like(logp))
    weight, keep, _ = correction(logp, batch.behavior_logp, batch.completion_mask,
                                 batch.token_advantages(), Settings(mode="mis"))
    torch.testing.assert_close(terms.loss, base.loss * weight)
    torch.testing.assert_close(terms.mask, base.mask * keep)
    assert "clip/fraction" in terms.metrics and "rollout_correction/kl" in terms.metrics


@pytest.mark.parametrize("override", [
    "rollout_correction.mode=icepop", "rollout_correction.level=geo", "rollout_correction.cap=0.5",
    "rollout_correction.lower=3.0", "rollout_correction.kl_scale=0", "rollout_correction.c=2",
])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="rollout_correction"):
        make_run({"rollout_correction": rc}, [override])


# ---------------------------------------------------------------- the claim: less bias

V, L = 6, 4


def _policies():
    """The trainer's logits, and the sampler's: the same logits fake-quantised to a grid of 0.5
    plus a fixed perturbation (a low-precision copy of the policy)."""
    theta = torch.randn(L, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    noise = torch.randn(L, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return theta, torch.round(theta / 0.5) * 0.5 + 0.3 * noise


def _reward(tokens):
    return (tokens == 0).double().mean(-1)  # the share of zeros in the completion


def _exact_target(theta):
    """-grad J(theta), J = E_pi[R], by enumerating all V^L completions (the on-policy policy
    gradient of the loss -A * log pi, whose expectation under pi it is)."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=L)))
    th = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(th, -1).gather(-1, seqs.T).T.sum(-1)
    J = (logp.exp() * _reward(seqs)).sum()
    (grad,) = torch.autograd.grad(J, th)
    return -grad, float(J.detach()), seqs


def _expected_gradient(theta, mu_logits, settings, run=None):
    """E_mu[grad of the corrected loss], exactly: every completion weighted by mu(y)."""
    target, value, seqs = _exact_target(theta)
    n = len(seqs)
    th = theta.clone().requires_grad_(True)
    pi_tok = torch.log_softmax(th, -1).gather(-1, seqs.T).T
    mu_tok = torch.log_softmax(mu_logits, -1).gather(-1, seqs.T).T
    zero = torch.zeros(n, 1, dtype=torch.float64)
    logp = torch.cat([zero, pi_tok], 1)
    behavior = torch.cat([zero, mu_tok], 1)
    mask = torch.cat([zero, torch.ones(n, L, dtype=torch.float64)], 1)
    adv = (_reward(seqs) - value)[:, None].expand_as(mask)  # constant baseline: no bias on-policy
    weight, keep, metrics = correction(logp, behavior, mask, adv, settings)
    loss = -adv * torch.exp(logp - logp.detach()) * weight  # the single-update surrogate
    total = (mu_tok.sum(-1).exp()[:, None] * loss * mask * keep).sum()
    (grad,) = torch.autograd.grad(total, th)
    return grad, target, metrics


def _relative_bias(grad, target):
    return float((grad - target).norm() / target.norm())


def test_exact_bias_tis_and_mis_reduce_the_bias_of_uncorrected_off_policy_gradients():
    theta, mu_logits = _policies()
    bias = {}
    for mode, level in [("none", "token"), ("tis", "token"), ("mis", "token"),
                        ("tis", "sequence"), ("mis", "sequence")]:
        grad, target, _ = _expected_gradient(theta, mu_logits, Settings(mode=mode, level=level))
        bias[mode, level] = _relative_bias(grad, target)
    # the fake-quantised sampler biases the plain gradient by about a third of its size
    assert bias["none", "token"] > 0.3
    # per-token ratios stay below the cap of 2 here: token TIS is then exactly unbiased
    assert bias["tis", "token"] < 1e-10
    assert bias["tis", "sequence"] < 0.3 * bias["none", "token"]
    assert bias["mis", "token"] < 0.5 * bias["none", "token"]
    assert bias["mis", "sequence"] < bias["none", "token"]
    # the same sampler with no quantisation error: nothing to correct, no bias anywhere
    for mode in ("none", "tis", "mis"):
        grad, target, _ = _expected_gradient(theta, theta, Settings(mode=mode))
        assert _relative_bias(grad, target) < 1e-10


def test_exact_bias_with_a_binding_cap_is_still_below_the_uncorrected_bias():
    theta, mu_logits = _policies()
    none, target, _ = _expected_gradient(theta, mu_logits, Settings(mode="none"))
    tis, _, m = _expected_gradient(theta, mu_logits, Settings(mode="tis", cap=1.2))
    assert m["rollout_correction/truncated_fraction"] > 0.05  # the cap does bite
    assert 0 < _relative_bias(tis, target) < 0.6 * _relative_bias(none, target)


def _sampled_estimates(mode, level, batches=300, n=64, seed=0):
    """Mean of the per-batch gradient estimates of the owner's loss wrapped by the plugin,
    sampling every batch from the quantised copy of the policy."""
    theta, mu_logits = _policies()
    _, value, _ = _exact_target(theta)
    run = make_run({"pg": Surrogate("seq-mean-token-sum"), "rollout_correction": rc},
                   [f"rollout_correction.mode={mode}", f"rollout_correction.level={level}"])
    sampler = ToyPolicy(vocab=V, length=L, seed=seed)
    trainer = ToyPolicy(vocab=V, length=L)
    with torch.no_grad():
        sampler.logits.copy_(mu_logits.float())
        trainer.logits.copy_(theta.float())
    total = torch.zeros(L, V)
    lambdas = []
    for _ in range(batches):
        batch = sampler.sample(n, 1)
        batch.advantages = (_reward(batch.tokens[:, 1:]) - value).float()
        logp, entropy = trainer.logprobs(batch)
        mb = Minibatch(batch=batch, normalizers=Normalizers(
            tokens=float(batch.completion_mask.sum()), sequences=float(n), norm_constant=L))
        terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
        loss = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
        (grad,) = torch.autograd.grad(loss, trainer.logits)
        total += grad
        lambdas.append(terms.metrics.get("rollout_correction/ais_lambda", 0.0))
    return total.double() / batches, sum(lambdas) / len(lambdas)


def test_sampled_bias_over_many_batches_tis_mis_ais_beat_no_correction():
    theta, _ = _policies()
    target, _, _ = _exact_target(theta)
    none, _ = _sampled_estimates("none", "token")
    tis, _ = _sampled_estimates("tis", "token")
    mis, _ = _sampled_estimates("mis", "token")
    ais, lam = _sampled_estimates("ais", "token")
    b_none, b_tis = _relative_bias(none, target), _relative_bias(tis, target)
    b_mis, b_ais = _relative_bias(mis, target), _relative_bias(ais, target)
    # 300 x 64 samples: the Monte Carlo error is a few percent of the target's norm
    assert b_none > 0.3
    assert b_tis < 0.35 * b_none
    assert b_mis < 0.75 * b_none
    assert 0.3 < lam < 1.0  # a severe mismatch: AIS leans toward the corrected gradient
    assert b_ais < 0.6 * b_none


# ---------------------------------------------------------------- parity with verl


@pytest.mark.parity
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_parity_with_verl_rollout_correction_weights(level):
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    g = torch.Generator().manual_seed(3)
    n, t = 12, 9
    mask = (torch.rand(n, t, generator=g) < 0.8).float()
    mask[0] = 0.0
    mask[0, 0] = 1.0  # a single-token row
    behavior = -3 * torch.rand(n, t, generator=g)
    train = behavior + 0.5 * torch.randn(n, t, generator=g)
    lr = (train - behavior) * mask
    ours_tis, _, _ = correction(train, behavior, mask, torch.zeros(n, t),
                                Settings(mode="tis", level=level, cap=2.0))
    theirs_tis, _ = helper.compute_rollout_correction_weights(lr, mask, rollout_is=level,
                                                              rollout_is_threshold=2.0)
    torch.testing.assert_close(ours_tis * mask, theirs_tis, atol=1e-6, rtol=1e-6)
    w, keep, _ = correction(train, behavior, mask, torch.zeros(n, t),
                            Settings(mode="mis", level=level, cap=2.0, lower=0.5))
    theirs_mis, _ = helper.compute_rollout_correction_weights(lr, mask, rollout_is=level,
                                                              rollout_is_threshold="0.5_2.0")
    torch.testing.assert_close(w * keep * mask, theirs_mis, atol=1e-6, rtol=1e-6)
    assert bool((theirs_mis == 0).logical_and(mask > 0).any())  # some were masked
