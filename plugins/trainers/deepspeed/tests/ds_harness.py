"""Runs a few rlmix steps on tiny-random with the core's default update or with DeepSpeed, and
writes every step's loss and gradient norm and the final weights. Launched by the tests, alone
or under ``python -m torch.distributed.run --nproc_per_node 2``:

    python ds_harness.py OUT_DIR --trainer default|deepspeed --stages 1,2,3 [--steps 5]

The stand-in rollout draws each prompt's completions from a generator seeded by the prompt's id,
so the batch does not depend on how prompts are split across ranks (the tests compare one
process with two). The loss has a term whose value depends on the current weights, so the loss
curve follows the updates.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

import rlmix
from rlmix import loop, manifest, ops
from rlmix.types import GenerationRequest, LossTerms, Minibatch, Prompt, RolloutBatch, Run

ALPHABET = "0123456789abcdef"


class Env:
    @rlmix.hookimpl
    def rlmix_prompts(self, run: Run, step: int) -> list[Prompt]:
        rng = random.Random(f"env-{step}")
        return [Prompt(messages=[{"role": "user", "content": "x" * rng.randint(3, 9)}],
                       id=f"p-{step}-{i}") for i in range(int(run.config.train.prompts_per_step))]

    @rlmix.hookimpl
    def rlmix_score(self, run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        even = ((batch.tokens % 2) == 0).float()
        return {"even": ops.masked_mean(even, batch.completion_mask.float(), dim=-1)}


class Rollout:
    """Completions drawn per prompt (seeded by its id), behaviour log-probs from the policy."""

    @rlmix.hookimpl
    def rlmix_generate(self, run: Run, request: GenerationRequest) -> RolloutBatch:
        assert run.policy is not None
        tok = run.policy.tokenizer
        texts = [run.policy.chat_text(p.messages) for p in request.prompts]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        ids = enc["input_ids"].repeat_interleave(request.n, 0)
        attn = enc["attention_mask"].repeat_interleave(request.n, 0)
        width = int(request.max_new_tokens)
        alphabet = torch.tensor([tok(c, add_special_tokens=False)["input_ids"][0]
                                 for c in ALPHABET])
        rows, masks = [], []
        for p in request.prompts:
            gen = torch.Generator().manual_seed(random.Random(p.id).getrandbits(62))
            rows.append(alphabet[torch.randint(0, len(alphabet), (request.n, width),
                                               generator=gen)])
            lengths = torch.randint(1, width + 1, (request.n,), generator=gen)
            masks.append((torch.arange(width)[None] < lengths[:, None]).float())
        completion, cmask = torch.cat(rows), torch.cat(masks)
        completion = torch.where(cmask > 0, completion, tok.pad_token_id)
        n_rows, p_width = ids.shape
        batch = RolloutBatch(
            group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
            tokens=torch.cat([ids, completion], 1),
            attention_mask=torch.cat([attn, cmask.long()], 1),
            completion_mask=torch.cat([torch.zeros(n_rows, p_width), cmask], 1),
            behavior_logp=torch.zeros(n_rows, p_width + width),
            policy_version=torch.full((n_rows,), run.policy_version, dtype=torch.long),
            texts=[""] * n_rows, prompts=[p for p in request.prompts for _ in range(request.n)])
        with torch.no_grad():
            logp, _ = run.policy.logprobs(run, batch)
        batch.behavior_logp = logp.float().cpu() * batch.completion_mask
        return batch


class Algo:
    @rlmix.hookimpl
    def rlmix_advantage(self, run: Run, batch: RolloutBatch) -> torch.Tensor:
        assert batch.rewards is not None
        return batch.rewards - ops.group_mean(batch.rewards, batch.group)

    @rlmix.hookimpl
    def rlmix_clip(self, run: Run, mb: Minibatch, logp: torch.Tensor,
                   entropy: torch.Tensor) -> LossTerms:
        adv = mb.batch.token_advantages().to(logp.dtype)
        behavior = mb.batch.behavior_logp.to(logp.dtype)
        # policy gradient plus a likelihood term whose value moves with the weights
        loss = -adv * torch.exp(logp - behavior) - 0.1 * logp
        return LossTerms(loss=loss, mask=mb.batch.completion_mask.to(logp.dtype),
                         mode="token-mean")


class Poison:
    """Makes the loss NaN on the steps listed (0-based), to check that the step is skipped."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    @rlmix.hookimpl(wrapper=True)
    def rlmix_clip(self, run: Run, mb: Minibatch, logp: torch.Tensor,
                   entropy: torch.Tensor) -> Any:
        terms = yield
        if run.step in self.steps:
            terms.loss = terms.loss * float("nan")
        return terms


def build(trainer: str, stage: int, out: Path, steps: int, extra: list[str],
          poison: list[int] | None = None, resume: bool = False) -> Run:
    import rlmix_deepspeed

    plugins: dict[str, Any] = {"env": Env(), "rollout": Rollout(), "algo": Algo()}
    if poison:
        plugins["poison"] = Poison(poison)
    if trainer == "deepspeed":
        plugins["deepspeed"] = rlmix_deepspeed
    names = ",".join(plugins)
    cfg = manifest.read(None, [
        "model=tiny-random", f"plugins=[{names}]", f"out={out}", "log.progress=false",
        "log.plot=false", f"train.steps={steps}", "train.prompts_per_step=4",
        "train.group_size=4", "train.grad_accum=2", "train.lr=0.01", "train.eval_every=0",
        "train.checkpoint_every=0", "train.max_grad_norm=0", "sampling.max_new_tokens=6",
        "policy.threads=1", "policy.device=cpu",
        *([f"deepspeed.stage={stage}"] if trainer == "deepspeed" else []), *extra])
    # the CLI's path: configure, restore the checkpoint (with resume), prepare the model
    return loop.build_run(cfg, extra_plugins=plugins, resume=resume)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--trainer", choices=("default", "deepspeed"), default="deepspeed")
    parser.add_argument("--stages", default="2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], help="extra manifest override")
    parser.add_argument("--poison", default="", help="0-based steps whose loss is NaN")
    parser.add_argument("--resume-after", type=int, default=0,
                        help="after this many steps, drop the run and resume a new one from the "
                             "checkpoint (needs train.checkpoint_every to save there)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    results: dict[str, Any] = {}
    rank = 0
    for stage in [int(s) for s in args.stages.split(",")]:
        folder = out / f"{args.trainer}-stage{stage}"
        poison = [int(s) for s in args.poison.split(",") if s]
        run = build(args.trainer, stage, folder, args.steps, args.set, poison)
        losses, norms, rewards, sums = [], [], [], []
        for k in range(args.steps):
            if args.resume_after and k == args.resume_after:
                from rlmix import checkpoint

                del run  # as if the process had died after the checkpoint
                assert checkpoint.list_checkpoints(folder / "checkpoints"), "no checkpoint"
                run = build(args.trainer, stage, folder, args.steps, args.set, poison,
                            resume=True)
                assert run.step == args.resume_after
            metrics = loop.train_step(run)
            run.hook.rlmix_step_end(run=run, metrics=metrics)
            params = run.policy.model.parameters()
            sums.append(float(sum(p.detach().double().sum() for p in params)))
            losses.append(metrics["loss"])
            norms.append(metrics.get("update/grad_norm", float("nan")))
            rewards.append(metrics["reward/mean"])
        tr = run.plugin_resources("deepspeed").get("trainer")
        if tr is not None:
            import rlmix_deepspeed

            rank = tr.rank
            weights = rlmix_deepspeed.consolidated_state_dict(tr.engine)
        else:
            weights = {k: v.detach().clone() for k, v in run.policy.model.named_parameters()}
        if rank == 0:
            torch.save(weights, out / f"{args.trainer}-stage{stage}.pt")
        results[str(stage)] = {"loss": losses, "grad_norm": norms, "reward": rewards,
                               "weight_sum": sums,
                               "policy_version": run.policy_version,
                               "skipped": run.state.get("deepspeed", {}).get("skipped_steps", 0)}
    if rank == 0:
        (out / f"{args.trainer}.json").write_text(json.dumps(results, indent=1))
    print("harness done", file=sys.stderr)


if __name__ == "__main__":
    main()
