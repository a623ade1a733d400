"""GRPO-RoC (Resample-on-Correct, rStar2-Agent) as an ``rlmix_sample`` wrapper.

Each prompt gets ``oversample * group_size`` rollouts (the owner's ``group_size`` plus the rest
through ``rlmix_generate``); the group is then cut back to ``group_size``: failures are kept
uniformly at random, in proportion to their share of the over-sampled group, and the remaining
slots go to the correct responses of highest quality (fewest tool errors and format issues).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.sampling import count_rollouts, generate, pad_id, prompt_key, regroup, score
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "roc"


@dataclass
class Settings:
    oversample: int = 2  # rollouts per prompt = oversample * group_size, cut back to group_size
    threshold: float = 0.5  # a rollout is correct when its reward is above this
    success_term: str = ""  # "" = the summed reward, or a reward term name ("arith.correct")
    quality_terms: str = ""  # comma-separated reward terms whose sum is a response's quality
    penalty_keys: str = "tool_errors,format_errors"  # numbers in batch.info[i] that cost quality

    def __post_init__(self) -> None:
        if self.oversample < 1:
            raise ValueError(f"oversample must be >= 1, got {self.oversample}")


def quality(terms: dict[str, torch.Tensor], info: list[dict[str, Any]], quality_terms: list[str],
            penalty_keys: list[str]) -> torch.Tensor:
    """``[N]``: the sum of the named reward terms minus the sum of the named per-sample
    penalties (``info[i][key]``, missing = 0). Higher is better."""
    n = len(info)
    q = torch.zeros(n)
    for name in quality_terms:
        if name not in terms:
            raise rlmix.ConfigError(f"roc.quality_terms: {name!r} is not a reward term; the "
                                    f"scorers returned: {', '.join(sorted(terms))}")
        q = q + terms[name].float()
    for key in penalty_keys:
        q = q - torch.tensor([float(row.get(key, 0) or 0) for row in info])
    return q


def resample_on_correct(correct: torch.Tensor, quality: torch.Tensor, keep: int,
                        generator: torch.Generator | None = None) -> list[int]:
    """Indices (sorted) of the ``keep`` rows of one over-sampled group: failures uniformly at
    random, ``round(keep * failures / n)`` of them, and the rest the correct rows of highest
    quality (ties at random). With ``keep >= 2`` a group with both outcomes keeps at least one
    of each; a short side is filled from the other."""
    n = len(correct)
    if keep >= n:
        return list(range(n))
    wrong = (~correct).nonzero().flatten()
    right = correct.nonzero().flatten()
    n_wrong = round(keep * len(wrong) / n)
    if keep >= 2:  # keep the contrast: at least one failure and one success when both exist
        n_wrong = max(n_wrong, 1 if len(wrong) else 0)
        n_wrong = min(n_wrong, keep - (1 if len(right) else 0))
    n_wrong = min(n_wrong, len(wrong))
    n_right = min(len(right), keep - n_wrong)
    n_wrong = keep - n_right
    wrong_kept = wrong[torch.randperm(len(wrong), generator=generator)[:n_wrong]]
    perm = torch.randperm(len(right), generator=generator)  # random order breaks ties
    best = perm[torch.argsort(-quality[right][perm], stable=True)]
    right_kept = right[best[:n_right]]
    return sorted(torch.cat([wrong_kept, right_kept]).tolist())


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    run.state.setdefault(NAME, {"rollouts": 0})


@rlmix.hookimpl(wrapper=True)
def rlmix_sample(run: Run, prompts: list[Prompt]
                 ) -> Generator[None, RolloutBatch, RolloutBatch]:
    first = yield
    s: Settings = run.settings(NAME)
    k = int(run.config.train.group_size)
    parts = [first]
    if s.oversample > 1:
        parts.append(generate(run, prompts, (s.oversample - 1) * k))
    keys = [prompt_key(p) + f"#{i}" for part in parts
            for i, p in zip(part.group.tolist(), part.prompts)]
    generated = sum(len(p) for p in parts)
    count_rollouts(run, NAME, generated)
    batch = regroup(parts, keys, pad_id(run))
    rewards = score(run, batch)
    if s.success_term:
        if s.success_term not in batch.reward_terms:
            raise rlmix.ConfigError(f"roc.success_term: {s.success_term!r} is not a reward term")
        values = batch.reward_terms[s.success_term]
    else:
        values = rewards
    correct = values > s.threshold
    q = quality(batch.reward_terms, batch.info, _names(s.quality_terms), _names(s.penalty_keys))
    gen = torch.Generator().manual_seed(int(run.config.train.seed) * 7907 + run.step)
    rows: list[int] = []
    for g in range(batch.num_groups):
        idx = (batch.group == g).nonzero().flatten()
        rows += idx[resample_on_correct(correct[idx], q[idx], k, gen)].tolist()
    out = batch.select(rows)
    kept_correct = correct[rows]
    stats = {
        "roc/rollouts": float(generated),
        "roc/correct_quality_all": float(q[correct].mean()) if bool(correct.any()) else 0.0,
        "roc/correct_quality_kept": float(q[rows][kept_correct].mean())
        if bool(kept_correct.any()) else 0.0,
        "roc/kept_correct_fraction": float(kept_correct.float().mean())}
    for key, value in stats.items():  # written with the step's metrics
        run.log(key, value)
    return out
