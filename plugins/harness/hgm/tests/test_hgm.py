"""Tests of HGM: clade totals and the level-by-level Thompson draw on hand-made trees, the
budget, resume, and the paper's claim in miniature on a deceptive landscape where only a
stepping stone that scores below its sibling leads to the top (sparse feedback: the proposer
cannot read the next edit off the traces, so only the choice of node to expand matters)."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest
import rlmix_hgm
from rlmix_hgm import (
    best_own_score,
    clade_thompson,
    clade_totals,
    evidence_counts,
    metaproductivity_counts,
    parse_proposal,
    reflection_prompt,
)
from rlmix_lm.chat_server import ScriptedLM

from rlmix import loop
from rlmix.testing import harness_example_resumes, make_run
from rlmix.testing.landscape import (
    deceptive_landscape,
    landscape_plugins,
    landscape_proposer,
    path_of,
)

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "harness" / "hgm-arith.yaml"

# ---------------------------------------------------------------- pure parts


def test_clade_totals_pool_every_descendant_by_hand():
    #     0
    #    / \
    #   1   2
    #  / \
    # 3   4
    parents = [None, 0, 0, 1, 1]
    s = [0.5, 0.25, 1.0, 0.75, 0.5]
    n = [1, 1, 1, 1, 1]
    totals = clade_totals(parents, s, n)
    assert totals[3] == (0.75, 1) and totals[4] == (0.5, 1) and totals[2] == (1.0, 1)
    assert totals[1] == (0.25 + 0.75 + 0.5, 3)
    assert totals[0] == (sum(s), 5)


def test_evidence_counts_node_versus_task():
    scores = [[1, 0, 0, 1], [1, 1, 1, 1]]
    assert evidence_counts(scores, "node") == ([0.5, 1.0], [1.0, 1.0])
    assert evidence_counts(scores, "task") == ([2.0, 4.0], [4.0, 4.0])


def test_metaproductivity_counts_descendants_only_by_hand():
    parents = [None, 0, 0, 1]
    s, n = [0.25, 0.25, 0.5, 1.0], [1, 1, 1, 1]
    # node 1 has one descendant (node 3: 1.0); node 0's descendants are 1, 2, 3; leaves: own
    assert metaproductivity_counts(parents, s, n) == [(1.75, 3), (1.0, 1), (0.5, 1), (1.0, 1)]


def test_thompson_descends_into_the_clade_whose_descendants_did_well():
    # root 0 has two children: 1 (scored 0.25, but its child 3 scored 1.0) and 2 (0.5, leaf)
    parents = [None, 0, 0, 1]
    scores = [[0.25] * 4, [0.25] * 4, [0.5] * 4, [1.0] * 4]
    rng = random.Random(0)
    picks = [clade_thompson(parents, scores, rng, "task") for _ in range(2000)]
    # CMP evidence: node 1 -> its child's 4 of 4; node 2 (leaf) -> 2 of 4; root -> 6 of 12
    into_one = sum(p in (1, 3) for p in picks) / len(picks)
    assert into_one > 0.6
    assert sum(p == 2 for p in picks) > 0 and sum(p == 0 for p in picks) > 0  # still explores
    # the greedy baseline never looks past a node's own score: node 3 (1.0) here, but on a
    # tree without it the 0.5 sibling, never the 0.25 stepping stone
    assert best_own_score(scores) == 3
    assert best_own_score(scores[:3]) == 2


def test_a_leaf_root_is_expanded_and_ties_break_at_random():
    assert clade_thompson([None], [[0.0]], random.Random(1)) == 0
    rng = random.Random(0)
    picks = {best_own_score([[0.5], [0.5], [0.25]], rng) for _ in range(50)}
    assert picks == {0, 1}


def test_reflection_prompt_and_parsing():
    prompt = reflection_prompt("instructions", "be brief",
                               [{"input": "2+2?", "output": "5", "score": 0.0}])
    assert "```\nbe brief\n```" in prompt and "Output: 5" in prompt
    assert parse_proposal("Sure:\n```text\nbe exact\n```\nthanks") == "be exact"
    assert parse_proposal("no fences") == "no fences"


def test_settings_are_checked():
    from rlmix.errors import ManifestError

    with pytest.raises(ManifestError, match="hgm.selection"):
        make_run({"hgm": rlmix_hgm}, ["hgm.selection=best"])
    with pytest.raises(ManifestError, match="hgm.budget"):
        make_run({"hgm": rlmix_hgm}, ["hgm.eval_size=0"])


# ---------------------------------------------------------------- the search on a landscape


def landscape_run(tmp_path, world, *overrides):
    run = make_run({**landscape_plugins(world), "hgm": rlmix_hgm},
                   [f"out={tmp_path}", "train.prompts_per_step=4", "harness.instructions=''",
                    "hgm.metric=landenv.correct", "hgm.eval_size=8", *overrides])
    loop.configure(run)
    return run


def search(run, attempts=60):
    """Expand until the budget cannot pay for another child."""
    for _ in range(attempts):
        update = rlmix_hgm.iterate(run)
        if update is not None:
            loop.apply_harness_update(run, update)
        state = run.state["hgm"]
        if state["metric_calls"] + len(state["tasks"]) > run.settings("hgm").budget:
            break


EXPANSIONS = 12
BUDGET = 8 * (1 + EXPANSIONS)  # the root and 12 children, 8 tasks each


def reached_top(tmp_path, selection, seed):
    world = deceptive_landscape()
    run = landscape_run(tmp_path / f"{selection}-{seed}", world, f"hgm.budget={BUDGET}",
                        f"hgm.selection={selection}", f"hgm.seed={seed}")
    run.resources["hgm.lm"] = ScriptedLM(reply=landscape_proposer(world, seed))
    search(run)
    state = run.state["hgm"]
    assert state["metric_calls"] == BUDGET  # same budget for both arms, fully spent
    assert len(state["nodes"]) == 1 + EXPANSIONS
    best = max(sum(n["scores"]) / 8 for n in state["nodes"])
    if best == 1.0:  # the applied harness is the top node, reached through the stepping stone
        assert path_of(run.harness["instructions"]) == ("s", "a", "b")
    return best == 1.0


def test_claim_clade_thompson_finds_the_stepping_stone_line_greedy_does_not(tmp_path):
    seeds = range(20)
    hgm = sum(reached_top(tmp_path, "clade_thompson", s) for s in seeds)
    greedy = sum(reached_top(tmp_path, "own_score", s) for s in seeds)
    assert hgm >= 16, hgm  # >= 80% of 20 seeds reach 1.0 within 12 expansions
    assert greedy <= 4, greedy  # <= 20%: the stepping stone scores below root and sibling


def test_budget_is_never_overspent_and_the_best_node_is_applied(tmp_path):
    world = deceptive_landscape()
    run = landscape_run(tmp_path, world, "hgm.budget=30")
    run.resources["hgm.lm"] = ScriptedLM(reply=landscape_proposer(world, 0))
    search(run)
    state = run.state["hgm"]
    assert state["metric_calls"] == 24  # root + 2 children; a third would overspend
    best = best_own_score([n["scores"] for n in state["nodes"]])
    assert run.harness["instructions"] == state["nodes"][best]["texts"]["instructions"]
    assert (tmp_path / "harness" / f"v{run.harness_version:04d}.json").exists() or best == 0


def test_no_new_text_adds_no_node_and_costs_no_calls(tmp_path):
    world = deceptive_landscape()
    run = landscape_run(tmp_path, world, "hgm.budget=100")
    run.resources["hgm.lm"] = ScriptedLM(["```\n\n```"])  # proposes the root's own (empty) text
    search(run, attempts=5)
    state = run.state["hgm"]
    assert len(state["nodes"]) == 1 and state["metric_calls"] == 8
    assert [h["child"] for h in state["history"]] == [None] * 5


def test_state_pickles_and_a_resumed_search_continues_from_it(tmp_path):
    def fresh(path):
        world = deceptive_landscape()
        run = landscape_run(path, world, f"hgm.budget={BUDGET}", "hgm.seed=3")
        run.resources["hgm.lm"] = ScriptedLM(reply=landscape_proposer(world, 3))
        return run

    half = fresh(tmp_path / "half")
    for _ in range(4):
        rlmix_hgm.expand(half)
    saved = pickle.loads(pickle.dumps(half.state))
    assert saved["hgm"]["metric_calls"] == 8 * 5
    old_nodes = [dict(n["texts"]) for n in saved["hgm"]["nodes"]]
    resumed = fresh(tmp_path / "resumed")
    resumed.state.update(saved)
    search(resumed)
    state = resumed.state["hgm"]
    # the root was not evaluated again, the old nodes are kept, and the budget still holds
    assert [n["texts"] for n in state["nodes"][:5]] == old_nodes
    assert state["metric_calls"] == BUDGET and len(state["nodes"]) == 1 + EXPANSIONS


def test_example_manifest_runs_and_resumes_on_the_tiny_model(tmp_path):
    overrides = [
        "hgm.eval_size=2", "hgm.budget=8", "hgm.max_new_tokens=4", "hgm.lm.max_new_tokens=8"]
    harness_example_resumes(EXAMPLE, tmp_path / "run", overrides, "hgm/metric_calls", 8)
