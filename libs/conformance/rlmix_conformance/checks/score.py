"""Checks of ``rlmix_score``: terms per sample, determinism."""

from __future__ import annotations

import torch

from rlmix.types import RolloutBatch, Run
from rlmix_conformance.batches import _at, _finite_rows, _nan_word, _same, edge_batches, kit_batch
from rlmix_conformance.kit import ConformanceFailure, Subject, check


def _score(s: Subject, run: Run, batch: RolloutBatch, what: str) -> dict[str, torch.Tensor]:
    impl = s.impl(run, "rlmix_score")
    result = impl.function(run=run, batch=batch)
    if result is None:
        return {}
    if not isinstance(result, dict):
        raise ConformanceFailure(f"rlmix_score returned {type(result).__name__}{what}; expected "
                                 f"{{term: Tensor[N]}} or None")
    out = {}
    for term, value in result.items():
        if not isinstance(term, str) or not term:
            raise ConformanceFailure(f"rlmix_score returned a term named {term!r}; term names "
                                     f"are non-empty strings (the core prefixes '{s.name}.')")
        try:
            t = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
        except Exception as exc:  # noqa: BLE001
            raise ConformanceFailure(f"rlmix_score term '{term}' is not numeric{what} "
                                     f"({type(exc).__name__}: {exc})") from None
        if t.shape[0] != len(batch):
            raise ConformanceFailure(f"rlmix_score term '{term}' has {t.shape[0]} values for "
                                     f"{len(batch)} samples{what}; return one per row")
        bad = _finite_rows(t)
        if bad:
            raise ConformanceFailure(f"rlmix_score term '{term}' is {_nan_word(t)} at "
                                     f"{_at(bad)}{what}")
        out[term] = t
    return out


@check("rlmix_score", "terms")
def _score_terms(s: Subject) -> None:
    """{term: Tensor[N]} of finite numbers, also on a single-token and an empty completion."""
    run = s.shared()
    _score(s, run, kit_batch(run), "")
    for what, _, batch in edge_batches(run)[1:]:
        _score(s, run, batch, f" on {what}")


@check("rlmix_score", "determinism", level="full")
def _score_determinism(s: Subject) -> None:
    """Two fresh runs with the same seed score the same batch the same."""
    outs = []
    for _ in range(2):
        run = s.run()
        outs.append(_score(s, run, kit_batch(run), ""))
    if _same(outs[0], outs[1]):
        raise ConformanceFailure("rlmix_score is not deterministic: two fresh runs with "
                                 "train.seed=0 give different terms on the same batch")
