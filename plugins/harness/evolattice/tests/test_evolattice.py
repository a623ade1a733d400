"""Tests of EvoLattice: credit, targeting, the path choice, repair and pruning on hand-made
lattices; the budget and resume; and the paper's claim in miniature on an epistatic world
(three components x three options, sparse feedback) where a one-candidate search that
overwrites and keeps what does not lose is trapped one edit from its start."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import rlmix_evolattice
from rlmix_evolattice import (
    alternative_means,
    credit_path,
    parse_proposal,
    prune,
    recombine_near,
    reflection_prompt,
    repair_path,
    ucb_path,
    unseen_pairs,
    weakest_component,
)
from rlmix_lm.chat_server import ScriptedLM

from rlmix import loop
from rlmix.testing import harness_example_resumes, make_run
from rlmix.testing.landscape import component_proposer, landscape_plugins, trap_world

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "harness" / "evolattice-arith.yaml"

# ---------------------------------------------------------------- pure parts


def test_every_evaluation_credits_each_alternative_on_its_path():
    credit = [[[0.0, 0], [0.0, 0]], [[0.0, 0], [0.0, 0], [0.0, 0]]]
    credit_path(credit, (0, 2), 0.5)
    credit_path(credit, (1, 2), 1.0)
    credit_path(credit, (0, 0), 0.25)
    assert credit == [[[0.75, 2], [1.0, 1]], [[0.25, 1], [0.0, 0], [1.5, 2]]]
    assert alternative_means(credit) == [[0.375, 1.0], [0.25, 0.0, 0.75]]


def test_mutation_targets_the_weakest_component_never_mutated_first():
    credit = [[[0.5, 1], [1.0, 1]], [[0.25, 1]], [[0.75, 1]]]
    assert weakest_component(credit, [1, 0, 0]) == 1  # unmutated, and its best is lowest
    assert weakest_component(credit, [1, 1, 1]) == 1
    assert weakest_component(credit, [1, 1, 0]) == 2  # never mutated comes first
    # a component whose proposals keep adding nothing stops drawing every mutation
    assert weakest_component(credit, [1, 1, 1], stale=[0, 5, 0]) == 2


def test_ucb_path_prefers_untried_alternatives_then_unseen_pairs_then_the_bound():
    credit = [[[0.5, 2], [0.0, 0]], [[1.0, 1], [0.1, 1]]]
    assert ucb_path(credit, 0.5) == (1, 0)  # the untried alternative of component 0
    seen = {(0, 0), (1, 1)}
    credit = [[[1.0, 2], [0.5, 2]], [[1.0, 2], [0.5, 2]]]
    # (0, 1) and (1, 0) each hold a pair never run together; (0, 1) has the larger bound sum
    assert unseen_pairs((0, 1), seen) == 1 and unseen_pairs((0, 0), seen) == 0
    assert ucb_path(credit, 0.0, seen) == (0, 1)
    assert ucb_path(credit, 0.0, {(0, 0), (0, 1), (1, 0), (1, 1)}) is None


def test_recombination_swaps_one_alternative_of_the_best_path():
    credit = [[[1.0, 2], [0.2, 1]], [[1.0, 2], [0.9, 1]]]
    best = (0, 0)
    found = recombine_near(best, credit, 0.0, {(0, 0)})
    assert found == (0, 1)  # the swapped-in alternative with the larger bound
    assert recombine_near(best, credit, 0.0, {(0, 0), (0, 1), (1, 0)}) is None


def test_repair_imposes_forward_dependencies_and_breaks_backward_ones():
    # component 0's alternative 1 needs component 2 = 1; component 2's alternative 0 needs
    # component 0 = 0 (a cycle through the first requirement)
    requires = [[{}, {2: 1}], [{}, {}], [{0: 0}, {}]]
    assert repair_path((1, 0, 0), requires) == (1, 0, 1)  # forward need imposed
    assert repair_path((0, 1, 0), requires) == (0, 1, 0)  # backward need already holds
    # a backward need that disagrees falls back to the dependency-free alternative 0
    requires = [[{}, {}], [{}, {0: 0}]]
    assert repair_path((1, 1), requires) == (1, 0)
    for path in [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]:
        fixed = repair_path(path, [[{}, {2: 1}], [{}, {}], [{}, {0: 1}]])
        for comp, alt in enumerate(fixed):  # every requirement of the repaired path holds
            need = [[{}, {2: 1}], [{}, {}], [{}, {0: 1}]][comp][alt]
            assert all(fixed[d] == a for d, a in need.items()), (path, fixed)


def test_prune_never_deletes_the_protected_or_the_start_alternative():
    credit = [[[0.1, 1], [0.0, 1], [0.9, 1], [0.05, 1]]]
    assert prune(credit, 0, protected=2, cap=4) is None  # within the cap
    assert prune(credit, 0, protected=2, cap=3) == 1  # the weakest that may go
    assert prune(credit, 0, protected=1, cap=3) == 3
    assert prune([[[0.1, 1], [0.0, 1]]], 0, protected=1, cap=1) is None


def test_reflection_prompt_lists_alternatives_and_parsing_reads_requires():
    prompt = reflection_prompt("system", ["be brief", "be exact"], [0.5, 0.25],
                               [{"input": "2+2?", "output": "5", "score": 0.0}])
    assert "```\nbe brief\n```" in prompt and "(score 0.25)" in prompt
    assert parse_proposal("```\nshow work\n```\nrequires: instructions=1") == \
        ("show work", {"instructions": 1})
    assert parse_proposal("plain") == ("plain", {})


def test_settings_are_checked():
    from rlmix.errors import ManifestError

    with pytest.raises(ManifestError, match="evolattice.representation"):
        make_run({"evolattice": rlmix_evolattice}, ["evolattice.representation=tree"])
    with pytest.raises(ManifestError, match="evolattice.max_alternatives"):
        make_run({"evolattice": rlmix_evolattice}, ["evolattice.max_alternatives=1"])


# ---------------------------------------------------------------- the search


def world_run(tmp_path, *overrides, start=("A", "A", "B")):
    world = trap_world()
    run = make_run({**landscape_plugins(world), "evolattice": rlmix_evolattice},
                   [f"out={tmp_path}", "train.prompts_per_step=4",
                    *[f"harness.c{k + 1}={t}" for k, t in enumerate(start)],
                    "evolattice.metric=landenv.correct", "evolattice.eval_size=8", *overrides])
    loop.configure(run)
    return run, world


def rounds(run, check=None, limit=80):
    for _ in range(limit):
        update = rlmix_evolattice.iterate(run)
        if update is not None:
            loop.apply_harness_update(run, update)
        state = run.state["evolattice"]
        if check is not None:
            check(state)
        if state["metric_calls"] + len(state["tasks"]) > run.settings("evolattice").budget:
            break


BUDGET = 160  # 20 path evaluations of 8 tasks


def search(tmp_path, representation, seed):
    run, world = world_run(tmp_path / f"{representation}-{seed}", f"evolattice.budget={BUDGET}",
                           f"evolattice.representation={representation}",
                           "evolattice.max_alternatives=3")
    run.resources["evolattice.lm"] = ScriptedLM(reply=component_proposer(world, seed))
    best_texts: list[dict[int, str]] = []
    lost = [False]

    def check(state):
        texts = {k: state["alternatives"][k][a] for k, a in enumerate(state["best_path"])}
        best_texts.append(texts)
        if representation == "lattice":  # no alternative of any best path so far is deleted
            for earlier in best_texts:
                for k, text in earlier.items():
                    assert text in state["alternatives"][k], (k, text, state["alternatives"])
        elif state["alternatives"][2][0] != "B":  # the start's right c3 was overwritten
            lost[0] = True

    rounds(run, check)
    state = run.state["evolattice"]
    assert state["metric_calls"] == BUDGET  # the same budget, fully spent, in both arms
    return state["best_score"] == 1.0, lost[0], run


def test_claim_the_lattice_finds_the_best_path_overwrite_does_not(tmp_path):
    seeds = range(20)
    lattice = [search(tmp_path, "lattice", s) for s in seeds]
    overwrite = [search(tmp_path, "overwrite", s) for s in seeds]
    found = sum(r[0] for r in lattice)
    assert found >= 18, found  # >= 90% of seeds
    assert sum(r[0] for r in overwrite) <= 10  # <= 50%
    assert sum(r[1] for r in overwrite) >= 1  # the baseline lost the right c3 in some seeds
    run = next(r[2] for r in lattice if r[0])
    assert [run.harness[c] for c in ("c1", "c2", "c3")] == ["B", "C", "B"]


def test_pruning_keeps_every_best_path_alternative_under_a_tight_cap(tmp_path):
    for seed in range(6):
        run, world = world_run(tmp_path / str(seed), f"evolattice.budget={BUDGET}",
                               "evolattice.max_alternatives=2")
        run.resources["evolattice.lm"] = ScriptedLM(reply=component_proposer(world, seed))
        best_so_far: list[dict[int, str]] = []

        def check(state, best_so_far=best_so_far):
            best_so_far.append({k: state["alternatives"][k][a]
                                for k, a in enumerate(state["best_path"])})
            for texts in best_so_far[-1:]:
                for k, text in texts.items():
                    assert text in state["alternatives"][k]
            assert all(len(a) <= 2 for a in state["alternatives"])

        rounds(run, check)
        state = run.state["evolattice"]
        assert state["pruned"], "a cap of 2 with three options must prune"
        best = {k: state["alternatives"][k][a] for k, a in enumerate(state["best_path"])}
        assert math.isclose(state["best_score"],
                            world.score_of({f"c{k + 1}": best[k] for k in best}))


def test_budget_is_never_overspent(tmp_path):
    run, world = world_run(tmp_path, "evolattice.budget=28")
    run.resources["evolattice.lm"] = ScriptedLM(reply=component_proposer(world, 0))
    rounds(run)
    assert run.state["evolattice"]["metric_calls"] == 24  # 3 paths; a 4th would overspend


def test_state_pickles_and_resumes(tmp_path):
    run, world = world_run(tmp_path / "a", f"evolattice.budget={BUDGET}")
    run.resources["evolattice.lm"] = ScriptedLM(reply=component_proposer(world, 0))
    for _ in range(3):
        rlmix_evolattice.iterate(run)
    saved = pickle.loads(pickle.dumps(run.state))
    calls = saved["evolattice"]["metric_calls"]
    paths = dict(saved["evolattice"]["paths"])
    resumed, _ = world_run(tmp_path / "b", f"evolattice.budget={BUDGET}")
    resumed.resources["evolattice.lm"] = ScriptedLM(reply=component_proposer(world, 0))
    resumed.state.update(saved)
    rounds(resumed)
    state = resumed.state["evolattice"]
    assert calls > 8 and state["metric_calls"] == BUDGET
    assert set(paths) <= set(state["paths"])  # the start was not evaluated again


def test_example_manifest_runs_and_resumes_on_the_tiny_model(tmp_path):
    overrides = [
        "evolattice.eval_size=2", "evolattice.budget=12", "evolattice.max_new_tokens=4",
        "evolattice.lm.max_new_tokens=8"]
    harness_example_resumes(EXAMPLE, tmp_path / "run", overrides, "evolattice/metric_calls", 12)
