"""Per-batch choice of the draft length (0 = plain decoding) from measured costs.

A small cost model with running means (exponential, factor ``decay``):

* ``alpha``: the per-slot acceptance rate (accepted drafts / draft slots offered);
* ``verify[w]``: seconds of one verify pass of width ``w = k + 1`` per row;
* ``draft``: seconds of one drafting step (one token for every row) per row.

With per-slot acceptance ``alpha`` a pass of ``k`` drafts yields ``(1 - alpha^(k+1)) / (1 -
alpha)`` tokens on average; it costs ``verify[k+1] + k * draft``. The choice maximises tokens
per second over the candidates; a width never measured is estimated by a line through the
measured widths (or, with one measurement, charged like ``verify[1]`` times the width: a
pessimistic guess, so exploration rather than optimism finds out). With probability
``explore`` (and until both plain and the longest draft have been measured) another candidate is
tried, so the estimates keep tracking the policy and drafter as they change.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from rlmix_speculative.engine import SpecStats


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens per verify pass with ``k`` drafts accepted independently w.p. ``alpha``."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class CostModel:
    candidates: list[int]
    explore: float = 0.1
    decay: float = 0.3
    seed: int = 0
    alpha: float | None = None
    verify: dict[int, float] = field(default_factory=dict)
    draft: float | None = None
    choices: int = 0

    def __post_init__(self) -> None:
        self.candidates = sorted(set(self.candidates) | {0})
        self.rng = random.Random(self.seed)

    def state(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "verify": dict(self.verify), "draft": self.draft,
                "choices": self.choices, "rng": self.rng.getstate()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.alpha = state.get("alpha")
        self.verify = {int(k): float(v) for k, v in state.get("verify", {}).items()}
        self.draft = state.get("draft")
        self.choices = int(state.get("choices", 0))
        if "rng" in state:
            self.rng.setstate(state["rng"])

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.decay) * old + self.decay * new

    def verify_cost(self, width: int) -> float:
        if width in self.verify:
            return self.verify[width]
        known = sorted(self.verify.items())
        if len(known) >= 2:  # a line through the two nearest measured widths
            (w0, c0), (w1, c1) = sorted(known, key=lambda kv: abs(kv[0] - width))[:2]
            slope = (c1 - c0) / (w1 - w0)
            return max(c0 + slope * (width - w0), min(c0, c1))
        if known:
            return known[0][1] * width / known[0][0]
        return float(width)

    def rate(self, k: int) -> float:
        """Estimated tokens per second per row with ``k`` drafts."""
        if k == 0:
            return 1.0 / self.verify_cost(1)
        alpha = self.alpha if self.alpha is not None else 0.0
        draft = self.draft if self.draft is not None else 0.0
        return expected_tokens(alpha, k) / (self.verify_cost(k + 1) + k * draft)

    def choose(self) -> int:
        self.choices += 1
        longest = max(self.candidates)
        if longest == 0:
            return 0
        if 1 not in self.verify:
            return 0
        if longest + 1 not in self.verify or self.alpha is None:
            return longest
        if self.rng.random() < self.explore:
            return self.rng.choice(self.candidates)
        return max(self.candidates, key=self.rate)

    def update(self, stats: SpecStats) -> None:
        if stats.row_passes == 0:
            return
        rows_per_pass = stats.row_passes / max(stats.passes, 1)
        per_row = stats.verify_s / stats.passes / rows_per_pass
        self.verify[stats.k + 1] = self._mean(self.verify.get(stats.k + 1), per_row)
        if stats.k > 0 and stats.slots:
            self.alpha = self._mean(self.alpha, stats.accepted / stats.slots)
            step = stats.draft_s / (stats.passes * stats.k) / rows_per_pass
            self.draft = self._mean(self.draft, step)
