"""Tensor math that every plugin reuses: masked reductions, group statistics, loss aggregation.

Pure functions, tensors in and tensors out.
"""

from __future__ import annotations

import torch

from rlmix.types import LOSS_MODES, Normalizers


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is nonzero (mask is multiplied in, so it may be weights)."""
    masked = values * mask
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                eps: float = 1e-8) -> torch.Tensor:
    """Mean of ``values`` over ``mask``; 0 where the mask is empty (never NaN)."""
    return masked_sum(values, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(
        min=eps)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over ``mask`` (whole tensor)."""
    mean = masked_mean(values, mask)
    count = mask.sum()
    var = masked_sum((values - mean) ** 2, mask)
    return var / (count - 1).clamp(min=1) if unbiased else var / count.clamp(min=1)


def group_count(group: torch.Tensor, num_groups: int | None = None) -> torch.Tensor:
    """Samples per group, ``[G]``."""
    g = int(group.max()) + 1 if num_groups is None else num_groups
    return torch.zeros(g, dtype=torch.float64).index_add_(
        0, group, torch.ones_like(group, dtype=torch.float64))


def group_mean(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Each sample's group mean, ``[N]`` (computed in float64, returned in ``values.dtype``)."""
    v = values.to(torch.float64)
    sums = torch.zeros(int(group.max()) + 1, dtype=torch.float64).index_add_(0, group, v)
    return (sums / group_count(group).clamp(min=1))[group].to(values.dtype)


def group_std(values: torch.Tensor, group: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Each sample's group standard deviation, ``[N]``; 0 for groups of one sample."""
    v = values.to(torch.float64)
    dev2 = (v - group_mean(v, group)) ** 2
    sums = torch.zeros(int(group.max()) + 1, dtype=torch.float64).index_add_(0, group, dev2)
    counts = group_count(group)
    denom = (counts - 1 if unbiased else counts).clamp(min=1)
    return (sums / denom).sqrt()[group].to(values.dtype)


def sequence_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Number of masked-in tokens per row, ``[N]``."""
    return mask.sum(-1)


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str,
                   normalizers: Normalizers) -> torch.Tensor:
    """Reduce a per-token loss ``[n, T]`` to the scalar this minibatch contributes.

    Every mode divides by counts of the whole optimizer step (``normalizers``), never by this
    minibatch's own, so the sum over minibatches equals the loss of the unsplit batch:

    * ``token-mean``: sum of all token losses / tokens in the step.
    * ``seq-mean-token-mean``: per-sequence token mean, summed / sequences in the step.
    * ``seq-mean-token-sum``: per-sequence token sum, summed / sequences in the step.
    * ``seq-mean-token-sum-norm``: token sums / ``norm_constant``, summed / sequences (Dr. GRPO).
    """
    if mode not in LOSS_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of "
                         f"{', '.join(LOSS_MODES)}")
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return masked_sum(loss, mask) / normalizers.tokens
    per_seq = masked_sum(loss, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / normalizers.norm_constant
    return per_seq.sum() / normalizers.sequences


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim."""
    logz = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.exp(logits - logz)
    return logz.squeeze(-1) - (probs * logits).sum(-1)
