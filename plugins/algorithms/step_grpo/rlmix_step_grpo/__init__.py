"""Step-GRPO's Step-Aware Relative Reward: split each completion into reasoning steps at
linguistic markers and line breaks, and penalise a correct completion for every step it takes
beyond its group's baseline (the median step count of the group's correct completions).

The plugin adds one reward term, ``penalty`` (``reward/step_grpo.penalty``), which is never
positive, so with the default weight 1.0 it subtracts from the env's correctness reward.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import rlmix
from rlmix.types import RolloutBatch, Run

NAME = "step_grpo"
BASELINES = ("median", "mean", "min")
DEFAULT_MARKERS = ("Step \\d+", "First", "Second", "Third", "Next", "Then", "Finally",
                   "Wait", "Alternatively", "Hmm", "Therefore")


@dataclass
class Settings:
    coef: float = 0.2  # penalty per unit of excess (relative: per baseline's worth of steps)
    baseline: str = "median"  # the group's baseline step count: median | mean | min
    relative: bool = True  # excess measured as (steps - baseline) / baseline
    cap: float = 1.0  # the excess is capped here, so the penalty never exceeds coef * cap
    markers: list[str] = field(default_factory=lambda: list(DEFAULT_MARKERS))  # regexes
    newlines: bool = True  # every line break also starts a step
    correct_term: str = "auto"  # auto | "" (every sample) | "<plugin>.<term>"
    correct_threshold: float = 0.5  # a completion is correct when that term is above this

    def __post_init__(self) -> None:
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline: {self.baseline!r} is not allowed; choose one of "
                             f"{', '.join(BASELINES)}")
        if self.coef < 0 or self.cap < 0:
            raise ValueError("coef and cap must be >= 0")
        for m in self.markers:
            try:
                re.compile(m)
            except re.error as exc:
                raise ValueError(f"markers: {m!r} is not a regular expression ({exc})") from None
        if self.correct_term not in ("auto", "") and "." not in self.correct_term:
            raise ValueError(f"correct_term: {self.correct_term!r} must be 'auto', '' or "
                             f"'<plugin>.<term>' (e.g. arith.correct)")


def _marker_split(markers: Sequence[str], newlines: bool) -> re.Pattern[str] | None:
    """Where a marker opens a sentence: after ``. ! ? ; :`` and whitespace, or (when line
    breaks are not steps by themselves) after a line break."""
    if not markers:
        return None
    alternatives = "|".join(f"(?:{m})" for m in markers)
    starts = r"(?<=[.!?;:])\s+" if newlines else r"(?:(?<=[.!?;:])\s+|\s*\n\s*)"
    return re.compile(f"{starts}(?=(?:{alternatives})\\b)")


def split_steps(text: str, markers: Sequence[str] = DEFAULT_MARKERS,
                newlines: bool = True) -> list[str]:
    """The reasoning steps of ``text``: with ``newlines``, every line is a step and a marker
    opening a sentence inside a line starts another; without, only markers (at the start of a
    sentence or a line) start steps. Markers are case-sensitive regexes matched on a word
    boundary ("Then" splits "... 7. Then add", not "and then" or "Thenceforth"). Empty
    segments are not steps."""
    pattern = _marker_split(markers, newlines)
    lines = re.split(r"\n+", text) if newlines else [text]
    steps: list[str] = []
    for line in lines:
        parts = pattern.split(line) if pattern is not None else [line]
        steps.extend(p.strip() for p in parts if p.strip())
    return steps


def count_steps(texts: Sequence[str], markers: Sequence[str] = DEFAULT_MARKERS,
                newlines: bool = True) -> torch.Tensor:
    return torch.tensor([float(len(split_steps(t, markers, newlines))) for t in texts])


def step_penalty(steps: torch.Tensor, group: torch.Tensor, eligible: torch.Tensor | None = None,
                 coef: float = 0.2, baseline: str = "median", relative: bool = True,
                 cap: float = 1.0) -> torch.Tensor:
    """``-coef * min(cap, excess_i)`` for eligible samples, 0 for the others, where
    ``excess_i = max(0, steps_i - b_g)`` (divided by ``max(b_g, 1)`` when ``relative``) and
    ``b_g`` is the median / mean / min step count of the eligible samples of sample ``i``'s
    group. ``eligible`` (the correct completions) defaults to every sample; a group with no
    eligible sample gets 0."""
    if baseline not in BASELINES:
        raise ValueError(f"baseline: {baseline!r} is not one of {', '.join(BASELINES)}")
    eligible = torch.ones_like(steps, dtype=torch.bool) if eligible is None else eligible.bool()
    out = torch.zeros_like(steps, dtype=torch.float32)
    for g in group.unique().tolist():
        rows = ((group == g) & eligible).nonzero().flatten()
        if len(rows) == 0:
            continue
        values = steps[rows].tolist()
        b = {"median": statistics.median, "mean": statistics.fmean, "min": min}[baseline](values)
        excess = (steps[rows].float() - b).clamp(min=0)
        if relative:
            excess = excess / max(float(b), 1.0)
        out[rows] = -coef * excess.clamp(max=cap)
    return out


def _correctness(run: Run, batch: RolloutBatch, s: Settings) -> torch.Tensor | None:
    """Which samples are correct, from another scorer's term; None = treat all as eligible.

    Reads the term from ``batch.reward_terms`` (the core fills it as scorers return); a scorer
    listed after this one is asked through ``loop.scorer_terms``, which keeps what it returns in
    the batch, so the core does not score it a second time."""
    from rlmix import loop

    if s.correct_term == "":
        return None
    if s.correct_term == "auto":
        plugins = [impl.plugin_name for impl in run.pm.hook.rlmix_score.get_hookimpls()
                   if impl.plugin_name != NAME and not (impl.wrapper or impl.hookwrapper)]
    else:
        plugins = [s.correct_term.rpartition(".")[0]]
    for plugin in plugins:
        terms = loop.scorer_terms(run, batch, plugin)
        name = f"{plugin}.correct" if s.correct_term == "auto" else s.correct_term
        if name in terms:
            return terms[name] > s.correct_threshold
    if s.correct_term == "auto":
        return None
    raise rlmix.ConfigError(f"step_grpo.correct_term: no loaded scorer returned "
                            f"{s.correct_term!r}")


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s: Settings = run.settings(NAME)
    if s.correct_term not in ("auto", ""):
        plugin = s.correct_term.rpartition(".")[0]
        if plugin not in run.plugin_names:
            raise rlmix.ConfigError(f"step_grpo.correct_term: {s.correct_term!r} names plugin "
                                    f"{plugin!r}, which is not in the manifest's plugins")


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    s: Settings = run.settings(NAME)
    steps = count_steps(batch.texts, s.markers, s.newlines)
    correct = _correctness(run, batch, s)
    penalty = step_penalty(steps, batch.group, correct, s.coef, s.baseline, s.relative, s.cap)
    for info, n in zip(batch.info, steps.tolist()):
        info[NAME] = {"steps": int(n)}
    return {"penalty": penalty}
