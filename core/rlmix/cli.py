"""``rlmix run | plugins | config | eval | new-plugin``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from rlmix.errors import RlmixError, one_line

# the run folder of the command being run, once known: where an error's traceback is logged
_RUN_DIR: list[Path] = []


def _cmd_run(args: argparse.Namespace) -> int:
    from rlmix import loop, manifest

    cfg = manifest.read(args.manifest, args.overrides)
    _RUN_DIR.append(Path(str(cfg.get("out") or "") or Path("runs") / str(cfg.get("name"))))
    run = loop.build_run(cfg, resume=args.resume, overwrite=args.overwrite,
                         allow_changes=args.allow_changes)
    _RUN_DIR.append(run.out_dir)
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
        after = f"{last[key]:.3f}" if isinstance(last[key], (int, float)) else str(last[key])
        lines.append(f"  {key}: {text} (step {first['step']}) -> {after} "
                     f"(step {last['step']})")
    return lines


def _cmd_config(args: argparse.Namespace) -> int:
    from rlmix import loop, manifest, plugins

    if args.schema or args.hooks:
        from rlmix.templates import reference

        if args.manifest is not None:
            raise RlmixError("config --schema / --hooks take no manifest (they document every "
                             "installed plugin and every hook)")
        print(reference.schema_markdown() if args.schema else reference.hooks_markdown(),
              end="")
        return 0
    if args.manifest is None:
        raise RlmixError("config: give a manifest to resolve, or --schema (the manifest "
                         "reference) or --hooks (the hooks reference)")
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
    if args.check is not None:
        return _check_plugins(found, args.check, args.level, args.json)
    if not found:
        print("no rlmix plugins installed (pip install rlmix-hf rlmix-arith rlmix-grpo)")
        return 0
    rows = []
    failures = 0
    for info in sorted(found.values(), key=lambda i: (i.family, i.name)):
        if info.problem:  # not imported: made for another core
            hooks, desc = "-", f"INCOMPATIBLE: {info.problem}"
            failures += 1
        else:
            try:
                obj = md.EntryPoint(name=info.name, value=info.value, group=info.family).load()
                hooks = ", ".join(h.removeprefix("rlmix_") for h in plugins.hooks_of(obj))
                desc = plugins.describe(obj)
            except Exception as exc:  # noqa: BLE001 - report, do not crash the listing
                hooks, desc = "-", f"IMPORT FAILED: {type(exc).__name__}: {exc}"
                failures += 1
        rows.append((info.family.removeprefix("rlmix."), info.name,
                     f"{info.distribution} {info.version}", hooks, desc))
    columns = ("family", "name", "distribution", "hooks", "description")
    if args.json:
        print(json.dumps([dict(zip(columns, r)) for r in rows], indent=1))
        return 1 if failures else 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="installed rlmix plugins")
    for col in columns:
        table.add_column(col)
    for r in rows:
        table.add_row(*r)
    Console(width=160).print(table)
    return 1 if failures else 0


def _check_plugins(found: dict, names: list[str], level: str, as_json: bool) -> int:
    """``--check``: the conformance kit's report over the named (default: every installed)
    plugins. The kit is an optional distribution; the core imports it for this option only."""
    try:
        kit = importlib.import_module("rlmix_conformance.cli")
    except ImportError:
        raise RlmixError("plugins --check runs the conformance kit, the distribution "
                         "rlmix-conformance (libs/conformance in the repository): "
                         "pip install rlmix-conformance") from None
    return kit.check_plugins(found, names, level, as_json)


def _cmd_new_plugin(args: argparse.Namespace) -> int:
    from rlmix import templates

    if not args.family:
        raise RlmixError(f"new-plugin: --family is required; choose one of "
                         f"{', '.join(templates.FAMILY_HOOKS)}")
    folder = templates.new_plugin(args.name, args.family, args.hooks, args.dir)
    family = templates.check_family(args.family)
    print(f"rlmix: wrote the plugin package {folder}")
    print(f"  entry point '{args.name}' in rlmix.{family}, module rlmix_{args.name}")
    print("next:")
    print(f"  pip install -e {folder}")
    print(f"  pytest -q {folder / 'tests'}              # its tests, with the conformance kit")
    print(f"  pytest -q --rlmix-conformance {args.name}  # the full kit")
    print(f"  rlmix run MANIFEST                 # with '{args.name}' in its plugins list")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from rlmix import checkpoint, loop, manifest

    cfg = manifest.read(args.manifest, args.overrides)
    run, _ = loop.prepare(cfg)
    loop.load_policy(run)
    loop.configure(run)
    source = "base model"  # without --checkpoint: the manifest's model as loaded
    if args.checkpoint is not None:
        folder = Path(args.checkpoint)
        if (folder / "checkpoints").exists():  # a run folder: take its latest checkpoint
            folder = checkpoint.latest(folder / "checkpoints") or folder
        if not (folder / "meta.json").exists():
            raise RlmixError(f"--checkpoint {args.checkpoint}: not a checkpoint folder "
                             "(no meta.json)")
        checkpoint.restore(run, folder)
        source = str(folder)
    loop.prepare_model(run)  # as build_run: the trainer wraps the restored, full model
    metrics = loop.evaluate(run)
    print(json.dumps({"checkpoint": source, "step": run.step, **metrics}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlmix", description="RL post-training from plugins.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print an error's traceback (it is always in the run's rlmix.log)")
    # -v after the command too; SUPPRESS keeps a -v given before it
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="print an error's traceback")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", parents=[common], help="train from a manifest")
    p.add_argument("manifest")
    p.add_argument("overrides", nargs="*", help="key=value dotlist overrides")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the outputs of a run already in the run folder first")
    p.add_argument("--allow-changes", action="store_true",
                   help="with --resume: continue even though the manifest changed")
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("config", parents=[common],
                       help="print the resolved manifest and hook owners; or the manifest "
                            "reference (--schema) or hooks reference (--hooks)")
    p.add_argument("manifest", nargs="?")
    p.add_argument("overrides", nargs="*")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--schema", action="store_true",
                      help="print the manifest reference (Markdown): every core and installed "
                           "plugin setting, its type, default and description")
    what.add_argument("--hooks", action="store_true",
                      help="print the hooks reference (Markdown) from the hook specifications")
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser("plugins", parents=[common],
                       help="list installed plugins and their hooks, or check them with the "
                            "conformance kit (--check)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--check", nargs="*", metavar="NAME", default=None,
                   help="run the conformance kit over these plugins (default: all installed); "
                        "exit 1 on any failure")
    p.add_argument("--level", choices=("quick", "full"), default="quick",
                   help="with --check: quick (default) or full")
    p.set_defaults(func=_cmd_plugins)
    p = sub.add_parser("new-plugin", parents=[common],
                       help="write a new plugin package (pyproject, module, settings, tests, "
                            "tox.ini, README)")
    p.add_argument("name", help="entry-point name (lowercase, digits, underscores)")
    p.add_argument("--family", help="algorithms | rollout | envs | harness | kernels | trainers")
    p.add_argument("--hooks", help="comma-separated hooks (short names: prompts, sample, "
                                   "generate, score, advantage, clip, update, evolve, "
                                   "token_logprobs, evaluate, step_end, configure); default: "
                                   "the family's usual ones")
    p.add_argument("--dir", default=".", help="where to write the package folder <dir>/<name> "
                                              "(default: the current folder)")
    p.set_defaults(func=_cmd_new_plugin)
    p = sub.add_parser("eval", parents=[common],
                       help="evaluate the manifest's model, or a checkpoint")
    p.add_argument("manifest")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--checkpoint", default=None,
                   help="a checkpoint folder or a run folder (default: the base model)")
    p.set_defaults(func=_cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The CLI. Every failure ends in one ``rlmix: error: ...`` line (exit 2); an exception
    that escaped a plugin's hook reads ``plugin 'X' failed in rlmix_Y: <exception>``. The
    traceback goes to the run folder's ``rlmix.log`` (when the folder is known) and, with
    ``-v``, to the screen."""
    import traceback

    from rlmix import runfolder

    args = build_parser().parse_args(argv)
    _RUN_DIR.clear()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("rlmix: interrupted; the last checkpoint is intact (resume with --resume)",
              file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the one place every error becomes one line
        # a user's mistake (a bad manifest) needs no traceback; anything else gets one
        user_error = isinstance(exc, RlmixError) and exc.__cause__ is None
        folder = _RUN_DIR[-1] if _RUN_DIR and _RUN_DIR[-1].is_dir() else None
        logged = None if user_error else runfolder.log_exception(folder, exc)
        if getattr(args, "verbose", False) and not user_error:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        where = "" if user_error else (f" (traceback in {logged})" if logged else
                                       " (run with -v for the traceback)")
        print(f"rlmix: error: {one_line(exc)}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
