"""Tests of the SAT plugin: the staleness proxy, the tail and its kernel, the bounds and the loss
against hand-computed values; the paper's claims (only the sign-selected endpoint contracts,
only in the tail; the loss is PPO's on ordinary tokens and when nothing is stale; it is never
below PPO's objective); the hook's old-log-prob rule, edge cases, settings, and verl parity."""

from __future__ import annotations

import math

import pytest
import rlmix_sat
import torch
from rlmix_sat import (
    quantile,
    sat_bounds,
    sat_sequence_loss,
    sat_token_loss,
    staleness,
    tail_scale,
)

import rlmix
from rlmix.testing import make_batch, make_run
from rlmix.types import Minibatch, Normalizers


def ppo_reference(logp, old, adv, eps_low, eps_high):
    """PPO's clipped surrogate, written out independently of the plugin."""
    ratio = torch.exp(logp - old)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)


def gspo_reference(logp, old, adv, mask, eps_low, eps_high):
    """GSPO-token's loss with the nominal bounds, written out independently."""
    lengths = mask.sum(-1).clamp(min=1)
    seq = (((logp - old) * mask).sum(-1) / lengths).detach()
    ratio = torch.exp(seq[:, None] + logp - logp.detach())
    return -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)


def _minibatch(batch):
    normalizers = Normalizers(tokens=float(batch.completion_mask.sum().clamp(min=1)),
                              sequences=float(len(batch)), norm_constant=5.0)
    return Minibatch(batch=batch, normalizers=normalizers)


# ---------------------------------------------------------------- the pieces, by hand


def test_quantile_matches_torch_and_hand_values():
    v = torch.tensor([0.3, 0.0, 1.0, 0.1, 0.2])
    assert float(quantile(v, 0.5)) == pytest.approx(0.2)
    assert float(quantile(v, 0.9)) == pytest.approx(0.3 + 0.6 * 0.7)  # pos 3.6
    assert float(quantile(v, 0.0)) == 0.0 and float(quantile(v, 1.0)) == 1.0
    g = torch.Generator().manual_seed(0)
    w = torch.rand(37, generator=g)
    for q in (0.1, 0.5, 0.8, 0.9, 0.97):
        assert float(quantile(w, q)) == pytest.approx(float(torch.quantile(w, q)), abs=1e-6)
    assert float(quantile(torch.tensor([2.5]), 0.9)) == 2.5


def test_staleness_is_the_detached_sampled_log_ratio():
    logp = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -1.5, 0.0, 0.0]], requires_grad=True)
    behavior = torch.tensor([[0.0, -1.2, -1.0, -0.5], [0.0, -0.5, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    d = staleness(logp, behavior, mask, "token")
    torch.testing.assert_close(d, torch.tensor([[0.0, 0.2, -1.0, 0.0], [0.0, -1.0, 0.0, 0.0]]))
    assert not d.requires_grad
    seq = staleness(logp, behavior, mask, "sequence")
    torch.testing.assert_close(seq, torch.tensor([(0.2 - 1.0 + 0.0) / 3, -1.0]))
    empty = staleness(logp, behavior, torch.zeros_like(mask), "sequence")
    assert (empty == 0).all()


def test_tail_and_kernel_hand_computed():
    d = torch.tensor([0.0, 0.1, -0.2, 0.3, -1.0])
    valid = torch.ones(5, dtype=torch.bool)
    # |d| sorted 0 .1 .2 .3 1: median .2 = tau; the tail is .3 and 1.0
    scale, tail, tau = tail_scale(d, valid, 0.5)
    assert tau == pytest.approx(0.2)
    assert tail.tolist() == [False, False, False, True, True]
    expected = [1.0, 1.0, 1.0, math.exp(-(0.5**2)), math.exp(-(4.0**2))]  # excess / tau
    torch.testing.assert_close(scale, torch.tensor(expected))
    # the floor raises tau: only |d| = 1 stays in the tail, one tau beyond it
    scale, tail, tau = tail_scale(d, valid, 0.5, min_staleness=0.5)
    assert tau == 0.5 and tail.tolist() == [False, False, False, False, True]
    torch.testing.assert_close(scale, torch.tensor([1.0, 1.0, 1.0, 1.0, math.exp(-1.0)]))
    # invalid (masked-out) entries neither set tau nor join the tail
    valid = torch.tensor([True, True, True, True, False])
    scale, tail, tau = tail_scale(d, valid, 0.5)
    assert tau == pytest.approx(0.15) and tail.tolist() == [False, False, True, True, False]


def test_nothing_is_tail_when_nothing_is_stale():
    scale, tail, tau = tail_scale(torch.zeros(3, 4), torch.ones(3, 4, dtype=torch.bool), 0.9)
    assert not tail.any() and (scale == 1).all() and tau == 0.0
    scale, tail, _ = tail_scale(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool), 0.9)
    assert not tail.any() and (scale == 1).all()


def test_bounds_hand_computed():
    adv = torch.tensor([1.0, -1.0, 0.0, 1.0, -2.0])
    scale = torch.tensor([0.5, 0.5, 0.5, 1.0, 0.0])
    lower, upper = sat_bounds(adv, scale, eps_low=0.2, eps_high=0.3)
    torch.testing.assert_close(lower, torch.tensor([0.8, 0.9, 0.8, 0.8, 1.0]))
    torch.testing.assert_close(upper, torch.tensor([1.15, 1.3, 1.3, 1.3, 1.3]))
    lower, _ = sat_bounds(adv, scale, 0.2, 0.3, min_scale=0.25)  # the floor keeps 25% of eps
    torch.testing.assert_close(lower, torch.tensor([0.8, 0.9, 0.8, 0.8, 0.95]))


# (ratio, advantage, lower, upper, hand-computed loss, clipped branch taken)
LOSS_CASES = [
    (1.10, 1.0, 0.8, 1.05, -1.05, True),   # A > 0, contracted upper: clipped at 1.05
    (1.02, 1.0, 0.8, 1.05, -1.02, False),  # inside the contracted interval
    (0.85, -1.0, 0.9, 1.2, 0.9, True),     # A < 0, contracted lower: clipped at 0.9
    (0.95, -2.0, 0.9, 1.2, 1.9, False),
    (1.50, -1.0, 0.9, 1.2, 1.5, False),    # A < 0 above the upper: unclipped (larger loss)
]


def test_token_loss_hand_computed_with_gradients():
    ratio = torch.tensor([c[0] for c in LOSS_CASES], dtype=torch.float64)
    adv = torch.tensor([c[1] for c in LOSS_CASES], dtype=torch.float64)
    lower = torch.tensor([c[2] for c in LOSS_CASES], dtype=torch.float64)
    upper = torch.tensor([c[3] for c in LOSS_CASES], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    logp = (old + ratio.log()).requires_grad_(True)
    loss, clipped = sat_token_loss(logp, old, adv, lower, upper)
    torch.testing.assert_close(loss, torch.tensor([c[4] for c in LOSS_CASES],
                                                  dtype=torch.float64))
    assert clipped.tolist() == [c[5] for c in LOSS_CASES]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.where(clipped, torch.zeros_like(adv),
                                                      -ratio * adv))


# ---------------------------------------------------------------- the claims


def _stale_case(seed=0, n=6, t=8):
    """Random log-probs, a behaviour policy equal to them except on a few very stale tokens,
    and mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(n, t, generator=g, dtype=torch.float64)
    behavior = logp + 0.02 * torch.randn(n, t, generator=g, dtype=torch.float64)
    stale = torch.zeros(n, t, dtype=torch.bool)
    stale[torch.arange(n), torch.randint(0, t, (n,), generator=g)] = True
    behavior = torch.where(stale, logp - 0.6 * torch.sign(torch.randn(n, t, generator=g,
                                                                       dtype=torch.float64)),
                           behavior)
    adv = torch.randn(n, 1, generator=g, dtype=torch.float64).expand(n, t).contiguous()
    return logp, behavior, adv, stale


def test_only_the_sign_selected_endpoint_contracts_and_only_in_the_tail():
    logp, behavior, adv, stale = _stale_case()
    mask = torch.ones_like(logp)
    d = staleness(logp, behavior, mask)
    scale, tail, _ = tail_scale(d, mask > 0, 0.8)
    assert torch.equal(tail & stale, stale) and tail.any()  # the stale tokens are in the tail
    lower, upper = sat_bounds(adv, scale, 0.2, 0.28)
    nominal_lower, nominal_upper = 0.8, 1.28
    contracted_upper = upper < nominal_upper
    contracted_lower = lower > nominal_lower
    assert torch.equal(contracted_upper, tail & (adv > 0))
    assert torch.equal(contracted_lower, tail & (adv < 0))
    assert not (contracted_upper & contracted_lower).any()  # never both endpoints
    assert (lower[~contracted_lower] == nominal_lower).all()
    assert (upper[~contracted_upper] == nominal_upper).all()
    # the contracted interval stays inside the nominal one (local interval containment)
    assert (lower >= nominal_lower).all() and (upper <= nominal_upper).all()
    assert (lower <= 1).all() and (upper >= 1).all()


def test_ordinary_tokens_keep_ppos_loss_and_the_objective_is_never_above_ppos():
    logp, behavior, adv, _ = _stale_case(seed=1)
    mask = torch.ones_like(logp)
    scale, tail, _ = tail_scale(staleness(logp, behavior, mask), mask > 0, 0.8)
    lower, upper = sat_bounds(adv, scale, 0.2, 0.28)
    # the ratio against the behaviour log-probs (several updates, or stale samples)
    current = (logp + 0.1).requires_grad_(True)  # a policy that moved since
    ours, _ = sat_token_loss(current, behavior, adv, lower, upper)
    theirs = ppo_reference(current, behavior, adv, 0.2, 0.28)
    torch.testing.assert_close(ours[~tail], theirs[~tail])
    assert (ours >= theirs - 1e-12).all()  # pointwise pessimism: loss >= PPO's loss
    assert (ours > theirs + 1e-6).any()  # and SAT does intercept some outward band here
    g_ours, = torch.autograd.grad(ours.sum(), current)
    g_theirs, = torch.autograd.grad(theirs.sum(), current)
    torch.testing.assert_close(g_ours[~tail], g_theirs[~tail])


@pytest.mark.parametrize("case", ["behaviour_is_current", "below_the_floor"])
def test_hook_equals_the_ppo_surrogate_when_nothing_is_stale(case):
    # behaviour_is_current: staleness 0 everywhere (and so a ratio of 1);
    # below_the_floor: a random mismatch (ratios far from 1, many clipped) that min_staleness
    # declares ordinary
    floor = "0.0" if case == "behaviour_is_current" else "10.0"
    run = make_run({"sat": rlmix_sat}, ["sat.eps_low=0.1", "sat.eps_high=0.3",
                                        "sat.old_logp=behavior", f"sat.min_staleness={floor}"])
    batch = make_batch(seed=2)
    g = torch.Generator().manual_seed(3)
    batch.advantages = torch.randn(len(batch), generator=g)
    mask = batch.completion_mask
    current = batch.behavior_logp.clone()
    if case == "below_the_floor":
        current = current + 0.5 * torch.randn(current.shape, generator=g) * mask
    logp = current.requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    expected = ppo_reference(logp, batch.behavior_logp, batch.token_advantages(), 0.1, 0.3)
    torch.testing.assert_close(terms.loss * mask, expected * mask)
    assert terms.metrics["sat/tail_fraction"] == 0.0
    assert terms.metrics["sat/extra_clip_fraction"] == 0.0
    if case == "below_the_floor":
        assert terms.metrics["clip/fraction"] > 0.1
    g1, = torch.autograd.grad((terms.loss * mask).sum(), logp)
    g2, = torch.autograd.grad((expected * mask).sum(), logp)
    torch.testing.assert_close(g1, g2)


def test_hook_equals_grpos_clipped_surrogate_on_ordinary_tokens():
    rlmix_grpo = pytest.importorskip("rlmix_grpo")
    run = make_run({"grpo": rlmix_grpo, "sat": rlmix_sat},
                   ["sat.old_logp=behavior", "sat.tail_quantile=0.8"])
    batch = make_batch(n_groups=3, group_size=4, completion_len=8, seed=4,
                       rewards=torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 1]))
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    g = torch.Generator().manual_seed(5)
    mask = batch.completion_mask
    logp = (batch.behavior_logp + 0.05 * torch.randn(mask.shape, generator=g) * mask)
    logp[0, -1] = logp[0, -1] + 0.8 * mask[0, -1]  # a few very stale tokens
    logp = logp.requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    theirs, _ = rlmix_grpo.clipped_surrogate(logp, batch.behavior_logp,
                                             batch.token_advantages(), 0.2, 0.2)
    d = (logp.detach() - batch.behavior_logp).abs() * mask
    _, tail, _ = tail_scale(d, mask > 0, 0.8)
    ordinary = (mask > 0) & ~tail
    torch.testing.assert_close(terms.loss[ordinary], theirs[ordinary])
    assert (terms.loss.detach() >= theirs.detach() - 1e-7)[mask > 0].all()


def test_sequence_level_contracts_per_row_and_equals_gspo_without_staleness():
    g = torch.Generator().manual_seed(6)
    n, t = 6, 5
    mask = torch.ones(n, t, dtype=torch.float64)
    mask[0, 3:] = 0
    logp = (-2 * torch.rand(n, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = logp.detach() + 0.01 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5, 1.0, -1.0], dtype=torch.float64)[:, None].expand(
        n, t)
    nominal = sat_bounds(adv, torch.ones_like(adv), 3e-3, 4e-3)
    ours, _ = sat_sequence_loss(logp, old, adv, mask, *nominal)
    theirs = gspo_reference(logp, old, adv, mask, 3e-3, 4e-3)
    torch.testing.assert_close(ours * mask, theirs * mask)
    ga, = torch.autograd.grad((ours * mask).sum(), logp)
    gb, = torch.autograd.grad((theirs * mask).sum(), logp)
    torch.testing.assert_close(ga, gb)
    # rows 1 and 2 very stale: their sign-selected endpoint contracts for the whole row
    behavior = logp.detach().clone()
    behavior[1] -= 0.5
    behavior[2] += 0.5
    d = staleness(logp, behavior, mask, "sequence")
    scale, tail, _ = tail_scale(d, mask.sum(-1) > 0, 0.5)
    assert tail.tolist() == [False, True, True, False, False, False]
    lower, upper = sat_bounds(adv, scale[:, None].expand(n, t), 3e-3, 4e-3)
    assert (lower[1] > 1 - 3e-3).all() and (upper[1] == 1 + 4e-3).all()  # A < 0: lower
    assert (upper[2] < 1 + 4e-3).all() and (lower[2] == 1 - 3e-3).all()  # A > 0: upper
    others = torch.tensor([0, 3, 4, 5])
    assert (lower[others] == 1 - 3e-3).all() and (upper[others] == 1 + 4e-3).all()


def test_sequence_hook_runs_and_reports_the_tail():
    run = make_run({"sat": rlmix_sat}, ["sat.level=sequence", "sat.old_logp=behavior",
                                        "sat.tail_quantile=0.5"])
    batch = make_batch(seed=7)
    batch.advantages = torch.tensor([1.0, -1.0] * 4)
    logp = batch.behavior_logp.clone()
    logp[0] += 0.4 * batch.completion_mask[0]
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp.requires_grad_(True),
                                entropy=torch.zeros_like(logp))
    rows_in_tail = (terms.metrics["sat/tail_fraction"] > 0)
    assert rows_in_tail and torch.isfinite(terms.loss).all()
    assert terms.metrics["sat/mean_scale"] < 1.0


# ---------------------------------------------------------------- the hook's other choices


@pytest.mark.parametrize("overrides, uses_behavior", [
    ([], False),                                  # auto, one update, fresh: detached
    (["train.epochs=2"], True),                   # auto, several optimizer steps: behaviour
    (["sat.old_logp=behavior"], True),
    (["sat.old_logp=detached", "train.epochs=2"], False),
])
def test_old_logp_rule_is_grpos(overrides, uses_behavior):
    run = make_run({"sat": rlmix_sat}, ["sat.tail_quantile=1.0", *overrides])  # no tail
    batch = make_batch(seed=8)
    batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))
    logp = -3 * torch.rand(batch.tokens.shape, generator=torch.Generator().manual_seed(9))
    logp = logp * batch.completion_mask
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    old = batch.behavior_logp if uses_behavior else logp
    torch.testing.assert_close(terms.loss, ppo_reference(logp, old, batch.token_advantages(),
                                                         0.2, 0.2))


def test_stale_policy_version_uses_the_behaviour_logp():
    run = make_run({"sat": rlmix_sat}, ["sat.tail_quantile=1.0"])
    batch = make_batch(seed=10)
    batch.advantages = torch.ones(len(batch))
    run.policy_version = 2
    batch.policy_version[:3] = 1
    logp = batch.behavior_logp + 0.3 * batch.completion_mask
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    torch.testing.assert_close(terms.loss, ppo_reference(logp, batch.behavior_logp,
                                                         batch.token_advantages(), 0.2, 0.2))
    assert terms.metrics["clip/fraction"] > 0  # exp(.3) > 1.2: clipped


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_rows_single_tokens_and_empty_minibatches_stay_finite(level):
    run = make_run({"sat": rlmix_sat}, [f"sat.level={level}", "sat.old_logp=behavior"])
    batch = make_batch(n_groups=1, group_size=3, completion_len=1, seed=11)
    batch.completion_mask[1] = 0  # a fully masked row
    batch.advantages = torch.tensor([1.0, -1.0, -2.0])
    logp = batch.behavior_logp + 5.0 * batch.completion_mask
    logp = logp.requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    value = rlmix.ops.aggregate_loss(terms.loss, terms.mask, terms.mode, _minibatch(batch)
                                     .normalizers)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in terms.metrics.values())
    batch.completion_mask.zero_()
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp.detach(),
                                entropy=torch.zeros_like(logp))
    assert all(math.isfinite(v) for v in terms.metrics.values())
    assert terms.metrics["sat/tail_fraction"] == 0.0


@pytest.mark.parametrize("override", [
    "sat.level=step", "sat.eps_low=1.0", "sat.eps_high=-0.1", "sat.tail_quantile=1.5",
    "sat.min_staleness=-1", "sat.min_scale=2", "sat.loss_mode=sum", "sat.old_logp=old",
    "sat.tau=0.1",
])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="sat"):
        make_run({"sat": rlmix_sat}, [override])


def test_settings_defaults():
    s = rlmix_sat.Settings()
    assert (s.level, s.eps_low, s.eps_high, s.tail_quantile, s.min_staleness, s.min_scale,
            s.loss_mode, s.old_logp) == ("token", 0.2, 0.2, 0.9, 0.0, 0.0,
                                         "seq-mean-token-mean", "auto")


# ---------------------------------------------------------------- parity with verl


@pytest.mark.parity
def test_parity_with_verl_when_nothing_is_stale():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from verl.workers.config import ActorConfig

    from rlmix import ops

    g = torch.Generator().manual_seed(12)
    n, t = 8, 6
    mask = (torch.rand(n, t, generator=g) > 0.2).float()
    mask[:, 0] = 1
    old = -3 * torch.rand(n, t, generator=g)
    logp = old + (2 * torch.rand(n, t, generator=g) - 1)  # ratios in [1/e, e], below 3
    adv = torch.randn(n, 1, generator=g).expand(n, t)
    config = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=0.1,
                         clip_ratio_high=0.3, ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    normalizers = Normalizers(tokens=float(mask.sum()), sequences=float(n), norm_constant=6.0)
    nominal = sat_bounds(adv, torch.ones_like(adv), 0.1, 0.3)
    loss, _ = sat_token_loss(logp, old, adv, *nominal)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        theirs, _ = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask,
                                                            loss_agg_mode=mode, config=config)
        torch.testing.assert_close(ops.aggregate_loss(loss, mask, mode, normalizers), theirs,
                                   atol=1e-5, rtol=1e-5)
    seq_loss, _ = sat_sequence_loss(logp, old, adv, mask, *nominal)
    theirs, _ = core_algos.compute_policy_loss_gspo(old, logp, adv, mask,
                                                     loss_agg_mode="seq-mean-token-mean",
                                                     config=config)
    torch.testing.assert_close(ops.aggregate_loss(seq_loss, mask, "seq-mean-token-mean",
                                                  normalizers), theirs, atol=1e-5, rtol=1e-5)
