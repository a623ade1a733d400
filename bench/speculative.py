"""Speculative rollout (plugin ``speculative``) against plain sampling (``hf``) with SmolLM2-135M.

    OMP_NUM_THREADS=2 python bench/speculative.py                  # CPU, about 10 minutes
    python bench/speculative.py --device cuda --prompts 16 --n 8   # what gpu/speculative.sh runs

1. Decode: ``--prompts`` reasoning prompts x ``--n`` samples, ``--max-new-tokens`` tokens at
   ``--temperature``. Plain sampling is ``rlmix_hf.sample_tokens``. Each drafter first sees one
   "previous epoch" over the same prompts (another seed: what SPEC-RL and the suffix index
   draft from); the adaptive drafter is instead trained for ``--adaptive-rounds`` rounds on other
   prompts' rollouts (generate, then ``--adaptive-steps`` drafter steps), so it is never
   measured on what it trained on. Then plain and every drafter (fixed ``k``; with ``--auto``
   also the ``auto`` strategy's choice after it has seen plain's and the fixed-k run's costs)
   decode the same prompts, interleaved, ``--repeats`` times; the table keeps each
   configuration's best (least disturbed) repeat. Tokens/s counts generated tokens.
2. GRPO step time: ``--grpo-steps`` steps of [hf, arith, grpo] and of [hf, arith, grpo,
   speculative] (``--grpo-drafter``, auto strategy) from the same weights and seed, on two-digit
   addition with a step-by-step instruction (longer completions); each step's wall time covers
   sampling, scoring, the update and the step end (where the adaptive drafter trains).

Prints JSON lines, then Markdown tables (for BENCHMARKS.md). The machine may be shared: say so
with the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

QUESTIONS = [
    "A shop sells pens at {a} cents each. How much do {b} pens cost? Explain step by step.",
    "What is {a} + {b}? Show your reasoning step by step before the answer.",
    "Tom has {a} apples and gives away {b}. How many are left? Think step by step.",
    "Compute {a} times {b}, explaining each step of the multiplication.",
    "A train travels {a} km per hour for {b} hours. How far does it go? Explain.",
    "Write a short explanation of how to add {a} and {b} by hand, then give the sum.",
]


def make_prompts(tok, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        q = QUESTIONS[i % len(QUESTIONS)].format(a=rng.randint(12, 99), b=rng.randint(3, 40))
        out.append(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True))
    return out


def encode(tok, texts, device):
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_bench(args, model, tok, device) -> list[dict]:
    from rlmix_hf import sample_tokens, stop_token_ids
    from rlmix_speculative import (
        AdaptiveDrafter,
        CostModel,
        PreviousRolloutDrafter,
        SamplingParams,
        SpecStats,
        SuffixDrafter,
        default_candidates,
        speculative_sample,
    )

    from rlmix.policy import Policy

    eos = stop_token_ids(Policy(model, tok, device=device))
    pad = tok.pad_token_id
    sampling = SamplingParams(args.temperature, 1.0, 0)
    ids, attn = encode(tok, make_prompts(tok, args.prompts, seed=0), device)
    keys = [str(i) for i in range(args.prompts)]

    def spec(drafter, k, seed, collect=False):
        g = torch.Generator(device=device).manual_seed(seed)
        sync(device)
        t0 = time.perf_counter()
        out = speculative_sample(model, ids, attn, args.n, args.max_new_tokens, sampling, eos,
                                 pad, drafter=drafter, k=k, generator=g, keys=keys,
                                 collect_hidden=collect)
        sync(device)
        return out, time.perf_counter() - t0

    drafters = {"suffix": SuffixDrafter(), "previous_rollout": PreviousRolloutDrafter()}
    for name, d in drafters.items():  # the previous epoch over the same prompts
        out, secs = spec(d, args.k, seed=100)
        print(json.dumps({"warmup": name, "seconds": round(secs, 2)}), flush=True)
    adaptive = AdaptiveDrafter(model, window=16, lr=1e-3, train_positions=256)
    train_ids, train_attn = encode(tok, make_prompts(tok, args.prompts, seed=1000), device)
    for r in range(args.adaptive_rounds):
        g = torch.Generator(device=device).manual_seed(200 + r)
        t0 = time.perf_counter()
        out = speculative_sample(model, train_ids, train_attn, args.n, args.max_new_tokens,
                                 sampling, eos, pad, drafter=adaptive, k=args.k, generator=g,
                                 collect_hidden=True)
        adaptive.add_rollouts(out.hidden)
        t1 = time.perf_counter()
        stats = adaptive.train(args.adaptive_steps)
        print(json.dumps({"warmup": "adaptive", "round": r, "gen_s": round(t1 - t0, 2),
                          "train_s": round(time.perf_counter() - t1, 2),
                          "accepted_length": round(out.stats.mean_accepted_length, 3),
                          **{k: round(v, 4) for k, v in stats.items()}}), flush=True)
    drafters["adaptive"] = adaptive

    best: dict[str, dict] = {}
    auto_cost = {name: CostModel(default_candidates(args.k), explore=0.0) for name in drafters}
    for rep in range(args.repeats):
        seed = 300 + rep
        torch.manual_seed(seed)
        sync(device)
        t0 = time.perf_counter()
        completion, cmask, _ = sample_tokens(model, ids, attn, args.n, args.max_new_tokens,
                                             args.temperature, 1.0, 0, eos, pad)
        sync(device)
        secs = time.perf_counter() - t0
        rows = [("plain (hf)", float(cmask.sum()), secs, 1.0, 0)]
        passes = completion.shape[1]
        plain_stats = SpecStats(k=0, passes=passes, row_passes=passes * completion.shape[0],
                                verify_s=secs)
        for name, d in drafters.items():
            out, secs = spec(d, args.k, seed)
            rows.append((f"{name} k={args.k}", float(out.completion_mask.sum()), secs,
                         out.stats.mean_accepted_length, args.k))
            # the auto strategy decides from what it has measured so far: plain sampling's
            # and the fixed-k run's costs and acceptance (as in a run, where both were tried)
            if not args.auto:
                continue
            cost = auto_cost[name]
            cost.update(plain_stats)
            cost.update(out.stats)
            k_auto = cost.choose()
            out, secs = spec(d, k_auto, seed)
            cost.update(out.stats)
            rows.append((f"{name} auto", float(out.completion_mask.sum()), secs,
                         out.stats.mean_accepted_length, k_auto))
        for label, tokens, secs, mal, k in rows:
            rec = {"config": label, "repeat": rep, "tokens": int(tokens),
                   "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs, 2),
                   "accepted_length": round(mal, 3), "k": k}
            print(json.dumps(rec), flush=True)
            if label not in best or rec["tokens_per_s"] > best[label]["tokens_per_s"]:
                best[label] = rec
    return list(best.values())


def grpo_bench(args, device) -> list[dict]:
    import rlmix_arith
    import rlmix_grpo
    import rlmix_hf
    import rlmix_speculative

    from rlmix import loop, manifest

    results = []
    for with_spec in (False, True):
        plugins = {"hf": rlmix_hf, "arith": rlmix_arith, "grpo": rlmix_grpo}
        if with_spec:
            plugins["speculative"] = rlmix_speculative
        cfg = manifest.read(None, [
            "model=smollm2-135m", f"plugins=[{','.join(plugins)}]", "log.progress=false",
            f"out=/tmp/rlmix-bench-speculative-{int(with_spec)}", f"policy.device={device}",
            f"train.steps={args.grpo_steps}", "train.prompts_per_step=4",
            f"train.group_size={args.n}", "train.seed=0",
            "sampling.temperature=0.7", f"sampling.max_new_tokens={args.grpo_max_new_tokens}",
            "arith.instructions='Explain your steps briefly, then give the final number.'",
            *([f"speculative.drafter={args.grpo_drafter}", f"speculative.k={args.k}"]
              if with_spec else [])])
        run, _ = loop.prepare(cfg, extra_plugins=plugins, required={})
        loop.load_policy(run)
        loop.configure(run)
        times = []
        for _ in range(args.grpo_steps):
            sync(device)
            t0 = time.perf_counter()
            metrics = loop.train_step(run)
            run.hook.rlmix_step_end(run=run, metrics=metrics)
            sync(device)
            step_s = time.perf_counter() - t0
            times.append(step_s)
            rec = {"grpo": "speculative" if with_spec else "plain", "step": run.step,
                   "step_s": round(step_s, 2), "sample_s": round(metrics["time/sample_s"], 2),
                   "train_s": round(metrics["time/train_s"], 2),
                   "length": round(metrics["response_length/mean"], 1),
                   **{k.split("/", 1)[1]: round(v, 3) for k, v in metrics.items()
                      if k.startswith("speculative/") and isinstance(v, float)}}
            print(json.dumps(rec), flush=True)
            results.append(rec)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--adaptive-rounds", type=int, default=4)
    parser.add_argument("--adaptive-steps", type=int, default=40)
    parser.add_argument("--grpo-steps", type=int, default=3)
    parser.add_argument("--grpo-max-new-tokens", type=int, default=48)
    parser.add_argument("--grpo-drafter", default="suffix")
    parser.add_argument("--skip-grpo", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--auto", action="store_true",
                        help="also decode with the auto strategy's choice of k per drafter")
    args = parser.parse_args()
    if args.device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    from rlmix.policy import load_model

    model, tok = load_model("smollm2-135m")
    model = model.to(args.device).eval()
    t_start = time.perf_counter()
    decode = [] if args.skip_decode else decode_bench(args, model, tok, args.device)
    grpo = [] if args.skip_grpo else grpo_bench(args, args.device)
    plain = next((r["tokens_per_s"] for r in decode if r["config"] == "plain (hf)"), 1.0)
    print(f"\nDecode, SmolLM2-135M, {args.device}, {args.prompts} prompts x {args.n} samples, "
          f"{args.max_new_tokens} new tokens, T={args.temperature} (best of {args.repeats}):\n")
    print("| configuration | k | tokens | tokens/s | speedup | mean accepted length |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in decode:
        print(f"| {r['config']} | {r['k']} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / plain:.2f}x | {r['accepted_length']:.2f} |")
    if grpo:
        print(f"\nGRPO step time ({args.grpo_steps} steps, 4 prompts x {args.n}, "
              f"{args.grpo_max_new_tokens} new tokens, drafter {args.grpo_drafter}, auto):\n")
        print("| run | mean step s | mean sample s | steps after the first: step s |")
        print("| --- | --- | --- | --- |")
        for name in ("plain", "speculative"):
            rows = [r for r in grpo if r["grpo"] == name]
            later = rows[1:] or rows
            print(f"| {name} | {sum(r['step_s'] for r in rows) / len(rows):.2f} | "
                  f"{sum(r['sample_s'] for r in rows) / len(rows):.2f} | "
                  f"{sum(r['step_s'] for r in later) / len(later):.2f} |")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; command: python "
          f"{' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
