"""Tests of AR3PO: the stage rule and the reuse rule by hand, the wrapper's budget and cache on a
synthetic env, settings checks, a checkpoint round trip of the cache, and the claim: fewer
zero-advantage groups than GRPO at the same number of generated rollouts."""

from __future__ import annotations

import random

import pytest
import rlmix_ar3po
import torch
from rlmix_ar3po import next_stage, reuse_rows

import rlmix
from rlmix.loop import score
from rlmix.testing import make_run
from rlmix.testing.allocation import KnownRateEnv as SyntheticEnv
from rlmix.testing.allocation import sample_steps as _steps


def _run(env, overrides=(), ar3po=True, group_size=4):
    plugins = {"env": env, "ar3po": rlmix_ar3po} if ar3po else {"env": env}
    return make_run(plugins, ["train.prompts_per_step=4", f"train.group_size={group_size}",
                              *overrides])


def test_next_stage_only_feeds_unsolved_prompts_within_stage_and_budget_limits():
    wins = {"a": 0, "b": 3, "c": 0, "d": 0}
    stages = {"a": 1, "b": 1, "c": 2, "d": 1}
    assert next_stage(wins, stages, 2, 4, 100) == [("a", 4), ("d", 4)]  # b solved, c at max
    assert next_stage(wins, stages, 2, 4, 6) == [("a", 4), ("d", 2)]  # the budget runs out
    assert next_stage(wins, stages, 3, 4, 100) == [("a", 4), ("c", 4), ("d", 4)]
    assert next_stage({"a": 1}, {"a": 1}, 5, 4, 100) == []


def test_reuse_rows_picks_all_wrong_groups_with_a_cached_success():
    assert reuse_rows({"a": 0, "b": 2, "c": 0}, {"a": 1, "b": 1}) == ["a"]


def test_budget_is_spent_exactly_and_unsolved_prompts_get_a_second_stage():
    rates = [0.0, 1.0, 0.0, 1.0]
    env = SyntheticEnv(rates, seed=1)
    run = _run(env, ["ar3po.reuse=false", "ar3po.new_prompts=false"])
    (generated, _, batch), = _steps(run, env, 1)
    assert generated == 4 * 8 == run.state["ar3po"]["rollouts"]
    sizes = torch.bincount(batch.group).tolist()
    by_task = {p.answer: n for p, n in zip([batch.prompts[(batch.group == g).nonzero()[0]]
                                            for g in range(batch.num_groups)], sizes)}
    # the impossible tasks took the second stage; the leftover 8 go to the first group
    assert by_task[0] == 8 + 8 and by_task[2] == 8 and by_task[1] == 4 and by_task[3] == 4


def test_new_prompts_take_the_savings_of_solved_prompts():
    env = SyntheticEnv([1.0] * 8, seed=2)
    run = _run(env)
    (generated, _, batch), = _steps(run, env, 1)
    assert generated == 32 and batch.num_groups == 8  # 4 step prompts + 4 new ones
    assert run.pending_metrics["ar3po/new_prompt_rollouts"] == 16


def test_cached_correct_response_joins_an_all_wrong_group():
    rates = [0.5] * 4
    env = SyntheticEnv(rates, seed=0)
    run = _run(env, ["ar3po.new_prompts=false", "ar3po.stages=1", "ar3po.budget_per_prompt=4"])
    _steps(run, env, 1)
    cache = run.state["ar3po"]["cache"]
    assert cache and all(row.texts == ["1"] for row in cache.values())
    env.rates = [0.0] * 4  # now every task fails: the cached successes are the only signal
    run.step = 1
    batch = run.sample(run.hook.rlmix_prompts(run=run, step=0))
    score(run, batch)
    assert len(batch) == 16 + len(cache) and run.state["ar3po"]["rollouts"] == 32
    for g in range(batch.num_groups):
        texts = [batch.texts[i] for i in (batch.group == g).nonzero().flatten().tolist()]
        assert texts.count("1") == 1 and len(texts) == 5


def test_cache_survives_a_checkpoint(tmp_path):
    env = SyntheticEnv([0.5] * 4, seed=0)
    run = _run(env)
    _steps(run, env, 2)
    torch.save(run.state, tmp_path / "state.pt")  # what the core's checkpointer writes
    restored = torch.load(tmp_path / "state.pt", weights_only=False)  # and how it reads it
    assert restored["ar3po"]["cache"].keys() == run.state["ar3po"]["cache"].keys()
    row = next(iter(restored["ar3po"]["cache"].values()))
    assert row.texts == ["1"] and len(row) == 1
    assert restored["ar3po"]["rollouts"] == 64


@pytest.mark.parametrize("override", ["ar3po.stages=0", "ar3po.budget_per_prompt=-1",
                                      "ar3po.key=name"])
def test_bad_settings_are_rejected_naming_the_setting(override):
    with pytest.raises(rlmix.ConfigError, match=override.split(".")[1].split("=")[0]):
        _run(SyntheticEnv([0.5]), [override])


def test_claim_fewer_zero_advantage_groups_than_grpo_at_equal_budget():
    # 24 tasks: impossible, trivial, easy (90%), hard (5%) and moderate (30%) ones
    rates = [0.0] * 4 + [1.0] * 4 + [0.9] * 4 + [0.05] * 6 + [0.3] * 6
    random.Random(0).shuffle(rates)
    steps = 30
    env_g, env_a = SyntheticEnv(rates, seed=5), SyntheticEnv(rates, seed=5)
    grpo = _steps(_run(env_g, ar3po=False, group_size=8), env_g, steps)
    run_a = _run(env_a)
    ar3po = _steps(run_a, env_a, steps)
    budget_g = sum(r[0] for r in grpo)
    assert budget_g == run_a.state["ar3po"]["rollouts"] == env_a.generated == steps * 32

    def summary(rows):
        """(zero-advantage groups among the steps' own prompts, informative groups in all)"""
        own_zero, informative = 0, 0
        for _generated, flat, batch in rows:
            for g, f in enumerate(flat):
                prompt = batch.prompts[int((batch.group == g).nonzero()[0])]
                own_zero += f and not prompt.id.startswith("step-")  # not an extra prompt
                informative += not f
        return own_zero, informative

    zero_g, informative_g = summary(grpo)
    zero_a, informative_a = summary(ar3po)
    assert zero_g > 0.5 * steps * 4  # GRPO: most of the step's groups carry no signal
    assert zero_a < 0.9 * zero_g  # the same prompts, fewer dead groups (stages + reuse)
    assert informative_a > 1.5 * informative_g  # and the savings buy more informative groups
    assert run_a.state["ar3po"]["reused"] > 0
