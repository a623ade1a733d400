"""Shared helpers for the core's cross-cutting tests.

Every test uses the in-process ``tiny-random`` model: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
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


def _machine_facts() -> str:
    """What a failed CI log needs to tell a broken test from a starved machine."""
    import resource
    import tempfile

    free_tmp = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    free_here = shutil.disk_usage(ROOT).free / 2**30
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        meminfo = dict(line.split(":", 1) for line in lines)
        memory = f"{int(meminfo['MemAvailable'].split()[0]) / 2**20:.1f} GiB"
    except (OSError, KeyError, ValueError):
        memory = "unknown"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    from rlmix.policy import cpu_capability, native_bf16

    # the vector ISA: an AVX2-only machine runs every bf16 test several times slower
    isa = f"{cpu_capability()}, {'native' if native_bf16('cpu') else 'emulated'} bf16"
    return (f"{cpus} CPUs ({isa}), memory available {memory}, disk free {free_tmp:.1f} GiB "
            f"(temp) / "
            f"{free_here:.1f} GiB (checkout), open files <= "
            f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}")


_FACTS_AT_START: list[str] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller only
        _FACTS_AT_START.append(_machine_facts())


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _FACTS_AT_START:  # printed last, so that the tail of a failed CI log holds it
        terminalreporter.write_line(f"machine at start: {_FACTS_AT_START[0]}")
        terminalreporter.write_line(f"machine at end:   {_machine_facts()}")


@pytest.fixture
def venv_dir(tmp_path: Path) -> Iterator[Path]:
    """Where a test makes a fresh virtualenv, deleted when the test ends, passed or failed: with
    torch in it one is about 1 GB, and pytest keeps the last three runs' tmp_path folders, so
    two such venvs a run would otherwise hold 6 GB of a CI machine's disk (a full disk fails
    every later test that writes a file, and pytest's own output capture with them)."""
    venv = tmp_path / "venv"
    yield venv
    shutil.rmtree(venv, ignore_errors=True)


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
