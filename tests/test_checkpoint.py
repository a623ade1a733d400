"""Checkpoints: a full round trip, atomic writes, and a run killed with SIGKILL that resumes
with every step logged exactly once."""

from __future__ import annotations

import copy
import json
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlmix import checkpoint, loop, manifest, observe
from rlmix.types import Run

from .conftest import EXAMPLE, TINY, cli_env, read_jsonl, rlmix_cmd


def build(out: Path, *extra: str) -> Run:
    """A configured run on ``out`` as a new process would build one, without the run-folder
    checks of ``build_run`` (these tests build several runs on one folder on purpose)."""
    cfg = manifest.read(EXAMPLE, [*TINY, f"out={out}", "train.lr=0.01", *extra])
    run, _ = loop.prepare(cfg)
    loop.load_policy(run)
    loop.configure(run)
    return run


def perturb(run: Run) -> None:
    """One optimizer step on a made-up loss: new weights and a non-trivial optimizer state."""
    assert run.policy is not None and run.optimizer is not None
    loss = sum((p.float() ** 2).sum() for p in run.policy.model.parameters())
    loss.backward()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def weights(run: Run) -> dict[str, torch.Tensor]:
    assert run.policy is not None
    return {k: v.detach().clone() for k, v in run.policy.model.state_dict().items()}


def optimizer_tensors(run: Run) -> list[torch.Tensor]:
    assert run.optimizer is not None
    state = run.optimizer.state_dict()["state"]
    return [torch.as_tensor(v).clone() for k in sorted(state) for _, v in sorted(
        state[k].items())]


def draws(run: Run) -> tuple[float, list[float], float]:
    return random.random(), torch.rand(4).tolist(), run.rng.random()


def test_save_restore_round_trip(tmp_path: Path) -> None:
    run = build(tmp_path)
    perturb(run)
    run.step, run.policy_version = 3, 5
    run.harness.update({"system": "Be brief.", "instructions": "Only the number."})
    run.harness_version = 2
    run.state["mine"] = {"counter": 7, "table": torch.arange(3)}
    saved_weights, saved_opt = weights(run), optimizer_tensors(run)
    saved_state = copy.deepcopy(run.state)
    folder = checkpoint.save(run)
    assert folder.name == "step-000003"
    expected_draws = draws(run)  # what the RNGs give right after the save

    fresh = build(tmp_path)  # a new process would start like this
    assert any(not torch.equal(saved_weights[k], v) for k, v in weights(fresh).items())
    assert fresh.step == 0 and fresh.policy_version == 0
    assert checkpoint.latest(checkpoint.checkpoint_root(fresh)) == folder
    checkpoint.restore(fresh, folder)

    restored = weights(fresh)
    assert restored.keys() == saved_weights.keys()
    for k, v in saved_weights.items():
        assert torch.equal(restored[k], v), k
    restored_opt = optimizer_tensors(fresh)
    assert len(restored_opt) == len(saved_opt) > 0
    for a, b in zip(restored_opt, saved_opt, strict=True):
        assert torch.equal(a, b)
    assert (fresh.step, fresh.policy_version, fresh.harness_version) == (3, 5, 2)
    assert fresh.harness == {"system": "Be brief.", "instructions": "Only the number."}
    assert fresh.state["mine"]["counter"] == 7
    assert torch.equal(fresh.state["mine"]["table"], saved_state["mine"]["table"])
    assert fresh.state.keys() == saved_state.keys()
    assert draws(fresh) == expected_draws
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["step"] == 3 and meta["policy_version"] == 5


def test_restored_weights_continue_training_identically(tmp_path: Path) -> None:
    """After a restore, the next optimizer step gives the same weights as without the break."""
    run = build(tmp_path / "a")
    perturb(run)
    folder = checkpoint.save(run)
    perturb(run)
    continued = weights(run)

    fresh = build(tmp_path / "b")
    checkpoint.restore(fresh, folder)
    perturb(fresh)
    for k, v in continued.items():
        assert torch.allclose(weights(fresh)[k], v, atol=0, rtol=0), k


def test_latest_ignores_partial_checkpoints(tmp_path: Path) -> None:
    run = build(tmp_path)
    root = checkpoint.checkpoint_root(run)
    for step in (2, 4, 6):
        run.step = step
        checkpoint.save(run, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step-000004",
                                                                    "step-000006"]
    assert not list(root.glob(".tmp-*"))  # a finished save leaves no temporary folder
    # a crash mid-save leaves a temporary folder (complete or not) and a final name may exist
    # without its meta.json: neither is a checkpoint
    leftover = root / ".tmp-step-000008-abc123"
    shutil.copytree(root / "step-000006", leftover)
    (root / "step-000010").mkdir()
    (root / "step-000010" / "optimizer.pt").write_bytes(b"half")
    assert checkpoint.latest(root) == root / "step-000006"

    fresh = build(tmp_path)
    latest = checkpoint.latest(root)
    assert latest is not None
    checkpoint.restore(fresh, latest)
    assert fresh.step == 6


def test_a_failing_save_keeps_the_previous_checkpoint(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    run = build(tmp_path)
    run.step = 2
    checkpoint.save(run)
    run.step = 4
    real_save = torch.save

    def dies_on_state(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if str(f).endswith("state.pt"):
            raise OSError("disk full")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_on_state)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(run)
    root = checkpoint.checkpoint_root(run)
    assert checkpoint.latest(root) == root / "step-000002"
    assert not (root / "step-000004").exists()
    assert not list(root.glob(".tmp-*"))


STEPS = 12


def _training_steps(path: Path) -> list[int]:
    return [r["step"] for r in observe.read_metrics(path) if "loss" in r]


@pytest.mark.slow
def test_sigkill_then_resume_logs_every_step_once(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["run", str(EXAMPLE), "model=tiny-random", "arith.eval_size=8",
            f"train.steps={STEPS}", "train.checkpoint_every=2", f"out={out}",
            "log.progress=false"]
    metrics = out / observe.METRICS_FILE
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(rlmix_cmd(*args), stdout=log, stderr=subprocess.STDOUT,
                            env=cli_env())
    deadline = time.monotonic() + 240
    try:
        while len(_training_steps(metrics)) < 5:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()
            assert time.monotonic() < deadline, "the run did not reach step 5 in time"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()
    assert proc.returncode == -signal.SIGKILL
    before = observe.read_metrics(metrics)
    logged = _training_steps(metrics)
    assert 5 <= len(logged) < STEPS, "killed too late to test a resume"
    last = checkpoint.latest(out / "checkpoints")
    assert last is not None
    resume_step = int(last.name.removeprefix("step-"))
    assert resume_step >= 4 and resume_step % 2 == 0
    assert resume_step <= max(logged)  # the checkpointer runs after the logger

    result = subprocess.run(rlmix_cmd(*args, "--resume"), capture_output=True, text=True,
                            env=cli_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"(resumed at step {resume_step})" in result.stdout

    rows = read_jsonl(metrics)  # every line must parse: no torn line survives the resume
    steps = [r["step"] for r in rows]
    assert steps == list(range(STEPS + 1)), steps  # 0 (start eval) .. 12, each exactly once
    # lines up to the checkpoint are the first process's, untouched; later ones are new
    kept = [r for r in before if r["step"] <= resume_step]
    assert rows[:resume_step + 1] == kept
    assert [r["policy_version"] for r in rows[1:]] == list(range(1, STEPS + 1))
    assert "eval/accuracy" in rows[-1] and "eval/accuracy" in rows[10]
    final = out / "checkpoints" / f"step-{STEPS:06d}"
    assert checkpoint.latest(out / "checkpoints") == final
    meta = json.loads((final / "meta.json").read_text())
    assert meta["step"] == STEPS and meta["policy_version"] == STEPS
