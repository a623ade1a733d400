"""DAPO token-level policy-gradient loss: the owner's loss averaged over all the step's tokens.

Every completion token of the optimizer step weighs the same (sum of token losses / tokens in
the step), so long sequences are not down-weighted. A wrapper on ``rlmix_clip`` that sets the
owner's aggregation to ``token-mean``. No settings."""

from __future__ import annotations

from collections.abc import Generator

import torch

import rlmix
from rlmix.types import LossTerms, Minibatch, Run

NAME = "dapo.token_loss"
MODE = "token-mean"


@rlmix.hookimpl(wrapper=True)
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
               ) -> Generator[None, LossTerms | None, LossTerms | None]:
    terms = yield
    if terms is not None:
        # the core divides by the whole optimizer step's token count (Normalizers.tokens), so
        # this is DAPO's token-level loss however the step is split into minibatches
        terms.mode = MODE
    return terms
