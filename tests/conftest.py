"""Shared helpers for the core's cross-cutting tests.

Every test uses the in-process ``tiny-random`` model: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# Two cores shared with other work: one intra-op thread is far faster than two contended ones.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo-arith.yaml"

#: Overrides that make the example manifest run in seconds on a CPU.
TINY = ["model=tiny-random", "arith.eval_size=8", "log.progress=false", "log.plot=true",
        "sampling.max_new_tokens=8", "arith.eval_max_new_tokens=8"]


#: Wall-clock seconds of session fixtures, for the tests that check speed.
TIMINGS: dict[str, float] = {}


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["PYTHONWARNINGS"] = "ignore"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def rlmix_cmd(*args: str) -> list[str]:
    """The ``rlmix`` command line, run by the interpreter that runs the tests."""
    return [sys.executable, "-m", "rlmix", *args]


def run_cli(*args: str, timeout: float = 120, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(rlmix_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env or cli_env())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def tiny_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished 4-step tiny-random run of the example manifest, made in-process through
    ``rlmix.cli.main`` and shared by the tests that only read its outputs."""
    import time

    from rlmix import cli

    out = tmp_path_factory.mktemp("tiny-run")
    start = time.perf_counter()
    code = cli.main(["run", str(EXAMPLE), *TINY, "train.steps=4", "train.eval_every=2",
                     "train.checkpoint_every=2", "train.updates_per_epoch=2", f"out={out}"])
    assert code == 0
    TIMINGS["tiny_run_s"] = time.perf_counter() - start
    return out
