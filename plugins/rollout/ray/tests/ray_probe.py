"""Plugins the Ray tests list in the manifest; the workers import them by this module's name.

``probe_rollout`` answers ``rlmix_generate`` with cheap random completions and writes, in every
row's ``info``, the process and Ray actor it ran in and the sum of that process's policy
weights, so a test can see where the manifest's plugins ran and which weights they used."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops
from rlmix.types import GenerationRequest, Prompt, RolloutBatch, Run


@dataclass
class EnvSettings:
    count_file: str = ""  # each scorer call appends "<pid> <rows>" here (any process)


class ProbeEnv:
    Settings = EnvSettings

    @rlmix.hookimpl
    def rlmix_prompts(self, run: Run, step: int) -> list[Prompt]:
        return [Prompt(messages=[{"role": "user", "content": f"task {step}-{i}"}],
                       id=f"{step}-{i}") for i in range(int(run.config.train.prompts_per_step))]

    @rlmix.hookimpl
    def rlmix_score(self, run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        # the batch sizes this process scored
        run.plugin_resources("probe_env").setdefault("scored", []).append(len(batch))
        path = run.settings("probe_env").count_file
        if path:
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {len(batch)}\n")
        even = ((batch.tokens % 2) == 0).float()
        return {"even": ops.masked_mean(even, batch.completion_mask.float(), dim=-1)}


@dataclass
class Settings:
    delay_s: float = 0.0  # seconds each generate call sleeps (to kill a worker mid-call)


def where() -> dict[str, object]:
    try:
        import ray

        actor = ray.get_runtime_context().get_actor_id()
    except Exception:
        actor = None
    return {"pid": os.getpid(), "actor": actor}


class ProbeRollout:
    Settings = Settings

    @rlmix.hookimpl
    def rlmix_generate(self, run: Run, request: GenerationRequest) -> RolloutBatch:
        assert run.policy is not None
        time.sleep(run.settings("probe_rollout").delay_s)
        tok = run.policy.tokenizer
        texts = [run.policy.chat_text(p.messages) for p in request.prompts]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        ids = enc["input_ids"].repeat_interleave(request.n, 0)
        attn = enc["attention_mask"].repeat_interleave(request.n, 0)
        rows, width = ids.shape[0], int(request.max_new_tokens)
        completion = torch.randint(48, 58, (rows, width))
        cmask = torch.ones(rows, width)
        weight_sum = float(sum(p.detach().double().sum() for p in run.policy.model.parameters()))
        here = {**where(), "weight_sum": weight_sum, "version": run.policy_version}
        batch = RolloutBatch(
            group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
            tokens=torch.cat([ids, completion], 1),
            attention_mask=torch.cat([attn, cmask.long()], 1),
            completion_mask=torch.cat([torch.zeros(rows, ids.shape[1]), cmask], 1),
            behavior_logp=torch.zeros(rows, ids.shape[1] + width),
            policy_version=torch.full((rows,), run.policy_version, dtype=torch.long),
            texts=[""] * rows, prompts=[p for p in request.prompts for _ in range(request.n)],
            info=[dict(here) for _ in range(rows)])
        with torch.no_grad():
            logp, _ = run.policy.logprobs(run, batch)
        batch.behavior_logp = logp.float() * batch.completion_mask
        return batch
