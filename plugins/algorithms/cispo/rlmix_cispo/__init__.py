"""CISPO: the REINFORCE loss weighted by a clipped, detached importance-sampling ratio, so no
token's gradient is ever dropped (MiniMax-M1). Owns ``rlmix_clip``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, Run

NAME = "cispo"
OLD_LOGP = ops.OLD_LOGP_CHOICES
old_logprobs = ops.old_logprobs  # grpo's rule, shared in rlmix.ops


@dataclass
class Settings:
    # weight clipped below at 1 - eps_low; >= 1 means no lower bound
    eps_low: float = rlmix.setting(1.0, ge=0)
    # weight clipped above at 1 + eps_high (TRL's epsilon_high = 1 + this)
    eps_high: float = rlmix.setting(4.0, ge=0)
    loss_mode: str = "token-mean"
    old_logp: str = "auto"  # what the ratio divides by: auto | behavior | detached

    def __post_init__(self) -> None:
        rlmix.check_choices(self, loss_mode=LOSS_MODES, old_logp=OLD_LOGP)
        rlmix.check_ranges(self)


def is_weight(logp: torch.Tensor, old_logp: torch.Tensor, eps_low: float, eps_high: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The detached weight ``clip(r, 1 - eps_low, 1 + eps_high)``, ``r = exp(logp - old)``
    (no lower bound when ``eps_low >= 1``), and where it was clipped."""
    ratio = torch.exp(logp.detach() - old_logp)
    low, high = 1.0 - eps_low, 1.0 + eps_high
    weight = ratio.clamp(min=low, max=high) if low > 0 else ratio.clamp(max=high)
    return weight, ops.outside_band(ratio, low, high)


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
               eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp``; also returns where the
    weight was clipped. The gradient is ``-w A`` on every token: clipping bounds the weight, it
    never zeroes the gradient (PPO's clipped branch has none)."""
    weight, clipped = is_weight(logp, old_logp, eps_low, eps_high)
    return -weight * advantages * logp, clipped


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor) -> LossTerms:
    s = run.settings(NAME)
    batch = mb.batch
    mask = batch.completion_mask.to(logp.device)
    old = old_logprobs(run, batch, logp, s.old_logp)
    adv = batch.token_advantages().to(logp.device)
    loss, clipped = cispo_loss(logp, old, adv, s.eps_low, s.eps_high)
    weight, _ = is_weight(logp, old, s.eps_low, s.eps_high)
    metrics = {
        "clip/fraction": float(ops.masked_mean(clipped.float(), mask)),
        "cispo/weight_mean": float(ops.masked_mean(weight, mask)),
        "entropy": float(ops.masked_mean(entropy.detach(), mask)),
        "mismatch/behavior_kl": float(ops.masked_mean(batch.behavior_logp.to(logp.device)
                                                      - logp.detach(), mask)),
    }
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode, metrics=metrics)
