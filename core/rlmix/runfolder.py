"""The run folder: one writer at a time (a lock file), no silent appending to an old run, the
manifest of a resumed run compared with the one it was started with, and the run's log.

A run folder holds ``manifest.yaml``, ``metrics.jsonl``, ``checkpoints/`` and what plugins
write. ``rlmix run`` into a folder that already holds a run refuses unless ``--resume``
(continue it) or ``--overwrite`` (delete its outputs first); ``--resume`` refuses a changed
manifest, printing the difference, unless ``--allow-changes``.
"""

from __future__ import annotations

import difflib
import fcntl
import os
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlmix.errors import RlmixError

LOCK_FILE = ".rlmix.lock"
LOG_FILE = "rlmix.log"
MANIFEST_FILE = "manifest.yaml"
# what a run writes; --overwrite removes exactly these (never the folder itself, which may be
# a folder the user keeps other things in)
RUN_OUTPUTS = (MANIFEST_FILE, "metrics.jsonl", "metrics.tmp", "checkpoints", "harness", "plots",
               "tensorboard", "hooks.txt", LOG_FILE)
# settings a resume may change without --allow-changes: they extend the run or only change
# what is shown, never what a step computes
RESUMABLE_CHANGES = ("train.steps", "log.progress", "log.tensorboard", "log.plot",
                     "policy.threads")


class RunFolderError(RlmixError):
    """The run folder is in use, holds another run, or its manifest changed."""


class _Lock:
    def __init__(self, path: Path, handle: Any) -> None:
        self.path, self.handle, self.count = path, handle, 1


_HELD: dict[Path, _Lock] = {}


def acquire(out_dir: Path) -> Path:
    """Take the run folder's lock (``.rlmix.lock``, an exclusive ``flock``: the kernel drops it
    when the process dies, even by SIGKILL, so a crash never leaves a stale lock). Re-entrant
    within a process; ``release`` once per ``acquire``. A second process is refused."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = (out_dir / LOCK_FILE).resolve()
    held = _HELD.get(path)
    if held is not None:
        held.count += 1
        return path
    handle = open(path, "a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        owner = handle.read().strip() or "?"
        handle.close()
        raise RunFolderError(f"run folder {out_dir} is in use by another rlmix run (pid "
                             f"{owner}, lock {path}); wait for it to end, or give another "
                             f"out=") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _HELD[path] = _Lock(path, handle)
    return path


def release(path: Path) -> None:
    held = _HELD.get(path)
    if held is None:
        return
    held.count -= 1
    if held.count <= 0:
        del _HELD[path]
        try:
            fcntl.flock(held.handle.fileno(), fcntl.LOCK_UN)
        finally:
            held.handle.close()


def secondary_rank() -> bool:
    """A process of a multi-process launch (torchrun's ``RANK``) other than rank 0: rank 0
    alone locks, checks and cleans the run folder (the others write apart, e.g. ``ranks/``)."""
    try:
        return int(os.environ.get("RANK", "0")) > 0
    except ValueError:
        return False


def describe_run(out_dir: Path) -> str | None:
    """What run ``out_dir`` holds (``"7 metrics lines, checkpoints up to step 6"``), or None
    when it holds none."""
    from rlmix import checkpoint, observe

    parts = []
    rows = observe.read_metrics(out_dir / observe.METRICS_FILE)
    if rows:
        parts.append(f"{len(rows)} metrics lines up to step {rows[-1].get('step', '?')}")
    last = checkpoint.latest(out_dir / "checkpoints")
    if last is not None:
        parts.append(f"checkpoints up to {last.name}")
    if not parts and (out_dir / MANIFEST_FILE).exists():
        parts.append(f"a {MANIFEST_FILE} (a run that stopped before its first step)")
    return ", ".join(parts) if parts else None


def remove_outputs(out_dir: Path) -> None:
    """``--overwrite``: delete what an earlier run wrote in ``out_dir``."""
    for name in RUN_OUTPUTS:
        p = out_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def manifest_changes(saved: Path, config: DictConfig) -> list[str]:
    """The unified diff (saved -> now) of the resolved manifests, leaving out the settings in
    ``RESUMABLE_CHANGES``; empty when nothing else changed (or nothing was saved)."""
    if not saved.exists():
        return []
    try:
        before = OmegaConf.to_container(OmegaConf.load(saved))
    except Exception:  # noqa: BLE001 - an unreadable saved manifest cannot be compared
        return [f"(the saved {saved} cannot be read)"]
    after = OmegaConf.to_container(config)
    assert isinstance(before, dict) and isinstance(after, dict)
    for path in RESUMABLE_CHANGES:
        for tree in (before, after):
            node = tree
            *parents, leaf = path.split(".")
            for part in parents:
                node = node.get(part, {}) if isinstance(node, dict) else {}
            if isinstance(node, dict):
                node.pop(leaf, None)
    old = OmegaConf.to_yaml(OmegaConf.create(before)).splitlines()
    new = OmegaConf.to_yaml(OmegaConf.create(after)).splitlines()
    if old == new:
        return []
    return list(difflib.unified_diff(old, new, "saved manifest.yaml", "this manifest",
                                     n=1, lineterm=""))


def log(out_dir: Path | None, text: str) -> None:
    """Append a timestamped entry to the run's log (``rlmix.log``); best effort (a log that
    cannot be written must not hide the error being logged)."""
    if out_dir is None:
        return
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        with open(out_dir / LOG_FILE, "a") as fh:
            fh.write(f"[{stamp} UTC] {text.rstrip()}\n")
    except OSError:
        pass


def note(out_dir: Path | None, text: str) -> None:
    """Tell the user ``text`` and keep it in the run's log. A line that starts with ``rlmix:
    warning`` goes to stderr, anything else to stdout (so that an error stays the one line on
    stderr). The log is written only where the run folder exists: evaluating makes none."""
    import sys

    print(text, file=sys.stderr if text.startswith("rlmix: warning") else sys.stdout,
          flush=True)
    if out_dir is not None and out_dir.is_dir():
        log(out_dir, text)


def log_exception(out_dir: Path | None, exc: BaseException) -> Path | None:
    """Write ``exc``'s traceback to the run's log; returns the log's path (None if not
    written)."""
    if out_dir is None:
        return None
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    log(out_dir, "error:\n" + text)
    path = out_dir / LOG_FILE
    return path if path.exists() else None
