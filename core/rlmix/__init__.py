"""rlmix: reinforcement-learning post-training of language models from plugins.

The public API a plugin needs: ``rlmix.hookimpl``, the types below, ``rlmix.ops``, and
``run.settings(name)``.
"""

from typing import TYPE_CHECKING, Any

from rlmix.errors import ConfigError, ManifestError, PluginError, RlmixError
from rlmix.hookspecs import hookimpl, hookspec

if TYPE_CHECKING:  # pragma: no cover
    from rlmix.manifest import check_choices, check_ranges, setting
    from rlmix.types import (
        Episode,
        GenerationRequest,
        HarnessUpdate,
        LossTerms,
        Minibatch,
        Normalizers,
        Prompt,
        RolloutBatch,
        Run,
        StepResult,
    )

# Imported on first use (PEP 562), not with the package: ``rlmix.types`` imports torch (~3 s),
# and ``import rlmix`` must stay cheap for what needs no tensor (the pytest plugin
# ``rlmix.testing`` loaded by every pytest run, ``rlmix plugins``, a manifest check).
_LAZY = {**{name: "rlmix.manifest" for name in ("check_choices", "check_ranges", "setting")},
         **{name: "rlmix.types" for name in (
             "Episode", "GenerationRequest", "HarnessUpdate", "LossTerms", "Minibatch",
             "Normalizers", "Prompt", "RolloutBatch", "Run", "StepResult")}}


def __getattr__(name: str) -> Any:
    import importlib.util

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"rlmix.{name}") is not None:
        # ``import rlmix; rlmix.ops.f()`` worked while the package imported its submodules
        value = importlib.import_module(f"rlmix.{name}")
    else:
        raise AttributeError(f"module 'rlmix' has no attribute {name!r}")
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "ConfigError", "Episode", "GenerationRequest", "HarnessUpdate", "LossTerms", "ManifestError",
    "Minibatch", "Normalizers", "PluginError", "Prompt", "RlmixError", "RolloutBatch", "Run",
    "StepResult", "check_choices", "check_ranges", "hookimpl", "hookspec", "setting",
    "__version__",
]
