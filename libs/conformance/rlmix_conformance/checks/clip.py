"""Checks of ``rlmix_clip``: ``LossTerms`` shapes, the completion mask, edge batches,
determinism, minibatch-split invariance (full)."""

from __future__ import annotations

import contextlib
import math

import torch

from rlmix import needs
from rlmix.types import RolloutBatch, Run
from rlmix_conformance.batches import (
    _advantages,
    _at,
    _clip,
    _finite_rows,
    _nan_word,
    _normalizers,
    _stale,
    edge_batches,
    kit_batch,
)
from rlmix_conformance.kit import ConformanceFailure, Subject, check


@check("rlmix_clip", "shape")
def _clip_shape(s: Subject) -> None:
    """LossTerms with loss and mask of shape mb.batch.tokens.shape, a known mode, a scalar
    extra, numeric metrics, and a finite loss that depends on logp."""
    run = s.shared()
    batch = kit_batch(run)
    _advantages(run, batch)
    terms, value, logp, _ = _clip(run, batch)
    if not torch.isfinite(value.detach()).all():
        raise ConformanceFailure(f"rlmix_clip gave an aggregated loss of {float(value)} on an "
                                 f"ordinary batch")
    if not value.requires_grad:
        raise ConformanceFailure("rlmix_clip returned a loss with no gradient (detached from "
                                 "logp); build the loss from the logp argument")


@check("rlmix_clip", "mask")
def _clip_mask(s: Subject) -> None:
    """The gradient of the aggregated loss w.r.t. logp and entropy is zero wherever
    completion_mask is 0, and LossTerms.mask stays inside completion_mask."""
    run = s.shared()
    # a loss that declares it does without advantages (rlmix.needs) need not follow them
    follows_advantages = "rlmix_advantage" not in needs.declared(s.obj)
    for stale in (False, True):
        batch = kit_batch(run)
        _advantages(run, batch)
        with _stale(run, batch) if stale else contextlib.nullcontext():
            _clip_mask_on(run, batch, " (samples one policy version old)" if stale else "",
                          follows_advantages)


def _clip_mask_on(run: Run, batch: RolloutBatch, where: str,
                  follows_advantages: bool = True) -> None:
    terms, value, logp, entropy = _clip(run, batch)
    cmask = batch.completion_mask > 0
    outside = (terms.mask.detach() != 0) & ~cmask
    if outside.any():
        row, col = (int(i) for i in outside.nonzero()[0])
        raise ConformanceFailure(f"rlmix_clip returned a mask that is nonzero at "
                                 f"{int(outside.sum())} positions where completion_mask is 0 "
                                 f"(first: row {row}, column {col}){where}; prompt and padding "
                                 f"tokens must not enter the loss: multiply your mask by "
                                 f"mb.batch.completion_mask")
    value.backward()
    for name, leaf in (("logp", logp), ("entropy", entropy)):
        grad = leaf.grad
        if grad is None:
            continue
        if not torch.isfinite(grad).all():
            raise ConformanceFailure(f"the gradient of rlmix_clip's loss w.r.t. {name} has "
                                     f"NaN/inf ({_at(_finite_rows(grad))}){where}")
        leak = (grad != 0) & ~cmask
        if leak.any():
            row, col = (int(i) for i in leak.nonzero()[0])
            raise ConformanceFailure(f"the gradient of rlmix_clip's aggregated loss w.r.t. "
                                     f"{name} is nonzero at {int(leak.sum())} positions where "
                                     f"completion_mask is 0 (first: row {row}, column {col})"
                                     f"{where}; mask every term of the loss, including terms "
                                     f"added to LossTerms.extra")
    adv = batch.token_advantages()
    if follows_advantages and (adv[cmask] != 0).any() and (
            logp.grad is None or not (logp.grad != 0).any()):
        raise ConformanceFailure(f"rlmix_clip's loss has zero gradient w.r.t. logp on a batch "
                                 f"with nonzero advantages{where}; the policy would never learn")


@check("rlmix_clip", "edge")
def _clip_edge(s: Subject) -> None:
    """No NaN or inf in the loss or its gradient on the edge batches."""
    run = s.shared()
    for what, _, batch in edge_batches(run):
        _advantages(run, batch)
        terms, value, logp, entropy = _clip(run, batch)
        if not torch.isfinite(value.detach()).all():
            bad = _finite_rows(terms.loss)
            where = (f"the per-token loss is {_nan_word(terms.loss)} at {_at(bad)}"
                     if bad else "LossTerms.extra is not finite")
            raise ConformanceFailure(f"rlmix_clip gave a {_nan_word(value)} loss on {what}: "
                                     f"{where}; NaN times a 0 mask is still NaN, so guard the "
                                     f"division (clamp counts to >= 1) or use torch.where")
        value.backward()
        for name, leaf in (("logp", logp), ("entropy", entropy)):
            if leaf.grad is not None and not torch.isfinite(leaf.grad).all():
                raise ConformanceFailure(f"the gradient of rlmix_clip's loss w.r.t. {name} is "
                                         f"NaN/inf on {what} ("
                                         f"{_at(_finite_rows(leaf.grad))}); a 0/0 hidden "
                                         f"behind torch.where still poisons the gradient: "
                                         f"clamp the denominator instead")


@check("rlmix_clip", "determinism", level="full")
def _clip_determinism(s: Subject) -> None:
    """Two fresh runs with the same seed give the same per-token loss."""
    losses = []
    for _ in range(2):
        run = s.run()
        batch = kit_batch(run)
        _advantages(run, batch)
        terms, _, _, _ = _clip(run, batch)
        losses.append(terms.loss.detach())
    if not torch.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-7, equal_nan=True):
        raise ConformanceFailure("rlmix_clip is not deterministic: two fresh runs with "
                                 "train.seed=0 give different losses on the same batch")


@check("rlmix_clip", "split", level="full")
def _clip_split(s: Subject) -> None:
    """Splitting a minibatch in two (same normalisers) leaves the loss and gradient unchanged."""
    run = s.shared()
    batch = kit_batch(run)
    _advantages(run, batch)
    with _stale(run, batch):
        _clip_split_on(run, batch)


def _clip_split_on(run: Run, batch: RolloutBatch) -> None:
    norm = _normalizers(run, batch)
    _, full, logp, _ = _clip(run, batch, norm)
    full.backward()
    half = len(batch) // 2
    total, grads = 0.0, []
    for rows in (list(range(half)), list(range(half, len(batch)))):
        part = batch.select(rows)
        _, value, part_logp, _ = _clip(run, part, norm)
        value.backward()
        total += float(value.detach())
        grads.append(part_logp.grad if part_logp.grad is not None
                     else torch.zeros_like(part_logp))
    if not math.isclose(float(full.detach()), total, rel_tol=1e-4, abs_tol=1e-6):
        raise ConformanceFailure(f"splitting a minibatch in two changes the loss "
                                 f"({float(full.detach()):.6g} whole vs {total:.6g} summed over "
                                 f"halves): a row's loss must not depend on the other rows of its "
                                 f"minibatch (train.grad_accum and PPO mini-batches split "
                                 f"batches): no normalising by the minibatch's own counts (the "
                                 f"core divides by mb.normalizers) and no minibatch statistics "
                                 f"such as quantiles (compute them over the whole batch, e.g. "
                                 f"in rlmix_advantage, and carry them in batch.extras)")
    if logp.grad is not None and not torch.allclose(logp.grad, torch.cat(grads), rtol=1e-4,
                                                    atol=1e-6):
        raise ConformanceFailure("splitting a minibatch in two changes the gradient w.r.t. "
                                 "logp; per-token losses must not depend on other rows of the "
                                 "minibatch (compute batch-level statistics in "
                                 "rlmix_advantage)")
