"""OSFT (online supervised fine-tuning on self-generated data): reward-free; each step the model
samples its own responses (one per prompt by default, ``train.group_size: 1``) and is
immediately fine-tuned on them with the token NLL.

The NLL is taken at ``train_temperature`` while the rollouts are sampled at the manifest's
``sampling.temperature``. Our reading: with equal temperatures the expected gradient of the
NLL of one's own samples is exactly 0 (``E_y[grad log p(y)] = 0``), so OSFT samples colder
than it trains; the per-token logit gradient is then ``p_train - p_sample``, which sharpens
the model towards its own modes (right or wrong: see README). When the temperatures differ
the logits come from ``rlmix.distill.completion_logits`` (one more forward).

Declares ``RLMIX_NOT_NEEDED``: a manifest needs no scorer and no advantage owner."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

import rlmix
from rlmix import distill
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, Run

NAME = "osft"
RLMIX_NOT_NEEDED = ("rlmix_score", "rlmix_advantage")


@dataclass
class Settings:
    train_temperature: float = 1.0  # the NLL's temperature (sampling.temperature samples)
    loss_mode: str = "token-mean"

    def __post_init__(self) -> None:
        rlmix.check_choices(self, loss_mode=LOSS_MODES)
        if self.train_temperature <= 0:
            raise ValueError("train_temperature must be > 0")


def self_nll(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-token ``-log softmax(logits / temperature)[token]``."""
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return -logp.gather(-1, tokens[..., None]).squeeze(-1)


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    if abs(s.train_temperature - float(run.config.sampling.temperature)) < 1e-9:
        print(f"rlmix: warning: osft: train_temperature equals sampling.temperature "
              f"({s.train_temperature}); the expected gradient of the NLL of the model's own "
              f"samples is then 0: sample colder (e.g. sampling.temperature 0.6)",
              file=sys.stderr)


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
               ) -> LossTerms:
    s = run.settings(NAME)
    batch = mb.batch
    mask = batch.completion_mask.to(logp.device)
    if abs(s.train_temperature - float(run.config.sampling.temperature)) < 1e-9:
        loss = -logp  # the core's log-probs are at the sampling temperature already
    else:
        first = distill.first_completion_column(batch)
        logits = distill.completion_logits(run, batch)
        per_token = self_nll(logits, batch.tokens[:, first:].to(logits.device),
                             s.train_temperature)
        loss = torch.cat([per_token.new_zeros(len(batch), first), per_token], 1)
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode,
                     metrics={f"{NAME}/nll": float((loss.detach() * mask).sum()
                                                   / mask.sum().clamp(min=1))})
