"""The kit's vocabulary: levels, results and reports, the check registry (``@check``), and
the ``Subject`` (the plugin under test and a factory of runs with the stand-ins)."""

from __future__ import annotations

import difflib
import importlib.metadata as md
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlmix import hookspecs, loop, manifest
from rlmix import plugins as plugin_loading
from rlmix.testing import standins
from rlmix.types import Run

LEVELS = ("quick", "full")
HOOKS = tuple(sorted(n for n in dir(hookspecs) if n.startswith("rlmix_")))
#: manifest overrides every kit run starts from (tiny model, small batches, no files but one)
BASE_OVERRIDES = ("model=tiny-random", "policy.device=cpu", "log.progress=false",
                  "log.plot=false", "log.tensorboard=false", "train.prompts_per_step=2",
                  "train.group_size=4", "train.seed=0")


class ConformanceFailure(AssertionError):
    """A broken contract; the message says what to fix."""


class NotApplicable(Exception):
    """The check does not apply to this plugin (reported as skipped)."""


@dataclass
class Result:
    plugin: str
    check: str  # "<hook or topic>/<what>", e.g. "rlmix_clip/mask"
    ok: bool
    message: str = ""
    skipped: bool = False
    seconds: float = 0.0


@dataclass
class Report:
    plugin: str
    results: list[Result] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    def format(self) -> str:
        lines = [f"rlmix conformance of '{self.plugin}': "
                 f"{sum(r.ok and not r.skipped for r in self.results)} passed, "
                 f"{len(self.failures)} failed, {sum(r.skipped for r in self.results)} skipped"]
        for r in self.results:
            if not r.ok:
                lines.append(f"  FAIL {r.check}: {r.message}")
        return "\n".join(lines)


@dataclass
class Check:
    id: str
    hook: str  # the hook it needs the plugin to implement, or "" for every plugin
    level: str
    fn: Callable[[Subject], None]
    owner_only: bool = False  # skip for wrapper-only implementations
    needs_run: bool = True  # skipped when no run configures (plugin/configure says why)

    @property
    def doc(self) -> str:
        return " ".join((self.fn.__doc__ or "").split())


CHECKS: list[Check] = []


def check(hook: str, name: str, level: str = "quick", owner_only: bool = False,
          needs_run: bool = True) -> Callable[[Callable[[Subject], None]], Callable]:
    def register(fn: Callable[[Subject], None]) -> Callable[[Subject], None]:
        topic = hook or "plugin"
        CHECKS.append(Check(f"{topic}/{name}", hook, level, fn, owner_only, needs_run))
        return fn
    return register


# ---------------------------------------------------------------------------- the subject


class Subject:
    """The plugin under test: its object, hooks, settings class, and a factory of ``Run``s in
    which the kit's stand-ins are registered before it."""

    def __init__(self, name: str, obj: Any = None) -> None:
        self.name = name
        self.inline = obj is not None
        self.load_error: str | None = None
        if obj is None:
            obj = self._load()
        self.obj = obj
        self.settings_cls = plugin_loading.settings_class(obj) if obj is not None else None
        attrs = [a for a in dir(obj) if a.startswith("rlmix_")] if obj is not None else []
        self.hooks = [a for a in attrs if a in HOOKS and callable(getattr(obj, a))]
        self.unknown = [a for a in attrs if a not in HOOKS and callable(getattr(obj, a))]
        self.wrappers = {h for h in self.hooks if _impl_opts(getattr(obj, h)).get("wrapper")
                         or _impl_opts(getattr(obj, h)).get("hookwrapper")}
        self.tmp = Path(tempfile.mkdtemp(prefix="rlmix-conformance-"))
        self._runs = 0
        self.cache: dict[str, Any] = {}

    def _load(self) -> Any:
        info = plugin_loading.installed().get(self.name)
        if info is None:
            known = sorted(plugin_loading.installed())
            close = difflib.get_close_matches(self.name, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            self.load_error = (f"no installed rlmix plugin is named '{self.name}'{hint}; install "
                               f"it (pip install -e <its folder>) so its entry point is "
                               f"registered, or pass the object: check_plugin(name, module)")
            return None
        try:
            return md.EntryPoint(name=info.name, value=info.value, group=info.family).load()
        except Exception as exc:  # noqa: BLE001 - reported as the first failure
            self.load_error = (f"entry point '{info.name} = {info.value}' ({info.family}) failed "
                               f"to import: {type(exc).__name__}: {exc}")
            return None

    def implements(self, hook: str) -> bool:
        return hook in self.hooks

    def owns(self, hook: str) -> bool:
        return hook in self.hooks and hook not in self.wrappers

    def run(self, overrides: Iterable[str] = (), policy: bool = True, configure: bool = True,
            probes: dict[str, Any] | None = None) -> Run:
        """A ``Run`` with the stand-ins, then the plugin, then ``probes``; the tiny model when
        ``policy``; every plugin configured when ``configure``."""
        self._runs += 1
        names = [*standins.STANDINS, self.name, *(probes or {})]
        extra: dict[str, Any] = {**standins.STANDINS, **(probes or {})}
        if self.inline:
            extra[self.name] = self.obj
        cfg = manifest.read(None, [*BASE_OVERRIDES, f"out={self.tmp / f'run{self._runs}'}",
                                   *overrides])
        cfg.plugins = names
        run, _ = loop.prepare(cfg, extra_plugins=extra, required={})
        if policy:
            loop.load_policy(run)
        if configure:
            loop.configure(run)
            loop.prepare_model(run)  # as build_run: a trainer plugin wraps the model here
        return run

    def shared(self) -> Run:
        """One configured run with the tiny model, reused by checks that only read from it."""
        if "shared" not in self.cache:
            self.cache["shared"] = self.run()
        return self.cache["shared"]

    def impl(self, run: Run, hook: str) -> Any:
        """The plugin's own implementation of ``hook`` in ``run`` (not the stand-ins')."""
        for impl in getattr(run.pm.hook, hook).get_hookimpls():
            if impl.plugin_name == self.name:
                return impl
        raise ConformanceFailure(f"{hook} of '{self.name}' is not registered")

    def close(self) -> None:
        self.cache.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _impl_opts(fn: Any) -> dict[str, Any]:
    return getattr(fn, f"{hookspecs.PROJECT}_impl", None) or {}
