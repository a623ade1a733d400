"""Tests of the high-entropy-tokens wrapper: the quantile threshold against hand-computed values,
the owner's mask respected, ties and empty masks, the normaliser choices (against hand-computed
means and verl's agg_loss), composition with grpo through make_run, settings, and learning the
toy task while training on a fraction of the tokens."""

from __future__ import annotations

import math

import pytest
import rlmix_high_entropy_tokens as het
import torch
from rlmix_high_entropy_tokens import entropy_threshold, high_entropy_mask, normalizer_factor

import rlmix
from rlmix import ops
from rlmix.testing import ToyPolicy, make_batch, make_run, toy_train
from rlmix.types import Minibatch, Normalizers


def _minibatch(batch):
    normalizers = Normalizers(tokens=float(batch.completion_mask.sum().clamp(min=1)),
                              sequences=float(len(batch)), norm_constant=5.0)
    return Minibatch(batch=batch, normalizers=normalizers)


# ---------------------------------------------------------------- the threshold and the mask


def test_threshold_hand_computed_and_equal_to_torch_quantile():
    entropy = torch.tensor([[0.1, 0.5, 0.3], [0.9, 0.7, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # 5.0 is a masked-out token
    # sorted .1 .3 .5 .7 .9: q = .8 sits at position 3.2 -> .7 + .2 (.9 - .7) = .74
    assert float(entropy_threshold(entropy, mask, 0.8)) == pytest.approx(0.74)
    assert float(entropy_threshold(entropy, mask, 0.5)) == pytest.approx(0.5)
    kept = high_entropy_mask(entropy, mask, 0.8)
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    kept = high_entropy_mask(entropy, mask, 0.5)
    torch.testing.assert_close(kept, torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]))
    g = torch.Generator().manual_seed(0)
    e = torch.rand(7, 9, generator=g)
    m = (torch.rand(7, 9, generator=g) > 0.3).float()
    for q in (0.0, 0.2, 0.8, 0.95, 1.0):
        expected = torch.quantile(e[m > 0], q)
        assert float(entropy_threshold(e, m, q)) == pytest.approx(float(expected), abs=1e-6)


def test_the_top_fifth_is_kept_of_distinct_entropies():
    g = torch.Generator().manual_seed(1)
    entropy = torch.rand(10, 10, generator=g)
    mask = torch.ones(10, 10)
    kept = high_entropy_mask(entropy, mask, 0.8)
    # 100 distinct values: position 79.2 -> the 20 largest are >= the threshold
    assert int(kept.sum()) == 20
    assert float(entropy[kept > 0].min()) > float(entropy[kept == 0].max())


def test_masked_out_tokens_neither_count_nor_are_kept():
    entropy = torch.tensor([[9.0, 0.2, 0.4], [9.0, 0.6, 0.8]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])  # the prompt column has entropy 9
    kept = high_entropy_mask(entropy, mask, 0.5)
    # threshold over .2 .4 .6 .8 only: position 1.5 -> .5; the prompt tokens stay out
    assert float(entropy_threshold(entropy, mask, 0.5)) == pytest.approx(0.5)
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 1.0]]))


def test_ties_single_tokens_and_empty_masks():
    same = torch.full((2, 3), 0.7)
    torch.testing.assert_close(high_entropy_mask(same, torch.ones(2, 3), 0.8), torch.ones(2, 3))
    one = torch.tensor([[0.0, 0.3]])
    torch.testing.assert_close(high_entropy_mask(one, torch.tensor([[0.0, 1.0]]), 0.8),
                               torch.tensor([[0.0, 1.0]]))
    empty = torch.zeros(2, 3)
    assert entropy_threshold(same, empty, 0.8) is None
    torch.testing.assert_close(high_entropy_mask(same, empty, 0.8), empty)


def test_normalizer_factor_hand_computed():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    kept = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # kept: tokens 6 / kept 3; sequences 3 / sequences with a kept token 2
    torch.testing.assert_close(normalizer_factor(mask, kept, "token-mean", "kept"),
                               torch.full((3, 1), 2.0))
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        torch.testing.assert_close(normalizer_factor(mask, kept, mode, "kept"),
                                   torch.full((3, 1), 1.5))
    # all: only seq-mean-token-mean needs kept / total per row (1/3, 2/2, 0/1)
    torch.testing.assert_close(normalizer_factor(mask, kept, "seq-mean-token-mean", "all"),
                               torch.tensor([[1 / 3], [1.0], [0.0]]))
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        torch.testing.assert_close(normalizer_factor(mask, kept, mode, "all"), torch.ones(3, 1))
    nothing = torch.zeros_like(mask)
    torch.testing.assert_close(normalizer_factor(mask, nothing, "token-mean", "kept"),
                               torch.ones(3, 1))
    with pytest.raises(ValueError, match="normalize"):
        normalizer_factor(mask, kept, "token-mean", "some")


# ---------------------------------------------------------------- the wrapper


class Owner:
    """A policy loss owner (-A logp on every completion token) with a chosen mode."""

    mode = "token-mean"

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        adv = mb.batch.token_advantages()
        return rlmix.LossTerms(loss=-adv * logp, mask=mb.batch.completion_mask,
                               mode=Owner.mode, metrics={"owner": 1.0})


def _case(seed=2):
    batch = make_batch(n_groups=2, group_size=4, completion_len=6, seed=seed)
    g = torch.Generator().manual_seed(seed)
    batch.advantages = torch.randn(len(batch), generator=g)
    logp = (-3 * torch.rand(batch.tokens.shape, generator=g)).requires_grad_(True)
    entropy = torch.rand(batch.tokens.shape, generator=g) * 3
    return batch, logp, entropy


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_wrapper_narrows_the_owners_mask_and_normalize_all_counts_every_token(mode):
    Owner.mode = mode
    run = make_run({"owner": Owner, "high_entropy_tokens": het},
                   ["high_entropy_tokens.normalize=all"])
    batch, logp, entropy = _case()
    mb = _minibatch(batch)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
    expected_mask = high_entropy_mask(entropy, batch.completion_mask, 0.8)
    torch.testing.assert_close(terms.mask, expected_mask)
    assert float(terms.mask.sum()) < float(batch.completion_mask.sum())
    assert ((terms.mask > 0) <= (batch.completion_mask > 0)).all()  # never adds a token
    assert terms.mode == mode and terms.metrics["owner"] == 1.0
    kept_fraction = float(expected_mask.sum() / batch.completion_mask.sum())
    assert terms.metrics["high_entropy/kept_fraction"] == pytest.approx(kept_fraction)
    # the dropped tokens count as zeros in every denominator
    loss = -batch.token_advantages() * logp
    zeroed = loss * expected_mask
    cmask = batch.completion_mask
    if mode == "token-mean":
        expected = zeroed.sum() / cmask.sum()
    elif mode == "seq-mean-token-mean":
        expected = (zeroed.sum(-1) / cmask.sum(-1)).mean()
    else:
        expected = zeroed.sum(-1).mean()
    value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
    torch.testing.assert_close(value, expected)


def test_kept_normaliser_averages_over_the_kept_tokens_hand_computed():
    batch, logp, entropy = _case(seed=3)
    mb = _minibatch(batch)  # one minibatch is the whole update
    Owner.mode = "token-mean"
    run = make_run({"owner": Owner, "high_entropy_tokens": het})
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
    value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
    kept = terms.mask > 0
    per_token = (-batch.token_advantages() * logp)[kept]
    torch.testing.assert_close(value, per_token.mean())
    Owner.mode = "seq-mean-token-mean"
    run = make_run({"owner": Owner, "high_entropy_tokens": het})
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
    value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
    loss = -batch.token_advantages() * logp
    rows = [loss[i][kept[i]].mean() for i in range(len(batch)) if kept[i].any()]
    assert len(rows) < len(batch)  # some sequences keep no token: they leave the mean
    torch.testing.assert_close(value, torch.stack(rows).mean())


def test_empty_and_fully_masked_minibatches_stay_finite():
    Owner.mode = "token-mean"
    run = make_run({"owner": Owner, "high_entropy_tokens": het})
    batch, logp, entropy = _case(seed=4)
    batch.completion_mask[1:] = 0  # one row left, then none
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=entropy)
    value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, _minibatch(batch).normalizers)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(logp.grad).all()
    batch.completion_mask.zero_()
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp.detach(),
                                entropy=entropy)
    assert float(terms.mask.sum()) == 0 and torch.isfinite(terms.loss).all()
    assert all(math.isfinite(v) for v in terms.metrics.values())


def test_composes_with_grpo_via_make_run():
    rlmix_grpo = pytest.importorskip("rlmix_grpo")
    run = make_run({"grpo": rlmix_grpo, "high_entropy_tokens": het},
                   ["high_entropy_tokens.quantile=0.5", "grpo.loss_mode=token-mean"])
    batch, logp, entropy = _case(seed=5)
    batch.rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1])
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    torch.testing.assert_close(batch.advantages, rlmix_grpo.group_normalized_advantage(
        batch.rewards, batch.group))
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=entropy)
    kept = high_entropy_mask(entropy, batch.completion_mask, 0.5)
    torch.testing.assert_close(terms.mask, kept)
    grpo_loss, _ = rlmix_grpo.clipped_surrogate(logp, logp.detach(), batch.token_advantages(),
                                                0.2, 0.2)
    factor = float(batch.completion_mask.sum() / kept.sum())  # kept, token-mean
    torch.testing.assert_close(terms.loss, grpo_loss * factor)
    assert factor > 1.5
    assert "clip/fraction" in terms.metrics and "high_entropy/threshold" in terms.metrics


@pytest.mark.parametrize("override", [
    "high_entropy_tokens.quantile=1.5", "high_entropy_tokens.quantile=-0.1",
    "high_entropy_tokens.normalize=some", "high_entropy_tokens.top=0.2",
])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="high_entropy_tokens"):
        make_run({"owner": Owner, "high_entropy_tokens": het}, [override])


def test_settings_defaults():
    s = het.Settings()
    assert (s.quantile, s.normalize) == (0.8, "kept")


# ---------------------------------------------------------------- learning on the toy policy


class GroupAdvantage:
    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        centred = batch.rewards - ops.group_mean(batch.rewards, batch.group)
        return centred / (ops.group_std(batch.rewards, batch.group) + 1e-6)


class KeptFraction:
    """Records the wrapper's kept fraction of every step."""

    seen: list[float] = []

    @rlmix.hookimpl(wrapper=True)
    def rlmix_clip(self, run, mb, logp, entropy):
        terms = yield
        KeptFraction.seen.append(terms.metrics["high_entropy/kept_fraction"])
        return terms


def test_learns_the_toy_task_training_on_the_most_uncertain_positions_only():
    # the toy policy's entropy is per position: each step trains the most uncertain position(s)
    # (a quarter of the tokens once they differ), which is enough to solve every position
    Owner.mode = "seq-mean-token-mean"
    KeptFraction.seen = []
    run = make_run({"owner": Owner, "adv": GroupAdvantage, "high_entropy_tokens": het,
                    "record": KeptFraction})
    history = toy_train(run, ToyPolicy(vocab=6, length=4, seed=0),
                        lambda b: (b.tokens[:, 1:] == 0).float().mean(-1), steps=200)
    assert sum(history[:3]) / 3 < 0.4
    assert sum(history[-20:]) / 20 > 0.85
    assert KeptFraction.seen[0] == 1.0  # uniform start: all positions tie, all are kept
    assert sum(KeptFraction.seen[1:]) / len(KeptFraction.seen[1:]) < 0.3


# ---------------------------------------------------------------- parity with verl


@pytest.mark.parity
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_kept_normaliser_matches_verls_agg_loss_on_the_narrowed_mask(mode):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    Owner.mode = mode
    run = make_run({"owner": Owner, "high_entropy_tokens": het})
    batch, logp, entropy = _case(seed=6)
    mb = _minibatch(batch)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
    ours = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
    theirs = core_algos.agg_loss(-batch.token_advantages() * logp, terms.mask, mode)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.parity
def test_mask_and_normalize_all_match_trls_top_entropy_quantile():
    # TRL's GRPOTrainer keeps tokens with entropy >= torch.quantile(entropies of the loss tokens,
    # 1 - top_entropy_quantile) and, for loss_type "grpo", averages each sequence over all its
    # completion tokens: our quantile = 1 - TRL's top_entropy_quantile, with normalize: all
    pytest.importorskip("trl")
    from unittest.mock import Mock

    from trl import GRPOTrainer

    trainer = Mock(spec=GRPOTrainer)
    trainer.accelerator = Mock()
    trainer.accelerator.num_processes = 1
    trainer.accelerator.gather = lambda x: x
    trainer.accelerator.pad_across_processes = lambda x, dim, pad_index: x
    batch, logp, entropy = _case(seed=7)
    mask = batch.completion_mask
    for q in (0.5, 0.8, 0.9):
        theirs = GRPOTrainer.get_high_entropy_mask(trainer, entropy, mask, q)
        torch.testing.assert_close(high_entropy_mask(entropy, mask, q), theirs.float())
    Owner.mode = "seq-mean-token-mean"
    run = make_run({"owner": Owner, "high_entropy_tokens": het},
                   ["high_entropy_tokens.normalize=all"])
    mb = _minibatch(batch)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
    ours = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
    emask = GRPOTrainer.get_high_entropy_mask(trainer, entropy, mask, 0.8).float()
    per_token = -batch.token_advantages() * logp * emask  # TRL: loss * entropy_mask
    trl_grpo = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    torch.testing.assert_close(ours, trl_grpo)
