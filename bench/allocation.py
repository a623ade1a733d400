"""Rollout allocation methods against GRPO on arithmetic: held-out accuracy against rollouts
spent, one short run per method on the same model, prompts, seed and step count.

    OMP_NUM_THREADS=2 python bench/allocation.py                  # SmolLM2-135M, all methods
    python bench/allocation.py --model tiny-random --steps 1      # a smoke test
    python bench/allocation.py --methods grpo,ar3po,roc           # a subset

Every method trains ``--steps`` GRPO steps on ``arith`` prompts (``--prompts`` per step) at
GRPO's budget of ``--prompts * --group`` generated rollouts per step, except where the method
spends differently by design (DOTS replays one group per step instead of generating it).
Rollouts are counted by a wrapper on ``rlmix_generate`` during training steps only (evaluation
is greedy generation and is not counted). Accuracy is greedy, on ``--eval`` held-out problems,
before training (once, shared) and after each method's run. A short run on a shared CPU: the
numbers say what each method spends and roughly where it lands, not which is best.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import pluggy

HOOKIMPL = pluggy.HookimplMarker("rlmix")


def method_overrides(name: str, group: int, prompts: int = 4) -> tuple[list[str], list[str]]:
    """(extra plugins, manifest overrides) of each method at GRPO's per-step budget."""
    half = max(2, group // 2)
    table: dict[str, tuple[list[str], list[str]]] = {
        "grpo": ([], [f"train.group_size={group}"]),
        "ar3po": (["ar3po"], [f"train.group_size={half}", f"ar3po.budget_per_prompt={group}"]),
        "dots": (["dots"], [f"train.group_size={group}",  # replay needs a third prompt slot
                            f"dots.replay_groups={1 if prompts > 2 else 0}"]),
        "roc": (["roc"], [f"train.group_size={half}", "roc.oversample=2",
                          "roc.quality_terms=arith.format", "score.weights.arith.format=0"]),
        "e3": (["e3"], [f"train.group_size={group}", "e3.min_rollouts=2"]),
        "eepo": (["eepo"], [f"train.group_size={group}", "eepo.unlearn_lr=1e-4"]),
        "trace_alloc": (["trace_alloc"],
                        [f"train.group_size={half}", f"trace_alloc.budget_per_prompt={group}"]),
        "xrpo_alloc": (["xrpo_alloc"], [f"train.group_size={half}",
                                        f"xrpo_alloc.budget_per_prompt={group}"]),
        # test-time RL: no labels; the reward is agreement with the group's majority answer
        "echo": (["echo"], [f"train.group_size={half}", f"echo.branch_budget={prompts * half}",
                            "score.weights.arith.correct=0", "score.weights.arith.format=0",
                            "score.weights.echo.pseudo_correct=1"]),
        # Monte Carlo continuations (counted in its state) take the other half of the budget
        "agent_prm": (["agent_prm"], [f"train.group_size={half}", "agent_prm.mc_rows=1",
                                      f"agent_prm.mc_rollouts={max(1, prompts * half // 4)}",
                                      "agent_prm.max_steps=4"]),
    }
    if name not in table:
        raise SystemExit(f"unknown method {name!r}; choose from {', '.join(table)}")
    return table[name]


METHODS = ("grpo", "ar3po", "dots", "roc", "e3", "eepo", "trace_alloc", "xrpo_alloc", "echo",
           "agent_prm")


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

    extra, overrides = method_overrides(name, args.group, args.prompts)
    counter = Counter()
    out = Path(tempfile.mkdtemp(prefix=f"bench-alloc-{name}-"))
    # the method's sample wrapper goes last, so it wraps the core's sampler
    plugins = ["hf", "arith", "grpo", "counter", *extra]
    cfg = manifest.read(None, [
        f"model={args.model}", f"plugins=[{','.join(plugins)}]", f"out={out}",
        f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}",
        "train.eval_every=0", "train.checkpoint_every=0", f"train.lr={args.lr}",
        "train.seed=0", f"sampling.max_new_tokens={args.max_new}", "sampling.temperature=1.0",
        f"arith.eval_size={args.eval}", f"arith.digits={args.digits}",
        "arith.eval_max_new_tokens=16", "log.progress=false", "policy.autocast=bfloat16",
        "log.plot=false", f"policy.threads={args.threads}", *overrides])
    run, _ = loop.prepare(cfg, extra_plugins={"counter": counter})
    loop.load_policy(run)
    loop.configure(run)
    return run, counter


def bench(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from rlmix import loop

    run, counter = build(name, args)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        counter.active = True
        loop.train_step(run)
        counter.active = False
    elapsed = time.perf_counter() - t0
    acc = loop.evaluate(run).get("eval/accuracy", float("nan"))
    return {"method": name, "rollouts": counter.count, "accuracy": acc, "train_s": elapsed,
            "state_rollouts": run.state.get(name, {}).get("rollouts")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=10)
    p.add_argument("--eval", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--digits", type=int, default=1, help="arith operand digits")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-start-eval", action="store_true")
    args = p.parse_args()
    from rlmix import loop

    methods = [m for m in args.methods.split(",") if m]
    rows = []
    if not args.skip_start_eval:
        run, _ = build("grpo", args)
        start = loop.evaluate(run).get("eval/accuracy", float("nan"))
        print(f"start accuracy (all methods, same weights): {start:.3f}", flush=True)
    for name in methods:
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
