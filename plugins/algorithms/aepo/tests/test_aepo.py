"""AEPO's update side: the stop-gradient rescaled clip and the entropy-aware advantage against
hand-computed values, quantile 1 is PPO exactly, and the claim that every high-entropy token
keeps a gradient where PPO's clip drops some."""

from __future__ import annotations

import pytest
import rlmix_aepo
import torch
from rlmix_aepo import entropy_aware_advantage, entropy_balanced_surrogate, high_entropy

import rlmix
from rlmix import ops
from rlmix.testing import ToyPolicy, make_run, toy_train
from rlmix.types import Minibatch, Normalizers

EPS = 0.2

def _grpo():
    """The GRPO baseline, skipped where rlmix-grpo is not installed (nox -s isolated)."""
    return pytest.importorskip("rlmix_grpo")



def test_rescaled_clip_hand_computed_values_and_gradients():
    # (ratio, A, high): PPO clips tokens 0 (A>0, r>1.2) and 2 (A<0, r<0.8)
    ratio = torch.tensor([1.5, 1.5, 0.5, 1.1], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -2.0, 1.0], dtype=torch.float64)
    high = torch.tensor([True, False, True, True])
    old = torch.zeros(4, dtype=torch.float64)
    logp = ratio.log().requires_grad_(True)
    loss, clipped = entropy_balanced_surrogate(logp, old, adv, high, EPS, EPS)
    assert clipped.tolist() == [True, True, True, False]
    # values are PPO's: -1.2, -1.2, -(0.8 * -2) = 1.6, -1.1
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.2, -1.2, 1.6, -1.1],
                                                           dtype=torch.float64))
    loss.sum().backward()
    # gradients: high & clipped -> -clip(r) A; low-entropy clipped -> 0; inside -> -r A
    torch.testing.assert_close(logp.grad, torch.tensor([-1.2, 0.0, 1.6, -1.1],
                                                       dtype=torch.float64))


def test_the_positive_rescue_keeps_only_the_upper_bounds_gradient():
    """``rescue: positive`` (a bench variant): the same values; the clipped high token with
    A < 0 (token 2) loses its gradient again, the one with A > 0 keeps ``-clip(r) A``."""
    ratio = torch.tensor([1.5, 1.5, 0.5, 1.1], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -2.0, 1.0], dtype=torch.float64)
    high = torch.tensor([True, False, True, True])
    logp = ratio.log().requires_grad_(True)
    loss, _ = entropy_balanced_surrogate(logp, torch.zeros(4, dtype=torch.float64), adv, high,
                                         EPS, EPS, rescue="positive")
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.2, -1.2, 1.6, -1.1],
                                                           dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-1.2, 0.0, 0.0, -1.1],
                                                       dtype=torch.float64))


def test_entropy_aware_advantage_and_the_high_entropy_mask():
    entropy = torch.tensor([[0.5, 1.0, 2.0, 4.0]])
    mask = torch.ones(1, 4)
    high = high_entropy(entropy, mask, 0.5)  # median of (0.5, 1, 2, 4) is 1.5
    assert high.tolist() == [[False, False, True, True]]
    adv = torch.full((1, 4), 2.0)
    shaped = entropy_aware_advantage(adv, entropy, mask, high, alpha=0.5)
    # on high tokens A (1 + 0.5 H / 4): 2 * 1.25 = 2.5 and 2 * 1.5 = 3
    torch.testing.assert_close(shaped, torch.tensor([[2.0, 2.0, 2.5, 3.0]]))
    assert not high_entropy(entropy, mask, 1.0).any()  # quantile 1: no token
    assert not high_entropy(entropy, torch.zeros(1, 4), 0.5).any()


def _stale_batch(seed=0):
    toy = ToyPolicy(vocab=6, length=4, seed=seed)
    with torch.no_grad():
        toy.logits.copy_(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)))
    batch = toy.sample(8, 4)
    g = torch.Generator().manual_seed(seed + 1)
    logp, entropy = toy.logprobs(batch)
    batch.behavior_logp = (logp.detach() - torch.randn(logp.shape, generator=g)) \
        * batch.completion_mask
    batch.advantages = torch.randn(len(batch), generator=g)
    return batch, logp.detach(), entropy.detach()


def _gradient(run, batch, logp, entropy):
    leaf = logp.clone().requires_grad_(True)
    mb = Minibatch(batch=batch, normalizers=Normalizers(
        tokens=float(batch.completion_mask.sum()), sequences=float(len(batch)),
        norm_constant=4.0))
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=leaf, entropy=entropy)
    ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers).backward()
    return terms, leaf.grad


def test_every_high_entropy_token_keeps_a_gradient_where_ppo_drops_some():
    batch, logp, entropy = _stale_batch()
    mask = batch.completion_mask
    ppo_run = make_run({"grpo": _grpo()}, ["train.epochs=2"])  # ratio vs behaviour
    aepo_run = make_run({"grpo": _grpo(), "aepo": rlmix_aepo}, ["train.epochs=2"])
    _, ppo = _gradient(ppo_run, batch, logp, entropy)
    terms, aepo = _gradient(aepo_run, batch, logp, entropy)
    high = high_entropy(entropy, mask, 0.8)
    assert high.sum() >= 8
    ppo_dropped = int((high & (ppo == 0)).sum())
    print(f"high-entropy tokens without gradient: PPO {ppo_dropped} of {int(high.sum())}, "
          f"AEPO {int((high & (aepo == 0)).sum())}")
    assert ppo_dropped > 0
    assert (aepo[high] != 0).all()
    assert terms.metrics["aepo/rescued_fraction"] > 0
    # the rescue is bounded: |grad| <= clip bound * |shaped A| per token (before aggregation)
    low = (mask > 0) & ~high
    torch.testing.assert_close(aepo[low], ppo[low])  # the others are PPO's


def test_quantile_one_is_ppo_exactly():
    batch, logp, entropy = _stale_batch(seed=3)
    ppo_terms, ppo = _gradient(make_run({"grpo": _grpo()}, ["train.epochs=2"]),
                               batch, logp, entropy)
    terms, aepo = _gradient(make_run({"grpo": _grpo(), "aepo": rlmix_aepo},
                                     ["train.epochs=2", "aepo.quantile=1.0"]),
                            batch, logp, entropy)
    assert torch.equal(terms.loss, ppo_terms.loss)
    assert torch.equal(aepo, ppo)


@pytest.mark.parametrize("override", ["aepo.quantile=1.5", "aepo.alpha=-1", "aepo.eps_low=1",
                                      "aepo.rescue=negative"])
def test_bad_settings_fail(override):
    with pytest.raises(rlmix.ManifestError, match="aepo"):
        make_run({"aepo": rlmix_aepo}, [override])


# ---------------------------------------------------------------- the entropy claim (null)

GOOD = 3  # tokens 0, 1, 2 of 6 are equally good: the optimum need not be deterministic


def _entropy_run(plugins, overrides=(), steps=200, lr=0.5, seed=0):
    """``ToyPolicy`` (4 positions, 6 tokens; reward = share of tokens < 3; start: token 0 at
    logit 3, tokens 1 and 2 at 0, the bad ones at 1), 4 prompts x 8 rollouts a step, one SGD
    update per batch through the run's advantage and clip owners. Returns (rewards per step,
    the table's mean entropy after the last step, rollouts)."""
    run = make_run(plugins, list(overrides))
    toy = ToyPolicy(vocab=6, length=4, seed=seed)
    with torch.no_grad():
        toy.logits.copy_(torch.tensor([3.0, 0.0, 0.0, 1.0, 1.0, 1.0]).repeat(4, 1)
                         + 0.1 * torch.arange(4.0)[:, None] * torch.eye(6)[0])
    rewards = toy_train(run, toy, lambda b: (b.tokens[:, 1:] < GOOD).float().mean(-1),
                        steps=steps, lr=lr, optimizer="sgd", norm_constant=4.0)
    with torch.no_grad():
        table = torch.log_softmax(toy.logits, -1)
        final_entropy = float(-(table.exp() * table).sum(-1).mean())
    return rewards, final_entropy, steps * 4 * 8


def test_entropy_claim_is_not_met_on_a_toy_with_several_good_answers():
    """The paper's "entropy at step 200 >= PPO's at final reward within 0.05", checked on a
    world where entropy can be kept (three equally good tokens): a NULL RESULT. At equal
    rollouts and final reward, AEPO ends with *less* entropy than PPO, because the
    entropy-aware advantage enlarges the updates of exactly the high-entropy tokens, which
    then sharpen first; the rescued clip does not act on-policy (ratio 1), so with alpha = 0
    AEPO is PPO step for step. See the README."""
    ppo_r, ppo_h, ppo_n = _entropy_run({"grpo": _grpo()})
    aepo_r, aepo_h, aepo_n = _entropy_run({"grpo": _grpo(), "aepo": rlmix_aepo})
    print(f"entropy at step 200: PPO {ppo_h:.3f}, AEPO {aepo_h:.3f}")
    assert ppo_n == aepo_n == 200 * 32  # equal rollouts
    final = lambda h: sum(h[-20:]) / 20  # noqa: E731
    assert final(ppo_r) > 0.95 and abs(final(aepo_r) - final(ppo_r)) <= 0.05
    assert aepo_h < ppo_h - 0.01  # the claim (aepo_h >= ppo_h) fails: recorded, not hidden
    # without the advantage shaping, AEPO is PPO here step for step (20 steps suffice to show)
    assert _entropy_run({"grpo": _grpo(), "aepo": rlmix_aepo}, ["aepo.alpha=0"], steps=20) \
        == _entropy_run({"grpo": _grpo()}, steps=20)
