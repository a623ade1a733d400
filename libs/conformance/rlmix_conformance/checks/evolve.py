"""Checks of ``rlmix_evolve``: a ``HarnessUpdate`` or None."""

from __future__ import annotations

from rlmix import loop
from rlmix.types import HarnessUpdate
from rlmix_conformance.batches import kit_batch
from rlmix_conformance.kit import ConformanceFailure, Subject, check


@check("rlmix_evolve", "update")
def _evolve(s: Subject) -> None:
    """None or a HarnessUpdate of text components, which the core can apply."""
    run = s.shared()
    batch = kit_batch(run)
    impl = s.impl(run, "rlmix_evolve")
    result = impl.function(run=run, batch=batch)
    if result is None:
        return
    if not isinstance(result, HarnessUpdate):
        raise ConformanceFailure(f"rlmix_evolve returned {type(result).__name__}; expected "
                                 f"rlmix.HarnessUpdate or None")
    bad = {k: type(v).__name__ for k, v in result.components.items()
           if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise ConformanceFailure(f"rlmix_evolve returned components that are not text: {bad}")
    loop.apply_harness_update(run, result)
    run.hook.rlmix_prompts(run=run, step=run.step)
