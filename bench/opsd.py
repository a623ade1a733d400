"""Self-distillation and self-weighted SFT against GRPO on arithmetic, where the answer is the
privileged context: held-out greedy accuracy and rollouts spent, one short run per method on
the same model, prompts, seed and step count.

    OMP_NUM_THREADS=1 python bench/opsd.py                      # SmolLM2-135M, all methods
    python bench/opsd.py --model tiny-random --steps 1          # a smoke test
    python bench/opsd.py --methods grpo,hdpo                    # a subset

Methods: ``grpo``; ``hdpo`` (grpo + ``opsd.hdpo``: cliff prompts regenerated with the answer in
the prompt, correct ones distilled into the student under the plain prompt); ``osw_ft`` (SFT on
the answer, each query weighted by 1 - its success rate from 2 inference-only rollouts);
``sft`` (the same rows and rollouts with every weight 1: uniform SFT, OSW-FT's control);
``opsd`` (plain on-policy self-distillation from the answer-conditioned teacher, reward-free).
Rollouts are counted by a wrapper on ``rlmix_generate`` during training steps (HDPO's
privileged rollouts and OSW-FT's inference-only rollouts included; evaluation is not counted).
A short run on a shared CPU: what each method spends and roughly where it lands.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import pluggy

HOOKIMPL = pluggy.HookimplMarker("rlmix")
TEMPLATE = "'\n\nThe correct result is {answer}. Reply with only the final number.'"


def method_overrides(name: str, group: int) -> tuple[list[str], list[str]]:
    """(plugins after hf, arith, counter; manifest overrides) of each method."""
    table: dict[str, tuple[list[str], list[str]]] = {
        "grpo": (["grpo"], [f"train.group_size={group}"]),
        "hdpo": (["grpo", "opsd.hdpo"], [f"train.group_size={group}", "opsd.hdpo.lam=0.1",
                                         f"opsd.hdpo.template={TEMPLATE}",
                                         f"opsd.hdpo.n_privileged={max(1, group // 2)}"]),
        "osw_ft": (["osw_ft"], ["train.group_size=2"]),
        # the control OSW-FT is measured against: the same SFT rows and rollouts, every weight 1
        "sft": (["osw_ft"], ["train.group_size=2", "osw_ft.weighting=uniform"]),
        "opsd": (["opsd"], [f"train.group_size={group}", f"opsd.template={TEMPLATE}",
                            "opsd.top_k=64"]),
    }
    if name not in table:
        raise SystemExit(f"unknown method {name!r}; choose from {', '.join(table)}")
    return table[name]


METHODS = ("grpo", "hdpo", "osw_ft", "sft", "opsd")


class Counter:
    """Counts completions generated while ``active``."""

    def __init__(self) -> None:
        self.count = 0
        self.active = False

    @HOOKIMPL(wrapper=True)
    def rlmix_generate(self, run: Any, request: Any) -> Any:
        batch = yield
        if self.active and batch is not None:
            self.count += len(batch)
        return batch


def build(name: str, args: argparse.Namespace) -> tuple[Any, Counter]:
    from rlmix import loop, manifest

    extra, overrides = method_overrides(name, args.group)
    counter = Counter()
    out = Path(tempfile.mkdtemp(prefix=f"bench-opsd-{name}-"))
    plugins = ["hf", "arith", "counter", *extra]
    cfg = manifest.read(None, [
        f"model={args.model}", f"plugins=[{','.join(plugins)}]", f"out={out}",
        f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}",
        "train.eval_every=0", "train.checkpoint_every=0", f"train.lr={args.lr}",
        "train.seed=0", f"sampling.max_new_tokens={args.max_new}", "sampling.temperature=1.0",
        f"arith.eval_size={args.eval}", f"arith.digits={args.digits}",
        "arith.eval_max_new_tokens=10", "log.progress=false", "log.plot=false",
        f"policy.threads={args.threads}", "score.weights.arith.format=0", *overrides])
    run, _ = loop.prepare(cfg, extra_plugins={"counter": counter})
    loop.load_policy(run)
    loop.configure(run)
    return run, counter


def bench(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from rlmix import loop

    run, counter = build(name, args)
    t0 = time.perf_counter()
    rewards = []
    for _ in range(args.steps):
        counter.active = True
        metrics = loop.train_step(run)
        counter.active = False
        rewards.append(metrics.get("reward/mean", float("nan")))
    elapsed = time.perf_counter() - t0
    acc = loop.evaluate(run).get("eval/accuracy", float("nan"))
    return {"method": name, "rollouts": counter.count, "accuracy": acc, "train_s": elapsed,
            "last_train_reward": rewards[-1] if rewards else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new", type=int, default=8)
    p.add_argument("--eval", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--digits", type=int, default=1, help="arith operand digits")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-start-eval", action="store_true")
    args = p.parse_args()
    from rlmix import loop

    rows = []
    if not args.skip_start_eval:
        run, _ = build("grpo", args)
        start = loop.evaluate(run).get("eval/accuracy", float("nan"))
        print(f"start accuracy (all methods, same weights): {start:.3f}", flush=True)
    for name in [m for m in args.methods.split(",") if m]:
        try:
            row = bench(name, args)
        except Exception as exc:  # one method's failure must not lose the others' rows
            print(f"{name}: failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        rows.append(row)
        print(f"{name}: {row}", flush=True)
    print()
    print(f"| method | rollouts generated ({args.steps} steps) | held-out accuracy | train s |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['method']} | {r['rollouts']} | {r['accuracy']:.3f} | {r['train_s']:.0f} |")


if __name__ == "__main__":
    main()
