"""bench/envs_learn.py end to end on the tiny model (an integration test: plumbing, not a
learning claim): for each of math, code_easy, sql_easy and tools, its example manifest
(examples/envs/*_smollm2.yaml) evaluates, trains 2 steps and evaluates again; the rows and the
table are written, the step budget and the wall-time budget both stop training, and code_easy
reports HumanEval pass@1 before and after when asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlmix.testing import load_script, skip_unless_installed

from .conftest import ROOT

BENCH = ROOT / "bench" / "envs_learn.py"


def _bench():
    return load_script(BENCH)


@pytest.mark.slow
def test_every_env_evaluates_trains_and_evaluates_again(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]):
    bench = _bench()
    for manifest, _, _ in bench.ENVS.values():
        skip_unless_installed(manifest)
    rows = bench.main(["--model", "tiny-random", "--steps", "2", "--eval-size", "2",
                       "--humaneval", "1", "--humaneval-tokens", "4", "--out", str(tmp_path)])
    assert [r["env"] for r in rows] == ["math", "code_easy", "sql_easy", "tools"]
    for row in rows:
        assert row["steps"] == 2 and len(row["reward_curve"]) == 2
        assert 0.0 <= row["before"] <= 1.0 and 0.0 <= row["after"] <= 1.0
        assert row["train_wall_s"] >= 0 and row["manifest"].startswith("examples/envs/")
        assert json.loads((tmp_path / f"{row['env']}.json").read_text())["env"] == row["env"]
    settings = [r["setting"] for r in rows]
    assert settings[0].startswith("math.source=curriculum") and settings[1:] == [
        "code.data=easy", "sql.difficulty=easy",
        "tools.call_format=template, demos=1 (2-digit *, 1 call)"]
    assert rows[1]["before_all"]["eval/problems"] == 2
    assert set(rows[1]["humaneval_pass@1"]) == {"before", "after", "problems"}
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n") == 2 + 4 and "HumanEval pass@1 on 1" in table
    assert "| sql_easy | sql.difficulty=easy |" in capsys.readouterr().out


def test_the_wall_time_budget_stops_training(tmp_path: Path):
    bench = _bench()
    skip_unless_installed(bench.ENVS["math"][0])
    (row,) = bench.main(["--model", "tiny-random", "--envs", "math", "--minutes", "0",
                         "--eval-size", "2", "--out", str(tmp_path)])
    assert row["steps"] == 0 and row["reward_curve"] == []
    with pytest.raises(SystemExit):
        bench.parse(["--envs", "chess"])
