"""Dr. GRPO: group-centred advantages without std scaling, and the PPO clipped surrogate summed
over each sequence's tokens and divided by a constant, so no length or difficulty bias."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops
from rlmix.types import LossTerms, Minibatch, RolloutBatch, Run

NAME = "dr_grpo"
OLD_LOGP = ops.OLD_LOGP_CHOICES
#: the aggregation that makes the loss length-unbiased: token sums / a constant, mean over rows
LOSS_MODE = "seq-mean-token-sum-norm"
# shared with the other PPO-style losses, kept in rlmix.ops
clipped_surrogate = ops.clipped_surrogate
old_logprobs = ops.old_logprobs


@dataclass
class Settings:
    eps_low: float = rlmix.setting(0.2, ge=0, lt=1)  # ratio clipped below at 1 - eps_low
    eps_high: float = rlmix.setting(0.2, ge=0)  # ratio clipped above at 1 + eps_high
    old_logp: str = "auto"  # what the ratio divides by: auto | behavior | detached

    def __post_init__(self) -> None:
        if self.old_logp not in OLD_LOGP:
            raise ValueError(f"old_logp: {self.old_logp!r} is not allowed; choose one of "
                             f"{', '.join(OLD_LOGP)}")
        rlmix.check_ranges(self)


RLMIX_GROUP_RELATIVE = True  # group-centred advantages: groups need >= 2 completions


def centered_advantage(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """``r - mean_group(r)``: the GRPO advantage without the division by the group's std.

    A group whose rewards all agree, and a group of one sample, get 0."""
    return rewards - ops.group_mean(rewards, group)


@rlmix.hookimpl
def rlmix_advantage(run: Run, batch: RolloutBatch) -> torch.Tensor:
    assert batch.rewards is not None
    return centered_advantage(batch.rewards, batch.group)


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor) -> LossTerms:
    s = run.settings(NAME)
    batch = mb.batch
    mask = batch.completion_mask.to(logp.device)
    old = old_logprobs(run, batch, logp, s.old_logp)
    adv = batch.token_advantages().to(logp.device)
    loss, clipped = clipped_surrogate(logp, old, adv, s.eps_low, s.eps_high)
    metrics = {
        "clip/fraction": float(ops.masked_mean(clipped.float(), mask)),
        "entropy": float(ops.masked_mean(entropy.detach(), mask)),
        "mismatch/behavior_kl": float(ops.masked_mean(batch.behavior_logp.to(logp.device)
                                                      - logp.detach(), mask)),
    }
    return LossTerms(loss=loss, mask=mask, mode=LOSS_MODE, metrics=metrics)
