"""A KL penalty toward a frozen copy of the initial policy, in the loss (a wrapper around any
``rlmix_clip`` owner) or in the reward (a scorer term), with Schulman's k1, k2 or k3 estimator."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix import ops
from rlmix.policy import frozen_copy
from rlmix.types import LossTerms, Minibatch, RolloutBatch, Run

NAME = "kl"
REFERENCE = "reference"  # key in run.plugin_resources("kl")
ESTIMATORS = ops.KL_ESTIMATORS
PLACEMENTS = ("loss", "reward")
POLICY_LOGP = ("recompute", "behavior")
kl_estimate = ops.kl_estimate  # shared with grpo and reinforce_pp
build_reference = frozen_copy


@dataclass
class Settings:
    beta: float = rlmix.setting(0.001, ge=0)  # KL coefficient
    estimator: str = "k3"  # k1 | k2 | k3
    placement: str = "loss"  # loss: beta * KL_t added to every token's loss; reward: a score term
    policy_logp: str = "recompute"  # reward placement: the sampled policy's log-probs (see README)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, estimator=ESTIMATORS,
                            placement=PLACEMENTS,
                            policy_logp=POLICY_LOGP)
        rlmix.check_ranges(self)


def sequence_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                     beta: float, estimator: str) -> torch.Tensor:
    """The reward term ``-beta * sum_t KL_t`` over each row's masked tokens, ``[N]``."""
    kl = kl_estimate(logp, ref_logp, estimator)
    kl = torch.where(mask > 0, kl, torch.zeros_like(kl))
    return -beta * (kl * mask).sum(-1)


def reference_logprobs(run: Run, batch: RolloutBatch) -> torch.Tensor:
    reference = run.plugin_resources("kl").get(REFERENCE)
    if reference is None or run.policy is None:
        raise RuntimeError("kl: no reference model (rlmix_configure has not run with a policy)")
    with torch.no_grad():
        ref_logp, _ = run.policy.logprobs(run, batch, model=reference)
    return ref_logp


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    # copied once, from the full model the run starts with (a resumed run restores its
    # checkpoint after configuring, and a trainer partitions the model later, in
    # rlmix_prepare_model), so the reference is the initial policy; never checkpointed
    own = run.plugin_resources("kl")
    if run.policy is not None and REFERENCE not in own:
        own[REFERENCE] = build_reference(run.policy.model)


@rlmix.hookimpl(wrapper=True)
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor,
               entropy: torch.Tensor) -> Generator[None, Any, LossTerms]:
    terms = yield
    s = run.settings(NAME)
    if terms is None or s.placement != "loss":
        return terms
    ref_logp = reference_logprobs(run, mb.batch).to(logp.device)
    kl = kl_estimate(logp, ref_logp, s.estimator)
    mask = terms.mask.to(device=kl.device, dtype=kl.dtype)
    kl = torch.where(mask > 0, kl, torch.zeros_like(kl))
    terms.loss = terms.loss + s.beta * kl
    terms.metrics["kl"] = float(ops.masked_mean(kl.detach(), mask))
    return terms


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor] | None:
    s = run.settings(NAME)
    if s.placement != "reward":
        return None
    ref_logp = reference_logprobs(run, batch)
    if s.policy_logp == "behavior":
        logp = batch.behavior_logp.to(ref_logp.device)
    else:
        with torch.no_grad():
            logp, _ = run.policy.logprobs(run, batch)  # type: ignore[union-attr]
    mask = batch.completion_mask.to(ref_logp.device)
    return {"penalty": sequence_penalty(logp, ref_logp, mask, s.beta, s.estimator).cpu()}
