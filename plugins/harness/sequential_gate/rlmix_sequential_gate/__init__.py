"""An anytime-valid sequential acceptance gate for harness evolution (SEA's gate, our reading).

SEA (seeds 003, paragraph 47) admits every self-modification only through "an anytime-valid gate
that emits an auditable certificate against a fixed error budget". This plugin is such a gate
for any harness plugin that accepts or rejects candidates:

* the test: paired per-task scores ``(before, after)`` of the incumbent and the candidate give
  differences ``d = (after - before) / (score_high - score_low)`` in ``[-1, 1]``; the null is
  ``H0: E[d] <= margin`` (the candidate is not better by more than ``margin``);
* the e-process: a betting martingale ``K_t = prod_i (1 + b_i * s_i)`` on the normalised payoff
  ``s_i = (d_i - margin) / (1 + margin) >= -1`` with a *predictable* bet ``b_i in [0, max_bet]``
  (chosen from ``d_1 .. d_{i-1}`` only: aGRAPA by default, or ONS, or a fixed fraction). Under
  ``H0`` it is a nonnegative supermartingale with ``K_0 = 1``, so by Ville's inequality
  ``P(sup_t K_t >= 1/alpha) <= alpha``: the gate may look after every task and stop the moment
  the wealth reaches ``1/alpha`` (accept), and the error stays below ``alpha``;
* stops: accept at ``K_t >= 1/alpha``; an optional futility test (the mirror-image e-process for
  ``E[d] >= margin``, stopping to reject at ``1/futility_beta``); curtailment (reject when
  ``1/alpha`` cannot be reached in the samples left); at ``max_samples`` or when the tasks run
  out undecided, ``at_end`` decides (``reject``, the default, or the sample ``mean``);
* a fixed error budget over the run: ``spending: basel`` runs the k-th check at
  ``alpha * 6 / (pi^2 k^2)``, so the chance that any check of the run accepts a candidate that
  is not better is at most ``alpha``; ``spending: none`` gives every check level ``alpha``.

Listed in a manifest the plugin puts a ``SequentialGate`` in ``run.resources["rlmix.gates"]``,
with the interface of the ``gates`` plugin's object (``check``, ``split``, ``mark_seen``,
``guard_heldout``, ``checks``, ``rejected``, ``last``), so gepa and ace use it unchanged. When
``gates`` is listed too, its object is wrapped (duck-typed, never imported): a candidate must
pass both. ``check_sequential(next_pair)`` pulls paired scores one task at a time and stops as
soon as the test decides, so a plugin that evaluates lazily spends fewer evaluations. Every
check leaves a certificate in ``run.state["sequential_gate"]["ledger"]`` (checkpointed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import rlmix
from rlmix.types import Run

NAME = "sequential_gate"
RESOURCE = "rlmix.gates"
BETS = ("agrapa", "ons", "fixed")
AT_END = ("reject", "mean")
SPENDING = ("none", "basel")
SETS = ("search", "selection", "heldout")
PRIOR_VAR = 0.25  # aGRAPA's prior variance of the payoff (one pseudo-observation)
ONS_RATE = 2.0 / (2.0 - math.log(3.0))  # Cutkosky & Orabona's online Newton step constant
LEDGER_KEEP = 200  # certificates kept in run.state (counters cover the rest)


@dataclass
class Settings:
    alpha: float = 0.05  # error budget: P(accept a candidate that is not better) <= alpha
    margin: float = 0.0  # H0: mean(after - before) <= margin (score units); accept beats it
    bet: str = "agrapa"  # agrapa | ons | fixed: the predictable betting fraction
    max_bet: float = 0.5  # cap of the bet on the normalised payoff, in (0, 1)
    fixed_bet: float = 0.25  # bet: fixed uses this fraction every sample
    max_samples: int = 0  # stop after this many pairs (0 = as many as given)
    futility_beta: float = 0.0  # reject early when the mirror e-process reaches 1/beta; 0 = off
    curtail: bool = True  # reject as soon as 1/alpha is out of reach in the samples left
    at_end: str = "reject"  # undecided at the end: reject | mean (accept if mean diff > margin)
    spending: str = "none"  # none (each check at alpha) | basel (k-th at 6 alpha / (pi k)^2)
    score_low: float = 0.0  # the scores' range; differences are divided by its width
    score_high: float = 1.0
    wrap: bool = True  # wrap the gates plugin's object when it is listed (both must pass)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, bet=BETS, at_end=AT_END, spending=SPENDING)
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha: must be in (0, 1), got {self.alpha}")
        if not 0.0 < self.max_bet < 1.0:
            raise ValueError(f"max_bet: must be in (0, 1), got {self.max_bet}")
        if not 0.0 < self.fixed_bet <= self.max_bet:
            raise ValueError(f"fixed_bet: must be in (0, max_bet={self.max_bet}], got "
                             f"{self.fixed_bet}")
        if self.max_samples < 0:
            raise ValueError(f"max_samples: must be >= 0, got {self.max_samples}")
        if not 0.0 <= self.futility_beta < 1.0:
            raise ValueError(f"futility_beta: must be in [0, 1), got {self.futility_beta}")
        if not self.score_high > self.score_low:
            raise ValueError(f"score_high: must be > score_low ({self.score_low}), got "
                             f"{self.score_high}")
        width = self.score_high - self.score_low
        if not -width < self.margin < width:
            raise ValueError(f"margin: must be strictly inside (-{width:g}, {width:g}) (the "
                             f"score range's width), got {self.margin}")


# ---------------------------------------------------------------- the e-process (pure)


class Bettor:
    """Wealth of a betting martingale on payoffs ``s_i >= -1`` with a predictable bet.

    ``bet()`` is the fraction for the next sample, a function of the past payoffs only;
    ``update(s)`` multiplies the wealth by ``1 + bet * s`` and learns from ``s``."""

    def __init__(self, kind: str = "agrapa", max_bet: float = 0.5,
                 fixed_bet: float = 0.25) -> None:
        if kind not in BETS:
            raise ValueError(f"bet: {kind!r} is not one of {', '.join(BETS)}")
        self.kind, self.max_bet, self.fixed_bet = kind, max_bet, fixed_bet
        self.wealth = 1.0
        self.n = 0
        self.sum_s = 0.0
        self.sum_s2 = 0.0
        self.ons_bet = 0.0
        self.ons_a = 1.0

    def bet(self) -> float:
        if self.kind == "fixed":
            return self.fixed_bet
        if self.kind == "ons":
            return self.ons_bet
        # aGRAPA: b = mu / (var + mu^2), the maximiser of a second-order expansion of
        # E log(1 + b s), with mean and variance estimated from the past and one prior
        # pseudo-observation (mean 0, variance PRIOR_VAR)
        n = self.n
        mu = self.sum_s / (n + 1)
        var = (PRIOR_VAR + self.sum_s2 - 2 * mu * self.sum_s + n * mu * mu) / (n + 1)
        return _clip(mu / (var + mu * mu), 0.0, self.max_bet)

    def update(self, s: float) -> float:
        if s < -1.0 - 1e-12:
            raise ValueError(f"payoff {s} < -1: the wealth could go negative")
        b = self.bet()
        self.wealth *= 1.0 + b * s
        if self.kind == "ons":
            z = s / (1.0 + b * s)
            self.ons_a += z * z
            self.ons_bet = _clip(b + ONS_RATE * z / self.ons_a, 0.0, self.max_bet)
        self.n += 1
        self.sum_s += s
        self.sum_s2 += s * s
        return self.wealth

    def best_factor(self, s_max: float) -> float:
        """The largest factor one more sample can multiply the wealth by."""
        cap = self.fixed_bet if self.kind == "fixed" else self.max_bet
        return 1.0 + cap * max(0.0, s_max)


def _clip(x: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, x))


def wealth_path(diffs: Sequence[float], margin: float = 0.0, bet: str = "agrapa",
                max_bet: float = 0.5, fixed_bet: float = 0.25) -> list[float]:
    """The wealth after each difference ``d_i in [-1, 1]`` of a test of ``E[d] <= margin``."""
    bettor = Bettor(bet, max_bet, fixed_bet)
    return [bettor.update((float(d) - margin) / (1.0 + margin)) for d in diffs]


def spent_alpha(alpha: float, k: int, spending: str = "none") -> float:
    """The level of the ``k``-th check (1-based) under the error-budget rule ``spending``."""
    if spending == "basel":
        return alpha * 6.0 / (math.pi ** 2 * k * k)  # sums to alpha over k = 1, 2, ...
    return alpha


@dataclass
class Decision:
    """What one sequential test decided, and on what."""

    passed: bool
    decision: str  # accept | futility | curtailed | end-reject | end-mean-accept | ...
    samples: int
    wealth: float
    threshold: float
    futility_wealth: float = 1.0
    alpha: float = 0.05
    mean_diff: float = 0.0
    before: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)


def sequential_test(pairs: Iterator[tuple[float, float] | None] | Callable[[], Any],
                    settings: Settings, alpha: float | None = None,
                    available: int | None = None) -> Decision:
    """Pull ``(before, after)`` pairs until the test decides; never pulls one more than needed.

    ``pairs`` is an iterator or a zero-argument function; ``None`` (or exhaustion) ends the
    supply. ``available`` is how many pairs the supply holds when known (for curtailment)."""
    s = settings
    alpha = s.alpha if alpha is None else alpha
    width = s.score_high - s.score_low
    m = s.margin / width
    limit = s.max_samples or None
    if available is not None:
        limit = available if limit is None else min(limit, available)
    pull = pairs if callable(pairs) else (lambda: next(pairs, None))
    up = Bettor(s.bet, s.max_bet, s.fixed_bet)  # H0: E d <= m
    down = Bettor(s.bet, s.max_bet, s.fixed_bet)  # futility, H0': E d >= m
    threshold = 1.0 / alpha
    before: list[float] = []
    after: list[float] = []
    diffs: list[float] = []

    def done(passed: bool, why: str) -> Decision:
        return Decision(passed, why, len(diffs), up.wealth, threshold, down.wealth, alpha,
                        sum(diffs) / len(diffs) if diffs else 0.0, before, after)

    while limit is None or len(diffs) < limit:
        if s.curtail and limit is not None:
            left = limit - len(diffs)
            if up.wealth * up.best_factor((1.0 - m) / (1.0 + m)) ** left < threshold:
                return done(False, "curtailed")
        pair = pull()
        if pair is None:
            break
        b, a = (float(x) for x in pair)
        for x in (b, a):
            if not s.score_low - 1e-9 <= x <= s.score_high + 1e-9:
                raise rlmix.ConfigError(
                    f"sequential_gate.score_low / score_high: score {x} is outside "
                    f"[{s.score_low:g}, {s.score_high:g}]; set them to the metric's range")
        d = _clip((a - b) / width, -1.0, 1.0)
        before.append(b)
        after.append(a)
        diffs.append(d)
        if up.update((d - m) / (1.0 + m)) >= threshold:
            return done(True, "accept")
        if s.futility_beta > 0 and down.update((m - d) / (1.0 - m)) >= 1.0 / s.futility_beta:
            return done(False, "futility")
    if s.at_end == "mean" and diffs:
        ok = sum(diffs) / len(diffs) > m
        return done(ok, "end-mean-accept" if ok else "end-mean-reject")
    return done(False, "end-reject")


# ---------------------------------------------------------------- the gate object


@dataclass
class GateResult:
    """The verdict, shaped like the gates plugin's ``GateResult`` (``passed``, ``regressions``,
    ``fixes``, ``allowed``, ``reason``) plus the sequential test's ``samples``, ``wealth``,
    ``threshold`` and ``decision``. ``regressions`` / ``fixes`` index the pairs the test used
    whose score went down / up (or the wrapped gate's, when there is one)."""

    passed: bool
    regressions: list[int] = field(default_factory=list)
    fixes: list[int] = field(default_factory=list)
    allowed: int = 0
    reason: str = ""
    samples: int = 0
    wealth: float = 1.0
    threshold: float = 20.0
    decision: str = ""
    inner_passed: bool | None = None


@dataclass
class TaskSplit:
    search: list[Any]
    selection: list[Any]
    heldout: list[Any]


def _key(task: Any) -> Hashable:
    return tuple(task) if isinstance(task, list) else task


def fresh_state() -> dict[str, Any]:
    return {"checks": 0, "rejected": 0, "samples": 0, "ledger": []}


class SequentialGate:
    """What the plugin puts at ``run.resources["rlmix.gates"]``: the gates interface, with the
    sequential test as the acceptance rule, wrapping ``inner`` (another gate object) if given.

    Counters and certificates live in ``run.state["sequential_gate"]`` when a run is given (so
    a resumed run continues the error-budget schedule), else in the object."""

    def __init__(self, settings: Settings | None = None, run: Run | None = None,
                 inner: Any = None) -> None:
        self.settings = settings or Settings()
        self.run = run
        self.inner = inner
        self._local = fresh_state()
        self._seen: set[Hashable] = set()
        self.last: GateResult | None = None

    # -- counters (state-backed)
    @property
    def state(self) -> dict[str, Any]:
        if self.run is None:
            return self._local
        return self.run.state.setdefault(NAME, fresh_state())

    @property
    def checks(self) -> int:
        return int(self.state["checks"])

    @property
    def rejected(self) -> int:
        return int(self.state["rejected"])

    @property
    def seen(self) -> set[Hashable]:
        return self.inner.seen if self.inner is not None and hasattr(self.inner, "seen") \
            else self._seen

    # -- task sets: the wrapped gate's when there is one
    def split(self, ids: Sequence[Any], sizes: dict[str, int]) -> Any:
        if self.inner is not None:
            return self.inner.split(ids, sizes)
        unknown = set(sizes) - set(SETS)
        if unknown:
            raise ValueError(f"task split: unknown set(s) {sorted(unknown)}; sets are "
                             f"{', '.join(SETS)}")
        want = [max(0, int(sizes.get(k, 0))) for k in SETS]
        if sum(want) > len(ids):
            raise ValueError(f"task split: {sum(want)} tasks asked for, only {len(ids)} given")
        a, b = want[0], want[0] + want[1]
        out = TaskSplit(list(ids[:a]), list(ids[a:b]), list(ids[b:b + want[2]]))
        self.mark_seen([*out.search, *out.selection])
        return out

    def mark_seen(self, tasks: Sequence[Any]) -> None:
        if self.inner is not None:
            self.inner.mark_seen(tasks)
        else:
            self._seen.update(_key(t) for t in tasks)

    def guard_heldout(self, tasks: Sequence[Any]) -> None:
        if self.inner is not None:
            self.inner.guard_heldout(tasks)
            return
        leaked = [t for t in tasks if _key(t) in self._seen]
        if leaked:
            raise ValueError(f"sequential_gate: {len(leaked)} held-out task(s) were seen by the "
                             f"search, e.g. {leaked[0]!r}")

    # -- acceptance
    def check(self, before: Sequence[float], after: Sequence[float]) -> GateResult:
        """All scores known: run the test over the pairs in order (it may stop early), and the
        wrapped gate on all of them."""
        if len(before) != len(after):
            raise ValueError(f"sequential_gate: {len(before)} scores before, {len(after)} after;"
                             " the check set must be the same tasks in the same order")
        pairs = iter(zip(before, after))
        return self._decide(pairs, len(before), list(before), list(after))

    def check_sequential(self, next_pair: Callable[[], tuple[float, float] | None]
                         ) -> GateResult:
        """Pull paired ``(before, after)`` scores one task at a time until the test decides
        (``None`` ends the supply); the wrapped gate sees the pairs pulled."""
        return self._decide(next_pair, None, None, None)

    def _decide(self, pairs: Any, available: int | None, before: list[float] | None,
                after: list[float] | None) -> GateResult:
        s = self.settings
        state = self.state
        k = state["checks"] + 1
        alpha = spent_alpha(s.alpha, k, s.spending)
        d = sequential_test(pairs, s, alpha, available)
        before = d.before if before is None else before
        after = d.after if after is None else after
        regressions = [i for i, (b, a) in enumerate(zip(d.before, d.after)) if a < b]
        fixes = [i for i, (b, a) in enumerate(zip(d.before, d.after)) if a > b]
        reason = (f"sequential test: {d.decision} after {d.samples} pairs (wealth "
                  f"{d.wealth:.3g}, accept at {d.threshold:.3g}, alpha {alpha:.3g}; mean diff "
                  f"{d.mean_diff:+.3f}, margin {s.margin:g})")
        result = GateResult(d.passed, regressions, fixes, 0, reason, d.samples, d.wealth,
                            d.threshold, d.decision)
        if self.inner is not None:
            inner = self.inner.check(before, after)
            result.inner_passed = bool(inner.passed)
            result.passed = result.passed and result.inner_passed
            result.regressions = list(getattr(inner, "regressions", regressions))
            result.fixes = list(getattr(inner, "fixes", fixes))
            result.allowed = int(getattr(inner, "allowed", 0))
            result.reason += f"; wrapped gate: {getattr(inner, 'reason', '')}"
        state["checks"] = k
        state["rejected"] += 0 if result.passed else 1
        state["samples"] += d.samples
        state["ledger"].append({
            "check": k, "step": getattr(self.run, "step", 0), "passed": result.passed,
            "decision": d.decision, "samples": d.samples, "wealth": d.wealth,
            "threshold": d.threshold, "alpha": alpha, "mean_diff": d.mean_diff,
            "futility_wealth": d.futility_wealth, "inner_passed": result.inner_passed})
        del state["ledger"][:-LEDGER_KEEP]
        self.last = result
        return result


# ---------------------------------------------------------------- hooks


@rlmix.hookimpl(trylast=True)
def rlmix_configure(run: Run) -> None:
    """``trylast``: a ``gates`` object listed in the same manifest is already in place."""
    s = run.settings(NAME)
    inner = run.resources.get(RESOURCE)
    if isinstance(inner, SequentialGate):  # configured twice: keep what it wrapped
        inner = inner.inner
    if inner is not None and not callable(getattr(inner, "check", None)):
        raise rlmix.ConfigError(f"sequential_gate.wrap: run.resources[{RESOURCE!r}] holds "
                                f"{type(inner).__name__}, which has no check(before, after)")
    run.resources[RESOURCE] = SequentialGate(s, run, inner if s.wrap else None)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if not state or not state["checks"]:
        return
    metrics[f"{NAME}/checks"] = state["checks"]
    metrics[f"{NAME}/rejected"] = state["rejected"]
    metrics[f"{NAME}/samples"] = state["samples"]
    last = state["ledger"][-1]
    metrics[f"{NAME}/last_samples"] = last["samples"]
    metrics[f"{NAME}/last_wealth"] = last["wealth"]
