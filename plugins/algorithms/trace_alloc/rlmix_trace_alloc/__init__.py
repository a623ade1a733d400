"""TRACE (Tree Rollout Allocation for Contrastive Exploration), prompt-level, as an
``rlmix_sample`` wrapper.

The owner samples ``train.group_size`` rollouts per prompt; the rest of the step's budget goes
``chunk`` at a time to the prompt where it most raises the predicted probability that the
prompt's group holds *mixed* terminal rewards (both a success and a failure), the only groups
with a group-relative signal: ``P(mixed | p, m) = 1 - p^m - (1-p)^m``, so prompts predicted
always or never solved gain nothing and hard-but-possible ones gain most. ``p`` is a success
estimate per prompt: a shared predictor (logistic
regression on hashed character-trigram features of the prompt, trained online on every outcome,
kept in ``run.state["trace_alloc"]``) used as a prior of strength ``prior_strength``, updated by
the prompt's own decayed history and its rollouts of this step. The greedy allocator is the
same as XRPO's (``rlmix_xrpo_alloc``).
"""

from __future__ import annotations

import zlib
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.sampling import (
    allocate_by_gain,
    count_rollouts,
    generate,
    pad_id,
    prompt_key,
    regroup,
    score,
)
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "trace_alloc"
MAX_HISTORY = 100_000  # prompts remembered (least recently seen forgotten first)


@dataclass
class Settings:
    budget_per_prompt: int = 0  # rollouts per step / prompts_per_step; 0 = 2 * group_size
    chunk: int = 2  # extra rollouts handed out at a time
    prior_strength: float = 0.5  # pseudo-rollouts the predictor's estimate counts for
    feature_dim: int = 1024  # hashed trigram features of the predictor
    predictor_lr: float = 0.5  # SGD step size of the predictor (per step, on the mean loss)
    history_decay: float = 0.9  # weight of a prompt's own past outcomes each time it returns
    threshold: float = 0.5  # a rollout succeeds when its reward is above this
    key: str = "text"  # prompt identity: "text" or "id"

    def __post_init__(self) -> None:
        if self.budget_per_prompt < 0:
            raise ValueError(f"budget_per_prompt must be >= 0, got {self.budget_per_prompt}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.prior_strength <= 0:
            raise ValueError(f"prior_strength must be > 0, got {self.prior_strength}")
        if self.feature_dim < 8:
            raise ValueError(f"feature_dim must be >= 8, got {self.feature_dim}")
        if self.predictor_lr < 0:
            raise ValueError(f"predictor_lr must be >= 0, got {self.predictor_lr}")
        if not 0.0 <= self.history_decay <= 1.0:
            raise ValueError(f"history_decay must be in [0, 1], got {self.history_decay}")
        if self.key not in ("text", "id"):
            raise ValueError(f"key must be 'text' or 'id', got {self.key!r}")


def features(texts: list[str], dim: int) -> torch.Tensor:
    """``[n, dim]``: hashed character-trigram counts, unit length (a stable hash)."""
    out = torch.zeros(len(texts), dim)
    for i, text in enumerate(texts):
        padded = f"  {text.lower()} "
        for j in range(len(padded) - 2):
            out[i, zlib.crc32(padded[j:j + 3].encode()) % dim] += 1.0
    return out / out.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def mixed_probability(p: float, m: int) -> float:
    """Probability that ``m`` rollouts with success rate ``p`` hold both outcomes:
    ``1 - p^m - (1-p)^m`` (0 for ``m < 2``)."""
    if m < 2:
        return 0.0
    return 1.0 - p ** m - (1.0 - p) ** m


def mixed_gain(p: float, n: int, extra: int, c: int) -> float:
    """How much ``c`` more rollouts (after ``n`` sampled and ``extra`` already planned) raise
    the probability that the prompt's group holds mixed rewards, at predicted success ``p``."""
    return mixed_probability(p, n + extra + c) - mixed_probability(p, n + extra)


def predictor_update(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                     lr: float) -> torch.Tensor:
    """One SGD step of logistic regression (weights ``w`` ``[d + 1]``, last entry the bias) on
    rows ``x`` ``[n, d]`` with outcomes ``y`` ``[n]``; returns the new weights."""
    xb = torch.cat([x, torch.ones(len(x), 1)], 1)
    p = torch.sigmoid(xb @ w)
    return w - lr * xb.T @ (p - y.float()) / max(len(y), 1)


def predict(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(torch.cat([x, torch.ones(len(x), 1)], 1) @ w)


def _text(prompt: Prompt) -> str:
    return "\n".join(m.get("content", "") for m in prompt.messages)


def _state(run: Run, dim: int) -> dict[str, Any]:
    state = run.state.setdefault(NAME, {"rollouts": 0, "extra": {}, "history": {}})
    if state.get("w") is None or state["w"].shape[0] != dim + 1:
        state["w"] = torch.zeros(dim + 1)
    return state


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    _state(run, run.settings(NAME).feature_dim)


@rlmix.hookimpl(wrapper=True)
def rlmix_sample(run: Run, prompts: list[Prompt]
                 ) -> Generator[None, RolloutBatch, RolloutBatch]:
    first = yield
    s: Settings = run.settings(NAME)
    state = _state(run, s.feature_dim)
    k = int(run.config.train.group_size)
    budget = len(prompts) * (s.budget_per_prompt or 2 * k)
    keys = [prompt_key(p, s.key) for p in first.prompts]
    ok = (score(run, first) > s.threshold).tolist()
    order = list(dict.fromkeys(keys))
    by_key = dict(zip(keys, first.prompts))
    wins = dict.fromkeys(order, 0)
    seen = dict.fromkeys(order, 0)
    for key, o in zip(keys, ok):
        wins[key] += int(o)
        seen[key] += 1
    x = features([_text(by_key[q]) for q in order], s.feature_dim)
    prior = predict(state["w"], x).tolist()
    past = {q: state["history"].get(q, (0.0, 0.0)) for q in order}
    p_hat = [(wins[q] + s.history_decay * past[q][0] + s.prior_strength * prior[i])
             / (seen[q] + s.history_decay * past[q][1] + s.prior_strength)
             for i, q in enumerate(order)]
    extra = allocate_by_gain(
        lambda i, e: mixed_gain(p_hat[i], seen[order[i]], e, s.chunk),
        len(order), budget - len(first), s.chunk)
    parts, row_keys = [first], list(keys)
    for q, e in zip(order, extra):
        if e > 0:
            part = generate(run, [by_key[q]], e)
            part_ok = (score(run, part) > s.threshold).tolist()
            wins[q] += sum(part_ok)
            seen[q] += len(part)
            parts.append(part)
            row_keys += [q] * len(part)
    # the shared predictor learns from every outcome of the step
    rows = torch.cat([x[i].expand(seen[q], -1) for i, q in enumerate(order)])
    ys = torch.cat([torch.tensor([1.0] * wins[q] + [0.0] * (seen[q] - wins[q]))
                    for q in order])
    state["w"] = predictor_update(state["w"], rows, ys, s.predictor_lr)
    for q in order:  # the prompt's own decayed history (most recent last, bounded)
        state["history"].pop(q, None)
        state["history"][q] = (s.history_decay * past[q][0] + wins[q],
                               s.history_decay * past[q][1] + seen[q])
    while len(state["history"]) > MAX_HISTORY:
        state["history"].pop(next(iter(state["history"])))
    generated = sum(len(p) for p in parts)
    count_rollouts(run, NAME, generated)
    state["extra"] = dict(zip(order, extra))
    stats = {
        "trace_alloc/rollouts": float(generated),
        "trace_alloc/extra_rollouts": float(sum(extra)),
        "trace_alloc/predicted_success": sum(prior) / max(len(prior), 1)}
    for key, value in stats.items():  # written with the step's metrics
        run.log(key, value)
    return regroup(parts, row_keys, pad_id(run))
