"""bench/harness_real.py end to end on the tiny model (an integration test: plumbing, not a
learning claim): the harness part searches with frozen weights and reports the seed and the
applied harness on the same held-out problems, none of which the search saw; the joint part
trains GRPO alone and GRPO with the search interleaved at one wall-time budget, from the same
start; a zero budget trains nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlmix.testing import load_script, skip_unless_installed

from .conftest import ROOT

BENCH = ROOT / "bench" / "harness_real.py"


def _bench():
    return load_script(BENCH)


def test_both_parts_run_on_the_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    bench = _bench()
    skip_unless_installed(bench.MANIFEST)
    results = bench.main(["--model", "tiny-random", "--steps", "2", "--eval-size", "4",
                          "--minutes", "5", "--out", str(tmp_path)])
    h = results["harness"]
    assert h["eval_size"] == 4 and h["steps"] >= 1
    # the tiny model's traces all pass threshold 0: a pool, zero-shot and one demo set scored
    assert h["demos"] == 4 and h["sets"][0] == [] and all(v is not None for v in h["val"])
    assert h["metric_calls"] == 4 + 2 * len(h["sets"]) <= 20
    assert h["gain"] == pytest.approx(h["evolved_heldout"]["accuracy"]
                                      - h["seed_heldout"]["accuracy"])
    assert json.loads((tmp_path / "harness.json").read_text())["part"] == "harness"

    j = results["joint"]
    rl, joint = j["rl"], j["joint"]
    assert rl["steps"] == joint["steps"] == 2  # the step cap, not the 5 minutes, stopped both
    assert rl["before"] == joint["before"]  # the same model, seed harness and problems
    assert "demos" not in rl and joint["metric_calls"] > 0 and joint["search_done"]
    assert set(joint["after_seed_harness"]) == {"accuracy", "format"}
    table = capsys.readouterr().out
    assert "| rl | 2 |" in table and "| joint | 2 |" in table and "| seed |" in table


def test_the_search_never_sees_a_held_out_problem(tmp_path: Path):
    bench = _bench()
    skip_unless_installed(bench.MANIFEST)
    sizes = [f"--set=bootstrap_fewshot.{k}" for k in ("train_size=24", "val_size=40",
                                                          "budget=400")]
    args = bench.parse(["--model", "tiny-random", "--eval-size", "60", "--out", str(tmp_path),
                        *sizes])
    run = bench.build(args, "split", ["hf", "arith", bench.NAME], "harness-only")
    import rlmix_bootstrap_fewshot as bf
    from rlmix_harness import task_prompts, user_text

    held = {f"What is {a}{op}{b}?" for a, op, b in run.state["arith"]["eval"]}
    tasks = [t for ts in bf.split(run).values() for t in ts]
    asked = {user_text(p).split("?")[0] + "?" for p in task_prompts(run, dict(run.harness),
                                                                     tasks)}
    assert len(tasks) == 64 and len(asked) > 40 and len(held) == 60 and not asked & held


def test_a_zero_budget_trains_nothing(tmp_path: Path):
    bench = _bench()
    skip_unless_installed(bench.MANIFEST)
    results = bench.main(["--model", "tiny-random", "--part", "joint", "--minutes", "0",
                          "--eval-size", "2", "--out", str(tmp_path)])
    assert results["joint"]["rl"]["steps"] == results["joint"]["joint"]["steps"] == 0
    assert results["joint"]["budget_s"] == 0 and results["joint"]["joint"]["metric_calls"] == 0


def test_the_late_schedule_searches_on_the_trained_weights(tmp_path: Path):
    """``--schedule late``: GRPO until the reserve (here the step cap stops it first), then the
    search to its end, in one budget; one arm per process writes ``joint-<arm>.json``."""
    bench = _bench()
    skip_unless_installed(bench.MANIFEST)
    results = bench.main(["--model", "tiny-random", "--part", "joint", "--schedule", "late",
                          "--arms", "joint", "--steps", "2", "--eval-size", "4",
                          "--minutes", "5", "--reserve", "60", "--clock", "cpu",
                          "--out", str(tmp_path)])
    j = results["joint"]
    assert "rl" not in j and j["schedule"] == "late"
    joint = j["joint"]
    assert joint["steps_before_search"] == 2 == joint["steps"]  # the cap: no steps after it
    assert joint["search_done"] and joint["metric_calls"] > 0 and joint["search_s"] >= 0
    # the search ran after the RL steps, outside them: every demo set was scored at step 2
    assert joint["history"] and {h["step"] for h in joint["history"]} == {2}
    written = json.loads((tmp_path / "joint-joint.json").read_text())
    assert written["joint"]["steps_before_search"] == 2


def test_the_late_schedule_with_the_whole_budget_reserved_searches_first(tmp_path: Path):
    bench = _bench()
    skip_unless_installed(bench.MANIFEST)
    results = bench.main(["--model", "tiny-random", "--part", "joint", "--schedule", "late",
                          "--arms", "joint", "--steps", "1", "--eval-size", "2",
                          "--minutes", "1", "--reserve", "60", "--out", str(tmp_path)])
    joint = results["joint"]["joint"]
    assert joint["steps_before_search"] == 0 and joint["search_done"]
    assert joint["steps"] <= 1  # after the search, GRPO only while the minute lasts


def test_unknown_arms_are_refused(tmp_path: Path):
    bench = _bench()
    with pytest.raises(SystemExit, match="--arms"):
        bench.main(["--part", "joint", "--arms", "rl,grpo", "--out", str(tmp_path)])
