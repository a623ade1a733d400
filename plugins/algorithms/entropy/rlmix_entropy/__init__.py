"""An entropy bonus around any policy loss: a wrapper on ``rlmix_clip`` that subtracts
``coef * entropy`` from every token's loss, so the owner's aggregation mode applies to it."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix import ops
from rlmix.types import LossTerms, Minibatch, Run

NAME = "entropy"


@dataclass
class Settings:
    # entropy coefficient; the loss becomes loss - coef * entropy per token
    coef: float = rlmix.setting(0.001, ge=0, why="a negative coefficient would penalise entropy")

    def __post_init__(self) -> None:
        rlmix.check_ranges(self)


def entropy_bonus(loss: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor,
                  coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss - coef * H, coef * H)`` per token, with ``H`` zeroed off the mask (so a masked
    token adds no gradient even if the mask is later used as weights)."""
    bonus = coef * torch.where(mask > 0, entropy, torch.zeros_like(entropy))
    return loss - bonus, bonus


@rlmix.hookimpl(wrapper=True)
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor,
               entropy: torch.Tensor) -> Generator[None, Any, LossTerms]:
    terms = yield
    if terms is None:
        return terms
    s = run.settings(NAME)
    device = terms.loss.device
    mask = terms.mask.to(device)
    terms.loss, bonus = entropy_bonus(terms.loss, entropy.to(device), mask, s.coef)
    terms.metrics["entropy/bonus"] = float(ops.masked_mean(bonus.detach(), mask))
    return terms
