"""The conformance kit: does a plugin keep the contract of every hook it implements?

    from rlmix_conformance import check_plugin

    report = check_plugin("myplugin")              # an installed plugin, by entry-point name
    report = check_plugin("myplugin", my_module)   # or an object in this process
    assert report.ok, report.format()

For each hook the plugin implements the kit checks shapes and dtypes, that masks are respected
(for ``rlmix_clip``: the gradient of the aggregated loss is zero wherever ``completion_mask`` is
0), that edge batches give no NaN (a group of identical rewards, a single-token completion, an
empty completion row), determinism under a seed; and for every plugin: that its ``Settings``
validate (defaults build, a wrong-typed value and an unknown key are rejected), that it
configures and runs one training step, and that what it keeps in ``run.state`` survives
``torch.save``/``torch.load``. Hooks it does not own are served by the stand-ins of
``rlmix.testing.standins``, registered before it. A failure says what to fix.

Two levels: ``quick`` (a few seconds; ``rlmix plugins --check``) and ``full`` (adds seeded
re-runs, minibatch-split invariance, gradient accumulation and a checkpoint resume;
``pytest --rlmix-conformance NAME``).

Modules: ``kit`` (results, reports, the ``@check`` registry, ``Subject``), ``batches`` (the
kit's batches and the helpers the checks share), ``checks.<hook>`` (one module per hook, and
``checks.every_plugin``), ``runner`` (``plan``, ``run_check``, ``check_plugin``), ``suite``
(the checks as pytest items), ``pytest_plugin`` (the ``--rlmix-conformance`` option, entry
point ``pytest11``) and ``cli`` (the report of ``rlmix plugins --check``).

The names below are imported on first use (PEP 562): the pytest plugin, which every pytest run in
an environment with this distribution imports, must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "kit": ("CHECKS", "HOOKS", "LEVELS", "Check", "ConformanceFailure", "NotApplicable",
            "Report", "Result", "Subject", "check"),
    "batches": ("_batch_problems", "edge_batches", "kit_batch"),
    "runner": ("assert_conformant", "check_plugin", "plan", "run_check"),
}
_WHERE = {name: module for module, names in _NAMES.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rlmix_conformance' has no attribute {name!r}")
    importlib.import_module("rlmix_conformance.checks")  # registers every check
    value = getattr(importlib.import_module(f"rlmix_conformance.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
