"""DAPO dynamic sampling: drops groups whose rewards all agree and samples fresh prompts to
refill the batch.

A wrapper on ``rlmix_sample``: groups with no reward spread carry no group-relative signal, so
they are dropped and fresh prompts are sampled until the batch again holds
``train.prompts_per_step`` groups, for at most ``max_rounds`` extra rounds."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "dapo.dynamic_sampling"
#: extra round ``k`` of step ``s`` asks the env for the prompts of step ``-(s * STRIDE + k)``
ROUND_STRIDE = 1000
METRICS = ("dropped_groups", "extra_rounds", "kept_groups", "short_groups", "sampled_groups")


@dataclass
class Settings:
    max_rounds: int = 4  # extra sampling rounds per step at most (0 = only filter)
    metric: str = ""  # what must vary within a group: "" = the summed reward, or a term name
    tol: float = 1e-6  # a group whose values span no more than this "agrees"

    def __post_init__(self) -> None:
        if not 0 <= self.max_rounds < ROUND_STRIDE:
            raise ValueError(f"max_rounds must be in [0, {ROUND_STRIDE}), got {self.max_rounds}")
        if self.tol < 0:
            raise ValueError(f"tol must be >= 0, got {self.tol}")


def informative_groups(values: torch.Tensor, group: torch.Tensor, tol: float = 1e-6
                       ) -> torch.Tensor:
    """``[G]`` bool: True for groups whose values differ (max - min > tol). A group of one sample
    never differs."""
    g = int(group.max()) + 1 if len(group) else 0
    v = values.to(torch.float64)
    high = torch.full((g,), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, group, v, reduce="amax")
    low = torch.full((g,), torch.inf, dtype=torch.float64).scatter_reduce(
        0, group, v, reduce="amin")
    return (high - low) > tol


def extra_prompt_key(step: int, round_: int) -> int:
    """The ``step`` argument of ``rlmix_prompts`` for extra round ``round_`` (1, 2, ...) of
    training step ``step``: negative, so it never collides with a real step (0, 1, ...), and
    distinct for every (step, round) with ``round_ < ROUND_STRIDE``, so prompts stay
    deterministic and a resumed run sees the same ones."""
    if not 1 <= round_ < ROUND_STRIDE:
        raise ValueError(f"round must be in [1, {ROUND_STRIDE}), got {round_}")
    return -(step * ROUND_STRIDE + round_)


def _judged(run: Run, batch: RolloutBatch, metric: str) -> torch.Tensor:
    from rlmix.loop import score  # the core's scoring: every scorer, manifest weights

    score(run, batch)
    if not metric:
        assert batch.rewards is not None
        return batch.rewards
    if metric not in batch.reward_terms:
        raise rlmix.ConfigError(f"plugin '{NAME}': metric {metric!r} is not a reward term; the "
                                f"scorers returned: {', '.join(sorted(batch.reward_terms))}")
    return batch.reward_terms[metric]


def _regroup(batch: RolloutBatch, keep: list[int]) -> RolloutBatch:
    """The rows of groups ``keep`` (in order), renumbered 0..len(keep)-1."""
    new_index = {g: i for i, g in enumerate(keep)}
    rows = [i for i, g in enumerate(batch.group.tolist()) if g in new_index]
    out = batch.select(rows)
    out.group = torch.tensor([new_index[g] for g in out.group.tolist()], dtype=torch.long)
    return out


def _inner_sampler(run: Run) -> Any:
    """``rlmix_sample`` without this wrapper and the wrappers outside it: the owner and the
    wrappers listed before this one, as they ran for the step's first batch."""
    impls = run.pm.hook.rlmix_sample.get_hookimpls()  # call order is the reverse of this list
    mine = next((i for i, impl in enumerate(impls) if impl.function is rlmix_sample), None)
    if mine is None:  # pragma: no cover - registered under another object; fall back to name
        mine = next(i for i, impl in enumerate(impls) if impl.plugin_name == NAME)
    return run.pm.subset_hook_caller("rlmix_sample",
                                     remove_plugins=[impl.plugin for impl in impls[mine:]])


def _pad_id(run: Run) -> int:
    tok = run.tokenizer
    pad = getattr(tok, "pad_token_id", None) if tok is not None else None
    return int(pad) if pad is not None else 0


@rlmix.hookimpl(wrapper=True)
def rlmix_sample(run: Run, prompts: list[Prompt]
                 ) -> Generator[None, RolloutBatch, RolloutBatch]:
    first = yield
    s = run.settings(NAME)
    target = int(run.config.train.prompts_per_step)
    kept: list[RolloutBatch] = []
    counts = dict.fromkeys(METRICS, 0)

    def absorb(batch: RolloutBatch) -> None:
        informative = informative_groups(_judged(run, batch, s.metric), batch.group, s.tol)
        counts["sampled_groups"] += len(informative)
        counts["dropped_groups"] += int((~informative).sum())
        room = target - counts["kept_groups"]
        keep = torch.nonzero(informative).flatten().tolist()[:max(room, 0)]
        if keep:
            kept.append(_regroup(batch, keep))
            counts["kept_groups"] += len(keep)

    absorb(first)
    sampler = None
    while counts["kept_groups"] < target and counts["extra_rounds"] < s.max_rounds:
        counts["extra_rounds"] += 1
        fresh = run.hook.rlmix_prompts(run=run,
                                       step=extra_prompt_key(run.step, counts["extra_rounds"]))
        if not fresh:
            break
        sampler = sampler or _inner_sampler(run)
        more = sampler(run=run, prompts=fresh)
        if more is None:
            raise RuntimeError(f"plugin '{NAME}': no plugin returned a batch for an extra round")
        absorb(more)
    counts["short_groups"] = max(0, target - counts["kept_groups"])
    state = run.state.setdefault(NAME, {"total_dropped_groups": 0, "total_extra_rounds": 0})
    state["total_dropped_groups"] += counts["dropped_groups"]
    state["total_extra_rounds"] += counts["extra_rounds"]
    for key, value in counts.items():  # written with the step's metrics
        run.log(f"dapo/{key}", float(value))
    if not kept:
        # nothing informative after every round: train on the first batch (its group-centred
        # advantages are all 0, so the policy gradient is 0), and say so in dapo/short_groups
        return first
    if len(kept) == 1 and counts["dropped_groups"] == 0 and kept[0].num_groups == first.num_groups:
        return first  # nothing dropped, nothing added
    return RolloutBatch.concat(kept, pad_token_id=_pad_id(run))
