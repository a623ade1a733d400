"""Tests of the acceptance gates: the flip gate on hand-made scores, the disjoint task split and
its held-out guard, the plugin's resource and metrics, settings checks, and the claim in
miniature: choosing by mean score alone accepts a proposal that trades solved tasks for new
ones, the flip gate refuses it and keeps the one that only adds."""

from __future__ import annotations

import pytest
import rlmix_gates
from rlmix_gates import Gates, Settings, flip_gate, split_tasks

import rlmix
from rlmix import loop
from rlmix.testing import make_run


def test_flip_gate_counts_regressions_and_fixes_by_hand():
    before = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    after = [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]  # task 1 breaks, tasks 2 and 3 are fixed
    r = flip_gate(before, after)
    assert (r.passed, r.regressions, r.fixes, r.allowed) == (False, [1], [2, 3], 0)
    assert "1 pass->fail" in r.reason
    # a tolerance of 1/6 of the check set allows exactly one flip
    assert flip_gate(before, after, tolerance=1 / 6).passed
    assert not flip_gate(before, [0, 0, 1, 1, 1, 0], tolerance=1 / 6).passed
    # the threshold decides what a pass is
    assert flip_gate([0.6, 0.4], [0.55, 0.0], threshold=0.5).passed
    assert not flip_gate([0.6, 0.4], [0.55, 0.0], threshold=0.3).passed


def test_flip_gate_rejects_mismatched_sets():
    with pytest.raises(ValueError, match="same tasks"):
        flip_gate([1, 0], [1])
    with pytest.raises(ValueError, match="tolerance"):
        flip_gate([1], [1], tolerance=2)


def test_claim_mean_score_alone_accepts_a_trade_the_gate_refuses():
    current = [1, 1, 1, 0, 0, 0, 0, 0]
    trade = [0, 0, 0, 1, 1, 1, 1, 0]  # mean 0.5 > 0.375, but three solved tasks now fail
    adds = [1, 1, 1, 1, 0, 0, 0, 0]  # mean 0.5 too, nothing lost
    assert sum(trade) > sum(current) and sum(adds) > sum(current)
    assert not flip_gate(current, trade).passed
    assert flip_gate(current, adds).passed


def test_split_is_disjoint_sized_seeded_and_complete():
    ids = [(s, i) for s in range(5) for i in range(4)]
    split = split_tasks(ids, {"search": 8, "selection": 6, "heldout": 4}, seed=1)
    sets = [set(split.search), set(split.selection), set(split.heldout)]
    assert [len(x) for x in sets] == [8, 6, 4]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert split == split_tasks(ids, {"search": 8, "selection": 6, "heldout": 4}, seed=1)
    assert split != split_tasks(ids, {"search": 8, "selection": 6, "heldout": 4}, seed=2)
    ordered = split_tasks(ids, {"search": 2, "heldout": 1}, shuffle=False)
    assert (ordered.search, ordered.selection, ordered.heldout) == (ids[:2], [], ids[2:3])
    with pytest.raises(ValueError, match="only 20 given"):
        split_tasks(ids, {"search": 20, "heldout": 1})
    with pytest.raises(ValueError, match="unknown set"):
        split_tasks(ids, {"train": 1})
    with pytest.raises(ValueError, match="not distinct"):
        split_tasks([1, 1, 2], {"search": 1})


def test_heldout_guard_refuses_tasks_the_search_saw():
    gates = Gates(Settings(seed=3))
    split = gates.split(list(range(10)), {"search": 4, "selection": 3, "heldout": 3})
    gates.guard_heldout(split.heldout)  # never shown to the search: fine
    with pytest.raises(ValueError, match="seen by the search"):
        gates.guard_heldout([split.selection[0]])


def test_plugin_registers_its_gates_and_reports(tmp_path):
    run = make_run({"gates": rlmix_gates}, [f"out={tmp_path}", "gates.flip_tolerance=0.5"])
    loop.configure(run)
    gates = run.resources[rlmix_gates.RESOURCE]
    assert gates.settings.flip_tolerance == 0.5
    assert gates.check([1, 1], [0, 1]).passed and not gates.check([1, 1], [0, 0]).passed
    metrics: dict = {}
    rlmix_gates.rlmix_step_end(run=run, metrics=metrics)
    assert metrics["gates/checks"] == 2 and metrics["gates/rejected"] == 1


def test_settings_errors():
    with pytest.raises(rlmix.ManifestError, match="gates.flip_tolerance"):
        make_run({"gates": rlmix_gates}, ["gates.flip_tolerance=1.5"])
