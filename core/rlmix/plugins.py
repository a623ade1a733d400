"""Plugin discovery and loading: entry points (stevedore) -> a pluggy PluginManager.

Only the plugins a manifest names are imported, in its order (stevedore's named loading), then
registered with pluggy in that order after the core's own default plugins (``trylast``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata as md
import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from rlmix import hookspecs
from rlmix.errors import ManifestError, PluginError, mark_origin

FAMILIES = ("rlmix.algorithms", "rlmix.rollout", "rlmix.envs", "rlmix.harness",
            "rlmix.kernels", "rlmix.trainers")
CORE = "rlmix"  # the name the core's own default plugins are registered under (prefix)


@dataclass
class PluginInfo:
    """An installed plugin, known from its entry point without importing it."""

    name: str
    family: str
    value: str
    distribution: str
    version: str
    #: why it cannot be used with the installed core ("" when it can): its declared ``rlmix``
    #: requirement, which pip does not check for a plugin installed with --no-deps or from a
    #: folder, against the core's version
    problem: str = ""


@dataclass
class LoadedPlugin:
    name: str
    family: str
    obj: Any
    settings_cls: type | None
    distribution: str = ""
    version: str = ""


def installed() -> dict[str, PluginInfo]:
    """Every installed rlmix plugin by entry-point name (no imports)."""
    found: dict[str, PluginInfo] = {}
    core_problems: dict[str, str] = {}
    for family in FAMILIES:
        for ep in md.entry_points(group=family):
            dist = getattr(ep, "dist", None)
            name = dist.metadata["Name"] if dist else "?"
            if dist is not None and name not in core_problems:
                core_problems[name] = core_requirement_problem(dist)
            found.setdefault(ep.name, PluginInfo(
                name=ep.name, family=family, value=ep.value, distribution=name,
                version=dist.version if dist else "?", problem=core_problems.get(name, "")))
    return found


def core_requirement_problem(dist: md.Distribution) -> str:
    """Why the installed core does not satisfy ``dist``'s declared ``rlmix`` requirement, or
    "" when it does (or declares none)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    try:
        core_version = md.version(CORE)
    except md.PackageNotFoundError:  # the core run from a source tree: nothing to check against
        return ""
    for line in dist.requires or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != CORE:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # only under an extra, or another platform
        if not req.specifier.contains(core_version, prereleases=True):
            return (f"needs {req.name}{req.specifier} but the installed core is rlmix "
                    f"{core_version}; install a matching core, or a version of "
                    f"{dist.metadata['Name']} made for rlmix {core_version}")
    return ""


def settings_class(obj: Any) -> type | None:
    cls = getattr(obj, "Settings", None)
    return cls if cls is not None and dataclasses.is_dataclass(cls) else None


def load(names: list[str], extra: dict[str, Any] | None = None) -> list[LoadedPlugin]:
    """Import the named plugins, in order. ``extra`` maps names to in-process plugin objects
    (modules or classes with hookimpls) that take precedence over entry points: for tests,
    notebooks and scripts that define a plugin inline."""
    from stevedore import NamedExtensionManager

    extra = extra or {}
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ManifestError(f"plugins: listed more than once: {', '.join(dupes)}")
    known = installed()
    missing = [n for n in names if n not in known and n not in extra]
    if missing:
        choices = ", ".join(sorted(set(known) | set(extra))) or "none installed"
        hints = "; ".join(f"'pip install rlmix-{n.split('.')[0].replace('_', '-')}'"
                          for n in missing)
        import difflib

        close = {m: difflib.get_close_matches(m, set(known) | set(extra), n=1) for m in missing}
        guess = "; ".join(f"did you mean '{c[0]}' for '{m}'?" for m, c in close.items() if c)
        raise ManifestError(
            f"plugins: unknown plugin {', '.join(repr(m) for m in missing)}; installed plugins: "
            f"{choices}." + (f" {guess[0].upper()}{guess[1:]}" if guess else "")
            + f" If it is published, {hints} would bring it.")

    unusable = [n for n in names if n not in extra and known[n].problem]
    if unusable:  # before importing anything: its import might fail on the same mismatch
        raise PluginError("; ".join(f"plugin '{n}' ({known[n].family}, {known[n].distribution} "
                                    f"{known[n].version}) {known[n].problem}"
                                    for n in unusable))

    loaded: dict[str, LoadedPlugin] = {}
    by_family: dict[str, list[str]] = {}
    for name in names:
        if name in extra:
            obj = extra[name]
            loaded[name] = LoadedPlugin(name, "inline", obj, settings_class(obj), "inline", "")
        else:
            by_family.setdefault(known[name].family, []).append(name)

    for family, members in by_family.items():
        def failed(_manager: Any, entrypoint: Any, exc: BaseException,
                   family: str = family) -> None:
            raise PluginError(f"plugin '{entrypoint.name}' ({family}) failed to import: "
                              f"{type(exc).__name__}: {exc}") from exc

        def not_found(missing: Any, family: str = family) -> None:
            raise PluginError(f"plugin {', '.join(repr(m) for m in missing)} ({family}) is "
                              f"installed but its entry point could not be loaded")

        # stevedore caches entry points per family for the life of the process; drop that
        # cache so a plugin installed (or put on sys.path) since the last load is found
        NamedExtensionManager.ENTRY_POINT_CACHE.pop(family, None)
        manager = NamedExtensionManager(family, names=members, name_order=True,
                                        on_load_failure_callback=failed,
                                        on_missing_entrypoints_callback=not_found)
        for ext in manager:
            info = known[ext.name]
            loaded[ext.name] = LoadedPlugin(ext.name, family, ext.plugin,
                                            settings_class(ext.plugin), info.distribution,
                                            info.version)
    return [loaded[n] for n in names]


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def register(pm: pluggy.PluginManager, plugins: list[LoadedPlugin]) -> None:
    """Register the core defaults (trylast), then the manifest's plugins in its order."""
    from rlmix import checkpoint, defaults, observe

    # registration order matters: pluggy puts each new ``trylast`` implementation at the far
    # end of the call order, so among these three the first registered is called first. The
    # logger is registered before the checkpointer: it writes (and fsyncs) a step's metrics
    # line before the checkpointer makes that step's checkpoint visible, so a resume from any
    # checkpoint finds its line (tested in tests/test_crash_windows.py)
    for name, obj in (("rlmix.defaults", defaults),
                      ("rlmix.observe", observe.ObservePlugin()),
                      ("rlmix.checkpoint", checkpoint.CheckpointPlugin())):
        if pm.get_plugin(name) is None:
            pm.register(obj, name=name)
            attribute_errors(pm, name)
    for plugin in plugins:
        obj = plugin.obj() if inspect.isclass(plugin.obj) else plugin.obj  # a class: an instance
        try:
            pm.register(obj, name=plugin.name)
        except (ValueError, pluggy.PluginValidationError) as exc:
            raise PluginError(f"plugin '{plugin.name}' could not be registered: {exc}") from exc
        attribute_errors(pm, plugin.name)


def attribute_errors(pm: pluggy.PluginManager, name: str) -> None:
    """Wrap each hook implementation of plugin ``name`` so that an exception escaping it is
    marked with the plugin and the hook (``rlmix.errors.mark_origin``); the CLI then reports
    ``plugin 'X' failed in rlmix_Y: ...``. The exception itself passes through unchanged."""
    plugin = pm.get_plugin(name)
    for caller in pm.get_hookcallers(plugin) or []:
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and not getattr(impl.function, "_rlmix_marks", False):
                impl.function = _marking(impl.function, name, caller.name,  # type: ignore[misc]
                                         bool(impl.wrapper or impl.hookwrapper))


def _marking(function: Any, plugin: str, hook: str, generator: bool) -> Any:
    if generator:  # a wrapper: errors of its own code before or after its yield
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return (yield from function(*args, **kwargs))
            except Exception as exc:
                mark_origin(exc, plugin, hook)
                raise
        marked = wrapper
    else:
        @functools.wraps(function)
        def plain(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except Exception as exc:
                mark_origin(exc, plugin, hook)
                raise
        marked = plain
    marked._rlmix_marks = True  # type: ignore[attr-defined]
    return marked


def implementers(pm: pluggy.PluginManager, hook: str) -> list[tuple[str, bool]]:
    """(plugin name, is_wrapper) for each implementation, in call order (first called first)."""
    # pluggy stores them last-called-first
    impls = reversed(getattr(pm.hook, hook).get_hookimpls())
    return [(i.plugin_name, bool(i.hookwrapper or i.wrapper)) for i in impls]


@dataclass
class HookOwner:
    hook: str
    kind: str  # firstresult | all
    owner: str | None
    displaced: list[str]
    wrappers: list[str]
    implementers: list[str]


def owner_table(pm: pluggy.PluginManager) -> list[HookOwner]:
    rows = []
    for hook in sorted(n for n in dir(hookspecs) if n.startswith("rlmix_")):
        impls = implementers(pm, hook)
        plain = [n for n, w in impls if not w]
        wrappers = [n for n, w in impls if w]
        if hook in hookspecs.FIRSTRESULT_HOOKS:
            rows.append(HookOwner(hook, "firstresult", plain[0] if plain else None, plain[1:],
                                  wrappers, plain))
        else:
            rows.append(HookOwner(hook, "all", None, [], wrappers, plain))
    return rows


def format_owner_table(pm: pluggy.PluginManager) -> list[str]:
    """One line per hook: its owner and what it displaced, or every implementer; wrappers."""
    lines = []
    for row in owner_table(pm):
        if row.kind == "firstresult":
            text = f"{row.hook:<22} owner: {row.owner or '-'}"
            if row.displaced:
                text += f"  displaces: {', '.join(row.displaced)}"
        else:
            text = f"{row.hook:<22} all: {', '.join(row.implementers) or '-'}"
        if row.wrappers:
            text += f"  wrappers: {', '.join(row.wrappers)}"
        lines.append(text)
    return lines


def check_required(pm: pluggy.PluginManager, required: dict[str, str] | None = None) -> None:
    """A required hook with no owner is a manifest error naming who could provide it."""
    required = hookspecs.REQUIRED_HOOKS if required is None else required
    problems = []
    for hook, who in required.items():
        if any(not w for _, w in implementers(pm, hook)):
            continue
        providers = providers_of(hook)
        offer = (f"installed plugins that provide it: {', '.join(providers)}" if providers
                 else "no installed plugin provides it")
        problems.append(f"hook '{hook}' has no owner (needs {who}); {offer}")
    if problems:
        raise ManifestError("plugins: " + "; ".join(problems) + ". Add one to 'plugins'.")


def providers_of(hook: str) -> list[str]:
    """Installed plugins implementing ``hook`` (imports each installed plugin, best effort)."""
    names = []
    for info in installed().values():
        try:
            ep = md.EntryPoint(name=info.name, value=info.value, group=info.family)
            obj = ep.load()
        except Exception:  # noqa: BLE001 - a broken plugin simply is not offered
            continue
        if hasattr(obj, hook):
            names.append(info.name)
    return sorted(names)


def hooks_of(obj: Any) -> list[str]:
    return sorted(n for n in dir(obj) if n.startswith("rlmix_") and callable(getattr(obj, n)))


def describe(obj: Any) -> str:
    doc = inspect.getdoc(obj) if isinstance(obj, ModuleType) or inspect.isclass(obj) else None
    # the first paragraph, on one line
    return " ".join((doc or "").strip().split("\n\n")[0].split()) if doc else ""
