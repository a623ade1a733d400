"""Tests of the decoupled PPO plugin: the importance weight and its cap modes, the loss and its
gradient against hand-computed values, the three proximal policies (EWMA of the weights, the
step's starting weights, log-linear interpolation), the EWMA's update and checkpoint, edge
cases, settings, the claim (identical to PPO when behaviour = proximal = current), and parity
with verl's decoupled rollout correction."""

from __future__ import annotations

import copy
import math

import pytest
import rlmix_decoupled_ppo as dppo
import torch
from rlmix_decoupled_ppo import behaviour_weight, decoupled_loss, ewma_update, loglinear_proximal

import rlmix
from rlmix.testing import make_batch, make_run
from rlmix.types import LossTerms, Minibatch, Normalizers


def ppo_reference(logp, old, adv, eps_low, eps_high):
    """PPO's clipped surrogate, written out independently of the plugin."""
    ratio = torch.exp(logp - old)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)


def _minibatch(batch):
    normalizers = Normalizers(tokens=float(batch.completion_mask.sum().clamp(min=1)),
                              sequences=float(len(batch)), norm_constant=5.0)
    return Minibatch(batch=batch, normalizers=normalizers)


# ---------------------------------------------------------------- the weight and the loss


def test_behaviour_weight_cap_modes_hand_computed():
    prox = torch.log(torch.tensor([[1.0, 2.0, 6.0, 0.5, 9.0]]))
    behav = torch.zeros(1, 5)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(behaviour_weight(prox, behav, mask, 5.0, "mask"),
                               torch.tensor([[1.0, 2.0, 0.0, 0.5, 1.0]]))
    torch.testing.assert_close(behaviour_weight(prox, behav, mask, 5.0, "truncate"),
                               torch.tensor([[1.0, 2.0, 5.0, 0.5, 1.0]]))
    torch.testing.assert_close(behaviour_weight(prox, behav, mask, 5.0, "none"),
                               torch.tensor([[1.0, 2.0, 6.0, 0.5, 1.0]]))
    with pytest.raises(ValueError, match="cap_mode"):
        behaviour_weight(prox, behav, mask, 5.0, "clip")


def test_weight_is_detached_and_never_overflows():
    prox = torch.tensor([[500.0, -500.0]], requires_grad=True)
    w = behaviour_weight(prox, torch.zeros(1, 2), torch.ones(1, 2), 5.0, "none")
    assert not w.requires_grad and torch.isfinite(w).all()


# (ratio current/prox, weight prox/behav, advantage, hand-computed loss, clipped)
CASES = [
    (1.1, 2.0, 1.0, -2.2, False),   # inside: -w r A
    (1.5, 0.5, 1.0, -0.6, True),    # A > 0 above 1 + .2: -w (1.2) A
    (0.5, 3.0, -1.0, 2.4, True),    # A < 0 below 1 - .2: -w (.8) A
    (1.5, 1.0, -2.0, 3.0, False),   # A < 0 above the upper: unclipped
]


def test_decoupled_loss_hand_computed_with_gradients():
    r = torch.tensor([c[0] for c in CASES], dtype=torch.float64)
    w = torch.tensor([c[1] for c in CASES], dtype=torch.float64)
    adv = torch.tensor([c[2] for c in CASES], dtype=torch.float64)
    behav = torch.full_like(r, -2.0)
    prox = behav + w.log()
    logp = (prox + r.log()).requires_grad_(True)
    mask = torch.ones_like(r)
    loss, clipped, weight = decoupled_loss(logp, prox, behav, adv, mask, 0.2, 0.2, cap=5.0)
    torch.testing.assert_close(loss, torch.tensor([c[3] for c in CASES], dtype=torch.float64))
    assert clipped.tolist() == [c[4] for c in CASES]
    torch.testing.assert_close(weight, w)
    loss.sum().backward()
    # d/dlogp of -w r A is -w r A; the clipped branch is constant in logp
    torch.testing.assert_close(logp.grad, torch.where(clipped, torch.zeros_like(r), -w * r * adv))


def test_the_trust_region_is_measured_from_the_proximal_policy_not_the_behaviour():
    # current / behaviour = 3 (far outside [.8, 1.2]) but current / prox = 1.1 (inside): PPO
    # against the behaviour clips it (no gradient); decoupled PPO keeps the gradient, weighted
    behav = torch.tensor([-2.0], dtype=torch.float64)
    prox = behav + math.log(3.0 / 1.1)
    logp = (behav + math.log(3.0)).requires_grad_(True)
    adv = torch.tensor([1.0], dtype=torch.float64)
    ppo = ppo_reference(logp, behav, adv, 0.2, 0.2)
    ours, clipped, _ = decoupled_loss(logp, prox, behav, adv, torch.ones(1), 0.2, 0.2)
    g_ppo, = torch.autograd.grad(ppo.sum(), logp)
    g_ours, = torch.autograd.grad(ours.sum(), logp)
    assert float(g_ppo) == 0.0
    assert not clipped.any() and float(g_ours) == pytest.approx(-(3.0 / 1.1) * 1.1)


# ---------------------------------------------------------------- the claim


def test_identical_to_ppo_when_behaviour_equals_proximal():
    g = torch.Generator().manual_seed(0)
    n, t = 6, 7
    old = -3 * torch.rand(n, t, generator=g, dtype=torch.float64)
    logp = (old + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5)).requires_grad_(True)
    adv = torch.randn(n, 1, generator=g, dtype=torch.float64).expand(n, t)
    mask = (torch.rand(n, t, generator=g) > 0.2).to(torch.float64)
    for cap_mode in ("mask", "truncate", "none"):
        ours, clipped, w = decoupled_loss(logp, old, old, adv, mask, 0.1, 0.3, 5.0, cap_mode)
        theirs = ppo_reference(logp, old, adv, 0.1, 0.3)
        assert (w == 1).all()
        torch.testing.assert_close(ours * mask, theirs * mask)
        g1, = torch.autograd.grad((ours * mask).sum(), logp)
        g2, = torch.autograd.grad((theirs * mask).sum(), logp)
        torch.testing.assert_close(g1, g2)
    assert clipped.any()  # the ratios span the clip: the equality covers both branches


def _model_run(overrides=(), extra=None):
    plugins = {**(extra or {}), "decoupled_ppo": dppo}
    run = make_run(plugins, list(overrides), with_policy=True)
    torch.manual_seed(0)
    dppo.rlmix_configure(run)
    batch = make_batch(vocab=200, seed=1)
    with torch.no_grad():
        behaviour, _ = run.policy.logprobs(run, batch)
    batch.behavior_logp = behaviour
    batch.advantages = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3, -2.0, 1.5, -0.1])
    return run, batch


@pytest.mark.parametrize("proximal", ["ewma", "recompute", "loglinear"])
def test_hook_is_ppo_when_behaviour_proximal_and_current_agree(proximal):
    run, batch = _model_run([f"decoupled_ppo.proximal={proximal}"],
                            extra={"adv": ConstantAdvantage})
    advantages = batch.advantages
    run.hook.rlmix_advantage(run=run, batch=batch)  # recompute: fills the proximal log-probs
    batch.advantages = advantages
    logp, entropy = run.policy.logprobs(run, batch)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=entropy)
    mask = batch.completion_mask
    adv = batch.token_advantages()
    expected = ppo_reference(logp, batch.behavior_logp, adv, 0.2, 0.2)
    torch.testing.assert_close(terms.loss * mask, expected * mask, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(terms.loss * mask, -adv * mask, atol=1e-5, rtol=1e-5)
    assert terms.metrics["decoupled/weight_mean"] == pytest.approx(1.0, abs=1e-5)
    params = [p for p in run.policy.model.parameters() if p.requires_grad]
    g1 = torch.autograd.grad((terms.loss * mask).sum(), params, retain_graph=True)
    g2 = torch.autograd.grad((expected * mask).sum(), params)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert any(float(a.abs().sum()) > 0 for a in g1)


def test_hook_matches_grpos_clipped_surrogate_value_and_gradient():
    rlmix_grpo = pytest.importorskip("rlmix_grpo")
    run, batch = _model_run(extra={"grpo": rlmix_grpo})
    logp, entropy = run.policy.logprobs(run, batch)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=entropy)
    theirs, _ = rlmix_grpo.clipped_surrogate(logp, batch.behavior_logp,
                                             batch.token_advantages(), 0.2, 0.2)
    mb = _minibatch(batch)
    ours_value = rlmix.ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
    their_value = rlmix.ops.aggregate_loss(theirs, batch.completion_mask, "seq-mean-token-mean",
                                           mb.normalizers)
    torch.testing.assert_close(ours_value, their_value, atol=1e-6, rtol=1e-6)
    params = [p for p in run.policy.model.parameters() if p.requires_grad]
    g1 = torch.autograd.grad(ours_value, params, retain_graph=True)
    g2 = torch.autograd.grad(their_value, params)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- the proximal policies


def test_loglinear_proximal_hand_computed():
    behav = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0]])
    logp = torch.tensor([[-0.5, -1.0], [-0.5, -1.0], [-0.5, -1.0]], requires_grad=True)
    prox = loglinear_proximal(logp, behav, torch.tensor([0, 1, 3]))
    # alpha = d / (d + 1): 0, 1/2, 3/4
    torch.testing.assert_close(prox, torch.tensor([[-1.0, -2.0], [-0.75, -1.5],
                                                   [-0.625, -1.25]]))
    assert not prox.requires_grad


def test_ewma_update_hand_computed():
    model = torch.nn.Linear(2, 1)
    ewma = copy.deepcopy(model)
    before = [p.detach().clone() for p in ewma.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ewma_update(ewma, model, 0.75)
    for e, b, m in zip(ewma.parameters(), before, model.parameters(), strict=True):
        torch.testing.assert_close(e, 0.75 * b + 0.25 * m)


class FakeTrainer:
    """An rlmix_update owner that moves every weight by +0.01 and bumps the version, or does
    nothing (a skipped step) when ``skip`` is set."""

    skip = False

    @rlmix.hookimpl
    def rlmix_update(self, run, loss):
        if not FakeTrainer.skip:
            with torch.no_grad():
                for p in run.policy.model.parameters():
                    p.add_(0.01)
            run.policy_version += 1
        return {}


def _ewma(run):
    return run.plugin_resources("decoupled_ppo")[dppo.EWMA]


def test_ewma_follows_optimizer_steps_and_proximal_logp_uses_it():
    run, batch = _model_run(["decoupled_ppo.ewma_decay=0.6"], extra={"trainer": FakeTrainer})
    model = run.policy.model
    start = [p.detach().clone() for p in model.parameters()]
    terms = LossTerms(loss=torch.zeros(1, 1), mask=torch.ones(1, 1))
    FakeTrainer.skip = True
    run.hook.rlmix_update(run=run, loss=terms)  # a skipped step leaves the EWMA alone
    for e, s in zip(_ewma(run).parameters(), start, strict=True):
        torch.testing.assert_close(e, s)
    FakeTrainer.skip = False
    run.hook.rlmix_update(run=run, loss=terms)
    run.hook.rlmix_update(run=run, loss=terms)
    # theta_1 = start + .01, theta_2 = start + .02: ewma = .6 (.6 s + .4 (s + .01)) + .4 (s + .02)
    for e, s in zip(_ewma(run).parameters(), start, strict=True):
        torch.testing.assert_close(e, s + 0.6 * 0.4 * 0.01 + 0.4 * 0.02, atol=1e-6, rtol=0)
    assert run.state["decoupled_ppo"]["updates"] == 2
    # the loss's proximal log-probs are the EWMA model's
    logp, entropy = run.policy.logprobs(run, batch)
    with torch.no_grad():
        expected_prox, _ = run.policy.logprobs(run, batch, model=_ewma(run))
    prox = dppo.proximal_logp(run, _minibatch(batch), logp)
    torch.testing.assert_close(prox, expected_prox)
    assert float((prox - logp.detach()).abs().max()) > 1e-4  # the policy moved past the EWMA


def test_ewma_is_restored_from_a_checkpointed_state():
    run, _ = _model_run(extra={"trainer": FakeTrainer})
    FakeTrainer.skip = False
    run.hook.rlmix_update(run=run, loss=LossTerms(loss=torch.zeros(1, 1), mask=torch.ones(1, 1)))
    saved = copy.deepcopy(run.state)  # what torch.save / torch.load of run.state give back
    expected = [p.detach().clone() for p in _ewma(run).parameters()]
    with torch.no_grad():  # a fresh process would start the EWMA from the initial weights
        for p in _ewma(run).parameters():
            p.zero_()
    run.state.clear()
    run.state.update(saved)
    restored = dppo.ewma_model(run)
    for p, e in zip(restored.parameters(), expected, strict=True):
        torch.testing.assert_close(p, e)
    assert run.state["decoupled_ppo"]["updates"] == 1


class ConstantAdvantage:
    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        return torch.ones(len(batch))


def test_recompute_stores_the_steps_starting_logp_and_keeps_it_across_updates():
    run, batch = _model_run(["decoupled_ppo.proximal=recompute"],
                            extra={"adv": ConstantAdvantage, "trainer": FakeTrainer})
    with torch.no_grad():
        start, _ = run.policy.logprobs(run, batch)
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    assert (adv == 1).all()  # the wrapper passes the owner's advantages through
    torch.testing.assert_close(batch.extras[dppo.PROX_LOGP], start)
    FakeTrainer.skip = False
    run.hook.rlmix_update(run=run, loss=LossTerms(loss=torch.zeros(1, 1), mask=torch.ones(1, 1)))
    logp, _ = run.policy.logprobs(run, batch)
    prox = dppo.proximal_logp(run, _minibatch(batch.select(list(range(4)))), logp[:4])
    torch.testing.assert_close(prox, start[:4])  # minibatch rows, the step's starting weights


def test_recompute_without_the_extras_fails_loudly():
    run = make_run({"decoupled_ppo": dppo}, ["decoupled_ppo.proximal=recompute"])
    batch = make_batch()
    batch.advantages = torch.ones(len(batch))
    logp = batch.behavior_logp.clone()
    with pytest.raises(RuntimeError, match="recompute"):
        run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                            entropy=torch.zeros_like(logp))


def test_ewma_without_a_policy_fails_loudly():
    run = make_run({"decoupled_ppo": dppo})
    batch = make_batch()
    batch.advantages = torch.ones(len(batch))
    with pytest.raises(RuntimeError, match="ewma"):
        run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=batch.behavior_logp.clone(),
                            entropy=torch.zeros_like(batch.behavior_logp))


def test_loglinear_hook_uses_version_staleness():
    run = make_run({"decoupled_ppo": dppo}, ["decoupled_ppo.proximal=loglinear",
                                             "decoupled_ppo.cap_mode=none"])
    batch = make_batch(seed=3)
    batch.advantages = torch.ones(len(batch))
    run.policy_version = 3
    batch.policy_version = torch.tensor([3, 3, 2, 2, 0, 0, 1, 1])
    mask = batch.completion_mask
    logp = (batch.behavior_logp + 0.4 * mask).requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    alpha = torch.tensor([0, 0, 1 / 2, 1 / 2, 3 / 4, 3 / 4, 2 / 3, 2 / 3])[:, None]
    prox = batch.behavior_logp + alpha * 0.4 * mask
    expected, _, _ = decoupled_loss(logp, prox, batch.behavior_logp, batch.token_advantages(),
                                    mask, 0.2, 0.2, 5.0, "none")
    torch.testing.assert_close(terms.loss * mask, expected * mask)


# ---------------------------------------------------------------- edge cases and settings


@pytest.mark.parametrize("cap_mode", ["mask", "truncate", "none"])
def test_masked_rows_and_huge_mismatch_stay_finite(cap_mode):
    run = make_run({"decoupled_ppo": dppo}, ["decoupled_ppo.proximal=loglinear",
                                             f"decoupled_ppo.cap_mode={cap_mode}"])
    batch = make_batch(n_groups=1, group_size=3, completion_len=1, seed=4)
    batch.completion_mask[1] = 0
    batch.advantages = torch.tensor([1.0, -1.0, -2.0])
    run.policy_version = 5
    logp = (batch.behavior_logp + 60.0 * batch.completion_mask).requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    value = rlmix.ops.aggregate_loss(terms.loss, terms.mask, terms.mode,
                                     _minibatch(batch).normalizers)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in terms.metrics.values())


@pytest.mark.parametrize("override", [
    "decoupled_ppo.proximal=old", "decoupled_ppo.cap_mode=clip", "decoupled_ppo.ewma_decay=1",
    "decoupled_ppo.ewma_decay=-0.1", "decoupled_ppo.cap=1.0", "decoupled_ppo.eps_low=1",
    "decoupled_ppo.eps_high=-1", "decoupled_ppo.loss_mode=sum", "decoupled_ppo.alpha=0.5",
])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="decoupled_ppo"):
        make_run({"decoupled_ppo": dppo}, [override])


def test_settings_defaults():
    s = dppo.Settings()
    assert (s.proximal, s.ewma_decay, s.eps_low, s.eps_high, s.cap, s.cap_mode,
            s.loss_mode) == ("ewma", 0.5, 0.2, 0.2, 5.0, "mask", "seq-mean-token-mean")


# ---------------------------------------------------------------- parity with verl


@pytest.mark.parity
@pytest.mark.parametrize("cap_mode, threshold", [("truncate", 2.0), ("mask", "1e-30_2.0")])
def test_parity_with_verls_decoupled_rollout_correction(cap_mode, threshold):
    # verl's decoupled mode: old_log_prob is the recomputed (proximal) policy, the rollout
    # correction weight is exp(old - rollout) truncated (TIS) or zeroed outside the bounds
    # (IcePop), multiplied into the vanilla PPO loss
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    from verl.workers.config import ActorConfig

    from rlmix import ops

    g = torch.Generator().manual_seed(5)
    n, t = 8, 6
    mask = (torch.rand(n, t, generator=g) > 0.2).float()
    mask[:, 0] = 1
    behav = -3 * torch.rand(n, t, generator=g)
    prox = behav + (2 * torch.rand(n, t, generator=g) - 1)  # weights in [1/e, e], some > 2
    logp = prox + (2 * torch.rand(n, t, generator=g) - 1)  # ratios in [1/e, e], below 3
    adv = torch.randn(n, 1, generator=g).expand(n, t)
    weights, _ = compute_rollout_correction_weights(prox - behav, mask, "token", threshold)
    config = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=0.1,
                         clip_ratio_high=0.3, ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    normalizers = Normalizers(tokens=float(mask.sum()), sequences=float(n), norm_constant=6.0)
    loss, _, w = decoupled_loss(logp, prox, behav, adv, mask, 0.1, 0.3, 2.0, cap_mode)
    torch.testing.assert_close(w * mask, weights)
    assert float(((w == 0) | (w == 2.0)).float().sum()) > 0  # the cap is exercised
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        theirs, _ = core_algos.compute_policy_loss_vanilla(prox, logp, adv, mask,
                                                            loss_agg_mode=mode, config=config,
                                                            rollout_is_weights=weights)
        torch.testing.assert_close(ops.aggregate_loss(loss, mask, mode, normalizers), theirs,
                                   atol=1e-5, rtol=1e-5)
