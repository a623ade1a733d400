"""AEPO, its update side (Entropy-Balanced Policy Optimization): the PPO clipped surrogate, except
that high-entropy tokens (entropy at or above the ``quantile`` of the minibatch's loss tokens)
whose ratio is clipped keep a gradient, rescaled through a stop-gradient
(``-sg(clip(r)) * r / sg(r) * A``: the clipped value, the gradient of ``clip(r) * A``), and an
entropy-aware advantage on those tokens, ``A * (1 + alpha * H / max H)``.

``quantile = 1`` selects no token: the loss is then PPO's exactly. The rollout side of AEPO
(entropy pre-monitoring, branch budgets) is not here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rlmix_high_entropy_tokens import entropy_threshold

import rlmix
from rlmix import ops
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, Run

NAME = "aepo"
RESCUE_CHOICES = ("both", "positive")


@dataclass
class Settings:
    eps_low: float = 0.2
    eps_high: float = 0.2
    quantile: float = 0.8  # high-entropy tokens: entropy >= this quantile; 1 = none (PPO)
    alpha: float = 0.5  # entropy-aware advantage: A (1 + alpha * H / max H) on those tokens
    # Where clipped high-entropy tokens keep a gradient: "both" bounds (the paper's reading),
    # or "positive" advantages only (the clip-higher side; a variant).
    rescue: str = "both"
    loss_mode: str = "seq-mean-token-mean"
    old_logp: str = "auto"

    def __post_init__(self) -> None:
        rlmix.check_choices(self, loss_mode=LOSS_MODES, old_logp=ops.OLD_LOGP_CHOICES,
                            rescue=RESCUE_CHOICES)
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError("eps_low must be in [0, 1) and eps_high >= 0")
        if not 0.0 <= self.quantile <= 1.0 or self.alpha < 0:
            raise ValueError("quantile must be in [0, 1] and alpha >= 0")


def high_entropy(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Bool ``[n, T]``: loss tokens whose entropy is at or above the ``quantile`` of the loss
    tokens' entropies; none when ``quantile >= 1``."""
    threshold = entropy_threshold(entropy, mask, quantile) if quantile < 1 else None
    if threshold is None:
        return torch.zeros_like(mask, dtype=torch.bool)
    return (mask > 0) & (entropy.detach() >= threshold)


def entropy_aware_advantage(advantages: torch.Tensor, entropy: torch.Tensor,
                            mask: torch.Tensor, high: torch.Tensor, alpha: float
                            ) -> torch.Tensor:
    """``A * (1 + alpha * H / max H)`` on the ``high`` tokens (max over the loss tokens), ``A``
    elsewhere."""
    ent = entropy.detach()
    peak = ent[mask > 0].max() if bool((mask > 0).any()) else ent.new_tensor(1.0)
    factor = 1 + alpha * ent / peak.clamp(min=1e-12)
    return torch.where(high, advantages * factor, advantages)


def entropy_balanced_surrogate(logp: torch.Tensor, old_logp: torch.Tensor,
                               advantages: torch.Tensor, high: torch.Tensor, eps_low: float,
                               eps_high: float, rescue: str = "both"
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's ``-min(r A, clip(r) A)``; on ``high`` tokens where the clipped branch is taken, its
    stop-gradient form ``-sg(clip(r)) * (r / sg(r)) * A`` (same value, gradient
    ``-clip(r) A``); with ``rescue="positive"`` only where ``A > 0`` (the upper bound's side).
    Returns the loss and where PPO's clipped branch was taken."""
    ratio = torch.exp(logp - old_logp)
    lower, upper = 1.0 - eps_low, 1.0 + eps_high
    loss, clipped = ops.clip_ratio(ratio, advantages, lower, upper)
    rescaled = ops.rescaled_clip(ratio, advantages, lower, upper)
    kept = high & clipped & ((advantages > 0) if rescue == "positive" else True)
    return torch.where(kept, rescaled, loss), clipped


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
               ) -> LossTerms:
    s = run.settings(NAME)
    batch = mb.batch
    mask = batch.completion_mask.to(logp.device)
    old = ops.old_logprobs(run, batch, logp, s.old_logp)
    high = high_entropy(entropy, mask, s.quantile)
    adv = entropy_aware_advantage(batch.token_advantages().to(logp.device), entropy, mask,
                                  high, s.alpha)
    loss, clipped = entropy_balanced_surrogate(logp, old, adv, high, s.eps_low, s.eps_high,
                                               s.rescue)
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode, metrics={
        "clip/fraction": float(ops.masked_mean(clipped.float(), mask)),
        f"{NAME}/rescued_fraction": float(ops.masked_mean((clipped & high).float(), mask)),
        "entropy": float(ops.masked_mean(entropy.detach(), mask))})
