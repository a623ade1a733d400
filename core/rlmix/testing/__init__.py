"""Fixtures and helpers for testing rlmix plugins (a pytest plugin, entry point ``pytest11``).

Fixtures: ``tiny_model`` (a random Llama and byte tokenizer, built in-process), ``tiny_batch``
(a small ``RolloutBatch``), ``fake_run`` (a factory of ``Run`` objects with chosen plugins),
``toy_policy`` (a tabular policy on which an advantage and a loss run hundreds of steps in
seconds).

``rlmix.testing.standins`` holds stand-in plugins (a fake env, a fake rollout, a simple
algorithm) that tests register around a plugin under test. The conformance kit
(``check_plugin(name)``, ``pytest --rlmix-conformance NAME``) is the distribution
``rlmix-conformance`` (``libs/conformance``, import ``rlmix_conformance``), which registers the
stand-ins before the plugin it checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from rlmix.testing.helpers import ToyPolicy
    from rlmix.types import RolloutBatch, Run

# This module is the ``pytest11`` entry point: every pytest run in an environment where rlmix
# is installed imports it. It imports neither torch nor transformers; the helpers below come
# from ``rlmix.testing.helpers`` on first use (``from rlmix.testing import make_run``) and the
# fixtures import what they need when a test requests them.
_HELPERS = ("make_batch", "make_run", "skip_unless_installed", "ToyPolicy", "toy_train",
            "harness_example_resumes", "example_resumes", "load_script")


def __getattr__(name: str) -> Any:
    if name in _HELPERS:
        from rlmix.testing import helpers

        value = getattr(helpers, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlmix.testing' has no attribute {name!r}")


@pytest.fixture
def tiny_model() -> tuple[Any, Any]:
    """``(model, tokenizer)``: a random two-layer Llama and a byte-level tokenizer."""
    from rlmix.policy import tiny_random

    return tiny_random()


@pytest.fixture
def tiny_batch() -> RolloutBatch:
    """Two groups of four samples, ragged completions, binary rewards."""
    from rlmix.testing.helpers import make_batch

    return make_batch()


@pytest.fixture
def fake_run() -> Callable[..., Run]:
    """Factory: ``fake_run({"grpo": rlmix_grpo}, ["grpo.beta=0.1"])`` -> ``Run``."""
    from rlmix.testing.helpers import make_run

    return make_run


@pytest.fixture
def toy_policy() -> ToyPolicy:
    """A fresh ``ToyPolicy(vocab=6, length=4)``; train it with ``rlmix.testing.toy_train``."""
    from rlmix.testing.helpers import ToyPolicy

    return ToyPolicy()
