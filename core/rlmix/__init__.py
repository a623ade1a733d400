"""rlmix: reinforcement-learning post-training of language models from plugins.

The public API a plugin needs: ``rlmix.hookimpl``, the types below, ``rlmix.ops``, and
``run.settings(name)``.
"""

from rlmix.errors import ConfigError, ManifestError, PluginError, RlmixError
from rlmix.hookspecs import hookimpl, hookspec
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

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "Episode", "GenerationRequest", "HarnessUpdate", "LossTerms", "ManifestError",
    "Minibatch", "Normalizers", "PluginError", "Prompt", "RlmixError", "RolloutBatch", "Run",
    "StepResult", "check_choices", "check_ranges", "hookimpl", "hookspec", "setting",
    "__version__",
]
