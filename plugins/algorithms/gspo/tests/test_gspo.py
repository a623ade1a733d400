"""Tests of the GSPO plugin: the sequence ratio against hand-computed values, the token form
against a direct implementation of the paper's sequence objective (value and gradient), edge
cases, the hook's old-logp rule, settings, a property of the paper's claim, and parity with verl
and TRL when they are installed."""

from __future__ import annotations

import math
import types

import pytest
import rlmix_gspo
import torch
from rlmix_gspo import gspo_token_loss, sequence_log_ratio

import rlmix
from rlmix import ops
from rlmix.testing import ToyPolicy, make_batch, make_run, toy_train
from rlmix.types import Minibatch, Normalizers


def _norm(mask: torch.Tensor) -> Normalizers:
    return Normalizers(tokens=float(mask.sum().clamp(min=1)), sequences=float(mask.shape[0]),
                       norm_constant=float(mask.shape[1]))


def _sequence_objective(logp, old, adv, mask, eps_low, eps_high):
    """The paper's objective written directly: s_i = exp(mean_t(logp - old)) over the row's
    tokens, loss = mean_i -min(s_i A_i, clip(s_i) A_i). Independent of the token form."""
    lengths = mask.sum(-1)
    s = torch.exp(((logp - old) * mask).sum(-1) / lengths)
    return (-torch.minimum(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv)).mean()


# ---------------------------------------------------------------- sequence_log_ratio


def test_sequence_log_ratio_is_the_length_normalised_sum_hand_computed():
    logp = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -1.0, -9.0, -9.0]])
    old = torch.tensor([[0.0, -1.3, -1.5, -0.2], [0.0, -0.4, 5.0, 5.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    # row 0: (0.3 - 0.5 - 0.3) / 3; row 1: only the -0.6 token counts (masked garbage ignored)
    expected = torch.tensor([(0.3 - 0.5 - 0.3) / 3, -0.6])
    torch.testing.assert_close(sequence_log_ratio(logp, old, mask), expected)


def test_sequence_ratio_is_the_geometric_mean_of_the_token_ratios():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 6, generator=g, dtype=torch.float64)
    old = -torch.rand(3, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 6, dtype=torch.float64)
    token_ratios = torch.exp(logp - old)
    geometric = token_ratios.prod(-1) ** (1 / 6)
    torch.testing.assert_close(sequence_log_ratio(logp, old, mask).exp(), geometric)


# ---------------------------------------------------------------- gspo_token_loss

EPS_LOW, EPS_HIGH = 0.1, 0.3  # wide, asymmetric bounds: 0.9 and 1.3


def _rows_with_sequence_ratios(seq_ratios, length=4, seed=0):
    """Rows whose token log-ratios vary (some far outside the bounds) but average to
    log(seq_ratio): a token-level clip would act on them, a sequence-level one must not."""
    g = torch.Generator().manual_seed(seed)
    n = len(seq_ratios)
    noise = torch.randn(n, length, generator=g, dtype=torch.float64)
    noise = noise - noise.mean(-1, keepdim=True)
    log_r = torch.log(torch.tensor(seq_ratios, dtype=torch.float64))[:, None] + noise
    old = -torch.rand(n, length, generator=g, dtype=torch.float64) - 0.5
    return old + log_r, old


def test_every_token_carries_the_sequence_ratio_and_the_sequence_clip_decision():
    # (sequence ratio, advantage, hand-computed per-token loss, clipped)
    cases = [(1.1, 1.0, -1.1, False), (1.5, 1.0, -1.3, True), (0.5, 1.0, -0.5, False),
             (0.5, -1.0, 0.9, True), (1.5, -2.0, 3.0, False), (0.95, -2.0, 1.9, False)]
    logp, old = _rows_with_sequence_ratios([c[0] for c in cases])
    adv = torch.tensor([c[1] for c in cases], dtype=torch.float64)[:, None].expand_as(logp)
    mask = torch.ones_like(logp)
    loss, clipped, s = gspo_token_loss(logp, old, adv, mask, EPS_LOW, EPS_HIGH)
    torch.testing.assert_close(s, torch.tensor([c[0] for c in cases], dtype=torch.float64))
    expected = torch.tensor([c[2] for c in cases], dtype=torch.float64)[:, None].expand_as(logp)
    torch.testing.assert_close(loss, expected)
    assert clipped.tolist() == [[c[3]] * 4 for c in cases]
    # the token ratios themselves leave [0.9, 1.3] in most rows: a token-level clip would differ
    token_ratio = torch.exp(logp - old)
    assert ((token_ratio < 0.9) | (token_ratio > 1.3)).sum() > 6


def test_token_form_reproduces_the_sequence_objective_value_and_gradient():
    mode = "seq-mean-token-mean"
    seq_ratios = [1.1, 1.5, 0.5, 0.5, 1.5, 0.95, 1.0, 1.25]
    logp, old = _rows_with_sequence_ratios(seq_ratios, length=6, seed=1)
    mask = torch.ones_like(logp)
    mask[1, 4:] = 0  # ragged rows: the normalisation is by each row's own length
    mask[5, 2:] = 0
    logp = torch.where(mask > 0, logp, torch.zeros_like(logp))
    old = torch.where(mask > 0, old, torch.zeros_like(old))
    adv_row = torch.tensor([1.0, 1.0, 1.0, -1.0, -2.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    adv = adv_row[:, None].expand_as(logp)

    ours_logp = logp.clone().requires_grad_(True)
    loss, _, _ = gspo_token_loss(ours_logp, old, adv, mask, EPS_LOW, EPS_HIGH)
    value = ops.aggregate_loss(loss, mask, mode, _norm(mask))
    value.backward()

    ref_logp = logp.clone().requires_grad_(True)
    reference = _sequence_objective(ref_logp, old, adv_row, mask, EPS_LOW, EPS_HIGH)
    reference.backward()
    torch.testing.assert_close(value, reference)
    torch.testing.assert_close(ours_logp.grad, ref_logp.grad)
    # some rows are clipped (zero gradient) and some are not: both branches were exercised
    row_grad = ours_logp.grad.abs().sum(-1)
    assert (row_grad == 0).sum() >= 2 and (row_grad > 0).sum() >= 4


def test_token_mean_weights_sequences_by_length_and_differs_from_the_objective():
    logp, old = _rows_with_sequence_ratios([1.05, 1.05], length=6, seed=2)
    mask = torch.ones_like(logp)
    mask[0, 2:] = 0
    adv_row = torch.tensor([1.0, -1.0], dtype=torch.float64)
    adv = adv_row[:, None].expand_as(logp)
    loss, _, _ = gspo_token_loss(logp, old, adv, mask, EPS_LOW, EPS_HIGH)
    seq = ops.aggregate_loss(loss, mask, "seq-mean-token-mean", _norm(mask))
    tok = ops.aggregate_loss(loss, mask, "token-mean", _norm(mask))
    torch.testing.assert_close(seq, _sequence_objective(logp, old, adv_row, mask, 0.1, 0.3))
    assert abs(float(seq - tok)) > 1e-3


def test_agreeing_group_zero_advantage_gives_zero_loss_and_zero_gradient():
    logp, old = _rows_with_sequence_ratios([1.2, 0.7, 1.0])
    logp.requires_grad_(True)
    mask = torch.ones_like(logp)
    loss, clipped, _ = gspo_token_loss(logp, old, torch.zeros_like(logp), mask, 3e-4, 4e-4)
    ops.aggregate_loss(loss, mask, "seq-mean-token-mean", _norm(mask)).backward()
    assert torch.isfinite(loss).all() and (loss == 0).all() and not clipped.any()
    assert (logp.grad == 0).all()


def test_a_single_token_row_is_token_level_ppo():
    old = torch.tensor([[0.0, -1.0], [0.0, -1.0], [0.0, -1.0]], dtype=torch.float64)
    ratios = torch.tensor([1.2, 1.5, 0.5], dtype=torch.float64)
    logp = old.clone()
    logp[:, 1] = old[:, 1] + ratios.log()
    logp.requires_grad_(True)
    mask = torch.tensor([[0.0, 1.0]] * 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    loss, clipped, _ = gspo_token_loss(logp, old, adv, mask, EPS_LOW, EPS_HIGH)
    # ppo: -min(r A, clip(r) A): 1.2 inside, 1.5 clipped at 1.3, 0.5 with A < 0 clipped at 0.9
    torch.testing.assert_close(loss[:, 1], torch.tensor([-1.2, -1.3, 0.9], dtype=torch.float64))
    assert clipped[:, 1].tolist() == [False, True, True]
    (loss * mask).sum().backward()
    torch.testing.assert_close(logp.grad[:, 1], torch.tensor([-1.2, 0.0, 0.0],
                                                             dtype=torch.float64))


def test_a_fully_masked_row_is_finite_carries_no_gradient_and_leaves_others_alone():
    logp, old = _rows_with_sequence_ratios([1.1, 0.9, 1.0], length=5, seed=4)
    mask = torch.ones_like(logp)
    mask[2] = 0
    adv = torch.tensor([1.0, -1.0, 5.0], dtype=torch.float64)[:, None].expand_as(logp)
    x = logp.clone().requires_grad_(True)
    loss, clipped, s = gspo_token_loss(x, old, adv, mask, EPS_LOW, EPS_HIGH)
    value = ops.aggregate_loss(loss, mask, "seq-mean-token-mean", _norm(mask))
    value.backward()
    assert torch.isfinite(loss).all() and torch.isfinite(x.grad).all()
    assert float(s[2]) == 1.0 and (x.grad[2] == 0).all()
    alone = x.detach()[:2].clone().requires_grad_(True)
    loss2, _, _ = gspo_token_loss(alone, old[:2], adv[:2], mask[:2], EPS_LOW, EPS_HIGH)
    # same per-sequence losses; the masked row counts as a sequence in the normaliser (3 vs 2)
    value2 = ops.aggregate_loss(loss2, mask[:2], "seq-mean-token-mean", _norm(mask[:2]))
    torch.testing.assert_close(value * 3, value2 * 2)


def test_a_huge_ratio_stays_finite():
    logp = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float32, requires_grad=True)
    old = torch.tensor([[-200.0, -200.0, -200.0]])
    mask = torch.ones(1, 3)
    loss, _, _ = gspo_token_loss(logp, old, -torch.ones(1, 3), mask, 0.2, 0.2)
    (loss * mask).sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
    assert float(loss.detach()[0, 0]) == pytest.approx(math.exp(rlmix_gspo.LOG_RATIO_CAP), rel=1e-5)


# ---------------------------------------------------------------- the hook through a fake run


def _minibatch(batch):
    return Minibatch(batch=batch, normalizers=_norm(batch.completion_mask))


def _random_logp(batch, seed=5, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return (batch.behavior_logp
            + scale * torch.randn(batch.tokens.shape, generator=g)) * batch.completion_mask


def _advantages(batch):
    return batch.rewards - ops.group_mean(batch.rewards, batch.group)


def test_clip_hook_single_update_uses_detached_logp_ratio_one():
    run = make_run({"gspo": rlmix_gspo})
    batch = make_batch()
    batch.advantages = _advantages(batch)
    logp = _random_logp(batch).requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.full_like(logp, 2.0))
    assert terms.mode == "seq-mean-token-mean"
    adv = batch.token_advantages()
    torch.testing.assert_close(terms.loss, -adv)
    value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, _minibatch(batch).normalizers)
    value.backward()
    # gradient of mean_i -A_i s_i at s = 1: -A_i / (N |y_i|) on each token of row i
    lengths = batch.completion_mask.sum(-1, keepdim=True)
    torch.testing.assert_close(logp.grad, -adv * batch.completion_mask / lengths / len(batch))
    assert terms.metrics["clip/fraction"] == 0.0
    assert terms.metrics["gspo/seq_ratio_mean"] == pytest.approx(1.0)
    assert terms.metrics["entropy"] == pytest.approx(2.0)


@pytest.mark.parametrize("overrides, uses_behavior", [
    (["train.epochs=2"], True),
    (["train.updates_per_epoch=2"], True),
    (["gspo.old_logp=behavior"], True),
    (["gspo.old_logp=detached", "train.epochs=2"], False),
    ([], False),
])
def test_clip_hook_old_logp_rule(overrides, uses_behavior):
    run = make_run({"gspo": rlmix_gspo}, ["gspo.eps_low=0.05", "gspo.eps_high=0.1", *overrides])
    batch = make_batch()
    batch.advantages = _advantages(batch)
    logp = _random_logp(batch)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    old = batch.behavior_logp if uses_behavior else logp
    expected, clipped, s = gspo_token_loss(logp, old, batch.token_advantages(),
                                           batch.completion_mask, 0.05, 0.1)
    torch.testing.assert_close(terms.loss, expected)
    frac = float(ops.masked_mean(clipped.float(), batch.completion_mask))
    assert terms.metrics["clip/fraction"] == pytest.approx(frac)
    if uses_behavior:
        assert frac > 0 and terms.metrics["gspo/seq_ratio_mean"] != pytest.approx(1.0)


def test_auto_takes_behaviour_logp_when_a_sample_is_of_an_older_version():
    run = make_run({"gspo": rlmix_gspo})
    batch = make_batch()
    batch.advantages = _advantages(batch)
    logp = _random_logp(batch)
    run.policy_version = 3
    batch.policy_version[:] = 3
    batch.policy_version[1] = 2
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    expected, _, _ = gspo_token_loss(logp, batch.behavior_logp, batch.token_advantages(),
                                     batch.completion_mask, 3e-4, 4e-4)
    torch.testing.assert_close(terms.loss, expected)


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("override", ["gspo.eps_low=1.0", "gspo.eps_low=-0.1",
                                      "gspo.eps_high=-1", "gspo.loss_mode=mean",
                                      "gspo.old_logp=old", "gspo.clip=0.2"])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="gspo"):
        make_run({"gspo": rlmix_gspo}, [override])


def test_settings_defaults_are_the_papers():
    s = rlmix_gspo.Settings()
    assert (s.eps_low, s.eps_high, s.loss_mode, s.old_logp) == (
        3e-4, 4e-4, "seq-mean-token-mean", "auto")


# ---------------------------------------------------------------- the claim


def test_sequence_ratio_noise_shrinks_with_length_where_token_ratios_do_not():
    # the paper's argument: token-level ratios are single-sample weights whose noise does not
    # average out, so they are clipped (and their gradient dropped) at random; the sequence ratio
    # is a length-normalised mean whose noise falls like 1/sqrt(|y|)
    g = torch.Generator().manual_seed(0)
    sigma = 0.02  # per-token log-ratio noise, e.g. a trainer/sampler mismatch
    fractions = {}
    for length in (4, 64, 1024):
        noise = sigma * torch.randn(2000, length, generator=g, dtype=torch.float64)
        log_s = sequence_log_ratio(noise, torch.zeros_like(noise), torch.ones_like(noise))
        assert float(log_s.std()) == pytest.approx(sigma / math.sqrt(length), rel=0.1)
        token_clip = float((noise.abs() > math.log(1 + 4e-3)).double().mean())
        seq_clip = float((log_s.abs() > math.log(1 + 4e-3)).double().mean())
        fractions[length] = (token_clip, seq_clip)
    assert all(abs(t - fractions[4][0]) < 0.05 for t, _ in fractions.values())  # stays high
    assert fractions[4][0] > 0.8 and fractions[1024][1] < 0.01  # the sequence ratio is clean


class GroupCentred:
    """A local advantage owner (r - group mean) so the test needs no other plugin."""

    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        return batch.rewards - ops.group_mean(batch.rewards, batch.group)


class ZeroAdvantage:
    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        return torch.zeros(len(batch))


def _fraction_of_zeros(batch):
    return (batch.tokens[:, 1:] == 0).float().mean(-1)


def test_gspo_learns_the_toy_task_and_beats_zero_advantage():
    steps = 150
    history = toy_train(make_run({"adv": GroupCentred, "gspo": rlmix_gspo}),
                        ToyPolicy(vocab=6, length=4, seed=0), _fraction_of_zeros, steps=steps)
    baseline = toy_train(make_run({"adv": ZeroAdvantage, "gspo": rlmix_gspo}),
                         ToyPolicy(vocab=6, length=4, seed=0), _fraction_of_zeros, steps=steps)
    assert sum(history[:3]) / 3 < 0.4
    assert sum(history[-20:]) / 20 > 0.85
    assert sum(baseline[-20:]) / 20 < 0.4


# ---------------------------------------------------------------- parity


def _parity_inputs(seed=7):
    g = torch.Generator().manual_seed(seed)
    n, t = 12, 9
    mask = torch.ones(n, t)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    old = -3 * torch.rand(n, t, generator=g)
    # per-row offsets put some sequence ratios outside [1 - 0.1, 1 + 0.15], some inside
    offsets = 0.4 * torch.randn(n, 1, generator=g)
    logp = old + offsets + 0.3 * torch.randn(n, t, generator=g)
    adv = torch.randn(n, 1, generator=g).expand(n, t).contiguous()
    return logp, old, adv, mask


@pytest.mark.parity
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_parity_with_verl_compute_policy_loss_gspo(mode):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from verl.workers.config import ActorConfig

    logp, old, adv, mask = _parity_inputs()
    config = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=0.1,
                         clip_ratio_high=0.15, ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    theirs_logp = logp.clone().requires_grad_(True)
    theirs, metrics = core_algos.compute_policy_loss_gspo(old, theirs_logp, adv, mask,
                                                          loss_agg_mode=mode, config=config)
    theirs.backward()
    ours_logp = logp.clone().requires_grad_(True)
    loss, clipped, _ = gspo_token_loss(ours_logp, old, adv, mask, 0.1, 0.15)
    ours = ops.aggregate_loss(loss, mask, mode, _norm(mask))
    ours.backward()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, atol=1e-5, rtol=1e-5)
    assert float(ops.masked_mean(clipped.float(), mask)) == pytest.approx(
        metrics["actor/pg_clipfrac"], abs=1e-6)
    assert 0 < metrics["actor/pg_clipfrac"] < 1


@pytest.mark.parity
def test_parity_with_trl_grpo_trainer_sequence_importance_sampling():
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from rlmix.testing.peers import trl_grpo_trainer

    trainer, _ = trl_grpo_trainer(None, "grpo", 4, importance_sampling_level="sequence",
                                  epsilon=0.1, epsilon_high=0.15)
    logp, old, adv, mask = _parity_inputs()
    n, t = logp.shape
    theirs_logp = logp.clone().requires_grad_(True)

    def fixed_logps(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        # the harness replaces only the model forward; TRL's own loss code runs on our inputs
        return theirs_logp, torch.zeros_like(theirs_logp), None

    trainer._get_per_token_logps_and_entropies = types.MethodType(fixed_logps, trainer)
    inputs = {"prompt_ids": torch.zeros(n, 2, dtype=torch.long),
              "prompt_mask": torch.ones(n, 2, dtype=torch.long),
              "completion_ids": torch.zeros(n, t, dtype=torch.long),
              "completion_mask": mask.long(), "advantages": adv[:, 0].clone(),
              "old_per_token_logps": old}
    theirs = trainer._compute_loss(trainer.model, inputs)
    theirs.backward()
    ours_logp = logp.clone().requires_grad_(True)
    loss, _, _ = gspo_token_loss(ours_logp, old, adv, mask, 0.1, 0.15)
    ours = ops.aggregate_loss(loss, mask, "seq-mean-token-mean", _norm(mask))
    ours.backward()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, atol=1e-5, rtol=1e-5)
    assert (ours_logp.grad.abs().sum(-1) == 0).any()  # some sequences clipped in both
