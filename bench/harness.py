"""rlmix's GEPA plugin against the PyPI ``gepa`` package (0.1.4), in one run, on the same task,
the same model and the same metric-call budget.

    python bench/harness.py                       # SmolLM2-135M, budget 60, 40 held-out tasks
    python bench/harness.py --model tiny-random --budget 20 --heldout 8    # a smoke run

Task: arith (two-digit addition and subtraction) from the harness-only GEPA manifest,
evolving the ``instructions`` component from a deliberately weak seed. Both optimizers use:

* the same tasks: rlmix's task pool split into search (the package's ``trainset``), selection
  (its ``valset``) and held-out tasks that neither optimizer sees;
* the same task model and rollouts: SmolLM2-135M-Instruct in-process, greedy, through rlmix's
  ``run.generate`` and the arith scorer (``arith.correct`` is the metric), so one metric call
  is one scored rollout of one task for both;
* the same reflection model: the same SmolLM2 in-process (``rlmix_lm.PolicyLM``), with the
  same token limit and temperature; the package calls it through its default proposal prompt,
  rlmix through its own;
* the same traces: input, output, score, reward terms and the env's feedback;
* the same budget in metric calls (the package checks it before starting an iteration, so it
  may overshoot by one iteration; rlmix starts an iteration only when its worst case fits, so
  it never overshoots; the table reports the calls actually made).

Held-out accuracy is measured for the seed and for each optimizer's best candidate on the
held-out tasks (these rollouts are not counted against either budget). Requires
``pip install gepa==0.1.4`` (not needed by the test suite).

``--compare flash`` instead compares rlmix's synchronous GEPA (``rlmix_gepa.iterate`` until no
iteration fits) with ``flash_evolve`` (GEPA's stages as asynchronous workers, the whole budget
in one ``evolve`` call) on the same tasks, task model, reflection model and budget, and reports
proposals per second (mutation proposals decided / search seconds), the final selection score
of each one's best candidate, and its held-out accuracy:

    python bench/harness.py --compare flash                     # reflection: a 2nd SmolLM2 copy
    python bench/harness.py --compare flash --reflect-source policy
    python bench/harness.py --compare flash --model tiny-random --budget 30 --heldout 8

With ``--reflect-source local`` (the default here) the reflection model is a second in-process
copy of the model, so reflection can overlap the task model's rollouts; with ``policy`` it is
the task model itself and flash_evolve serialises the two under its generation lock.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "harness" / "gepa-arith.yaml"
SEED_INSTRUCTIONS = "Answer the question."


def build(args: argparse.Namespace, out: Path) -> Any:
    from rlmix import loop, manifest

    cfg = manifest.read(MANIFEST, [
        f"model={args.model}", "plugins=[hf,arith,grpo,gepa]", f"out={out}",
        "log.progress=false", f"harness.instructions={SEED_INSTRUCTIONS}",
        f"gepa.budget={args.budget}", f"gepa.search_size={args.search}",
        f"gepa.selection_size={args.selection}", f"gepa.heldout_size={args.heldout}",
        f"gepa.minibatch_size={args.minibatch}", f"gepa.max_new_tokens={args.max_new_tokens}",
        f"gepa.lm.max_new_tokens={args.reflect_tokens}",
        f"gepa.lm.temperature={args.reflect_temperature}", f"gepa.seed={args.seed}",
        f"train.prompts_per_step={args.per_step}", f"policy.threads={args.threads}"])
    del cfg["gates"]  # the package has no flip gate: compare the searches alone
    return loop.build_run(cfg)


def run_rlmix(run: Any) -> dict[str, Any]:
    import rlmix_gepa

    from rlmix import loop

    t0 = time.perf_counter()
    state = rlmix_gepa.init_state(run)
    print(f"  rlmix seed: selection {sum(state['scores'][0]) / len(state['scores'][0]):.3f}, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    while state["metric_calls"] < run.settings("gepa").budget:
        before = state["iteration"]
        update = rlmix_gepa.iterate(run)
        if update is not None:
            loop.apply_harness_update(run, update)
        if state["iteration"] == before:
            break  # no iteration fits in what is left of the budget
        h = state["history"][-1]
        print(f"  rlmix iteration {h['iteration']} ({h['kind']}): accepted "
              f"{h.get('accepted')}, {h['metric_calls']} calls, {time.perf_counter() - t0:.0f} s,"
              f" proposal {str(h.get('proposal', ''))[:80]!r}", flush=True)
    best = state["candidates"][state["applied"]]
    return {"best": best, "calls": state["metric_calls"], "seconds": time.perf_counter() - t0,
            "candidates": len(state["candidates"]),
            "accepted": sum(1 for h in state["history"] if h.get("accepted")),
            "iterations": state["iteration"]}


class ArithAdapter:
    """The package's adapter over the same rollouts and scorer."""

    propose_new_texts = None  # use the package's own reflective proposal

    def __init__(self, run: Any, feedback_chars: int) -> None:
        self.run, self.feedback_chars = run, feedback_chars
        self.calls = 0

    def evaluate(self, batch: list[Any], candidate: dict[str, str],
                 capture_traces: bool = False) -> Any:
        import rlmix_gepa
        from gepa.core.adapter import EvaluationBatch

        tasks = [(int(a), int(b)) for a, b in batch]
        scores, scored = rlmix_gepa.run_tasks(self.run, candidate, tasks)
        self.calls += len(tasks)
        traces = rlmix_gepa.traces(scored, scores, self.feedback_chars)
        return EvaluationBatch(outputs=list(scored.texts), scores=scores,
                               trajectories=traces if capture_traces else None)

    def make_reflective_dataset(self, candidate: dict[str, str], eval_batch: Any,
                                components_to_update: list[str]) -> dict[str, list[dict]]:
        rows = [{"Inputs": t["input"], "Generated Outputs": t["output"],
                 "Feedback": f"score {t['score']:g} ({t['terms']}); {t['feedback']}"}
                for t in eval_batch.trajectories]
        return {c: rows for c in components_to_update}


def run_package(run: Any, seed: dict[str, str], search: list, selection: list,
                args: argparse.Namespace) -> dict[str, Any]:
    import gepa
    from rlmix_lm import PolicyLM

    lm = PolicyLM(run)

    def reflection_lm(prompt: str) -> str:
        return lm.complete(prompt, args.reflect_tokens, args.reflect_temperature)

    adapter = ArithAdapter(run, run.settings("gepa").feedback_chars)
    t0 = time.perf_counter()
    result = gepa.optimize(
        seed_candidate=dict(seed), trainset=[tuple(t) for t in search],
        valset=[tuple(t) for t in selection], adapter=adapter, reflection_lm=reflection_lm,
        reflection_minibatch_size=args.minibatch, max_metric_calls=args.budget,
        use_merge=True, max_merge_invocations=5, seed=args.seed, display_progress_bar=False,
        raise_on_exception=True)
    return {"best": dict(result.best_candidate), "calls": adapter.calls,
            "reported_calls": result.total_metric_calls, "seconds": time.perf_counter() - t0,
            "candidates": len(result.candidates)}


def heldout_accuracy(run: Any, candidate: dict[str, str], tasks: list) -> float:
    import rlmix_gepa

    scores, _ = rlmix_gepa.run_tasks(run, candidate, [tuple(t) for t in tasks])
    return sum(scores) / len(scores)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--budget", type=int, default=60)
    p.add_argument("--search", type=int, default=12)
    p.add_argument("--selection", type=int, default=8)
    p.add_argument("--heldout", type=int, default=40)
    p.add_argument("--minibatch", type=int, default=3)
    p.add_argument("--per-step", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--reflect-tokens", type=int, default=96)
    p.add_argument("--reflect-temperature", type=float, default=0.7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench-harness")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--compare", choices=("package", "flash"), default="package",
                   help="package: the PyPI gepa package; flash: flash_evolve (asynchronous)")
    p.add_argument("--reflect-source", choices=("local", "policy"), default="local",
                   help="--compare flash: the reflection model, a second copy or the policy")
    p.add_argument("--reflect-workers", type=int, default=2, help="--compare flash")
    p.add_argument("--staleness", default="update", help="--compare flash: update|discard|patch")
    args = p.parse_args(argv)
    random.seed(args.seed)
    if args.compare == "flash":
        return compare_flash(args)

    t0 = time.perf_counter()
    run = build(args, Path(args.out))
    print(f"model {args.model} loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    import rlmix_gepa

    seed = {"instructions": SEED_INSTRUCTIONS}
    ours = run_rlmix(run)
    print(f"rlmix gepa: {ours['calls']} calls, {ours['seconds']:.0f} s, best {ours['best']}",
          flush=True)
    tasks = run.state["gepa"]["tasks"]
    theirs = run_package(run, seed, tasks["search"], tasks["selection"], args)
    print(f"gepa package: {theirs['calls']} calls, {theirs['seconds']:.0f} s, best "
          f"{theirs['best']}", flush=True)
    heldout = tasks["heldout"]
    seed_acc = heldout_accuracy(run, seed, heldout)
    ours_acc = heldout_accuracy(run, ours["best"], heldout)
    theirs_acc = heldout_accuracy(run, theirs["best"], heldout)
    del rlmix_gepa
    rows = [("seed (no search)", seed_acc, 0, "-"),
            ("gepa 0.1.4 (PyPI)", theirs_acc, theirs["calls"], f"{theirs['seconds']:.0f}"),
            ("rlmix gepa", ours_acc, ours["calls"], f"{ours['seconds']:.0f}")]
    print(f"\nheld-out accuracy on {len(heldout)} tasks never searched on; budget "
          f"{args.budget} metric calls; model {args.model} (task and reflection)\n")
    print("| optimizer | held-out accuracy | gain | metric calls | search time (s) |")
    print("| --- | --- | --- | --- | --- |")
    for name, acc, calls, secs in rows:
        print(f"| {name} | {acc:.3f} | {acc - seed_acc:+.3f} | {calls} | {secs} |")
    print(f"\nbest instructions, package: {theirs['best']['instructions']!r}")
    print(f"best instructions, rlmix:   {ours['best']['instructions']!r}")
    print(f"rlmix: {ours['iterations']} iterations, {ours['accepted']} accepted, "
          f"{ours['candidates']} candidates; package: {theirs['candidates']} candidates "
          f"(it reports {theirs['reported_calls']} metric calls)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "seed_heldout": seed_acc, "rlmix": {**ours, "heldout": ours_acc},
            "package": {**theirs, "heldout": theirs_acc}}, indent=1, default=str))
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


# ---------------------------------------------------------------- --compare flash

SEARCH_KEYS = ("budget", "search_size", "selection_size", "heldout_size", "minibatch_size",
               "max_new_tokens", "seed")


def build_flash(args: argparse.Namespace, out: Path) -> Any:
    """One run holding both plugins with the same search settings and reflection model."""
    from rlmix import loop, manifest

    values = {"budget": args.budget, "search_size": args.search,
              "selection_size": args.selection, "heldout_size": args.heldout,
              "minibatch_size": args.minibatch, "max_new_tokens": args.max_new_tokens,
              "seed": args.seed}
    lm = [f"lm.source={args.reflect_source}", f"lm.max_new_tokens={args.reflect_tokens}",
          f"lm.temperature={args.reflect_temperature}"]
    if args.reflect_source == "local":
        lm.append(f"lm.model={args.model}")
    over = [f"model={args.model}", "plugins=[hf,arith,grpo,gepa,flash_evolve]", f"out={out}",
            "log.progress=false", f"harness.instructions={SEED_INSTRUCTIONS}",
            f"train.prompts_per_step={args.per_step}", f"policy.threads={args.threads}",
            f"flash_evolve.staleness={args.staleness}",
            f"flash_evolve.reflect_workers={args.reflect_workers}",
            "flash_evolve.proposals_per_step=0"]
    for name in ("gepa", "flash_evolve"):
        over += [f"{name}.{k}={values[k]}" for k in SEARCH_KEYS]
        over += [f"{name}.{x}" for x in lm]
        over += [f"{name}.components=[instructions]", f"{name}.metric=arith.correct",
                 f"{name}.merge=true", f"{name}.max_merges=5"]
    cfg = manifest.read(MANIFEST, over)
    del cfg["gates"]
    run = loop.build_run(cfg)
    if args.reflect_source == "local":  # one reflection copy, shared: the same model for both
        run.resources["flash_evolve.lm"] = run.resources["gepa.lm"] = \
            run.resources[f"rlmix_lm.local:{args.model}"]
    return run


def _mutations(state: dict[str, Any]) -> int:
    return sum(1 for h in state["history"] if h["kind"] == "mutation")


def run_flash(run: Any) -> dict[str, Any]:
    import rlmix_flash_evolve

    t0 = time.perf_counter()
    rlmix_flash_evolve.evolve(run, 0)  # the seed, then the whole budget
    seconds = time.perf_counter() - t0
    rlmix_flash_evolve.close(run)
    state = run.state["flash_evolve"]
    best = state["applied"]
    for h in state["history"]:
        print(f"  flash {h['kind']} {h.get('index', '')}: parent {h.get('parent')}, pool "
              f"v{h.get('version', '-')}->v{h.get('pool_version', '-')} "
              f"({h.get('staleness', '-')}), accepted {h.get('accepted')}, "
              f"{h['metric_calls']} calls, proposal {str(h.get('proposal', ''))[:60]!r}")
    return {"best": dict(state["candidates"][best]), "calls": state["metric_calls"],
            "seconds": seconds, "proposals": _mutations(state),
            "selection": sum(state["scores"][best]) / len(state["scores"][best]),
            "seed_selection": sum(state["scores"][0]) / len(state["scores"][0]),
            "candidates": len(state["candidates"]), "stale": dict(state["stale"]),
            "accepted": sum(1 for h in state["history"] if h.get("accepted"))}


def compare_flash(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    run = build_flash(args, Path(args.out))
    print(f"model {args.model} loaded (task model + {args.reflect_source} reflection) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    seed = {"instructions": SEED_INSTRUCTIONS}
    sync = run_rlmix(run)  # rlmix_gepa.iterate until no iteration fits
    g = run.state["gepa"]
    best = g["applied"]
    sync.update(proposals=_mutations(g), selection=sum(g["scores"][best]) / len(g["scores"][best]),
                seed_selection=sum(g["scores"][0]) / len(g["scores"][0]))
    print(f"sync gepa: {sync['proposals']} proposals, {sync['calls']} calls, "
          f"{sync['seconds']:.0f} s", flush=True)
    run.harness.clear()
    run.harness.update({**dict(run.config.harness), **seed})  # flash starts from the seed too
    flash = run_flash(run)
    print(f"flash_evolve: {flash['proposals']} proposals, {flash['calls']} calls, "
          f"{flash['seconds']:.0f} s", flush=True)
    assert run.state["flash_evolve"]["tasks"] == g["tasks"], "the two searches' tasks differ"
    heldout = g["tasks"]["heldout"]
    accs = {name: heldout_accuracy(run, cand, heldout) if heldout else float("nan")
            for name, cand in (("seed", seed), ("sync", sync["best"]),
                               ("flash", flash["best"]))}
    print(f"\nsame budget ({args.budget} metric calls), tasks, task model {args.model}, "
          f"reflection {args.reflect_source} (max {args.reflect_tokens} tokens); "
          f"held-out: {len(heldout)} tasks never searched on\n")
    print("| optimizer | proposals | search time (s) | proposals/s | metric calls | "
          "best selection | held-out accuracy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| seed | - | - | - | - | {sync['seed_selection']:.3f} | {accs['seed']:.3f} |")
    for name, r, key in (("rlmix gepa (synchronous)", sync, "sync"),
                         (f"flash_evolve ({args.staleness}, {args.reflect_workers} reflectors)",
                          flash, "flash")):
        print(f"| {name} | {r['proposals']} | {r['seconds']:.0f} | "
              f"{r['proposals'] / r['seconds']:.3f} | {r['calls']} | {r['selection']:.3f} | "
              f"{accs[key]:.3f} |")
    ratio = (flash["proposals"] / flash["seconds"]) / (sync["proposals"] / sync["seconds"])
    print(f"\nthroughput ratio flash/sync: {ratio:.2f}; stale proposals {flash['stale']}")
    print(f"best instructions, sync:  {sync['best']['instructions']!r}")
    print(f"best instructions, flash: {flash['best']['instructions']!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "heldout": accs,
                                               "sync": sync, "flash": flash, "ratio": ratio},
                                              indent=1, default=str))
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
