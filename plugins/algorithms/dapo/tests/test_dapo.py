"""Tests of the four DAPO plugins: each part's math by hand and its edge cases, the hooks through
fake runs (dynamic sampling with scripted in-process env and rollout plugins), one real training
step with all four parts, and parity with verl and TRL when installed."""

from __future__ import annotations

import pytest
import torch
from rlmix_dapo import (
    clip_higher,
    decoupled_clip_surrogate,
    dynamic_sampling,
    extra_prompt_key,
    informative_groups,
    overlong,
    overlong_penalty,
    token_loss,
)

import rlmix
from rlmix import loop, ops
from rlmix.testing import make_batch, make_run
from rlmix.testing.peers import completion_logprobs as _completion_logp
from rlmix.testing.peers import pop_grads as _grads
from rlmix.testing.peers import trl_grpo_trainer as _trl_trainer
from rlmix.testing.peers import trl_loss_inputs as _trl_inputs
from rlmix.types import Minibatch, Normalizers, Prompt, RolloutBatch

# ================================================================ dapo.clip_higher

# (ratio, advantage, expected loss, clipped low?, clipped high?) by hand, bounds [0.8, 1.28]
CLIP_CASES = [
    (1.0, 2.0, -2.0, False, False),
    (1.25, 2.0, -2.5, False, False),  # above the symmetric 1.2 but inside clip-higher's 1.28
    (1.5, 2.0, -2.56, False, True),  # A > 0 above 1.28: clipped high
    (1.5, -2.0, 3.0, False, False),  # A < 0 above: the unclipped r A is the smaller, kept
    (0.5, 2.0, -1.0, False, False),  # A > 0 below: kept
    (0.5, -2.0, 1.6, True, False),  # A < 0 below 0.8: clipped low
    (0.79, 0.0, 0.0, False, False),  # A == 0: no loss, nothing clipped
]


def test_decoupled_clip_by_hand_with_gradient():
    ratio = torch.tensor([c[0] for c in CLIP_CASES], dtype=torch.float64)
    adv = torch.tensor([c[1] for c in CLIP_CASES], dtype=torch.float64)
    old = torch.full_like(ratio, -2.0)
    logp = (old + ratio.log()).requires_grad_(True)
    loss, low, high = decoupled_clip_surrogate(logp, old, adv, 0.2, 0.28)
    torch.testing.assert_close(loss.detach(), torch.tensor([c[2] for c in CLIP_CASES],
                                                           dtype=torch.float64))
    assert low.tolist() == [c[3] for c in CLIP_CASES]
    assert high.tolist() == [c[4] for c in CLIP_CASES]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.where(low | high, 0.0, -ratio * adv))


def test_clip_higher_differs_from_symmetric_clip_only_between_the_upper_bounds():
    ratio = torch.linspace(0.51, 1.61, 45, dtype=torch.float64)  # no ratio on a bound
    old = torch.zeros_like(ratio)
    for a in (1.0, -1.0):
        adv = torch.full_like(ratio, a)
        higher, _, _ = decoupled_clip_surrogate(ratio.log(), old, adv, 0.2, 0.28)
        symmetric, _, _ = decoupled_clip_surrogate(ratio.log(), old, adv, 0.2, 0.2)
        differs = (higher - symmetric).abs() > 1e-12
        expected = (ratio > 1.2) if a > 0 else torch.zeros_like(differs)
        assert differs.tolist() == expected.tolist()


def _minibatch(batch, norm_constant=5.0):
    return Minibatch(batch=batch, normalizers=Normalizers(
        tokens=float(batch.completion_mask.sum()), sequences=float(len(batch)),
        norm_constant=norm_constant))


def _random_logp(batch, seed=5):
    g = torch.Generator().manual_seed(seed)
    return -3 * torch.rand(batch.tokens.shape, generator=g) * batch.completion_mask


def _with_advantages(batch):
    batch.advantages = batch.rewards - ops.group_mean(batch.rewards, batch.group)
    return batch


@pytest.mark.parametrize("overrides, uses_behavior", [
    ([], False),
    (["train.epochs=2"], True),
    (["dapo.clip_higher.old_logp=behavior"], True),
    (["dapo.clip_higher.old_logp=detached", "train.epochs=3"], False),
])
def test_clip_higher_hook(overrides, uses_behavior):
    run = make_run({"dapo.clip_higher": clip_higher},
                   ["dapo.clip_higher.eps_low=0.1", "dapo.clip_higher.eps_high=0.4", *overrides])
    batch = _with_advantages(make_batch())
    logp = _random_logp(batch)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.full_like(logp, 2.0))
    assert terms.mode == "seq-mean-token-mean"
    old = batch.behavior_logp if uses_behavior else logp
    expected, low, high = decoupled_clip_surrogate(logp, old, batch.token_advantages(), 0.1, 0.4)
    torch.testing.assert_close(terms.loss, expected)
    mask = batch.completion_mask
    assert terms.metrics["clip/low_fraction"] == pytest.approx(float(ops.masked_mean(
        low.float(), mask)))
    assert terms.metrics["clip/high_fraction"] == pytest.approx(float(ops.masked_mean(
        high.float(), mask)))
    assert terms.metrics["clip/fraction"] == pytest.approx(
        terms.metrics["clip/low_fraction"] + terms.metrics["clip/high_fraction"])
    assert terms.metrics["entropy"] == pytest.approx(2.0)
    assert (terms.metrics["clip/fraction"] > 0) == uses_behavior


@pytest.mark.parametrize("override", [
    "dapo.clip_higher.eps_high=0.1",  # below eps_low (0.2)
    "dapo.clip_higher.eps_low=1.0", "dapo.clip_higher.eps_low=-0.1",
    "dapo.clip_higher.loss_mode=sum", "dapo.clip_higher.old_logp=old",
    "dapo.clip_higher.beta=0.1",
])
def test_clip_higher_bad_settings(override):
    with pytest.raises(rlmix.ManifestError, match="dapo.clip_higher"):
        make_run({"dapo.clip_higher": clip_higher}, [override])


def test_clip_higher_defaults_and_equal_bounds_allowed():
    s = clip_higher.Settings()
    assert (s.eps_low, s.eps_high, s.loss_mode, s.old_logp) == (
        0.2, 0.28, "seq-mean-token-mean", "auto")
    assert clip_higher.Settings(eps_low=0.2, eps_high=0.2).eps_high == 0.2


# ================================================================ dapo.token_loss


class SumOwner:
    """A stand-in loss owner: per-token loss -A * logp, aggregated seq-mean-token-sum."""

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        loss = -mb.batch.token_advantages() * logp
        return rlmix.LossTerms(loss=loss, mask=mb.batch.completion_mask,
                               mode="seq-mean-token-sum", metrics={"owner": 1.0})


@pytest.mark.parametrize("owner", ["clip_higher", "inline"])
def test_token_loss_weighs_every_token_of_the_step_alike(owner):
    plugins = ({"dapo.clip_higher": clip_higher} if owner == "clip_higher"
               else {"owner": SumOwner()})
    run = make_run({**plugins, "dapo.token_loss": token_loss})
    batch = _with_advantages(make_batch(n_groups=2, group_size=4, completion_len=6, seed=2))
    logp = _random_logp(batch).requires_grad_(True)
    mb = _minibatch(batch)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=torch.zeros_like(logp))
    assert terms.mode == "token-mean"
    assert terms.metrics  # the owner's metrics pass through
    ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers).backward()
    # on-policy (ratio 1) or -A logp: d/dlogp_t = -A / (tokens in the step), whatever the length
    total = batch.completion_mask.sum()
    torch.testing.assert_close(logp.grad, -batch.token_advantages() / total
                               * batch.completion_mask)

    # two minibatches with the step's normalisers add up to the whole batch's loss
    whole = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
    parts = 0.0
    for rows in (torch.arange(0, 3), torch.arange(3, 8)):
        sub = Minibatch(batch=batch.select(rows), normalizers=mb.normalizers)
        t = run.hook.rlmix_clip(run=run, mb=sub, logp=logp[rows], entropy=logp[rows])
        parts = parts + ops.aggregate_loss(t.loss, t.mask, t.mode, sub.normalizers)
    torch.testing.assert_close(parts, whole)


def test_without_token_loss_the_owner_keeps_its_mode():
    run = make_run({"owner": SumOwner()})
    batch = _with_advantages(make_batch())
    logp = _random_logp(batch)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    assert terms.mode == "seq-mean-token-sum"


def test_token_loss_has_no_settings():
    with pytest.raises(rlmix.ManifestError, match="dapo.token_loss"):
        make_run({"owner": SumOwner(), "dapo.token_loss": token_loss},
                 ["dapo.token_loss.mode=seq-mean-token-mean"])


# ================================================================ dapo.overlong


def test_overlong_penalty_by_hand():
    # L_max 10, L_cache 4: free up to 6, then -1/4 per token, -1 at 10 and beyond
    lengths = torch.tensor([0, 1, 6, 7, 8, 9, 10, 11, 25])
    expected = torch.tensor([0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4), expected)


def test_overlong_penalty_edges():
    # a one-token limit with a one-token cache: only the empty completion is free
    torch.testing.assert_close(overlong_penalty(torch.tensor([0, 1, 2]), 1, 1),
                               torch.tensor([0.0, -1.0, -1.0]))
    # the cache spans the whole limit: the penalty falls from the first token
    torch.testing.assert_close(overlong_penalty(torch.tensor([0.0, 2.0, 4.0]), 4, 4),
                               torch.tensor([0.0, -0.5, -1.0]))
    for bad in ((4, 0), (4, 5)):
        with pytest.raises(ValueError, match="cache_length"):
            overlong_penalty(torch.tensor([1]), *bad)


def test_overlong_hook_defaults_to_max_new_tokens_and_is_logged_as_a_term():
    run = make_run({"dapo.overlong": overlong}, ["sampling.max_new_tokens=20"])
    assert overlong.limits(run) == (20, 4)  # cache: 0.2 * 20
    overlong.rlmix_configure(run)
    batch = make_batch(n_groups=1, group_size=5, prompt_len=2, completion_len=24)
    lengths = torch.tensor([0, 16, 18, 20, 22])
    batch.completion_mask[:] = 0
    for i, length in enumerate(lengths.tolist()):
        batch.completion_mask[i, 2:2 + length] = 1  # row 0: fully masked
    loop.score(run, batch)
    expected = torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0])
    torch.testing.assert_close(batch.reward_terms["dapo.overlong.penalty"], expected)
    torch.testing.assert_close(batch.rewards, expected)

    run = make_run({"dapo.overlong": overlong}, ["dapo.overlong.max_length=8",
                                                 "dapo.overlong.cache_length=3",
                                                 "score.weights.dapo.overlong.penalty=0.5"])
    batch.reward_terms = {}  # a scored batch keeps its terms (score once): score it afresh
    loop.score(run, batch)
    torch.testing.assert_close(batch.rewards, 0.5 * overlong_penalty(lengths, 8, 3))


@pytest.mark.parametrize("overrides", [
    ["dapo.overlong.cache_length=5", "dapo.overlong.max_length=4"],
    ["dapo.overlong.max_length=-1"],
    ["dapo.overlong.length=3"],
])
def test_overlong_bad_settings(overrides):
    with pytest.raises(rlmix.ManifestError, match="dapo.overlong"):
        make_run({"dapo.overlong": overlong}, overrides)


def test_overlong_cache_longer_than_max_new_tokens_fails_at_configure():
    run = make_run({"dapo.overlong": overlong},
                   ["sampling.max_new_tokens=8", "dapo.overlong.cache_length=9"])
    with pytest.raises(rlmix.ConfigError, match="dapo.overlong"):
        overlong.rlmix_configure(run)


# ================================================================ dapo.dynamic_sampling


def test_informative_groups_and_keys():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 5.0, 0.3, 0.3 + 1e-9],
                          dtype=torch.float64)
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4])
    assert informative_groups(values, group).tolist() == [False, True, False, False, False]
    assert informative_groups(values, group, tol=0.0).tolist() == [False, True, False, False,
                                                                    True]
    keys = {extra_prompt_key(s, r) for s in range(50) for r in range(1, 20)}
    assert len(keys) == 50 * 19 and max(keys) < 0
    with pytest.raises(ValueError):
        extra_prompt_key(0, 0)


class ScriptedEnv:
    """Prompts whose groups' rewards are scripted per (step key, prompt index); a sample's text
    is its reward, which the scorer reads back. Records every step key it is asked for."""

    def __init__(self, script):
        self.script, self.keys = script, []

    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        self.keys.append(step)
        rows = self.script(step)
        return [Prompt(messages=[{"role": "user", "content": f"q{step}.{i}"}], id=f"{step}.{i}",
                       info={"rewards": r}) for i, r in enumerate(rows)]

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        correct = torch.tensor([float(t.split("|")[0]) for t in batch.texts])
        noise = torch.tensor([0.01 * float(t.split("|")[1]) for t in batch.texts])
        return {"correct": correct, "noise": noise}


class FakeRollout:
    """``rlmix_generate``: n completions per prompt, ragged, each call one column wider (so
    concatenation has to pad); token ids stay below 200 (tiny-random's byte vocabulary)."""

    def __init__(self):
        self.calls = 0

    @rlmix.hookimpl
    def rlmix_generate(self, run, request):
        self.calls += 1
        prompt_len, width = 3, 3 + self.calls
        rows, texts, prompts = [], [], []
        for p in request.prompts:
            for k in range(request.n):
                rows.append(k)
                texts.append(f"{p.info['rewards'][k]}|{k}")
                prompts.append(p)
        n = len(rows)
        g = torch.Generator().manual_seed(self.calls)
        tokens = torch.randint(10, 200, (n, prompt_len + width), generator=g)
        cmask = torch.zeros(n, prompt_len + width)
        for i, k in enumerate(rows):
            cmask[i, prompt_len:prompt_len + 1 + (k % width)] = 1
        attn = cmask.long()
        attn[:, :prompt_len] = 1
        return RolloutBatch(
            group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
            tokens=tokens, attention_mask=attn, completion_mask=cmask,
            behavior_logp=-torch.rand(n, prompt_len + width, generator=g) * cmask,
            policy_version=torch.full((n,), run.policy_version), texts=texts, prompts=prompts)


class Tagger:
    """A wrapper on rlmix_sample that counts its calls and tags each batch's info."""

    def __init__(self, tag):
        self.tag, self.calls = tag, 0

    @rlmix.hookimpl(wrapper=True)
    def rlmix_sample(self, run, prompts):
        batch = yield
        self.calls += 1
        for info in batch.info:
            info.setdefault("tags", []).append(self.tag)
        return batch


def _sampling_run(script, overrides=(), extra=None, before=None, with_policy=False):
    env, rollout = ScriptedEnv(script), FakeRollout()
    plugins = {"env": env, "rollout": rollout, **(before or {}),
               "dapo.dynamic_sampling": dynamic_sampling, **(extra or {})}
    run = make_run(plugins, ["train.prompts_per_step=3", "train.group_size=4",
                             "score.weights.env.noise=0.0", *overrides], with_policy=with_policy)
    return run, env, rollout


def _sample(run, step=0):
    run.step = step
    prompts = run.hook.rlmix_prompts(run=run, step=step)
    batch = run.sample(prompts)
    metrics = run.drain_metrics()  # what the wrapper logged for the step
    return batch, metrics


def _groups(batch):
    """The reward rows of each group, in group order."""
    return [[float(t.split("|")[0]) for t, g in zip(batch.texts, batch.group.tolist()) if g == k]
            for k in range(batch.num_groups)]


AGREE1, AGREE0 = [1, 1, 1, 1], [0, 0, 0, 0]


def test_dynamic_sampling_refills_with_fresh_prompts():
    script = {0: [AGREE1, [0, 1, 0, 1], AGREE0],
              -1: [[1, 0, 0, 0], [2, 2, 2, 2], [0, 0, 1, 1]]}
    run, env, rollout = _sampling_run(lambda step: script[step])
    batch, metrics = _sample(run)
    assert env.keys == [0, extra_prompt_key(0, 1)] == [0, -1]
    assert rollout.calls == 2
    assert _groups(batch) == [[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 1, 1]]
    assert batch.group.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert [p.id for p in batch.prompts[::4]] == ["0.1", "-1.0", "-1.2"]
    assert batch.tokens.shape == (12, 3 + 5)  # the wider round's width; the first is padded
    torch.testing.assert_close(batch.rewards, batch.reward_terms["env.correct"])
    assert metrics == {"dapo/dropped_groups": 3.0, "dapo/extra_rounds": 1.0,
                       "dapo/kept_groups": 3.0, "dapo/short_groups": 0.0,
                       "dapo/sampled_groups": 6.0}
    state = run.state["dapo.dynamic_sampling"]
    assert (state["total_dropped_groups"], state["total_extra_rounds"]) == (3, 1)
    assert "last" not in state  # per-step counts are logged, never checkpointed


def test_dynamic_sampling_truncates_surplus_groups_and_leaves_full_batches_alone():
    script = {0: [AGREE1, [0, 1, 1, 1], AGREE0],
              -1: [[1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 1]]}
    run, _, _ = _sampling_run(lambda step: script[step],
                              ["dapo.dynamic_sampling.metric=env.correct"])
    batch, metrics = _sample(run)
    assert _groups(batch) == [[0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 1]]
    assert metrics["dapo/dropped_groups"] == 2 and metrics["dapo/kept_groups"] == 3

    full = {3: [[0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 1, 1]]}
    run, env, rollout = _sampling_run(lambda step: full[step])
    batch, metrics = _sample(run, step=3)
    assert env.keys == [3] and rollout.calls == 1
    assert _groups(batch) == full[3]
    assert metrics["dapo/extra_rounds"] == 0 and metrics["dapo/dropped_groups"] == 0


def test_dynamic_sampling_stops_after_max_rounds_and_keeps_what_it_has():
    # step 7: the keys of its extra rounds are -7001, -7002; only one informative group in all
    script = {7: [AGREE1, [0, 1, 0, 0], AGREE0], -7001: [AGREE0] * 3, -7002: [AGREE1] * 3}
    run, env, rollout = _sampling_run(lambda step: script[step],
                                      ["dapo.dynamic_sampling.max_rounds=2"])
    batch, metrics = _sample(run, step=7)
    assert env.keys == [7, -7001, -7002] and rollout.calls == 3
    assert _groups(batch) == [[0, 1, 0, 0]]
    assert metrics["dapo/short_groups"] == 2 and metrics["dapo/kept_groups"] == 1
    assert metrics["dapo/dropped_groups"] == 8 and metrics["dapo/extra_rounds"] == 2


@pytest.mark.parametrize("max_rounds", [0, 3])
def test_dynamic_sampling_when_every_group_agrees_trains_on_the_first_batch(max_rounds):
    run, env, rollout = _sampling_run(lambda step: [AGREE1, AGREE0, [3, 3, 3, 3]],
                                      [f"dapo.dynamic_sampling.max_rounds={max_rounds}",
                                       "dapo.dynamic_sampling.metric=env.correct"])
    batch, metrics = _sample(run)
    assert rollout.calls == 1 + max_rounds and len(env.keys) == 1 + max_rounds
    assert _groups(batch) == [AGREE1, AGREE0, [3, 3, 3, 3]]  # the first batch, unfiltered
    assert metrics["dapo/kept_groups"] == 0 and metrics["dapo/short_groups"] == 3
    advantages = batch.rewards - ops.group_mean(batch.rewards, batch.group)
    assert torch.isfinite(advantages).all()


def test_dynamic_sampling_metric_picks_what_must_vary():
    # "correct" agrees in every group, "noise" (0.01 * sample index) never does
    run, _, _ = _sampling_run(lambda step: [AGREE1, AGREE0, AGREE1],
                              ["dapo.dynamic_sampling.max_rounds=0", "score.weights.env.noise=1"])
    _, metrics = _sample(run)
    assert metrics["dapo/dropped_groups"] == 0  # the summed reward varies
    run, _, _ = _sampling_run(lambda step: [AGREE1, AGREE0, AGREE1],
                              ["dapo.dynamic_sampling.max_rounds=0", "score.weights.env.noise=1",
                               "dapo.dynamic_sampling.metric=env.correct"])
    _, metrics = _sample(run)
    assert metrics["dapo/dropped_groups"] == 3
    run, _, _ = _sampling_run(lambda step: [AGREE1] * 3, ["dapo.dynamic_sampling.metric=acc"])
    with pytest.raises(rlmix.ConfigError, match="env.correct"):
        _sample(run)


def test_dynamic_sampling_reenters_only_the_wrappers_inside_it():
    script = {0: [AGREE1, [0, 1, 0, 1], AGREE0], -1: [AGREE0, AGREE0, AGREE0],
              -2: [[1, 0, 0, 0], [0, 0, 1, 1], AGREE1]}
    inner, outer = Tagger("inner"), Tagger("outer")
    run, _, rollout = _sampling_run(lambda step: script[step], before={"inner": inner},
                                    extra={"outer": outer})
    batch, metrics = _sample(run)
    assert rollout.calls == 3 and inner.calls == 3 and outer.calls == 1
    assert all(info["tags"] == ["inner", "outer"] for info in batch.info)
    assert metrics["dapo/extra_rounds"] == 2


@pytest.mark.parametrize("override", ["dapo.dynamic_sampling.max_rounds=-1",
                                      "dapo.dynamic_sampling.max_rounds=1000",
                                      "dapo.dynamic_sampling.tol=-1"])
def test_dynamic_sampling_bad_settings(override):
    with pytest.raises(rlmix.ManifestError, match="dapo.dynamic_sampling"):
        make_run({"dapo.dynamic_sampling": dynamic_sampling}, [override])


# ================================================================ all four in one real step


class CentredAdvantage:
    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        return batch.rewards - ops.group_mean(batch.rewards, batch.group)


def test_one_training_step_with_all_four_parts(tmp_path):
    script = {0: [AGREE1, [0, 1, 0, 1], AGREE0], -1: [[1, 0, 0, 0], AGREE0, [0, 0, 1, 1]]}
    run, _, _ = _sampling_run(
        lambda step: script[step],
        [f"out={tmp_path}", "sampling.max_new_tokens=4", "dapo.overlong.cache_length=2",
         "dapo.dynamic_sampling.metric=env.correct"],
        extra={"adv": CentredAdvantage(), "dapo.clip_higher": clip_higher,
               "dapo.token_loss": token_loss, "dapo.overlong": overlong}, with_policy=True)
    loop.configure(run)
    before = [p.detach().clone() for p in run.policy.model.parameters()]
    metrics = loop.train_step(run)
    run.hook.rlmix_step_end(run=run, metrics=metrics)
    assert metrics["policy_version"] == 1 and metrics["update/skipped"] == 0.0
    assert metrics["dapo/kept_groups"] == 3 and metrics["dapo/extra_rounds"] == 1
    # completions of 1..4 tokens with L_max 4, L_cache 2: lengths 3 and 4 are punished
    assert "reward/dapo.overlong.penalty" in metrics
    assert metrics["reward/dapo.overlong.penalty"] < 0
    assert "clip/high_fraction" in metrics and torch.isfinite(torch.tensor(metrics["loss"]))
    changed = any(not torch.equal(a, b.detach()) for a, b in
                  zip(before, run.policy.model.parameters()))
    assert changed
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert '"dapo/dropped_groups": 3.0' in lines[-1]


# ================================================================ parity with verl


def _random_inputs(seed=3, n=16, width=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    lengths[0] = 1  # a single-token completion
    mask = (torch.arange(width)[None] < lengths[:, None]).double()
    adv = torch.randn(n, 1, generator=g, dtype=torch.float64).expand(n, width)
    old = -3 * torch.rand(n, width, generator=g, dtype=torch.float64)
    # ratios in [1/e, e]: both clip bounds are crossed, verl's dual clip (3) is not
    logp = old + (2 * torch.rand(n, width, generator=g, dtype=torch.float64) - 1)
    return mask, adv, old, logp


@pytest.mark.parity
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_parity_with_verl_clip_higher_and_aggregation(mode):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from verl.workers.config import ActorConfig

    mask, adv, old, logp = _random_inputs()
    n, width = mask.shape
    normalizers = Normalizers(tokens=float(mask.sum()), sequences=float(n), norm_constant=11.0)
    # two minibatches, each divided by the whole step's counts (verl: global_batch_info)
    info = {"batch_num_tokens": float(mask.sum()), "global_batch_size": float(n),
            "loss_scale_factor": 11.0}
    config = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                         ppo_micro_batch_size_per_gpu=1, rollout_n=1, global_batch_info=info)
    ours_logp = logp.clone().requires_grad_(True)
    theirs_logp = logp.clone().requires_grad_(True)
    ours_total, theirs_total, fractions = 0.0, 0.0, []
    for rows in (torch.arange(0, 6), torch.arange(6, n)):
        loss, low, high = decoupled_clip_surrogate(ours_logp[rows], old[rows], adv[rows],
                                                   0.2, 0.28)
        ours_total = ours_total + ops.aggregate_loss(loss, mask[rows], mode, normalizers)
        theirs, metrics = core_algos.compute_policy_loss_vanilla(
            old[rows], theirs_logp[rows], adv[rows], mask[rows], loss_agg_mode=mode,
            config=config)
        theirs_total = theirs_total + theirs
        fractions.append((float(ops.masked_mean((low | high).double(), mask[rows])),
                          metrics["actor/pg_clipfrac"]))
    ours_total.backward()
    theirs_total.backward()
    torch.testing.assert_close(ours_total, theirs_total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, atol=1e-5, rtol=1e-5)
    for ours_frac, theirs_frac in fractions:
        assert ours_frac == pytest.approx(theirs_frac, abs=1e-6)
    assert any(0 < f < 1 for f, _ in fractions)


# ================================================================ parity with TRL


def _rows(inputs, rows):
    return {k: v[rows] for k, v in inputs.items()}


@pytest.mark.parity
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("loss_type, plugins, split", [
    ("grpo", [], False),  # seq-mean-token-mean: clip_higher alone
    ("bnpo", ["token_loss"], False),  # token mean of the local batch
    ("dapo", ["token_loss"], True),  # token mean over the whole generation batch
])
def test_parity_with_trl(tmp_path, loss_type, plugins, split):
    pytest.importorskip("trl")
    width = 7
    trainer, model = _trl_trainer(tmp_path, loss_type, width, epsilon=0.2, epsilon_high=0.28)
    inputs, g = _trl_inputs(width=width)
    with torch.no_grad():
        current = _completion_logp(model, inputs)
    inputs["old_per_token_logps"] = current + 0.3 * torch.randn(current.shape, generator=g)
    total_tokens = inputs["completion_mask"].sum()
    parts = [torch.arange(0, 2), torch.arange(2, 6)] if split else [torch.arange(6)]

    theirs = 0.0
    for rows in parts:
        part = _rows(inputs, rows)
        part["num_items_in_batch"] = total_tokens  # TRL's count over the generation batch
        loss = trainer._compute_loss(model, part)
        loss.backward()
        theirs = theirs + loss.detach()
    theirs_grads = _grads(model)

    run = make_run({"dapo.clip_higher": clip_higher,
                    **({"dapo.token_loss": token_loss} if plugins else {})})
    normalizers = Normalizers(tokens=float(total_tokens), sequences=6.0, norm_constant=7.0)
    ours = 0.0
    for rows in parts:
        part = _rows(inputs, rows)
        n = len(rows)
        batch = RolloutBatch(group=torch.zeros(n, dtype=torch.long), tokens=part["completion_ids"],
                             attention_mask=part["completion_mask"],
                             completion_mask=part["completion_mask"].float(),
                             behavior_logp=part["old_per_token_logps"],
                             policy_version=torch.zeros(n, dtype=torch.long),
                             advantages=part["advantages"])
        logp = _completion_logp(model, part)
        mb = Minibatch(batch=batch, normalizers=normalizers)
        run.policy_version = 1  # the samples are one version old: the ratio uses behaviour
        terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=torch.zeros_like(logp))
        assert 0 < terms.metrics["clip/fraction"] < 1
        value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, normalizers)
        value.backward()
        ours = ours + value.detach()
    ours_grads = _grads(model)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert ours_grads.keys() == theirs_grads.keys()
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, theirs_grads[name], atol=1e-5, rtol=1e-4, msg=name)
