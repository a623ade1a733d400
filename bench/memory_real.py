"""Memory and context plugins on the real model: case retrieval with bandit selection
(``cascade``) and trajectory reduction (``agent_diet``), each against its baseline.

    OMP_NUM_THREADS=1 python bench/memory_real.py --out runs/bench-memory.json
    python bench/memory_real.py --model tiny-random --steps 1 --tasks 2 --out /tmp/m.json  # smoke

* ``cascade``: the arithmetic stream of ``examples/harness/cascade-arith.yaml``, harness-only
  (the weights never change), three arms on the same prompts (arith is deterministic in the
  step): no memory, nearest-case retrieval (``cascade.select=nearest``) and LinUCB selection.
  Reported: the stream's ``arith.correct`` per step and its mean (all steps, and the second
  half, after the memory has cases).
* ``agent_diet``: the ``tools`` env (calculator and python) with the ``hf`` multi-turn engine,
  greedy, ``--tasks`` tasks, with and without the plugin. Reported: the env tokens inserted
  (raw and kept), the tokens of the whole rows, the tool calls, accuracy and wall time.

Each arm is one ordinary run (``rlmix.loop.build_run``); results go to ``--out`` (JSON) and a
table is printed. The machine may be shared: wall times are indicative only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASCADE = ROOT / "examples" / "harness" / "cascade-arith.yaml"
DIET = ROOT / "examples" / "harness" / "agent_diet-tools.yaml"


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [r for r in (json.loads(x) for x in path.read_text().splitlines())
            if "reward/mean" in r]


def cascade_arm(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from rlmix import loop, manifest

    out = root / f"cascade-{name}"
    shutil.rmtree(out, ignore_errors=True)
    over = [f"model={args.model}", f"out={out}", "log.progress=false", "log.plot=false",
            f"train.steps={args.steps}", "train.eval_every=0", "train.checkpoint_every=0",
            "arith.eval_size=0", f"sampling.max_new_tokens={args.max_new_tokens}",
            f"policy.threads={args.threads}"]
    cfg = manifest.read(CASCADE, over)
    if name == "none":
        cfg = OmegaConf.merge(cfg, manifest.read(None, ["plugins=[hf,arith]"]))
        del cfg["cascade"]
    else:
        cfg = OmegaConf.merge(cfg, manifest.read(None, [f"cascade.select={name}"]))
    t0 = time.perf_counter()
    run = loop.build_run(cfg)
    loop.train(run)
    acc = [float(r.get("reward/arith.correct", 0.0)) for r in rows_of(out / "metrics.jsonl")]
    half = acc[len(acc) // 2:]
    return {"per_step": acc, "mean": sum(acc) / max(1, len(acc)),
            "second_half": sum(half) / max(1, len(half)), "wall_s": time.perf_counter() - t0,
            "cases": len(run.state.get("cascade", {}).get("cases", []))}


def diet_arm(with_plugin: bool, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import torch
    from omegaconf import OmegaConf

    from rlmix import loop, manifest

    out = root / f"diet-{'on' if with_plugin else 'off'}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = manifest.read(DIET, [
        f"model={args.model}", f"out={out}", "log.progress=false", "log.plot=false",
        "train.mode=harness-only", f"train.prompts_per_step={args.tasks}",
        "tools.eval_size=0", f"hf.max_turns={args.max_turns}", f"policy.threads={args.threads}"])
    plugins = "[hf,tools,agent_diet]" if with_plugin else "[hf,tools]"
    cfg = OmegaConf.merge(cfg, manifest.read(None, [f"plugins={plugins}"]))
    if not with_plugin:
        del cfg["agent_diet"]
    run = loop.build_run(cfg)
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    t0 = time.perf_counter()
    with torch.no_grad():
        batch = run.generate(prompts, temperature=0.0, max_new_tokens=args.episode_tokens)
    wall = time.perf_counter() - t0
    loop.score(run, batch)
    episodes = [i["episode"] for i in batch.info]
    calls = sum(sum("tool" in (t.get("info") or {}) for t in e["turns"]) for e in episodes)
    raw = sum(sum(((t.get("info") or {}).get("agent_diet") or {}).get("raw", 0)
                  for t in e["turns"]) for e in episodes)
    return {"wall_s": wall, "row_tokens": int(batch.attention_mask.sum()),
            "env_tokens": sum(int(e["env_tokens"]) for e in episodes),
            "model_tokens": sum(int(e["model_tokens"]) for e in episodes),
            "env_content_tokens_raw": raw, "tool_calls": calls,
            "accuracy": float(batch.reward_terms["tools.correct"].mean()),
            "turns": sum(len(e["turns"]) for e in episodes)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--parts", default="cascade,agent_diet")
    p.add_argument("--steps", type=int, default=8, help="cascade: stream steps (4 prompts each)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--tasks", type=int, default=6, help="agent_diet: tools tasks")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--episode-tokens", type=int, default=160)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--root", default="runs/bench-memory")
    p.add_argument("--out", default="runs/bench-memory.json")
    args = p.parse_args(argv)
    root = Path(args.root)
    results: dict[str, Any] = {"model": args.model}
    parts = args.parts.split(",")
    if "cascade" in parts:
        results["cascade"] = {name: cascade_arm(name, args, root)
                              for name in ("none", "nearest", "linucb")}
    if "agent_diet" in parts:
        results["agent_diet"] = {"off": diet_arm(False, args, root),
                                 "on": diet_arm(True, args, root)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    for name, r in results.get("cascade", {}).items():
        print(f"cascade {name:8s} stream accuracy {r['mean']:.3f} (second half "
              f"{r['second_half']:.3f}) per step {r['per_step']} cases {r['cases']} "
              f"{r['wall_s']:.0f} s")
    for name, r in results.get("agent_diet", {}).items():
        print(f"agent_diet {name:3s} env tokens {r['env_tokens']} (content raw "
              f"{r['env_content_tokens_raw']}) row tokens {r['row_tokens']} model tokens "
              f"{r['model_tokens']} tool calls {r['tool_calls']} turns {r['turns']} accuracy "
              f"{r['accuracy']:.2f} wall {r['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
