"""RP-OPSD: reasoning-pivot-guided OPSD. Two teacher views of the student's tokens, the same
weights with and without a reference solution; their per-token divergence marks the reasoning
pivots (tokens where the reference changes the decision). The distillation towards the
reference view is weighted by the pivot score normalised to mean 1 per sequence, and a
reference-anchoring term pulls the student towards the reference view's choice at pivots.

Our reading (the abstract names the parts, not the formulas): pivot score
``s_t = KL(p_ref || p_noref)`` at token ``t``; weight ``w_t = s_t ** sharpness`` normalised
to mean 1 per sequence; loss ``w_t * KL(p_ref || p_student) + anchor * w_t *
(-log p_student(argmax p_ref))``. Reward-free like ``opsd``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlmix
from rlmix import distill
from rlmix.types import LossTerms, Minibatch, Run
from rlmix_opsd import base

NAME = "opsd.rp"
RLMIX_NOT_NEEDED = ("rlmix_score", "rlmix_advantage")


@dataclass
class Settings(base.Settings):
    template: str = "\n\nA reference solution: {reference}"  # the view with the reference
    plain_template: str = ""  # the view without it ("" = the student's own prompt)
    sharpness: float = 1.0  # exponent on the pivot score before normalising
    anchor: float = 0.1  # weight of the reference-anchoring term; 0 = none

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sharpness < 0 or self.anchor < 0:
            raise ValueError("sharpness and anchor must be >= 0")


def pivot_weights(with_reference: torch.Tensor, without_reference: torch.Tensor,
                  mask: torch.Tensor, sharpness: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """``[n, t]`` weights, mean 1 over each row's masked tokens, proportional to
    ``KL(p_ref || p_noref) ** sharpness`` (uniform for a row where the views never differ)."""
    score = base.forward_kl(with_reference, without_reference, top_k).clamp(min=0)
    return base.mean_one(score**sharpness, mask)


def anchor_nll(with_reference: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """``-log p_student`` of the reference view's most likely token, per position."""
    target = with_reference.argmax(-1, keepdim=True)
    return -torch.log_softmax(student.float(), -1).gather(-1, target).squeeze(-1)


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
               ) -> LossTerms:
    s = run.settings(NAME)
    batch = mb.batch
    with_ref = distill.teacher_logits(
        run, batch, [base.privileged_messages(p, s.template) for p in batch.prompts])
    without_ref = distill.teacher_logits(
        run, batch, [base.privileged_messages(p, s.plain_template) for p in batch.prompts])
    region = distill.completion_region(batch).to(with_ref.device)
    weights = pivot_weights(with_ref, without_ref, region, s.sharpness, s.top_k)
    student = distill.completion_logits(run, batch)
    kl = base.forward_kl(with_ref, student, s.top_k) * region
    per_token = base.clip_token_loss(kl, s.kl_clip) * weights
    if s.anchor > 0:
        per_token = per_token + s.anchor * weights * anchor_nll(with_ref, student) * region
    width = batch.tokens.shape[1]
    mask = batch.completion_mask.to(per_token.device)
    return LossTerms(loss=base.to_columns(per_token, width), mask=mask, mode=s.loss_mode,
                     metrics={f"{NAME}/kl": base.kl_metric(base.to_columns(kl.detach(), width),
                                                           mask),
                              f"{NAME}/weight_max": float(weights.max())})
