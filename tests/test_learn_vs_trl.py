"""bench/learn_vs_trl.py end to end on the tiny model (an integration test: plumbing, not a
learning claim): both frameworks train, the one evaluation scores both, the report has a row
per config, and rlmix with TRL's defaults follows TRL's learning-rate schedule step for step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlmix.testing import load_script

from .conftest import ROOT

BENCH = ROOT / "bench" / "learn_vs_trl.py"


def _bench():
    return load_script(BENCH)


@pytest.mark.slow
@pytest.mark.parity
def test_bench_trains_both_and_scores_them_alike(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    bench = _bench()
    argv = ["--model", "tiny-random", "--steps", "3", "--prompts", "2", "--group", "4",
            "--max-new-tokens", "6", "--eval-size", "4", "--eval-max-new-tokens", "4",
            "--seeds", "0", "--configs", "rlmix", "rlmix-trl", "trl", "--parallel", "3",
            "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    for config in ("rlmix", "rlmix-trl", "trl"):
        assert f"| {config} | 1 |" in table
    results = {c: json.loads((tmp_path / "results" / f"{c}-s0.json").read_text())
               for c in ("rlmix", "rlmix-trl", "trl")}
    for r in results.values():
        assert len(r["rewards"]) == 3 and 0.0 <= r["accuracy"] <= 1.0
        assert r["train_wall_s"] > 0 and r["threads"] == 1
    assert results["trl"]["trl_defaults"]["loss_type"] == "dapo"
    assert results["rlmix-trl"]["lrs"] == pytest.approx(results["trl"]["lrs"])
    assert results["rlmix"]["lrs"] == pytest.approx([1e-5] * 3)
