"""Train only on the high-entropy tokens: a wrapper around any ``rlmix_clip`` owner that keeps
the tokens whose entropy is at or above a quantile of the minibatch's loss tokens (the top 20%
by default), as in DART's selective training on high-entropy steps and the "forking tokens"
reading of it. Optionally the token denominators count only the kept tokens."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

import rlmix
from rlmix.types import LossTerms, Minibatch, Run

NAME = "high_entropy_tokens"
NORMALIZE = ("kept", "all")


@dataclass
class Settings:
    quantile: float = 0.8  # keep tokens with entropy >= this quantile (0.8: the top 20%)
    normalize: str = "kept"  # kept: denominators count kept tokens only | all: every token

    def __post_init__(self) -> None:
        if not 0.0 <= self.quantile <= 1.0:
            raise ValueError("quantile: must be in [0, 1]")
        if self.normalize not in NORMALIZE:
            raise ValueError(f"normalize: {self.normalize!r} is not allowed; choose one of "
                             f"{', '.join(NORMALIZE)}")


def entropy_threshold(entropy: torch.Tensor, mask: torch.Tensor, quantile: float,
                      ) -> torch.Tensor | None:
    """The ``quantile`` quantile of ``entropy`` over the tokens where ``mask > 0`` (linear
    interpolation between order statistics, as ``torch.quantile``); None if there are none."""
    values = torch.sort(entropy.detach()[mask > 0].flatten()).values
    if values.numel() == 0:
        return None
    pos = quantile * (values.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, values.numel() - 1)
    return values[lo] + (pos - lo) * (values[hi] - values[lo])


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float,
                      ) -> torch.Tensor:
    """``mask`` times ``entropy >= threshold``: the owner's mask narrowed to the high-entropy
    tokens (same dtype as ``mask``; all zeros if ``mask`` is empty)."""
    threshold = entropy_threshold(entropy, mask, quantile)
    if threshold is None:
        return torch.zeros_like(mask)
    return mask * (entropy.detach() >= threshold).to(mask.dtype)


def normalizer_factor(mask: torch.Tensor, kept: torch.Tensor, mode: str,
                      normalize: str = "kept") -> torch.Tensor:
    """What each row's per-token loss is multiplied by (``[n, 1]``) once the mask is narrowed
    to ``kept``, so that the core's aggregation divides by the counts ``normalize`` asks for.

    The core divides ``token-mean`` by the update's tokens and ``seq-mean-*`` by its sequences
    (both counted from the completion mask, i.e. all of them), and ``seq-mean-token-mean``'s
    per-row mean by the row's tokens *in the returned mask* (the kept ones).

    * ``kept``: every denominator counts kept tokens only (the paper's fork of verl, whose
      ``agg_loss`` runs on the narrowed mask): ``token-mean`` is scaled by
      ``tokens / kept tokens``, ``seq-mean-*`` by ``sequences / sequences with a kept token``,
      both counted on this minibatch (exact when the minibatch is the whole update).
    * ``all``: every denominator counts all the owner's tokens, so dropped tokens weigh as
      zeros (TRL's ``top_entropy_quantile``): only ``seq-mean-token-mean`` needs a factor,
      ``kept tokens of the row / tokens of the row``.
    """
    n = mask.shape[0]
    ones = torch.ones(n, 1, dtype=mask.dtype, device=mask.device)
    if normalize == "all":
        if mode != "seq-mean-token-mean":
            return ones
        row_total = mask.sum(-1, keepdim=True)
        return torch.where(row_total > 0, kept.sum(-1, keepdim=True) / row_total.clamp(min=1e-12),
                           ones)
    if normalize != "kept":
        raise ValueError(f"normalize: {normalize!r} is not one of {', '.join(NORMALIZE)}")
    if mode == "token-mean":
        total, kept_total = float(mask.sum()), float(kept.sum())
    else:
        total = float((mask.sum(-1) > 0).sum())
        kept_total = float((kept.sum(-1) > 0).sum())
    return ones * (total / kept_total if kept_total > 0 else 1.0)


@rlmix.hookimpl(wrapper=True)
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor,
               ) -> Generator[None, LossTerms | None, LossTerms | None]:
    terms = yield
    if terms is None:
        return terms
    s = run.settings(NAME)
    mask = terms.mask
    ent = entropy.detach().to(mask.device)
    kept = high_entropy_mask(ent, mask, s.quantile)
    total, kept_total = float(mask.sum()), float(kept.sum())
    terms.loss = terms.loss * normalizer_factor(mask, kept, terms.mode, s.normalize)
    terms.mask = kept
    threshold = entropy_threshold(ent, mask, s.quantile)
    terms.metrics["high_entropy/threshold"] = float(threshold) if threshold is not None else 0.0
    terms.metrics["high_entropy/kept_fraction"] = kept_total / total if total > 0 else 0.0
    return terms
