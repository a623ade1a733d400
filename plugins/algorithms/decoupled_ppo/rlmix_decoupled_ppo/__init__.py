"""Decoupled PPO: the PPO ratio split in two. A behaviour->proximal importance weight
``pi_prox / pi_behav`` (capped) corrects for stale or mismatched samples; the PPO clip acts on
``pi_theta / pi_prox`` only, so the trust region is measured from a recent *training-side*
policy, not from the sampler. The proximal policy is an exponential moving average of the
policy's weights (PPO-EWMA, the revised reading of the missing-old-logit paper), the weights at
the start of the step (AReaL's recompute), or a log-linear interpolation (A-3PO)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix import ops
from rlmix.policy import frozen_copy
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, RolloutBatch, Run

NAME = "decoupled_ppo"
PROXIMAL = ("ewma", "recompute", "loglinear")
CAP_MODES = ("mask", "truncate", "none")
EWMA = "ewma"  # run.plugin_resources("decoupled_ppo"): the EWMA model
SYNCED = "synced"  # run.plugin_resources("decoupled_ppo"): the state dict it last wrote
PROX_LOGP = "decoupled_ppo.prox_logp"  # batch.extras: proximal log-probs (recompute)
#: log importance weights are capped here before exp, so a far off-policy token cannot overflow
LOG_WEIGHT_CAP = 20.0


@dataclass
class Settings:
    proximal: str = "ewma"  # ewma | recompute | loglinear (see README)
    ewma_decay: float = 0.5  # ewma: theta_prox <- decay * theta_prox + (1 - decay) * theta
    eps_low: float = 0.2  # the clip of pi_theta / pi_prox: [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.2
    cap: float = 5.0  # the behaviour weight pi_prox / pi_behav above this is capped
    cap_mode: str = "mask"  # mask: weight 0 above the cap (AReaL) | truncate: min(w, cap) | none
    loss_mode: str = "seq-mean-token-mean"

    def __post_init__(self) -> None:
        rlmix.check_choices(self, proximal=PROXIMAL, cap_mode=CAP_MODES, loss_mode=LOSS_MODES)
        if not 0.0 <= self.ewma_decay < 1.0:
            raise ValueError("ewma_decay: must be in [0, 1)")
        if self.eps_low < 0 or self.eps_high < 0 or self.eps_low >= 1:
            raise ValueError("eps_low must be in [0, 1) and eps_high >= 0")
        if self.cap <= 1.0:
            raise ValueError("cap: must be > 1 (a weight of 1 is an on-policy token)")


# ---------------------------------------------------------------- tensor math


def behaviour_weight(prox_logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor,
                     cap: float, cap_mode: str = "mask") -> torch.Tensor:
    """The detached importance weight ``pi_prox / pi_behav`` per token (1 off the mask).
    ``mask``: tokens above ``cap`` get weight 0 (AReaL's filter); ``truncate``: ``min(w, cap)``
    (truncated importance sampling); ``none``: the raw weight."""
    log_w = torch.where(mask > 0, (prox_logp - behavior_logp).detach(),
                        torch.zeros_like(prox_logp))
    w = torch.exp(log_w.clamp(max=LOG_WEIGHT_CAP))
    if cap_mode == "mask":
        return torch.where(w > cap, torch.zeros_like(w), w)
    if cap_mode == "truncate":
        return w.clamp(max=cap)
    if cap_mode == "none":
        return w
    raise ValueError(f"cap_mode: {cap_mode!r} is not one of {', '.join(CAP_MODES)}")


def decoupled_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behavior_logp: torch.Tensor,
                   advantages: torch.Tensor, mask: torch.Tensor, eps_low: float,
                   eps_high: float, cap: float = 5.0, cap_mode: str = "mask",
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``-w * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with
    ``r = pi_theta / pi_prox`` and ``w = pi_prox / pi_behav`` (detached, capped). Returns
    ``(loss, clipped, w)``; ``clipped`` marks where the clipped branch was taken. With
    ``prox == behav`` it is PPO's clipped surrogate against the behaviour policy."""
    w = behaviour_weight(prox_logp, behavior_logp, mask, cap, cap_mode)
    prox = prox_logp.detach()
    log_r = torch.where(mask > 0, logp - prox, logp - logp.detach())  # 0 off the mask
    loss, clipped = ops.clip_ratio(torch.exp(log_r), advantages, 1.0 - eps_low, 1.0 + eps_high)
    return w * loss, clipped, w


def loglinear_proximal(logp: torch.Tensor, behavior_logp: torch.Tensor,
                       staleness: torch.Tensor) -> torch.Tensor:
    """A-3PO / AReaL ``loglinear``: ``behav + alpha (logp - behav)`` (detached) with
    ``alpha = d / (d + 1)`` per row, ``d`` the row's staleness in policy versions: the point
    one version short of the current policy on the line from the behaviour policy.
    ``staleness`` may also be ``[n, T]`` (per token, for samples continued across versions)."""
    d = staleness.clamp(min=0).to(logp.dtype)
    alpha = d / (d + 1)
    if alpha.dim() == 1:
        alpha = alpha[:, None]
    return (behavior_logp + alpha * (logp.detach() - behavior_logp)).detach()


@torch.no_grad()
def ewma_update(ewma: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """``theta_ewma <- decay * theta_ewma + (1 - decay) * theta`` for every parameter (buffers
    are copied)."""
    for p_ewma, p in zip(ewma.parameters(), model.parameters(), strict=True):
        p_ewma.mul_(decay).add_(p.detach().to(p_ewma.dtype), alpha=1.0 - decay)
    for b_ewma, b in zip(ewma.buffers(), model.buffers(), strict=True):
        b_ewma.copy_(b)


# ---------------------------------------------------------------- the EWMA model and its state


def _sync_state(run: Run) -> None:
    """Point ``run.plugin_state("decoupled_ppo")`` (checkpointed by the core) at the live
    EWMA."""
    res, state = run.plugin_resources(NAME), run.plugin_state(NAME)
    state["ewma"] = res[EWMA].state_dict()
    state.setdefault("updates", 0)
    res[SYNCED] = state


def ewma_model(run: Run) -> torch.nn.Module:
    """The EWMA model; if ``run.state`` holds a state this plugin did not write (a checkpoint
    was restored since), its weights are loaded first."""
    res = run.plugin_resources(NAME)
    model = res.get(EWMA)
    if model is None:
        raise RuntimeError("decoupled_ppo: proximal: ewma needs the EWMA copy of the policy, "
                           "built by rlmix_configure from a loaded policy")
    saved = run.plugin_state(NAME)
    if saved is not res.get(SYNCED):
        if "ewma" in saved:
            model.load_state_dict(saved["ewma"])
        _sync_state(run)
    return model


def proximal_logp(run: Run, mb: Minibatch, logp: torch.Tensor) -> torch.Tensor:
    s = run.settings(NAME)
    batch = mb.batch
    behavior = batch.behavior_logp.to(logp.device)
    if s.proximal == "loglinear":
        # per token when a sample was continued across versions (partial rollouts)
        versions = batch.extras.get("token_version", batch.policy_version)
        staleness = run.policy_version - versions.to(logp.device)
        return loglinear_proximal(logp, behavior, staleness)
    if s.proximal == "recompute":
        prox = batch.extras.get(PROX_LOGP)
        if prox is None:
            raise RuntimeError("decoupled_ppo: proximal: recompute found no proximal log-probs "
                               "in the batch (its rlmix_advantage wrapper computes them)")
        return prox.to(logp.device, logp.dtype)
    if run.policy is None:
        raise RuntimeError("decoupled_ppo: proximal: ewma needs a loaded policy")
    with torch.no_grad():
        prox, _ = run.policy.logprobs(run, batch, model=ewma_model(run))
    return prox.to(logp.device, logp.dtype)


# ---------------------------------------------------------------- hooks


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    res = run.plugin_resources(NAME)
    if s.proximal == "ewma" and run.policy is not None and EWMA not in res:
        # starts at the initial weights; a resumed run loads the checkpointed EWMA afterwards
        res[EWMA] = frozen_copy(run.policy.model)
        _sync_state(run)


@rlmix.hookimpl(wrapper=True)
def rlmix_advantage(run: Run, batch: RolloutBatch) -> Generator[None, Any, Any]:
    advantages = yield
    s = run.settings(NAME)
    if s.proximal == "recompute" and run.policy is not None:
        # the weights before this step's first optimizer step, for every minibatch of the step
        with torch.no_grad():
            prox, _ = run.policy.logprobs(run, batch)
        batch.extras[PROX_LOGP] = prox.detach().to(batch.behavior_logp.device,
                                                   batch.behavior_logp.dtype)
    return advantages


@rlmix.hookimpl(wrapper=True)
def rlmix_update(run: Run, loss: LossTerms) -> Generator[None, Any, Any]:
    version = run.policy_version
    stats = yield
    s = run.settings(NAME)
    if (s.proximal == "ewma" and run.policy_version != version
            and EWMA in run.plugin_resources(NAME)):
        # an optimizer step happened (the core bumps the version only then)
        ewma_update(ewma_model(run), run.policy.model, s.ewma_decay)  # type: ignore[union-attr]
        state = run.plugin_state(NAME)
        state["updates"] = state.get("updates", 0) + 1
    return stats


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor) -> LossTerms:
    s = run.settings(NAME)
    batch = mb.batch
    device = logp.device
    mask = batch.completion_mask.to(device)
    behavior = batch.behavior_logp.to(device)
    prox = proximal_logp(run, mb, logp)
    adv = batch.token_advantages().to(device)
    loss, clipped, w = decoupled_loss(logp, prox, behavior, adv, mask, s.eps_low, s.eps_high,
                                      s.cap, s.cap_mode)
    raw = torch.exp(torch.where(mask > 0, prox - behavior, torch.zeros_like(prox)))
    metrics = {
        "clip/fraction": float(ops.masked_mean(clipped.float(), mask)),
        "decoupled/weight_mean": float(ops.masked_mean(w, mask)),
        "decoupled/capped_fraction": float(ops.masked_mean((raw > s.cap).float(), mask)),
        "decoupled/prox_behavior_kl": float(ops.masked_mean(behavior - prox, mask)),
        "decoupled/current_prox_kl": float(ops.masked_mean(prox - logp.detach(), mask)),
        "entropy": float(ops.masked_mean(entropy.detach(), mask)),
        "mismatch/behavior_kl": float(ops.masked_mean(behavior - logp.detach(), mask)),
    }
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode, metrics=metrics)
