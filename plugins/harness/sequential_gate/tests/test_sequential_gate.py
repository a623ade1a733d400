"""Tests of the sequential gate: the wealth by hand; validity (type-I error <= alpha under
optional stopping, where naive peeking at a z-test is not); power (a clearly better candidate is
accepted after a fraction of the maximum samples); curtailment, futility and the end rule; the
error-budget schedule; lazy evaluation through ``check_sequential``; composition with the gates
plugin's flip gate; and gepa using the gate unchanged through ``run.resources``."""

from __future__ import annotations

import math
import random

import pytest
import rlmix_sequential_gate as sg
from rlmix_harness import score_tasks, task_pool
from rlmix_lm.chat_server import ScriptedLM
from rlmix_sequential_gate import Bettor, SequentialGate, Settings, sequential_test, wealth_path

import rlmix
from rlmix import loop
from rlmix.testing import make_run
from rlmix.testing.harness import HintEnv, HintModel, hint_plugins, hint_reflection

# ---------------------------------------------------------------- the wealth by hand


def test_wealth_by_hand_fixed_agrapa_ons():
    # fixed fraction 1/2, margin 0: factors 1 + d/2
    assert wealth_path([1, -1, 1, 0], bet="fixed", fixed_bet=0.5) == pytest.approx(
        [1.5, 0.75, 1.125, 1.125])
    # margin 0.2: payoffs (d - 0.2) / 1.2 = 2/3 then -1/6
    assert wealth_path([1, 0], margin=0.2, bet="fixed", fixed_bet=0.5) == pytest.approx(
        [4 / 3, 11 / 9])
    # aGRAPA: first bet 0 (prior mean 0); then mu = 1/2, var = (1/4 + 1/4) / 2 = 1/4,
    # b = mu / (var + mu^2) = 1, capped at 0.5; third: capped again, d = -1 halves the wealth
    assert wealth_path([1, 1, -1], bet="agrapa", max_bet=0.5) == pytest.approx([1.0, 1.5, 0.75])
    b = Bettor("agrapa", max_bet=0.9)
    b.update(1.0)
    b.update(0.0)  # mu = 1/3, var = (1/4 + 1 - 2/3*1 + 2/9) / 3 = 0.26852; b = mu/(var+mu^2)
    mu, var = 1 / 3, (0.25 + 1 - 2 / 3 + 2 / 9) / 3
    assert b.bet() == pytest.approx(mu / (var + mu * mu))
    # ONS: starts at 0, then b = clip(0 + c * z / A) with z = 1, A = 2, c = 2 / (2 - ln 3)
    o = Bettor("ons", max_bet=0.9)
    assert o.bet() == 0.0
    o.update(0.5)  # z = 0.5, A = 1.25
    assert o.bet() == pytest.approx(min(0.9, 2 / (2 - math.log(3)) * 0.5 / 1.25))


def test_wealth_never_negative_and_payoff_checked():
    rng = random.Random(0)
    for kind in ("agrapa", "ons", "fixed"):
        b = Bettor(kind, max_bet=0.9, fixed_bet=0.9)
        for _ in range(300):
            assert b.update(rng.choice([-1.0, -1.0, -1.0, 1.0])) > 0
    with pytest.raises(ValueError, match="payoff"):
        Bettor().update(-1.5)


# ---------------------------------------------------------------- validity and power

ALPHA = 0.1


def _stream(rng: random.Random, p_before: float, p_after: float):
    return lambda: (float(rng.random() < p_before), float(rng.random() < p_after))


def _accept_rate(settings: Settings, p_before: float, p_after: float, runs: int, seed: int
                 ) -> tuple[float, float]:
    rng = random.Random(seed)
    accepted, samples = 0, 0
    for _ in range(runs):
        d = sequential_test(_stream(rng, p_before, p_after), settings)
        accepted += d.passed
        samples += d.samples
    return accepted / runs, samples / runs


@pytest.mark.parametrize("bet", ["agrapa", "ons"])
@pytest.mark.parametrize(("p_before", "p_after"), [(0.5, 0.5), (0.7, 0.6), (0.2, 0.2)])
def test_type_one_error_under_optional_stopping(bet, p_before, p_after):
    # H0 true (mean difference <= 0); the gate looks after every pair for up to 150 pairs and
    # stops at the first crossing: the accept rate stays below alpha
    settings = Settings(alpha=ALPHA, bet=bet, max_samples=150, curtail=False)
    rate, _ = _accept_rate(settings, p_before, p_after, runs=400, seed=1)
    assert rate <= ALPHA


def test_naive_peeking_is_not_valid_but_the_e_process_is():
    """The same null data: a one-sided z-test at level alpha, looked at after every pair (from
    the 10th on), accepts far more often than alpha; the e-process does not."""
    rng = random.Random(7)
    runs, horizon, z_crit = 300, 150, 1.2816  # one-sided 10%
    naive = 0
    for _ in range(runs):
        total = total2 = 0.0
        for t in range(1, horizon + 1):
            d = float(rng.random() < 0.5) - float(rng.random() < 0.5)
            total += d
            total2 += d * d
            if t >= 10:
                mean = total / t
                sd = math.sqrt(max(total2 / t - mean * mean, 1e-12))
                if mean / (sd / math.sqrt(t)) > z_crit:
                    naive += 1
                    break
    assert naive / runs > 2 * ALPHA
    rate, _ = _accept_rate(Settings(alpha=ALPHA, max_samples=horizon, curtail=False),
                           0.5, 0.5, runs, seed=7)
    assert rate <= ALPHA


@pytest.mark.parametrize("bet", ["agrapa", "ons"])
def test_power_a_clearly_better_candidate_is_accepted_early(bet):
    settings = Settings(alpha=0.05, bet=bet, max_samples=200)
    rate, mean_samples = _accept_rate(settings, 0.3, 0.85, runs=100, seed=2)
    assert rate >= 0.95
    assert mean_samples < 200 / 5, mean_samples


def test_curtailment_futility_and_the_end_rule():
    # 4 pairs can lift the wealth to at most 1.5^4 ~ 5 < 1/0.05: rejected before any pull
    calls = []

    def supply():
        calls.append(1)
        return (0.0, 1.0)

    d = sequential_test(supply, Settings(max_samples=4))
    assert (d.passed, d.decision, d.samples, len(calls)) == (False, "curtailed", 0, 0)
    # without curtailment it runs to the end and the end rule decides
    d = sequential_test(iter([(0.0, 1.0)] * 4), Settings(curtail=False, max_samples=4))
    assert (d.passed, d.decision, d.samples) == (False, "end-reject", 4)
    d = sequential_test(iter([(0.0, 1.0)] * 4), Settings(curtail=False, at_end="mean"))
    assert (d.passed, d.decision) == (True, "end-mean-accept")
    # a clearly worse candidate stops early for futility
    d = sequential_test(iter([(1.0, 0.0)] * 100), Settings(futility_beta=0.1))
    assert d.decision == "futility" and d.samples < 12
    # scores must lie in the declared range
    with pytest.raises(rlmix.ConfigError, match="sequential_gate.score_low"):
        sequential_test(iter([(0.0, 2.0)]), Settings())
    assert sequential_test(iter([(0.0, 2.0)] * 20),
                           Settings(score_high=2.0, max_bet=0.6)).passed
    # differences are in units of the range: 0 -> 1 on a 0..2 scale is d = 1/2
    half = sequential_test(iter([(0.0, 1.0)]), Settings(score_high=2.0, bet="fixed",
                                                        fixed_bet=0.5, curtail=False))
    assert half.wealth == pytest.approx(1.25) and half.mean_diff == pytest.approx(0.5)


def test_error_budget_schedule_and_counters():
    gate = SequentialGate(Settings(alpha=0.05, spending="basel"))
    strong = [0.0] * 30, [1.0] * 30
    first = gate.check(*strong)
    second = gate.check(*strong)
    assert first.passed and second.passed
    assert first.threshold == pytest.approx(math.pi ** 2 / (6 * 0.05))
    assert second.threshold == pytest.approx(4 * math.pi ** 2 / (6 * 0.05))
    assert second.samples > first.samples  # a smaller alpha needs more evidence
    assert gate.check([0.0] * 8, [0.0] * 8).passed is False
    assert (gate.checks, gate.rejected) == (3, 1)
    assert [c["check"] for c in gate.state["ledger"]] == [1, 2, 3]
    with pytest.raises(ValueError, match="same tasks"):
        gate.check([1.0], [1.0, 0.0])


# ---------------------------------------------------------------- lazy evaluation on a toy env


def test_check_sequential_spends_fewer_evaluations(tmp_path):
    env = HintEnv()
    model = HintModel(env)
    run = make_run({"hintenv": env, "hintmodel": model, "sequential_gate": sg},
                   [f"out={tmp_path}", "train.prompts_per_step=4", "harness.instructions=Go.",
                    "sequential_gate.max_samples=64"])
    loop.configure(run)
    gate = run.resources["rlmix.gates"]
    tasks = task_pool(run, 64, 5000)
    incumbent = {"instructions": "Go. alpha"}
    candidate = {"instructions": "Go. alpha beta gamma delta"}
    queue = iter(tasks)

    def next_pair():
        task = next(queue, None)
        if task is None:
            return None
        before, _ = score_tasks(run, incumbent, [task])
        after, _ = score_tasks(run, candidate, [task])
        return before[0], after[0]

    result = gate.check_sequential(next_pair)
    assert result.passed and result.decision == "accept"
    assert result.samples < 20 and model.calls == 2 * result.samples
    # all 64 tasks scored up front would have cost 128 rollouts
    metrics: dict = {}
    sg.rlmix_step_end(run=run, metrics=metrics)
    assert metrics["sequential_gate/checks"] == 1
    assert metrics["sequential_gate/samples"] == result.samples


# ---------------------------------------------------------------- with the gates plugin


@pytest.mark.parametrize("order", ["gates-first", "gate-first"])
def test_wraps_the_flip_gate_and_both_must_pass(tmp_path, order):
    rlmix_gates = pytest.importorskip("rlmix_gates")
    plugins = {"gates": rlmix_gates, "sequential_gate": sg}
    if order == "gate-first":
        plugins = {"sequential_gate": sg, "gates": rlmix_gates}
    run = make_run(plugins, [f"out={tmp_path}", "gates.flip_tolerance=0.0",
                             "sequential_gate.alpha=0.05"])
    loop.configure(run)
    gate = run.resources["rlmix.gates"]
    assert isinstance(gate, SequentialGate) and isinstance(gate.inner, rlmix_gates.Gates)
    before = [0.0] * 20 + [1.0]
    adds = [1.0] * 21  # much better, breaks nothing
    trade = [1.0] * 20 + [0.0]  # much better on the mean, but breaks task 20
    weak = [0.0] * 19 + [1.0, 1.0]  # breaks nothing, one fix: not enough evidence
    r = gate.check(before, adds)
    assert r.passed and r.inner_passed and r.decision == "accept"
    r = gate.check(before, trade)
    assert not r.passed and r.decision == "accept" and r.inner_passed is False
    assert r.regressions == [20] and "flip" in r.reason
    r = gate.check(before, weak)
    assert not r.passed and r.inner_passed is True
    assert (gate.checks, gate.rejected) == (3, 2)
    assert gate.inner.checks == 3  # the flip gate saw every check
    # the split and the held-out guard are the wrapped gate's
    split = gate.split(list(range(10)), {"search": 3, "selection": 3, "heldout": 3})
    gate.guard_heldout(split.heldout)
    with pytest.raises(ValueError, match="seen by the search"):
        gate.guard_heldout(split.search[:1])


def test_alone_it_splits_in_order_and_guards_heldout():
    gate = SequentialGate(Settings())
    split = gate.split(list(range(6)), {"search": 2, "selection": 2, "heldout": 2})
    assert (split.search, split.selection, split.heldout) == ([0, 1], [2, 3], [4, 5])
    gate.guard_heldout(split.heldout)
    with pytest.raises(ValueError, match="held-out"):
        gate.guard_heldout([2])
    with pytest.raises(ValueError, match="only 6 given"):
        gate.split(list(range(6)), {"search": 7})


# ---------------------------------------------------------------- gepa, unchanged


def _gepa_run(tmp_path, with_gate: bool, minibatch: int):
    rlmix_gepa = pytest.importorskip("rlmix_gepa")
    plugins = hint_plugins()
    if with_gate:
        plugins["sequential_gate"] = sg
    plugins["gepa"] = rlmix_gepa
    run = make_run(plugins, [f"out={tmp_path}", "train.prompts_per_step=4",
                             "harness.instructions=Answer.", "gepa.metric=hintenv.correct",
                             "gepa.search_size=8", "gepa.selection_size=24",
                             f"gepa.minibatch_size={minibatch}", "gepa.budget=400",
                             "gepa.merge=false"])
    loop.configure(run)
    run.resources["gepa.lm"] = ScriptedLM(reply=hint_reflection)
    for _ in range(6):
        update = rlmix_gepa.iterate(run)
        if update is not None:
            loop.apply_harness_update(run, update)
    return run, run.state["gepa"]


def _selection_means(state):
    return [sum(s) / len(s) for s in state["scores"]]


def test_gepa_uses_the_gate_through_resources(tmp_path):
    # a reflection on 2 traces adds 2 hint words: a child fixes half the 24 selection tasks,
    # which the e-process certifies before it has seen all of them
    run, state = _gepa_run(tmp_path / "gated", with_gate=True, minibatch=2)
    gate = run.resources["rlmix.gates"]
    assert _selection_means(state) == [0.0, 0.5, 1.0]
    ledger = gate.state["ledger"]
    assert [c["decision"] for c in ledger] == ["accept", "accept"]
    assert all(c["samples"] < 24 for c in ledger)
    metrics: dict = {}
    sg.rlmix_step_end(run=run, metrics=metrics)
    assert metrics["sequential_gate/checks"] == 2 and metrics["sequential_gate/rejected"] == 0


def test_gepa_children_without_enough_evidence_are_refused(tmp_path):
    # one hint word per child fixes 6 of 24 tasks: gepa alone accepts each such child; at
    # alpha 0.05 the gate refuses them (1/alpha is out of reach in the pairs left)
    _, alone = _gepa_run(tmp_path / "alone", with_gate=False, minibatch=1)
    assert _selection_means(alone) == [0.0, 0.25, 0.5, 0.75, 1.0]
    run, gated = _gepa_run(tmp_path / "gated", with_gate=True, minibatch=1)
    gate = run.resources["rlmix.gates"]
    assert _selection_means(gated) == [0.0]
    assert gate.checks == 6 and gate.rejected == 6
    assert all("sequential test: curtailed" in h["why"] for h in gated["history"])


def test_settings_errors():
    with pytest.raises(rlmix.ManifestError, match="sequential_gate.alpha"):
        make_run({"sequential_gate": sg}, ["sequential_gate.alpha=1.5"])
    with pytest.raises(rlmix.ManifestError, match="sequential_gate.bet"):
        make_run({"sequential_gate": sg}, ["sequential_gate.bet=kelly"])
    with pytest.raises(rlmix.ManifestError, match="sequential_gate.margin"):
        make_run({"sequential_gate": sg}, ["sequential_gate.margin=1.0"])
    with pytest.raises(rlmix.ManifestError, match="sequential_gate.max_bet"):
        make_run({"sequential_gate": sg}, ["sequential_gate.max_bet=1.0"])
