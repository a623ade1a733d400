"""The core's own default plugins, registered ``trylast`` so any plugin takes over.

* ``rlmix_sample``: ``train.group_size`` completions per prompt through ``rlmix_generate``.
* ``rlmix_update``: AdamW, gradient clipping, accumulation over minibatches, NaN/inf skip; or,
  with ``train.optimizer_in_backward``, each parameter stepped inside the backward as soon as
  its gradient is ready (no gradient memory held for the whole model).
* ``rlmix_token_logprobs``: plain torch (full logits).
* ``rlmix_completion_logits``: the policy's forward (``rlmix.distill``).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from rlmix import distill
from rlmix import plugins as _plugins
from rlmix.errors import ConfigError
from rlmix.hookspecs import hookimpl
from rlmix.policy import plain_token_logprobs
from rlmix.types import LossTerms, Prompt, RolloutBatch, Run

NAME = "rlmix.defaults"


def adamw(params: list[torch.nn.Parameter], **kwargs: Any) -> torch.optim.AdamW:
    """AdamW, fused (one kernel over every tensor) where torch supports it for these
    parameters: the same update as the per-tensor loop (to the last bit or so), 3-5x faster on
    a CPU; otherwise the per-tensor loop."""
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(params, **kwargs)


@hookimpl(trylast=True)
def rlmix_configure(run: Run) -> None:
    owner = next((n for n, w in _plugins.implementers(run.pm, "rlmix_update") if not w), None)
    if owner == NAME and run.optimizer is None and run.policy is not None:
        train = run.config.train
        params = [p for p in run.policy.model.parameters() if p.requires_grad]
        run.optimizer = adamw(params, lr=float(train.lr),
                              betas=(float(train.adam_beta1), float(train.adam_beta2)),
                              weight_decay=float(train.weight_decay))
        run.state.setdefault(NAME, {"skipped_steps": 0, "optimizer_steps": 0})
        if bool(train.optimizer_in_backward):  # the manifest checked it can be honoured
            run.plugin_resources(NAME)[IN_BACKWARD] = StepInBackward(run.optimizer, params)
    elif bool(run.config.train.optimizer_in_backward) and owner != NAME:
        raise ConfigError(f"train.optimizer_in_backward is a mode of the core's default "
                          f"rlmix_update, but {owner!r} implements rlmix_update")


IN_BACKWARD = "in_backward"  # run.plugin_resources("rlmix.defaults")


class StepInBackward:
    """AdamW applied to each parameter inside the backward, the moment its gradient has been
    accumulated, after which the gradient is freed: the full set of gradients (one more copy of
    the weights) never exists at once. Without clipping and with one backward per update this
    is the same update as stepping after the backward (AdamW is per element), hence the
    restrictions ``manifest.validate_core`` checks (``train.max_grad_norm: 0``,
    ``train.grad_accum: 1``).

    One optimizer over all parameters is kept (its ``state_dict`` is what checkpoints save, as
    in the usual mode); calling its ``step`` while exactly one parameter holds a gradient
    updates exactly that parameter. Hooks only act while ``armed``, i.e. inside the default
    ``rlmix_update``'s backward, so other backward passes (a plugin's probe, a test) never
    step the weights."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]):
        self.optimizer = optimizer
        self.armed = False
        self.sq_norm = 0.0
        self.nonfinite = 0
        self.stepped = 0
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def _hook(self, param: torch.Tensor) -> None:
        if not self.armed or param.grad is None:
            return
        norm = float(torch.linalg.vector_norm(param.grad))
        if math.isfinite(norm):
            self.sq_norm += norm * norm
            self.optimizer.step()  # only this parameter holds a gradient now
            self.stepped += 1
        else:
            self.nonfinite += 1
        param.grad = None

    def backward(self, value: torch.Tensor, lr: float) -> None:
        _set_lr(self.optimizer, lr)
        self.sq_norm, self.nonfinite, self.stepped = 0.0, 0, 0
        self.armed = True
        try:
            value.backward()
        finally:
            self.armed = False


@hookimpl(trylast=True)
def rlmix_sample(run: Run, prompts: list[Prompt]) -> RolloutBatch:
    s = run.config.sampling  # through rlmix_generate, as Run.generate does
    return run.generate(prompts, n=int(run.config.train.group_size),
                        temperature=float(s.temperature), top_p=float(s.top_p),
                        top_k=int(s.top_k), max_new_tokens=int(s.max_new_tokens))


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _skipped(run: Run, state: dict[str, Any], cause: str) -> dict[str, Any]:
    """Count and announce an optimizer step not taken (the weights are unchanged)."""
    state["skipped_steps"] += 1
    print(f"rlmix: warning: step {run.step + 1}: {cause}; optimizer step skipped, weights "
          f"unchanged ({state['skipped_steps']} skipped so far)", file=sys.stderr)
    return {"update/skipped": 1.0}


def _stepped(run: Run, state: dict[str, Any], lr: float) -> dict[str, Any]:
    """Count an optimizer step taken: one more policy version."""
    state["optimizer_steps"] += 1
    run.policy_version += 1
    return {"update/skipped": 0.0, "update/lr": lr}


def lr_scale(done: int, warmup: int, schedule: str, total: int) -> float:
    """The learning-rate multiplier of the optimizer step after ``done`` steps: linear warm-up
    over ``warmup`` steps, then 1 (``constant``) or a linear decay that reaches 0 after ``total``
    steps (``linear``: ``(total - done) / (total - warmup)``, so the first step after warm-up
    takes the full rate and the last one 1/(total - warmup) of it, as Hugging Face's linear
    schedule does)."""
    if warmup > 0 and done < warmup:
        return min(1.0, (done + 1) / warmup)
    if schedule == "linear":
        return max(0.0, (total - done) / max(1, total - warmup))
    return 1.0


def _lr_at(run: Run) -> float:
    train = run.config.train
    done = run.state.get(NAME, {}).get("optimizer_steps", 0)
    # optimizer steps the run will take: one per update of every epoch of every step
    total = int(train.steps) * int(train.epochs) * int(train.updates_per_epoch)
    scale = lr_scale(done, int(train.warmup_steps), str(train.get("lr_schedule", "constant")),
                     total)
    return float(train.lr) * scale


@hookimpl(trylast=True)
def rlmix_update(run: Run, loss: LossTerms) -> dict[str, Any]:
    if run.optimizer is None:
        raise RuntimeError("the default rlmix_update has no optimizer (was rlmix_configure run?)")
    state = run.state.setdefault(NAME, {"skipped_steps": 0, "optimizer_steps": 0})
    value = loss.value
    assert value is not None
    finite = bool(torch.isfinite(value.detach()).all())
    in_backward = run.plugin_resources(NAME).get(IN_BACKWARD)
    if in_backward is not None:
        return _update_in_backward(run, in_backward, value, finite, state)
    if finite:
        value.backward()
    else:
        state["pending_bad"] = True  # poison the whole accumulated update
    mb = loss.minibatch
    if mb is not None and not mb.last:
        return {}  # the optimizer steps after the update's last chunk
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    max_norm = float(run.config.train.max_grad_norm)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        params, max_norm if max_norm > 0 else math.inf, error_if_nonfinite=False)
    if state.pop("pending_bad", False) or not bool(torch.isfinite(grad_norm)):
        # leave the weights untouched: drop the gradients, do not step
        stats = _skipped(run, state, "non-finite loss or gradient")
    else:
        lr = _lr_at(run)
        _set_lr(run.optimizer, lr)
        run.optimizer.step()
        stats = _stepped(run, state, lr)
    run.optimizer.zero_grad(set_to_none=True)
    return {**stats, "update/grad_norm": float(grad_norm)}


def _update_in_backward(run: Run, stepper: StepInBackward, value: torch.Tensor, finite: bool,
                        state: dict[str, Any]) -> dict[str, Any]:
    if not finite:
        return _skipped(run, state, "non-finite loss")
    lr = _lr_at(run)
    stepper.backward(value, lr)
    run.optimizer.zero_grad(set_to_none=True)  # parameters outside the graph, if any
    if stepper.nonfinite:
        # parameters already stepped keep their update: the backward cannot be taken back
        print(f"rlmix: warning: step {run.step + 1}: {stepper.nonfinite} parameter(s) had a "
              f"non-finite gradient and were not updated (train.optimizer_in_backward "
              f"updates the others)", file=sys.stderr)
    stats = _stepped(run, state, lr)
    stats["update/grad_norm"] = math.sqrt(stepper.sq_norm)
    stats["update/nonfinite_params"] = float(stepper.nonfinite)
    return stats


@hookimpl(trylast=True)
def rlmix_token_logprobs(run: Run, hidden: torch.Tensor, lm_head: torch.nn.Module,
                         labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return plain_token_logprobs(hidden, lm_head, labels,
                                float(run.config.sampling.temperature),
                                getattr(run.policy, "lm_head_dtype", None))


@hookimpl(trylast=True)
def rlmix_completion_logits(run: Run, batch: RolloutBatch,
                            messages: list[list[dict[str, str]]] | None) -> torch.Tensor:
    return distill.policy_completion_logits(run, batch, messages)
