"""Tests of the CISPO plugin: its math by hand, its hook through a fake run, its settings, the
paper's claim (no token's gradient is dropped, so stale batches still teach) on the toy policy,
and parity with verl and TRL when installed."""

from __future__ import annotations

import pytest
import rlmix_cispo
import torch
from rlmix_cispo import cispo_loss, is_weight

import rlmix
from rlmix import ops
from rlmix.testing import ToyPolicy, make_batch, make_run, toy_train
from rlmix.testing.peers import completion_logprobs as _completion_logp
from rlmix.testing.peers import pop_grads as _grads
from rlmix.testing.peers import trl_grpo_trainer
from rlmix.types import Minibatch, Normalizers, RolloutBatch

# (ratio, advantage, logp, weight with the defaults: no lower bound, upper 1 + 4 = 5)
CASES = [
    (1.0, 2.0, -1.0, 1.0),
    (0.1, 2.0, -2.0, 0.1),  # far below 1: not clipped by default
    (3.0, -1.5, -0.5, 3.0),
    (7.0, 1.0, -0.2, 5.0),  # above 5: clipped to 5
    (7.0, -1.0, -0.2, 5.0),  # the cap applies whatever the advantage's sign
]


def test_cispo_loss_and_gradient_by_hand():
    ratio = torch.tensor([c[0] for c in CASES], dtype=torch.float64)
    adv = torch.tensor([c[1] for c in CASES], dtype=torch.float64)
    logp = torch.tensor([c[2] for c in CASES], dtype=torch.float64, requires_grad=True)
    weight = torch.tensor([c[3] for c in CASES], dtype=torch.float64)
    old = logp.detach() - ratio.log()
    loss, clipped = cispo_loss(logp, old, adv, 1.0, 4.0)
    torch.testing.assert_close(loss.detach(), -weight * adv * logp.detach())
    assert clipped.tolist() == [False, False, False, True, True]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -weight * adv)  # the weight carries no gradient


def test_two_sided_bounds_as_verl_clips_them():
    ratio = torch.tensor([0.5, 0.9, 1.1, 1.5], dtype=torch.float64)
    old = torch.zeros_like(ratio)
    weight, clipped = is_weight(ratio.log(), old, 0.2, 0.28)
    torch.testing.assert_close(weight, torch.tensor([0.8, 0.9, 1.1, 1.28], dtype=torch.float64))
    assert clipped.tolist() == [True, False, False, True]
    weight, clipped = is_weight(ratio.log(), old, 1.5, 0.28)  # eps_low > 1: no lower bound
    torch.testing.assert_close(weight[0], torch.tensor(0.5, dtype=torch.float64))
    assert not clipped[0]


def test_extreme_ratios_stay_finite():
    logp = torch.tensor([-0.01, -80.0, -5.0], requires_grad=True)
    old = torch.tensor([-95.0, -0.01, -5.0])  # ratios e^95, e^-80, 1
    loss, clipped = cispo_loss(logp, old, torch.ones(3), 1.0, 4.0)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
    torch.testing.assert_close(logp.grad, -torch.tensor([5.0, torch.exp(torch.tensor(-79.99)),
                                                         1.0]))
    assert clipped.tolist() == [True, False, False]


def test_where_ppo_drops_a_token_cispo_keeps_its_gradient():
    g = torch.Generator().manual_seed(0)
    old = -3 * torch.rand(200, generator=g, dtype=torch.float64)
    logp = (old + 1.2 * torch.randn(200, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(200, generator=g, dtype=torch.float64)
    ratio = torch.exp(logp.detach() - old)
    ppo = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    # PPO's loss through logp: r = exp(logp - old), so the gradient flows where unclipped
    ppo_taken = ratio.clamp(0.8, 1.28) * adv < ratio * adv
    ppo_grad = torch.where(ppo_taken, 0.0, -ratio * adv)
    loss, _ = cispo_loss(logp, old, adv, 1.0, 4.0)
    loss.sum().backward()
    assert ppo_taken.float().mean() > 0.2  # many tokens PPO ignores
    assert (ppo_grad[ppo_taken] == 0).all() and torch.isfinite(ppo).all()
    assert (logp.grad[ppo_taken] != 0).all()  # CISPO still learns from each of them
    torch.testing.assert_close(logp.grad, -ratio.clamp(max=5.0) * adv)


# ---------------------------------------------------------------- the hook


def _minibatch(batch):
    return Minibatch(batch=batch, normalizers=Normalizers(
        tokens=float(batch.completion_mask.sum()), sequences=float(len(batch)), norm_constant=5.0))


def _prepared(seed=0):
    batch = make_batch(seed=seed)
    batch.advantages = batch.rewards - ops.group_mean(batch.rewards, batch.group)
    g = torch.Generator().manual_seed(seed + 1)
    logp = -3 * torch.rand(batch.tokens.shape, generator=g) * batch.completion_mask
    return batch, logp


@pytest.mark.parametrize("overrides, uses_behavior", [
    ([], False),
    (["train.updates_per_epoch=2"], True),
    (["cispo.old_logp=behavior"], True),
    (["cispo.old_logp=detached", "train.epochs=2"], False),
])
def test_clip_hook(overrides, uses_behavior):
    run = make_run({"cispo": rlmix_cispo}, ["cispo.eps_low=0.2", "cispo.eps_high=0.3",
                                            *overrides])
    batch, logp = _prepared()
    logp.requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    assert terms.mode == "token-mean"
    old = batch.behavior_logp if uses_behavior else logp.detach()
    weight, clipped = is_weight(logp, old, 0.2, 0.3)
    adv = batch.token_advantages()
    torch.testing.assert_close(terms.loss, -weight * adv * logp)
    mask = batch.completion_mask
    assert terms.metrics["clip/fraction"] == pytest.approx(float(ops.masked_mean(
        clipped.float(), mask)))
    assert terms.metrics["cispo/weight_mean"] == pytest.approx(float(ops.masked_mean(
        weight, mask)))
    assert (terms.metrics["clip/fraction"] > 0) == uses_behavior
    (terms.loss * mask).sum().backward()
    torch.testing.assert_close(logp.grad, -weight * adv * mask)


def test_loss_mode_setting_and_fully_masked_row():
    run = make_run({"cispo": rlmix_cispo}, ["cispo.loss_mode=seq-mean-token-mean",
                                            "cispo.old_logp=behavior"])
    batch, logp = _prepared(seed=3)
    batch.completion_mask[1] = 0
    logp.requires_grad_(True)
    mb = _minibatch(batch)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=torch.zeros_like(logp))
    assert terms.mode == "seq-mean-token-mean"
    value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(logp.grad).all()
    assert (logp.grad[1] == 0).all()


@pytest.mark.parametrize("override", ["cispo.eps_low=-0.1", "cispo.eps_high=-1",
                                      "cispo.loss_mode=sum", "cispo.old_logp=x", "cispo.eps=1"])
def test_bad_settings(override):
    with pytest.raises(rlmix.ManifestError, match="cispo"):
        make_run({"cispo": rlmix_cispo}, [override])


def test_settings_defaults():
    s = rlmix_cispo.Settings()
    assert (s.eps_low, s.eps_high, s.loss_mode, s.old_logp) == (1.0, 4.0, "token-mean", "auto")


# ---------------------------------------------------------------- the claim, on the toy policy


class PPOClip:
    """The comparison: PPO's clipped surrogate (DAPO's bounds), same advantages and aggregation."""

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        b = mb.batch
        ratio = torch.exp(logp - b.behavior_logp)
        adv = b.token_advantages()
        loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
        return rlmix.LossTerms(loss=loss, mask=b.completion_mask, mode="token-mean")


def _group_normalized(batch):
    centred = batch.rewards - ops.group_mean(batch.rewards, batch.group)
    return centred / (ops.group_std(batch.rewards, batch.group) + 1e-6)


def _train_reused(run, policy, steps=10, updates=8, lr=2.0):
    """Each batch is reused for ``updates`` SGD steps (ratios drift from 1, so clipping bites);
    returns each step's mean reward (the fraction of zeros, as in the GRPO test)."""
    return toy_train(run, policy, lambda b: (b.tokens[:, 1:] == 0).float().mean(-1),
                     steps=steps, lr=lr, epochs=updates, optimizer="sgd",
                     advantage=_group_normalized, norm_constant=4.0)


def test_reused_batches_teach_more_under_cispo_than_under_ppo_clipping():
    cispo = _train_reused(make_run({"cispo": rlmix_cispo}, ["train.epochs=8"]),
                          ToyPolicy(vocab=6, length=4, seed=0))
    ppo = _train_reused(make_run({"ppo": PPOClip()}), ToyPolicy(vocab=6, length=4, seed=0))
    assert cispo[0] == ppo[0]  # the same first batch
    early_cispo, early_ppo = sum(cispo[3:10]) / 7, sum(ppo[3:10]) / 7
    assert early_cispo > early_ppo + 0.1  # 0.90 vs 0.71 on this seed; > 0.17 on seeds 0-7


# ---------------------------------------------------------------- parity with verl


def _random_inputs(seed=4, n=16, width=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).double()
    adv = torch.randn(n, 1, generator=g, dtype=torch.float64).expand(n, width)
    old = -3 * torch.rand(n, width, generator=g, dtype=torch.float64)
    logp = old + 1.5 * torch.randn(n, width, generator=g, dtype=torch.float64)
    return mask, adv, old, logp


@pytest.mark.parity
@pytest.mark.parametrize("eps_low, eps_high", [(0.2, 0.28), (1.0, 4.0)])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_parity_with_verl(mode, eps_low, eps_high):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from verl.workers.config import ActorConfig

    mask, adv, old, logp = _random_inputs()
    n = len(mask)
    config = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=eps_low,
                         clip_ratio_high=eps_high, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                         global_batch_info={"loss_scale_factor": 10.0})
    ours_logp = logp.clone().requires_grad_(True)
    theirs_logp = logp.clone().requires_grad_(True)
    loss, clipped = cispo_loss(ours_logp, old, adv, eps_low, eps_high)
    ours = ops.aggregate_loss(loss, mask, mode, Normalizers(
        tokens=float(mask.sum()), sequences=float(n), norm_constant=10.0))
    theirs, metrics = core_algos.compute_policy_loss_cispo(old, theirs_logp, adv, mask,
                                                           loss_agg_mode=mode, config=config)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, atol=1e-5, rtol=1e-5)
    frac = float(ops.masked_mean(clipped.double(), mask))
    assert frac == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)
    assert 0 < frac < 1


# ---------------------------------------------------------------- parity with TRL


def _trl_trainer(tmp_path, max_completion_length, **config):
    return trl_grpo_trainer(tmp_path, "cispo", max_completion_length, **config)


@pytest.mark.parity
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_parity_with_trl(tmp_path):
    pytest.importorskip("trl")
    n, prompt_len, width = 6, 3, 7
    # TRL's epsilon_high is the weight's cap itself: 5.0 there is our eps_high 4.0
    trainer, model = _trl_trainer(tmp_path, width, epsilon=0.2, epsilon_high=5.0)
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([7, 3, 1, 5, 2, 6])
    inputs = {"prompt_ids": torch.randint(3, 200, (n, prompt_len), generator=g),
              "prompt_mask": torch.ones(n, prompt_len, dtype=torch.long),
              "completion_ids": torch.randint(3, 200, (n, width), generator=g),
              "completion_mask": (torch.arange(width)[None] < lengths[:, None]).long(),
              "advantages": torch.randn(n, generator=g)}
    with torch.no_grad():
        current = _completion_logp(model, inputs)
    inputs["old_per_token_logps"] = current - 1.2 * torch.randn(current.shape, generator=g)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    theirs = trainer._compute_loss(model, dict(inputs))
    theirs.backward()
    theirs_grads = _grads(model)

    run = make_run({"cispo": rlmix_cispo})  # the defaults: no lower bound, cap 5, token-mean
    run.policy_version = 1  # the samples are one version old: the ratio uses behaviour
    mask = inputs["completion_mask"].float()
    batch = RolloutBatch(group=torch.zeros(n, dtype=torch.long), tokens=inputs["completion_ids"],
                         attention_mask=inputs["completion_mask"], completion_mask=mask,
                         behavior_logp=inputs["old_per_token_logps"],
                         policy_version=torch.zeros(n, dtype=torch.long),
                         advantages=inputs["advantages"])
    logp = _completion_logp(model, inputs)
    mb = Minibatch(batch=batch, normalizers=Normalizers(tokens=float(mask.sum()),
                                                        sequences=float(n), norm_constant=7.0))
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=torch.zeros_like(logp))
    assert 0 < terms.metrics["clip/fraction"] < 1  # the cap is exercised
    ours = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
    ours.backward()
    ours_grads = _grads(model)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert ours_grads.keys() == theirs_grads.keys()
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, theirs_grads[name], atol=1e-5, rtol=1e-4, msg=name)
