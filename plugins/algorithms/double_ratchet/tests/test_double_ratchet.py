"""Double Ratchet: the metric, anchor agreement, consensus and mutations by hand, evolution with
and without the anchor guard, the hook, the claim (a harness loop driven by the evolved metric
keeps the held-out lift of the ground-truth loop; without the guard the metric collapses and
the lift is ~0), and the example manifest on tiny-random."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import rlmix_double_ratchet as dr
from omegaconf import OmegaConf

import rlmix
from rlmix import cli, loop
from rlmix.testing import make_batch, make_run, skip_unless_installed

EXAMPLE = Path(dr.__file__).parents[4] / "examples" / "rewards" / "double_ratchet-arith.yaml"

# ---------------------------------------------------------------- by hand


def test_score_agreement_and_consensus_by_hand():
    metric = {"crash": 0.5, "typo": 0.25}
    assert dr.score_texts(metric, ["ok", "a crash", "Crash and TYPO", "typo"]) == \
        [1.0, 0.5, 0.25, 0.75]
    anchors = [{"text": "ok", "score": 1.0}, {"text": "typo", "score": 0.5},
               {"text": "crash", "score": 0.0}, {"text": "fine", "score": 1.0}]
    # pairs with different scores: 5; all ordered right
    assert dr.anchor_agreement(metric, anchors) == 1.0
    assert dr.anchor_agreement({}, anchors) == 0.5  # every pair tied
    assert dr.anchor_agreement({"ok": 1.0}, anchors) == pytest.approx((0 + 0 + 0.5 * 3) / 5)
    # consensus: "crash" alone fires -> max(0.5, 0.25)/0.75; nothing fires -> 1
    assert dr.consensus(metric, ["a crash", "ok"]) == pytest.approx((0.5 / 0.75 + 1) / 2)
    assert dr.consensus({"x": 1.0}, ["x"]) == 1.0 and dr.consensus({}, ["x"]) == 1.0


def test_mutations_add_drop_reweight():
    rng = random.Random(0)
    seen = set()
    for _ in range(60):
        out = dr.mutate({"a": 0.25}, ["a", "b"], rng)
        if "b" in out:
            seen.add("add")
        elif not out:
            seen.add("drop")
        else:
            assert out["a"] in (0.125, 0.5)
            seen.add("reweight")
    assert seen == {"add", "drop", "reweight"}
    assert dr.mutate({}, [], rng) == {}


def test_guarded_evolution_fits_anchors_unguarded_collapses():
    pool = ["crash", "typo", "note"]
    anchors = [{"text": t, "score": s} for t, s in
               [("ok", 1.0), ("note", 1.0), ("crash", 0.0), ("typo note", 0.5),
                ("crash typo", 0.0)]]
    unlabeled = ["note crash", "typo", "note", "ok"]
    guarded, counts = dr.evolve({}, pool, anchors, unlabeled, 200, random.Random(1))
    assert dr.anchor_agreement(guarded, anchors) == 1.0 and "note" not in guarded
    loose, _ = dr.evolve({"crash": 0.5, "typo": 0.25}, pool, anchors, unlabeled, 200,
                         random.Random(1), guard=False)
    assert loose == {}  # consensus alone: the empty metric wins, a vacuous detector
    assert counts["kept"] >= 1


def test_settings_and_configure_are_checked():
    with pytest.raises(ValueError, match="pool"):
        dr.Settings(pool=["("])
    with pytest.raises(ValueError, match="text"):
        dr.Settings(anchors=[{"score": 1}])
    run = make_run({"double_ratchet": dr}, ['double_ratchet.pool=["x"]'])
    with pytest.raises(rlmix.ConfigError, match="anchors"):
        dr.rlmix_configure(run)


def test_hook_evolves_then_scores_and_logs_the_audit():
    overrides = ['double_ratchet.pool=["crash","note"]',
                 'double_ratchet.anchors=[{text: ok, score: 1.0}, {text: crash, score: 0.0},'
                 ' {text: note, score: 1.0}]',
                 'double_ratchet.heldout=[{text: "a crash", score: 0.0}, {text: fine, '
                 'score: 1.0}]', "double_ratchet.rounds=100"]
    run = make_run({"double_ratchet": dr}, overrides)
    dr.rlmix_configure(run)
    batch = make_batch(n_groups=1, group_size=3)
    batch.texts = ["crash here", "a note", "fine"]
    loop.score(run, batch)
    assert batch.reward_terms["double_ratchet.score"].tolist()[1:] == [1.0, 1.0]
    assert batch.reward_terms["double_ratchet.score"][0] < 1.0
    assert run.pending_metrics["double_ratchet/audit"] == 1.0
    assert run.state["double_ratchet"]["evolutions"] == 1


def test_hook_mines_detectors_from_the_batch_and_keeps_them_in_state():
    overrides = ["double_ratchet.mine=4", "double_ratchet.rounds=60",
                 'double_ratchet.anchors=[{text: ok, score: 1.0}, {text: a crash, score: 0.0},'
                 ' {text: a note, score: 1.0}]']
    run = make_run({"double_ratchet": dr}, overrides)
    dr.rlmix_configure(run)
    batch = make_batch(n_groups=1, group_size=4)
    batch.texts = ["crash here", "a note", "fine", "crash and note"]
    loop.score(run, batch)
    state = run.state["double_ratchet"]
    assert r"\bcrash\b" in state["mined"] and run.pending_metrics["double_ratchet/mined"] >= 2
    assert r"\bcrash\b" in state["metric"] and r"\bnote\b" not in state["metric"]
    assert batch.reward_terms["double_ratchet.score"].tolist()[1:3] == [1.0, 1.0]
    run_no_anchor = make_run({"double_ratchet": dr}, ["double_ratchet.mine=4"])
    with pytest.raises(rlmix.ConfigError, match="anchors"):
        dr.rlmix_configure(run_no_anchor)


# ---------------------------------------------------------------- the claim

DRAWBACKS = ["crash", "leak", "typo"]  # each costs a third of the true quality
NEUTRAL = ["note", "tip", "aside", "remark"]  # cost nothing
BASE = {**{d: 0.6 for d in DRAWBACKS}, **{n: 0.3 for n in NEUTRAL}}
# instructions a harness can switch on: three fix a drawback at the price of a neutral word;
# three remove neutral words at the price of a drawback (a metric that punishes neutral words
# takes those)
INSTRUCTIONS = {
    "careful": {"crash": 0.1, "note": 0.8}, "test": {"leak": 0.1, "tip": 0.8},
    "proofread": {"typo": 0.1, "aside": 0.8}, "terse": {"note": 0.0, "tip": 0.0, "crash": 0.9},
    "plain": {"remark": 0.0, "aside": 0.0, "leak": 0.9}, "quiet": {"remark": 0.0, "typo": 0.9},
}


def probs(harness: frozenset[str]) -> dict[str, float]:
    p = dict(BASE)
    for name in sorted(harness):
        p.update(INSTRUCTIONS[name])
    return p


def outputs(harness: frozenset[str], n: int, rng: random.Random) -> list[str]:
    p = probs(harness)
    return [" ".join(["the"] + [w for w in p if rng.random() < p[w]] + ["and"]) for _ in range(n)]


def true_quality(text: str) -> float:
    return 1.0 - sum(d in text.split() for d in DRAWBACKS) / len(DRAWBACKS)


def expected_quality(harness: frozenset[str]) -> float:
    p = probs(harness)
    return 1.0 - sum(p[d] for d in DRAWBACKS) / len(DRAWBACKS)


def anchor_set(seed: int, size: int = 10) -> list[dict]:
    rng = random.Random(seed)
    items = []
    for _ in range(size):
        harness = frozenset(rng.sample(sorted(INSTRUCTIONS), rng.randint(0, 3)))
        text = outputs(harness, 1, rng)[0]
        items.append({"text": text, "score": true_quality(text)})
    return items


def harness_loop(scorer: str, seed: int, rounds: int = 24, per_eval: int = 24):
    """Hill climbing on the harness: each round toggles one random instruction and keeps it
    when the mean score of ``per_eval`` outputs rises (the same random draws for the current
    and the candidate harness). ``scorer``: truth | evolved | unguarded. The metric is the
    plugin's ``EvolvedMetric`` with **no given pool**: its detectors are mined from the round's
    unlabeled outputs (every word is a candidate: the drawbacks, the neutral words, "the",
    "and"), then 30 mutations against 10 anchors. Returns the held-out lift (expected true
    quality, final minus start), the metric, the scorer calls and the audit."""
    rng = random.Random(seed)
    anchors, heldout = anchor_set(seed), anchor_set(seed + 1000)
    metric = dr.EvolvedMetric(anchors, heldout, pool=[], rounds=30, guard=scorer == "evolved",
                              mine=8)
    harness: frozenset[str] = frozenset()
    calls = 0
    for r in range(rounds):
        cand = harness ^ {rng.choice(sorted(INSTRUCTIONS))}
        draw = rng.random()
        mine, theirs = outputs(harness, per_eval, random.Random(draw)), \
            outputs(cand, per_eval, random.Random(draw))
        calls += 2 * per_eval
        if scorer == "truth":
            old = sum(map(true_quality, mine)) / per_eval
            new = sum(map(true_quality, theirs)) / per_eval
        else:  # co-evolution: the metric mines and evolves on this round's outputs first
            metric.step(mine + theirs, random.Random(seed * 100 + r))
            old = sum(metric.score(mine)) / per_eval
            new = sum(metric.score(theirs)) / per_eval
        if new > old:
            harness = cand
    lift = expected_quality(harness) - expected_quality(frozenset())
    return lift, metric.metric, calls, metric.audit()


def test_propose_mines_frequent_words_not_in_the_pool():
    texts = ["the crash and a typo", "the note", "the crash", "ok"]
    assert dr.propose(texts, [], 3) == [r"\bthe\b", r"\bcrash\b", r"\band\b"]
    assert dr.propose(texts, [r"\bthe\b"], 2, min_share=0.5) == [r"\bcrash\b"]
    assert dr.propose(texts, [], 0) == [] and dr.propose([], [], 5) == []
    assert dr.fires(r"\bcrash\b", "a Crash!") and not dr.fires(r"\bcrash\b", "crashes")


def test_the_lifecycle_never_reads_the_heldout_anchor():
    anchors, unlabeled = anchor_set(0), outputs(frozenset(), 24, random.Random(1))
    runs = []
    inverted = [{"text": "a crash", "score": 1.0}, {"text": "fine", "score": 0.0}]
    for heldout in (anchor_set(1000), inverted, []):
        m = dr.EvolvedMetric(anchors, heldout, pool=[], rounds=30, mine=8)
        for r in range(3):
            m.step(unlabeled, random.Random(r))
        runs.append((m.metric, m.audit()))
    assert runs[0][0] == runs[1][0] == runs[2][0]  # the same metric whatever the audit set
    assert r"\bcrash\b" in runs[0][0]
    # the audit only reports: a true held-out set agrees, an inverted one disagrees fully
    assert runs[0][1] >= 0.65 and runs[1][1] == 0.0 and runs[2][1] is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_claim_evolved_metric_keeps_the_lift_unguarded_collapses(seed):
    truth, _, t_calls, _ = harness_loop("truth", seed)
    evolved, metric, e_calls, audit = harness_loop("evolved", seed)
    assert t_calls == e_calls  # the same loop budget
    assert truth > 0.3  # the loop can lift the held-out quality
    assert evolved >= 0.8 * truth
    # found among mined words: every drawback detector, at most one neutral word, no filler
    drawbacks = {rf"\b{d}\b" for d in DRAWBACKS}
    assert drawbacks <= set(metric) and len(set(metric) - drawbacks) <= 1
    assert not {r"\bthe\b", r"\band\b"} & set(metric)
    unguarded, loose, u_calls, loose_audit = harness_loop("unguarded", seed)
    assert u_calls == t_calls
    assert loose == {} and abs(unguarded) <= 0.1 * truth  # collapsed: vacuous, no lift
    # the held-out anchor the metric never read: the evolved metric orders it better than the
    # collapsed one (which ties every pair: 0.5)
    assert audit >= 0.65 and loose_audit == 0.5


# ---------------------------------------------------------------- the example manifest


@pytest.mark.slow
def test_example_manifest_runs_on_tiny_random(tmp_path):
    skip_unless_installed(EXAMPLE)
    cfg = OmegaConf.load(EXAMPLE)
    assert cfg.model == "tiny-random" and "double_ratchet" in cfg.plugins
    out = tmp_path / "ex"
    assert cli.main(["run", str(EXAMPLE), "train.steps=2", "arith.eval_size=2",
                     "arith.eval_max_new_tokens=4", "sampling.max_new_tokens=6",
                     "log.progress=false", "log.plot=false", "train.eval_every=0",
                     f"out={out}"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert "double_ratchet/audit" in rows[-1] and "reward/double_ratchet.score" in rows[-1]


