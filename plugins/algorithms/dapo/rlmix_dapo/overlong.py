"""DAPO soft overlong punishment: a reward term that penalises completions near the length limit.

The term ``penalty`` (logged as ``reward/dapo.overlong.penalty``) is 0 up to
``max_length - cache_length`` completion tokens, falls linearly to -1 over the last
``cache_length`` tokens, and is -1 beyond ``max_length``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlmix
from rlmix.types import RolloutBatch, Run

NAME = "dapo.overlong"
#: DAPO's cache is 4096 of 20480 tokens; a cache_length of 0 takes the same share of max_length
DEFAULT_CACHE_SHARE = 0.2


@dataclass
class Settings:
    max_length: int = 0  # L_max, completion tokens; 0 = sampling.max_new_tokens
    cache_length: int = 0  # L_cache; 0 = round(0.2 * L_max), at least 1

    def __post_init__(self) -> None:
        if self.max_length < 0 or self.cache_length < 0:
            raise ValueError("max_length and cache_length must be >= 0 (0 = default)")
        if self.max_length and self.cache_length > self.max_length:
            raise ValueError(f"cache_length ({self.cache_length}) must be <= max_length "
                             f"({self.max_length})")


def overlong_penalty(lengths: torch.Tensor, max_length: int, cache_length: int) -> torch.Tensor:
    """DAPO's R_length(|y|): 0 if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) /
    L_cache`` if ``L_max - L_cache < |y| <= L_max``; -1 if ``|y| > L_max``."""
    if cache_length < 1 or cache_length > max_length:
        raise ValueError(f"need 1 <= cache_length <= max_length, got {cache_length}, "
                         f"{max_length}")
    lengths = lengths.to(torch.float32)
    expected = float(max_length - cache_length)
    soft = (expected - lengths) / cache_length
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths), soft)
    return torch.where(lengths > max_length, torch.full_like(lengths, -1.0), penalty)


def limits(run: Run) -> tuple[int, int]:
    """``(L_max, L_cache)`` with the defaults resolved against the manifest."""
    s = run.settings(NAME)
    max_length = s.max_length or int(run.config.sampling.max_new_tokens)
    cache_length = s.cache_length or max(1, round(DEFAULT_CACHE_SHARE * max_length))
    return max_length, cache_length


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    max_length, cache_length = limits(run)
    if not 1 <= cache_length <= max_length:
        raise rlmix.ConfigError(f"plugin '{NAME}': cache_length ({cache_length}) must be "
                                f"between 1 and max_length ({max_length})")


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    max_length, cache_length = limits(run)
    lengths = batch.completion_mask.sum(-1)
    return {"penalty": overlong_penalty(lengths, max_length, cache_length)}
