"""RLOO: REINFORCE with a leave-one-out baseline, the mean reward of the *other* samples of the
same prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops
from rlmix.types import RolloutBatch, Run


@dataclass
class Settings:
    normalize: bool = False  # whiten the advantages over the whole batch (TRL's option)
    eps: float = rlmix.setting(1e-4, ge=0)  # added to the batch std when normalize is on

    def __post_init__(self) -> None:
        rlmix.check_ranges(self)


RLMIX_GROUP_RELATIVE = True  # the baseline is the other completions of the same prompt


def leave_one_out_advantage(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """``A_i = r_i - mean_{j in group(i), j != i} r_j``, ``[N]``; 0 for a sample alone in its
    group (there is nothing to compare it with). Computed in float64, returned in the rewards'
    dtype. Equal to ``k / (k - 1) * (r_i - mean_group(r))`` for a group of ``k``."""
    r = rewards.to(torch.float64)
    counts = ops.group_count(group)[group]
    sums = torch.zeros(int(group.max()) + 1, dtype=torch.float64).index_add_(0, group, r)[group]
    others = (counts - 1).clamp(min=1)
    adv = torch.where(counts > 1, r - (sums - r) / others, torch.zeros_like(r))
    return adv.to(rewards.dtype)


def whiten(advantages: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``(A - mean(A)) / (std(A) + eps)`` over the batch (unbiased std; 0 for one sample)."""
    if advantages.numel() < 2:
        return torch.zeros_like(advantages)
    return (advantages - advantages.mean()) / (advantages.std() + eps)


@rlmix.hookimpl
def rlmix_advantage(run: Run, batch: RolloutBatch) -> torch.Tensor:
    s = run.settings("rloo")
    assert batch.rewards is not None
    adv = leave_one_out_advantage(batch.rewards, batch.group)
    return whiten(adv, s.eps) if s.normalize else adv
