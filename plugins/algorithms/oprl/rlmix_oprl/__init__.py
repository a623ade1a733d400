"""OPRL (Online Process Reward Learning): an implicit process reward model, trained alternately
with the policy by trajectory-level DPO, turns trajectory preferences into step rewards.

Each step (the ``rlmix_advantage`` owner):

1. Preference pairs inside each group: every (winner, loser) with a higher / lower reward (at
   most ``max_pairs`` per group).
2. ``prm_steps`` DPO updates of the implicit PRM ``pi_phi`` against the frozen reference
   ``pi_ref``: ``-log sigmoid(beta * (D_w - D_l))`` with ``D = sum_t (log pi_phi - log pi_ref)``
   over the completion.
3. Step rewards ``r_t = beta * (log pi_phi(a_t) - log pi_ref(a_t))`` per completion token.
4. Advantages ``A_t = A_episode + alpha * A_step_t`` (``[N, T]``): ``A_episode`` is the
   group-normalised outcome reward, ``A_step_t`` the step rewards normalised over the tokens of
   the row's group.

The PRM starts as a copy of the policy, the reference is a frozen copy of the starting policy.
Other engines, or tests, can put their own in ``run.plugin_resources("oprl")``: ``"prm"`` (an
object with ``logprobs(batch) -> [N, T]`` differentiable in its ``parameters()``) and
``"ref_logprobs"`` (``fn(batch) -> [N, T]``).

The PRM's weights and its optimiser's state are checkpointed: ``run.plugin_state("oprl")``
points at the live state dicts after every update, and a restored state (a resumed run) is
loaded into the live PRM and optimiser before the next update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix import ops
from rlmix.types import RolloutBatch, Run

NAME = "oprl"
STEP_REWARD_KEY = "oprl.step_reward"
_SYNCED = "oprl.synced"  # run.resources: the state dict this plugin last put in run.state


@dataclass
class Settings:
    beta: float = 0.1  # DPO beta and the step reward scale
    alpha: float = 1.0  # weight of the step advantage
    prm_lr: float = 1.0e-5  # Adam step size of the implicit PRM
    prm_steps: int = 1  # DPO updates per policy step
    max_pairs: int = 16  # preference pairs per group at most
    eps: float = 1e-6  # added to standard deviations

    def __post_init__(self) -> None:
        if self.beta <= 0 or self.alpha < 0 or self.prm_lr <= 0:
            raise ValueError("beta and prm_lr must be > 0, alpha >= 0")
        if self.prm_steps < 0 or self.max_pairs < 1 or self.eps <= 0:
            raise ValueError("prm_steps must be >= 0, max_pairs >= 1, eps > 0")


# ---------------------------------------------------------------- pure functions


def preference_pairs(rewards: torch.Tensor, group: torch.Tensor,
                     max_pairs: int = 16) -> list[tuple[int, int]]:
    """``(winner, loser)`` rows inside each group, winner's reward strictly higher; per group
    the first ``max_pairs`` in row order."""
    pairs = []
    for g in group.unique().tolist():
        rows = (group == g).nonzero().flatten().tolist()
        found = [(i, j) for i in rows for j in rows if float(rewards[i]) > float(rewards[j])]
        pairs.extend(found[:max_pairs])
    return pairs


def sequence_log_ratio(logp: torch.Tensor, ref_logp: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """``[N]``: ``sum_t (logp - ref_logp)`` over the completion."""
    return ops.masked_sum(logp - ref_logp, mask, dim=-1)


def dpo_loss(log_ratio: torch.Tensor, pairs: list[tuple[int, int]], beta: float) -> torch.Tensor:
    """Mean over pairs of ``-log sigmoid(beta * (D_w - D_l))`` (0 with no pairs)."""
    if not pairs:
        return log_ratio.sum() * 0.0
    w = torch.tensor([p[0] for p in pairs])
    lose = torch.tensor([p[1] for p in pairs])
    return -torch.nn.functional.logsigmoid(beta * (log_ratio[w] - log_ratio[lose])).mean()


def step_rewards(prm_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                 beta: float) -> torch.Tensor:
    """``[N, T]``: ``beta * (log pi_phi - log pi_ref)`` on the completion, 0 elsewhere."""
    return beta * (prm_logp - ref_logp) * mask


def group_token_normalize(values: torch.Tensor, mask: torch.Tensor, group: torch.Tensor,
                          eps: float = 1e-6) -> torch.Tensor:
    """``(v - mean_g) / (std_g + eps)`` with the mean and (unbiased) std over every completion
    token of the row's group; 0 off the mask."""
    out = torch.zeros_like(values)
    for g in group.unique().tolist():
        rows = group == g
        v, m = values[rows], mask[rows]
        mean = ops.masked_mean(v, m)
        std = ops.masked_var(v, m).sqrt()
        out[rows] = (v - mean) / (std + eps) * m
    return out


def oprl_advantage(rewards: torch.Tensor, group: torch.Tensor, step_r: torch.Tensor,
                   mask: torch.Tensor, alpha: float = 1.0, eps: float = 1e-6) -> torch.Tensor:
    """``[N, T]``: the group-normalised episode advantage on every completion token plus
    ``alpha`` times the group-token-normalised step rewards."""
    episode = (rewards - ops.group_mean(rewards, group)) / (ops.group_std(rewards, group) + eps)
    return (episode[:, None] + alpha * group_token_normalize(step_r, mask, group, eps)) * mask


def pair_order_accuracy(scores: torch.Tensor, pairs: list[tuple[int, int]]) -> float:
    """Share of pairs whose winner has the higher score (ties count half)."""
    if not pairs:
        return 0.0
    right = sum(1.0 if scores[w] > scores[lo] else 0.5 if scores[w] == scores[lo] else 0.0
                for w, lo in pairs)
    return right / len(pairs)


# ---------------------------------------------------------------- the PRM around a model


class ModelPRM:
    """The implicit PRM as a trainable copy of a transformers policy."""

    def __init__(self, run: Run) -> None:
        import copy

        assert run.policy is not None
        self.run = run
        self.model = copy.deepcopy(run.policy.model).train()
        for p in self.model.parameters():
            p.requires_grad_(True)

    def parameters(self) -> Any:
        return self.model.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> Any:
        return self.model.load_state_dict(state)

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        assert self.run.policy is not None
        return self.run.policy.logprobs(self.run, batch, model=self.model)[0]


# ---------------------------------------------------------------- checkpointed state


def prm_state(prm: Any) -> Any:
    """The PRM's weights as live references: its ``state_dict()`` when it has one, else the
    list of its parameters (``torch.save`` copies their values when the core checkpoints)."""
    if hasattr(prm, "state_dict"):
        return prm.state_dict()
    return [p.detach() for p in prm.parameters()]


def load_prm_state(prm: Any, saved: Any) -> None:
    """Put saved weights (from ``prm_state``) back into the live PRM."""
    if isinstance(saved, dict) and hasattr(prm, "load_state_dict"):
        prm.load_state_dict(saved)
        return
    params = list(prm.parameters())
    if len(params) != len(saved):
        raise RuntimeError(f"oprl: the checkpoint holds {len(saved)} PRM tensors, the PRM has "
                           f"{len(params)}")
    with torch.no_grad():
        for p, v in zip(params, saved):
            p.copy_(v)


def sync_state(run: Run, prm: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point ``run.plugin_state("oprl")`` (checkpointed by the core) at the live PRM weights and
    optimiser state."""
    state = run.plugin_state(NAME)
    state.clear()
    state.update({"prm": prm_state(prm), "optimizer": optimizer.state_dict()})
    run.resources[_SYNCED] = state


def restore_if_resumed(run: Run, prm: Any, optimizer: torch.optim.Optimizer,
                       s: Settings) -> bool:
    """When ``run.state["oprl"]`` is not the state this plugin last wrote (a checkpoint was
    restored since), load its PRM weights and optimiser state into the live ones (the
    manifest's ``prm_lr`` wins over the saved one). Returns whether it loaded anything."""
    saved = run.state.get(NAME)
    if saved is None or saved is run.resources.get(_SYNCED) or "prm" not in saved:
        return False
    load_prm_state(prm, saved["prm"])
    if saved.get("optimizer"):
        optimizer.load_state_dict(saved["optimizer"])
        for group in optimizer.param_groups:
            group["lr"] = s.prm_lr
    return True


# ---------------------------------------------------------------- hooks


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s: Settings = run.settings(NAME)
    if "ref_logprobs" not in run.plugin_resources(NAME) and run.policy is not None:
        from rlmix.policy import frozen_copy

        reference = frozen_copy(run.policy.model)
        run.plugin_resources(NAME)["ref_logprobs"] = (
            lambda batch: run.policy.logprobs(run, batch, model=reference)[0])
    if "prm" not in run.plugin_resources(NAME) and run.policy is not None:
        run.plugin_resources(NAME)["prm"] = ModelPRM(run)
    prm = run.plugin_resources(NAME).get("prm")
    if prm is not None and "optimizer" not in run.plugin_resources(NAME):
        run.plugin_resources(NAME)["optimizer"] = torch.optim.Adam(prm.parameters(), lr=s.prm_lr)


@rlmix.hookimpl
def rlmix_advantage(run: Run, batch: RolloutBatch) -> torch.Tensor:
    s: Settings = run.settings(NAME)
    own = run.plugin_resources(NAME)
    prm, ref_fn = own.get("prm"), own.get("ref_logprobs")
    if prm is None or ref_fn is None:
        raise RuntimeError("oprl: no implicit PRM or reference (rlmix_configure not run)")
    assert batch.rewards is not None
    mask = batch.completion_mask
    with torch.no_grad():
        ref = ref_fn(batch).detach().to(mask.dtype)
    pairs = preference_pairs(batch.rewards, batch.group, s.max_pairs)
    optimizer = run.plugin_resources(NAME)["optimizer"]
    if restore_if_resumed(run, prm, optimizer, s):
        run.log(f"{NAME}/restored", 1.0)
    loss_value = 0.0
    for _ in range(s.prm_steps if pairs else 0):
        loss = dpo_loss(sequence_log_ratio(prm.logprobs(batch).to(mask.dtype), ref, mask),
                        pairs, s.beta)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    with torch.no_grad():
        r = step_rewards(prm.logprobs(batch).to(mask.dtype), ref, mask, s.beta)
    batch.extras[STEP_REWARD_KEY] = r
    sync_state(run, prm, optimizer)
    run.log(f"{NAME}/dpo_loss", loss_value)
    run.log(f"{NAME}/pairs", float(len(pairs)))
    run.log(f"{NAME}/pair_accuracy", pair_order_accuracy(r.sum(-1), pairs))
    return oprl_advantage(batch.rewards, batch.group, r, mask, s.alpha, s.eps)
