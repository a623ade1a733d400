"""Tests of E3: the difficulty allocation and the temperature rule by hand, the entropy estimate,
the sampler's budget, posterior and temperature state, settings checks, and the claim: at the
same rollout budget, E3 holds the sampling entropy near its target while GRPO's collapses."""

from __future__ import annotations

import math

import pytest
import rlmix_e3
import torch
from rlmix_e3 import difficulty_allocation, entropy_temperature_step, sample_entropy

import rlmix
from rlmix.testing import ToyPolicy, make_batch, make_run
from rlmix.testing.allocation import ToyPolicyEnv as ToyEnv
from rlmix.testing.allocation import toy_policy_loop as toy_loop
from rlmix.types import Prompt


def test_difficulty_allocation_by_hand():
    # min 2 each (8), the other 8 split 1 : 3 : 0 : 0 -> 2 and 6
    assert difficulty_allocation(torch.tensor([0.25, 0.75, 0.0, 0.0]), 16, 2, 16) == [4, 8, 2, 2]
    # capped at 5: the excess goes to the next hardest
    assert difficulty_allocation(torch.tensor([0.1, 0.9, 0.0]), 12, 2, 5) == [5, 5, 2]
    # no difficulty anywhere: even split
    assert difficulty_allocation(torch.zeros(4), 16, 1, 16) == [4, 4, 4, 4]
    for seed in range(20):
        d = torch.rand(5, generator=torch.Generator().manual_seed(seed))
        counts = difficulty_allocation(d, 40, 2, 20)
        assert sum(counts) == 40 and min(counts) >= 2 and max(counts) <= 20
        hardest, easiest = int(d.argmax()), int(d.argmin())
        assert counts[hardest] >= counts[easiest]
    with pytest.raises(ValueError, match="budget"):
        difficulty_allocation(torch.ones(4), 6, 2, 8)


def test_entropy_temperature_step_by_hand():
    assert entropy_temperature_step(1.0, 0.5, 1.0, 0.4, 0.3, 2.0) == pytest.approx(1.2)
    assert entropy_temperature_step(1.0, 1.5, 1.0, 0.4, 0.3, 2.0) == pytest.approx(0.8)
    assert entropy_temperature_step(1.9, 0.0, 1.0, 0.4, 0.3, 2.0) == 2.0
    assert entropy_temperature_step(0.4, 3.0, 1.0, 0.4, 0.3, 2.0) == 0.3


def test_sample_entropy_estimates_the_sampling_entropy():
    batch = make_batch()
    mask = batch.completion_mask
    expected = float(-(batch.behavior_logp * mask).sum() / mask.sum())
    assert sample_entropy(batch) == pytest.approx(expected)
    pol = ToyPolicy(vocab=6, length=4)  # uniform: entropy log 6 per token
    env = ToyEnv(pol, lambda b: {"r": torch.zeros(len(b))})
    run = make_run({"env": env}, ["train.prompts_per_step=2"])
    big = env.rlmix_generate(run, rlmix.GenerationRequest(prompts=[Prompt(messages=[])],
                                                          n=2000))
    assert sample_entropy(big) == pytest.approx(math.log(6), rel=1e-4)


def _reward(batch):
    return {"correct": (batch.tokens[:, 1:] == 1).float().mean(-1)}


def _run(env, e3=True, overrides=()):
    plugins = {"env": env, "grpo": pytest.importorskip("rlmix_grpo")}  # the baseline
    if e3:
        plugins["e3"] = rlmix_e3
    return make_run(plugins, ["train.prompts_per_step=4", "train.group_size=8", *overrides])


def test_sampler_spends_the_budget_by_difficulty_and_tracks_temperature():
    env = ToyEnv(ToyPolicy(vocab=6, length=4), _reward)
    run = _run(env, overrides=["e3.target_entropy=1.0"])
    key = "text:user: p0"
    run.state["e3"] = {"posterior": {key: (1.0, 9.0)}, "rollouts": 0, "temperature": None,
                       "target": None, "entropy": []}  # p0 is known to be hard
    batch = run.sample(run.hook.rlmix_prompts(run=run, step=0))
    assert len(batch) == 32 == env.generated == run.state["e3"]["rollouts"]
    sizes = {batch.prompts[int((batch.group == g).nonzero()[0])].messages[0]["content"]:
             int((batch.group == g).sum()) for g in range(batch.num_groups)}
    assert sizes["p0"] > sizes["p1"] and sum(sizes.values()) == 32
    # uniform toy: entropy log 6 > 1.0, so the temperature goes down by lr * (1 - log 6)
    assert run.state["e3"]["temperature"] == pytest.approx(
        max(0.3, 1.0 + 0.5 * (1.0 - sample_entropy(batch))))
    a, b = run.state["e3"]["posterior"][key]
    assert a + b == 10.0 + sizes["p0"]


@pytest.mark.parametrize("override", ["e3.min_rollouts=0", "e3.temp_min=0", "e3.key=name",
                                      "e3.temp_max=0.1"])
def test_bad_settings_are_rejected_naming_the_setting(override):
    name = override.split(".")[1].split("=")[0]
    with pytest.raises(rlmix.ConfigError, match=name.split("_")[0]):
        _run(ToyEnv(ToyPolicy(), _reward), overrides=[override])


def test_claim_entropy_held_near_target_while_grpo_collapses():
    target, steps = 1.2, 80
    traces = {}
    for name, e3 in (("grpo", False), ("e3", True)):
        env = ToyEnv(ToyPolicy(vocab=6, length=4), _reward, seed=1)
        # the toy sharpens fast, so the temperature may climb past the LLM-minded default cap
        run = _run(env, e3=e3, overrides=[f"e3.target_entropy={target}", "e3.temp_max=5"]
                   if e3 else [])
        ent = []
        toy_loop(run, env, steps, lr=0.05, on_batch=lambda b, ent=ent: ent.append(
            sample_entropy(b)))
        traces[name] = (env.generated, ent)
        if e3:
            assert run.state["e3"]["rollouts"] == env.generated
    assert traces["grpo"][0] == traces["e3"][0] == steps * 32  # equal rollout budget
    late_g = sum(traces["grpo"][1][-20:]) / 20
    late_e = sum(traces["e3"][1][-20:]) / 20
    assert late_g < target - 0.5  # GRPO sharpens: its samples lose most of their entropy
    assert abs(late_e - target) < 0.2
