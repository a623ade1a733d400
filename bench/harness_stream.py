"""Harness evolution on a shifting task stream: no evolution, single-harness GEPA, Adaptive
Auto-Harness (``auto_harness``) and Live-Evo (``live_evo``), accuracy over time.

    OMP_NUM_THREADS=1 python bench/harness_stream.py --out runs/bench-stream.json
    python bench/harness_stream.py --model tiny-random --steps-per-phase 1 --eval-size 3 \
        --out /tmp/stream.json                                       # a smoke run
    python bench/harness_stream.py --methods none,auto_harness --out /tmp/a.json

Every method runs the same manifest (``examples/harness/auto_harness-stream.yaml``): the
``stream`` env, phases of ``--steps-per-phase`` steps each (``--kinds``, default add -> sub ->
word; ``--digits`` per operand, default 1), ``train.mode: harness-only`` (the weights never
change), the same model as task model and reflection model, the same seed, prompts and token
limits. Each method is one ordinary run through ``rlmix.loop`` (``build_run`` + ``train``),
its plugin listed by name; a method whose plugin is not installed is skipped with a note. Reported:

* accuracy over time: the greedy held-out accuracy (``eval/accuracy``, every kind of the
  schedule, ``--eval-size`` tasks) at the start and at the end of every phase, and each step's
  accuracy on the stream's own tasks (``stream/accuracy``, sampled at ``--temperature``);
* the final held-out accuracy per kind;
* for ``auto_harness``, the evolution and adaptation losses of the last step and the tree size.

GEPA optimises one harness on its own task pool (the stream env's reserved steps, which mix
every kind of the schedule from the start: an offline view of the whole stream, an advantage
no streaming method has). Results go to ``--out`` (JSON) and a table is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "harness" / "auto_harness-stream.yaml"
METHODS = ("none", "gepa", "auto_harness", "live_evo")


def schedule_override(kinds: list[str], steps: int) -> str:
    phases = ", ".join(f"{{kind: '{k}', steps: {steps}}}" for k in kinds)
    return f"stream.schedule=[{phases}]"


def plugin_fields(name: str) -> set[str]:
    """The settings keys an installed plugin takes (empty when it has no Settings)."""
    from rlmix import plugins

    loaded = plugins.load([name])[0]
    cls = loaded.settings_cls
    return {f.name for f in dataclasses.fields(cls)} if cls is not None else set()


def method_overrides(name: str, args: argparse.Namespace) -> list[str]:
    """The plugin list and the method's own settings; shared keys only where a plugin has them."""
    if name == "none":
        return ["plugins=[hf,stream]"]
    out = [f"plugins=[hf,stream,{name}]"]
    if name == "auto_harness":
        return out + [f"auto_harness.max_nodes={args.max_nodes}",
                      f"auto_harness.max_new_tokens={args.max_new_tokens}",
                      f"auto_harness.lm.max_new_tokens={args.reflect_tokens}"]
    if name == "gepa":
        return out + ["gepa.components=[instructions]", "gepa.metric=stream.correct",
                      f"gepa.budget={args.gepa_budget}", "gepa.search_size=8",
                      "gepa.selection_size=4", "gepa.minibatch_size=2", "gepa.merge=false",
                      f"gepa.max_new_tokens={args.max_new_tokens}",
                      f"gepa.lm.max_new_tokens={args.reflect_tokens}",
                      "gepa.lm.temperature=0.7"]
    fields = plugin_fields(name)  # other plugins (live_evo): driven by name, common keys only
    common = {"metric": "stream.correct", "max_new_tokens": str(args.max_new_tokens)}
    out += [f"{name}.{k}={v}" for k, v in common.items() if k in fields]
    if "lm" in fields:
        out += [f"{name}.lm.max_new_tokens={args.reflect_tokens}"]
    return out


def build_cfg(name: str, args: argparse.Namespace, out: Path) -> Any:
    from omegaconf import OmegaConf

    from rlmix import manifest

    cfg = manifest.read(MANIFEST, [
        f"model={args.model}", f"out={out}", "log.progress=false", "log.plot=false",
        f"train.steps={args.steps_per_phase * len(args.kinds)}",
        f"train.prompts_per_step={args.per_step}", f"train.eval_every={args.steps_per_phase}",
        "train.checkpoint_every=0", f"train.seed={args.seed}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        f"sampling.temperature={args.temperature}",
        schedule_override(args.kinds, args.steps_per_phase), f"stream.eval_size={args.eval_size}",
        f"stream.digits={args.digits}",
        f"stream.eval_max_new_tokens={args.max_new_tokens}", f"policy.threads={args.threads}"])
    for key in ("auto_harness", "gepa"):  # the manifest's blocks of methods not in this run
        if key in cfg and key != name:
            del cfg[key]
    return OmegaConf.merge(cfg, manifest.read(None, method_overrides(name, args)))


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def summarise(rows: list[dict[str, Any]], steps_per_phase: int, kinds: list[str]
              ) -> dict[str, Any]:
    """Accuracy over time from one run's metrics.jsonl rows."""
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    stream_acc = [float(r.get("stream/accuracy", float("nan"))) for r in steps]
    per_phase = []
    for k in range(len(kinds)):
        part = [a for a in stream_acc[k * steps_per_phase:(k + 1) * steps_per_phase] if a == a]
        per_phase.append(sum(part) / len(part) if part else float("nan"))
    last = evals[-1] if evals else {}
    out: dict[str, Any] = {
        "eval_over_time": [[int(r["step"]), float(r["eval/accuracy"])] for r in evals],
        "stream_accuracy": stream_acc,
        "stream_accuracy_per_phase": per_phase,
        "final_eval_per_kind": {k: last.get(f"eval/accuracy/{k}") for k in kinds},
        "final_eval": last.get("eval/accuracy"),
        "harness_version": steps[-1].get("harness_version") if steps else None,
        "seconds": sum(float(r.get("time/step_s", 0.0)) for r in steps),
    }
    if steps and "auto_harness/nodes" in steps[-1]:
        out["auto_harness"] = {k.split("/", 1)[1]: v for k, v in steps[-1].items()
                               if k.startswith("auto_harness/")}
    return out


def table(results: dict[str, dict[str, Any]], kinds: list[str]) -> str:
    lines = []
    heads = ["method", "held-out acc. over time (step: acc)",
             *[f"stream acc. {k}" for k in kinds], *[f"final {k}" for k in kinds], "time (s)"]
    lines.append("| " + " | ".join(heads) + " |")
    lines.append("|" + " --- |" * len(heads))
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} |" + " |" * (len(heads) - 2))
            continue
        over = ", ".join(f"{s}: {a:.2f}" for s, a in r["eval_over_time"])
        phases = [f"{a:.2f}" for a in r["stream_accuracy_per_phase"]]
        finals = [("-" if r["final_eval_per_kind"][k] is None
                   else f"{r['final_eval_per_kind'][k]:.2f}") for k in kinds]
        lines.append(f"| {name} | {over} | " + " | ".join(phases + finals)
                     + f" | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def run_method(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from rlmix import loop, plugins

    needed = {"none": [], "gepa": ["gepa"]}.get(name, [name])
    missing = [n for n in ["hf", "stream", *needed] if n not in plugins.installed()]
    if missing:
        return {"skipped": f"plugin(s) not installed: {', '.join(missing)}"}
    out = root / name
    if (out / "manifest.yaml").exists():  # a previous bench run: start clean, never append
        shutil.rmtree(out)
    t0 = time.perf_counter()
    run = loop.build_run(build_cfg(name, args, out))
    loop.train(run)
    result = summarise(read_rows(out / "metrics.jsonl"), args.steps_per_phase, args.kinds)
    result["wall_s"] = time.perf_counter() - t0
    result["harness"] = dict(run.harness)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--kinds", default="add,sub,word", help="one phase per kind, in order")
    p.add_argument("--steps-per-phase", type=int, default=4)
    p.add_argument("--digits", type=int, default=1, help="add / sub operands (SmolLM2-135M "
                   "solves almost no two-digit task)")
    p.add_argument("--per-step", type=int, default=4, help="prompts per step")
    p.add_argument("--eval-size", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--reflect-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7, help="stream rollouts")
    p.add_argument("--max-nodes", type=int, default=4)
    p.add_argument("--gepa-budget", type=int, default=80)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a "
                   "shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/bench-stream",
                   help="run folders, one per method (a previous run there is replaced)")
    p.add_argument("--out", required=True, help="JSON results")
    args = p.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for name in methods:
        print(f"== {name}", flush=True)
        results[name] = run_method(name, args, Path(args.run_dir))
        if "skipped" in results[name]:
            print(f"   skipped: {results[name]['skipped']}", flush=True)
        else:
            r = results[name]
            print(f"   held-out over time {r['eval_over_time']}, stream per phase "
                  f"{[round(a, 3) for a in r['stream_accuracy_per_phase']]}, "
                  f"{r['wall_s']:.0f} s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1,
                                         default=str))
    print(f"\nmodel {args.model}; phases {' -> '.join(args.kinds)}, {args.steps_per_phase} "
          f"steps x {args.per_step} prompts each; held-out: {args.eval_size} tasks, greedy\n")
    print(table(results, args.kinds))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
