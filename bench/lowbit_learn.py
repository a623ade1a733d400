"""Does sampling with a low-precision copy change what the demo learns? fp32 vs bf16 vs int8
sampler weights, each with and without TIS, on the same seeds.

Every run is the demo (``examples/grpo-arith.yaml``: SmolLM2-135M-Instruct, two-digit additions,
its settings, 40 steps, held-out greedy accuracy on 100 problems every 10 steps) with one change
of sampler: ``fp32`` is the demo as it is (rollouts from the trainer's own model); ``bf16`` and
``int8`` add ``lowbit_rollout`` (a bf16 copy; weight-only int8 linears and an int8 LM head;
``int8dyn``: fbgemm's dynamic int8 linears, the fastest decode in bench/lowbit_decode.py);
``-tis`` adds ``rollout_correction`` (token-level TIS, cap 2). The trainer (fp32 master weights,
bf16 autocast, as in the demo) and everything else are the same; so are the prompts and the
seed. The held-out evaluation always runs on the fp32 master weights.

    python bench/lowbit_learn.py                                  # 8 configs x seeds 0 1 2
    python bench/lowbit_learn.py --configs fp32 int8-tis --seeds 0 --parallel 2
    python bench/lowbit_learn.py --target 0.54    # + time to reach an accuracy (TRL's 40-step)
    python bench/lowbit_learn.py --model tiny-random --steps 2    # plumbing only (fast)

Each run is ``rlmix run`` in its own process with one torch thread; results land in
``<out>/results/<config>-s<seed>.json`` and are reused when present (a stopped bench resumes),
``--report`` only prints. The table: accuracy after the last step (mean and standard error over
seeds, and each seed's), its difference to ``fp32`` in points, the accuracy at each evaluation,
the training time (sum of ``time/step_s``) and its ratio to ``fp32``, the mean sampling time per
step, the mean mismatch (``lowbit_rollout/logp_diff_abs_mean`` and ``kl_seq``), and with
``--target`` the training seconds until an evaluation first reached it. A run whose accuracy
ends more than 10 points under its own starting accuracy is marked COLLAPSED, not dropped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "grpo-arith.yaml"
BASE_PLUGINS = ["hf", "arith", "grpo", "fused_logprobs"]
TIS = ["rollout_correction.mode=tis", "rollout_correction.level=token",
       "rollout_correction.cap=2.0"]
CONFIGS: dict[str, tuple[list[str], list[str]]] = {  # name: (extra plugins, overrides)
    "fp32": ([], []),
    "fp32-tis": (["rollout_correction"], TIS),
    "bf16": (["lowbit_rollout"], ["lowbit_rollout.precision=bf16"]),
    "bf16-tis": (["lowbit_rollout", "rollout_correction"],
                 ["lowbit_rollout.precision=bf16", *TIS]),
    "int8": (["lowbit_rollout"], ["lowbit_rollout.precision=int8"]),
    "int8-tis": (["lowbit_rollout", "rollout_correction"],
                 ["lowbit_rollout.precision=int8", *TIS]),
    "int8dyn": (["lowbit_rollout"], ["lowbit_rollout.precision=int8",
                                     "lowbit_rollout.int8_kernel=dynamic"]),
    "int8dyn-tis": (["lowbit_rollout", "rollout_correction"],
                    ["lowbit_rollout.precision=int8", "lowbit_rollout.int8_kernel=dynamic",
                     *TIS]),
    "int8w8a8": (["lowbit_rollout"], ["lowbit_rollout.precision=int8",
                                      "lowbit_rollout.int8_kernel=w8a8"]),
    "int8w8a8-tis": (["lowbit_rollout", "rollout_correction"],
                     ["lowbit_rollout.precision=int8", "lowbit_rollout.int8_kernel=w8a8",
                      *TIS]),
}
DEFAULT_CONFIGS = ["fp32", "bf16", "bf16-tis", "int8", "int8-tis", "int8dyn", "int8dyn-tis",
                   "int8w8a8", "int8w8a8-tis", "fp32-tis"]


def overrides(args: argparse.Namespace, config: str, seed: int, out: Path) -> list[str]:
    plugins, extra = CONFIGS[config]
    over = [f"plugins=[{','.join(BASE_PLUGINS + plugins)}]", f"train.seed={seed}",
            f"model={args.model}", f"train.steps={args.steps}", "policy.threads=1",
            "log.progress=false", "log.plot=false", "train.checkpoint_every=0",
            f"out={out}", *extra]
    if args.model == "tiny-random":  # plumbing: small and quick
        over += ["train.prompts_per_step=2", "train.group_size=4", "sampling.max_new_tokens=6",
                 "arith.eval_size=4", "arith.eval_max_new_tokens=6", "train.eval_every=2"]
    return over + list(args.override)


def run_one(args: argparse.Namespace, config: str, seed: int) -> dict[str, Any]:
    result_path = Path(args.out) / "results" / f"{config}-s{seed}.json"
    if result_path.exists():
        return json.loads(result_path.read_text())
    out = Path(args.out) / "runs" / f"{config}-s{seed}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "rlmix", "run", str(DEMO), *overrides(args, config, seed, out),
           "--overwrite"]
    if args.in_process:  # plumbing tests: no interpreter start-up per run
        from rlmix import cli

        code = cli.main(cmd[3:])
        if code != 0:
            raise RuntimeError(f"{config} seed {seed} failed ({code})")
    else:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{config} seed {seed} failed ({proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    result = summarise(rows)
    result.update({"config": config, "seed": seed, "command": " ".join(cmd[1:])})
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.write_text(json.dumps(result, indent=1))
    return result


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from its metrics.jsonl lines."""
    evals, elapsed, train_s = [], 0.0, 0.0
    sample_s, diff, kl, refresh = [], [], [], []
    for r in rows:
        if "time/step_s" in r:
            elapsed += float(r["time/step_s"])
            train_s += float(r["time/step_s"])
            sample_s.append(float(r["time/sample_s"]))
            if "lowbit_rollout/logp_diff_abs_mean" in r:
                diff.append(float(r["lowbit_rollout/logp_diff_abs_mean"]))
                kl.append(float(r["lowbit_rollout/kl_seq"]))
            if "time/sampler_refresh_s" in r:
                refresh.append(float(r["time/sampler_refresh_s"]))
        if "eval/accuracy" in r:
            evals.append({"step": int(r["step"]), "accuracy": float(r["eval/accuracy"]),
                          "train_s": elapsed})

    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs) if xs else float("nan")

    return {"evals": evals, "accuracy": evals[-1]["accuracy"] if evals else float("nan"),
            "start_accuracy": evals[0]["accuracy"] if evals else float("nan"),
            "train_s": train_s, "sample_s_mean": mean(sample_s), "logp_diff_abs_mean": mean(diff),
            "kl_seq_mean": mean(kl), "refresh_s_mean": mean(refresh)}


def at(result: dict[str, Any], step: int) -> float | None:
    """A run's held-out accuracy at ``step`` (``None``: not evaluated there)."""
    return next((e["accuracy"] for e in result["evals"] if e["step"] == step), None)


def report(results: list[dict[str, Any]], configs: list[str], target: float | None) -> str:
    by: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in results:
        by.setdefault(r["config"], []).append(r)
    base = by.get("fp32") or []
    base_acc = statistics.fmean(r["accuracy"] for r in base) if base else float("nan")
    base_time = statistics.fmean(r["train_s"] for r in base) if base else float("nan")
    lines = ["| sampler | seeds | held-out accuracy (mean +/- se) | per seed | vs fp32 (points) "
             "| accuracy at each eval (seed mean) | train s | x fp32 | sample s / step | "
             "mean abs logp diff | kl_seq | time to target s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in configs:
        rs = sorted(by.get(c, []), key=lambda r: r["seed"])
        if not rs:
            continue
        acc = [r["accuracy"] for r in rs]
        m = statistics.fmean(acc)
        se = statistics.stdev(acc) / math.sqrt(len(acc)) if len(acc) > 1 else 0.0
        seeds = ", ".join(f"{a:.2f}" + (" COLLAPSED" if a < r["start_accuracy"] - 0.10 else "")
                          for a, r in zip(acc, rs))
        steps = sorted({e["step"] for r in rs for e in r["evals"]})
        curve = " / ".join(f"{statistics.fmean(at(r, s) for r in rs if at(r, s) is not None):.2f}"
                           for s in steps)
        t = statistics.fmean(r["train_s"] for r in rs)
        reach = "n/a"
        if target is not None:
            times = [next((e["train_s"] for e in r["evals"] if e["accuracy"] >= target), None)
                     for r in rs]
            reach = ", ".join("not reached" if x is None else f"{x:.0f}" for x in times)
        lines.append(
            f"| {c} | {len(rs)} | {m:.3f} +/- {se:.3f} | {seeds} | {100 * (m - base_acc):+.1f} | "
            f"{curve} | {t:.0f} | {t / base_time:.2f} | "
            f"{statistics.fmean(r['sample_s_mean'] for r in rs):.2f} | "
            f"{statistics.fmean(r['logp_diff_abs_mean'] for r in rs):.4f} | "
            f"{statistics.fmean(r['kl_seq_mean'] for r in rs):.4f} | {reach} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--parallel", type=int, default=1, help="runs at once (one thread each)")
    ap.add_argument("--target", type=float, help="an accuracy to time (TRL's after 40 steps)")
    ap.add_argument("--override", action="append", default=[], help="extra manifest key=value")
    ap.add_argument("--out", default="/tmp/rlmix-lowbit-learn")
    ap.add_argument("--report", action="store_true", help="print the stored results only")
    ap.add_argument("--in-process", action="store_true",
                    help="run each config in this process, one after another (plumbing tests)")
    args = ap.parse_args(argv)
    jobs = [(c, s) for s in args.seeds for c in args.configs]
    if args.report:
        results = [json.loads(p.read_text())
                   for p in sorted((Path(args.out) / "results").glob("*.json"))]
    else:
        with ThreadPoolExecutor(1 if args.in_process else max(1, args.parallel)) as pool:
            results = list(pool.map(lambda job: run_one(args, *job), jobs))
    print(f"model {args.model}, {args.steps} steps, demo settings (examples/grpo-arith.yaml), "
          f"seeds {' '.join(map(str, args.seeds))}")
    print(report(results, args.configs, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
