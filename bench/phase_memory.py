"""Where an rlmix GRPO step's peak memory falls: RSS around each phase, SmolLM2-135M.

    OMP_NUM_THREADS=1 python bench/phase_memory.py [--steps 3] [overrides ...]
    OMP_NUM_THREADS=1 python bench/phase_memory.py policy.gradient_checkpointing=true \
        train.optimizer_in_backward=true

The bench/vs_trl.py workload (1 prompt x 8 completions x 32 tokens by default, fused_logprobs,
exactly 32 tokens each, no clipping so ``train.optimizer_in_backward`` may be set) with any
manifest overrides; prints the step time and ``VmRSS`` / ``VmHWM`` (the peak so far) after
each step and before and after generation, the log-prob forward and the backward of the last
step. ``--mmap-threshold BYTES`` first fixes glibc's ``M_MMAP_THRESHOLD`` (and trim threshold)
through ``mallopt``, so freed large blocks go back to the system at once. ``--profile`` runs
one more step under the torch profiler and prints its top operators and each phase's total.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rss() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` in MiB."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) // 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--mmap-threshold", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="profile one more step")
    ap.add_argument("overrides", nargs="*", help="manifest overrides, key=value")
    args = ap.parse_args()
    if args.mmap_threshold:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, args.mmap_threshold)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, args.mmap_threshold)  # M_TRIM_THRESHOLD

    import torch
    import vs_trl

    import rlmix
    from rlmix import loop, manifest
    from rlmix.types import Prompt

    problems = vs_trl.prompt_texts(args.prompts * (args.steps + 2), 0)

    class BenchTask:
        @rlmix.hookimpl
        def rlmix_prompts(self, run: Any, step: int) -> list[Prompt]:
            chunk = problems[step * args.prompts:(step + 1) * args.prompts]
            return [Prompt(messages=[{"role": "user", "content": q}], answer=a, id=q)
                    for q, a in chunk]

        @rlmix.hookimpl
        def rlmix_score(self, run: Any, batch: Any) -> dict[str, torch.Tensor]:
            return {"correct": torch.tensor([vs_trl.correct(t, p.answer)
                                             for t, p in zip(batch.texts, batch.prompts)])}

    cfg = manifest.read(None, [
        "model=smollm2-135m", "plugins=[hf,benchtask,grpo,fused_logprobs]",
        "log.progress=false", "log.plot=false", "out=/tmp/rlmix-phase-memory",
        f"train.prompts_per_step={args.prompts}", f"train.group_size={args.group}",
        "train.lr=1e-6", "train.eval_every=0", "train.checkpoint_every=0",
        f"sampling.max_new_tokens={args.max_new_tokens}", "grpo.beta=0.0",
        "hf.stop_at_eos=false", "train.max_grad_norm=0", *args.overrides])
    run = loop.build_run(cfg, extra_plugins={"benchtask": BenchTask()})
    print(f"built: {rss()}")
    marks: list[tuple[str, dict[str, int]]] = []

    def wrap(obj: Any, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def wrapped(*a: Any, **kw: Any) -> Any:
            marks.append((f"before {name}", rss()))
            try:
                with torch.profiler.record_function(f"phase: {name}"):
                    return fn(*a, **kw)
            finally:
                marks.append((f"after {name}", rss()))
        setattr(obj, attr, wrapped)

    wrap(run, "sample", "generation")
    wrap(run.policy, "logprobs", "log-prob forward")
    wrap(torch.Tensor, "backward", "backward")
    for i in range(args.steps):
        marks.clear()
        t = time.perf_counter()
        loop.train_step(run)
        print(f"step {i}: {time.perf_counter() - t:.2f} s, {rss()}")
    for name, value in marks:
        print(f"  last step, {name}: {value}")
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loop.train_step(run)
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=12))
        for event in table:
            if event.key.startswith("phase: "):
                print(f"{event.key}: {event.cpu_time_total / 1e6:.2f} s")


if __name__ == "__main__":
    main()
