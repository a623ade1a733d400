"""The event loop of DESIGN §2, and building a ``Run`` from a manifest.

Sampling sits behind ``Run.sample`` (one call): with ``train.max_staleness > 0`` a background
worker (``rlmix.async_sampling``) samples ahead of the trainer, with bounded staleness. Nothing
here knows about any method.
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlmix import (
    async_sampling,
    checkpoint,
    manifest,
    needs,
    observe,
    ops,
    preflight,
    runfolder,
    sampler_weights,
)
from rlmix import plugins as plugin_loading
from rlmix.errors import ManifestError, PluginError, origin
from rlmix.hookspecs import REQUIRED_HOOKS
from rlmix.policy import Policy, load_model, resolve_autocast
from rlmix.types import HarnessUpdate, RolloutBatch, Run


def prepare(cfg: DictConfig, extra_plugins: dict[str, Any] | None = None,
            required: dict[str, str] | None = None,
            ) -> tuple[Run, list[plugin_loading.LoadedPlugin]]:
    """Validate the manifest, load and register its plugins, check hook ownership.

    Everything here happens before any model loads, so manifest mistakes fail fast."""
    core = manifest.validate_core(cfg)  # types, choices and declared ranges
    loaded = plugin_loading.load(list(core.plugins), extra_plugins)
    settings = manifest.validate_plugin_blocks(cfg, loaded, set(plugin_loading.installed()))
    resolved = manifest.resolved(cfg, core, settings)
    pm = plugin_loading.new_plugin_manager()
    plugin_loading.register(pm, loaded)
    if core.train.mode == "harness-only" and required is None:
        # no weight updates: nothing needs advantages or a policy loss
        required = {k: v for k, v in REQUIRED_HOOKS.items()
                    if k not in ("rlmix_advantage", "rlmix_clip")}
    # a reward-free method declares RLMIX_NOT_NEEDED (rlmix.needs) instead of a core branch
    plugin_loading.check_required(pm, needs.required_hooks([p.obj for p in loaded], required))
    preflight.check(core, pm, settings)  # the plugins as a set, sizes, memory, device
    out_dir = Path(core.out or Path("runs") / core.name)
    run = Run(config=resolved, pm=pm, settings_by_plugin=settings, out_dir=out_dir,
              plugin_names=list(core.plugins), harness=dict(core.harness))
    run.rng.seed(core.train.seed)
    return run, loaded


def load_policy(run: Run) -> None:
    pol = run.config.policy
    if int(pol.threads) > 0:
        torch.set_num_threads(int(pol.threads))
    device = pol.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(int(run.config.train.seed))
    random.seed(int(run.config.train.seed))
    model, tok = load_model(str(run.config.model), str(pol.dtype))
    if pol.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    autocast, line = resolve_autocast(str(pol.autocast), device)
    if line is not None:
        runfolder.note(run.out_dir, line)
    run.policy = Policy(model, tok, device=device, autocast=autocast,
                        share_prefix=bool(pol.share_prefix),
                        gradient_checkpointing=bool(pol.gradient_checkpointing),
                        lm_head_autocast=bool(pol.lm_head_autocast))


def manifest_order(impls: list[Any]) -> list[Any]:
    """Hook implementations in the order a phase runs them: ``tryfirst`` ones, then the rest,
    then ``trylast`` ones (the core's defaults, and plugins that must see the others' work),
    each group in registration order, which is manifest order. (``get_hookimpls`` lists them
    in pluggy's storage order, trylast first.)"""
    first = [i for i in impls if i.tryfirst]
    last = [i for i in impls if i.trylast and not i.tryfirst]
    return first + [i for i in impls if not (i.tryfirst or i.trylast)] + last


def configure(run: Run) -> None:
    """Each plugin's ``rlmix_configure``, in call order. A failure becomes one error naming
    the plugin and hook it escaped (the innermost, when one plugin's configure calls another
    plugin's hook), a ``ManifestError`` when it was one (a plugin's ConfigError)."""
    _phase(run, "rlmix_configure")


def _phase(run: Run, hook_name: str) -> None:
    """Every implementation of ``hook_name`` in manifest order; a failure is named by the mark
    it carries (``errors.origin``), never by searching its text."""
    for impl in manifest_order(getattr(run.pm.hook, hook_name).get_hookimpls()):
        try:
            impl.function(run=run)
        except Exception as exc:
            plugin, hook = origin(exc) or (impl.plugin_name, hook_name)
            detail = str(exc) if isinstance(exc, (ManifestError, PluginError)) \
                else f"{type(exc).__name__}: {exc}"
            kind = ManifestError if isinstance(exc, ManifestError) else PluginError
            raise kind(f"plugin '{plugin}' failed in {hook}: {detail}") from exc


def build_run(cfg: DictConfig, extra_plugins: dict[str, Any] | None = None,
              resume: bool = False, overwrite: bool = False,
              allow_changes: bool = False) -> Run:
    """A ready ``Run``: validated, plugins registered, the run folder locked and checked,
    model loaded, plugins configured, and (with ``resume``) restored from the last checkpoint.

    A folder that already holds a run is refused unless ``resume`` (continue it: refused too
    when the manifest changed, unless ``allow_changes``) or ``overwrite`` (its outputs are
    deleted first)."""
    run, _ = prepare(cfg, extra_plugins)
    if overwrite and resume:
        raise ManifestError("--resume and --overwrite contradict each other; give one")
    if not runfolder.secondary_rank():  # under torchrun, rank 0 alone manages the folder
        _claim_folder(run, resume, overwrite, allow_changes)
    load_policy(run)
    configure(run)
    if resume:
        root = checkpoint.checkpoint_root(run)
        last = checkpoint.latest(root)
        if last is None and runfolder.secondary_rank():
            raise ManifestError(f"--resume: no checkpoint in {root}")
        if last is not None:
            checkpoint.restore(run, last)
        # killed before its first checkpoint (no last): start again, nothing kept
        observe.truncate_metrics(run.out_dir / observe.METRICS_FILE,
                                 -1 if last is None else run.step)
    prepare_model(run)
    return run


def _claim_folder(run: Run, resume: bool, overwrite: bool, allow_changes: bool) -> None:
    """Lock the run folder (released when ``run`` is garbage), clean what crashes left, and
    refuse an old run unless resumed (with an unchanged manifest) or overwritten."""
    import weakref

    lock = runfolder.acquire(run.out_dir)
    weakref.finalize(run, runfolder.release, lock)
    root = checkpoint.checkpoint_root(run)
    for name in checkpoint.clean(root):
        runfolder.log(run.out_dir, f"removed {root / name} (left by an interrupted write)")
    held = runfolder.describe_run(run.out_dir)
    if overwrite and held:
        runfolder.remove_outputs(run.out_dir)
    elif resume:
        if held is None:
            raise ManifestError(f"--resume: {run.out_dir} holds no run to resume (no "
                                f"checkpoint, no metrics); run without --resume")
        changes = runfolder.manifest_changes(run.out_dir / runfolder.MANIFEST_FILE, run.config)
        if changes and not allow_changes:
            raise ManifestError("--resume: the manifest differs from the one this run was "
                                "started with (add --allow-changes to resume anyway, or "
                                "give another out=):\n" + "\n".join(changes))
        if changes:
            runfolder.log(run.out_dir, "resumed with a changed manifest (--allow-changes):\n"
                          + "\n".join(changes))
    elif held:
        raise ManifestError(f"run folder {run.out_dir} already holds a run ({held}); add "
                            f"--resume to continue it, --overwrite to replace it, or give "
                            f"another out=")


def prepare_model(run: Run) -> None:
    """The phase after every ``rlmix_configure`` (and a resume's restore): the sampler's weight
    copy (``rlmix_sampler_weights``, else the async sampler's fp32 copy when
    ``train.max_staleness > 0``) is taken from the full model, then ``rlmix_prepare_model``
    lets a trainer plugin wrap or partition it (manifest order)."""
    if run.policy is not None:
        run.sampler_weights = sampler_weights.build(run)  # rlmix_sampler_weights, or None
        if run.sampler_weights is None and int(run.config.train.max_staleness) > 0:
            async_sampling.take_model_copy(run)
    _phase(run, "rlmix_prepare_model")


def score(run: Run, batch: RolloutBatch) -> None:
    """Collect every scorer's terms, weight them by the manifest, sum into ``batch.rewards``.

    Each sample is scored once: a scorer whose terms are already in ``batch.reward_terms`` (a
    sample wrapper scored this candidate batch and handed it on, a scorer read another's term
    through ``scorer_terms``) is not called again, and each scorer's terms are written to
    ``batch.reward_terms`` as it returns, so a later scorer can read an earlier one's."""
    weights = score_weights(run)
    total = torch.zeros(len(batch))
    # called one by one (manifest order) so each term can be prefixed with its plugin's name;
    # rlmix_score is an all-hook, so there is no owner for a wrapper to wrap
    terms: dict[str, torch.Tensor] = {}
    for impl in _scorers(run):
        terms.update(_score_with(run, batch, impl))
    for name, value in terms.items():  # summed in manifest order, whoever scored first
        weight = float(weights.get(name, 1.0))
        if weight != 0:  # a weight of 0 turns a term off, NaN or not (0 x NaN is NaN)
            total = total + weight * value
    _check_weighted_terms(run, weights, terms)
    batch.rewards = total


def _scorers(run: Run) -> list[Any]:
    """The ``rlmix_score`` implementations in manifest order (wrappers are never called)."""
    return [impl for impl in manifest_order(run.pm.hook.rlmix_score.get_hookimpls())
            if not (impl.wrapper or impl.hookwrapper)]


def _term_owner(term: str, plugin_names: list[str]) -> str:
    """The plugin a prefixed term belongs to: the longest plugin name that prefixes it (plugin
    names may contain dots: ``dapo.dynamic_sampling.x`` is not a term of ``dapo``)."""
    owners = [p for p in plugin_names if term.startswith(p + ".")]
    return max(owners, key=len) if owners else term.rpartition(".")[0]


def _score_with(run: Run, batch: RolloutBatch, impl: Any) -> dict[str, torch.Tensor]:
    """Plugin ``impl``'s prefixed terms for ``batch``: the ones already present, or, when it
    has none there yet, what it returns now (written to ``batch.reward_terms``)."""
    plugin = impl.plugin_name
    names = [i.plugin_name for i in _scorers(run)]
    present = {k: v for k, v in batch.reward_terms.items() if _term_owner(k, names) == plugin}
    if present:
        return present
    out: dict[str, torch.Tensor] = {}
    for term, value in (impl.function(run=run, batch=batch) or {}).items():
        value = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
        if value.shape[0] != len(batch):
            raise RuntimeError(f"plugin '{plugin}' returned reward term '{term}' "
                               f"with {value.shape[0]} values for {len(batch)} samples")
        out[f"{plugin}.{term}"] = value
    batch.reward_terms.update(out)
    return out


def scorer_terms(run: Run, batch: RolloutBatch, plugin: str) -> dict[str, torch.Tensor]:
    """The terms scorer ``plugin`` gives ``batch`` (prefixed, ``{"arith.correct": ...}``),
    scored now only if ``batch.reward_terms`` has none of them yet; what is scored here is kept
    in ``batch.reward_terms``, so ``score`` does not call that scorer again. For a scorer that
    needs another's term (``step_grpo`` reads ``arith.correct``). ``{}`` if ``plugin`` is not
    a loaded scorer or returned nothing."""
    impl = next((i for i in _scorers(run) if i.plugin_name == plugin), None)
    return {} if impl is None else _score_with(run, batch, impl)


def _check_weighted_terms(run: Run, weights: dict[str, float],
                          terms: dict[str, torch.Tensor]) -> None:
    """``score.weights`` naming a term its plugin did not return is a manifest error (found at
    the first batch that plugin scores; plugins declaring ``RLMIX_SCORE_TERMS`` fail before the
    model loads). A plugin that returned nothing for this batch is judged at a later one."""
    state = run.state.setdefault("rlmix.score", {})
    if state.get("weights_checked"):
        return
    names = [impl.plugin_name for impl in _scorers(run)]
    judged = set(state.get("weights_judged", ()))
    returned = {_term_owner(name, names) for name in terms}
    for name in sorted(set(weights) - set(terms)):
        plugin = _term_owner(name, names)
        if plugin in returned and plugin not in judged:
            term = name[len(plugin) + 1:]
            theirs = sorted(t[len(plugin) + 1:] for t in terms if _term_owner(t, names) == plugin)
            raise ManifestError(f"manifest error at 'score.weights.{name}': plugin '{plugin}' "
                                f"returned no term '{term}'; its terms: {', '.join(theirs)}")
    judged |= returned
    state["weights_judged"] = sorted(judged)
    # every plugin score.weights names has been judged: nothing left to check
    state["weights_checked"] = all(_term_owner(name, names) in judged for name in weights)


def nonfinite_terms(batch: RolloutBatch, weights: dict[str, float]) -> dict[str, int]:
    """``{plugin.term: count}`` of non-finite reward values in the terms that count (weight
    not 0)."""
    counts = {name: int((~torch.isfinite(value)).sum())
              for name, value in batch.reward_terms.items() if float(weights.get(name, 1.0)) != 0}
    return {name: count for name, count in counts.items() if count}


def _finite_mean(value: torch.Tensor) -> float:
    ok = torch.isfinite(value)
    return float(value[ok].mean()) if bool(ok.any()) else float("nan")


def score_weights(run: Run) -> dict[str, float]:
    """``score.weights`` as ``{"plugin.term": weight}``."""
    return _flatten(OmegaConf.to_container(run.config.score.weights) or {})


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, float]:
    flat: dict[str, float] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = float(v)
    return flat


def apply_harness_update(run: Run, update: HarnessUpdate) -> None:
    run.harness.update(update.components)
    run.harness_version += 1
    folder = run.out_dir / "harness"
    folder.mkdir(parents=True, exist_ok=True)
    record = {"version": run.harness_version, "step": run.step,
              "parent_version": update.parent_version, "source": update.source,
              "evidence": update.evidence, "components": dict(run.harness)}
    import json

    _write_whole(folder / f"v{run.harness_version:04d}.json", json.dumps(record, indent=1))


def _write_whole(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a ``.tmp`` file beside it, renamed over it): a crash
    leaves no half file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def evaluate(run: Run) -> dict[str, float]:
    """Every ``rlmix_evaluate`` result, as ``eval/<metric>``."""
    assert run.policy is not None
    was_training = run.policy.model.training
    run.policy.model.eval()
    metrics: dict[str, float] = {}
    try:
        with torch.no_grad():
            for result in run.pm.hook.rlmix_evaluate(run=run):
                metrics.update({f"eval/{k}": float(v) for k, v in (result or {}).items()})
    finally:
        run.policy.model.train(was_training)
    return metrics


def train_step(run: Run) -> dict[str, Any]:
    """One step of DESIGN §2. Returns the step's metrics (without eval)."""
    assert run.policy is not None
    t0 = time.perf_counter()
    hook = run.hook
    asynchronous = run.async_sampler is not None  # then the worker asked for the prompts
    prompts = [] if asynchronous else hook.rlmix_prompts(run=run, step=run.step)
    if not prompts and not asynchronous:
        raise RuntimeError("rlmix_prompts returned no prompts")
    run.policy.model.eval()
    with torch.no_grad():
        batch = run.sample(prompts)
    t_sample = time.perf_counter()
    staleness = async_sampling.staleness_metrics(run.policy_version, batch)
    score(run, batch)
    # a non-finite reward (NaN, inf) skips the step: no advantage, update or evolution (one
    # bad value would poison the group statistics and the loss); the step still counts, so a
    # scorer that keeps failing cannot stall the run, and the metrics line says what happened
    bad = nonfinite_terms(batch, score_weights(run))
    if bad:
        _skip_nonfinite(run, bad, len(batch))
    # harness-only: no advantage, no log-prob forward, no backward; the step only evolves
    harness_only = str(run.config.train.mode) == "harness-only"
    no_update = harness_only or bool(bad)
    advantages = (torch.zeros(len(batch)) if no_update
                  else hook.rlmix_advantage(run=run, batch=batch))
    if advantages is None and needs.run_does_without(run, "rlmix_advantage"):
        advantages = torch.zeros(len(batch))
    if advantages is None:
        raise RuntimeError("no plugin returned advantages from rlmix_advantage")
    batch.advantages = advantages
    run.policy.model.train()
    # the loss metric: the mean over optimizer updates of each update's loss (the sum of its
    # accumulation chunks, each already divided by the whole update's normalisers)
    losses, update_loss, update_stats, loss_metrics = [], 0.0, {}, {}
    for mb in ([] if no_update else run.minibatches(batch)):
        logp, entropy = run.policy.logprobs(run, mb.batch)
        terms = hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
        if terms is None:
            raise RuntimeError("no plugin returned LossTerms from rlmix_clip")
        value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
        if terms.extra is not None:
            value = value + terms.extra
        terms.value, terms.minibatch = value, mb
        with async_sampling.weights_guard(run):  # the async worker never copies mid-update
            update_stats.update(hook.rlmix_update(run=run, loss=terms) or {})
        update_loss += float(value.detach())
        if mb.last:
            losses.append(update_loss)
            update_loss = 0.0
        for k, v in terms.metrics.items():
            loss_metrics.setdefault(k, []).append(float(v))
    t_train = time.perf_counter()
    evolve_now = (run.step + 1) % max(1, int(run.config.train.evolve_every)) == 0 and not bad
    # the async worker renders prompts from run.harness: it waits while harnesses evolve
    with _paused(run, evolve_now):
        for update in (hook.rlmix_evolve(run=run, batch=batch) if evolve_now else []):
            if update is not None:
                apply_harness_update(run, update)
    run.step += 1
    comp = batch.completion_mask
    metrics: dict[str, Any] = {
        "step": run.step,
        "reward/mean": _finite_mean(batch.rewards),
        "reward/std": float(batch.rewards.std()) if len(batch) > 1 and not bad else 0.0,
        **{f"reward/{k}": _finite_mean(v) for k, v in batch.reward_terms.items()},
        **({"reward/nonfinite": float(sum(bad.values())), "update/skipped": 1.0} if bad
           else {}),
        "loss": sum(losses) / len(losses) if losses else 0.0,
        "policy_version": run.policy_version,
        "harness_version": run.harness_version,
        "response_length/mean": float(comp.sum(-1).float().mean()),
        "time/sample_s": t_sample - t0,
        "time/train_s": t_train - t_sample,
        **staleness,
        "time/evolve_s": time.perf_counter() - t_train,
        **{k: sum(v) / len(v) for k, v in loss_metrics.items()},
        **update_stats,
        **run.drain_metrics(),
    }
    metrics["time/step_s"] = time.perf_counter() - t0
    return metrics


def _skip_nonfinite(run: Run, bad: dict[str, int], n: int) -> None:
    state = run.state.setdefault("rlmix.score", {})
    state["nonfinite_steps"] = state.get("nonfinite_steps", 0) + 1
    named = "; ".join(f"plugin '{name.rsplit('.', 1)[0]}' term '{name.rsplit('.', 1)[1]}': "
                      f"{count} of {n}" for name, count in bad.items())
    text = (f"rlmix: warning: step {run.step + 1}: non-finite rewards ({named}); step skipped "
            f"(no advantage, update or evolution; {state['nonfinite_steps']} skipped so far). "
            f"A weight of 0 in score.weights turns a term off")
    runfolder.note(run.out_dir, text)  # a warning: stderr, and the run's log


def _observer(run: Run) -> observe.ObservePlugin:
    return run.pm.get_plugin("rlmix.observe")  # type: ignore[return-value]


def log_owner_table(run: Run) -> str:
    """The owner table, written to ``hooks.txt`` in the run folder and returned."""
    table = "\n".join(plugin_loading.format_owner_table(run.pm))
    run.out_dir.mkdir(parents=True, exist_ok=True)
    (run.out_dir / "hooks.txt").write_text(table + "\n")
    return table


def _paused(run: Run, when: bool) -> Any:
    """Hold the async worker between generation calls when ``when`` (harnesses evolve, or the
    core checkpointer saves: the plugin state it touches is then pickled consistently)."""
    sampler = run.async_sampler
    return sampler.paused() if when and sampler is not None else contextlib.nullcontext()


def train(run: Run) -> dict[str, Any]:
    """Run ``train.steps`` steps (from ``run.step``), evaluating at the start, every
    ``train.eval_every`` steps and at the end. Returns the last step's metrics."""
    lock = runfolder.acquire(run.out_dir)  # re-entrant: build_run may hold it already
    try:
        checkpoint.clean(checkpoint.checkpoint_root(run))
        # whole or not at all: a resume compares with it
        _write_whole(run.out_dir / runfolder.MANIFEST_FILE, OmegaConf.to_yaml(run.config))
        log_owner_table(run)
        return _train(run)
    finally:
        runfolder.release(lock)


def _train(run: Run) -> dict[str, Any]:
    steps = int(run.config.train.steps)
    eval_every = int(run.config.train.eval_every)
    last: dict[str, Any] = {}
    k = int(run.config.train.max_staleness)
    own_sampler = k > 0 and run.async_sampler is None and run.step < steps
    try:
        if own_sampler:
            async_sampling.start(run, k)
        if run.step == 0:
            start = evaluate(run)
            if start:
                _observer(run).write(run, {"step": 0, "policy_version": run.policy_version,
                                           **start})
        while run.step < steps:
            metrics = train_step(run)
            if run.step == steps or (eval_every > 0 and run.step % eval_every == 0):
                metrics.update(evaluate(run))
            metrics.update(run.drain_metrics())  # what plugins logged during evaluation
            with _paused(run, checkpoint.due(run)):
                run.hook.rlmix_step_end(run=run, metrics=metrics)
            last = metrics
    finally:
        try:
            if own_sampler:
                async_sampling.stop(run)  # joins the worker, also on an exception or Ctrl-C
            run.hook.rlmix_run_end(run=run)  # plugins stop their threads, close their files
        finally:
            _observer(run).close(run)
    return last
