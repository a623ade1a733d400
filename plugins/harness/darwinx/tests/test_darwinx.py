"""Tests of DarwinX: the preserve-and-extend contract, component-wise recombination, the typed
edit prompt, the budget and resume; and the paper's claim in miniature on a path-dependent
world (the first edit of either line makes the other's fix conflict): lineages keep monotone
solved sets and recombination reaches 1.0, single-lineage accept-if-better plateaus."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import rlmix_darwinx
from rlmix_darwinx import edit_prompt, extends, parse_proposal, recombination, solved
from rlmix_lm.chat_server import ScriptedLM

from rlmix import loop
from rlmix.errors import ManifestError
from rlmix.testing import harness_example_resumes, make_run
from rlmix.testing.landscape import landscape_plugins, path_proposer, path_world

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "harness" / "darwinx-arith.yaml"


def test_preserve_and_extend_needs_a_strict_superset_of_every_parent():
    assert extends({0, 1, 2}, [{0, 1}])
    assert not extends({0, 1}, [{0, 1}])  # no new task
    assert not extends({0, 2, 3}, [{0, 1}])  # lost task 1
    assert extends({0, 1, 2}, [{0, 1}, {0, 2}]) and not extends({0, 1, 2}, [{0, 1}, {3}])
    assert solved([1.0, 0.0, 1.0]) == {0, 2}


def test_recombination_takes_each_component_from_the_line_that_changed_it():
    root = {"c1": "s", "c2": "s", "c3": "s"}
    a = {"c1": "x", "c2": "s", "c3": "p"}
    b = {"c1": "s", "c2": "y", "c3": "q"}
    assert recombination(a, b, root, {0, 1}, {0}) == {"c1": "x", "c2": "y", "c3": "p"}
    assert recombination(a, b, root, {0}, {0, 1}) == {"c1": "x", "c2": "y", "c3": "q"}
    # one line's changes contain the other's: nothing to combine
    assert recombination(a, {**a, "c2": "y"}, root, set(), set()) is None


def test_edit_prompt_has_typed_evidence_blocks():
    prompt = edit_prompt("c2", {"c1": "x", "c2": "s"},
                         [{"input": "q1", "output": "no"}], [{"input": "q2", "output": "ok"}],
                         [{"input": "q3", "output": "yes"}])
    assert "Component c1:\n```\nx\n```" in prompt and "Edit: c2" in prompt
    for kind in ("[failure]", "[teacher]", "[self]"):
        assert kind in prompt
    assert parse_proposal("```\ny\n```") == "y"


def test_settings_are_checked():
    with pytest.raises(ManifestError, match="darwinx.mode"):
        make_run({"darwinx": rlmix_darwinx}, ["darwinx.mode=tree"])


def world_run(tmp_path, *overrides):
    world = path_world()
    run = make_run({**landscape_plugins(world), "darwinx": rlmix_darwinx},
                   [f"out={tmp_path}", "train.prompts_per_step=4", "harness.c1=s", "harness.c2=s",
                    "darwinx.metric=landenv.correct", "darwinx.eval_size=8", *overrides])
    loop.configure(run)
    run.resources["darwinx.lm"] = ScriptedLM(reply=path_proposer())
    return run


BUDGET = 8 * 7  # the seed and six evaluations


def evolve(run, check=None, rounds=12):
    for _ in range(rounds):
        update = rlmix_darwinx.iterate(run)
        if update is not None:
            loop.apply_harness_update(run, update)
        if check is not None:
            check(run.state["darwinx"])
    return run.state["darwinx"]


def monotone(state):
    for line in state["lineages"]:
        sets = [solved(state["variants"][v]["scores"]) for v in line]
        assert all(a < b for a, b in zip(sets, sets[1:])), sets
        for v in line:  # and every admitted variant extends each of its parents
            parents = state["variants"][v]["parents"]
            assert extends(solved(state["variants"][v]["scores"]),
                           [solved(state["variants"][p]["scores"]) for p in parents])


def test_claim_recombined_lineages_reach_the_top_single_lineage_plateaus(tmp_path):
    darwin = evolve(world_run(tmp_path / "d", f"darwinx.budget={BUDGET}"), check=monotone)
    single = evolve(world_run(tmp_path / "s", f"darwinx.budget={BUDGET}",
                              "darwinx.mode=single_lineage"))
    for state in (darwin, single):
        assert state["metric_calls"] <= BUDGET
    top = {k: max(sum(v["scores"]) / 8 for v in s["variants"])
           for k, s in (("darwin", darwin), ("single", single))}
    assert top["darwin"] == 1.0
    assert top["single"] <= 0.75
    kinds = [h["kind"] for h in darwin["history"] if h["admitted"]]
    assert kinds[-1] == "recombination" and len(darwin["lineages"]) >= 3


def test_without_recombination_darwinx_keeps_both_lines_but_stops_short(tmp_path):
    state = evolve(world_run(tmp_path, f"darwinx.budget={BUDGET}", "darwinx.recombine=false"),
                   check=monotone)
    assert len(state["lineages"]) == 2
    assert max(sum(v["scores"]) / 8 for v in state["variants"]) == 0.5


def test_budget_and_resume(tmp_path):
    state = evolve(world_run(tmp_path / "a", "darwinx.budget=20"))
    assert state["metric_calls"] == 16
    run = world_run(tmp_path / "b", f"darwinx.budget={BUDGET}")
    rlmix_darwinx.iterate(run)
    saved = pickle.loads(pickle.dumps(run.state))
    resumed = world_run(tmp_path / "c", f"darwinx.budget={BUDGET}")
    resumed.state.update(saved)
    state = evolve(resumed, check=monotone)
    assert max(sum(v["scores"]) / 8 for v in state["variants"]) == 1.0


def test_teacher_evidence_reaches_the_prompt(tmp_path):
    path = tmp_path / "teacher.jsonl"
    path.write_text(json.dumps({"input": "Task 1.0.", "output": "ANSWER 1.0"}) + "\n")
    run = world_run(tmp_path / "run", f"darwinx.teacher_path={path}", "darwinx.budget=24")
    evolve(run, rounds=1)
    assert "[teacher] Input: Task 1.0." in run.resources["darwinx.lm"].prompts[0]


def test_example_manifest_runs_and_resumes_on_the_tiny_model(tmp_path):
    overrides = [
        "darwinx.eval_size=2", "darwinx.budget=8", "darwinx.max_new_tokens=4",
        "darwinx.lm.max_new_tokens=8"]
    harness_example_resumes(EXAMPLE, tmp_path / "run", overrides, "darwinx/metric_calls", 8)
