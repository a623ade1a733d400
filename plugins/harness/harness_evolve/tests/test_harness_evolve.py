"""Tests of HarnessEvolve: error signals and failure patterns, the leakage and bloat checks,
the performance gate over recent batches, reference prompts, the budget and resume; and the
paper's claim in miniature in a world where answers can be memorised: an ungated loop reaches
search accuracy 1.0 by writing answers into the harness and held-out stays at the seed's, the
gated loop rejects every leaking edit and lifts held-out from the same seed."""

from __future__ import annotations

import pickle
from pathlib import Path

import rlmix_harness_evolve
from rlmix_harness_evolve import (
    error_signal,
    failure_patterns,
    leaks,
    performance_ok,
    with_reference,
)
from rlmix_lm.chat_server import ScriptedLM

from rlmix import loop
from rlmix.testing import harness_example_resumes, make_run
from rlmix.testing.demos import LeakModel, leaky_proposer
from rlmix.testing.harness import HintEnv
from rlmix.types import Prompt

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "harness" / "harness_evolve-arith.yaml"

# ---------------------------------------------------------------- pure parts


def test_error_signal_is_what_only_the_reference_says():
    assert error_signal("no idea", "Recall beta. ANSWER t1", "Question 3.1 on topic t1.") == \
        {"recall", "beta", "answer"}


def test_failures_cluster_by_signal_without_the_shared_words():
    signals = [{"recall", "beta"}, {"recall", "gamma"}, {"recall", "beta"}, {"recall"}]
    patterns = failure_patterns(signals)
    assert patterns == [(frozenset({"beta"}), [0, 2]), (frozenset({"gamma"}), [1])]
    # one kind of failure only: nothing is common-removed
    assert failure_patterns([{"x"}, {"x"}]) == [(frozenset({"x"}), [0, 1])]


def test_leaks_are_answers_the_edit_writes_in():
    assert leaks("alpha", "alpha 3.1 -> t1", ["t1", "t2"]) == ["t1"]
    assert leaks("t1 alpha", "t1 alpha beta", ["t1"]) == []  # already there: not this edit's
    assert leaks("alpha", "alpha beta", ["t1", "t2"]) == []


def test_performance_gate_needs_a_gain_now_and_no_loss_on_recent_batches():
    assert performance_ok([1, 1], [1, 0], [([1, 0], [1, 0])])
    assert not performance_ok([1, 1], [1, 0], [([0, 0], [1, 0])])  # lowered a recent batch
    assert not performance_ok([1, 0], [1, 0], [])  # no gain on this batch


def test_reference_prompt_appends_the_ground_truth_and_copies():
    prompt = Prompt(messages=[{"role": "system", "content": "s"},
                              {"role": "user", "content": "Q?"}], answer="42")
    ref = with_reference(prompt)
    assert ref.messages[-1]["content"] == "Q? (Reference: the correct answer is 42.)"
    assert prompt.messages[-1]["content"] == "Q?"


# ---------------------------------------------------------------- the loop in a leak world


def world_run(tmp_path, *overrides):
    env = HintEnv()
    run = make_run({"hintenv": env, "leak": LeakModel(env),
                    "harness_evolve": rlmix_harness_evolve},
                   [f"out={tmp_path}", "train.prompts_per_step=4", "harness.instructions=alpha",
                    "harness_evolve.metric=hintenv.correct", *overrides])
    loop.configure(run)
    run.resources["harness_evolve.lm"] = ScriptedLM(reply=leaky_proposer())
    return run


def passes(run, n):
    for _ in range(n):
        update = rlmix_harness_evolve.iterate(run)
        if update is not None:
            loop.apply_harness_update(run, update)
    return run.state["harness_evolve"]


BUDGET = 200


def test_claim_gates_reject_leaks_and_lift_heldout_where_the_ungated_loop_memorises(tmp_path):
    gated_run = world_run(tmp_path / "gated", f"harness_evolve.budget={BUDGET}")
    ungated_run = world_run(tmp_path / "ungated", f"harness_evolve.budget={BUDGET}",
                            "harness_evolve.gated=false")
    gated, ungated = passes(gated_run, 4), passes(ungated_run, 4)
    for state in (gated, ungated):  # the same budget and the same passes for both
        assert state["calls"] <= BUDGET and state["iteration"] == 4
    seed_heldout = gated["snapshots"][0]["heldout"]
    assert seed_heldout == ungated["snapshots"][0]["heldout"] == 0.25
    # ungated: search solved by memorised answers, held-out where it started
    assert ungated["search_accuracy"] == 1.0
    assert max(s["heldout"] for s in ungated["snapshots"]) == seed_heldout
    assert "->" in ungated["current"]
    # gated: every leaking edit rejected (the proposer leaks first for each of 3 patterns)
    assert gated["rejected"]["leak"] == 3 and "->" not in gated["current"]
    assert gated["snapshots"][gated["best"]]["heldout"] >= 0.75
    assert gated_run.harness["instructions"] == gated["snapshots"][gated["best"]]["text"]


def test_bloat_is_rejected(tmp_path):
    run = world_run(tmp_path, "harness_evolve.max_chars=12", "harness_evolve.budget=200")
    run.resources["harness_evolve.lm"] = ScriptedLM(["```\nalpha beta gamma delta\n```"])
    state = passes(run, 2)
    assert state["rejected"]["bloat"] >= 1 and state["current"] == "alpha"


def test_performance_gate_protects_recent_batches(tmp_path):
    # a proposer that drops alpha while adding the batch's word: better on the batch at hand
    # when alpha's tasks are elsewhere, worse on the batch that holds them
    run = world_run(tmp_path, "harness_evolve.batch_size=2", "harness_evolve.recent_batches=3",
                    "harness_evolve.budget=400")

    def swap(prompt: str) -> str:
        import re

        signal = re.search(r"Signal: (.*)", prompt).group(1).split()
        return "```\n" + " ".join(signal) + "\n```"

    run.resources["harness_evolve.lm"] = ScriptedLM(["```\nalpha\n```"])  # proposes nothing
    passes(run, 4)  # one pass over the four batches: each is now a recent batch
    run.resources["harness_evolve.lm"] = ScriptedLM(reply=swap)
    state = passes(run, 4)
    assert state["rejected"]["performance"] >= 1
    assert "alpha" in state["current"].split()  # the batch that needs alpha was protected


def test_budget_and_resume(tmp_path):
    run = world_run(tmp_path / "a", "harness_evolve.budget=30")
    state = passes(run, 10)
    assert state["calls"] <= 30
    run = world_run(tmp_path / "b", f"harness_evolve.budget={BUDGET}")
    passes(run, 1)
    saved = pickle.loads(pickle.dumps(run.state))
    resumed = world_run(tmp_path / "c", f"harness_evolve.budget={BUDGET}")
    resumed.state.update(saved)
    state = passes(resumed, 3)
    # the counts carried over (3 leaks rejected in the first pass) and went on from there
    assert state["iteration"] == 4 and state["rejected"]["leak"] >= 3
    assert len(state["snapshots"]) == 5 and state["snapshots"][0] == saved["harness_evolve"][
        "snapshots"][0]


def test_a_missing_component_warns_and_evolves_nothing(tmp_path, capsys):
    run = world_run(tmp_path, "harness_evolve.component=system")
    assert "has nothing to evolve" in capsys.readouterr().out
    assert rlmix_harness_evolve.iterate(run) is None and "harness_evolve" not in run.state


def test_example_manifest_runs_and_resumes_on_the_tiny_model(tmp_path):
    overrides = [
        "harness_evolve.search_size=2", "harness_evolve.batch_size=1",
        "harness_evolve.heldout_size=2", "harness_evolve.budget=12",
        "harness_evolve.max_new_tokens=4", "harness_evolve.lm.max_new_tokens=8"]
    harness_example_resumes(EXAMPLE, tmp_path / "run", overrides, "harness_evolve/calls", 12)
