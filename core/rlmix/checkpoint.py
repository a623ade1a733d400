"""Atomic checkpoints: model, optimizer, RNG states, step, harness and plugin state.

A checkpoint is written to a temporary folder beside its final place and renamed into place,
so a crash (even SIGKILL) mid-write leaves the previous checkpoint intact. ``latest`` is the
highest-numbered complete ``step-NNNNNN`` folder. An old checkpoint is deleted by first renaming
it to a ``.del-`` name (atomic: it is then no longer a checkpoint) and then removing it, so a
crash mid-delete never leaves a half checkpoint that looks whole; ``clean`` removes what such
crashes leave (``.tmp-`` and ``.del-`` folders, ``step-`` folders without ``meta.json``) when a
run starts.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from rlmix.hookspecs import hookimpl
from rlmix.types import Run

PREFIX = "step-"


def checkpoint_root(run: Run) -> Path:
    return run.out_dir / "checkpoints"


def list_checkpoints(root: Path) -> list[Path]:
    if not root.exists():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and p.name.startswith(PREFIX) and (p / "meta.json").exists()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run: Run, keep: int = 2) -> Path:
    """Write a checkpoint of ``run`` at its current step; keep the newest ``keep``."""
    root = checkpoint_root(run)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{run.step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        assert run.policy is not None
        run.policy.model.save_pretrained(tmp / "model")
        run.policy.tokenizer.save_pretrained(tmp / "model")
        if run.optimizer is not None:
            torch.save(run.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"python": random.getstate(), "torch": torch.get_rng_state(),
                    "run": run.rng.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                   tmp / "rng.pt")
        torch.save(run.state, tmp / "state.pt")
        meta = {"step": run.step, "policy_version": run.policy_version,
                "harness_version": run.harness_version, "harness": run.harness}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        _remove(old)
    return final


def _remove(folder: Path) -> None:
    """Delete a checkpoint folder: renamed out of the ``step-`` names first (one atomic step),
    then removed; a crash in between leaves a ``.del-`` folder that ``clean`` removes."""
    trash = Path(tempfile.mkdtemp(prefix=f".del-{folder.name}-", dir=folder.parent))
    os.replace(folder, trash / folder.name)
    _fsync_dir(folder.parent)
    shutil.rmtree(trash, ignore_errors=True)


def clean(root: Path) -> list[str]:
    """Remove what interrupted writes and deletes left in ``root``: ``.tmp-*`` and ``.del-*``
    folders, and ``step-*`` folders without ``meta.json`` (never complete). Returns their
    names. Called when a run starts, under the run folder's lock."""
    if not root.exists():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        partial = p.name.startswith((".tmp-", ".del-"))
        incomplete = p.is_dir() and p.name.startswith(PREFIX) and not (p / "meta.json").exists()
        if partial or incomplete:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def load_weights(model: Any, folder: Path) -> None:
    """Load a checkpoint's weights into ``model`` in place (tied weights allowed to be absent)."""
    from safetensors.torch import load_file

    files = sorted((folder / "model").glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder / 'model'}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k or "embed" in k}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"checkpoint {folder} does not match the model: missing "
                           f"{sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def restore(run: Run, folder: Path) -> None:
    """Put ``run`` back in the state saved in ``folder``."""
    assert run.policy is not None
    load_weights(run.policy.model, folder)
    if run.optimizer is not None and (folder / "optimizer.pt").exists():
        run.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
    rng = torch.load(folder / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    run.rng.setstate(rng["run"])
    if rng.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    run.state.clear()
    run.state.update(torch.load(folder / "state.pt", weights_only=False))
    meta = json.loads((folder / "meta.json").read_text())
    run.step = int(meta["step"])
    run.policy_version = int(meta["policy_version"])
    run.harness_version = int(meta["harness_version"])
    run.harness.clear()
    run.harness.update(meta["harness"])


class CheckpointPlugin:
    """The core's checkpointer: a plugin on ``rlmix_step_end`` like any other."""

    @hookimpl(trylast=True)
    def rlmix_step_end(self, run: Run, metrics: dict[str, Any]) -> None:
        if due(run):
            save(run, keep=int(run.config.train.keep_checkpoints))


def due(run: Run) -> bool:
    """Whether the checkpointer saves at this step: every ``train.checkpoint_every`` steps
    (0: never) and at the last one."""
    every = int(run.config.train.checkpoint_every)
    return run.step >= int(run.config.train.steps) or (every > 0 and run.step % every == 0)
