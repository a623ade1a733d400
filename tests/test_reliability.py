"""Through ``rlmix run``: non-finite rewards skip the step and are named, a raising plugin is
named with its hook (traceback in the run's log, on screen with -v), one writer per run folder,
no silent appending to an old run, a changed manifest refused on resume, ``eval --checkpoint``
on a finished run folder, ``plugins --check`` without pytest, leftovers of crashes cleaned."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import rlmix_arith
import rlmix_grpo
import torch

from rlmix import checkpoint, cli, runfolder

from .conftest import EXAMPLE, TINY, read_jsonl

FAST = [*TINY, "train.eval_every=0", "log.plot=false", "train.prompts_per_step=2",
        "train.group_size=2", "arith.eval_size=2"]


def run(out: Path, *extra: str) -> int:
    return cli.main(["run", str(EXAMPLE), *FAST, f"out={out}", *extra])


def training_rows(out: Path) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]


def nan_format(monkeypatch: pytest.MonkeyPatch, rows: int = 2) -> None:
    """arith's format term is NaN on the first ``rows`` samples of every batch."""
    real = rlmix_arith.format_reward

    def poisoned(texts: list[str]) -> torch.Tensor:
        value = real(texts).clone()
        value[:rows] = float("nan")
        return value
    monkeypatch.setattr(rlmix_arith, "format_reward", poisoned)


def test_nan_reward_skips_the_step_and_names_plugin_term_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    nan_format(monkeypatch)
    # progress on (printed lines without a terminal): it formats reward/mean, NaN or not
    code = run(tmp_path, "train.steps=2", "score.weights.arith.format=1.0", "log.progress=true")
    err = capsys.readouterr().err
    assert code == 0, err
    assert "plugin 'arith' term 'format': 2 of 4" in err and "step skipped" in err
    rows = training_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["update/skipped"] == 1.0 and r["reward/nonfinite"] == 2.0 for r in rows)
    assert all(r["policy_version"] == 0 for r in rows)  # no update happened
    assert all(isinstance(r["reward/mean"], float) for r in rows)  # mean of the finite ones
    assert "term 'format'" in (tmp_path / runfolder.LOG_FILE).read_text()


def test_a_weight_of_zero_neutralises_a_nan_term(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    nan_format(monkeypatch)
    assert run(tmp_path, "train.steps=2", "score.weights.arith.format=0") == 0
    rows = training_rows(tmp_path)
    assert [r["policy_version"] for r in rows] == [1, 2]  # trained on
    assert "update/skipped" not in rows[0] or rows[0]["update/skipped"] == 0.0


@pytest.mark.parametrize("hook", ["rlmix_advantage", "rlmix_score"])
def test_a_raising_plugin_is_named_with_its_hook(hook: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise ValueError("boom inside")
    if hook == "rlmix_advantage":
        monkeypatch.setattr(rlmix_grpo, "group_normalized_advantage", boom)
        plugin = "grpo"
    else:
        monkeypatch.setattr(rlmix_arith, "correct_reward", boom)
        plugin = "arith"
    code = run(tmp_path, "train.steps=1", "arith.eval_size=0")
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("rlmix: error:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith(f"rlmix: error: plugin '{plugin}' failed in {hook}: "
                               f"ValueError: boom inside"), lines[0]
    log = (tmp_path / runfolder.LOG_FILE).read_text()
    assert "Traceback" in log and "boom inside" in log and str(tmp_path) in lines[0]
    # -v prints the traceback too
    code = cli.main(["-v", "run", str(EXAMPLE), *FAST, f"out={tmp_path / 'v'}",
                     "train.steps=1", "arith.eval_size=0"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and f"failed in {hook}" in err.splitlines()[-1]


def test_a_configure_failure_is_named_without_searching_its_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def no_copy(model: object) -> None:
        raise RuntimeError("out of memory for the reference (mentions 'arith' on purpose)")
    monkeypatch.setattr(rlmix_grpo, "frozen_copy", no_copy)
    assert run(tmp_path, "train.steps=1", "grpo.beta=0.1") == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("rlmix: error: plugin 'grpo' failed in rlmix_configure: "
                           "RuntimeError: out of memory"), line


def test_a_second_writer_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tmp_path.mkdir(exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
         "fcntl.flock(f, fcntl.LOCK_EX); f.write('4242'); f.flush(); print('held', flush=True);"
         " time.sleep(60)", str(tmp_path / runfolder.LOCK_FILE)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert run(tmp_path, "train.steps=1") == 2
        err = capsys.readouterr().err
        assert "in use by another rlmix run" in err and "4242" in err
        assert not (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert run(tmp_path, "train.steps=1") == 0  # the lock died with its process


def test_no_appending_overwrite_and_resume_with_changes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tmp_path, "train.steps=1") == 0
    capsys.readouterr()
    assert run(tmp_path, "train.steps=1") == 2  # a plain run into a folder that holds a run
    assert "already holds a run" in capsys.readouterr().err
    assert run(tmp_path, "train.steps=1", "--overwrite") == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]
    # extending a run is a resume, not a change
    assert run(tmp_path, "train.steps=2", "--resume") == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    capsys.readouterr()
    assert run(tmp_path, "train.steps=3", "train.lr=0.5", "train.seed=3", "--resume") == 2
    err = capsys.readouterr().err
    assert "differs from the one this run was started with" in err and "--allow-changes" in err
    assert "-  lr: 1.0e-05" in err and "+  lr: 0.5" in err and "+  seed: 3" in err
    assert "Traceback" not in err
    assert run(tmp_path, "train.steps=3", "train.lr=0.5", "--resume", "--allow-changes") == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert "changed manifest" in (tmp_path / runfolder.LOG_FILE).read_text()


def test_eval_checkpoint_on_a_finished_run_folder(tiny_run_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["eval", str(EXAMPLE), *TINY, "--checkpoint", str(tiny_run_dir)]) == 0
    assert '"step": 4' in capsys.readouterr().out


def test_start_cleans_interrupted_writes_and_deletes(tmp_path: Path) -> None:
    assert run(tmp_path, "train.steps=2", "train.checkpoint_every=1") == 0
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-000003-abc").mkdir()
    half = root / ".del-step-000001-xyz" / "step-000001"
    half.mkdir(parents=True)
    (half / "meta.json").write_text("{}")
    (root / "step-000009").mkdir()  # a folder without meta.json is never a checkpoint
    assert run(tmp_path, "train.steps=3", "train.checkpoint_every=1", "--resume") == 0
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000003"]
    assert checkpoint.latest(root) == root / "step-000003"


def test_plugins_check_without_pytest_says_so(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "pytest", None)  # import pytest now raises ImportError
    assert cli.main(["plugins", "--check", "grpo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlmix: error: plugins --check runs the conformance kit, which "
                          "needs pytest") and "Traceback" not in err


def test_plugins_check_without_the_conformance_kit_says_which_distribution(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The kit is the optional distribution rlmix-conformance: the core imports it for
    ``--check`` only, and without it says the pip command."""
    monkeypatch.setitem(sys.modules, "rlmix_conformance", None)
    monkeypatch.setitem(sys.modules, "rlmix_conformance.cli", None)
    assert cli.main(["plugins", "--check", "grpo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlmix: error: plugins --check runs the conformance kit, the "
                          "distribution rlmix-conformance") and "pip install rlmix-conformance" \
        in err and "Traceback" not in err
