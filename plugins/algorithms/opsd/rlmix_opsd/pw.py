"""PW-OPSD: OPSD with each token's distillation loss weighted by a weight that grows with its
position in the completion, ``((t + 1) / T) ** gamma`` normalised to mean 1 per sequence
(``gamma = 0`` is OPSD exactly). Owns ``rlmix_clip``; reward-free like ``opsd``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlmix
from rlmix.types import LossTerms, Minibatch, Run
from rlmix_opsd import base
from rlmix_opsd.plain import opsd_loss

NAME = "opsd.pw"
RLMIX_NOT_NEEDED = ("rlmix_score", "rlmix_advantage")


@dataclass
class Settings(base.Settings):
    gamma: float = 1.0  # exponent of the position weight; 0 = uniform (plain OPSD)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gamma < 0:
            raise ValueError("gamma must be >= 0 (0 = uniform weights, plain OPSD)")


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
               ) -> LossTerms:
    s = run.settings(NAME)
    weights = base.position_weights(mb.batch.completion_mask, s.gamma)
    return opsd_loss(run, mb, s, s.template, weights, NAME)
