"""The issue-26 reward bench: GRPO on SmolLM2-135M arithmetic against GRPO + fapo (rule
detectors), solid (label-free: arith.correct weighted 0) and reagent.r (the policy as judge),
at equal rollouts (the same manifest, seed, prompts, group size and steps; only the reward
plugins differ). Prints one row per arm: held-out greedy accuracy at the start and the end,
the mean training correctness, and the arm's own metrics.

    OMP_NUM_THREADS=1 python bench/rewards_smollm2.py --steps 8 --out /tmp/rewards-bench
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlmix import cli

ARMS = {
    "grpo": ([], []),
    "fapo": (["fapo"], ["fapo.correct_term=arith.correct", "fapo.min_steps=0"]),
    "solid": (["solid"], ["score.weights.arith.correct=0.0", "solid.nll_coef=0.1"]),
    "reagent.r": (["reagent.r"], ["score.weights.reagent.r.process=0.5",
                                  "reagent.r.lm.max_new_tokens=48"]),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--eval-size", type=int, default=20)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default="/tmp/rewards-bench")
    args = ap.parse_args()
    rows = []
    for arm in args.arms.split(","):
        plugins, extra = ARMS[arm]
        out = Path(args.out) / arm
        t0 = time.perf_counter()
        code = cli.main([
            "run", "examples/grpo-arith.yaml", "model=smollm2-135m",
            f"plugins=[hf,arith,grpo{''.join(',' + p for p in plugins)}]",
            f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}",
            f"train.group_size={args.group}", "train.eval_every=0", "train.checkpoint_every=0",
            f"arith.eval_size={args.eval_size}", "arith.eval_max_new_tokens=12",
            "sampling.max_new_tokens=12", "policy.autocast=none", "log.progress=false",
            "log.plot=false", f"out={out}", *extra])
        seconds = time.perf_counter() - t0
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in lines if "eval/accuracy" in r]
        train = [r for r in lines if "reward/arith.correct" in r]
        mine = {k: round(v, 3) for r in train for k, v in r.items()
                if k.split("/")[0] in ("fapo", "solid", "reagent.r")}
        rows.append({"arm": arm, "exit": code, "seconds": round(seconds, 1),
                     "eval_start": evals[0]["eval/accuracy"] if evals else None,
                     "eval_end": evals[-1]["eval/accuracy"] if evals else None,
                     "train_correct": round(sum(r["reward/arith.correct"] for r in train)
                                            / max(1, len(train)), 3),
                     "rollouts": args.steps * args.prompts * args.group, "last": mine})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
