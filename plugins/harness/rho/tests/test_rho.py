"""Tests of RHO: answers and self-consistency, the hard-and-diverse coreset, the round-robin
tournament, candidate parsing; and the paper's claim in miniature, label-free (the env raises
if anything reads a reward): candidates come from a fixed pool, so any gain is selection; the
self-preference tournament lifts held-out from 0.25 to >= 0.75 in one round, a random pick among
the same candidates lifts it less on average."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import rlmix_rho
from rlmix_harness import task_pool, task_prompts
from rlmix_lm.chat_server import ScriptedLM
from rlmix_rho import answer_of, consistency, coreset, parse_candidates, round_robin_winner

from rlmix import loop
from rlmix.errors import ManifestError
from rlmix.testing import make_run, skip_unless_installed
from rlmix.testing.demos import GuessingHintModel, LabelFreeHintEnv

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "harness" / "rho-arith.yaml"

POOL = ["alpha beta gamma delta", "alpha beta", "alpha omega", "omega"]  # 1.0, .5, .25, 0


def test_answers_and_self_consistency():
    assert answer_of("thinking\n  ANSWER  t1 \n\n") == "ANSWER t1"
    assert consistency(["a", "b", "a", "a"]) == ("a", 0.75)
    assert consistency([]) == ("", 0.0)


def test_coreset_is_hard_then_diverse():
    texts = ["apple pie", "apple tart", "car engine", "easy one", "apple pie again"]
    shares = [0.25, 0.25, 0.5, 1.0, 0.25]
    # the 4 least consistent are 0, 1, 4, 2; start at 0, then the farthest: the car
    assert coreset(texts, shares, 2) == [0, 2]
    assert len(coreset(texts, shares, 3)) == 3


def test_round_robin_tournament_counts_wins():
    strength = [0.1, 0.9, 0.5]
    winner, wins = round_robin_winner(3, lambda i, j: i if strength[i] > strength[j] else j)
    assert winner == 1 and wins == [0, 2, 1]
    assert parse_candidates("```\na\n```\n```\nb\n```\n```\n\n```") == ["a", "b"]


def test_settings_are_checked():
    with pytest.raises(ManifestError, match="rho.select"):
        make_run({"rho": rlmix_rho}, ["rho.select=best"])
    with pytest.raises(ManifestError, match="rho.temperature"):
        make_run({"rho": rlmix_rho}, ["rho.temperature=0"])


def self_lm(prompt: str) -> str:
    """The model as its own critic: proposes from a fixed pool and prefers the version whose
    repeated answers agree more (it never sees an answer key)."""
    if "Is this answer right?" in prompt:
        return "yes, it looks plausible"
    if prompt.startswith("You are improving"):
        return "\n".join(f"```\n{c}\n```" for c in POOL)

    def agreement(tag: str) -> float:
        rows = [line[3:].split(" | ") for line in prompt.splitlines() if line.startswith(tag)]
        return sum(consistency(r)[1] for r in rows)

    return "B" if agreement("B: ") > agreement("A: ") else "A"


def world_run(tmp_path, *overrides, seed=0):
    env = LabelFreeHintEnv()
    model = GuessingHintModel(env, seed=seed)
    run = make_run({"hintenv": env, "guess": model, "rho": rlmix_rho},
                   [f"out={tmp_path}", "train.prompts_per_step=4", "harness.instructions=alpha",
                    *overrides])
    loop.configure(run)
    run.resources["rho.lm"] = ScriptedLM(reply=self_lm)
    return run, model


def heldout(run, model):
    tasks = task_pool(run, 8, 3_000_000)
    model.temperature = 0.0
    batch = run.generate(task_prompts(run, dict(run.harness), tasks))  # greedy; the test scores
    return LabelFreeHintEnv.accuracy(batch)


def one_round(tmp_path, select, seed=0):
    run, model = world_run(tmp_path, f"rho.select={select}", f"rho.seed={seed}", seed=seed)
    before = heldout(run, model)
    update = rlmix_rho.iterate(run)
    if update is not None:
        loop.apply_harness_update(run, update)
    assert rlmix_rho.iterate(run) is None  # rounds: 1
    return before, heldout(run, model), run


def test_claim_self_preference_selection_lifts_heldout_more_than_random(tmp_path):
    before, after, run = one_round(tmp_path / "t", "tournament")
    assert before == 0.25 and after >= 0.75
    assert run.harness["instructions"] == POOL[0]
    lifts = []
    for seed in range(12):  # the baseline: one of the same candidates at random
        b, a, _ = one_round(tmp_path / f"r{seed}", "random", seed)
        lifts.append(a - b)
    assert sum(lifts) / len(lifts) < after - before
    assert run.state["rho"]["judgements"] == 6  # 4 candidates, every pair once


def test_the_coreset_holds_the_self_inconsistent_tasks(tmp_path):
    run, _ = world_run(tmp_path)
    rlmix_rho.iterate(run)
    record = run.state["rho"]["history"][0]
    tasks = [tuple(t) for t in record["coreset"]]
    topics = [p.info["topic"] for p in task_prompts(run, dict(run.harness), tasks)]
    assert "t0" not in topics  # the seed answers topic 0 the same way every time: not hard


def test_example_manifest_runs_on_the_tiny_model(tmp_path):
    from rlmix import cli

    skip_unless_installed(EXAMPLE)
    out = tmp_path / "run"
    args = ["run", str(EXAMPLE), "model=tiny-random", "train.prompts_per_step=2",
            "train.eval_every=0", "train.checkpoint_every=1", "arith.eval_size=2",
            "sampling.max_new_tokens=4", "rho.pool_size=2", "rho.coreset_size=1",
            "rho.samples=2", "rho.candidates=2", "rho.max_new_tokens=4",
            "rho.lm.max_new_tokens=16", "log.progress=false", "log.plot=false", f"out={out}"]
    assert cli.main([*args, "train.steps=2"]) == 0
    assert cli.main([*args, "train.steps=3", "--resume"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["rho/rounds"] == 2
    assert re.match(r"\d", str(rows[-1]["rho/rollouts"]))
