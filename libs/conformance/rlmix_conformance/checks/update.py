"""Checks of ``rlmix_update``: a step, no step on a NaN gradient, gradient accumulation."""

from __future__ import annotations

import contextlib
import io

import torch

from rlmix import loop
from rlmix.testing import standins
from rlmix_conformance.checks.every_plugin import _step
from rlmix_conformance.kit import ConformanceFailure, Subject, check


@check("rlmix_update", "step")
def _update_step(s: Subject) -> None:
    """An optimizer step bumps policy_version by one, changes the weights, clears gradients,
    and returns numeric stats."""
    run = s.run()
    assert run.policy is not None
    before = [p.detach().clone() for p in run.policy.model.parameters()]
    metrics = _step(s, run)
    if run.policy_version != 1:
        raise ConformanceFailure(f"after one optimizer step run.policy_version is "
                                 f"{run.policy_version}; rlmix_update must increment it by one "
                                 f"on the minibatch with loss.minibatch.last")
    if all(torch.equal(a, p.detach()) for a, p in zip(before, run.policy.model.parameters())):
        raise ConformanceFailure("rlmix_update did not change the policy's weights on an "
                                 "optimizer step")
    stale = [n for n, p in run.policy.model.named_parameters()
             if p.grad is not None and bool((p.grad != 0).any())]
    if stale:
        raise ConformanceFailure(f"rlmix_update left gradients in .grad after the optimizer "
                                 f"step ({stale[0]}, ...); zero them so the next step does not "
                                 f"accumulate them")
    del metrics


@check("rlmix_update", "nan")
def _update_nan(s: Subject) -> None:
    """A NaN loss skips the optimizer step: weights and policy_version untouched."""
    run = s.run(probes={standins.POISON: standins.Poison})
    assert run.policy is not None
    before = [p.detach().clone() for p in run.policy.model.parameters()]
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the core's skipped-step warning
            loop.train_step(run)
    except Exception as exc:  # noqa: BLE001
        raise ConformanceFailure(f"rlmix_update raised on a NaN loss ({type(exc).__name__}: "
                                 f"{exc}); skip the step and carry on") from None
    changed = not all(torch.equal(a, p.detach())
                      for a, p in zip(before, run.policy.model.parameters()))
    if changed or run.policy_version != 0:
        raise ConformanceFailure("rlmix_update stepped on a NaN loss; when the loss or the "
                                 "gradient is not finite, skip the optimizer step and leave the "
                                 "weights and run.policy_version untouched")


@check("rlmix_update", "accumulation", level="full")
def _update_accumulation(s: Subject) -> None:
    """With train.grad_accum=2 one optimizer step is taken (on the last minibatch), and it
    moves the weights as the unsplit step does."""
    runs = []
    for accum in (1, 2):
        run = s.run([f"train.grad_accum={accum}"])
        _step(s, run)
        runs.append(run)
    if runs[1].policy_version != 1:
        raise ConformanceFailure(f"with train.grad_accum=2 one update bumped policy_version to "
                                 f"{runs[1].policy_version}; step the optimizer only when "
                                 f"loss.minibatch.last is True")
    lr = float(runs[0].config.train.lr)
    for (name, a), b in zip(runs[0].policy.model.named_parameters(),  # type: ignore[union-attr]
                            runs[1].policy.model.parameters()):  # type: ignore[union-attr]
        if not torch.allclose(a, b, rtol=1e-4, atol=4 * lr):
            raise ConformanceFailure(f"gradient accumulation over 2 minibatches moves {name} "
                                     f"differently from the unsplit update; accumulate "
                                     f"gradients and step once, on loss.minibatch.last")
