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

from rlmix import async_sampling, checkpoint, manifest, needs, observe, ops
from rlmix import plugins as plugin_loading
from rlmix.errors import ManifestError, PluginError
from rlmix.hookspecs import REQUIRED_HOOKS
from rlmix.policy import Policy, load_model
from rlmix.types import HarnessUpdate, RolloutBatch, Run


def prepare(cfg: DictConfig, extra_plugins: dict[str, Any] | None = None,
            required: dict[str, str] | None = None,
            ) -> tuple[Run, list[plugin_loading.LoadedPlugin]]:
    """Validate the manifest, load and register its plugins, check hook ownership.

    Everything here happens before any model loads, so manifest mistakes fail fast."""
    core = manifest.validate_core(cfg)
    if core.train.max_staleness < 0:
        raise ManifestError("manifest error at 'train.max_staleness': must be >= 0 (0 = "
                            f"synchronous sampling), got {core.train.max_staleness}")
    if core.sampling.temperature <= 0:
        raise ManifestError("manifest error at 'sampling.temperature': training samples need a "
                            "temperature > 0 (evaluation is greedy on its own)")
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
    run.policy = Policy(model, tok, device=device, autocast=str(pol.autocast),
                        share_prefix=bool(pol.share_prefix),
                        gradient_checkpointing=bool(pol.gradient_checkpointing))


def configure(run: Run) -> None:
    for impl in reversed(run.pm.hook.rlmix_configure.get_hookimpls()):
        try:
            impl.function(run=run)
        except (ManifestError, PluginError) as exc:
            if f"'{impl.plugin_name}'" in str(exc):
                raise
            # a plugin's own ConfigError: say whose it is, as for any other failure
            kind = ManifestError if isinstance(exc, ManifestError) else PluginError
            raise kind(f"plugin '{impl.plugin_name}' failed to configure: {exc}") from exc
        except Exception as exc:
            raise PluginError(f"plugin '{impl.plugin_name}' failed to configure: "
                              f"{type(exc).__name__}: {exc}") from exc


def build_run(cfg: DictConfig, extra_plugins: dict[str, Any] | None = None,
              resume: bool = False) -> Run:
    """A ready ``Run``: validated, plugins registered, model loaded, plugins configured, and
    (with ``resume``) restored from the last checkpoint."""
    run, _ = prepare(cfg, extra_plugins)
    load_policy(run)
    configure(run)
    if resume:
        last = checkpoint.latest(checkpoint.checkpoint_root(run))
        if last is None:
            raise ManifestError(f"--resume: no checkpoint in {checkpoint.checkpoint_root(run)}")
        checkpoint.restore(run, last)
        observe.truncate_metrics(run.out_dir / observe.METRICS_FILE, run.step)
    return run


def score(run: Run, batch: RolloutBatch) -> None:
    """Collect every scorer's terms, weight them by the manifest, sum into ``batch.rewards``."""
    weights = _flatten(OmegaConf.to_container(run.config.score.weights) or {})
    n = len(batch)
    total = torch.zeros(n)
    terms: dict[str, torch.Tensor] = {}
    # called one by one (manifest order) so each term can be prefixed with its plugin's name;
    # rlmix_score is an all-hook, so there is no owner for a wrapper to wrap
    for impl in run.pm.hook.rlmix_score.get_hookimpls():
        if impl.wrapper or impl.hookwrapper:
            continue
        result = impl.function(run=run, batch=batch)
        if not result:
            continue
        for term, value in result.items():
            name = f"{impl.plugin_name}.{term}"
            value = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
            if value.shape[0] != n:
                raise RuntimeError(f"plugin '{impl.plugin_name}' returned reward term '{term}' "
                                   f"with {value.shape[0]} values for {n} samples")
            terms[name] = value
            total = total + float(weights.get(name, 1.0)) * value
    unknown = set(weights) - set(terms)
    if unknown and run.step == 0:
        print(f"rlmix: warning: score.weights names terms no plugin returned: "
              f"{', '.join(sorted(unknown))}")
    batch.reward_terms = terms
    batch.rewards = total


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

    path = folder / f"v{run.harness_version:04d}.json"
    tmp = path.with_suffix(".json.tmp")  # written whole, then renamed: a crash leaves no half file
    tmp.write_text(json.dumps(record, indent=1))
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
                for k, v in (result or {}).items():
                    metrics[f"eval/{k}"] = float(v)
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
    # harness-only: no advantage, no log-prob forward, no backward; the step only evolves
    harness_only = str(run.config.train.mode) == "harness-only"
    advantages = (torch.zeros(len(batch)) if harness_only
                  else hook.rlmix_advantage(run=run, batch=batch))
    if advantages is None and needs.run_does_without(run, "rlmix_advantage"):
        advantages = torch.zeros(len(batch))
    if advantages is None:
        raise RuntimeError("no plugin returned advantages from rlmix_advantage")
    batch.advantages = advantages
    run.policy.model.train()
    losses, update_stats, loss_metrics = [], {}, {}
    for mb in ([] if harness_only else run.minibatches(batch)):
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
        losses.append(float(value.detach()))
        for k, v in terms.metrics.items():
            loss_metrics.setdefault(k, []).append(float(v))
    t_train = time.perf_counter()
    evolve_now = (run.step + 1) % max(1, int(run.config.train.evolve_every)) == 0
    # the async worker renders prompts from run.harness: it waits while harnesses evolve
    sampler = run.async_sampler
    with sampler.paused() if (evolve_now and sampler is not None) else contextlib.nullcontext():
        for update in (hook.rlmix_evolve(run=run, batch=batch) if evolve_now else []):
            if update is not None:
                apply_harness_update(run, update)
    run.step += 1
    comp = batch.completion_mask
    metrics: dict[str, Any] = {
        "step": run.step,
        "reward/mean": float(batch.rewards.mean()),
        "reward/std": float(batch.rewards.std()) if len(batch) > 1 else 0.0,
        **{f"reward/{k}": float(v.mean()) for k, v in batch.reward_terms.items()},
        "loss": sum(losses),
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


def _observer(run: Run) -> observe.ObservePlugin:
    return run.pm.get_plugin("rlmix.observe")  # type: ignore[return-value]


def log_owner_table(run: Run) -> str:
    """The owner table, written to ``hooks.txt`` in the run folder and returned."""
    table = "\n".join(plugin_loading.format_owner_table(run.pm))
    run.out_dir.mkdir(parents=True, exist_ok=True)
    (run.out_dir / "hooks.txt").write_text(table + "\n")
    return table


def _checkpoint_pause(run: Run) -> Any:
    """On a step the core checkpointer saves, hold the async worker between generation calls
    so the plugin state it touches is pickled consistently; otherwise nothing."""
    sampler = run.async_sampler
    every = int(run.config.train.checkpoint_every)
    saving = run.step >= int(run.config.train.steps) or (every > 0 and run.step % every == 0)
    if sampler is None or not saving:
        return contextlib.nullcontext()
    return sampler.paused()


def train(run: Run) -> dict[str, Any]:
    """Run ``train.steps`` steps (from ``run.step``), evaluating at the start, every
    ``train.eval_every`` steps and at the end. Returns the last step's metrics."""
    run.out_dir.mkdir(parents=True, exist_ok=True)
    (run.out_dir / "manifest.yaml").write_text(OmegaConf.to_yaml(run.config))
    log_owner_table(run)
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
            with _checkpoint_pause(run):
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
