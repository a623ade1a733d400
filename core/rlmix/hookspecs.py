"""The hook specifications of rlmix: the reference for plugin authors.

Every method in rlmix is a plugin that implements some of these hooks. The core calls them in
the order of DESIGN §2 (see ``rlmix.loop``). Hook kinds:

* **all**: every implementation is called; results are collected in a list.
* **firstresult**: one *owner* answers. Pluggy calls implementations last-registered first and
  stops at the first non-``None`` result; plugins are registered in manifest order, so the owner
  is the plugin listed *last* among those implementing the hook. An owner may return ``None`` to
  decline, which passes the call to the plugin it displaced. ``rlmix config`` prints the owner
  of every hook and what it displaced.
* **wrappers**: an implementation marked ``@rlmix.hookimpl(wrapper=True)`` is a generator that
  yields once and receives the owner's result (``result = yield``); it returns the value to pass
  on (the same object, changed, or a new one). Wrappers compose around the owner: the wrapper
  listed last in the manifest is outermost.

The core's own defaults (``rlmix.defaults``) are plugins registered ``trylast``: any plugin that
implements the same hook takes over.

Shapes: ``N`` samples, ``T`` token columns (prompt + completion, left-padded), ``V`` vocabulary,
``H`` hidden size. All per-token tensors are aligned with ``batch.tokens``: column ``t`` of
``logp`` is the log-probability of ``tokens[:, t]`` given ``tokens[:, :t]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rlmix.types import (
        Episode,
        GenerationRequest,
        HarnessUpdate,
        LossTerms,
        Minibatch,
        Prompt,
        RolloutBatch,
        Run,
    )

PROJECT = "rlmix"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Hooks that a training run cannot do without, and who usually provides them.
REQUIRED_HOOKS: dict[str, str] = {
    "rlmix_prompts": "an env plugin (family rlmix.envs)",
    "rlmix_generate": "a rollout plugin (family rlmix.rollout)",
    "rlmix_score": "an env or reward plugin (family rlmix.envs)",
    "rlmix_advantage": "an algorithm plugin (family rlmix.algorithms)",
    "rlmix_clip": "an algorithm plugin (family rlmix.algorithms)",
}

@hookspec
def rlmix_configure(run: Run) -> None:
    """Read this plugin's settings, check them, allocate what it needs.

    Called once per run, after the model is loaded and before the first step, for every loaded
    plugin, in manifest order (the order of ``plugins:``); implementations marked ``tryfirst``
    come before the others and ``trylast`` ones (the core's defaults, and plugins such as
    ``sequential_gate`` that wrap what others published) after them. A plugin listed later can
    therefore rely on what an earlier one set up. The model is still the full, unwrapped model
    here: take reference copies (``rlmix.policy.frozen_copy``) now. Wrapping or partitioning
    the model (a trainer's engine, ZeRO-3) belongs in ``rlmix_prepare_model``, which runs after
    every ``rlmix_configure`` and, on ``--resume``, after the checkpoint's weights are
    restored. Read your settings with ``run.settings("<your entry-point name>")``: they are
    already validated against your ``Settings`` dataclass. Raise ``rlmix.ConfigError`` (or any
    exception) to stop the run; the CLI reports it with your plugin's name. State that must
    survive a checkpoint goes in ``run.plugin_state("<your name>")`` (a dict in ``run.state``;
    anything ``torch.save`` can pickle); objects that must not be pickled in
    ``run.plugin_resources("<your name>")``.
    """


@hookspec
def rlmix_prepare_model(run: Run) -> None:
    """Wrap, move or partition the model: a trainer plugin's phase (``deepspeed``).

    Called once per run, in manifest order, after every plugin's ``rlmix_configure`` and, when
    the run resumes, after the core restored the checkpoint (weights, optimizer, ``run.state``,
    step), so the model is whole and at its checkpointed weights when it is wrapped. Reference
    copies taken in ``rlmix_configure`` and the asynchronous sampler's copy (taken before this
    phase too) are copies of the full model, never of partitioned parameters. Set
    ``run.policy.model`` to the module the rollout engine should run (``engine.module``). Most
    plugins do not implement this.
    """


@hookspec(firstresult=True)
def rlmix_prompts(run: Run, step: int) -> list[Prompt] | None:
    """Return the next batch of tasks: ``train.prompts_per_step`` ``Prompt`` objects.

    Implemented by env plugins. Build prompt texts from ``run.harness`` components (``system``,
    ``instructions``, ...) so harness-evolution plugins can change them. Must be deterministic
    given ``run.rng`` / ``step`` so that a resumed run sees the same prompts.
    """


@hookspec
def rlmix_select_prompts(run: Run, prompts: list[Prompt]) -> list[Prompt] | None:
    """Choose the prompts a training step samples: return a new list, or ``None`` to keep them.

    Called once per training batch by ``Run.sample`` (so also in the async sampler's worker),
    just before ``rlmix_sample``, never by evaluation, harness scoring or a wrapper's extra
    rounds. Every implementation is called, in manifest order (``tryfirst`` ones first), each
    with the previous one's list. For rollout-allocation plugins that pick which prompts the
    ``rlmix_sample`` owner generates for (``aero``, ``dots``): a pluggy wrapper on
    ``rlmix_sample`` cannot pass new arguments to the owner, and mutating the caller's list
    (``prompts[:] = ...``) changed it under every other plugin. Never change ``prompts`` in
    place. What the matching ``rlmix_sample`` wrapper needs afterwards goes in
    ``run.plugin_resources(name)``.
    """


@hookspec(firstresult=True)
def rlmix_sample(run: Run, prompts: list[Prompt]) -> RolloutBatch | None:
    """Turn prompts into a ``RolloutBatch`` of ``len(prompts) * train.group_size`` samples.

    The core's default (``trylast``) asks ``rlmix_generate`` for ``train.group_size``
    completions per prompt with the manifest's ``sampling`` settings. Rollout schedules that
    filter or over-sample (DAPO's dynamic sampling) implement this hook as a *wrapper*; one that
    decides how generation itself runs (``partial``) owns it. With ``train.max_staleness > 0``
    this hook, and everything it calls, runs in the background sampler thread on the worker's
    copy of the run (its own weights, step and policy version). The batch must
    carry ``tokens``, ``attention_mask``, ``completion_mask``, ``behavior_logp`` (the sampling
    distribution's log-probs, with the sampling temperature applied), ``policy_version`` (the
    version that generated each sample), ``group``, ``texts`` and ``prompts``.

    This is the seam for asynchronous sampling: the loop only ever calls ``Run.sample``.
    """


@hookspec(firstresult=True)
def rlmix_generate(run: Run, request: GenerationRequest) -> RolloutBatch | None:
    """Generate completions for ``request.prompts`` with explicit sampling settings.

    Implemented by rollout engines (``hf``, later vLLM). ``request.n`` completions per prompt,
    ``request.temperature`` (0 = greedy), ``request.top_p``, ``request.top_k`` and
    ``request.max_new_tokens``. Returns a ``RolloutBatch`` whose ``group`` is the prompt index
    and whose rows are ordered prompt-major (all completions of prompt 0 first). Evaluation and
    harness reflection call this directly, so training-time wrappers on ``rlmix_sample``
    (filters, over-sampling) never touch them.
    """


@hookspec
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor] | None:
    """Return reward terms ``{term: Tensor[N]}`` for the batch, or ``None``.

    Every implementation is called. Term names are prefixed by the core with the plugin's
    entry-point name (``correct`` from ``arith`` becomes ``arith.correct``); weights come from
    the manifest's ``score.weights`` (default 1.0). The core writes the weighted sum to
    ``batch.rewards``, the terms to ``batch.reward_terms``, and logs ``reward/<term>``.
    Put per-sample feedback (verifier messages, traces) in ``batch.info[i]``. Every scorer is
    called on its own (there is no owner), so wrappers on this hook are not called: to reshape
    rewards, add a term (a negative weight subtracts it).
    """


@hookspec(firstresult=True)
def rlmix_advantage(run: Run, batch: RolloutBatch) -> torch.Tensor | None:
    """Return advantages, ``Tensor[N]`` (one per sequence) or ``Tensor[N, T]`` (per token).

    One estimator owns this hook; shaping plugins wrap it. Read ``batch.rewards`` and
    ``batch.group``; use ``rlmix.ops`` for group statistics.
    """


@hookspec(firstresult=True)
def rlmix_clip(
    run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
) -> LossTerms | None:
    """Return the policy loss of one minibatch as ``LossTerms``.

    ``mb.batch`` is the minibatch's ``RolloutBatch``; ``logp`` and ``entropy`` are ``[n, T]``
    from the current policy (with gradient). Return the per-token loss, the mask of tokens it
    applies to, the aggregation mode and metrics; the core aggregates with the whole update's
    normalisers (``mb.normalizers``) so that splitting a batch leaves the gradient unchanged.
    Add terms that are not per-token (a value loss) as ``LossTerms.extra`` (a scalar).
    Wrappers add importance corrections, KL or entropy terms to the owner's result.
    """


@hookspec(firstresult=True)
def rlmix_update(run: Run, loss: LossTerms) -> dict[str, float] | None:
    """Backpropagate ``loss.value`` and, on the last minibatch of an update, step the optimizer.

    ``loss.minibatch.last`` says whether this minibatch closes an optimizer step. On a step:
    clip gradients, step, zero gradients, increment ``run.policy_version`` and make the new
    weights visible to the rollout engine. A non-finite loss or gradient skips the step and leaves
    the weights untouched. Returns metrics (``grad_norm``, ``lr``, ``skipped``). The core ships
    a plain torch AdamW default (``trylast``).
    """


@hookspec
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    """Propose new harness text from this step's feedback, or return ``None``.

    Harness plugins read ``batch.texts``, ``batch.rewards`` and ``batch.info`` and return a
    ``HarnessUpdate``. The core applies accepted updates to ``run.harness`` (which the next
    prompts are built from), numbers the version, writes it to the run folder and checkpoints it.
    """


@hookspec
def rlmix_run_end(run: Run) -> None:
    """Called once when ``rlmix.loop.train`` ends: after the last step, or on an exception or
    Ctrl-C, after the asynchronous sampler has stopped and before the logger closes.

    For plugins that hold threads, processes or open files (a background evolution pipeline,
    a service): stop and release them here. Must not raise; the run's state is already final.
    """


@hookspec(firstresult=True)
def rlmix_token_logprobs(
    run: Run, hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Return ``(logp, entropy)`` of ``labels`` under ``lm_head(hidden)``, each ``[n, t]``.

    ``hidden`` is ``[n, t, H]`` (the final hidden state at the positions that predict
    ``labels``); ``labels`` is ``[n, t]``. Apply the sampling temperature
    (``run.config.sampling.temperature``) to the logits, as the rollout did. Kernel plugins avoid
    materialising ``[n, t, V]`` logits; the core ships the plain torch default (``trylast``).
    """


@hookspec
def rlmix_evaluate(run: Run) -> dict[str, float] | None:
    """Evaluate the current policy on held-out data and return ``{metric: value}``.

    Called at the start of training, every ``train.eval_every`` steps, at the end, and by
    ``rlmix eval``. The core logs each metric as ``eval/<metric>``. Use ``run.generate`` (which
    calls ``rlmix_generate``) so training-time sampling wrappers are not applied.
    """


@hookspec
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    """Called after every step with the step's metrics (a dict the hook may add to).

    For logging, checkpointing and step-based schedules. The core's own logger and
    checkpointer are plugins on this hook too.
    """


@hookspec(firstresult=True)
def rlmix_episode(run: Run, prompt: Prompt) -> Episode | None:
    """Return a fresh multi-turn ``Episode`` for one sample of ``prompt``, or ``None``.

    Implemented by env plugins whose tasks take several turns (tool use, games, dialogue).
    A rollout engine that supports multi-turn (``hf``) calls it once per *sample* (``n`` times
    per prompt, so every sample gets its own episode state) before generating. ``None`` (the
    answer for any prompt that is not yours: check ``prompt.info`` or ``prompt.id``) means an
    ordinary single-turn completion. The engine then drives the episode: it templates
    ``episode.reset()`` as the prompt, generates until EOS or one of ``episode.stop_strings``,
    calls ``episode.step(text)`` with the turn's text, appends the returned messages (tool
    results) to the context with the chat template, and generates again, until ``done``, the
    engine's turn limit or its token budget. Everything after the prompt is the completion
    region of one row: ``completion_mask`` is 1 only on model-generated tokens, so env-inserted
    tokens are masked out of the loss. ``batch.info[i]["episode"]`` records the episode:
    ``turns`` (per model turn: ``assistant`` text, ``end`` = ``eos`` | ``stop`` | ``budget``,
    the env's ``messages`` and ``info``), ``stop_reason`` (``done``, ``max_turns``,
    ``max_new_tokens``, ``max_episode_tokens``), ``model_tokens``, ``env_tokens`` and
    ``model_text`` (the model's turns only: score from it, so a tool's output can never supply
    an answer). See ``rlmix.types.Episode`` for the protocol. Engines without multi-turn
    support ignore this hook (scorers then see a plain single-turn completion).
    """


@hookspec(firstresult=True)
def rlmix_completion_logits(
    run: Run, batch: RolloutBatch, messages: list[list[dict[str, str]]] | None
) -> torch.Tensor | None:
    """Return full-vocabulary logits ``[n, T - first, V]`` at the batch's completion columns.

    ``first = rlmix.distill.first_completion_column(batch)``: row ``i``, index ``j`` holds the
    logits that predict ``batch.tokens[i, first + j]`` (prompt + completion, as in
    ``Policy.logprobs``), raw (no temperature). With ``messages`` (one chat per row) the
    completion tokens ``batch.tokens[i, first:]`` are scored after the prompt those messages
    render to instead of the row's own prompt: a teacher under a privileged view (the answer,
    a reference solution, a context) on the student's own tokens. The caller decides the
    gradient: call under ``torch.no_grad()`` for a teacher; without it the logits carry the
    policy's gradient. Losses that need more than the sampled token's log-prob (on-policy
    distillation's per-token KL over the vocabulary) call this through
    ``rlmix.distill.completion_logits`` / ``teacher_logits``; ``rlmix_clip`` itself only gets
    ``logp`` and ``entropy``. The core's default (``trylast``) runs the policy's model; a toy
    or a remote teacher implements it to serve the logits another way.
    """


@hookspec(firstresult=True)
def rlmix_sampler_weights(run: Run, master: Any) -> Any | None:
    """Return the copy of the policy that training rollouts generate with, or ``None``.

    ``master`` is the policy's full model (the trainer's weights). Return an object with
    ``model`` (the module the rollout engine runs: a bf16 copy, one with int8 linears, ...)
    and ``refresh(master)`` (copy the master's current weights into it, in place); subclass
    ``rlmix.sampler_weights.SamplerWeights``. The core calls this once, in
    ``loop.prepare_model`` (after every ``rlmix_configure`` and a resume's restore, before
    ``rlmix_prepare_model``), refreshes the copy before a training rollout whenever
    ``run.policy_version`` moved (logging ``time/sampler_refresh_s``), and runs
    ``rlmix_sample`` on a view of the run whose ``policy.model`` is the copy, so behaviour
    log-probs come from it; with ``train.max_staleness > 0`` it is the async worker's own copy.
    Optionally ``release() -> bool``: called after each synchronous training rollout; a copy
    that freed its weights returns ``True`` and is refreshed (rebuilt) before the next one.
    Evaluation and the training forward keep the master. ``None`` (no plugin): the synchronous
    loop samples with the master itself, the async worker with an fp32 copy.
    """


#: Hooks with a single owner (pluggy ``firstresult``), read from their specifications above.
FIRSTRESULT_HOOKS = tuple(name for name, spec in globals().items()
                          if name.startswith("rlmix_") and spec.rlmix_spec["firstresult"])
