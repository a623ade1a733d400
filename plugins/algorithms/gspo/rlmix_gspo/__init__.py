"""GSPO: a sequence-level importance ratio (the geometric mean of the token ratios) clipped at the
sequence level, written in the token-level GSPO-token form so it fits per-token ``LossTerms``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, Run

OLD_LOGP = ops.OLD_LOGP_CHOICES
LOG_RATIO_CAP = ops.LOG_RATIO_CAP  # the combined log-ratio's cap before exp (as verl)


@dataclass
class Settings:
    # sequence ratio clipped below at 1 - eps_low (the paper's 3e-4)
    eps_low: float = rlmix.setting(3e-4, ge=0, lt=1)
    # sequence ratio clipped above at 1 + eps_high (the paper's 4e-4)
    eps_high: float = rlmix.setting(4e-4, ge=0)
    loss_mode: str = "seq-mean-token-mean"  # the one mode that is the paper's sequence objective
    old_logp: str = "auto"  # what the ratio divides by, grpo's rule (see README)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, loss_mode=LOSS_MODES, old_logp=OLD_LOGP)
        rlmix.check_ranges(self)


sequence_log_ratio = ops.sequence_log_ratio  # the paper's s_i (log), written once


def gspo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, eps_low: float, eps_high: float,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token GSPO-token loss ``-min(s_it A, clip(s_it, 1-eps_low, 1+eps_high) A)`` with
    ``s_it = sg(s_i) * pi_t / sg(pi_t)``.

    ``s_it`` has the value of the sequence ratio ``s_i`` on every token of row ``i`` (so the
    clip decision is the sequence's) and the gradient ``s_i * grad logp_t``. Averaged over each
    sequence's tokens and then over sequences (``seq-mean-token-mean``), the loss and its
    gradient are those of the sequence objective ``mean_i -min(s_i A_i, clip(s_i) A_i)`` when
    ``A`` is constant along each row. Returns ``(loss [N, T], clipped [N, T], s [N])``, where
    ``clipped`` marks tokens whose clipped branch was taken."""
    ratio, seq = ops.sequence_token_ratio(logp, old_logp, mask, LOG_RATIO_CAP)
    loss, clipped = ops.clip_ratio(ratio, advantages, 1.0 - eps_low, 1.0 + eps_high)
    return loss, clipped, seq.exp()


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor) -> LossTerms:
    s = run.settings("gspo")
    batch = mb.batch
    mask = batch.completion_mask.to(logp.device)
    behavior = batch.behavior_logp.to(logp.device)
    old = ops.old_logprobs(run, batch, logp, s.old_logp)
    adv = batch.token_advantages().to(logp.device)
    loss, clipped, seq_ratio = gspo_token_loss(logp, old, adv, mask, s.eps_low, s.eps_high)
    rows = (mask.sum(-1) > 0).to(logp.dtype)
    seq_clipped = (clipped.to(logp.dtype) * mask).sum(-1) > 0
    metrics = {
        "clip/fraction": float(ops.masked_mean(clipped.float(), mask)),
        "gspo/seq_clip_fraction": float(ops.masked_mean(seq_clipped.float(), rows)),
        "gspo/seq_ratio_mean": float(ops.masked_mean(seq_ratio, rows)),
        "entropy": float(ops.masked_mean(entropy.detach(), mask)),
        "mismatch/behavior_kl": float(ops.masked_mean(behavior - logp.detach(), mask)),
    }
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode, metrics=metrics)
