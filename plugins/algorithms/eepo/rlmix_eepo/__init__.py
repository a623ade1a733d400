"""EEPO (Exploration-Enhanced Policy Optimization): two-stage rollouts with adaptive unlearning.

An ``rlmix_sample`` owner: for each prompt it samples the first half of the group, takes one
temporary gradient step that lowers the log-likelihood of those responses (unlearning, its step
size scaled by how confident the policy was in them), samples the second half from the unlearned
weights, and restores the weights exactly (a bit-identical copy taken before the step).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import rlmix
from rlmix.sampling import count_rollouts, generate, pad_id, regroup
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "eepo"


@dataclass
class Settings:
    first_fraction: float = 0.5  # share of the group sampled before the unlearning step
    unlearn_lr: float = 1.0e-3  # SGD step size of the unlearning step
    adaptive: bool = True  # scale the step by the first half's confidence exp(mean token logp)
    max_grad_norm: float = 1.0  # clip the unlearning gradient (0 = no clipping)

    def __post_init__(self) -> None:
        if not 0.0 < self.first_fraction < 1.0:
            raise ValueError(f"first_fraction must be in (0, 1), got {self.first_fraction}")
        if self.unlearn_lr < 0:
            raise ValueError(f"unlearn_lr must be >= 0, got {self.unlearn_lr}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {self.max_grad_norm}")


def split_group(group_size: int, first_fraction: float) -> tuple[int, int]:
    """``(first, second)`` completions per prompt; each at least 1 when ``group_size >= 2``."""
    first = min(max(1, round(group_size * first_fraction)), max(group_size - 1, 1))
    return first, group_size - first


def unlearning_loss(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(loss, confidence)``: the loss is the mean over sequences of each sequence's mean token
    log-prob (descending it makes the sampled responses less likely); the confidence is
    ``exp`` of the mean token log-prob over all tokens (the geometric-mean token probability)."""
    mask = mask.float()
    per_seq = (logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    mean_logp = float((logp.detach() * mask).sum() / mask.sum().clamp(min=1))
    return per_seq.mean(), math.exp(mean_logp)


def distinct_rows(batch: RolloutBatch) -> list[int]:
    """The first row of every distinct (prompt, completion) pair: each sampled response is
    unlearned once, however often it was drawn (so the step suppresses what was sampled instead
    of following the score-function average, which is zero in expectation)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    rows = []
    for i in range(len(batch)):
        mask = batch.completion_mask[i] > 0
        key = (int(batch.group[i]), tuple(batch.tokens[i][mask].tolist()))
        if key not in seen:
            seen.add(key)
            rows.append(i)
    return rows


@contextmanager
def restored(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Anything done to ``params`` (values and ``.grad``) inside the block is undone on exit,
    bit for bit."""
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v, g in zip(params, saved, grads):
                p.copy_(v)
                p.grad = g


def unlearning_step(params: list[torch.nn.Parameter], loss: torch.Tensor, lr: float,
                    max_grad_norm: float = 0.0) -> float:
    """One SGD step ``p <- p - lr * grad(loss)`` (gradient clipped to ``max_grad_norm`` when it
    is > 0). Returns the gradient norm before clipping."""
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    norm = float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads)))
    scale = lr
    if max_grad_norm > 0 and norm > max_grad_norm:
        scale = lr * max_grad_norm / norm
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(scale * g.to(p.dtype))
    return norm


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    if int(run.config.train.group_size) < 2:
        raise rlmix.ConfigError("eepo needs train.group_size >= 2 (two stages per group)")
    run.state.setdefault(NAME, {"rollouts": 0})


@rlmix.hookimpl
def rlmix_sample(run: Run, prompts: list[Prompt]) -> RolloutBatch:
    s: Settings = run.settings(NAME)
    if run.policy is None:
        raise RuntimeError("eepo: the run has no policy to unlearn on")
    n1, n2 = split_group(int(run.config.train.group_size), s.first_fraction)
    first = generate(run, prompts, n1)
    params = [p for p in run.policy.model.parameters() if p.requires_grad]
    stats: dict[str, float] = {}
    with restored(params):
        with torch.enable_grad():
            target = first.select(distinct_rows(first))
            logp, _ = run.policy.logprobs(run, target)
            loss, confidence = unlearning_loss(logp, target.completion_mask.to(logp.device))
            lr = s.unlearn_lr * (confidence if s.adaptive else 1.0)
            stats["eepo/grad_norm"] = unlearning_step(params, loss, lr, s.max_grad_norm)
        stats["eepo/confidence"] = confidence
        stats["eepo/unlearn_lr"] = lr
        second = generate(run, prompts, n2)
    second.policy_version = torch.full_like(second.policy_version, run.policy_version)
    keys = [str(g) for g in first.group.tolist()] + [str(g) for g in second.group.tolist()]
    batch = regroup([first, second], keys, pad_id(run))
    count_rollouts(run, NAME, len(batch))
    stats["eepo/rollouts"] = float(len(batch))
    for key, value in stats.items():  # written with the step's metrics
        run.log(key, value)
    return batch
