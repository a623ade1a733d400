"""GRPO: group-normalised advantages and the PPO clipped surrogate, with optional KL to a frozen
reference (k1, k2 or k3 estimator)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, RolloutBatch, Run

SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
OLD_LOGP = ("auto", "behavior", "detached")


@dataclass
class Settings:
    scale: str = "group"  # divide by the group's std | the batch's std | nothing
    eps: float = 1e-6  # added to the std before dividing
    eps_low: float = 0.2  # ratio clipped below at 1 - eps_low
    eps_high: float = 0.2  # ratio clipped above at 1 + eps_high
    beta: float = 0.0  # KL coefficient; 0 = no reference model
    kl_estimator: str = "k3"
    loss_mode: str = "seq-mean-token-mean"
    old_logp: str = "auto"  # what the ratio divides by (see README)

    def __post_init__(self) -> None:
        for name, value, choices in (("scale", self.scale, SCALES),
                                     ("kl_estimator", self.kl_estimator, KL_ESTIMATORS),
                                     ("loss_mode", self.loss_mode, LOSS_MODES),
                                     ("old_logp", self.old_logp, OLD_LOGP)):
            if value not in choices:
                raise ValueError(f"{name}: {value!r} is not allowed; choose one of "
                                 f"{', '.join(choices)}")
        if self.eps_low < 0 or self.eps_high < 0 or self.eps_low >= 1:
            raise ValueError("eps_low must be in [0, 1) and eps_high >= 0")
        if self.beta < 0:
            raise ValueError("beta must be >= 0")


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


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` with
    ``r = exp(logp - old_logp)``; also returns where the clipped branch was taken."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"kl_estimator: {estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings("grpo")
    if s.beta > 0 and run.policy is not None:
        reference = copy.deepcopy(run.policy.model).eval()
        for p in reference.parameters():
            p.requires_grad_(False)
        # rebuilt from the initial weights on every start, so it is not checkpoint state
        run.resources["grpo.reference"] = reference


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
    single_update = int(run.config.train.epochs) * int(run.config.train.updates_per_epoch) == 1
    # the current weights are the sampler's only when every sample is of this policy version
    fresh = bool((batch.policy_version == run.policy_version).all())
    use_detached = s.old_logp == "detached" or (s.old_logp == "auto" and single_update and fresh)
    behavior = batch.behavior_logp.to(logp.device)
    old = logp.detach() if use_detached else behavior
    adv = batch.token_advantages().to(logp.device)
    loss, clipped = clipped_surrogate(logp, old, adv, s.eps_low, s.eps_high)
    metrics = {
        "clip/fraction": float(ops.masked_mean(clipped.float(), mask)),
        "entropy": float(ops.masked_mean(entropy.detach(), mask)),
        "mismatch/behavior_kl": float(ops.masked_mean(behavior - logp.detach(), mask)),
    }
    if s.beta > 0:
        reference = run.resources.get("grpo.reference")
        if reference is None:
            raise RuntimeError("grpo: beta > 0 but no reference model (rlmix_configure not run)")
        with torch.no_grad():
            ref_logp, _ = run.policy.logprobs(run, batch, model=reference)
        kl = kl_estimate(logp, ref_logp.to(logp.device), s.kl_estimator)
        loss = loss + s.beta * kl
        metrics["kl"] = float(ops.masked_mean(kl.detach(), mask))
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode, metrics=metrics)
