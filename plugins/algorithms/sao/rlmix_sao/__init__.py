"""SAO (Single-rollout Asynchronous Optimization): one rollout per prompt, its baseline from a
small value model V(x) trained online, and strict double-sided token clipping (a token whose
ratio leaves ``[1 - eps_low, 1 + eps_high]`` gets no gradient, whatever its advantage's sign).

The value model is a linear head on hashed unigram and bigram features of the prompt's token
ids (unit norm), so it needs no forward of the policy and generalises across prompts that share
tokens; it is trained by SGD on the squared error to the observed rewards *after* the batch's
advantages are taken (a sample's own reward never enters its baseline), and checkpointed in
``run.state["sao"]``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlmix
from rlmix import distill, ops
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, RolloutBatch, Run

NAME = "sao"


@dataclass
class Settings:
    eps_low: float = 0.2  # ratio below 1 - eps_low: no gradient
    eps_high: float = 0.2  # ratio above 1 + eps_high: no gradient
    feature_dim: int = 4096  # hashed prompt-feature buckets of the value head
    value_lr: float = 0.5  # SGD step of the value head (features have unit norm)
    value_steps: int = 1  # value-head updates per training step
    loss_mode: str = "seq-mean-token-mean"
    old_logp: str = "auto"  # what the ratio divides by (rlmix.ops.old_logprobs)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, loss_mode=LOSS_MODES, old_logp=ops.OLD_LOGP_CHOICES)
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError("eps_low must be in [0, 1) and eps_high >= 0")
        if self.feature_dim < 1 or self.value_lr <= 0 or self.value_steps < 1:
            raise ValueError("feature_dim and value_steps must be >= 1, value_lr > 0")


def double_sided_surrogate(logp: torch.Tensor, old_logp: torch.Tensor,
                           advantages: torch.Tensor, eps_low: float, eps_high: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``-r A`` inside ``[1 - eps_low, 1 + eps_high]`` and a constant (no gradient)
    outside, for either sign of ``A``; also returns the mask of tokens outside. The gradient in
    ``logp`` is ``-r A`` inside, so its magnitude never exceeds ``(1 + eps_high) |A|``."""
    ratio = torch.exp(logp - old_logp)
    outside = ops.outside_band(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.where(outside, -(ratio.detach() * advantages), -(ratio * advantages))
    return loss, outside


def prompt_features(batch: RolloutBatch, dim: int) -> torch.Tensor:
    """``[N, dim]`` unit-norm hashed counts of each row's prompt token ids (unigrams and
    bigrams of the attended columns before the first completion column)."""
    first = distill.first_completion_column(batch)
    feats = torch.zeros(len(batch), dim)
    for i in range(len(batch)):
        ids = batch.tokens[i, :first][batch.attention_mask[i, :first] > 0].tolist()
        for a in ids:
            feats[i, (a * 1_000_003 + 17) % dim] += 1.0
        for a, b in zip(ids, ids[1:], strict=False):
            feats[i, (a * 1_000_003 + b * 9_176_459 + 29) % dim] += 1.0
    return feats / feats.norm(dim=-1, keepdim=True).clamp(min=1e-12)


class ValueHead:
    """``V(x) = w . phi(x) + b``, trained by SGD on the squared error."""

    def __init__(self, dim: int, state: dict | None = None) -> None:
        state = state or {}
        self.w = state.get("w", torch.zeros(dim)).clone()
        self.b = float(state.get("b", 0.0))

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        return feats @ self.w + self.b

    def fit(self, feats: torch.Tensor, rewards: torch.Tensor, lr: float, steps: int) -> float:
        """SGD on ``mean((V - r)^2) / 2``; returns the squared error before the update."""
        mse = float(((self(feats) - rewards) ** 2).mean())
        for _ in range(steps):
            err = self(feats) - rewards
            self.w -= lr * feats.T @ err / len(rewards)
            self.b -= lr * float(err.mean())
        return mse

    def state(self) -> dict:
        return {"w": self.w.clone(), "b": self.b}


def value_advantage(head: ValueHead, feats: torch.Tensor, rewards: torch.Tensor
                    ) -> torch.Tensor:
    """``r - V(x)`` with the head as it is before seeing these rewards."""
    return rewards - head(feats)


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    run.state.setdefault(NAME, ValueHead(s.feature_dim).state())


@rlmix.hookimpl
def rlmix_advantage(run: Run, batch: RolloutBatch) -> torch.Tensor:
    s = run.settings(NAME)
    assert batch.rewards is not None
    head = ValueHead(s.feature_dim, run.state.get(NAME))
    feats = prompt_features(batch, s.feature_dim)
    rewards = batch.rewards.float()
    advantages = value_advantage(head, feats, rewards)
    run.log(f"{NAME}/value_mse", head.fit(feats, rewards, s.value_lr, s.value_steps))
    run.state[NAME] = head.state()
    return advantages


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
               ) -> LossTerms:
    s = run.settings(NAME)
    batch = mb.batch
    mask = batch.completion_mask.to(logp.device)
    old = ops.old_logprobs(run, batch, logp, s.old_logp)
    loss, outside = double_sided_surrogate(logp, old, batch.token_advantages().to(logp.device),
                                           s.eps_low, s.eps_high)
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode, metrics={
        "clip/fraction": float(ops.masked_mean(outside.float(), mask)),
        "entropy": float(ops.masked_mean(entropy.detach(), mask))})
