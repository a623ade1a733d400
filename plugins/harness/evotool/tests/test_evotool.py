"""Tests of EvoTool: dominance, unique wins and the diverse parent draw; blame from trace tags
and from a judge; the reflection prompt and its parsing; collateral regressions; the budget and
resume; and the paper's claim in miniature in a world of three modules where each failure is
tagged with its module and correct text nobody asked to change is fragile."""

from __future__ import annotations

import pickle
import random
from collections import Counter
from pathlib import Path

import pytest
import rlmix_evotool
from rlmix_evotool import (
    blame_by_tags,
    diverse_parent,
    dominated,
    most_blamed,
    parse_modules,
    reflection_prompt,
    regressions,
    unique_wins,
)
from rlmix_lm.chat_server import ScriptedLM

from rlmix import loop
from rlmix.errors import ManifestError
from rlmix.testing import harness_example_resumes, make_run
from rlmix.testing.modules import module_plugins, module_rewriter

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "harness" / "evotool-arith.yaml"

# ---------------------------------------------------------------- pure parts


def test_dominance_and_unique_wins_by_hand():
    scores = [[1, 0, 0], [1, 1, 0], [0, 0, 1], [0, 0, 1]]
    assert dominated(scores, 0) and not dominated(scores, 1)
    assert not dominated(scores, 2) and not dominated(scores, 3)  # equal: neither dominates
    assert unique_wins(scores) == [0, 1, 0, 0]  # task 1: only candidate 1; task 2: two solve it


def test_diverse_parent_draws_the_front_weighted_by_unique_wins():
    scores = [[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]  # 0 is dominated by 1
    rng = random.Random(0)
    counts = Counter(diverse_parent(scores, rng) for _ in range(3000))
    assert counts[0] == 0
    # weights 1 + unique wins: candidate 1 solves tasks 1, 2 alone (3), candidate 2 task 3 (2)
    assert counts[1] / 3000 == pytest.approx(0.6, abs=0.04)


def test_blame_reads_the_trace_tags_and_picks_the_most_blamed():
    modules = ["m1", "m2", "m3"]
    assert blame_by_tags({"output": "no idea [m2]", "feedback": "m3 ..."}, modules) == "m2"
    assert blame_by_tags({"output": "no idea", "feedback": "{\"x\": \"m3 bad\"}"}, modules) == "m3"
    assert blame_by_tags({"output": "no idea", "feedback": ""}, modules) is None
    assert most_blamed(["m3", "m2", "m3", None], modules) == "m3"
    assert most_blamed(["m2", "m3"], modules) == "m2"  # ties: the earlier module
    assert most_blamed([None], modules) is None


def test_prompt_and_parsing_of_module_blocks():
    prompt = reflection_prompt({"m2": "hello"}, [{"input": "Q", "output": "no idea [m2]",
                                                  "feedback": "m2 should say beta"}])
    assert "Module m2:\n```\nhello\n```" in prompt and "Feedback: m2 should say beta" in prompt
    reply = "Module m2:\n```\nuse beta\n```\nModule m9:\n```\nx\n```"
    assert parse_modules(reply, ["m2"]) == {"m2": "use beta"}  # m9 was not asked about
    assert parse_modules("```\nuse beta\n```", ["m2"]) == {"m2": "use beta"}
    assert parse_modules("```\nuse beta\n```", ["m1", "m2"]) == {}


def test_regressions_count_pass_to_fail():
    assert regressions([1, 1, 0, 0], [1, 0, 1, 1]) == 1
    assert regressions([0, 0], [1, 1]) == 0


def test_settings_are_checked():
    with pytest.raises(ManifestError, match="evotool.target"):
        make_run({"evotool": rlmix_evotool}, ["evotool.target=everything"])


# ---------------------------------------------------------------- the search


def world_run(tmp_path, *overrides):
    run = make_run({**module_plugins(), "evotool": rlmix_evotool},
                   [f"out={tmp_path}", "train.prompts_per_step=4", "harness.m1=alpha",
                    "harness.m2=hello", "harness.m3=hello", "evotool.metric=modenv.correct",
                    "evotool.eval_size=9", *overrides])
    loop.configure(run)
    return run


BUDGET = 9 * (1 + 8)  # the seed and eight children, 9 tasks each


def evolve(run, limit=12):
    for _ in range(limit):
        update = rlmix_evotool.iterate(run)
        if update is not None:
            loop.apply_harness_update(run, update)
    return run.state["evotool"]


def arm(tmp_path, target):
    run = world_run(tmp_path / target, f"evotool.target={target}", f"evotool.budget={BUDGET}")
    run.resources["evotool.lm"] = ScriptedLM(reply=module_rewriter)
    return evolve(run), run


def test_claim_blame_targeted_mutation_beats_round_robin_and_whole_rewrites(tmp_path):
    targeted, run = arm(tmp_path, "blame")
    robin, _ = arm(tmp_path, "round_robin")
    whole, _ = arm(tmp_path, "whole")
    for state in (targeted, robin, whole):  # one budget for all three
        assert state["metric_calls"] <= BUDGET
    seed = sum(targeted["candidates"][0]["scores"]) / 9
    assert seed == pytest.approx(1 / 3)  # only m1 is right at the start
    top = {k: max(sum(c["scores"]) / 9 for c in s["candidates"])
           for k, s in (("blame", targeted), ("robin", robin), ("whole", whole))}
    assert top["blame"] == 1.0 and targeted["collateral"] == 0
    assert run.harness["m1"] == "alpha"  # the fragile correct module was never touched
    assert robin["reached_at"] is None or robin["reached_at"] > targeted["reached_at"]
    assert targeted["reached_at"] == 2  # one reflection per broken module
    assert whole["collateral"] >= 1  # whole rewrites broke solved tasks at least once
    assert top["whole"] < 1.0


def test_a_judge_can_blame_instead_of_tags(tmp_path):
    run = world_run(tmp_path, f"evotool.budget={BUDGET}", "evotool.blame=judge")

    def lm(prompt: str) -> str:
        if prompt.startswith("An AI assistant made of the modules"):  # the judge
            output = next(line for line in prompt.splitlines() if line.startswith("Output:"))
            return "m3" if "[m3]" in output else "m2"
        return module_rewriter(prompt)

    run.resources["evotool.lm"] = ScriptedLM(reply=lm)
    state = evolve(run)
    assert max(sum(c["scores"]) / 9 for c in state["candidates"]) == 1.0
    assert state["judge_calls"] > 0 and state["collateral"] == 0


def test_budget_is_never_overspent(tmp_path):
    run = world_run(tmp_path, "evotool.budget=20", "evotool.target=whole")
    run.resources["evotool.lm"] = ScriptedLM(reply=module_rewriter)
    state = evolve(run)
    assert state["metric_calls"] == 18  # the seed and one child; a second would overspend


def test_state_pickles_and_resumes(tmp_path):
    run = world_run(tmp_path / "a", f"evotool.budget={BUDGET}")
    run.resources["evotool.lm"] = ScriptedLM(reply=module_rewriter)
    rlmix_evotool.iterate(run)
    saved = pickle.loads(pickle.dumps(run.state))
    resumed = world_run(tmp_path / "b", f"evotool.budget={BUDGET}")
    resumed.resources["evotool.lm"] = ScriptedLM(reply=module_rewriter)
    resumed.state.update(saved)
    state = evolve(resumed)
    assert state["reached_at"] == 2 and state["iteration"] > 2


def test_example_manifest_runs_and_resumes_on_the_tiny_model(tmp_path):
    overrides = [
        "evotool.eval_size=2", "evotool.budget=8", "evotool.max_new_tokens=4",
        "evotool.lm.max_new_tokens=8"]
    harness_example_resumes(EXAMPLE, tmp_path / "run", overrides, "evotool/metric_calls", 8)
