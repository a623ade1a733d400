"""Checks of ``rlmix_advantage``: shape and dtype, edge batches, determinism."""

from __future__ import annotations

from typing import Any

import torch

from rlmix.types import RolloutBatch
from rlmix_conformance.batches import (
    _at,
    _finite_rows,
    _nan_word,
    _same,
    _shape,
    edge_batches,
    kit_batch,
)
from rlmix_conformance.kit import ConformanceFailure, Subject, check


def _check_advantage(adv: Any, batch: RolloutBatch, where: str) -> torch.Tensor:
    n, width = batch.tokens.shape
    if not isinstance(adv, torch.Tensor):
        raise ConformanceFailure(f"rlmix_advantage returned {type(adv).__name__}{where}; "
                                 f"expected a tensor of shape ({n},) or ({n}, {width})")
    if tuple(adv.shape) not in ((n,), (n, width)):
        raise ConformanceFailure(f"rlmix_advantage returned shape {_shape(adv)}{where}; expected "
                                 f"({n},) or ({n}, {width}) = (len(batch),) or batch.tokens.shape")
    if not adv.is_floating_point():
        raise ConformanceFailure(f"rlmix_advantage returned dtype {adv.dtype}{where}; expected "
                                 f"a floating-point tensor")
    return adv


@check("rlmix_advantage", "shape")
def _advantage_shape(s: Subject) -> None:
    """Advantages are float [N] or [N, T], finite, and the batch's rewards are left as they
    were."""
    run = s.shared()
    batch = kit_batch(run)
    assert batch.rewards is not None
    rewards = batch.rewards.clone()
    tokens = batch.tokens.clone()
    adv = _check_advantage(run.hook.rlmix_advantage(run=run, batch=batch), batch, "")
    bad = _finite_rows(adv)
    if bad:
        raise ConformanceFailure(f"rlmix_advantage returned {_nan_word(adv)} at "
                                 f"{_at(bad)} on an ordinary batch")
    if not torch.equal(batch.rewards, rewards) or not torch.equal(batch.tokens, tokens):
        raise ConformanceFailure("rlmix_advantage changed batch.rewards or batch.tokens in "
                                 "place; return new advantages and leave the batch's data as "
                                 "it was (to reshape rewards, add an rlmix_score term)")


@check("rlmix_advantage", "edge")
def _advantage_edge(s: Subject) -> None:
    """No NaN or inf on a group of identical rewards, a single-token completion, an empty
    completion row."""
    run = s.shared()
    for what, rows, batch in edge_batches(run):
        adv = _check_advantage(run.hook.rlmix_advantage(run=run, batch=batch), batch,
                               f" on {what}")
        bad = _finite_rows(adv)
        if bad:
            hint = ("guard the division by the group's std (add eps to it)"
                    if "identical" in what else
                    "guard divisions by a row's token count (clamp it to >= 1)")
            at = "" if sorted(bad) == sorted(rows) else f" (at {_at(bad)})"
            raise ConformanceFailure(f"rlmix_advantage returned {_nan_word(adv)} on {what}"
                                     f"{at}; {hint}")


@check("rlmix_advantage", "determinism", level="full")
def _advantage_determinism(s: Subject) -> None:
    """Two fresh runs with the same seed give the same advantages."""
    outs = []
    for _ in range(2):
        run = s.run()
        batch = kit_batch(run)
        outs.append(run.hook.rlmix_advantage(run=run, batch=batch))
    if _same(outs[0], outs[1]):
        raise ConformanceFailure("rlmix_advantage is not deterministic: two fresh runs with "
                                 "train.seed=0 give different advantages on the same batch; "
                                 "draw randomness from run.rng or a torch.Generator seeded from "
                                 "run.config.train.seed")
