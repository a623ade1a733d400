"""The weights training rollouts are generated with: the sampler's copy of the policy.

By default the synchronous loop samples with the trainer's own model (no copy) and the async
worker (``train.max_staleness > 0``) with a full-precision copy (``SamplerWeights``). A plugin
that implements ``rlmix_sampler_weights(run, master)`` returns another copy instead (a bf16 or
int8 one: ``lowbit_rollout``); then:

* the core builds it once in ``loop.prepare_model`` (from the full model, after a resume
  restored the checkpoint, before ``rlmix_prepare_model`` wraps the model);
* before a training rollout, whenever ``run.policy_version`` moved since the copy's last refresh
  (so once after each step's optimizer step(s)), the copy is refreshed from the master weights
  (``refresh(master)``); the time it took is logged as ``time/sampler_refresh_s``;
* ``Run.sample`` runs ``rlmix_sample`` on a view of the run whose ``policy.model`` is the copy,
  so every engine that generates with ``run.policy.model`` (``hf``, ``speculative``,
  ``partial``) samples with it and records its behaviour log-probs;
* in async mode the background worker's own copy is this object (not a second one), refreshed
  under the weights lock;
* evaluation (``Run.generate`` outside ``Run.sample``) and the training forward use the master;
* a copy may also have ``release() -> bool``: after each synchronous training rollout the core
  calls it (``after_rollout``), and a copy that freed its weights returns ``True``; the core
  then marks it stale (``version = -1``), so the next training rollout refreshes it first
  (``refresh`` must rebuild what ``release`` freed). The copy then takes no memory while the
  trainer's forward and backward run, which is where a step's memory peaks. The async worker
  samples while the trainer trains and never calls it.

The copy is derived state: it is never checkpointed, and a resumed run rebuilds it.
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Any

import torch

from rlmix.policy import frozen_copy

if TYPE_CHECKING:  # pragma: no cover
    from rlmix.types import Run

REFRESH_METRIC = "time/sampler_refresh_s"


class SamplerWeights:
    """A sampler copy: ``model`` (the module the rollout engine runs) and ``refresh(master)``
    (copy the master's current weights in). This base class is the full-precision copy the
    async worker uses by default; plugins subclass it or return any object with the same two
    members. ``version`` is the ``policy_version`` of the weights it holds (the core sets it)."""

    def __init__(self, master: Any) -> None:
        self.model = frozen_copy(master)
        self.version = -1

    @torch.no_grad()
    def refresh(self, master: Any) -> None:
        src = master.state_dict()
        for name, tensor in self.model.state_dict().items():
            tensor.copy_(src[name])


def build(run: Run) -> Any:
    """The ``rlmix_sampler_weights`` owner's copy of ``run.policy.model`` (or ``None``: sample
    with the master), its ``version`` set to the run's current one."""
    assert run.policy is not None
    hook = getattr(run.hook, "rlmix_sampler_weights", None)
    weights = hook(run=run, master=run.policy.model) if hook is not None else None
    if weights is None:
        return None
    for member in ("model", "refresh"):
        if not hasattr(weights, member):
            raise TypeError(f"rlmix_sampler_weights returned {type(weights).__name__}, which has "
                            f"no '{member}' (a sampler copy needs .model and .refresh(master))")
    weights.version = run.policy_version
    return weights


def refresh(run: Run, weights: Any) -> None:
    """Copy the policy's model into ``weights`` now, mark it with the run's version and log
    the seconds it took (``time/sampler_refresh_s``)."""
    assert run.policy is not None
    t0 = time.perf_counter()
    weights.refresh(run.policy.model)
    run.log(REFRESH_METRIC, time.perf_counter() - t0)
    weights.version = run.policy_version


def after_rollout(run: Run, weights: Any) -> None:
    """A synchronous training rollout on ``weights`` is done: let the copy free its memory
    until the next one (``release()``, where it has one and returns ``True``; see above)."""
    release = getattr(weights, "release", None)
    if callable(release) and release():
        weights.version = -1  # holds no weights now: the next rollout's view refreshes it


def sampling_view(run: Run) -> Run:
    """The run as a synchronous training rollout sees it: the policy's model swapped for the
    sampler copy, refreshed first if the master moved since. Everything else is shared, as in
    the async worker's view."""
    weights = run.sampler_weights
    assert weights is not None and run.policy is not None
    if weights.version != run.policy_version:
        refresh(run, weights)
    view = copy.copy(run)
    view.policy = copy.copy(run.policy)
    view.policy.model = weights.model
    view.sampler_weights = None
    view.async_sampler = None
    return view
