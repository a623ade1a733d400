"""REINFORCE++: a token-level KL penalty in the reward, returns-to-go, and advantages normalised
over the whole batch (not per prompt). Returns per-token advantages ``[N, T]``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops
from rlmix.policy import frozen_copy
from rlmix.types import RolloutBatch, Run

NAME = "reinforce_pp"
REFERENCE = "reference"  # key in run.plugin_resources(NAME)
ESTIMATORS = ops.KL_ESTIMATORS
BASELINES = ("none", "group")
POLICY_LOGP = ("recompute", "behavior")
kl_estimate = ops.kl_estimate  # shared with grpo and kl
batch_whiten = ops.masked_whiten
_build_reference = frozen_copy


@dataclass
class Settings:
    # KL coefficient in the token rewards; 0 = no reference model
    beta: float = rlmix.setting(0.01, ge=0)
    kl_estimator: str = "k1"  # the paper's reward KL is k1, log(pi_old / pi_ref)
    gamma: float = rlmix.setting(1.0, ge=0, le=1)  # discount of the returns-to-go
    baseline: str = "none"  # none: REINFORCE++; group: subtract the group's mean reward first
    eps: float = rlmix.setting(1e-8, ge=0)  # added to the batch variance before the square root
    policy_logp: str = "recompute"  # the sampled policy's log-probs for the KL (see README)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, kl_estimator=ESTIMATORS,
                            baseline=BASELINES,
                            policy_logp=POLICY_LOGP)
        rlmix.check_ranges(self)


# with baseline: group, the group's mean reward is subtracted: groups need >= 2 completions
def RLMIX_GROUP_RELATIVE(settings: Settings) -> bool:  # noqa: N802 - a declared name
    return settings.baseline == "group"


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Column of each row's last masked-in token, ``[N]`` (0 for a row with none)."""
    cols = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask > 0, cols, torch.zeros_like(cols)).amax(-1)


def token_rewards(rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                  beta: float) -> torch.Tensor:
    """``r_t = -beta * KL_t`` on every completion token, plus the sequence's reward on its last
    completion token; 0 off the mask. ``[N, T]``."""
    mask = mask.to(kl.dtype)
    out = torch.where(mask > 0, -beta * kl, torch.zeros_like(kl))
    has_tokens = mask.sum(-1) > 0
    rows = torch.arange(len(rewards), device=kl.device)
    last = last_token_index(mask)
    out[rows, last] = out[rows, last] + torch.where(has_tokens, rewards.to(kl.dtype),
                                                    torch.zeros_like(rewards, dtype=kl.dtype))
    return out


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = r_t + gamma * G_next`` over the masked tokens, from the end. A masked-out column
    (a tool output inside a completion) is skipped: the return passes through it undiscounted
    and it gets 0. ``[N, T]``."""
    mask = mask.to(rewards.dtype)
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        step = rewards[:, t] + gamma * running
        running = torch.where(mask[:, t] > 0, step, running)
        out[:, t] = running * mask[:, t]
    return out


def reinforce_pp_advantage(rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                           beta: float, gamma: float = 1.0, group: torch.Tensor | None = None,
                           eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantages and returns, each ``[N, T]``. With ``group`` given, each reward is
    first centred on its group's mean (REINFORCE++-baseline)."""
    if group is not None:
        rewards = rewards - ops.group_mean(rewards, group)
    returns = returns_to_go(token_rewards(rewards, kl, mask, beta), mask, gamma)
    return batch_whiten(returns, mask, eps), returns


def _logprobs(run: Run, batch: RolloutBatch, model: torch.nn.Module | None) -> torch.Tensor:
    """No-grad log-probs, in row chunks the size of a training minibatch."""
    assert run.policy is not None
    train = run.config.train
    chunks = max(1, int(train.updates_per_epoch)) * max(1, int(train.grad_accum))
    size = max(1, math.ceil(len(batch) / chunks))
    parts = []
    with torch.no_grad():
        for rows in torch.arange(len(batch)).split(size):
            logp, _ = run.policy.logprobs(run, batch.select(rows), model=model)
            parts.append(logp)
    return torch.cat(parts)


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    own = run.plugin_resources(NAME)
    if s.beta > 0 and run.policy is not None and REFERENCE not in own:
        # the initial weights (configure runs before a checkpoint is restored); not checkpointed
        own[REFERENCE] = _build_reference(run.policy.model)


@rlmix.hookimpl
def rlmix_advantage(run: Run, batch: RolloutBatch) -> torch.Tensor:
    s = run.settings(NAME)
    assert batch.rewards is not None
    mask = batch.completion_mask.float()
    if s.beta > 0:
        reference = run.plugin_resources(NAME).get(REFERENCE)
        if reference is None or run.policy is None:
            raise RuntimeError("reinforce_pp: beta > 0 but no reference model "
                               "(rlmix_configure has not run with a policy)")
        ref_logp = _logprobs(run, batch, reference).cpu()
        logp = (batch.behavior_logp.float() if s.policy_logp == "behavior"
                else _logprobs(run, batch, None).cpu())
        kl = kl_estimate(logp, ref_logp, s.kl_estimator)
    else:
        kl = torch.zeros_like(mask)
    group = batch.group if s.baseline == "group" else None
    adv, _ = reinforce_pp_advantage(batch.rewards.float(), kl, mask, s.beta, s.gamma, group,
                                    s.eps)
    return adv
