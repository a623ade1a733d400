"""Double Ratchet's evolved metric: a weighted set of small drawback detectors, evolved (add,
drop, reweight) to agree with a small anchored reference set, regularised by consensus over
unlabeled outputs, and audited on a held-out anchor set it never reads.

* A detector is a case-insensitive regular expression that flags a drawback in a text.
* A metric is ``{pattern: weight}``; its score of a text is ``1 - min(1, sum of the weights of
  the detectors that fire)`` (1 = no drawback found).
* Anchor agreement: the share of anchor pairs with different reference scores that the metric
  orders the same way (a metric tie counts half).
* Consensus: per unlabeled output, the weighted share of the metric's detectors that agree
  with their weighted-majority verdict, averaged (1 with fewer than two detectors).
* Evolution: each round one mutation; it is kept when the objective (anchor agreement +
  ``consensus_weight`` x consensus) rises, or stays equal with no more detectors. The anchor
  guard (the ratchet) also refuses any mutation that lowers anchor agreement. Without the guard
  the objective is consensus alone, which a metric with no detectors maximises: that is the
  collapse the guard prevents.

Detectors come from the manifest's ``pool`` and, with ``mine > 0``, are mined from the unlabeled
outputs themselves (``propose``: a word-boundary detector for each frequent word not yet in the
pool), so the metric can find drawbacks nobody listed. ``EvolvedMetric`` is the lifecycle in
one object (mine, evolve, score, audit), used by the hook and by any harness loop as its score.

Hooks: ``rlmix_score`` returns the term ``score`` (the metric on each completion); every
``evolve_every`` steps the metric first evolves ``rounds`` rounds with the batch's texts as the
unlabeled outputs. The metric and its history are in ``run.state["double_ratchet"]``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import rlmix
from rlmix.types import RolloutBatch, Run

NAME = "double_ratchet"
Metric = dict[str, float]
Anchor = dict[str, Any]  # {"text": str, "score": float}


@dataclass
class Settings:
    pool: list[str] = field(default_factory=list)  # candidate detectors (regexes)
    anchors: list[dict[str, Any]] = field(default_factory=list)  # [{text, score}], fitted to
    heldout: list[dict[str, Any]] = field(default_factory=list)  # [{text, score}], audit only
    rounds: int = 50  # mutations tried per evolution
    evolve_every: int = 1  # steps between evolutions (0 = only on the first step)
    consensus_weight: float = 0.1
    guard: bool = True  # the anchor ratchet (off only for the ablation)
    seed: int = 0
    max_chars: int = 4000  # texts are cut here before detectors run
    mine: int = 0  # words mined from the unlabeled outputs into the pool per evolution (0: off)
    mine_min_share: float = 0.05  # a mined word appears in at least this share of outputs

    def __post_init__(self) -> None:
        if self.rounds < 0 or self.evolve_every < 0 or self.consensus_weight < 0:
            raise ValueError("rounds, evolve_every and consensus_weight must be >= 0")
        if self.mine < 0 or not 0 <= self.mine_min_share <= 1:
            raise ValueError("mine must be >= 0 and mine_min_share in [0, 1]")
        for p in self.pool:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"pool: {p!r} is not a regular expression ({exc})") from None
        for name in ("anchors", "heldout"):
            for a in getattr(self, name):
                if not isinstance(a, dict) or "text" not in a or "score" not in a:
                    raise ValueError(f"{name}: every item needs 'text' and 'score'")


# ---------------------------------------------------------------- the metric


def fires(pattern: str, text: str) -> bool:
    return re.search(pattern, text, re.IGNORECASE) is not None


def score_texts(metric: Metric, texts: Sequence[str], max_chars: int = 4000) -> list[float]:
    """``1 - min(1, sum of the weights of the detectors that fire)`` per text."""
    return [1.0 - min(1.0, sum(w for p, w in metric.items() if fires(p, t[:max_chars])))
            for t in texts]


def anchor_agreement(metric: Metric, anchors: Sequence[Anchor]) -> float:
    """Share of anchor pairs (different reference scores) the metric orders alike; ties in the
    metric count half; 0 with no such pair."""
    scores = score_texts(metric, [a["text"] for a in anchors])
    right = total = 0.0
    for i in range(len(anchors)):
        for j in range(i + 1, len(anchors)):
            ri, rj = float(anchors[i]["score"]), float(anchors[j]["score"])
            if ri == rj:
                continue
            total += 1
            if scores[i] == scores[j]:
                right += 0.5
            elif (scores[i] > scores[j]) == (ri > rj):
                right += 1
    return right / total if total else 0.0


def consensus(metric: Metric, texts: Sequence[str]) -> float:
    """Mean over texts of the weighted share of detectors agreeing with their weighted
    majority verdict (1 for a metric of fewer than two detectors, or no texts)."""
    if len(metric) < 2 or not texts:
        return 1.0
    total = sum(metric.values())
    shares = []
    for t in texts:
        firing = sum(w for p, w in metric.items() if fires(p, t))
        shares.append(max(firing, total - firing) / total)
    return sum(shares) / len(shares)


def objective(metric: Metric, anchors: Sequence[Anchor], unlabeled: Sequence[str],
              consensus_weight: float, guard: bool) -> float:
    return (anchor_agreement(metric, anchors) if guard else 0.0) + \
        consensus_weight * consensus(metric, unlabeled)


def mutate(metric: Metric, pool: Sequence[str], rng: random.Random) -> Metric:
    """One of: add a pool detector at weight 0.25, drop a detector, or double / halve one's
    weight (kept in [0.05, 1])."""
    out = dict(metric)
    unused = [p for p in pool if p not in out]
    moves = (["add"] if unused else []) + (["drop", "reweight"] if out else [])
    if not moves:
        return out
    move = rng.choice(moves)
    if move == "add":
        out[rng.choice(unused)] = 0.25
    elif move == "drop":
        out.pop(rng.choice(sorted(out)))
    else:
        p = rng.choice(sorted(out))
        out[p] = min(1.0, max(0.05, out[p] * rng.choice((0.5, 2.0))))
    return out


def evolve(metric: Metric, pool: Sequence[str], anchors: Sequence[Anchor],
           unlabeled: Sequence[str], rounds: int, rng: random.Random,
           consensus_weight: float = 0.1, guard: bool = True) -> tuple[Metric, dict[str, int]]:
    """``rounds`` mutations; returns the metric and counts of kept and refused mutations."""
    current = dict(metric)
    best = objective(current, anchors, unlabeled, consensus_weight, guard)
    fit = anchor_agreement(current, anchors)
    counts = {"kept": 0, "refused": 0, "guarded": 0}
    for _ in range(rounds):
        cand = mutate(current, pool, rng)
        value = objective(cand, anchors, unlabeled, consensus_weight, guard)
        cand_fit = anchor_agreement(cand, anchors) if guard else fit
        if guard and cand_fit < fit:
            counts["guarded"] += 1
            continue
        if value > best or (value == best and len(cand) <= len(current)):
            current, best, fit = cand, value, cand_fit
            counts["kept"] += 1
        else:
            counts["refused"] += 1
    return current, counts


# ---------------------------------------------------------------- mining and the lifecycle


def propose(texts: Sequence[str], pool: Sequence[str], limit: int,
            min_share: float = 0.05) -> list[str]:
    """Up to ``limit`` new detectors mined from unlabeled outputs: ``\\bword\\b`` for the
    lower-case words (letters only, 3+ characters) found in at least ``min_share`` of the
    texts, most frequent first (ties alphabetical), skipping patterns already in ``pool``."""
    if limit <= 0 or not texts:
        return []
    counts: dict[str, int] = {}
    for t in texts:
        for w in set(re.findall(r"[a-z]{3,}", t.lower())):
            counts[w] = counts.get(w, 0) + 1
    known = set(pool)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    out = []
    for word, n in ranked:
        pattern = rf"\b{word}\b"
        if n / len(texts) >= min_share and pattern not in known:
            out.append(pattern)
        if len(out) >= limit:
            break
    return out


class EvolvedMetric:
    """The metric's lifecycle: a pool (given, plus words mined from unlabeled outputs), a
    weighted detector set evolved against ``anchors`` with consensus on the unlabeled outputs,
    and an audit on ``heldout``, which nothing here reads except ``audit()``. Use ``step`` then
    ``score`` as a harness loop's score, or through the ``rlmix_score`` hook."""

    def __init__(self, anchors: Sequence[Anchor], heldout: Sequence[Anchor] = (),
                 pool: Sequence[str] = (), *, rounds: int = 30, consensus_weight: float = 0.1,
                 guard: bool = True, mine: int = 0, mine_min_share: float = 0.05,
                 max_chars: int = 4000, metric: Metric | None = None) -> None:
        self.anchors, self._heldout = list(anchors), list(heldout)
        self.pool = list(pool)
        self.rounds, self.consensus_weight, self.guard = rounds, consensus_weight, guard
        self.mine, self.mine_min_share, self.max_chars = mine, mine_min_share, max_chars
        self.metric: Metric = dict(metric or {})
        self.counts = {"kept": 0, "refused": 0, "guarded": 0, "mined": 0}

    def step(self, unlabeled: Sequence[str], rng: random.Random) -> Metric:
        """Mine new detectors from ``unlabeled`` (when ``mine``), then evolve ``rounds``
        mutations with ``unlabeled`` as the consensus set."""
        texts = [t[:self.max_chars] for t in unlabeled]
        mined = propose(texts, self.pool, self.mine, self.mine_min_share)
        self.pool += mined
        self.metric, counts = evolve(self.metric, self.pool, self.anchors, texts, self.rounds,
                                     rng, self.consensus_weight, self.guard)
        for k, v in counts.items():
            self.counts[k] += v
        self.counts["mined"] += len(mined)
        return self.metric

    def score(self, texts: Sequence[str]) -> list[float]:
        return score_texts(self.metric, texts, self.max_chars)

    def fit(self) -> float:
        return anchor_agreement(self.metric, self.anchors)

    def audit(self) -> float | None:
        """Agreement on the held-out anchor set (``None`` without one)."""
        return anchor_agreement(self.metric, self._heldout) if self._heldout else None


# ---------------------------------------------------------------- hooks


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s: Settings = run.settings(NAME)
    if (s.pool or s.mine) and not s.anchors:
        raise rlmix.ConfigError("double_ratchet.anchors: the metric needs an anchored "
                                "reference set (items {text, score})")
    heldout = {a["text"] for a in s.heldout}
    if heldout & {a["text"] for a in s.anchors}:
        raise rlmix.ConfigError("double_ratchet.heldout: shares items with anchors; the "
                                "audit set must be one the metric never reads")


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    s: Settings = run.settings(NAME)
    state = run.state.setdefault(NAME, {"metric": {}, "evolutions": 0})
    lifecycle = EvolvedMetric(s.anchors, s.heldout, [*s.pool, *state.get("mined", [])],
                              rounds=s.rounds, consensus_weight=s.consensus_weight,
                              guard=s.guard, mine=s.mine, mine_min_share=s.mine_min_share,
                              max_chars=s.max_chars, metric=state["metric"])
    due = state["evolutions"] == 0 or (s.evolve_every > 0 and run.step % s.evolve_every == 0)
    if due and s.rounds:
        lifecycle.step(batch.texts, random.Random(s.seed * 1_000_003 + run.step))
        state["metric"] = lifecycle.metric
        state["mined"] = lifecycle.pool[len(s.pool):]
        state["evolutions"] += 1
        run.log(f"{NAME}/kept", float(lifecycle.counts["kept"]))
        run.log(f"{NAME}/guarded", float(lifecycle.counts["guarded"]))
        run.log(f"{NAME}/mined", float(lifecycle.counts["mined"]))
    run.log(f"{NAME}/detectors", float(len(lifecycle.metric)))
    run.log(f"{NAME}/anchor_agreement", lifecycle.fit())
    audit = lifecycle.audit()
    if audit is not None:
        run.log(f"{NAME}/audit", audit)
    return {"score": torch.tensor(lifecycle.score(batch.texts))}
