"""Tensor math that every plugin reuses: masked reductions, group statistics, loss aggregation.

Pure functions, tensors in and tensors out.
"""

from __future__ import annotations

from typing import Any

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


# ---------------------------------------------------------------- shared by policy losses

KL_ESTIMATORS = ("k1", "k2", "k3")
OLD_LOGP_CHOICES = ("auto", "behavior", "detached")


def clip_ratio(ratio: torch.Tensor, advantages: torch.Tensor, lower: float | torch.Tensor,
               upper: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PPO clip of a given ratio: per-token ``-min(r A, clip(r, lower, upper) A)``, and where
    the clipped branch was taken. ``lower``/``upper`` are numbers or tensors broadcastable to
    ``ratio`` (per-token or per-row bounds, as SAT's); ``ratio`` may be a token ratio
    ``exp(logp - old_logp)`` or a sequence ratio carried on every token
    (``sequence_token_ratio``)."""
    unclipped = ratio * advantages
    clipped = _clamp(ratio, lower, upper) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def _clamp(ratio: torch.Tensor, lower: float | torch.Tensor,
           upper: float | torch.Tensor) -> torch.Tensor:
    """``torch.clamp`` of ``ratio`` to bounds that may be a number and a tensor (torch.clamp
    takes two numbers or two tensors)."""
    if isinstance(lower, torch.Tensor) != isinstance(upper, torch.Tensor):
        lower = torch.as_tensor(lower, dtype=ratio.dtype, device=ratio.device)
        upper = torch.as_tensor(upper, dtype=ratio.dtype, device=ratio.device)
    return torch.clamp(ratio, lower, upper)


def outside_band(ratio: torch.Tensor, lower: float | torch.Tensor,
                 upper: float | torch.Tensor) -> torch.Tensor:
    """Where ``ratio`` leaves the trust region ``[lower, upper]``, whatever the advantage's
    sign (PPO's clip acts on one side per sign; a double-sided clip and an IS weight's clip
    test on both)."""
    return (ratio < lower) | (ratio > upper)


def rescaled_clip(ratio: torch.Tensor, advantages: torch.Tensor, lower: float | torch.Tensor,
                  upper: float | torch.Tensor) -> torch.Tensor:
    """``-sg(clip(r, lower, upper)) * (r / sg(r)) * A``: the value of PPO's clipped branch
    with a gradient through a stop-gradient, ``-clip(r) A`` in ``logp`` (at the upper bound
    ``-(upper) A``) instead of none."""
    bound = _clamp(ratio, lower, upper).detach()
    return -bound * (ratio / ratio.detach()) * advantages


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` with
    ``r = exp(logp - old_logp)``; also returns where the clipped branch was taken."""
    return clip_ratio(torch.exp(logp - old_logp), advantages, 1.0 - eps_low, 1.0 + eps_high)


#: a sequence ratio's log is capped here before exp (as verl does), so a far off-policy sample
#: cannot overflow; beyond the cap the token carries no gradient
LOG_RATIO_CAP = 10.0


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """``log s_i = (1/|y_i|) sum_t (logp - old_logp)`` over the masked tokens, ``[N]`` (GSPO's
    length-normalised sequence ratio); 0 for a row with no tokens (its ratio is 1)."""
    mask = mask.to(logp.dtype)
    diff = torch.where(mask > 0, logp - old_logp, torch.zeros_like(logp))
    return (diff * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def sequence_token_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                         cap: float = LOG_RATIO_CAP) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO-token's ratio ``s_it = sg(s_i) * pi_t / sg(pi_t)``, ``[N, T]``: the value of the
    sequence ratio ``s_i`` on every token of row ``i`` (so a clip decision is the sequence's)
    with the gradient ``s_i * grad logp_t``; the log is capped at ``cap`` before exp. Also
    returns ``log s_i`` (detached), ``[N]``."""
    seq = sequence_log_ratio(logp, old_logp, mask).detach()
    return torch.exp((seq[:, None] + logp - logp.detach()).clamp(max=cap)), seq


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) at tokens sampled from pi (Schulman's estimators),
    with ``log_r = ref_logp - logp``: ``k1 = -log_r``, ``k2 = log_r^2 / 2``,
    ``k3 = exp(log_r) - 1 - log_r`` (never negative; k1 and k3 are unbiased)."""
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kl_estimator: {estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")


def old_logprobs(run: Any, batch: Any, logp: torch.Tensor, choice: str) -> torch.Tensor:
    """The log-probs a policy ratio is taken against.

    ``behavior``: the sampler's log-probs recorded in the batch. ``detached``: the current
    log-probs, detached (ratio exactly 1, gradient of the plain policy gradient). ``auto``:
    ``detached`` when it is exact — one optimizer step per batch and every sample generated
    by the current policy version — otherwise ``behavior``."""
    if choice not in OLD_LOGP_CHOICES:
        raise ValueError(f"old_logp: {choice!r} is not one of {', '.join(OLD_LOGP_CHOICES)}")
    train = run.config.train
    single_update = int(train.epochs) * int(train.updates_per_epoch) == 1
    fresh = bool((batch.policy_version == run.policy_version).all())
    if choice == "detached" or (choice == "auto" and single_update and fresh):
        return logp.detach()
    return batch.behavior_logp.to(logp.device)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with the masked mean and unbiased variance over every
    masked-in entry; 0 off the mask, and 0 everywhere when there is no spread (a single entry,
    or all equal), never NaN."""
    mask = mask.to(values.dtype)
    var = masked_var(values, mask, unbiased=True)
    if not bool(var > 0):
        return torch.zeros_like(values)
    return (values - masked_mean(values, mask)) * torch.rsqrt(var + eps) * mask
