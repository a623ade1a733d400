"""GAPO: per prompt, the median of the group's highest-SNR reward interval (the "adaptive Q")
replaces the group mean as the advantage baseline, so a reward outlier barely moves the other
samples' advantages."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops
from rlmix.types import RolloutBatch, Run

NAME = "gapo"
INTERVALS = ("snr", "hdi")
SCALES = ("baseline", "group", "none")


@dataclass
class Settings:
    interval: str = "snr"  # snr: the window of highest mean/std; hdi: the narrowest window
    # a window holds at least ceil(min_fraction * G) rewards (>= 2)
    min_fraction: float = rlmix.setting(0.5, gt=0, le=1)
    scale: str = "baseline"  # baseline: RMS deviation around Q | group: the group's std | none
    eps: float = rlmix.setting(1e-6, ge=0)  # added to the scale before dividing

    def __post_init__(self) -> None:
        rlmix.check_choices(self, interval=INTERVALS, scale=SCALES)
        rlmix.check_ranges(self)


RLMIX_GROUP_RELATIVE = True  # the baseline comes from the group's rewards


def min_window(group_size: int, min_fraction: float) -> int:
    """The fewest sorted rewards a candidate window may hold: ``ceil(min_fraction * G)``, at
    least 2 (a lone reward has no noise to measure) and at most ``G``."""
    # the small tolerance keeps e.g. 0.5 * 8 = 4.000000000000001 from rounding up to 5
    return min(group_size, max(2, math.ceil(min_fraction * group_size - 1e-9)))


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else 0.5 * (sorted_values[mid - 1] + sorted_values[mid])


def adaptive_window(values: torch.Tensor, min_size: int, interval: str = "snr",
                    ) -> tuple[int, int]:
    """The chosen window ``[i, j]`` (inclusive) of ``values`` **sorted ascending**.

    Candidates are the contiguous runs of the sorted rewards with at least ``min_size`` members.

    * ``snr``: the run with the highest ``mean / std`` (unbiased std). A run whose rewards all
      agree has no noise: its SNR counts as infinite, above every noisy run. Ties go to the
      longer run, then the lower one.
    * ``hdi``: among runs of exactly ``min_size`` members, the narrowest
      (``values[j] - values[i]``); ties go to the lower run.
    """
    g = len(values)
    if g == 0:
        raise ValueError("adaptive_window needs at least one value")
    if g == 1 or min_size >= g:
        return 0, g - 1
    v = values.to(torch.float64)
    if interval == "hdi":
        widths = (v[min_size - 1:] - v[:g - min_size + 1]).tolist()
        start = min(range(len(widths)), key=lambda k: (widths[k], k))
        return start, start + min_size - 1
    if interval != "snr":
        raise ValueError(f"interval: {interval!r} is not one of {', '.join(INTERVALS)}")
    # prefix sums of values centred on the middle reward (less cancellation in the variance)
    shift = v[g // 2]
    c = v - shift
    s1 = torch.cat([torch.zeros(1, dtype=torch.float64), c.cumsum(0)]).tolist()
    s2 = torch.cat([torch.zeros(1, dtype=torch.float64), (c * c).cumsum(0)]).tolist()
    vals = v.tolist()
    best: tuple[float, int, int] | None = None
    best_window = (0, g - 1)
    for i in range(g - min_size + 1):
        for j in range(i + min_size - 1, g):
            n = j - i + 1
            if vals[j] == vals[i]:  # sorted: equal ends mean every reward in the run agrees
                score = math.inf
            else:
                t1, t2 = s1[j + 1] - s1[i], s2[j + 1] - s2[i]
                var = max((t2 - t1 * t1 / n) / (n - 1), 0.0)
                mean = t1 / n + float(shift)
                score = mean / math.sqrt(var) if var > 0 else math.inf
            key = (score, n, -i)
            if best is None or key > best:
                best, best_window = key, (i, j)
    return best_window


def adaptive_q(rewards: torch.Tensor, group: torch.Tensor, min_fraction: float = 0.5,
               interval: str = "snr") -> torch.Tensor:
    """Each sample's adaptive Q, ``[N]``: the median of its group's chosen window."""
    q = torch.zeros(len(rewards), dtype=torch.float64)
    for g in torch.unique(group).tolist():
        rows = (group == g).nonzero().flatten()
        sorted_values = torch.sort(rewards[rows].to(torch.float64)).values
        i, j = adaptive_window(sorted_values, min_window(len(rows), min_fraction), interval)
        q[rows] = _median(sorted_values[i:j + 1].tolist())
    return q.to(rewards.dtype)


def gapo_advantage(rewards: torch.Tensor, group: torch.Tensor, interval: str = "snr",
                   min_fraction: float = 0.5, scale: str = "baseline",
                   eps: float = 1e-6) -> torch.Tensor:
    """``(r - Q) / (scale + eps)`` with ``Q`` the adaptive Q of the sample's group.

    ``scale``: ``baseline`` is ``sqrt(sum_group (r - Q)^2 / (G - 1))``, the deviation around Q
    (GRPO's std when Q is the mean); ``group`` is the group's unbiased std, as in GRPO; ``none``
    divides by nothing. A group of one sample gets 0."""
    if scale not in SCALES:
        raise ValueError(f"scale: {scale!r} is not one of {', '.join(SCALES)}")
    r = rewards.to(torch.float64)
    centred = r - adaptive_q(r, group, min_fraction, interval)
    if scale == "none":
        return centred.to(rewards.dtype)
    if scale == "group":
        denom = ops.group_std(r, group)
    else:
        sums = torch.zeros(int(group.max()) + 1, dtype=torch.float64).index_add_(
            0, group, centred**2)
        denom = (sums / (ops.group_count(group) - 1).clamp(min=1)).sqrt()[group]
    return (centred / (denom + eps)).to(rewards.dtype)


@rlmix.hookimpl
def rlmix_advantage(run: Run, batch: RolloutBatch) -> torch.Tensor:
    s = run.settings(NAME)
    if batch.rewards is None:
        raise RuntimeError("gapo: the batch has no rewards (no rlmix_score ran)")
    return gapo_advantage(batch.rewards, batch.group, s.interval, s.min_fraction, s.scale,
                          s.eps)
