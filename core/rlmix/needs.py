"""Hooks a plugin declares the run can do without (``RLMIX_NOT_NEEDED``).

A method that trains without a reward (online self fine-tuning, pure on-policy distillation)
declares it on its plugin object, instead of the core knowing the method::

    RLMIX_NOT_NEEDED = ("rlmix_score", "rlmix_advantage")

Only the required hooks ``rlmix_score`` and ``rlmix_advantage`` may be declared. The manifest
then loads without a scorer or an advantage owner; with no scorer the rewards are 0, with no
advantage owner the advantages are 0 (any plugin that does implement them still runs).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlmix.errors import PluginError
from rlmix.hookspecs import REQUIRED_HOOKS

ATTRIBUTE = "RLMIX_NOT_NEEDED"
DECLARABLE = ("rlmix_score", "rlmix_advantage")


def declared(obj: Any) -> set[str]:
    """The hooks one plugin object declares not needed (checked against ``DECLARABLE``)."""
    value = getattr(obj, ATTRIBUTE, ())
    names = {value} if isinstance(value, str) else set(value or ())
    bad = sorted(names - set(DECLARABLE))
    if bad:
        raise PluginError(f"{ATTRIBUTE} may name {', '.join(DECLARABLE)} only, not "
                          f"{', '.join(bad)}")
    return names


def not_needed(plugins: Iterable[Any]) -> set[str]:
    """The union of what ``plugins`` declare."""
    out: set[str] = set()
    for obj in plugins:
        out |= declared(obj)
    return out


def required_hooks(plugins: Iterable[Any], required: dict[str, str] | None) -> dict[str, str]:
    """``required`` (default ``REQUIRED_HOOKS``) less the hooks ``plugins`` declare not
    needed."""
    base = REQUIRED_HOOKS if required is None else required
    skip = not_needed(plugins)
    return {k: v for k, v in base.items() if k not in skip}


def run_does_without(run: Any, hook: str) -> bool:
    """Whether a registered plugin of ``run`` declared ``hook`` not needed."""
    return hook in not_needed(run.pm.get_plugins())
