"""Checks of ``rlmix_sample``: a well-formed batch, seeded determinism."""

from __future__ import annotations

import torch

from rlmix import loop
from rlmix_conformance.batches import _batch_problems, _same
from rlmix_conformance.kit import ConformanceFailure, Subject, check


@check("rlmix_sample", "batch")
def _sample_batch(s: Subject) -> None:
    """run.sample(prompts) returns a well-formed RolloutBatch (len(prompts) * group_size rows
    for an owner) that the core can score."""
    run = s.shared()
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    with torch.no_grad():
        batch = run.sample(prompts)
    problems = _batch_problems(batch, "rlmix_sample")
    if problems:
        raise ConformanceFailure("; ".join(problems))
    expected = len(prompts) * int(run.config.train.group_size)
    if s.owns("rlmix_sample") and len(batch) != expected:
        raise ConformanceFailure(f"rlmix_sample returned {len(batch)} rows for {len(prompts)} "
                                 f"prompts; expected {expected} = len(prompts) * "
                                 f"train.group_size")
    if len(batch) == 0:
        raise ConformanceFailure("rlmix_sample returned an empty batch")
    loop.score(run, batch)


@check("rlmix_sample", "determinism", level="full")
def _sample_determinism(s: Subject) -> None:
    """Two fresh runs with the same seed sample the same tokens."""
    tokens = []
    for _ in range(2):
        run = s.run()
        prompts = run.hook.rlmix_prompts(run=run, step=0)
        with torch.no_grad():
            tokens.append(run.sample(prompts).tokens)
    if _same(tokens[0], tokens[1]):
        raise ConformanceFailure("rlmix_sample is not deterministic: two fresh runs with "
                                 "train.seed=0 sample different tokens")
