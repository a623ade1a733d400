"""Checks for every plugin, whatever hooks it implements: it registers, its ``Settings``
validate, it configures, runs one step, its ``run.state`` pickles, and it resumes (full)."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import io
import json
import math
import typing
from typing import Any

import torch

from rlmix import loop, manifest
from rlmix import plugins as plugin_loading
from rlmix.errors import ManifestError
from rlmix.testing import standins
from rlmix.types import Run
from rlmix_conformance.batches import _same, _where_raised
from rlmix_conformance.kit import (
    HOOKS,
    ConformanceFailure,
    NotApplicable,
    Subject,
    _impl_opts,
    check,
)


@check("", "registers", needs_run=False)
def _registers(s: Subject) -> None:
    """The plugin imports, its rlmix_* names are hooks, and pluggy accepts its hookimpls."""
    problems = []
    for name in s.unknown:
        close = difflib.get_close_matches(name, HOOKS, n=1)
        hint = f"; did you mean {close[0]}?" if close else "; rename it (rlmix_ is reserved)"
        problems.append(f"{name} is not an rlmix hook{hint}")
    for hook in s.hooks:
        fn = getattr(s.obj, hook)
        opts = _impl_opts(fn)
        if not opts:
            problems.append(f"{hook} is not marked @rlmix.hookimpl, so it is never called; "
                            f"decorate it")
            continue
        is_gen = inspect.isgeneratorfunction(fn)
        wrapper = bool(opts.get("wrapper") or opts.get("hookwrapper"))
        if is_gen and not wrapper:
            problems.append(f"{hook} is a generator but not marked "
                            f"@rlmix.hookimpl(wrapper=True); as it is, the hook's result "
                            f"would be a generator object")
        if wrapper and hook in ("rlmix_score", "rlmix_configure", "rlmix_evaluate"):
            if hook == "rlmix_score":
                problems.append("rlmix_score is marked wrapper=True, but the core calls every "
                                "scorer on its own and never calls score wrappers; return a "
                                "reward term instead (a negative weight subtracts it)")
    if problems:
        raise ConformanceFailure("; ".join(problems))
    pm = plugin_loading.new_plugin_manager()
    try:
        plugin_loading.register(pm, [plugin_loading.LoadedPlugin(s.name, "", s.obj, None)])
    except Exception as exc:  # noqa: BLE001 - pluggy's validation of the hookimpls
        raise ConformanceFailure(f"pluggy rejects the plugin's hookimpls: {exc}; a hookimpl "
                                 f"may take only arguments its hook passes (see "
                                 f"docs/hooks.md)") from None


@check("", "settings", needs_run=False)
def _settings(s: Subject) -> None:
    """Settings is a dataclass whose defaults build through the manifest validator, and a
    wrong-typed value and an unknown key are rejected with ManifestError."""
    raw = getattr(s.obj, "Settings", None)
    if raw is None:
        raise NotApplicable("the plugin has no Settings (it takes no manifest block)")
    if not dataclasses.is_dataclass(raw):
        raise ConformanceFailure("Settings is not a dataclass, so the core ignores it and any "
                                 f"'{s.name}:' block is rejected; decorate it with "
                                 "@dataclasses.dataclass")
    cls = raw
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConformanceFailure(f"Settings field(s) {', '.join(missing)} have no default; every "
                                 f"field needs one so the plugin runs when its manifest block "
                                 f"is absent")
    try:
        manifest.validate_block(cls, {}, s.name, s.name)
    except ManifestError as exc:
        raise ConformanceFailure(f"Settings() with its defaults is rejected: {exc}; make the "
                                 f"defaults valid (they are what a manifest without a "
                                 f"'{s.name}:' block runs with)") from None
    except Exception as exc:  # noqa: BLE001 - OmegaConf cannot even build the schema
        raise ConformanceFailure(f"the manifest validator cannot build Settings: "
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0]}; use field "
                                 f"types OmegaConf supports (str, int, float, bool, enums, "
                                 f"lists/dicts of those, nested dataclasses)") from None
    try:
        manifest.validate_block(cls, {"kit_no_such_key": 1}, s.name, s.name)
    except ManifestError:
        pass
    else:
        raise ConformanceFailure(f"an unknown key '{s.name}.kit_no_such_key' was accepted; "
                                 f"Settings must be a plain dataclass (no **kwargs catch-all)")
    hints = typing.get_type_hints(cls)
    typed = [f.name for f in dataclasses.fields(cls) if hints.get(f.name) in (int, float, bool)]
    for name in typed:
        try:
            manifest.validate_block(cls, {name: "kit-not-a-number"}, s.name, s.name)
        except ManifestError:
            continue
        raise ConformanceFailure(f"'{s.name}.{name}: kit-not-a-number' was accepted for a "
                                 f"{hints[name].__name__} field; keep the field annotated "
                                 f"with its type so the manifest validator checks it")


@check("", "configure")
def _configure(s: Subject) -> None:
    """The plugin configures with its default settings on the tiny model."""
    try:
        s.shared()
    except Exception as exc:  # noqa: BLE001
        s.cache["configure_error"] = True
        raise ConformanceFailure(f"the run did not configure with default settings: "
                                 f"{type(exc).__name__}: {exc}{_where_raised(exc, s)}") from None


def _step(s: Subject, run: Run) -> dict[str, Any]:
    try:
        metrics = loop.train_step(run)
        run.hook.rlmix_step_end(run=run, metrics=metrics)
        if s.implements("rlmix_evaluate"):
            metrics.update(loop.evaluate(run))
    except ConformanceFailure:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ConformanceFailure(
            f"one training step with the kit's stand-ins ({', '.join(standins.STANDINS)} "
            f"registered before '{s.name}') failed: {type(exc).__name__}: {exc}"
            f"{_where_raised(exc, s)}") from None
    return metrics


@check("", "step")
def _one_step(s: Subject) -> None:
    """One training step (and its step_end, and evaluation when implemented) runs, with a finite
    loss, numeric metrics, and an optimizer step taken."""
    run = s.run()
    metrics = _step(s, run)
    s.cache["stepped"] = run
    bad = []
    for key, value in metrics.items():
        try:
            json.dumps(float(value) if not isinstance(value, (int, str)) else value)
        except (TypeError, ValueError):
            bad.append(f"{key}={value!r}")
    if bad:
        raise ConformanceFailure(f"the step's metrics are not numbers: {', '.join(bad[:3])}; "
                                 f"metrics are logged as JSON numbers")
    if not math.isfinite(float(metrics["loss"])):
        raise ConformanceFailure(f"one training step gave loss {metrics['loss']}; the loss must "
                                 f"be finite on an ordinary batch")
    if run.policy_version != 1:
        raise ConformanceFailure(f"after one training step run.policy_version is "
                                 f"{run.policy_version}, not 1: the optimizer step was skipped "
                                 f"(a non-finite loss or gradient) or rlmix_update did not bump "
                                 f"the version")


@check("", "state")
def _state(s: Subject) -> None:
    """What the plugin keeps in run.state survives torch.save/torch.load unchanged."""
    run = s.cache.get("stepped")
    if run is None:
        run = s.run()
    buffer = io.BytesIO()
    try:
        torch.save(run.state, buffer)
    except Exception as exc:  # noqa: BLE001
        raise ConformanceFailure(f"run.state cannot be saved by torch.save ({type(exc).__name__}: "
                                 f"{exc}); keep only picklable data there (tensors, numbers, "
                                 f"strings, lists, dicts) and put other objects in "
                                 f"run.resources") from None
    buffer.seek(0)
    try:
        loaded = torch.load(buffer, weights_only=False)
    except Exception as exc:  # noqa: BLE001
        raise ConformanceFailure(f"run.state is saved but cannot be loaded back "
                                 f"({type(exc).__name__}: {exc})") from None
    diff = _same(run.state, loaded, "run.state")
    if diff:
        raise ConformanceFailure(f"run.state changes in a torch.save/torch.load round trip at "
                                 f"{diff}; a resumed run would see other state")


@check("", "resume", level="full")
def _resume(s: Subject) -> None:
    """Two steps equal one step, a checkpoint, a restore into a fresh run, and one more step."""
    from rlmix import checkpoint

    straight = s.run()
    _step(s, straight)
    second = _step(s, straight)
    first = s.run()
    _step(s, first)
    folder = checkpoint.save(first, keep=1)
    resumed = s.run()
    checkpoint.restore(resumed, folder)
    again = _step(s, resumed)
    for key in ("loss", "reward/mean"):
        if not math.isclose(float(second[key]), float(again[key]), rel_tol=1e-5, abs_tol=1e-6):
            raise ConformanceFailure(f"step 2 after a checkpoint resume gives {key} "
                                     f"{again[key]:.6g}, an uninterrupted run {second[key]:.6g}; "
                                     f"keep what a step depends on in run.state (checkpointed) "
                                     f"and derive randomness from run.rng or the step")
    diff = _same(straight.state, resumed.state, "run.state")
    if diff:
        raise ConformanceFailure(f"after a resume run.state differs from an uninterrupted run at "
                                 f"{diff}")
