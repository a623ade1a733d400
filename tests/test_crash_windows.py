"""SIGKILL at each window of a step (after its metrics line, inside a checkpoint write or an
old checkpoint's deletion, after its checkpoint, at start-up): 10 kills per window, then the run
is finished, and every step is logged exactly once (tests/crash_driver.py does the killing)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import cli_env

DRIVER = Path(__file__).with_name("crash_driver.py")


@pytest.mark.slow  # 40 kills and 4 finishing runs of tiny-random: ~100 s on a shared CPU
def test_ten_kills_per_window_lose_and_duplicate_no_step(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(DRIVER), str(tmp_path)], capture_output=True,
                            text=True, timeout=900, env=cli_env())
    assert result.returncode == 0, result.stderr[-3000:]
    reports = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["window"] for r in reports] == ["after_metrics", "during_checkpoint",
                                              "after_checkpoint", "startup"]
    for r in reports:
        window = r["window"]
        log = (tmp_path / f"{window}.log").read_text()[-2000:]
        assert r["codes"] == [-signal.SIGKILL] * 10, (window, r["codes"], log)
        assert r["final"] == 0, (window, log)
        assert r["lost"] == [] and r["duplicated"] == [], (window, r["steps"])
        assert r["steps"] == list(range(14)), (window, r["steps"])
        assert r["versions_ok"], window  # each step's update happened once
        assert r["latest"] == "step-000013" and r["leftovers"] == [], r
