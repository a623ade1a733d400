"""Rollout-training mismatch correction: importance weights ``pi_train / pi_behaviour`` on the
owner's per-token policy loss, for rollouts sampled by a different (e.g. low-precision) copy of
the policy.

* ``tis``: truncated importance sampling, weight ``min(rho, cap)``;
* ``mis``: masked importance sampling, weight ``rho`` where ``lower <= rho <= cap``, and the
  token (or sequence) removed from the loss mask elsewhere;
* ``ais``: adaptive importance sampling, weight ``(1 - lambda) + lambda * min(rho, cap)`` with
  ``lambda`` in [0, 1] computed per minibatch from weight reliability, divergence severity and
  variance amplification (see README, "Our reading");
* ``none``: no correction, diagnostics only.

``rho`` is per token (``level: token``) or the product over a sequence's completion tokens
(``level: sequence``). Weights are detached: they change the measure, not the objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops
from rlmix.types import LossTerms, Minibatch, RolloutBatch, Run

NAME = "rollout_correction"
MODES = ("tis", "mis", "ais", "none")
LEVELS = ("token", "sequence")
OLD_LOGP = "rollout_correction.train_logp"  # batch.extras key of the step-start trainer logp
SAFETY = 20.0  # log-ratios are clamped to [-20, 20] before exp (metrics only)


@dataclass
class Settings:
    mode: str = "tis"  # tis | mis | ais | none
    level: str = "token"  # token | sequence
    cap: float = 2.0  # truncation (tis, ais) and upper mask bound (mis)
    lower: float = 0.0  # mis lower bound; 0 = 1 / cap
    kl_scale: float = 1.0e-3  # ais: divergence severity = 1 - exp(-kl / kl_scale)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, mode=MODES, level=LEVELS)
        if self.cap < 1.0:
            raise ValueError("cap must be >= 1")
        if not 0.0 <= self.lower < self.cap:
            raise ValueError("lower must be in [0, cap)")
        if self.kl_scale <= 0:
            raise ValueError("kl_scale must be > 0")

    @property
    def lower_bound(self) -> float:
        return self.lower if self.lower > 0 else 1.0 / self.cap


# ---------------------------------------------------------------- pure tensor math


def log_ratio(train_logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor,
              level: str = "token") -> torch.Tensor:
    """``log(pi_train / pi_behaviour)`` per token ``[n, T]``, 0 off the mask. At ``sequence``
    level every token of a row carries the row's sum (the log of the product of its ratios)."""
    diff = (train_logp - behavior_logp) * mask
    if level == "token":
        return diff
    if level == "sequence":
        return diff.sum(-1, keepdim=True).expand_as(diff) * (mask > 0)
    raise ValueError(f"level: {level!r} is not one of {', '.join(LEVELS)}")


def truncated_weights(log_rho: torch.Tensor, cap: float) -> torch.Tensor:
    """TIS: ``min(rho, cap)``, computed in log space (no overflow)."""
    return torch.exp(torch.clamp(log_rho, max=math.log(cap)))


def masked_weights(log_rho: torch.Tensor, lower: float,
                   upper: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MIS: ``(rho * keep, keep)`` with ``keep = lower <= rho <= upper``."""
    keep = (log_rho >= math.log(lower)) & (log_rho <= math.log(upper))
    weights = torch.where(keep, torch.exp(torch.clamp(log_rho, max=math.log(upper))),
                          torch.zeros_like(log_rho))
    return weights, keep


def _units(values: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """The per-unit values (tokens, or one per sequence) and their 0/1 weights."""
    if level == "token":
        return values.reshape(-1), mask.reshape(-1)
    rows = (mask.sum(-1) > 0).to(values.dtype)
    return ops.masked_mean(values, mask, dim=-1), rows


def ais_diagnostics(log_rho: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    cap: float, level: str = "token",
                    kl_scale: float = 1.0e-3) -> dict[str, float]:
    """The three diagnostics and the mixing coefficient, over the units of ``level``:

    * ``reliability`` = ESS / n = ``(sum w)^2 / (n sum w^2)`` of the truncated weights ``w``;
    * ``kl`` = mean of ``rho - 1 - log rho`` (k3; an estimate of KL(behaviour || train)), and
      ``severity = 1 - exp(-kl / kl_scale)``;
    * ``variance`` = ``sum w^2 A^2 / sum A^2`` (how much weighting inflates the second moment of
      the per-unit signal ``w A``; 1 when every advantage is 0);
    * ``lambda = severity * reliability / max(variance, 1)``, in [0, 1].
    Empty masks give ``lambda = 0`` and neutral diagnostics, never NaN."""
    mask = mask.to(log_rho.dtype)
    lr, unit = _units(torch.clamp(log_rho, -SAFETY, SAFETY), mask, level)
    adv, _ = _units(advantages.to(log_rho.dtype), mask, level)
    n = float(unit.sum())
    if n == 0:
        return {"reliability": 1.0, "kl": 0.0, "severity": 0.0, "variance": 1.0,
                "lambda": 0.0}
    w = torch.exp(torch.clamp(lr, max=math.log(cap)))
    sum_w, sum_w2 = float((w * unit).sum()), float((w * w * unit).sum())
    reliability = sum_w**2 / (n * sum_w2) if sum_w2 > 0 else 0.0
    kl = float(((torch.exp(lr) - 1.0 - lr) * unit).sum()) / n
    severity = 1.0 - math.exp(-kl / kl_scale)
    a2 = float((adv * adv * unit).sum())
    variance = float((w * w * adv * adv * unit).sum()) / a2 if a2 > 0 else 1.0
    lam = min(1.0, max(0.0, severity * reliability / max(variance, 1.0)))
    return {"reliability": reliability, "kl": kl, "severity": severity,
            "variance": variance, "lambda": lam}


def correction(train_logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor,
               advantages: torch.Tensor, settings: Settings,
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(weight [n, T], keep [n, T], metrics)``: multiply the per-token loss by ``weight`` and
    the loss mask by ``keep``. Everything is detached."""
    s = settings
    mask = mask.to(train_logp.dtype)
    log_rho = log_ratio(train_logp.detach(), behavior_logp.to(train_logp.dtype), mask, s.level)
    keep = torch.ones_like(mask, dtype=torch.bool)
    prefix = f"{NAME}/"
    if s.mode == "mis":
        weight, keep = masked_weights(log_rho, s.lower_bound, s.cap)
    else:
        weight = truncated_weights(log_rho, s.cap)
    metrics: dict[str, float] = {}
    if s.mode == "ais":
        diag = ais_diagnostics(log_rho, advantages, mask, s.cap, s.level, s.kl_scale)
        lam = diag["lambda"]
        weight = (1.0 - lam) + lam * weight
        metrics.update({f"{prefix}ais_{k}": v for k, v in diag.items()})
    elif s.mode == "none":
        weight = torch.ones_like(weight)
    keep = keep | (mask == 0)  # only completion tokens are ever dropped
    kept = mask * keep
    safe = torch.clamp(log_rho, -SAFETY, SAFETY)
    units, unit_mask = _units(safe, mask, s.level)
    metrics.update({
        f"{prefix}ratio_mean": float(ops.masked_mean(torch.exp(units), unit_mask)),
        f"{prefix}ratio_max": float((torch.exp(units) * unit_mask).max()) if units.numel() else 0.0,
        f"{prefix}log_ratio_abs_mean": float(ops.masked_mean(units.abs(), unit_mask)),
        f"{prefix}kl": float(ops.masked_mean(torch.exp(units) - 1.0 - units, unit_mask)),
        f"{prefix}truncated_fraction": float(ops.masked_mean(
            (units > math.log(s.cap)).to(mask.dtype), unit_mask)),
        f"{prefix}masked_fraction": float(1.0 - ops.masked_sum(kept, mask)
                                          / mask.sum().clamp(min=1)) if mask.sum() > 0 else 0.0,
        f"{prefix}weight_mean": float(ops.masked_mean(weight, kept)),
    })
    return weight.detach(), keep, metrics


# ---------------------------------------------------------------- the hooks


def _several_updates(run: Run) -> bool:
    train = run.config.train
    return int(train.epochs) * int(train.updates_per_epoch) > 1


@rlmix.hookimpl(wrapper=True)
def rlmix_advantage(run: Run, batch: RolloutBatch):
    advantages = yield
    # with several optimizer steps per batch the current log-probs drift from the trainer's
    # log-probs at the start of the step: record those once, before any update
    if _several_updates(run) and run.policy is not None and OLD_LOGP not in batch.extras:
        with torch.no_grad():
            old, _ = run.policy.logprobs(run, batch)
        batch.extras[OLD_LOGP] = old.detach().float().cpu()
    return advantages


@rlmix.hookimpl(wrapper=True)
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor):
    terms: LossTerms | None = yield
    if terms is None:
        return terms
    s: Settings = run.settings(NAME)
    batch = mb.batch
    device = logp.device
    train_logp = batch.extras.get(OLD_LOGP)
    train_logp = logp.detach() if train_logp is None else train_logp.to(device, logp.dtype)
    cmask = batch.completion_mask.to(device, logp.dtype)
    adv = batch.token_advantages().to(device, logp.dtype) if batch.advantages is not None \
        else torch.zeros_like(cmask)
    weight, keep, metrics = correction(train_logp, batch.behavior_logp.to(device), cmask, adv, s)
    terms.loss = terms.loss * weight.to(terms.loss.dtype)
    terms.mask = terms.mask * keep.to(terms.mask.dtype)
    terms.metrics.update(metrics)
    return terms

