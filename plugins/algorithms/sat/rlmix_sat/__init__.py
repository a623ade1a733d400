"""SAT, the Staleness-Adaptive Trust Region: the detached sampled log-ratio measures each
token's (or sequence's) staleness; the batch's high-mismatch tail gets the sign-selected endpoint
of the PPO interval contracted by a Gaussian kernel of its excess staleness; every other token
keeps the nominal interval. Token ratios (GRPO) or GSPO's sequence ratio."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, Run

NAME = "sat"
LEVELS = ("token", "sequence")
OLD_LOGP = ops.OLD_LOGP_CHOICES
#: the sequence log-ratio is capped before exp (as gspo does), so a far off-policy sample
#: cannot overflow
LOG_RATIO_CAP = ops.LOG_RATIO_CAP


@dataclass
class Settings:
    level: str = "token"  # token: GRPO's per-token ratio | sequence: GSPO's sequence ratio
    eps_low: float = 0.2  # nominal interval [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.2  # (for level: sequence use GSPO's, e.g. 3e-4 and 4e-4)
    tail_quantile: float = 0.9  # staleness above this quantile of the minibatch is the tail
    min_staleness: float = 0.0  # ... and above this many nats (0: any nonzero mismatch)
    min_scale: float = 0.0  # a contracted endpoint keeps at least this share of its eps
    loss_mode: str = "seq-mean-token-mean"
    old_logp: str = "auto"  # what the ratio divides by: grpo's rule (see README)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, level=LEVELS, loss_mode=LOSS_MODES, old_logp=OLD_LOGP)
        if self.eps_low < 0 or self.eps_high < 0 or self.eps_low >= 1:
            raise ValueError("eps_low must be in [0, 1) and eps_high >= 0")
        if not 0.0 <= self.tail_quantile <= 1.0:
            raise ValueError("tail_quantile: must be in [0, 1]")
        if self.min_staleness < 0:
            raise ValueError("min_staleness: must be >= 0")
        if not 0.0 <= self.min_scale <= 1.0:
            raise ValueError("min_scale: must be in [0, 1]")


def quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q`` quantile of a 1-D tensor with linear interpolation between order statistics
    (``torch.quantile``'s default, without its size limit)."""
    v = torch.sort(values.flatten()).values
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (pos - lo) * (v[hi] - v[lo])


def staleness(logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor,
              level: str = "token") -> torch.Tensor:
    """The staleness proxy: the detached sampled log-ratio ``logp - behavior_logp``, per token
    (``[N, T]``, 0 off the mask) or, for ``sequence``, its mean over each row's tokens
    (``[N]``, 0 for an empty row)."""
    m = mask.to(logp.dtype)
    d = torch.where(m > 0, logp.detach() - behavior_logp, torch.zeros_like(logp))
    if level == "token":
        return d
    if level == "sequence":
        return (d * m).sum(-1) / m.sum(-1).clamp(min=1)
    raise ValueError(f"level: {level!r} is not one of {', '.join(LEVELS)}")


def tail_scale(d: torch.Tensor, valid: torch.Tensor, tail_quantile: float,
               min_staleness: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(scale, tail, tau)``. ``tau`` is the ``tail_quantile`` quantile of ``|d|`` over the
    ``valid`` entries, raised to ``min_staleness``; the tail is where ``|d| > tau``. The scale
    is 1 outside the tail and ``exp(-((|d| - tau) / tau)^2)`` inside it: a Gaussian kernel of
    the excess staleness in units of ``tau``, continuous at the tail's edge."""
    a = d.abs()
    valid = valid.bool()
    if not bool(valid.any()):
        return torch.ones_like(a), torch.zeros_like(valid), float("inf")
    tau = max(float(quantile(a[valid], tail_quantile)), float(min_staleness))
    tail = valid & (a > tau)
    excess = (a - tau) / max(tau, 1e-12)
    scale = torch.where(tail, torch.exp(-(excess**2)), torch.ones_like(a))
    return scale, tail, tau


def sat_bounds(advantages: torch.Tensor, scale: torch.Tensor, eps_low: float, eps_high: float,
               min_scale: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lower, upper)`` per token. Only the endpoint that gates the update's outward
    direction shrinks: the upper ``1 + eps_high * s`` where ``A > 0``, the lower
    ``1 - eps_low * s`` where ``A < 0``, with ``s = max(scale, min_scale)``; the other endpoint
    (and both where ``A == 0``) stays nominal."""
    s = scale.clamp(min=min_scale).to(advantages.dtype)
    lower = torch.where(advantages < 0, 1.0 - eps_low * s, torch.full_like(s, 1.0 - eps_low))
    upper = torch.where(advantages > 0, 1.0 + eps_high * s, torch.full_like(s, 1.0 + eps_high))
    return lower, upper


def clipped_loss(ratio: torch.Tensor, advantages: torch.Tensor, lower: torch.Tensor,
                 upper: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``-min(r A, clip(r, lower, upper) A)`` with per-token bounds; also where the clipped
    branch was taken."""
    return ops.clip_ratio(ratio, advantages, lower, upper)


def sat_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                   lower: torch.Tensor, upper: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token PPO surrogate with ``r = exp(logp - old_logp)`` and the SAT bounds."""
    return clipped_loss(torch.exp(logp - old_logp), advantages, lower, upper)


def sat_sequence_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO-token: the ratio ``s_it = sg(s_i) * pi_t / sg(pi_t)`` carries the sequence ratio
    ``s_i = exp(mean_t (logp - old_logp))`` on every token of row ``i`` (so the clip decision is
    the sequence's) and the gradient ``s_i * grad logp_t``; the SAT bounds are per row."""
    ratio, _ = ops.sequence_token_ratio(logp, old_logp, mask, LOG_RATIO_CAP)
    return clipped_loss(ratio, advantages, lower, upper)


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor) -> LossTerms:
    s = run.settings(NAME)
    batch = mb.batch
    device = logp.device
    mask = batch.completion_mask.to(device)
    behavior = batch.behavior_logp.to(device)
    old = ops.old_logprobs(run, mb.batch, logp, s.old_logp)
    adv = batch.token_advantages().to(device)
    d = staleness(logp, behavior, mask, s.level)
    if s.level == "token":
        scale, tail, tau = tail_scale(d, mask > 0, s.tail_quantile, s.min_staleness)
    else:
        rows = mask.sum(-1) > 0
        row_scale, row_tail, tau = tail_scale(d, rows, s.tail_quantile, s.min_staleness)
        scale = row_scale[:, None].expand_as(mask)
        tail = row_tail[:, None].expand_as(mask) & (mask > 0)
    lower, upper = sat_bounds(adv, scale, s.eps_low, s.eps_high, s.min_scale)
    nominal_lower = torch.full_like(lower, 1.0 - s.eps_low)
    nominal_upper = torch.full_like(upper, 1.0 + s.eps_high)
    if s.level == "token":
        loss, clipped = sat_token_loss(logp, old, adv, lower, upper)
        _, nominal_clipped = sat_token_loss(logp.detach(), old, adv, nominal_lower,
                                            nominal_upper)
    else:
        loss, clipped = sat_sequence_loss(logp, old, adv, mask, lower, upper)
        _, nominal_clipped = sat_sequence_loss(logp.detach(), old, adv, mask, nominal_lower,
                                               nominal_upper)
    tail_f = tail.float()
    metrics = {
        "clip/fraction": float(ops.masked_mean(clipped.float(), mask)),
        "sat/tail_fraction": float(ops.masked_mean(tail_f, mask)),
        "sat/tau": tau if tau != float("inf") else 0.0,
        "sat/mean_scale": float(ops.masked_mean(scale.to(tail_f.dtype), mask)),
        "sat/extra_clip_fraction": float(ops.masked_mean(
            (clipped & ~nominal_clipped).float(), mask)),
        "entropy": float(ops.masked_mean(entropy.detach(), mask)),
        "mismatch/behavior_kl": float(ops.masked_mean(behavior - logp.detach(), mask)),
    }
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode, metrics=metrics)
