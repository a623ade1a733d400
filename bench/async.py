"""Throughput of the training loop with heavy-tailed response lengths: synchronous sampling
against asynchronous sampling (``train.max_staleness``), partial rollouts (``partial``), and
both, in one run on the same model, prompts and settings.

    python bench/async.py                            # tiny random Llama, 10 steps per mode
    python bench/async.py --steps 20 --hidden 256 --layers 4 --modes sync async+partial

Response lengths are heavy-tailed by construction: a forward hook on the model
(``rlmix_partial.lengths.heavy_tail_eos``) gives the stop token probability
``alpha / (t + scale)`` at completion position ``t``, so lengths have a Pareto tail (index
``alpha``) capped at ``--max-new``. Each mode builds a fresh run (same seed, same initial
weights), trains ``--steps`` steps of GRPO on ``arith`` prompts with evaluation off, and is
timed from the first step to the last (model build excluded); "CPU s" is the process's CPU
time over the same span, all threads (async overlaps sampling and training: wall below CPU
means it used a second core). "samples/s" counts trained
samples; "tokens/s" counts trained completion tokens (partial rollouts return the groups that
finish first, so over a short run their samples are shorter on average: tokens/s is the fairer
figure). "sync+partial x1.0" is partial's engine without over-provisioning (finished rows
leave the decoding batch, nothing is carried over), which separates that effect from partial
rollouts proper. The machine this runs on may be shared: run it when idle, compare ratios, and
keep ``--threads 1`` there (two intra-op threads per process under contention were several
times slower).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = {  # name: (async, partial, over_provision: None = --over)
    "sync": (False, False, None),
    "async": (True, False, None),
    "sync+partial x1.0": (False, True, 1.0),  # partial's engine alone, no over-provisioning
    "sync+partial": (False, True, None),
    "async+partial": (True, True, None),
}


def run_mode(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from rlmix_partial.lengths import heavy_tail_eos

    from rlmix import loop, manifest
    from rlmix.policy import Policy, tiny_random

    asynchronous, partial, over = MODES[name]
    staleness = args.staleness if asynchronous else 0
    out = Path(tempfile.mkdtemp(prefix=f"bench-async-{name}-"))
    plugins = ["hf", "arith", "grpo"] + (["partial"] if partial else [])
    overrides = [
        f"model={args.model}", f"plugins=[{','.join(plugins)}]", f"out={out}",
        f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}",
        f"train.group_size={args.group}", f"train.max_staleness={staleness}",
        "train.eval_every=0", "train.checkpoint_every=0", "train.lr=1e-4", "train.seed=0",
        f"sampling.max_new_tokens={args.max_new}", "sampling.temperature=1.0",
        "arith.eval_size=0", "log.progress=false", "log.plot=false",
        f"policy.threads={args.threads}",
    ]
    if partial:
        overrides.append(f"partial.over_provision={args.over if over is None else over}")
    cfg = manifest.read(None, overrides)
    run, _ = loop.prepare(cfg)
    loop.load_policy(run)
    assert run.policy is not None
    if args.model == "tiny-random":  # a wider tiny model, so tensor work (not Python) dominates
        model, tok = tiny_random(seed=0, hidden=args.hidden, layers=args.layers,
                                 heads=max(1, args.hidden // 32))
        run.policy = Policy(model, tok, device="cpu")
    tok = run.policy.tokenizer
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    start = min(len(tok(run.policy.chat_text(p.messages), add_special_tokens=False)["input_ids"])
                for p in prompts)
    heavy_tail_eos(run.policy.model, tok.eos_token_id, start=start, alpha=args.alpha,
                   scale=args.scale, temperature=1.0)
    loop.configure(run)
    torch.manual_seed(0)
    t0, c0 = time.perf_counter(), time.process_time()
    loop.train(run)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    samples = args.steps * args.prompts * args.group
    tokens = sum(r["response_length/mean"] * args.prompts * args.group for r in rows)
    return {"mode": name, "wall_s": wall, "cpu_s": cpu, "samples_per_s": samples / wall,
            "tokens_per_s": tokens / wall,
            "mean_len": tokens / samples,
            "sample_s": sum(r["time/sample_s"] for r in rows),
            "staleness_max": max(r.get("staleness/max", 0.0) for r in rows),
            "staleness_mean": sum(r.get("staleness/mean", 0.0) for r in rows) / len(rows)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=4, help="groups per step")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--alpha", type=float, default=1.0, help="Pareto tail index of lengths")
    p.add_argument("--scale", type=float, default=3.0)
    p.add_argument("--over", type=float, default=1.5, help="partial.over_provision")
    p.add_argument("--staleness", type=int, default=1, help="max_staleness of async modes")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print(f"heavy-tailed lengths (alpha={args.alpha}, scale={args.scale}, cap {args.max_new});"
          f" {args.steps} steps x {args.prompts} groups x {args.group}; model {args.model}"
          + (f" (hidden {args.hidden}, {args.layers} layers)" if args.model == "tiny-random"
             else "") + f"; torch threads {args.threads}; async max_staleness "
          f"{args.staleness}; partial over_provision {args.over}\n", flush=True)
    print("| mode | wall s | CPU s | samples/s | x sync | tokens/s | x sync | mean len | "
          "staleness mean / max |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    results: list[dict[str, Any]] = []
    for mode in args.modes:  # each row as soon as its mode is done
        r = run_mode(mode, args)
        results.append(r)
        base = next((x for x in results if x["mode"] == "sync"), results[0])
        print(f"| {r['mode']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['samples_per_s']:.2f} | "
              f"{r['samples_per_s'] / base['samples_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} | {r['mean_len']:.1f} | "
              f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
