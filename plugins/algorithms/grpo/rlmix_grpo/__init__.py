"""GRPO: group-normalised advantages and the PPO clipped surrogate, with optional KL to a frozen
reference (k1, k2 or k3 estimator)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops
from rlmix.policy import frozen_copy
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, RolloutBatch, Run

SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ops.KL_ESTIMATORS
OLD_LOGP = ops.OLD_LOGP_CHOICES
# the PPO surrogate and the KL estimators are shared math, kept in rlmix.ops
clipped_surrogate = ops.clipped_surrogate
kl_estimate = ops.kl_estimate


@dataclass
class Settings:
    scale: str = "group"  # divide by the group's std | the batch's std | nothing
    eps: float = rlmix.setting(1e-6, ge=0)  # added to the std before dividing
    eps_low: float = rlmix.setting(0.2, ge=0, lt=1)  # ratio clipped below at 1 - eps_low
    eps_high: float = rlmix.setting(0.2, ge=0)  # ratio clipped above at 1 + eps_high
    beta: float = rlmix.setting(0.0, ge=0)  # KL coefficient; 0 = no reference model
    kl_estimator: str = "k3"
    loss_mode: str = "seq-mean-token-mean"
    old_logp: str = "auto"  # what the ratio divides by (see README)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, scale=SCALES,
                            kl_estimator=KL_ESTIMATORS,
                            loss_mode=LOSS_MODES,
                            old_logp=OLD_LOGP)
        rlmix.check_ranges(self)


# owning rlmix_advantage, it compares the completions of a prompt: groups need >= 2
RLMIX_GROUP_RELATIVE = True


def group_normalized_advantage(rewards: torch.Tensor, group: torch.Tensor, scale: str = "group",
                               eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean_group(r)) / (std + eps)``, where std is the group's (``group``), the whole
    batch's (``batch``), or 1 (``none``). Unbiased std, as in the GRPO paper's implementation."""
    centered = rewards - ops.group_mean(rewards, group)
    if scale == "group":
        return centered / (ops.group_std(rewards, group) + eps)
    if scale == "batch":
        return centered / (rewards.std() + eps) if len(rewards) > 1 else centered
    if scale == "none":
        return centered
    raise ValueError(f"scale: {scale!r} is not one of {', '.join(SCALES)}")


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings("grpo")
    if s.beta > 0 and run.policy is not None:
        reference = frozen_copy(run.policy.model)
        # rebuilt from the initial, full weights on every start (before a resume restores the
        # checkpoint and before rlmix_prepare_model), so it is not checkpoint state
        run.plugin_resources("grpo")["reference"] = reference


@rlmix.hookimpl
def rlmix_advantage(run: Run, batch: RolloutBatch) -> torch.Tensor:
    s = run.settings("grpo")
    assert batch.rewards is not None
    return group_normalized_advantage(batch.rewards, batch.group, s.scale, s.eps)


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor) -> LossTerms:
    s = run.settings("grpo")
    batch = mb.batch
    mask = batch.completion_mask.to(logp.device)
    behavior = batch.behavior_logp.to(logp.device)
    old = ops.old_logprobs(run, batch, logp, s.old_logp)
    adv = batch.token_advantages().to(logp.device)
    loss, clipped = clipped_surrogate(logp, old, adv, s.eps_low, s.eps_high)
    metrics = {
        "clip/fraction": float(ops.masked_mean(clipped.float(), mask)),
        "entropy": float(ops.masked_mean(entropy.detach(), mask)),
        "mismatch/behavior_kl": float(ops.masked_mean(behavior - logp.detach(), mask)),
    }
    if s.beta > 0:
        reference = run.plugin_resources("grpo").get("reference")
        if reference is None:
            raise RuntimeError("grpo: beta > 0 but no reference model (rlmix_configure not run)")
        with torch.no_grad():
            ref_logp, _ = run.policy.logprobs(run, batch, model=reference)
        kl = kl_estimate(logp, ref_logp.to(logp.device), s.kl_estimator)
        loss = loss + s.beta * kl
        metrics["kl"] = float(ops.masked_mean(kl.detach(), mask))
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode, metrics=metrics)
