"""Checks of ``rlmix_evaluate``: finite metrics under no_grad in eval mode."""

from __future__ import annotations

import math

import torch

from rlmix_conformance.kit import ConformanceFailure, Subject, check


@check("rlmix_evaluate", "metrics")
def _evaluate(s: Subject) -> None:
    """{metric: number} (finite) or None, under no_grad with the model in eval mode."""
    run = s.shared()
    assert run.policy is not None
    impl = s.impl(run, "rlmix_evaluate")
    run.policy.model.eval()
    try:
        with torch.no_grad():
            result = impl.function(run=run)
    finally:
        run.policy.model.train()
    if result is None:
        return
    if not isinstance(result, dict):
        raise ConformanceFailure(f"rlmix_evaluate returned {type(result).__name__}; expected "
                                 f"{{metric: number}} or None")
    for key, value in result.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConformanceFailure(f"rlmix_evaluate metric '{key}' = {value!r} is not a "
                                     f"number") from None
        if not math.isfinite(number):
            raise ConformanceFailure(f"rlmix_evaluate metric '{key}' is {number}")
