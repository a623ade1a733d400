"""Asynchronous sampling with bounded staleness (``train.max_staleness > 0``).

A background thread samples the batches of future steps while the trainer trains on the current
one. Design:

* **Its own weights.** The worker generates with a private copy of the policy (the run's
  sampler copy from ``rlmix_sampler_weights`` when a plugin gives one, e.g. a bf16 or int8
  copy, else a deep copy of the model; and a copy of the tokenizer, whose fast backend is not
  safe to share between threads). Before
  each generation call it refreshes the copy from the trainer's weights under ``weights_lock``;
  the trainer holds the same lock around every ``rlmix_update``, so a generation step never sees
  half-updated weights, and the copy's ``policy_version`` is exactly the version of its weights.
* **Bounded staleness.** Staleness of a sample = the trainer's ``policy_version`` when it starts
  the step that trains on the sample minus the sample's ``policy_version``. With ``u`` optimizer
  steps per training step (``train.epochs * train.updates_per_epoch``), the batch of step ``s``
  is generated only once the trainer has asked for the batch of step ``s - max_staleness // u``
  (so its weights are at least that step's), which bounds staleness by ``max_staleness``; the
  trainer checks the bound on every batch it takes and fails loudly if an update owner bumped
  ``policy_version`` more often than ``u`` per step.
* **Prompts in step order.** The worker asks ``rlmix_prompts(run, s)`` for ``s = step, step+1,
  ...`` with a view of the run whose ``step`` is ``s`` (env plugins are deterministic per step),
  and calls ``rlmix_sample`` (with its wrappers) on the same view, whose ``policy`` is the
  worker's copy and whose ``policy_version`` is the copy's version. Scoring, advantages and the
  update stay on the trainer side. Harness updates reach the prompts the worker builds next, so
  prompts may lag a harness update by up to the lead.
* **Clean shutdown.** An exception in the worker is re-raised by the trainer when it asks for
  the next batch (``AsyncSamplingError``, chained to the cause); an exception or Ctrl-C in the
  trainer stops the worker: ``close`` sets a stop flag that every forward pass of the worker's
  model checks (so a generation call in progress ends within one token), then joins the thread.
* **Checkpoints.** The trainer pauses the worker between generation calls while it writes a
  checkpoint (``paused``), so plugin state in ``run.state`` is pickled consistently. Batches
  buffered ahead of the trainer are not checkpointed: a resumed run starts a fresh worker at the
  checkpoint's step and samples those steps again with the restored weights. Sample-side plugins
  that keep state ahead of the trainer (``partial``) keep what they need to give back the
  samples of steps not yet trained (see its README).

``max_staleness = 0`` never starts a worker: the loop is exactly the synchronous one.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any

import torch

from rlmix import sampler_weights
from rlmix.types import RolloutBatch, Run

THREAD_NAME = "rlmix-async-sampler"
_POLL_S = 0.05


class AsyncSamplingError(RuntimeError):
    """The background sampler failed; ``__cause__`` is its exception."""


class _Stopped(BaseException):
    """Raised inside the worker's model forward to abandon a generation call on shutdown."""


def updates_per_step(run: Run) -> int:
    """Optimizer steps (policy-version bumps) one training step makes with the default update."""
    train = run.config.train
    return max(1, int(train.epochs) * max(1, int(train.updates_per_epoch)))


class AsyncSampler:
    """Samples the batches of steps ``run.step, run.step + 1, ...`` in a background thread, at
    most ``max_staleness`` policy versions ahead of the trainer. Use ``start`` / ``close``; the
    trainer calls ``take(run)`` once per step and wraps every ``rlmix_update`` in
    ``weights_lock``."""

    def __init__(self, run: Run, max_staleness: int) -> None:
        assert run.policy is not None, "async sampling needs a loaded policy"
        self.run = run
        self.max_staleness = int(max_staleness)
        self.lead = self.max_staleness // updates_per_step(run)  # steps the worker may run ahead
        self.last_step = int(run.config.train.steps)
        self.weights_lock = threading.RLock()
        # held by the worker during a generation call; re-entrant, because a wrapper on
        # rlmix_prompts running in the worker (routing, retrieval) renders prompts under other
        # harnesses through rlmix_harness.prompts_under, which pauses the sampler again
        self._pause_lock = threading.RLock()
        self._cond = threading.Condition()
        # step -> (batch, the worker's weights version when its generation call started)
        self._buffer: dict[int, tuple[RolloutBatch, int]] = {}
        self._next_step = run.step  # the next step the worker samples
        self._wanted = run.step  # the step the trainer asked for last
        self._wanted_version = run.policy_version  # the trainer's version when it asked
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._error_step = -1
        self._thread: threading.Thread | None = None
        # the worker's weights: the run's sampler copy (rlmix_sampler_weights: a low-precision
        # one) when a plugin gave one, else the fp32 copy taken before rlmix_prepare_model (from
        # the full model) when the loop took one, else a copy taken now
        early = run.resources.pop(EARLY_COPY, None)
        self.weights = (run.sampler_weights or early
                        or sampler_weights.SamplerWeights(run.policy.model))
        self.policy = copy.copy(run.policy)
        self.policy.model = self.weights.model
        self.policy.tokenizer = copy.deepcopy(run.policy.tokenizer)
        self.version = run.policy_version
        self._hook = self.policy.model.register_forward_pre_hook(self._check_stop)
        self.stats = {"weight_syncs": 0}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> AsyncSampler:
        self._thread = threading.Thread(target=self._work, name=THREAD_NAME, daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 60.0) -> None:
        """Stop the worker (abandoning a generation call in progress) and join it."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():  # pragma: no cover - a plugin blocking outside torch
                raise AsyncSamplingError(f"the async sampler did not stop within {timeout} s")
        self._hook.remove()
        self._buffer.clear()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ trainer side

    def take(self, run: Run) -> RolloutBatch:
        """The batch of step ``run.step``: waits for the worker, re-raises its failure, and
        checks the staleness bound."""
        step = run.step
        with self._cond:
            self._wanted, self._wanted_version = step, run.policy_version
            self._cond.notify_all()
            while step not in self._buffer:
                if self._error is not None:
                    raise AsyncSamplingError(
                        f"the async sampler failed while sampling step {self._error_step}: "
                        f"{type(self._error).__name__}: {self._error}") from self._error
                if self._thread is None or not self._thread.is_alive():
                    raise AsyncSamplingError(f"the async sampler stopped before step {step}")
                self._cond.wait(_POLL_S)
            batch, version = self._buffer.pop(step)
            self._cond.notify_all()
        # the invariant: the weights that started this batch's generation call are at most
        # max_staleness versions old (carried-over partial segments are older by design)
        stale = run.policy_version - version
        if stale > self.max_staleness:
            raise AsyncSamplingError(
                f"step {step}: the batch was sampled with weights {stale} policy versions old, "
                f"over train.max_staleness={self.max_staleness}; the update owner bumped "
                f"policy_version more than train.epochs * train.updates_per_epoch = "
                f"{updates_per_step(run)} times per step")
        return batch

    def paused(self) -> contextlib.AbstractContextManager:
        """Hold the worker between generation calls (for a consistent checkpoint): ``with``
        it, the worker's lock is held."""
        return self._pause_lock

    # ------------------------------------------------------------------ worker side

    def _check_stop(self, module: Any, args: Any) -> None:
        if self._stop.is_set():
            raise _Stopped()

    def _refresh(self) -> None:
        """Copy the trainer's weights into the worker's model if they changed. While the
        trainer is inside ``rlmix_update`` the worker keeps its copy when that copy is already
        recent enough for the bound (at least the version the trainer had when it asked for its
        current step); otherwise it waits for the update to finish."""
        run = self.run
        with self._cond:
            needed = self._wanted_version
        if not self.weights_lock.acquire(blocking=self.version < needed):
            return
        try:
            if run.policy_version == self.version and self.stats["weight_syncs"]:
                return
            sampler_weights.refresh(run, self.weights)  # logs time/sampler_refresh_s
            self.version = run.policy_version
            self.stats["weight_syncs"] += 1
        finally:
            self.weights_lock.release()

    def view(self, step: int) -> Run:
        """The run as the worker's hooks see it: step ``step``, the worker's policy copy and
        its version, and its own copy of the harness (a routing or retrieval wrapper swaps the
        harness while it renders; the trainer, evaluating meanwhile, must not see that);
        everything else (config, plugins, state, resources) shared."""
        view = copy.copy(self.run)
        view.harness = dict(self.run.harness)
        view.policy = self.policy
        view.policy_version = self.version
        view.step = step
        view.async_sampler = None
        view.sampler_weights = None  # the view's policy already is the copy
        return view

    def _wait_turn(self, step: int) -> bool:
        with self._cond:
            while not self._stop.is_set():
                if step - self._wanted <= self.lead:
                    return True
                self._cond.wait(_POLL_S)
        return False

    def _work(self) -> None:
        step = self._next_step
        try:
            while step < self.last_step and self._wait_turn(step):
                with self._pause_lock:
                    if self._stop.is_set():
                        break
                    self._refresh()
                    view = self.view(step)
                    prompts = view.hook.rlmix_prompts(run=view, step=step)
                    if not prompts:
                        raise RuntimeError("rlmix_prompts returned no prompts")
                    with torch.no_grad():
                        batch = view.sample(prompts)
                with self._cond:
                    self._buffer[step] = (batch, self.version)
                    self._cond.notify_all()
                step += 1
                self._next_step = step
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer thread
            with self._cond:
                self._error, self._error_step = exc, step
                self._cond.notify_all()


EARLY_COPY = "rlmix.async_sampling.model_copy"  # core-internal resources key


def take_model_copy(run: Run) -> None:
    """Copy the policy's model for the worker now, before a trainer plugin wraps or partitions
    it in ``rlmix_prepare_model`` (a ZeRO-3 model's parameters are empty shards); the sampler
    built by ``start`` uses this copy."""
    assert run.policy is not None
    run.resources[EARLY_COPY] = sampler_weights.SamplerWeights(run.policy.model)


def start(run: Run, max_staleness: int | None = None) -> AsyncSampler:
    """Attach and start a worker for ``run`` (``train`` does this when ``max_staleness > 0``;
    tests may start one with ``max_staleness=0``: a worker in lock-step with the trainer)."""
    k = int(run.config.train.max_staleness) if max_staleness is None else int(max_staleness)
    run.async_sampler = AsyncSampler(run, k)
    return run.async_sampler.start()


def stop(run: Run) -> None:
    """Stop and detach the run's worker, if any."""
    sampler = run.async_sampler
    run.async_sampler = None
    if sampler is not None:
        sampler.close()


def staleness_metrics(version: int, batch: RolloutBatch) -> dict[str, float]:
    """``staleness/mean`` and ``staleness/max``: the trainer's version minus each sample's."""
    if not len(batch):
        return {"staleness/mean": 0.0, "staleness/max": 0.0}
    stale = (version - batch.policy_version).float()
    return {"staleness/mean": float(stale.mean()), "staleness/max": float(stale.max())}


def weights_guard(run: Run) -> contextlib.AbstractContextManager:
    """What the trainer holds around ``rlmix_update``: the worker's weights lock, or nothing."""
    sampler = run.async_sampler
    return sampler.weights_lock if sampler is not None else contextlib.nullcontext()
