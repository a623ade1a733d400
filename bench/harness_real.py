"""Harness evolution on a real model with no strong reflection model: bootstrapped few-shot
demonstrations (``bootstrap_fewshot``) on SmolLM2-135M-Instruct, alone and with GRPO.

The task is ``arith`` with one-digit operands and the operators + - * (the setting in
``examples/harness/bootstrap_fewshot-smollm2.yaml``). The mechanism needs no model that writes
edits: the program (policy + harness) runs greedily on training tasks, its correct answers
become demonstrations, and demo sets are chosen by greedy accuracy on validation tasks. The
training and validation tasks come from ``rlmix_prompts`` at steps far beyond the training
stream, and ``arith`` never draws its held-out problems there, so the held-out figure (arith's
own ``eval/accuracy``: 100 problems, greedy) is never searched on.

Part ``harness`` (the weights never change, ``train.mode: harness-only``): held-out accuracy
under the seed harness, then the search run to the end (every demo set scored, or the budget
spent), then held-out accuracy under the harness it applied. ``--score-all`` also scores every
demo set on the held-out problems (reporting only; selection never reads it).

Part ``joint``: GRPO alone vs GRPO with the same search interleaved (``train.evolve_every``),
each for the same time budget (``--minutes`` of wall time, or of this process's CPU time with
``--clock cpu``, fairer when the machine's load changes; the search's rollouts count inside
it), the same seed and the same training problems; held-out accuracy of each at the end, each
under its own harness (the joint run's weights are also scored under the seed harness).
``--schedule late`` moves the search to the end: GRPO alone until ``--reserve`` seconds of the
budget are left, then the search to its end on the trained weights (demos bootstrapped from
what GRPO taught), then GRPO under the applied harness for what is left; the search's time
counts inside the budget either way. ``--arms rl`` and ``--arms joint`` in two processes run
the two arms of one seed side by side (with ``--clock cpu``, each on its own CPU time).

    python bench/harness_real.py                                  # both parts
    python bench/harness_real.py --part harness
    python bench/harness_real.py --part joint --minutes 10
    python bench/harness_real.py --part joint --minutes 10 --clock cpu --schedule late \
        --arms joint --seed 3              # beside the same with --arms rl
    python bench/harness_real.py --model tiny-random --steps 2 --eval-size 4   # plumbing only

Results go to ``<out>/harness.json`` and ``<out>/joint.json`` (``joint-<arm>.json`` for one
arm). Run it with one torch thread
(``OMP_NUM_THREADS=1``; the manifest sets ``policy.threads: 1``) and ``nice`` on this machine.
Training and search time are wall seconds; model loading and held-out evaluation are excluded.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

from _common import Clock, tiny_plumbing, train_for

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "harness" / "bootstrap_fewshot-smollm2.yaml"
NAME = "bootstrap_fewshot"


def overrides(args: argparse.Namespace, label: str) -> list[str]:
    out = [f"model={args.model}", "log.progress=false", "log.plot=false",
           f"out={args.out}/runs/{label}", f"train.seed={args.seed}",
           f"{NAME}.seed={args.seed}"]
    if args.steps:
        out.append(f"train.steps={args.steps}")
    if args.eval_size:
        out.append(f"arith.eval_size={args.eval_size}")
    if args.model == "tiny-random":  # plumbing: short everything, no bf16
        out += tiny_plumbing("arith", 4) + [
                f"{NAME}.max_new_tokens=4", f"{NAME}.train_size=4",
                f"{NAME}.val_size=2", f"{NAME}.num_candidates=2", f"{NAME}.budget=20",
                f"{NAME}.threshold=0.0"]  # the tiny model solves nothing: keep every trace
    return out + list(args.set)


def build(args: argparse.Namespace, label: str, plugins: list[str], mode: str,
          extra: list[str] = ()) -> Any:
    from rlmix import loop, manifest

    cfg = manifest.read(MANIFEST, overrides(args, label) + [f"train.mode={mode}", *extra])
    cfg["plugins"] = plugins
    for block in ("grpo", NAME):
        if block not in plugins:
            del cfg[block]
    return loop.build_run(cfg, overwrite=True)


def heldout(run: Any) -> dict[str, float]:
    from rlmix import loop

    out = loop.evaluate(run)
    return {"accuracy": out["eval/accuracy"], "format": out["eval/format"]}


def search_done(run: Any) -> bool:
    """Every demo set scored, or the next one no longer fits in the budget."""
    state = run.state.get(NAME)
    if not state:
        return False
    s = run.settings(NAME)
    pending = any(v is None for v in state["val"])
    return not pending or state["metric_calls"] + s.val_size > s.budget


def summary(run: Any) -> dict[str, Any]:
    from rlmix_harness import mean

    # before any search step: an empty state
    state = run.state.get(NAME) or {"pool": [], "candidates": [], "val": [], "applied": 0,
                                    "metric_calls": 0, "rounds": [], "history": []}
    return {"demos": len(state["pool"]), "sets": [list(c) for c in state["candidates"]],
            "val": [None if v is None else round(mean(v), 4) for v in state["val"]],
            "applied": state["applied"], "metric_calls": state["metric_calls"],
            "pool": [d["input"] + " -> " + d["output"] for d in state["pool"]],
            "rounds": state["rounds"], "history": state["history"]}


def harness_part(args: argparse.Namespace) -> dict[str, Any]:
    """Held-out accuracy under the seed harness and under the harness the search applied."""
    from rlmix import loop

    run = build(args, "harness", ["hf", "arith", NAME], "harness-only",
                ["train.group_size=1"])
    seed_harness = dict(run.harness)
    before = heldout(run)
    print(f"[harness] seed harness: held-out {before['accuracy']:.3f}", flush=True)
    t0 = time.perf_counter()
    while run.step < int(run.config.train.steps) and not search_done(run):
        loop.train_step(run)
        s = summary(run)
        print(f"[harness] step {run.step}: {s['demos']} demos, val {s['val']}, applied "
              f"{s['applied']}, {s['metric_calls']} calls, {time.perf_counter() - t0:.0f} s",
              flush=True)
    search_s = time.perf_counter() - t0
    after = heldout(run)
    row = {"part": "harness", "model": args.model, "seed": args.seed,
           "seed_heldout": before, "evolved_heldout": after,
           "gain": after["accuracy"] - before["accuracy"], "search_wall_s": round(search_s, 1),
           "steps": run.step, "harness_version": run.harness_version,
           "evolved_harness": dict(run.harness), "seed_harness": seed_harness,
           "eval_size": len(run.state["arith"]["eval"]), **summary(run)}
    if args.score_all:  # reporting only: the search never reads these
        import rlmix_bootstrap_fewshot as bf
        from rlmix_harness import harness_swapped

        state, scores = run.state[NAME], []
        component = run.settings(NAME).component
        for c in range(len(state["candidates"])):
            demo_set = bf.harness_with(state, run, c)[component]
            with harness_swapped(run, {**seed_harness, component: demo_set}):
                scores.append(heldout(run)["accuracy"])
        row["heldout_per_set"] = scores
    run.hook.rlmix_run_end(run=run)
    return row


def search_to_end(run: Any, label: str, verbose: bool) -> None:
    """The demo search run to its end at the current weights, outside the training steps:
    the bootstrap, then every demo set scored on the validation tasks (or the budget spent),
    the best applied as the harness."""
    import rlmix_bootstrap_fewshot as bf

    from rlmix import loop

    while not search_done(run):
        update = bf.iterate(run)
        if update is not None:
            loop.apply_harness_update(run, update)
        if verbose:
            s = summary(run)
            print(f"[{label}] search: {s['demos']} demos, val {s['val']}, applied "
                  f"{s['applied']}", flush=True)


def train_late(run: Any, budget_s: float, reserve_s: float, label: str, verbose: bool,
               clock: str) -> dict[str, Any]:
    """The ``late`` schedule: GRPO alone until ``reserve_s`` of the budget is left, then the
    demo search to its end on the trained weights, then GRPO under the applied harness for
    whatever the budget has left (the search's time counts inside the budget)."""
    c, rewards = Clock(clock), []
    train_for(run, budget_s - reserve_s, label, verbose, started=c, rewards=rewards)
    rl_steps, t0 = run.step, c.spent()
    search_to_end(run, label, verbose)
    search_s = c.spent() - t0
    row = train_for(run, budget_s, label, verbose, started=c, rewards=rewards)
    return {**row, "steps_before_search": rl_steps, "search_s": round(search_s, 1)}


def joint_part(args: argparse.Namespace) -> dict[str, Any]:
    """GRPO alone vs GRPO + the demo search (interleaved from the first step, or ``late``: on
    the trained weights at the end), at the same time budget."""
    from rlmix_harness import harness_swapped

    budget = args.minutes * 60.0
    rows: dict[str, Any] = {"part": "joint", "model": args.model, "seed": args.seed,
                            "budget_s": budget, "schedule": args.schedule}
    arms = {"rl": ["hf", "arith", "grpo", "fused_logprobs"],
            "joint": ["hf", "arith", "grpo", "fused_logprobs", NAME]}
    for label in args.arms:
        extra = list(args.joint_set) if label == "joint" else []
        if label == "joint" and args.schedule == "late":
            extra.append("train.evolve_every=1000000000")  # no search inside the RL steps
        run = build(args, label, arms[label], "rl", extra)
        seed_harness = dict(run.harness)
        before = heldout(run)
        if label == "joint" and args.schedule == "late":
            trained = train_late(run, budget, min(args.reserve, budget), label, args.verbose,
                                 args.clock)
        else:
            trained = train_for(run, budget, label, args.verbose, args.clock)
        row = {"before": before, **trained}
        row["after"] = heldout(run)
        if label == "joint":
            row.update(summary(run), harness=dict(run.harness), search_done=search_done(run))
            with harness_swapped(run, seed_harness):  # the weights alone, under the seed
                row["after_seed_harness"] = heldout(run)
        print(f"[{label}] {row['steps']} steps in {row['train_wall_s']:.0f} s: held-out "
              f"{before['accuracy']:.3f} -> {row['after']['accuracy']:.3f}", flush=True)
        run.hook.rlmix_run_end(run=run)
        rows[label] = row
        del run
        gc.collect()
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("harness", "joint", "both"), default="both")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--minutes", type=float, default=10.0, help="joint: time per run")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="joint: what --minutes counts; cpu (this process's CPU seconds) is "
                   "the fairer budget on a machine whose load changes between the two runs")
    p.add_argument("--schedule", choices=("interleaved", "late"), default="interleaved",
                   help="joint: the search at every step from the first (the manifest's "
                   "train.evolve_every: 1), or late: on the trained weights, --reserve before "
                   "the budget ends")
    p.add_argument("--reserve", type=float, default=150.0,
                   help="joint, late: seconds of the budget left when the search starts")
    p.add_argument("--arms", type=lambda v: v.split(","), default=["rl", "joint"],
                   help="joint: the runs, comma-separated (rl, joint); one arm per process "
                   "runs both arms of a seed side by side with --clock cpu")
    p.add_argument("--steps", type=int, default=0, help="at most this many steps per run "
                   "(0 = the manifest's train.steps)")
    p.add_argument("--eval-size", type=int, default=0, help="held-out problems (0 = the "
                   "manifest's 100)")
    p.add_argument("--seed", type=int, default=0, help="train.seed and the demo-set seed")
    p.add_argument("--score-all", action="store_true",
                   help="harness: also score every demo set on the held-out problems")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a manifest override for every run (repeatable)")
    p.add_argument("--joint-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a manifest override for the joint run only (repeatable)")
    p.add_argument("--out", default="runs/harness_real")
    p.add_argument("--verbose", action="store_true", help="a line per training step")
    return p.parse_args(argv)


def table(results: dict[str, Any]) -> str:
    lines = []
    h = results.get("harness")
    if h:
        lines += ["| harness (weights frozen) | held-out accuracy | search |",
                  "| --- | --- | --- |",
                  f"| seed | {h['seed_heldout']['accuracy']:.3f} | - |",
                  f"| bootstrapped demos, set {h['applied']} of {len(h['sets'])} | "
                  f"{h['evolved_heldout']['accuracy']:.3f} ({h['gain']:+.3f}) | "
                  f"{h['metric_calls']} calls, {h['search_wall_s']:.0f} s |"]
    j = results.get("joint")
    if j:
        clock = j[next(k for k in ("rl", "joint") if k in j)]["clock"]
        lines += ["", f"| run (equal {clock} time) | steps | train wall (s) | "
                  "train CPU (s) | held-out before | held-out after |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for label in ("rl", "joint"):
            if label not in j:
                continue
            r = j[label]
            lines.append(f"| {label} | {r['steps']} | {r['train_wall_s']:.0f} | "
                         f"{r['train_cpu_s']:.0f} | "
                         f"{r['before']['accuracy']:.3f} | {r['after']['accuracy']:.3f} |")
        if "joint" in j:
            lines.append(f"| joint weights, seed harness | | | | | "
                         f"{j['joint']['after_seed_harness']['accuracy']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if set(args.arms) - {"rl", "joint"} or not args.arms:
        raise SystemExit(f"--arms: rl and/or joint, not {','.join(args.arms)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for part, fn in (("harness", harness_part), ("joint", joint_part)):
        if args.part in (part, "both"):
            results[part] = fn(args)
            results[part]["args"] = vars(args)
            name = part if part == "harness" or len(args.arms) == 2 else \
                f"{part}-{args.arms[0]}"
            (out / f"{name}.json").write_text(json.dumps(results[part], indent=1, default=str))
    print(table(results), flush=True)
    return results


if __name__ == "__main__":
    main()
