"""Dr. MAS agent-wise advantage normalisation: in a multi-agent system each agent's rewards are
centred and scaled by that agent's own statistics, not by one baseline shared by all agents.

A sample's agent is ``batch.info[i]["agent"]`` (the key is a setting); samples without one form
a single default agent. With no agent information at all this is GRPO's group-normalised
advantage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix import ops
from rlmix.types import RolloutBatch, Run

NAME = "agentwise_norm"
SCOPES = ("group", "batch")


@dataclass
class Settings:
    key: str = "agent"  # batch.info[i][key] names sample i's agent
    scope: str = "group"  # statistics over the agent's samples in the same group | whole batch
    scale: bool = True  # divide by the agent's std (False: only centre)
    eps: float = 1.0e-6  # added to the std

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"scope: {self.scope!r} is not allowed; choose one of "
                             f"{', '.join(SCOPES)}")
        if self.eps < 0:
            raise ValueError("eps must be >= 0")
        if not self.key:
            raise ValueError("key: must not be empty")


def agent_ids(info: Sequence[dict[str, Any]], key: str = "agent") -> torch.Tensor:
    """Agent index per sample, in order of first appearance; samples without ``key`` share one
    default agent."""
    ids: dict[Any, int] = {}
    out = []
    for item in info:
        name = item.get(key) if isinstance(item, dict) else None
        out.append(ids.setdefault(("agent", name) if name is not None else ("default",),
                                  len(ids)))
    return torch.tensor(out, dtype=torch.long)


def agentwise_advantage(rewards: torch.Tensor, group: torch.Tensor, agents: torch.Tensor,
                        scope: str = "group", scale: bool = True,
                        eps: float = 1.0e-6) -> torch.Tensor:
    """``(r_i - mean_k(r)) / (std_k(r) + eps)`` where ``k`` is sample ``i``'s agent within its
    group (``scope: group``) or in the whole batch (``scope: batch``); unbiased std, as GRPO.
    A cell of one sample, or of identical rewards, gets 0."""
    if len(rewards) == 0:
        return torch.zeros_like(rewards)
    if scope == "group":
        cell = group * (int(agents.max()) + 1) + agents
    elif scope == "batch":
        cell = agents
    else:
        raise ValueError(f"scope: {scope!r} is not one of {', '.join(SCOPES)}")
    _, cell = torch.unique(cell, return_inverse=True)
    centered = rewards - ops.group_mean(rewards, cell)
    if not scale:
        return centered
    return centered / (ops.group_std(rewards, cell) + eps)


@rlmix.hookimpl
def rlmix_advantage(run: Run, batch: RolloutBatch) -> torch.Tensor:
    s: Settings = run.settings(NAME)
    assert batch.rewards is not None
    agents = agent_ids(batch.info, s.key)
    run.log(f"{NAME}/agents", int(agents.max()) + 1 if len(agents) else 0)
    return agentwise_advantage(batch.rewards, batch.group, agents, s.scope, s.scale, s.eps)
