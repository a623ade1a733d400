"""Errors the CLI reports in one line, without a traceback."""

from __future__ import annotations

ORIGIN = "_rlmix_origin"  # (plugin, hook) set on an exception by the hook that raised it


class RlmixError(Exception):
    """Base class of errors that are the user's to fix (bad manifest, missing plugin, ...)."""


class ManifestError(RlmixError):
    """The manifest is wrong: unknown key, wrong type, unknown plugin, hook without owner."""


class PluginError(RlmixError):
    """A plugin failed to import or to configure; the message names it."""


ConfigError = ManifestError  # what plugins raise from rlmix_configure for bad settings


def mark_origin(exc: BaseException, plugin: str, hook: str) -> None:
    """Record on ``exc`` that it escaped ``plugin``'s ``hook`` (the innermost hook wins: a
    plugin calling another plugin's hook does not take the blame for it). The exception keeps
    its type, so callers that catch it by type are unaffected; a note names the plugin in its
    traceback."""
    if getattr(exc, ORIGIN, None) is not None:
        return
    try:
        setattr(exc, ORIGIN, (plugin, hook))
        exc.add_note(f"(raised in plugin '{plugin}', {hook})")
    except (AttributeError, TypeError):  # an exception type without a __dict__
        pass


def origin(exc: BaseException) -> tuple[str, str] | None:
    """``(plugin, hook)`` where ``exc`` (or an exception it was raised from) escaped a hook."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = getattr(current, ORIGIN, None)
        if found is not None:
            return found
        current = current.__cause__ or current.__context__
    return None


def one_line(exc: BaseException) -> str:
    """The CLI's message for ``exc``: ``plugin 'X' failed in rlmix_Y: <exception>`` when it
    escaped a plugin's hook; the message alone for an ``RlmixError``; else its type and text."""
    text = str(exc).strip() or "(no message)"
    if not isinstance(exc, RlmixError):  # the traceback (in the run log, or -v) has the rest
        lines = text.splitlines()
        text = lines[0] + (" ..." if len(lines) > 1 else "")
    detail = text if isinstance(exc, RlmixError) else f"{type(exc).__name__}: {text}"
    where = origin(exc)
    prefix = f"plugin '{where[0]}' failed in {where[1]}: " if where is not None else ""
    # a message that already names the plugin and hook is not prefixed twice
    return detail if detail.startswith(prefix) else prefix + detail
