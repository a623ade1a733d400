"""Tests of the PPO plugin: GAE against a hand-computed example, a naive loop and verl; whitening
and value clipping by hand; the critic (alignment, independence from the policy); the hooks,
including the critic's optimizer step and its skip; real training steps on tiny-random; the
checkpoint round trip; and GAE's bias-variance claim on samples of the toy policy."""

from __future__ import annotations

import random

import pytest
import rlmix_ppo
import torch
from rlmix_ppo import (
    clipped_surrogate,
    clipped_value_loss,
    explained_variance,
    gae,
    outcome_rewards,
    whiten,
)

import rlmix
from rlmix import checkpoint, loop, ops
from rlmix.testing import ToyPolicy, make_batch, make_run
from rlmix.types import LossTerms, Minibatch, Normalizers

# ---------------------------------------------------------------- GAE

GAMMA, LAM = 0.9, 0.5  # gamma * lam = 0.45


def _hand_example():
    """Five rows, two prompt columns and four completion columns (cols 2..5)."""
    big = 100.0  # values where the mask is 0: must be ignored
    values = torch.tensor([
        [big, big, 0.5, 1.0, 2.0, 1.5],    # full length, reward 3 at col 5
        [big, big, 1.0, -1.0, big, big],  # ragged: 2 tokens then padding, reward -2 at col 3
        [big, big, 0.25, big, big, big],  # a single completion token, reward 1
        [big, big, big, big, big, big],   # fully masked row
        [big, big, 0.5, big, 1.0, big],   # tool output at col 3 (a hole), reward 2 at col 4
    ])
    mask = torch.tensor([
        [0, 0, 1, 1, 1, 1],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 1, 0, 1, 0],
    ], dtype=torch.float)
    rewards = torch.tensor([3.0, -2.0, 1.0, 5.0, 2.0])
    return values, mask, rewards


def test_outcome_rewards_sit_on_the_last_completion_token():
    _, mask, rewards = _hand_example()
    expected = torch.zeros(5, 6)
    expected[0, 5], expected[1, 3], expected[2, 2], expected[4, 4] = 3.0, -2.0, 1.0, 2.0
    torch.testing.assert_close(outcome_rewards(rewards, mask), expected)


def test_gae_hand_computed():
    values, mask, rewards = _hand_example()
    adv, ret = gae(outcome_rewards(rewards, mask), values, mask, GAMMA, LAM)
    # row 0: deltas 0.9*1.0-0.5=0.4, 0.9*2.0-1.0=0.8, 0.9*1.5-2.0=-0.65, 3-1.5=1.5
    #   A5=1.5, A4=-0.65+0.45*1.5=0.025, A3=0.8+0.45*0.025=0.81125, A2=0.4+0.45*0.81125
    # row 1: delta3=-2-(-1)=-1, delta2=0.9*(-1)-1=-1.9; A3=-1, A2=-1.9+0.45*(-1)=-2.35
    # row 2: A = 1 - 0.25
    # row 4: the hole is skipped (no value, no discount): delta4=2-1=1, delta2=0.9*1-0.5=0.4
    #   A4=1, A2=0.4+0.45*1=0.85
    expected = torch.zeros(5, 6)
    expected[0, 2:] = torch.tensor([0.4 + 0.45 * 0.81125, 0.81125, 0.025, 1.5])
    expected[1, 2:4] = torch.tensor([-2.35, -1.0])
    expected[2, 2] = 0.75
    expected[4, 2], expected[4, 4] = 0.85, 1.0
    torch.testing.assert_close(adv, expected)
    expected_ret = torch.where(mask > 0, expected + values, torch.zeros_like(values))
    torch.testing.assert_close(ret, expected_ret)
    assert ret[2, 2] == pytest.approx(1.0)  # single token: the return is the reward
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[3] == 0).all() and (ret[3] == 0).all()  # fully masked row: zeros, no NaN


def test_gae_lambda_one_gamma_one_is_reward_minus_value():
    values, mask, rewards = _hand_example()
    adv, ret = gae(outcome_rewards(rewards, mask), values, mask, 1.0, 1.0)
    on = mask > 0
    torch.testing.assert_close(adv[on], (rewards[:, None] - values).expand_as(mask)[on])
    torch.testing.assert_close(ret[on], rewards[:, None].expand_as(mask)[on])


def _naive_gae(token_rewards, values, mask, gamma, lam):
    """Row by row, in plain Python over the masked-in positions only."""
    n, width = values.shape
    adv = [[0.0] * width for _ in range(n)]
    for i in range(n):
        cols = [t for t in range(width) if mask[i, t] > 0]
        running, next_value = 0.0, 0.0
        for t in reversed(cols):
            delta = float(token_rewards[i, t]) + gamma * next_value - float(values[i, t])
            running = delta + gamma * lam * running
            next_value = float(values[i, t])
            adv[i][t] = running
    adv_t = torch.tensor(adv, dtype=torch.float64)
    return adv_t, torch.where(mask > 0, adv_t + values.double(), torch.zeros_like(adv_t))


def _random_inputs(seed, n=9, width=12, holes=True):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(n, width, generator=g, dtype=torch.float64)
    token_rewards = torch.randn(n, width, generator=g, dtype=torch.float64)
    mask = torch.zeros(n, width)
    for i in range(n):
        start = int(torch.randint(0, 4, (1,), generator=g))
        length = int(torch.randint(0, width - start + 1, (1,), generator=g))
        mask[i, start:start + length] = 1.0
        if holes and length > 3:  # a tool-output hole inside the completion
            mask[i, start + 1:start + 3] = 0.0
    mask[0] = 0.0  # one fully masked row
    mask[1] = 0.0
    mask[1, 5] = 1.0  # one single-token row
    return token_rewards, values, mask


@pytest.mark.parametrize("seed, gamma, lam", [(0, 1.0, 0.95), (1, 0.97, 0.8), (2, 0.5, 0.0),
                                              (3, 1.0, 1.0)])
def test_gae_matches_a_naive_loop(seed, gamma, lam):
    token_rewards, values, mask = _random_inputs(seed)
    adv, ret = gae(token_rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = _naive_gae(token_rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert (adv[mask == 0] == 0).all()


# ---------------------------------------------------------------- whitening, value loss


def test_whiten_is_masked_with_unbiased_variance():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=g, dtype=torch.float64) * 3 + 2
    mask = (torch.rand(4, 7, generator=g) > 0.4).float()
    x_off = x.clone()
    x_off[mask == 0] = 1e6  # what lies off the mask must not matter
    w = whiten(x_off, mask)
    on = mask > 0
    vals = x[on]
    torch.testing.assert_close(w[on], (vals - vals.mean()) / torch.sqrt(vals.var() + 1e-8))
    assert (w[~on] == 0).all()
    assert float(w[on].mean()) == pytest.approx(0.0, abs=1e-9)
    assert float(w[on].std()) == pytest.approx(1.0, abs=1e-6)  # unbiased std 1


def test_whiten_single_token_and_empty_mask_give_zeros():
    x = torch.tensor([[3.0, 4.0]])
    assert (whiten(x, torch.tensor([[0.0, 1.0]])) == 0).all()
    assert (whiten(x, torch.zeros(1, 2)) == 0).all()


CLIP = 0.2
# (V, V_old, R, hand-computed 0.5 * max((V-R)^2, (clip(V, V_old +- 0.2) - R)^2), clipped larger)
VALUE_CASES = [
    (1.1, 1.0, 1.5, 0.5 * 0.4**2, False),    # inside the clip range
    (1.5, 1.0, 2.0, 0.5 * 0.8**2, True),     # moved +0.5 toward R: clipped to 1.2, error 0.8
    (1.5, 1.0, 0.0, 0.5 * 1.5**2, False),    # moved away from R: the unclipped is larger
    (0.2, 1.0, -1.0, 0.5 * 1.8**2, True),    # moved -0.8 toward R: clipped to 0.8, error 1.8
    (0.2, 1.0, 2.0, 0.5 * 1.8**2, False),    # moved away: unclipped 1.8 > clipped 1.2
    (1.0, 1.0, 1.0, 0.0, False),             # exact
]


def test_clipped_value_loss_hand_computed_with_gradients():
    v = torch.tensor([c[0] for c in VALUE_CASES], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([c[1] for c in VALUE_CASES], dtype=torch.float64)
    ret = torch.tensor([c[2] for c in VALUE_CASES], dtype=torch.float64)
    loss, clipped = clipped_value_loss(v, old, ret, CLIP)
    torch.testing.assert_close(loss.detach(), torch.tensor([c[3] for c in VALUE_CASES],
                                                           dtype=torch.float64))
    assert clipped.tolist() == [c[4] for c in VALUE_CASES]
    loss.sum().backward()
    # the clipped branch is constant in V beyond the bound: no gradient there; else V - R
    expected = torch.where(clipped, torch.zeros_like(ret), v.detach() - ret)
    torch.testing.assert_close(v.grad, expected)


def test_value_clip_zero_is_plain_squared_error():
    v, old, ret = torch.tensor([1.5, 0.2]), torch.tensor([1.0, 1.0]), torch.tensor([2.0, -1.0])
    loss, clipped = clipped_value_loss(v, old, ret, 0.0)
    torch.testing.assert_close(loss, 0.5 * (v - ret) ** 2)
    assert not clipped.any()


def test_explained_variance():
    g = torch.Generator().manual_seed(0)
    ret = torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    mask[0, :2] = 0
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    mean = float(ret[mask > 0].mean())
    assert explained_variance(torch.full_like(ret, mean), ret, mask) == pytest.approx(0.0,
                                                                                    abs=1e-6)
    assert explained_variance(-ret, ret, mask) < -1  # worse than the mean
    assert explained_variance(ret, torch.ones(3, 5), mask) == 0.0  # nothing to explain


# ---------------------------------------------------------------- the critic


def _ppo_run(overrides=(), **kwargs):
    run = make_run({"ppo": rlmix_ppo}, list(overrides), with_policy=True, **kwargs)
    loop.configure(run)  # the core default's optimizer and the ppo critic
    return run


def _randomise_head(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=g))
        model.head.bias.fill_(0.3)


def test_critic_is_an_independent_copy_of_the_trunk_with_a_zero_head():
    run = _ppo_run(["ppo.critic_lr=3e-4"])
    model, opt = rlmix_ppo.critic(run)
    trunk = run.policy.model.base_model
    ours = dict(model.trunk.named_parameters())
    for name, p in trunk.named_parameters():
        torch.testing.assert_close(ours[name], p)
        assert ours[name].data_ptr() != p.data_ptr()
    assert (model.head.weight == 0).all() and (model.head.bias == 0).all()
    assert opt.param_groups[0]["lr"] == 3e-4
    n_params = sum(1 for p in model.parameters())
    assert sum(len(g["params"]) for g in opt.param_groups) == n_params
    policy_params = {id(p) for p in run.optimizer.param_groups[0]["params"]}
    assert not policy_params & {id(p) for p in model.parameters()}
    assert run.state["ppo"]["critic"].keys() == model.state_dict().keys()


@pytest.mark.parametrize("share_prefix", [True, False])
def test_values_are_aligned_like_logp(share_prefix):
    run = _ppo_run()
    model, _ = rlmix_ppo.critic(run)
    _randomise_head(model)
    batch = make_batch(vocab=200, prompt_len=3, completion_len=5)
    values = model(batch.tokens, batch.attention_mask, batch.completion_mask,
                   share_prefix=share_prefix)
    # reference: the full sequence through the trunk, head on position t-1 for column t
    attn = batch.attention_mask
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    hidden = model.trunk(input_ids=batch.tokens, attention_mask=attn, position_ids=pos,
                         use_cache=False).last_hidden_state
    head = (hidden @ model.head.weight.T).squeeze(-1) + model.head.bias
    expected = torch.zeros_like(values)
    expected[:, 3:] = head[:, 2:-1]
    on = batch.completion_mask > 0
    torch.testing.assert_close(values[on], expected[on], atol=1e-5, rtol=1e-5)
    assert (values[:, :3] == 0).all()
    # causality: changing token 5 leaves columns <= 5 alone and moves column 6
    changed = batch.tokens.clone()
    changed[:, 5] = (changed[:, 5] + 7) % 200
    moved = model(changed, attn, batch.completion_mask, share_prefix=share_prefix)
    torch.testing.assert_close(moved[:, :6], values[:, :6])
    assert (moved[:, 6] - values[:, 6]).abs().max() > 1e-4


# ---------------------------------------------------------------- the hooks


def _mb(batch, last=True, tokens=None):
    return Minibatch(batch=batch, normalizers=Normalizers(
        tokens=float(batch.completion_mask.sum()) if tokens is None else tokens,
        sequences=float(len(batch)), norm_constant=5.0), last=last)


def test_advantage_hook_is_whitened_gae_of_the_critics_values():
    run = _ppo_run(["ppo.gamma=0.95", "ppo.lam=0.9"])
    model, _ = rlmix_ppo.critic(run)
    _randomise_head(model)
    batch = make_batch(vocab=200, rewards=torch.tensor([1.0, 0, 0, 2, 1, 0, 3, 0]))
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    mask = batch.completion_mask
    with torch.no_grad():
        values = model(batch.tokens, batch.attention_mask, mask) * mask
    torch.testing.assert_close(batch.extras["ppo.values"], values)
    raw, ret = gae(outcome_rewards(batch.rewards, mask), values, mask, 0.95, 0.9)
    torch.testing.assert_close(batch.extras["ppo.returns"], ret)
    torch.testing.assert_close(adv, whiten(raw, mask))
    assert adv.shape == mask.shape and (adv[mask == 0] == 0).all()
    run = _ppo_run(["ppo.whiten=false"])  # zero head: values 0, advantages = GAE of rewards
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    raw, _ = gae(outcome_rewards(batch.rewards, mask), torch.zeros_like(mask), mask, 1.0, 0.95)
    torch.testing.assert_close(adv, raw)


def _prepared(run, batch, seed=1):
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    model, _ = rlmix_ppo.critic(run)
    _randomise_head(model, seed)  # the critic moves after the old values were taken
    g = torch.Generator().manual_seed(seed)
    logp = (batch.behavior_logp + 0.5 * torch.randn(batch.behavior_logp.shape, generator=g)
            ) * batch.completion_mask
    return model, logp.requires_grad_(True)


@pytest.mark.parametrize("overrides, uses_behavior", [([], False), (["train.epochs=2"], True)])
def test_clip_hook_policy_loss_plus_clipped_value_loss(overrides, uses_behavior):
    run = _ppo_run(["ppo.vf_coef=0.5", "ppo.value_clip=0.1", "ppo.eps_low=0.1",
                    "ppo.eps_high=0.3", *overrides])
    batch = make_batch(vocab=200, rewards=torch.tensor([1.0, 0, 0, 2, 1, 0, 3, 0]))
    model, logp = _prepared(run, batch)
    mask = batch.completion_mask
    step_tokens = 2.5 * float(mask.sum())  # the optimizer step's count, not this minibatch's
    terms = run.hook.rlmix_clip(run=run, mb=_mb(batch, tokens=step_tokens), logp=logp,
                                entropy=torch.ones_like(logp))
    old = batch.behavior_logp if uses_behavior else logp.detach()
    expected, clipped = clipped_surrogate(logp.detach(), old, batch.advantages, 0.1, 0.3)
    torch.testing.assert_close(terms.loss.detach(), expected)
    assert terms.mode == "token-mean"
    with torch.no_grad():
        new_values = model(batch.tokens, batch.attention_mask, mask)
    vf, vf_clipped = clipped_value_loss(new_values, batch.extras["ppo.values"],
                                        batch.extras["ppo.returns"], 0.1)
    torch.testing.assert_close(terms.extra.detach(), 0.5 * (vf * mask).sum() / step_tokens)
    assert vf_clipped[mask > 0].any()  # the moved critic hits the clip somewhere
    m = terms.metrics
    assert m["critic/vf_clip_fraction"] == pytest.approx(float(ops.masked_mean(
        vf_clipped.float(), mask)))
    assert m["critic/value_loss"] == pytest.approx(float(ops.masked_mean(vf, mask)))
    assert m["clip/fraction"] == pytest.approx(float(ops.masked_mean(clipped.float(), mask)))
    assert "critic/explained_variance" not in m  # advantage-time metrics go through run.log
    assert "critic/explained_variance" in run.drain_metrics()
    if uses_behavior:
        assert m["clip/fraction"] > 0
    # the value loss reaches the critic (trunk and head) and not the policy
    terms.extra.backward()
    assert model.head.weight.grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.trunk.parameters())
    assert all(p.grad is None for p in run.policy.model.parameters())


def test_clip_hook_without_ppo_advantage_fails_loudly():
    run = _ppo_run()
    batch = make_batch(vocab=200)
    batch.advantages = torch.zeros(len(batch))
    logp = torch.zeros_like(batch.behavior_logp)
    with pytest.raises(RuntimeError, match="ppo.returns"):
        run.hook.rlmix_clip(run=run, mb=_mb(batch), logp=logp, entropy=logp)


def _terms(run, batch, mb, logp):
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=torch.zeros_like(logp))
    value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
    terms.value, terms.minibatch = value + terms.extra, mb
    return terms


def _snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(module, snap):
    return all(torch.equal(v, snap[k]) for k, v in module.state_dict().items())


def test_update_wrapper_steps_the_critic_once_per_optimizer_step():
    run = _ppo_run(["ppo.critic_lr=1e-3", "ppo.critic_max_grad_norm=0"])
    batch = make_batch(vocab=200, rewards=torch.tensor([1.0, 0, 0, 2, 1, 0, 3, 0]))
    model, _ = _prepared(run, batch)
    before = _snapshot(model)
    first, second = batch.select([0, 1, 2, 3]), batch.select([4, 5, 6, 7])
    tokens = float(batch.completion_mask.sum())
    for half, last in ((first, False), (second, True)):
        logp, _ = run.policy.logprobs(run, half)
        stats = run.hook.rlmix_update(run=run, loss=_terms(run, half, _mb(half, last, tokens),
                                                           logp))
        if not last:  # accumulating: the critic keeps its gradients and weights
            assert _same(model, before)
            assert model.head.weight.grad is not None
            assert "critic/grad_norm" not in stats
    assert not _same(model, before)
    assert all(p.grad is None for p in model.parameters())
    assert stats["critic/skipped"] == 0.0 and stats["critic/grad_norm"] > 0
    assert stats["update/skipped"] == 0.0  # the owner's stats pass through
    assert run.state["ppo"]["optimizer"]["state"]  # the checkpointed state is the live one
    live = model.state_dict()
    assert all(torch.equal(v, live[k]) for k, v in run.state["ppo"]["critic"].items())


def test_a_skipped_policy_step_skips_the_critic_step():
    run = _ppo_run(["ppo.critic_lr=1e-3"])
    batch = make_batch(vocab=200, rewards=torch.tensor([1.0, 0, 0, 2, 1, 0, 3, 0]))
    model, _ = _prepared(run, batch)
    before, policy_before = _snapshot(model), _snapshot(run.policy.model)
    first, second = batch.select([0, 1, 2, 3]), batch.select([4, 5, 6, 7])
    tokens = float(batch.completion_mask.sum())
    logp, _ = run.policy.logprobs(run, first)
    run.hook.rlmix_update(run=run, loss=_terms(run, first, _mb(first, False, tokens), logp))
    assert model.head.weight.grad is not None  # finite gradients are waiting for the step
    logp, _ = run.policy.logprobs(run, second)
    terms = _terms(run, second, _mb(second, True, tokens), logp)
    terms.value = terms.value * float("nan")  # a non-finite loss poisons the whole update
    stats = run.hook.rlmix_update(run=run, loss=terms)
    assert stats["update/skipped"] == 1.0 and stats["critic/skipped"] == 1.0
    assert _same(model, before) and _same(run.policy.model, policy_before)
    assert all(p.grad is None for p in model.parameters())
    assert not run.state["ppo"]["optimizer"]["state"]  # no critic step was ever taken


# ---------------------------------------------------------------- real steps on tiny-random


class LengthReward:
    """A scorer whose rewards vary on tiny-random's random text (arith's are all 0 there)."""

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        return {"len": torch.tensor([float(len(t) % 3) for t in batch.texts])}


def _full_run(overrides=()):
    rlmix_hf = pytest.importorskip("rlmix_hf")
    rlmix_arith = pytest.importorskip("rlmix_arith")
    run = make_run({"hf": rlmix_hf, "arith": rlmix_arith, "ppo": rlmix_ppo, "len": LengthReward},
                   ["train.prompts_per_step=2", "train.group_size=4",
                    "sampling.max_new_tokens=6", "arith.eval_size=0", "log.plot=false",
                    *overrides], with_policy=True)
    loop.configure(run)
    return run


def test_train_steps_change_the_policy_and_the_critic():
    run = _full_run(["train.updates_per_epoch=2", "train.epochs=2"])
    model, _ = rlmix_ppo.critic(run)
    critic_before, policy_before = _snapshot(model), _snapshot(run.policy.model)
    head_before, trunk_before = model.head.weight.detach().clone(), _snapshot(model.trunk)
    for _ in range(2):
        metrics = loop.train_step(run)
        for key in ("critic/value_loss", "critic/vf_clip_fraction", "critic/explained_variance",
                    "clip/fraction", "critic/grad_norm", "loss"):
            assert key in metrics and metrics[key] == metrics[key]  # present, not NaN
        assert metrics["critic/skipped"] == 0.0 and metrics["update/skipped"] == 0.0
    assert run.policy_version == 8  # 2 steps x 2 epochs x 2 updates
    assert not _same(run.policy.model, policy_before)
    assert not torch.equal(model.head.weight, head_before)
    assert not _same(model.trunk, trunk_before)  # reached once the head is no longer zero
    assert not _same(model, critic_before)
    assert metrics["critic/value_loss"] > 0
    # the critic stays a separate model: the policy's trunk did not become the critic's
    assert not torch.equal(model.trunk.embed_tokens.weight,
                           run.policy.model.base_model.embed_tokens.weight)


def test_checkpoint_round_trip_restores_the_critic_and_its_optimizer(tmp_path):
    overrides = [f"out={tmp_path}", "train.steps=2", "ppo.critic_lr=1e-3"]
    run = _full_run(overrides)
    for _ in range(2):
        metrics = loop.train_step(run)
    run.hook.rlmix_step_end(run=run, metrics=metrics)  # ppo syncs, then the core saves
    run.pm.get_plugin("rlmix.observe").close(run)
    saved = checkpoint.latest(checkpoint.checkpoint_root(run))
    assert saved is not None and saved.name == "step-000002"
    model, opt = rlmix_ppo.critic(run)
    weights, opt_state = _snapshot(model), opt.state_dict()

    fresh = _full_run(overrides)  # as build_run: configure first, then restore
    fresh_model, fresh_opt = rlmix_ppo.critic(fresh)
    assert not _same(fresh_model, weights)
    checkpoint.restore(fresh, saved)
    got_model, got_opt = rlmix_ppo.critic(fresh)  # reloads lazily on first use
    assert got_model is fresh_model and got_opt is fresh_opt
    assert _same(got_model, weights)
    got_state = got_opt.state_dict()
    assert got_state["state"].keys() == opt_state["state"].keys() and got_state["state"]
    for key, entry in opt_state["state"].items():
        for name, value in entry.items():
            torch.testing.assert_close(got_state["state"][key][name], value, rtol=0, atol=0)
    assert got_state["param_groups"][0]["lr"] == 1e-3

    # both continue identically from the checkpoint's RNG state (the global torch and Python
    # generators are shared by the two in-process runs, so each starts from the saved one)
    rng = torch.load(saved / "rng.pt", weights_only=False)
    for r in (run, fresh):
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        loop.train_step(r)
    model_after = _snapshot(model)
    for k, v in got_model.state_dict().items():
        torch.testing.assert_close(v, model_after[k])


# ---------------------------------------------------------------- the claim


def _fit_values(toy, n):
    """A learned baseline: least squares of the return on (ones so far, one-hot position),
    fitted on an independent sample of ``n`` rollouts."""
    batch = toy.sample(n, 1)
    draws = batch.tokens[:, 1:].double()
    ret = draws.sum(-1)
    length = toy.length
    so_far = torch.cumsum(draws, -1) - draws  # ones before position t
    feats = torch.cat([so_far.reshape(-1, 1),
                       torch.eye(length, dtype=torch.float64).repeat(n, 1)], 1)
    target = ret[:, None].expand(n, length).reshape(-1, 1)
    coef = torch.linalg.lstsq(feats, target).solution.flatten()
    return coef


def test_gae_with_a_learned_critic_lowers_advantage_error_and_variance():
    """Schulman et al. 2016: with a good value function, lambda < 1 trades a little bias for a
    large cut in variance. The task: ``length`` independent binary tokens, reward = number of
    ones. The true advantage of token t is ``a_t - p_t``; Monte-Carlo (lambda = 1) adds the
    noise of every later token to it, GAE(lambda) discounts that noise by lambda per step."""
    torch.manual_seed(0)
    random.seed(0)
    length = 8
    toy = ToyPolicy(vocab=2, length=length, seed=0)
    with torch.no_grad():
        toy.logits[:, 1] = torch.linspace(-1.5, 1.5, length)  # p_t from 0.18 to 0.82
    probs = torch.softmax(toy.logits.detach().double(), -1)[:, 1]
    coef = _fit_values(toy, 3000)
    # the fit recovers the true value function: slope 1 on the ones so far, the rest to go
    assert float(coef[0]) == pytest.approx(1.0, abs=0.05)
    to_go = probs.flip(0).cumsum(0).flip(0)
    torch.testing.assert_close(coef[1:], to_go, atol=0.1, rtol=0)

    batch = toy.sample(4000, 1)  # fresh samples to evaluate on
    draws = batch.tokens[:, 1:].double()
    mask = batch.completion_mask.double()
    rewards = draws.sum(-1)
    so_far = torch.cumsum(draws, -1) - draws
    values = torch.zeros_like(mask)
    values[:, 1:] = coef[0] * so_far + coef[1:]
    true_adv = draws - probs  # a_t - p_t at columns 1..length
    token_rewards = outcome_rewards(rewards, mask)

    def error_and_variance(lam, vals):
        adv, _ = gae(token_rewards, vals, mask, 1.0, lam)
        err = float(((adv[:, 1:] - true_adv) ** 2).mean())
        return err, float(adv[:, 1].var())  # first token: the most future noise

    results = {lam: error_and_variance(lam, values) for lam in (1.0, 0.95, 0.8, 0.5, 0.0)}
    errors = [results[lam][0] for lam in (1.0, 0.95, 0.8, 0.5, 0.0)]
    assert errors == sorted(errors, reverse=True)  # each smaller lambda is closer to the truth
    assert errors[2] < 0.5 * errors[0]  # lambda 0.8 vs Monte-Carlo: less than half the error
    mc_var, gae_var = results[1.0][1], results[0.95][1]
    # Monte-Carlo variance at the first token: its own p(1-p) plus every later token's
    assert mc_var == pytest.approx(float((probs * (1 - probs)).sum()), rel=0.1)
    assert gae_var < 0.85 * mc_var

    def signal(lam, vals):
        """Regression slope of the advantage on the true advantage: 1 = unbiased signal."""
        adv, _ = gae(token_rewards, vals, mask, 1.0, lam)
        return float((adv[:, 1:] * true_adv).sum() / (true_adv**2).sum())

    # with the learned critic every lambda keeps the signal (little bias) ...
    for lam in (1.0, 0.95, 0.5, 0.0):
        assert signal(lam, values) == pytest.approx(1.0, abs=0.05)
    # ... without one (V = 0) lambda < 1 discounts it away: lambda is no free lunch
    zero = torch.zeros_like(mask)
    assert signal(1.0, zero) == pytest.approx(1.0, abs=0.2)
    assert signal(0.5, zero) < 0.35 and signal(0.0, zero) < 0.15


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("override", [
    "ppo.gamma=1.5", "ppo.lam=-0.1", "ppo.eps_low=1.0", "ppo.eps_high=-0.1", "ppo.vf_coef=-1",
    "ppo.value_clip=-0.2", "ppo.critic_lr=0", "ppo.loss_mode=sum", "ppo.old_logp=old",
    "ppo.critic_max_grad_norm=-1", "ppo.clip=0.2",
])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="ppo"):
        make_run({"ppo": rlmix_ppo}, [override])


def test_settings_defaults_and_no_critic_without_a_policy():
    s = rlmix_ppo.Settings()
    assert (s.gamma, s.lam, s.whiten, s.eps_low, s.eps_high, s.loss_mode, s.old_logp, s.vf_coef,
            s.value_clip, s.critic_lr, s.critic_weight_decay, s.critic_max_grad_norm) == (
        1.0, 0.95, True, 0.2, 0.2, "token-mean", "auto", 0.1, 0.2, 1e-5, 0.0, 1.0)
    run = make_run({"ppo": rlmix_ppo})
    rlmix_ppo.rlmix_configure(run)
    with pytest.raises(RuntimeError, match="no critic"):
        rlmix_ppo.critic(run)


# ---------------------------------------------------------------- parity with verl


@pytest.mark.parity
def test_parity_with_verl_gae_whitening_and_value_loss():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    for seed, gamma, lam in ((0, 1.0, 0.95), (1, 0.99, 0.9), (2, 0.9, 0.0)):
        token_rewards, values, mask = _random_inputs(seed, n=16, width=20)
        mask[0, 3:9] = 1.0  # verl's whitening needs more than one token; keep row 0 non-empty
        token_rewards, values = token_rewards.float(), values.float()
        theirs_adv, theirs_ret = core_algos.compute_gae_advantage_return(
            token_level_rewards=token_rewards, values=values, response_mask=mask, gamma=gamma,
            lam=lam)
        adv, ret = gae(token_rewards, values, mask, gamma, lam)
        on = mask > 0
        torch.testing.assert_close(whiten(adv, mask)[on], theirs_adv[on], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[on], theirs_ret[on], atol=1e-5, rtol=1e-5)

        # outcome rewards through the hook's path give the same as verl's token-level input
        rewards = torch.randn(len(mask))
        theirs_adv, _ = core_algos.compute_gae_advantage_return(
            outcome_rewards(rewards, mask), values, mask, gamma, lam)
        ours, _ = gae(outcome_rewards(rewards, mask), values, mask, gamma, lam)
        torch.testing.assert_close(whiten(ours, mask)[on], theirs_adv[on], atol=1e-5,
                                   rtol=1e-5)

        g = torch.Generator().manual_seed(seed)
        new_values = values + 0.5 * torch.randn(values.shape, generator=g)
        vf, vf_clipped = clipped_value_loss(new_values, values, ret, 0.2)
        theirs_loss, theirs_frac = core_algos.compute_value_loss(
            new_values, ret, values, mask, cliprange_value=0.2, loss_agg_mode="token-mean")
        norm = Normalizers(tokens=float(mask.sum()), sequences=float(len(mask)),
                           norm_constant=1.0)
        torch.testing.assert_close(ops.aggregate_loss(vf, mask, "token-mean", norm),
                                   theirs_loss, atol=1e-5, rtol=1e-5)
        assert float(ops.masked_mean(vf_clipped.float(), mask)) == pytest.approx(
            float(theirs_frac), abs=1e-6)


def test_loss_terms_type_is_what_the_core_expects():
    run = _ppo_run()
    batch = make_batch(vocab=200)
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    logp, entropy = run.policy.logprobs(run, batch)
    terms = run.hook.rlmix_clip(run=run, mb=_mb(batch), logp=logp, entropy=entropy)
    assert isinstance(terms, LossTerms) and terms.extra is not None and terms.extra.dim() == 0
