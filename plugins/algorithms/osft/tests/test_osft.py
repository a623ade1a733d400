"""OSFT: the NLL and its expected gradient by hand, the hook on the tiny model, a reward-free
manifest, and the claim on the privileged toy world (no view): with no reward, sampled accuracy
0.4 -> >= 0.8 in 100 steps, within 0.1 of GRPO at equal rollouts; a wrong mode is sharpened."""

from __future__ import annotations

import math

import pytest
import rlmix_osft
import torch
from rlmix_osft import self_nll

import rlmix
from rlmix import loop, manifest
from rlmix.testing import make_run
from rlmix.testing.privileged import PrivilegedToyPolicy, PrivilegedToyWorld, toy_world_run


def _grpo():
    """The GRPO baseline, skipped where rlmix-grpo is not installed (nox -s isolated)."""
    return pytest.importorskip("rlmix_grpo")



def test_self_nll_hand_computed():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    tokens = torch.tensor([[1]])
    assert float(self_nll(logits, tokens, 1.0)[0, 0]) == pytest.approx(math.log(4))
    # at temperature 0.5 the distribution is (0.25, 1/16, 1/16) / (6/16) = (2/3, 1/6, 1/6)
    assert float(self_nll(logits, tokens, 0.5)[0, 0]) == pytest.approx(math.log(6))


def test_expected_gradient_is_p_train_minus_p_sample_and_zero_at_equal_temperatures():
    logits = torch.tensor([2.0, 0.5, 0.0, -1.0])
    for t_sample, t_train in ((0.5, 1.0), (1.0, 1.0)):
        p_sample = torch.softmax(logits / t_sample, -1)
        expected = torch.zeros(4)
        for y in range(4):  # the exact expectation over the sampled token
            leaf = logits.clone().requires_grad_(True)
            self_nll(leaf[None, None], torch.tensor([[y]]), t_train).sum().backward()
            expected += p_sample[y] * leaf.grad
        p_train = torch.softmax(logits / t_train, -1)
        torch.testing.assert_close(expected, (p_train - p_sample) / t_train)
    assert expected.abs().max() < 1e-6  # equal temperatures: nothing in expectation


def test_hook_on_the_tiny_model_and_a_manifest_without_scorer():
    from rlmix.testing import make_batch
    from rlmix.types import Minibatch, Normalizers

    run = make_run({"osft": rlmix_osft}, ["sampling.temperature=0.5"], with_policy=True)
    batch = make_batch(vocab=200)
    mb = Minibatch(batch=batch, normalizers=Normalizers(
        tokens=float(batch.completion_mask.sum()), sequences=float(len(batch)),
        norm_constant=5.0))
    logp, entropy = run.policy.logprobs(run, batch)
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
    # at train_temperature 1 the loss is the NLL at temperature 1, not the core's logp at 0.5
    run1 = make_run({"osft": rlmix_osft}, ["sampling.temperature=1.0"], with_policy=True)
    run1.policy.model.load_state_dict(run.policy.model.state_dict())
    logp1, _ = run1.policy.logprobs(run1, batch)
    mask = batch.completion_mask
    torch.testing.assert_close(terms.loss.detach() * mask, -logp1.detach() * mask,
                               atol=1e-5, rtol=1e-5)
    terms.loss.sum().backward()

    class PromptsAndEngine:  # an env without a scorer, and a rollout engine
        @rlmix.hookimpl
        def rlmix_prompts(self, run, step):
            return [rlmix.Prompt(messages=[{"role": "user", "content": "hi"}])]

        @rlmix.hookimpl
        def rlmix_generate(self, run, request):
            return None

    cfg = manifest.read(None, ["model=tiny-random", "plugins=[world,osft]"])
    loop.prepare(cfg, extra_plugins={"world": PromptsAndEngine()})  # no scorer, no advantage


def test_bad_settings_fail():
    with pytest.raises(rlmix.ManifestError, match="osft"):
        make_run({"osft": rlmix_osft}, ["osft.train_temperature=0"])


# ---------------------------------------------------------------- the claim


def _world(wrong_mode: bool = False) -> PrivilegedToyWorld:
    """8 prompts, 2 tokens of 6. The answer's logit is 2.15 (0.632 a position: sampled
    accuracy 0.40 at T = 1) and the greedy mode is right; with ``wrong_mode`` another token
    holds 2.15 and the answer 1.0 (greedy wrong)."""
    g = torch.Generator().manual_seed(5)
    answers = torch.randint(0, 6, (8, 2), generator=g)
    init = torch.zeros(8, 2, 6).scatter_(-1, answers[..., None], 2.15)
    if wrong_mode:
        init = torch.zeros(8, 2, 6).scatter_(-1, ((answers + 1) % 6)[..., None], 2.15)
        init.scatter_(-1, answers[..., None], 1.0)
    return PrivilegedToyWorld(PrivilegedToyPolicy(8, 2, 6, init=init), answers)


def _accuracy(world) -> float:
    return float(world.policy.answer_prob(world.answers).mean())


def test_osft_sharpens_a_right_mode_without_reward_as_far_as_grpo():
    steps = 100
    world = _world()
    start = _accuracy(world)
    run = toy_world_run(world, {"osft": rlmix_osft},
                        ["train.group_size=1", "train.prompts_per_step=8",
                         "sampling.temperature=0.5"], scorer=False)
    for _ in range(steps):
        metrics = loop.train_step(run)
    assert metrics["reward/mean"] == 0.0  # no reward anywhere
    baseline = _world()
    grpo_run = toy_world_run(baseline, {"grpo": _grpo()},
                             ["train.group_size=4", "train.prompts_per_step=2"])
    for _ in range(steps):
        loop.train_step(grpo_run)
    assert world.generated_rows == baseline.generated_rows == 8 * steps
    osft, grpo = _accuracy(world), _accuracy(baseline)
    print(f"sampled accuracy (T = 1): start {start:.3f}, OSFT {osft:.3f}, GRPO {grpo:.3f}")
    assert start == pytest.approx(0.4, abs=0.01)
    assert osft >= 0.8
    assert abs(osft - grpo) <= 0.1


def test_negative_control_osft_sharpens_a_wrong_mode_too():
    world = _world(wrong_mode=True)
    start = _accuracy(world)
    run = toy_world_run(world, {"osft": rlmix_osft},
                        ["train.group_size=1", "train.prompts_per_step=8",
                         "sampling.temperature=0.5"], scorer=False)
    for _ in range(100):
        loop.train_step(run)
    end = _accuracy(world)
    print(f"wrong mode: sampled accuracy {start:.3f} -> {end:.3f}")
    assert end < start / 4  # the boundary: OSFT amplifies what the model already prefers
