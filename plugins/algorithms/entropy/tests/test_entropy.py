"""Tests of the entropy plugin: the bonus against hand-computed values, the wrapper around a local
owner and around grpo (in either manifest order), its gradient, that it raises the entropy of the
toy policy, edge cases, settings, and parity with verl's entropy term and TRL's entropy bonus."""

from __future__ import annotations

import types

import pytest
import rlmix_entropy
import torch
from rlmix_entropy import entropy_bonus

import rlmix
from rlmix import ops
from rlmix.testing import ToyPolicy, make_batch, make_run
from rlmix.types import LossTerms, Minibatch, Normalizers


def _norm(mask):
    return Normalizers(tokens=float(mask.sum().clamp(min=1)), sequences=float(mask.shape[0]),
                       norm_constant=float(mask.shape[1]))


def _minibatch(batch):
    return Minibatch(batch=batch, normalizers=_norm(batch.completion_mask))


class Owner:
    """A stand-in rlmix_clip owner: loss -A * logp, with a metric of its own."""

    mode = "seq-mean-token-mean"

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        adv = mb.batch.token_advantages()
        return LossTerms(loss=-adv * logp, mask=mb.batch.completion_mask, mode=self.mode,
                         metrics={"owner": 1.0})


def _inputs(seed=0):
    batch = make_batch(seed=seed)
    batch.advantages = batch.rewards - ops.group_mean(batch.rewards, batch.group)
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(batch.tokens.shape, generator=g) * batch.completion_mask
    entropy = 2 * torch.rand(batch.tokens.shape, generator=g)  # nonzero off the mask too
    return batch, logp, entropy


# ---------------------------------------------------------------- entropy_bonus


def test_bonus_hand_computed_and_masked():
    loss = torch.tensor([[1.0, 2.0, 3.0]])
    entropy = torch.tensor([[0.5, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    new, bonus = entropy_bonus(loss, entropy, mask, coef=0.1)
    torch.testing.assert_close(new, torch.tensor([[0.95, 1.9, 3.0]]))
    torch.testing.assert_close(bonus, torch.tensor([[0.05, 0.1, 0.0]]))


# ---------------------------------------------------------------- the wrapper


def test_wrapper_subtracts_coef_entropy_and_keeps_the_owners_result():
    run = make_run({"owner": Owner, "entropy": rlmix_entropy}, ["entropy.coef=0.2"])
    batch, logp, entropy = _inputs()
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=entropy)
    mask = batch.completion_mask
    torch.testing.assert_close(terms.loss * mask,
                               (-batch.token_advantages() * logp - 0.2 * entropy) * mask)
    assert terms.mode == "seq-mean-token-mean" and terms.metrics["owner"] == 1.0
    assert terms.metrics["entropy/bonus"] == pytest.approx(
        float(0.2 * (entropy * mask).sum() / mask.sum()), rel=1e-6)


def test_gradient_wrt_entropy_is_minus_coef_over_the_owners_normaliser():
    run = make_run({"owner": Owner, "entropy": rlmix_entropy}, ["entropy.coef=0.3"])
    batch, logp, entropy = _inputs(1)
    entropy.requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=entropy)
    mask = batch.completion_mask
    ops.aggregate_loss(terms.loss, terms.mask, terms.mode, _norm(mask)).backward()
    # seq-mean-token-mean: each token of row i weighs 1 / (N |y_i|)
    expected = -0.3 * mask / mask.sum(-1, keepdim=True) / len(batch)
    torch.testing.assert_close(entropy.grad, expected)


def test_fully_masked_rows_and_single_tokens_are_finite_with_no_gradient_off_the_mask():
    run = make_run({"owner": Owner, "entropy": rlmix_entropy}, ["entropy.coef=1.0"])
    batch, logp, entropy = _inputs(2)
    batch.completion_mask[0] = 0
    batch.completion_mask[1] = 0
    batch.completion_mask[1, 3] = 1
    entropy.requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=entropy)
    value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, _norm(batch.completion_mask))
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(entropy.grad).all()
    assert (entropy.grad[0] == 0).all()
    assert float(entropy.grad[1, 3]) < 0 and int((entropy.grad[1] != 0).sum()) == 1


def test_coef_zero_leaves_the_owners_loss_unchanged():
    batch, logp, entropy = _inputs()
    plain = make_run({"owner": Owner})
    wrapped = make_run({"owner": Owner, "entropy": rlmix_entropy}, ["entropy.coef=0"])
    a = plain.hook.rlmix_clip(run=plain, mb=_minibatch(batch), logp=logp, entropy=entropy)
    b = wrapped.hook.rlmix_clip(run=wrapped, mb=_minibatch(batch), logp=logp, entropy=entropy)
    torch.testing.assert_close(a.loss, b.loss)


@pytest.mark.parametrize("order", [("grpo", "entropy"), ("entropy", "grpo")])
def test_composes_with_grpo_as_owner_in_either_order(order):
    rlmix_grpo = pytest.importorskip("rlmix_grpo")
    modules = {"grpo": rlmix_grpo, "entropy": rlmix_entropy}
    run = make_run({name: modules[name] for name in order},
                   ["entropy.coef=0.05", "grpo.scale=none"])
    alone = make_run({"grpo": rlmix_grpo}, ["grpo.scale=none"])
    batch, logp, entropy = _inputs(3)
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)  # grpo still owns this
    mb = _minibatch(batch)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
    base = alone.hook.rlmix_clip(run=alone, mb=mb, logp=logp, entropy=entropy)
    mask = batch.completion_mask
    torch.testing.assert_close(terms.loss * mask, (base.loss - 0.05 * entropy) * mask)
    assert terms.mode == base.mode and "clip/fraction" in terms.metrics
    assert "entropy/bonus" in terms.metrics and "entropy/bonus" not in base.metrics


# ---------------------------------------------------------------- the claim, on the toy policy


def test_the_gradient_raises_the_entropy_of_the_toy_policy():
    toy = ToyPolicy(vocab=6, length=4, seed=0)
    with torch.no_grad():
        toy.logits.copy_(3 * torch.randn(toy.logits.shape,
                                         generator=torch.Generator().manual_seed(0)))
    run = make_run({"owner": Owner, "entropy": rlmix_entropy}, ["entropy.coef=1.0"])
    opt = torch.optim.SGD(toy.parameters(), lr=5.0)

    def mean_entropy():
        table = torch.log_softmax(toy.logits.detach(), -1)
        return float(-(table.exp() * table).sum(-1).mean())

    history = [mean_entropy()]
    for _ in range(40):
        batch = toy.sample(2, 4)
        batch.advantages = torch.zeros(len(batch))  # the owner contributes no gradient
        logp, entropy = toy.logprobs(batch)
        terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=entropy)
        loss = ops.aggregate_loss(terms.loss, terms.mask, terms.mode,
                                  _norm(batch.completion_mask))
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(mean_entropy())
    assert all(b > a for a, b in zip(history, history[1:]))  # every step raises it
    assert history[0] < 1.0 and history[-1] > 0.85 * torch.log(torch.tensor(6.0)).item()


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("override", ["entropy.coef=-0.1", "entropy.beta=0.1",
                                      "entropy.coef=lots"])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="entropy"):
        make_run({"entropy": rlmix_entropy}, [override])


def test_settings_defaults():
    assert rlmix_entropy.Settings().coef == 0.001


# ---------------------------------------------------------------- parity


@pytest.mark.parity
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_parity_with_verl_entropy_term(mode):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 6, 11, generator=g).requires_grad_(True)
    mask = (torch.arange(6)[None] < torch.tensor([6, 1, 3, 5, 2])[:, None]).float()
    coef = 0.01
    # verl (workers/utils/losses.py): policy_loss -= entropy_coeff * agg_loss(entropy, mode)
    theirs = -coef * core_algos.compute_entropy_loss(logits, mask, loss_agg_mode=mode)
    (theirs_grad,) = torch.autograd.grad(theirs, logits)
    Owner.mode = mode
    try:
        run = make_run({"owner": Owner, "entropy": rlmix_entropy}, [f"entropy.coef={coef}"])
        batch = make_batch(n_groups=1, group_size=5, prompt_len=0, completion_len=6)
        batch.completion_mask = mask
        batch.advantages = torch.zeros(5)
        entropy = ops.entropy_from_logits(logits)
        terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch),
                                    logp=torch.zeros(5, 6), entropy=entropy)
    finally:
        Owner.mode = "seq-mean-token-mean"
    ours = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, _norm(mask))
    (ours_grad,) = torch.autograd.grad(ours, logits)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours_grad, theirs_grad, atol=1e-7, rtol=1e-5)


@pytest.mark.parity
def test_parity_with_trl_grpo_entropy_bonus():
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from rlmix.testing.peers import trl_grpo_trainer

    coef = 0.02
    g = torch.Generator().manual_seed(5)
    n, t = 6, 7
    mask = (torch.arange(t)[None] < torch.tensor([7, 1, 4, 2, 7, 5])[:, None]).float()
    entropy = 3 * torch.rand(n, t, generator=g)
    logp = -torch.rand(n, t, generator=g)
    # bnpo is TRL's token-mean policy loss; TRL applies the entropy bonus as a token mean over
    # the completion mask for every loss type
    trainer, _ = trl_grpo_trainer(None, "bnpo", 4, num_generations=2,
                                  per_device_train_batch_size=2, entropy_coef=coef)
    theirs_entropy = entropy.clone().requires_grad_(True)

    def fixed(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        return logp, theirs_entropy, None  # the harness replaces only the model forward

    trainer._get_per_token_logps_and_entropies = types.MethodType(fixed, trainer)
    inputs = {"prompt_ids": torch.zeros(n, 2, dtype=torch.long),
              "prompt_mask": torch.ones(n, 2, dtype=torch.long),
              "completion_ids": torch.zeros(n, t, dtype=torch.long),
              "completion_mask": mask.long(), "advantages": torch.zeros(n),
              "old_per_token_logps": logp}
    theirs = trainer._compute_loss(trainer.model, inputs)
    theirs.backward()

    Owner.mode = "token-mean"
    try:
        run = make_run({"owner": Owner, "entropy": rlmix_entropy}, [f"entropy.coef={coef}"])
        batch = make_batch(n_groups=1, group_size=n, prompt_len=0, completion_len=t)
        batch.completion_mask = mask
        batch.advantages = torch.zeros(n)
        ours_entropy = entropy.clone().requires_grad_(True)
        terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                    entropy=ours_entropy)
    finally:
        Owner.mode = "seq-mean-token-mean"
    ours = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, _norm(mask))
    ours.backward()
    assert float(ours) < 0
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours_entropy.grad, theirs_entropy.grad, atol=1e-7, rtol=1e-5)
