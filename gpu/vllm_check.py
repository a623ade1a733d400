"""GPU check of the vLLM rollout plugin (plugins/rollout/vllm); run by gpu/vllm.sh.

1. logprobs: vLLM's per-token behaviour log-probs (processed: temperature applied) against the
   trainer's (``Policy.logprobs``, fp32) on the same tokens.
2. sync: after an "update" (every weight moved), the plugin pushes the weights into the running
   engine; its log-probs must follow the new weights, not the old ones.
3. sleep: GPU memory the engine frees with ``sleep_level: 1``.
4. throughput: generated tokens per second, vLLM vs ``rollout/hf``, same model, same requests.

The model is a SmolLM2-135M-shaped Llama with random weights (30 layers, hidden 576; the GPU
machine has no network and no model cache) and rlmix's byte tokenizer, so the figures are for
that shape. One JSON line per check, then a Markdown table. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def build_model(folder: str, layers: int, hidden: int, heads: int) -> None:
    from rlmix.policy import tiny_random

    model, tok = tiny_random(seed=0, hidden=hidden, layers=layers, heads=heads)
    with torch.no_grad():  # wider logits than the init scale, so distributions are not flat
        model.get_output_embeddings().weight.mul_(20.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def make(folder: str, plugins: dict[str, Any], overrides: list[str]) -> Any:
    from rlmix import loop
    from rlmix.testing import make_run

    run = make_run(plugins, ["policy.device=cuda", "sampling.temperature=1.0",
                             *overrides], model=folder, with_policy=True)
    loop.configure(run)
    return run


def prompts(k: int) -> list[Any]:
    from rlmix.types import Prompt

    return [Prompt(messages=[{"role": "user", "content": f"Add {i} and {2 * i + 1}."}],
                   id=str(i)) for i in range(k)]


def compare(run: Any, batch: Any) -> tuple[float, float]:
    with torch.no_grad():
        logp, _ = run.policy.logprobs(run, batch)
    mask = batch.completion_mask.bool()
    diff = (logp.float().cpu()[mask] - batch.behavior_logp[mask]).abs()
    return float(diff.mean()), float(diff.max())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--tol-mean", type=float, default=2e-3)
    parser.add_argument("--tol-max", type=float, default=5e-2)
    parser.add_argument("--part", choices=("sync", "sleep", "throughput"), required=True,
                        help="one part per process: a second vllm.LLM in one process is fragile")
    parser.add_argument("--folder", required=True, help="where the random model is (made once)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        emit({"check": "vllm", "skipped": "no CUDA GPU"})
        return 0
    from pathlib import Path

    import rlmix_hf
    import rlmix_vllm
    import vllm

    folder = args.folder
    if not (Path(folder) / "config.json").exists():
        build_model(folder, args.layers, args.hidden, args.heads)
    ok = True
    rows: list[tuple[str, str, str]] = []
    emit({"check": "versions", "vllm": vllm.__version__, "torch": torch.__version__,
          "gpu": torch.cuda.get_device_name()})

    if args.part == "sync":
        ok &= part_sync(args, folder, rows, rlmix_vllm)
    elif args.part == "sleep":
        ok &= part_sleep(folder, rows, rlmix_vllm)
    else:
        part_throughput(args, folder, rows, rlmix_vllm, rlmix_hf)
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]} |")
    return 0 if ok else 1


def part_sync(args: Any, folder: str, rows: list[tuple[str, str, str]], rlmix_vllm: Any) -> bool:
    ok = True
    # 1. log-probs, fp32 engine against the fp32 trainer
    run = make(folder, {"vllm": rlmix_vllm},
               ["vllm.dtype=float32", "vllm.stop_at_eos=false", "vllm.gpu_memory_utilization=0.3"])
    batch = run.generate(prompts(8), n=4, temperature=1.0, max_new_tokens=32)
    mean, worst = compare(run, batch)
    good = mean < args.tol_mean and worst < args.tol_max
    ok &= good
    emit({"check": "logprobs", "mean_abs": mean, "max_abs": worst, "ok": good})
    rows.append(("vLLM vs trainer log-probs (fp32)", f"mean {mean:.2e}, max {worst:.2e}",
                 "ok" if good else "FAIL"))

    # 2. weight sync: move every weight, push, compare against new and old
    with torch.no_grad():
        for p in run.policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.abs().mean())
    run.policy_version += 1
    after = run.generate(prompts(8), n=4, temperature=1.0, max_new_tokens=32)
    mean_new, worst_new = compare(run, after)
    good = (mean_new < args.tol_mean and worst_new < args.tol_max
            and bool((after.policy_version == run.policy_version).all()))
    ok &= good
    emit({"check": "weight_sync", "mean_abs_vs_new": mean_new, "max_abs_vs_new": worst_new,
          "ok": good})
    rows.append(("after a weight push: vs the new weights", f"mean {mean_new:.2e}",
                 "ok" if good else "FAIL"))
    return ok


def part_sleep(folder: str, rows: list[tuple[str, str, str]], rlmix_vllm: Any) -> bool:
    # 3. sleep level 1 frees the engine's memory between rollouts
    free0, _ = torch.cuda.mem_get_info()
    run = make(folder, {"vllm": rlmix_vllm}, ["vllm.sleep_level=1", "vllm.stop_at_eos=false"])
    free_asleep, _ = torch.cuda.mem_get_info()
    engine = run.resources["vllm"]
    engine.wake(["weights", "kv_cache"])
    engine.asleep = False
    free_awake, _ = torch.cuda.mem_get_info()
    engine.sleep()
    gib = 1024 ** 3
    emit({"check": "sleep", "engine_awake_gib": (free0 - free_awake) / gib,
          "engine_asleep_gib": (free0 - free_asleep) / gib})
    rows.append(("GPU memory held, awake -> asleep (level 1)",
                 f"{(free0 - free_awake) / gib:.1f} -> {(free0 - free_asleep) / gib:.2f} GiB", ""))
    batch = run.generate(prompts(4), n=2, temperature=1.0, max_new_tokens=16)  # wakes, sleeps
    good = len(batch) == 8 and bool(engine.asleep)
    emit({"check": "sleep_generate", "rows": len(batch), "asleep_after": engine.asleep,
          "ok": good})
    return good


def part_throughput(args: Any, folder: str, rows: list[tuple[str, str, str]], rlmix_vllm: Any,
                    rlmix_hf: Any) -> None:
    # 4. throughput: the same requests through vLLM (bf16) and rollout/hf (bf16 autocast)
    results = {}
    for name, plugins, extra in [
        ("vllm", {"vllm": rlmix_vllm}, ["vllm.dtype=bfloat16", "vllm.stop_at_eos=false",
                                        "vllm.gpu_memory_utilization=0.5"]),
        ("hf", {"hf": rlmix_hf}, ["policy.autocast=bfloat16", "hf.stop_at_eos=false"]),
    ]:
        run = make(folder, plugins, extra)
        run.generate(prompts(4), n=2, temperature=1.0, max_new_tokens=8)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = run.generate(prompts(args.prompts), n=args.n, temperature=1.0,
                             max_new_tokens=args.tokens)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        tokens = float(batch.completion_mask.sum())
        results[name] = tokens / seconds
        emit({"check": "throughput", "engine": name, "tokens": tokens, "seconds": seconds,
              "tokens_per_s": tokens / seconds})
        engine = run.resources.get("vllm")
        if engine is not None and hasattr(engine.llm, "shutdown"):
            engine.llm.shutdown()
        del run
        torch.cuda.empty_cache()
    ratio = results["vllm"] / results["hf"]
    rows.append((f"throughput, {args.prompts} prompts x {args.n} x {args.tokens} tokens",
                 f"vLLM {results['vllm']:.0f} tok/s, hf {results['hf']:.0f} tok/s",
                 f"{ratio:.1f}x"))


if __name__ == "__main__":
    sys.exit(main())
