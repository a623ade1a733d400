"""Does an env teach a real model? Held-out greedy accuracy before and after GRPO, per env.

For each env (``--envs``), from its example manifest (``examples/envs/<env>_smollm2.yaml``:
``math``, ``code_easy``, ``sql_easy``, ``tools``): build the run, evaluate the untrained model
on the env's held-out problems (greedy, the env's own ``rlmix_evaluate``), train with the
manifest until the wall-time budget (``--minutes``, default 15) or the manifest's
``train.steps`` runs out, evaluate again, and print the table row: env, task setting, before,
after, training steps and time (wall and CPU seconds; model loading and evaluation excluded),
manifest. ``--humaneval N`` also reports
HumanEval pass@1 on the first N held-out HumanEval problems before and after the code run.

    python bench/envs_learn.py                                  # math, code_easy, sql_easy, tools
    python bench/envs_learn.py --envs sql_easy --minutes 15
    python bench/envs_learn.py --envs code_easy --humaneval 41
    python bench/envs_learn.py --model tiny-random --steps 2 --eval-size 4   # plumbing only

Rows are written to ``<out>/<env>.json`` and the table to ``<out>/table.md``. Run it with one
torch thread per run on this 2-core machine (``OMP_NUM_THREADS=1``, ``policy.threads``) and
``nice``; the seeds are the manifests' (``train.seed`` 0), ``--seed`` changes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from _common import tiny_plumbing, train_for

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "envs"

#: env -> (manifest, plugin, the eval metric that is the accuracy)
ENVS: dict[str, tuple[Path, str, str]] = {
    "math": (EXAMPLES / "math_smollm2.yaml", "math", "eval/accuracy"),
    "code_easy": (EXAMPLES / "code_easy_smollm2.yaml", "code", "eval/pass@1"),
    "sql_easy": (EXAMPLES / "sql_easy_smollm2.yaml", "sql", "eval/accuracy"),
    "tools": (EXAMPLES / "tools_smollm2.yaml", "tools", "eval/accuracy"),
}


def setting(plugin: str, s: Any) -> str:
    """The task setting of a run, in words, from its validated settings."""
    if plugin == "math":
        levels = "+".join(f"{x}-step" for x in s.levels)
        return f"math.source={s.kind} ({levels}, operands <= {s.curriculum_max})" \
            if s.kind == "curriculum" else f"math.source={s.kind}"
    if plugin == "code":
        return f"code.data={s.data}"
    if plugin == "tools":
        return (f"tools.call_format={s.call_format}, demos={s.demos} "
                f"({s.digits}-digit {s.operators}, {s.steps} call)")
    return f"sql.difficulty={s.difficulty}"


def overrides(args: argparse.Namespace, env: str) -> list[str]:
    _, plugin, _ = ENVS[env]
    out = [f"model={args.model}", "train.eval_every=0", "train.checkpoint_every=0",
           "log.progress=false", "log.plot=false", f"out={args.out}/runs/{env}"]
    if args.seed is not None:
        out.append(f"train.seed={args.seed}")
    if args.steps:
        out.append(f"train.steps={args.steps}")
    if args.eval_size:
        out.append(f"{plugin}.eval_size={args.eval_size}")
    if args.model == "tiny-random":  # plumbing: short everything, no bf16
        out += tiny_plumbing(plugin, 8)
    return out + list(args.set)


def humaneval_pass_at_1(run: Any, size: int, max_new_tokens: int) -> float:
    """HumanEval pass@1 (greedy, the first ``size`` held-out problems) of ``run``'s policy: the
    code env's own evaluation with its settings switched to HumanEval for the call."""
    from rlmix import loop

    easy = run.settings_by_plugin["code"]
    run.settings_by_plugin["code"] = dataclasses.replace(
        easy, data="humaneval", worked_example="hide", eval_split="heldout", eval_size=size,
        heldout_fraction=0.25, split_seed=0, eval_max_new_tokens=max_new_tokens)
    try:
        return loop.evaluate(run)["eval/pass@1"]
    finally:
        run.settings_by_plugin["code"] = easy


def learn(args: argparse.Namespace, env: str) -> dict[str, Any]:
    """One env's row: evaluate, train within the budget, evaluate."""
    from rlmix import loop, manifest

    path, plugin, metric = ENVS[env]
    cfg = manifest.read(path, overrides(args, env))
    run = loop.build_run(cfg, overwrite=True)
    s = run.settings(plugin)
    t0 = time.perf_counter()
    before = loop.evaluate(run)
    eval_s = time.perf_counter() - t0
    human_before = (humaneval_pass_at_1(run, args.humaneval, args.humaneval_tokens)
                    if plugin == "code" and args.humaneval else None)
    budget = args.minutes * 60.0
    trained = train_for(run, budget, env, args.verbose)
    after = loop.evaluate(run)
    human_after = (humaneval_pass_at_1(run, args.humaneval, args.humaneval_tokens)
                   if plugin == "code" and args.humaneval else None)
    run.hook.rlmix_run_end(run=run)
    row = {"env": env, "setting": setting(plugin, s), "model": args.model,
           "metric": metric, "before": before.get(metric), "after": after.get(metric),
           "before_all": before, "after_all": after,
           **{k: v for k, v in trained.items() if k != "clock"},
           "eval_wall_s": round(eval_s, 1), "budget_s": budget,
           "manifest": str(path.relative_to(ROOT)), "overrides": overrides(args, env)}
    if human_before is not None:
        row["humaneval_pass@1"] = {"before": human_before, "after": human_after,
                                   "problems": args.humaneval}
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| env | task setting | before | after | training | manifest |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        extra = ""
        if "humaneval_pass@1" in r:
            h = r["humaneval_pass@1"]
            extra = f" (HumanEval pass@1 on {h['problems']}: {h['before']:.2f} -> {h['after']:.2f})"
        lines.append(f"| {r['env']} | {r['setting']} | {r['before']:.2f} | {r['after']:.2f}"
                     f"{extra} | {r['steps']} steps, {r['train_wall_s']:.0f} s wall, "
                     f"{r['train_cpu_s']:.0f} s CPU | `{r['manifest']}` |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envs", default="math,code_easy,sql_easy,tools",
                   help=f"comma-separated, from {', '.join(ENVS)}")
    p.add_argument("--minutes", type=float, default=15.0, help="training wall-time budget")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=0, help="at most this many steps (0 = the "
                   "manifest's train.steps)")
    p.add_argument("--eval-size", type=int, default=0, help="held-out problems (0 = the "
                   "manifest's)")
    p.add_argument("--seed", type=int, default=None, help="train.seed (default: the manifest's)")
    p.add_argument("--humaneval", type=int, default=0, help="code_easy: also HumanEval pass@1 "
                   "on this many held-out problems, before and after (0 = off)")
    p.add_argument("--humaneval-tokens", type=int, default=256)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a manifest override for every env (repeatable)")
    p.add_argument("--out", default="runs/envs_learn")
    p.add_argument("--verbose", action="store_true", help="a line per training step")
    args = p.parse_args(argv)
    unknown = [e for e in args.envs.split(",") if e not in ENVS]
    if unknown:
        p.error(f"unknown env(s) {', '.join(unknown)}; choose from {', '.join(ENVS)}")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for env in args.envs.split(","):
        row = learn(args, env)
        (out / f"{env}.json").write_text(json.dumps(row, indent=1))
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return rows


if __name__ == "__main__":
    main()
