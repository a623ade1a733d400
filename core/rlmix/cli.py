"""``rlmix run | plugins | config | eval``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from rlmix.errors import RlmixError


def _cmd_run(args: argparse.Namespace) -> int:
    from rlmix import loop, manifest

    cfg = manifest.read(args.manifest, args.overrides)
    run = loop.build_run(cfg, resume=args.resume)
    print(f"rlmix: run folder {run.out_dir}" + (f" (resumed at step {run.step})"
                                                 if args.resume else ""))
    print("rlmix: hook owners")
    print("\n".join(f"  {line}" for line in loop.log_owner_table(run).splitlines()))
    started = time.perf_counter()
    loop.train(run)
    print(f"rlmix: done in {time.perf_counter() - started:.0f} s; {run.step} steps; "
          f"outputs in {run.out_dir}")
    for line in eval_summary(run.out_dir / "metrics.jsonl"):
        print(line)
    return 0


def eval_summary(metrics_file: Path) -> list[str]:
    """``eval/<metric>: first -> last`` for every evaluation metric the run logged."""
    from rlmix.observe import read_metrics

    rows = [r for r in read_metrics(metrics_file) if any(k.startswith("eval/") for k in r)]
    if not rows:
        return []
    first, last = rows[0], rows[-1]
    lines = []
    for key in sorted(k for k in last if k.startswith("eval/")):
        before = first.get(key)
        text = f"{before:.3f}" if isinstance(before, (int, float)) else "-"
        lines.append(f"  {key}: {text} (step {first['step']}) -> {last[key]:.3f} "
                     f"(step {last['step']})")
    return lines


def _cmd_config(args: argparse.Namespace) -> int:
    from rlmix import loop, manifest, plugins

    cfg = manifest.read(args.manifest, args.overrides)
    run, _ = loop.prepare(cfg)
    print(OmegaConf.to_yaml(run.config), end="")
    print("# hook owners (the last listed implementer owns a firstresult hook)")
    for line in plugins.format_owner_table(run.pm):
        print(f"# {line}")
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    import importlib.metadata as md

    from rlmix import plugins

    found = plugins.installed()
    if not found:
        print("no rlmix plugins installed (pip install rlmix-hf rlmix-arith rlmix-grpo)")
        return 0
    rows = []
    failures = 0
    for info in sorted(found.values(), key=lambda i: (i.family, i.name)):
        try:
            obj = md.EntryPoint(name=info.name, value=info.value, group=info.family).load()
            hooks = ", ".join(h.removeprefix("rlmix_") for h in plugins.hooks_of(obj))
            desc = plugins.describe(obj)
        except Exception as exc:  # noqa: BLE001 - report, do not crash the listing
            hooks, desc = "-", f"IMPORT FAILED: {type(exc).__name__}: {exc}"
            failures += 1
        rows.append((info.family.removeprefix("rlmix."), info.name,
                     f"{info.distribution} {info.version}", hooks, desc))
    if args.json:
        print(json.dumps([dict(zip(("family", "name", "distribution", "hooks", "description"),
                                   r)) for r in rows], indent=1))
        return 1 if failures else 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="installed rlmix plugins")
    for col in ("family", "name", "distribution", "hooks", "description"):
        table.add_column(col)
    for r in rows:
        table.add_row(*r)
    Console(width=160).print(table)
    return 1 if failures else 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from rlmix import checkpoint, loop, manifest

    cfg = manifest.read(args.manifest, args.overrides)
    run, _ = loop.prepare(cfg)
    loop.load_policy(run)
    loop.configure(run)
    folder = Path(args.checkpoint)
    if (folder / "checkpoints").exists():  # a run folder: take its latest checkpoint
        folder = checkpoint.latest(folder / "checkpoints") or folder
    if not (folder / "meta.json").exists():
        raise RlmixError(f"--checkpoint {args.checkpoint}: not a checkpoint folder (no meta.json)")
    checkpoint.restore(run, folder)
    metrics = loop.evaluate(run)
    print(json.dumps({"checkpoint": str(folder), "step": run.step, **metrics}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlmix", description="RL post-training from plugins.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="train from a manifest")
    p.add_argument("manifest")
    p.add_argument("overrides", nargs="*", help="key=value dotlist overrides")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("config", help="print the resolved manifest and hook owners")
    p.add_argument("manifest")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser("plugins", help="list installed plugins and their hooks")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plugins)
    p = sub.add_parser("eval", help="evaluate a checkpoint")
    p.add_argument("manifest")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder or a run folder")
    p.set_defaults(func=_cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RlmixError as exc:
        print(f"rlmix: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rlmix: interrupted; the last checkpoint is intact (resume with --resume)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
