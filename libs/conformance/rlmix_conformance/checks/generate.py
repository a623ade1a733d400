"""Checks of ``rlmix_generate``: the batch, behaviour log-probs, greedy and seeded decoding."""

from __future__ import annotations

import torch

from rlmix.types import GenerationRequest, Prompt, RolloutBatch, Run
from rlmix_conformance.batches import _batch_problems, _same
from rlmix_conformance.kit import ConformanceFailure, Subject, check


def _generate(run: Run, prompts: list[Prompt], n: int, temperature: float,
              max_new_tokens: int = 5) -> RolloutBatch:
    request = GenerationRequest(prompts=prompts, n=n, temperature=temperature,
                                max_new_tokens=max_new_tokens)
    with torch.no_grad():
        batch = run.hook.rlmix_generate(run=run, request=request)
    if batch is None:
        raise ConformanceFailure("rlmix_generate returned None")
    return batch


@check("rlmix_generate", "batch", owner_only=True)
def _generate_batch(s: Subject) -> None:
    """A well-formed batch: n rows per prompt, prompt-major, at most max_new_tokens completion
    tokens, the run's policy_version, behaviour log-probs <= 0 on completions and 0 elsewhere."""
    run = s.shared()
    prompts = run.hook.rlmix_prompts(run=run, step=0)[:2]
    n, limit = 3, 5
    batch = _generate(run, prompts, n, 1.0, limit)
    problems = _batch_problems(batch, "rlmix_generate")
    if problems:
        raise ConformanceFailure("; ".join(problems))
    expected = len(prompts) * n
    if len(batch) != expected:
        raise ConformanceFailure(f"rlmix_generate returned {len(batch)} rows for "
                                 f"{len(prompts)} prompts x n={n}; expected {expected}")
    want = torch.arange(len(prompts)).repeat_interleave(n)
    if not torch.equal(batch.group.cpu().long(), want):
        raise ConformanceFailure(f"rlmix_generate returned group {batch.group.tolist()}; expected "
                                 f"{want.tolist()} (the prompt index, rows prompt-major)")
    for i, p in enumerate(batch.prompts):
        if p is not prompts[i // n] and p != prompts[i // n]:
            raise ConformanceFailure(f"rlmix_generate row {i} carries prompt {p!r}; expected "
                                     f"request.prompts[{i // n}] (rows are prompt-major)")
    lengths = batch.completion_mask.sum(-1)
    if (lengths > limit).any():
        row = int((lengths > limit).nonzero()[0])
        raise ConformanceFailure(f"rlmix_generate row {row} has {int(lengths[row])} completion "
                                 f"tokens; request.max_new_tokens is {limit}")
    if (batch.policy_version != run.policy_version).any():
        raise ConformanceFailure(f"rlmix_generate returned policy_version "
                                 f"{batch.policy_version.tolist()}; expected run.policy_version "
                                 f"({run.policy_version}) on every row")


@check("rlmix_generate", "behavior_logp", owner_only=True)
def _generate_logp(s: Subject) -> None:
    """behavior_logp equals the policy's log-probs of the sampled tokens (temperature applied)."""
    for temperature in (1.0, 0.7):
        run = s.run([f"sampling.temperature={temperature}"])
        prompts = run.hook.rlmix_prompts(run=run, step=0)[:2]
        batch = _generate(run, prompts, 2, temperature, 6)
        assert run.policy is not None
        with torch.no_grad():
            logp, _ = run.policy.logprobs(run, batch)
        cmask = batch.completion_mask > 0
        if not cmask.any():
            continue
        diff = (logp.float().cpu() - batch.behavior_logp.float().cpu()).abs() * cmask
        if float(diff.max()) > 2e-2:
            row, col = (int(i) for i in (diff == diff.max()).nonzero()[0])
            raise ConformanceFailure(f"rlmix_generate's behavior_logp differs from the policy's "
                                     f"log-prob of the sampled token by {float(diff.max()):.3g} "
                                     f"at temperature {temperature} (row {row}, column {col}); "
                                     f"record log_softmax(logits / temperature) of each sampled "
                                     f"token")


@check("rlmix_generate", "determinism", owner_only=True)
def _generate_greedy(s: Subject) -> None:
    """Greedy generation (temperature 0) gives the same tokens twice."""
    run = s.shared()
    prompts = run.hook.rlmix_prompts(run=run, step=0)[:2]
    a = _generate(run, prompts, 1, 0.0, 5).tokens
    b = _generate(run, prompts, 1, 0.0, 5).tokens
    if _same(a, b):
        raise ConformanceFailure("rlmix_generate at temperature 0 (greedy) gave different "
                                 "tokens for the same prompts; temperature 0 means argmax")


@check("rlmix_generate", "seeded", level="full", owner_only=True)
def _generate_seeded(s: Subject) -> None:
    """Two fresh runs with the same seed sample the same tokens at temperature 1."""
    tokens = []
    for _ in range(2):
        run = s.run()
        prompts = run.hook.rlmix_prompts(run=run, step=0)[:2]
        tokens.append(_generate(run, prompts, 2, 1.0, 5).tokens)
    if _same(tokens[0], tokens[1]):
        raise ConformanceFailure("rlmix_generate is not deterministic under train.seed: two "
                                 "fresh runs sample different tokens; sample with torch's "
                                 "global generator (seeded by the core) or one seeded from "
                                 "run.config.train.seed")
