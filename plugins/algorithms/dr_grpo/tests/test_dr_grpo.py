"""Tests of the Dr. GRPO plugin: its math by hand, its hooks through a fake run, its settings, the
paper's claim (no length bias) on the toy policy, and parity with verl and TRL when installed."""

from __future__ import annotations

import pytest
import rlmix_dr_grpo
import torch
from rlmix_dr_grpo import centered_advantage, clipped_surrogate

import rlmix
from rlmix import ops
from rlmix.testing import ToyPolicy, make_batch, make_run
from rlmix.testing.peers import completion_logprobs as _completion_logp
from rlmix.testing.peers import pop_grads as _grads
from rlmix.testing.peers import trl_grpo_trainer as _trl_trainer
from rlmix.testing.peers import trl_loss_inputs as _trl_inputs
from rlmix.types import Minibatch, Normalizers

# ---------------------------------------------------------------- centered_advantage


def test_centered_advantage_by_hand_with_agreeing_group_and_group_of_one():
    # group 0: 1, 0, 0, 1 -> mean 0.5; group 1: all 2 -> 0; group 2: one sample -> 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])
    adv = centered_advantage(rewards, group)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))


def test_no_std_scaling_advantage_scales_with_the_reward_spread():
    # GRPO's std division makes (1, 0) and (10, 0) groups equal; Dr. GRPO keeps the spread
    rewards = torch.tensor([1.0, 0.0, 10.0, 0.0, 0.3, 0.1, 0.2])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    adv = centered_advantage(rewards, group)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 5.0, -5.0, 0.1, -0.1, 0.0]))
    torch.testing.assert_close(centered_advantage(3 * rewards, group), 3 * adv)


# ---------------------------------------------------------------- clipped_surrogate

EPS_LOW, EPS_HIGH = 0.2, 0.28
# (ratio, advantage, expected loss, clipped?) by hand: -min(r A, clip(r, 0.8, 1.28) A)
SURROGATE_CASES = [
    (1.0, 2.0, -2.0, False),
    (1.5, 2.0, -2.56, True),  # above 1 + eps_high, A > 0: clipped at 1.28
    (1.5, -2.0, 3.0, False),  # A < 0: the unclipped r A is the smaller
    (0.5, 2.0, -1.0, False),
    (0.5, -2.0, 1.6, True),  # below 1 - eps_low, A < 0: clipped at 0.8
    (1.2, 1.0, -1.2, False),  # inside the bounds
]


def test_clipped_surrogate_by_hand_and_its_gradient():
    ratio = torch.tensor([c[0] for c in SURROGATE_CASES], dtype=torch.float64)
    adv = torch.tensor([c[1] for c in SURROGATE_CASES], dtype=torch.float64)
    old = torch.full_like(ratio, -1.3)
    logp = (old + ratio.log()).requires_grad_(True)
    loss, clipped = clipped_surrogate(logp, old, adv, EPS_LOW, EPS_HIGH)
    torch.testing.assert_close(loss.detach(), torch.tensor([c[2] for c in SURROGATE_CASES],
                                                           dtype=torch.float64))
    assert clipped.tolist() == [c[3] for c in SURROGATE_CASES]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.where(clipped, 0.0, -ratio * adv))


# ---------------------------------------------------------------- hooks through a fake run


def _minibatch(batch, norm_constant=5.0):
    normalizers = Normalizers(tokens=float(batch.completion_mask.sum()),
                              sequences=float(len(batch)), norm_constant=norm_constant)
    return Minibatch(batch=batch, normalizers=normalizers)


def _random_logp(batch, seed=5):
    g = torch.Generator().manual_seed(seed)
    return -3 * torch.rand(batch.tokens.shape, generator=g) * batch.completion_mask


def test_advantage_hook_centres_without_scaling():
    run = make_run({"dr_grpo": rlmix_dr_grpo})
    batch = make_batch(rewards=torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 1.0, 3.0]))
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, -1.0, 1.0]))


def test_per_token_gradient_weight_does_not_depend_on_length():
    # one optimizer step, fresh samples: the ratio is 1, so d loss / d logp_t = -A / (C * N) for
    # every completion token whatever its row's length; seq-mean-token-mean gives -A / (|o| N)
    run = make_run({"dr_grpo": rlmix_dr_grpo})
    batch = make_batch(n_groups=2, group_size=4, completion_len=6, seed=1)
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    lengths = batch.completion_mask.sum(-1)
    assert len(set(lengths.tolist())) > 2  # ragged rows, so the check means something
    mb = _minibatch(batch, norm_constant=6.0)
    logp = _random_logp(batch).requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=torch.zeros_like(logp))
    assert terms.mode == "seq-mean-token-sum-norm"
    ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers).backward()
    n, mask = len(batch), batch.completion_mask
    adv = batch.advantages[:, None]
    torch.testing.assert_close(logp.grad, -adv / (6.0 * n) * mask)

    logp.grad = None  # the GRPO aggregation of the same per-token loss: weight ~ 1 / length
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=torch.zeros_like(logp))
    ops.aggregate_loss(terms.loss, terms.mask, "seq-mean-token-mean", mb.normalizers).backward()
    torch.testing.assert_close(logp.grad, -adv / (lengths[:, None] * n) * mask)


@pytest.mark.parametrize("overrides, uses_behavior", [
    ([], False),                                       # auto, one optimizer step: detached
    (["train.epochs=2"], True),                        # auto, several: behaviour
    (["dr_grpo.old_logp=behavior"], True),
    (["dr_grpo.old_logp=detached", "train.updates_per_epoch=2"], False),
])
def test_clip_hook_old_logp_choice(overrides, uses_behavior):
    run = make_run({"dr_grpo": rlmix_dr_grpo},
                   ["dr_grpo.eps_low=0.1", "dr_grpo.eps_high=0.3", *overrides])
    batch = make_batch()
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    logp = _random_logp(batch)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    old = batch.behavior_logp if uses_behavior else logp
    expected, clipped = clipped_surrogate(logp, old, batch.token_advantages(), 0.1, 0.3)
    torch.testing.assert_close(terms.loss, expected)
    frac = float(ops.masked_mean(clipped.float(), batch.completion_mask))
    assert terms.metrics["clip/fraction"] == pytest.approx(frac)
    assert (frac > 0) == uses_behavior


def test_fully_masked_row_gives_no_nan():
    run = make_run({"dr_grpo": rlmix_dr_grpo}, ["dr_grpo.old_logp=behavior"])
    batch = make_batch()
    batch.completion_mask[0] = 0  # a row with no completion token at all
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    logp = _random_logp(batch).requires_grad_(True)
    mb = _minibatch(batch)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=torch.zeros_like(logp))
    value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(logp.grad).all()
    assert (logp.grad[0] == 0).all()


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("override", [
    "dr_grpo.eps_low=1.0", "dr_grpo.eps_low=-0.1", "dr_grpo.eps_high=-0.2",
    "dr_grpo.old_logp=old", "dr_grpo.loss_mode=token-mean",
])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="dr_grpo"):
        make_run({"dr_grpo": rlmix_dr_grpo}, [override])


def test_settings_defaults():
    s = rlmix_dr_grpo.Settings()
    assert (s.eps_low, s.eps_high, s.old_logp) == (0.2, 0.2, "auto")


# ---------------------------------------------------------------- the claim, on the toy policy

TOY_LEN = 8  # a long completion has 8 tokens, a short one 1


def _length(draws):
    # the first token decides everything: 0 wrong+short, 1 wrong+long, 2 right+short, 3 right+long
    return torch.where(draws[:, 0] % 2 == 1, TOY_LEN, 1)


def _correct(batch):
    return (batch.tokens[:, 1] >= 2).float()  # the reward does not depend on the length


class SeqMeanTokenMean:
    """Swaps the owner's aggregation for GRPO's (per-sequence token mean), nothing else."""

    @rlmix.hookimpl(wrapper=True)
    def rlmix_clip(self, run, mb, logp, entropy):
        terms = yield
        terms.mode = "seq-mean-token-mean"
        return terms


def _train_sgd(run, policy, steps=150, lr=2.0, n_prompts=8, group_size=8):
    """Like rlmix.testing.toy_train, with plain SGD: Adam's per-parameter scaling would hide the
    difference between the two wrong tokens' gradients, which is what the claim is about."""
    opt = torch.optim.SGD(policy.parameters(), lr=lr)
    for step in range(steps):
        run.step = step
        batch = policy.sample(n_prompts, group_size, _length)
        batch.rewards = _correct(batch)
        batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
        logp, entropy = policy.logprobs(batch)
        normalizers = Normalizers(tokens=float(batch.completion_mask.sum()),
                                  sequences=float(len(batch)), norm_constant=float(TOY_LEN))
        mb = Minibatch(batch=batch, normalizers=normalizers)
        terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
        loss = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, normalizers)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _long_share(policy):
    """P(long | wrong) and P(long | right) under the policy's first-token distribution; the
    mean length of wrong answers is 1 + 7 P(long | wrong)."""
    p = torch.softmax(policy.logits.detach()[0], -1)
    return float(p[1] / (p[0] + p[1])), float(p[3] / (p[2] + p[3])), float(p[2] + p[3])


def test_no_length_bias_where_grpo_aggregation_lengthens_wrong_answers():
    dr = ToyPolicy(vocab=4, length=TOY_LEN, seed=0)
    _train_sgd(make_run({"dr_grpo": rlmix_dr_grpo}), dr)
    wrong_long, right_long, right = _long_share(dr)
    assert right > 0.9  # it learned the task
    # reward ignores length, so neither share moves from 1/2 beyond sampling noise
    assert abs(wrong_long - 0.5) < 0.1
    assert abs(right_long - 0.5) < 0.15

    grpo = ToyPolicy(vocab=4, length=TOY_LEN, seed=0)  # the same samples' seed
    _train_sgd(make_run({"dr_grpo": rlmix_dr_grpo, "agg": SeqMeanTokenMean}), grpo)
    wrong_long, right_long, right = _long_share(grpo)
    assert right > 0.9
    assert wrong_long > 0.7  # wrong answers got longer: mean length 4.5 -> above 5.9
    assert right_long < 0.1  # right answers got shorter


# ---------------------------------------------------------------- parity with verl


def _random_inputs(seed=11, n_groups=4, group_size=5, width=9):
    g = torch.Generator().manual_seed(seed)
    n = n_groups * group_size
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    rewards = torch.randint(0, 4, (n,), generator=g).float()
    rewards[:group_size] = 1.0  # one group whose rewards all agree
    group = torch.arange(n_groups).repeat_interleave(group_size)
    old = -3 * torch.rand(n, width, generator=g, dtype=torch.float64)
    logp = old + (2 * torch.rand(n, width, generator=g, dtype=torch.float64) - 1)
    return rewards, group, mask, old, logp


@pytest.mark.parity
def test_parity_with_verl():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    import numpy as np
    from verl.workers.config import ActorConfig

    rewards, group, mask, old, logp = _random_inputs()
    n, width = mask.shape
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(n), mask.sum(-1).long() - 1] = rewards
    theirs, _ = core_algos.compute_grpo_outcome_advantage(
        token_rewards, mask, np.array(group.tolist()), norm_adv_by_std_in_grpo=False)
    adv = centered_advantage(rewards, group)
    torch.testing.assert_close(adv[:, None] * mask, theirs, atol=1e-6, rtol=1e-6)

    # the loss with verl's seq-mean-token-sum-norm and the same constant; ratios in [1/e, e]
    # stay under verl's dual-clip bound (3), which Dr. GRPO does not have
    norm_constant = 12.0
    config = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                         ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                         global_batch_info={"loss_scale_factor": norm_constant})
    adv_t = adv.to(torch.float64)[:, None].expand(n, width)
    ours_logp = logp.clone().requires_grad_(True)
    theirs_logp = logp.clone().requires_grad_(True)
    loss, clipped = clipped_surrogate(ours_logp, old, adv_t, 0.2, 0.28)
    ours = ops.aggregate_loss(loss, mask, "seq-mean-token-sum-norm",
                              Normalizers(tokens=float(mask.sum()), sequences=float(n),
                                          norm_constant=norm_constant))
    theirs, metrics = core_algos.compute_policy_loss_vanilla(
        old, theirs_logp, adv_t, mask, loss_agg_mode="seq-mean-token-sum-norm", config=config)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, atol=1e-5, rtol=1e-5)
    assert float(ops.masked_mean(clipped.float(), mask)) == pytest.approx(
        metrics["actor/pg_clipfrac"], abs=1e-6)
    assert 0 < metrics["actor/pg_clipfrac"] < 1  # both branches exercised


# ---------------------------------------------------------------- parity with TRL


@pytest.mark.parity
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_parity_with_trl_dr_grpo_loss(tmp_path):
    pytest.importorskip("trl")
    width = 7
    trainer, model = _trl_trainer(tmp_path, "dr_grpo", width, epsilon=0.2, epsilon_high=0.28)
    inputs, g = _trl_inputs(width=width)
    with torch.no_grad():
        current = _completion_logp(model, inputs)
    inputs["old_per_token_logps"] = current + 0.3 * torch.randn(current.shape, generator=g)
    theirs = trainer._compute_loss(model, dict(inputs))
    theirs.backward()
    theirs_grads = _grads(model)

    mask = inputs["completion_mask"].float()
    logp = _completion_logp(model, inputs)
    adv = inputs["advantages"][:, None].expand_as(logp)
    loss, clipped = clipped_surrogate(logp, inputs["old_per_token_logps"], adv, 0.2, 0.28)
    assert 0 < float(ops.masked_mean(clipped.float(), mask)) < 1
    ours = ops.aggregate_loss(loss, mask, "seq-mean-token-sum-norm",
                              Normalizers(tokens=float(mask.sum()), sequences=float(len(mask)),
                                          norm_constant=float(width)))
    ours.backward()
    ours_grads = _grads(model)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert ours_grads.keys() == theirs_grads.keys()
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, theirs_grads[name], atol=1e-5, rtol=1e-4, msg=name)
