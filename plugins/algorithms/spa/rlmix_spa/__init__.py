"""SPA (Stepwise Progress Attribution): redistribute the outcome reward over a trajectory's
steps with a progress estimator whose per-step contributions sum to the outcome, and add a
grounding signal for actions that executed validly.

The ``rlmix_advantage`` owner, each step:

1. Steps: every completion token (``steps: tokens``), or the text split at ``step_separator``
   (a token whose decoded text holds the separator ends a step).
2. The progress estimator (a linear head on hashed word features of each step's text, its
   weights in ``run.state["spa"]``, checkpointed) takes ``head_epochs`` SGD passes on
   ``(sum_t c_t - R)^2`` over the batch's trajectories.
3. Intermediate rewards ``r_t = c_t + alpha * g_t``; ``g_t = 1`` when step t's action executed
   validly (``batch.info[i]["valid_steps"]`` from the env, or ``valid_pattern`` on the step's
   text), else 0.
4. Advantages ``[N, T]``: ``r_t`` normalised over the steps of the row's group, spread on the
   step's tokens.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.types import RolloutBatch, Run

NAME = "spa"
STEPS = ("tokens", "separator")


@dataclass
class Settings:
    steps: str = "separator"  # separator (decoded text) | tokens
    step_separator: str = "\n"
    alpha: float = 0.5  # weight of the grounding signal g_t
    valid_pattern: str = ""  # a step is valid when this regex matches its text ("" = use info)
    feature_dim: int = 4096  # hashed features of a step
    head_lr: float = 0.5  # SGD step size of the progress estimator
    head_epochs: int = 20  # passes over each batch
    eps: float = 1e-6

    def __post_init__(self) -> None:
        rlmix.check_choices(self, steps=STEPS)
        if self.alpha < 0 or self.head_lr < 0 or self.head_epochs < 0 or self.feature_dim < 8:
            raise ValueError("alpha, head_lr, head_epochs >= 0 and feature_dim >= 8")
        if not self.step_separator or self.eps <= 0:
            raise ValueError("step_separator must not be empty, eps > 0")
        if self.valid_pattern:
            try:
                re.compile(self.valid_pattern)
            except re.error as exc:
                raise ValueError(f"valid_pattern: {exc}") from None


# ---------------------------------------------------------------- steps


def token_steps(completion_mask: torch.Tensor,
                ends_step: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, T]`` long step index per completion token (-1 elsewhere); a new step starts after
    each token where ``ends_step`` holds (``None``: every token is a step)."""
    mask = completion_mask > 0
    ends = ((mask if ends_step is None else ends_step) & mask).long()
    before = torch.cumsum(ends, 1) - ends
    return torch.where(mask, before, torch.full_like(before, -1))


def step_texts_of(tokens: torch.Tensor, step_ids: torch.Tensor,
                  decode: Callable[[list[int]], str]) -> list[list[str]]:
    """Each row's steps as text (the decoded tokens of each step)."""
    out = []
    for row, ids in zip(tokens.tolist(), step_ids.tolist()):
        steps: dict[int, list[int]] = {}
        for tok, s in zip(row, ids):
            if s >= 0:
                steps.setdefault(s, []).append(tok)
        out.append([decode(steps[k]) for k in sorted(steps)])
    return out


# ---------------------------------------------------------------- the progress estimator


def features(text: str, dim: int) -> torch.Tensor:
    """Hashed lower-case word unigrams and bigrams of a step (CRC32 into ``dim`` buckets),
    scaled to unit length."""
    words = re.findall(r"\S+", text.lower())
    grams = words + [f"{a} {b}" for a, b in zip(words, words[1:])]
    v = torch.zeros(dim)
    for g in grams:
        v[zlib.crc32(g.encode()) % dim] += 1.0
    n = v.norm()
    return v / n if n > 0 else v


def contributions(weights: torch.Tensor, step_feats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per row ``[S_i]``: ``c_t = w . phi(step_t)``."""
    return [f @ weights if len(f) else torch.zeros(0) for f in step_feats]


def fit_progress(weights: torch.Tensor, step_feats: Sequence[torch.Tensor],
                 outcomes: torch.Tensor, lr: float, epochs: int) -> tuple[torch.Tensor, float]:
    """``epochs`` full-batch gradient steps on ``mean_i (sum_t c_t - R_i)^2``; returns the new
    weights and the final loss."""
    rows = [i for i, f in enumerate(step_feats) if len(f)]
    if not rows:
        return weights, 0.0
    summed = torch.stack([step_feats[i].sum(0) for i in rows])  # sum_t phi_t: [n, D]
    target = outcomes[rows].float()
    w = weights.clone()
    loss = 0.0
    for _ in range(epochs):
        err = summed @ w - target
        loss = float((err ** 2).mean())
        w = w - lr * 2.0 * (summed.T @ err) / len(rows)
    err = summed @ w - target
    return w, float((err ** 2).mean()) if epochs else loss


def step_advantages(step_rewards: Sequence[torch.Tensor], group: torch.Tensor,
                    eps: float = 1e-6) -> list[torch.Tensor]:
    """Each row's step rewards normalised over every step of its group (mean, unbiased std)."""
    out = [torch.zeros_like(r) for r in step_rewards]
    for g in group.unique().tolist():
        rows = (group == g).nonzero().flatten().tolist()
        values = torch.cat([step_rewards[i] for i in rows]) if rows else torch.zeros(0)
        if len(values) == 0:
            continue
        mean = values.mean()
        std = values.std() if len(values) > 1 else torch.tensor(0.0)
        for i in rows:
            out[i] = (step_rewards[i] - mean) / (std + eps)
    return out


def spread(per_step: Sequence[torch.Tensor], step_ids: torch.Tensor) -> torch.Tensor:
    """``[N, T]``: each step's value on every token of the step."""
    out = torch.zeros(step_ids.shape)
    for i, values in enumerate(per_step):
        ids = step_ids[i]
        on = ids >= 0
        if len(values):
            out[i, on] = values[ids[on].clamp(max=len(values) - 1)]
    return out


def deciding_rank(contrib: Sequence[torch.Tensor], step: int) -> float:
    """Share of rows whose step ``step`` has the largest ``|c_t|``."""
    rows = [c for c in contrib if len(c) > step]
    if not rows:
        return 0.0
    return sum(int(c.abs().argmax()) == step for c in rows) / len(rows)


# ---------------------------------------------------------------- hooks


def _validity(batch: RolloutBatch, texts: Sequence[Sequence[str]], s: Settings
              ) -> list[torch.Tensor]:
    if s.valid_pattern:
        pattern = re.compile(s.valid_pattern)
        return [torch.tensor([float(bool(pattern.search(t))) for t in row]) for row in texts]
    out = []
    for info, row in zip(batch.info, texts):
        valid = list(info.get("valid_steps", []))[:len(row)]
        valid += [False] * (len(row) - len(valid))
        out.append(torch.tensor([float(bool(v)) for v in valid]))
    return out


@rlmix.hookimpl
def rlmix_advantage(run: Run, batch: RolloutBatch) -> torch.Tensor:
    s: Settings = run.settings(NAME)
    assert batch.rewards is not None
    if s.steps == "tokens":
        ids = token_steps(batch.completion_mask)
        # a token step's text names its step and token id ("p2t3": token 3 at step 2), so the
        # estimator can tell the same token at different steps apart
        texts = [[f"p{k}t{t}" for k, t in enumerate(row[m > 0].tolist())]
                 for row, m in zip(batch.tokens, batch.completion_mask)]
    else:
        tok = run.tokenizer
        cache: dict[int, bool] = {}

        def ends(t: int) -> bool:
            if t not in cache:
                cache[t] = s.step_separator in tok.decode([t])
            return cache[t]

        flags = torch.tensor([[ends(int(t)) for t in row] for row in batch.tokens.tolist()])
        ids = token_steps(batch.completion_mask, flags)
        texts = step_texts_of(batch.tokens, ids, lambda toks: tok.decode(toks))
    feats = [torch.stack([features(t, s.feature_dim) for t in row]) if row
             else torch.zeros(0, s.feature_dim) for row in texts]
    state: dict[str, Any] = run.state.setdefault(NAME, {})
    weights = state.get("weights")
    if weights is None or len(weights) != s.feature_dim:
        weights = torch.zeros(s.feature_dim)
    weights, loss = fit_progress(weights, feats, batch.rewards, s.head_lr, s.head_epochs)
    state["weights"] = weights
    contrib = contributions(weights, feats)
    valid = _validity(batch, texts, s)
    rewards = [c + s.alpha * g for c, g in zip(contrib, valid)]
    adv = spread(step_advantages(rewards, batch.group, s.eps), ids) * batch.completion_mask
    for info, c, g in zip(batch.info, contrib, valid):
        info[NAME] = {"contributions": [round(float(x), 4) for x in c],
                      "valid": [bool(x) for x in g.tolist()]}
    run.log(f"{NAME}/progress_loss", loss)
    run.log(f"{NAME}/valid_rate", float(torch.cat(valid).mean()) if valid and
            sum(len(v) for v in valid) else 0.0)
    return adv
