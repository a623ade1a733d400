"""DAPO clip-higher: the PPO clipped surrogate with decoupled bounds, ratio clipped to
``[1 - eps_low, 1 + eps_high]``, ``eps_high >= eps_low``.

Raising the upper bound lets low-probability tokens with a positive advantage grow further,
against entropy collapse. Owns ``rlmix_clip``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, Run

NAME = "dapo.clip_higher"
OLD_LOGP = ops.OLD_LOGP_CHOICES
old_logprobs = ops.old_logprobs  # grpo's rule, shared in rlmix.ops


@dataclass
class Settings:
    eps_low: float = rlmix.setting(0.2, ge=0, lt=1)  # ratio clipped below at 1 - eps_low
    eps_high: float = 0.28  # ratio clipped above at 1 + eps_high (>= eps_low)
    loss_mode: str = "seq-mean-token-mean"  # dapo.token_loss switches it to token-mean
    old_logp: str = "auto"  # what the ratio divides by: auto | behavior | detached

    def __post_init__(self) -> None:
        rlmix.check_choices(self, loss_mode=LOSS_MODES, old_logp=OLD_LOGP)
        rlmix.check_ranges(self)
        if self.eps_high < self.eps_low:
            raise ValueError(f"eps_high ({self.eps_high}) must be >= eps_low ({self.eps_low}): "
                             f"clip-higher raises the upper bound")


def decoupled_clip_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                             eps_low: float, eps_high: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, ``r = exp(logp - old)``.

    Also returns where the clipped branch was taken at the lower bound (``r < 1 - eps_low``,
    ``A < 0``) and at the upper bound (``r > 1 + eps_high``, ``A > 0``)."""
    ratio = torch.exp(logp - old_logp)
    loss, taken = ops.clip_ratio(ratio, advantages, 1.0 - eps_low, 1.0 + eps_high)
    return loss, taken & (ratio < 1.0 - eps_low), taken & (ratio > 1.0 + eps_high)


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor) -> LossTerms:
    s = run.settings(NAME)
    batch = mb.batch
    mask = batch.completion_mask.to(logp.device)
    old = old_logprobs(run, batch, logp, s.old_logp)
    adv = batch.token_advantages().to(logp.device)
    loss, low, high = decoupled_clip_surrogate(logp, old, adv, s.eps_low, s.eps_high)
    metrics = {
        "clip/fraction": float(ops.masked_mean((low | high).float(), mask)),
        "clip/low_fraction": float(ops.masked_mean(low.float(), mask)),
        "clip/high_fraction": float(ops.masked_mean(high.float(), mask)),
        "entropy": float(ops.masked_mean(entropy.detach(), mask)),
        "mismatch/behavior_kl": float(ops.masked_mean(batch.behavior_logp.to(logp.device)
                                                      - logp.detach(), mask)),
    }
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode, metrics=metrics)
