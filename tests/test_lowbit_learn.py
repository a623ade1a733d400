"""bench/lowbit_learn.py in its plumbing mode (tiny model, 2 steps): every sampler config runs
the demo manifest through ``rlmix run``, the results carry the evaluations and the mismatch, and
the report has a row per config (an integration test of the script, not a learning claim)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rlmix.testing import skip_unless_installed

from .conftest import ROOT

BENCH = ROOT / "bench" / "lowbit_learn.py"


def _bench():
    spec = importlib.util.spec_from_file_location("lowbit_learn", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plumbing_mode_runs_each_sampler_and_reports(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    skip_unless_installed(ROOT / "examples" / "lowbit-arith.yaml")  # the same plugins
    bench = _bench()
    argv = ["--model", "tiny-random", "--steps", "2", "--seeds", "0", "--configs", "fp32",
            "int8-tis", "--in-process", "--target", "0.0", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    for config in ("fp32", "int8-tis"):
        assert f"| {config} | 1 |" in table
    fp32 = json.loads((tmp_path / "results" / "fp32-s0.json").read_text())
    int8 = json.loads((tmp_path / "results" / "int8-tis-s0.json").read_text())
    assert [e["step"] for e in fp32["evals"]] == [0, 2]
    assert fp32["train_s"] > 0 and 0.0 <= fp32["accuracy"] <= 1.0
    assert int8["logp_diff_abs_mean"] > 0 and int8["refresh_s_mean"] > 0
    assert fp32["logp_diff_abs_mean"] != fp32["logp_diff_abs_mean"]  # nan: no lowbit plugin
    assert "lowbit_rollout.precision=int8" in int8["command"]
    # a stored result is reused, not run again
    assert bench.main([*argv, "--report"]) == 0
