"""Metrics: ``metrics.jsonl`` (one JSON object per step), a progress bar, TensorBoard, plots.

The names are a contract (DESIGN §5): every training line has ``step``, ``reward/mean``,
``reward/<term>``, ``loss``, ``time/step_s``, ``policy_version``; evaluation lines add
``eval/<metric>``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from rlmix.errors import ConfigError
from rlmix.hookspecs import hookimpl
from rlmix.types import Run

METRICS_FILE = "metrics.jsonl"
# the optional extras, as the command that installs them (printed when one is missing)
PLOTS_PIP = "pip install matplotlib"
TENSORBOARD_PIP = "pip install tensorboard"


def _clean(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _shown(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec`` when it is a number, else as it is ("nan")."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return str(value)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a crash ends the readable log
    return rows


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep lines up to ``last_step`` (used on resume: later lines belong to lost work)."""
    rows = [r for r in read_metrics(path) if int(r.get("step", 0)) <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def plot(run_dir: Path) -> list[Path]:
    """PNG plots of reward and eval metrics over steps; returns the files written."""
    rows = read_metrics(run_dir / METRICS_FILE)
    if not rows:
        return []
    try:  # an extra (rlmix[plots]): a run without it ends with a note, not a crash
        import matplotlib
    except ImportError:
        print(f"rlmix: plots skipped (log.plot): matplotlib is not installed; run "
              f"'{PLOTS_PIP}' or set log.plot=false", file=sys.stderr, flush=True)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    written = []
    every = sorted({k for r in rows for k in r})
    groups = {name: [k for k in every if k.startswith(name + "/")] for name in ("reward", "eval")}
    for name, keys in groups.items():
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o" if name == "eval" else None,
                        markersize=3, label=k)
        ax.set_xlabel("step")
        ax.set_title(f"{name} over steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


class ObservePlugin:
    """The core's logger: a plugin on ``rlmix_step_end`` like any other."""

    def __init__(self) -> None:
        self.file: Any = None
        self.progress: Any = None
        self.task: Any = None
        self.tb: Any = None
        self.last_eval: dict[str, float] = {}

    @hookimpl(trylast=True)
    def rlmix_configure(self, run: Run) -> None:
        # metrics.jsonl is opened on the first write, not here: a resume truncates it (by
        # replacing the file) after configure, and a handle opened now would keep writing
        # to the replaced, unlinked file; nor is the run folder made here (``rlmix eval``
        # configures plugins and must not leave an empty run folder behind)
        if run.config.log.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(f"log.tensorboard needs the tensorboard package: run "
                                  f"'{TENSORBOARD_PIP}' or set log.tensorboard=false") from None
            self.tb = SummaryWriter(str(run.out_dir / "tensorboard"))
        if run.config.log.progress and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]step {task.completed}/{task.total}"),
                                     BarColumn(), TextColumn("{task.description}"),
                                     TimeRemainingColumn(), transient=False)
            self.progress.start()
            self.task = self.progress.add_task("", total=int(run.config.train.steps),
                                               completed=run.step)

    def write(self, run: Run, metrics: dict[str, Any]) -> None:
        row = {k: _clean(v) for k, v in metrics.items()}
        if self.file is None:
            run.out_dir.mkdir(parents=True, exist_ok=True)
            self.file = open(run.out_dir / METRICS_FILE, "a", buffering=1)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, row.get("step", run.step))
            self.tb.flush()
        self.last_eval.update({k: v for k, v in row.items() if k.startswith("eval/")})
        self.show(run, row)

    def show(self, run: Run, row: dict[str, Any]) -> None:
        parts = []
        # values are as written: a non-finite float is the string "nan"/"inf" by now (_clean)
        reward = row.get("reward/mean")
        if reward is not None:
            parts.append(f"reward {_shown(reward, '.3f')}")
        for k, v in self.last_eval.items():
            if isinstance(v, (int, float)):
                parts.append(f"{k} {v:.3f}")
        if "update/skipped" in row and row["update/skipped"]:
            parts.append("update skipped")
        if "time/step_s" in row:
            parts.append(f"{_shown(row['time/step_s'], '.1f')}s/step")
        text = "  ".join(parts)
        if self.progress is not None:
            self.progress.update(self.task, completed=row.get("step", run.step), description=text)
        elif run.config.log.progress:
            print(f"step {row.get('step', run.step)}/{run.config.train.steps}  {text}",
                  file=sys.stderr, flush=True)

    @hookimpl(trylast=True)
    def rlmix_step_end(self, run: Run, metrics: dict[str, Any]) -> None:
        # what plugins ``run.log``-ged in their own rlmix_step_end (called before this one)
        metrics.update(run.drain_metrics())
        self.write(run, metrics)

    def close(self, run: Run) -> list[Path]:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.file is not None:
            self.file.close()
            self.file = None
        return plot(run.out_dir) if run.config.log.plot else []
