"""Tests of the arith env: problem generation, the held-out split, answer parsing, the reward
terms, prompts built from the harness, scoring through the core, and greedy evaluation."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest
import rlmix_arith
import torch
from rlmix_arith import (
    correct_reward,
    format_reward,
    make_problem,
    parse_answer,
    problem_set,
)

import rlmix
from rlmix import loop
from rlmix.testing import make_batch, make_run

_PROBLEM = re.compile(r"What is (\d+)([+\-*])(\d+)\?")


def problem_of(prompt):
    """``(a, op, b)`` read back from a prompt's user message."""
    match = _PROBLEM.search(prompt.messages[-1]["content"])
    assert match, prompt.messages
    return int(match[1]), match[2], int(match[3])


def arith_run(*overrides, plugins=None):
    return make_run(plugins or {"arith": rlmix_arith}, list(overrides))


# ---------------------------------------------------------------- problems


@pytest.mark.parametrize("digits, low", [(1, 0), (2, 10), (3, 100), (5, 10_000)])
def test_make_problem_operands_have_the_digits(digits, low):
    rng = random.Random(0)
    seen_ops, operands = set(), []
    for _ in range(400):
        a, op, b = make_problem(rng, digits, "+-*")
        seen_ops.add(op)
        operands += [a, b]
    assert seen_ops == {"+", "-", "*"}
    assert all(low <= x <= 10**digits - 1 for x in operands)
    if digits <= 2:  # small ranges: both ends are reached
        assert min(operands) == low and max(operands) == 10**digits - 1


def test_make_problem_is_deterministic_given_the_rng():
    a = [make_problem(random.Random(5), 3, "+*") for _ in range(3)]
    b = [make_problem(random.Random(5), 3, "+*") for _ in range(3)]
    assert a == b


def test_problem_set_is_deterministic_unique_and_seeded():
    first = problem_set(7, 60, 2, "+-")
    assert first == problem_set(7, 60, 2, "+-")
    assert first != problem_set(8, 60, 2, "+-")
    assert len(first) == len(set(first)) == 60
    assert all(10 <= a <= 99 and 10 <= b <= 99 and op in "+-" for a, op, b in first)


def test_problem_set_stops_at_the_size_of_the_problem_space():
    everything = problem_set(0, 1000, 1, "+")  # 10 x 10 one-digit sums exist
    assert len(everything) == len(set(everything)) == 100


# ---------------------------------------------------------------- answers and rewards


@pytest.mark.parametrize("text, expected", [
    ("42", 42),
    ("The answer is 12, not 13.", 13),
    ("-7", -7),
    ("x = -15\n", -15),
    ("1,234", 1234),
    ("Total: 12,345,678 apples", 12345678),
    ("no number here", None),
    ("", None),
])
def test_parse_answer_takes_the_last_integer(text, expected):
    assert parse_answer(text) == expected


def test_correct_reward():
    texts = ["57", "I think 57", "56", "-3", "three", "1,100"]
    answers = [57, 57, 57, -3, 3, 1100]
    assert correct_reward(texts, answers).tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]


def test_format_reward_is_one_only_for_a_bare_number():
    texts = ["42", "  -3 ", "42.", "7\n", "The answer is 42", "42 apples", "", "4 2", "x"]
    assert format_reward(texts).tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------- prompts


def test_prompts_are_deterministic_per_seed_and_step():
    run = arith_run("train.prompts_per_step=6", "arith.operators=+-*")
    again = arith_run("train.prompts_per_step=6", "arith.operators=+-*")
    other_seed = arith_run("train.prompts_per_step=6", "arith.operators=+-*", "train.seed=1")
    p3 = run.hook.rlmix_prompts(run=run, step=3)
    assert len(p3) == 6
    assert [problem_of(p) for p in p3] == [problem_of(p) for p in
                                            again.hook.rlmix_prompts(run=again, step=3)]
    # the same step again (as after a resume), even after other steps were drawn
    run.hook.rlmix_prompts(run=run, step=4)
    assert [p.messages for p in run.hook.rlmix_prompts(run=run, step=3)] == [
        p.messages for p in p3]
    assert [problem_of(p) for p in p3] != [problem_of(p) for p in
                                            run.hook.rlmix_prompts(run=run, step=4)]
    assert [problem_of(p) for p in p3] != [problem_of(p) for p in
                                            other_seed.hook.rlmix_prompts(run=other_seed,
                                                                          step=3)]
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
    for p in p3:
        a, op, b = problem_of(p)
        assert p.answer == ops[op](a, b)
    assert len({p.id for p in p3}) == 6


def test_held_out_problems_never_appear_in_training_prompts():
    run = arith_run("train.prompts_per_step=16", "arith.eval_size=200")
    rlmix_arith.rlmix_configure(run)
    held_out = set(run.state["arith"]["eval"])
    assert len(held_out) == 200
    train = {problem_of(p) for step in range(300)
             for p in run.hook.rlmix_prompts(run=run, step=step)}
    assert len(train) > 2000
    assert not train & held_out


def test_held_out_split_in_a_small_problem_space():
    # 100 one-digit sums, 30 held out: training draws from the other 70 only
    run = arith_run("train.prompts_per_step=20", "arith.digits=1", "arith.eval_size=30")
    held_out = set(rlmix_arith._eval_set(run))
    train = {problem_of(p) for step in range(50)
             for p in run.hook.rlmix_prompts(run=run, step=step)}
    assert not train & held_out
    assert len(train) == 70


@pytest.mark.parametrize("operators, eval_size", [("+-*", 100), ("+", 50), ("+", 90)])
def test_held_out_split_holds_for_any_share_of_the_space(operators, eval_size):
    # 100 one-digit problems per operator; while any problem is left outside the held-out set,
    # training never draws a held-out one
    run = arith_run("train.prompts_per_step=20", "arith.digits=1",
                    f"arith.operators={operators}", f"arith.eval_size={eval_size}")
    held_out = set(rlmix_arith._eval_set(run))
    assert len(held_out) == eval_size
    train = {problem_of(p) for step in range(30)
             for p in run.hook.rlmix_prompts(run=run, step=step)}
    assert not train & held_out


def test_a_held_out_set_covering_the_whole_space_still_gives_prompts():
    run = arith_run("train.prompts_per_step=5", "arith.digits=1", "arith.eval_size=100")
    assert len(rlmix_arith._eval_set(run)) == 100
    assert len(run.hook.rlmix_prompts(run=run, step=0)) == 5


def test_prompt_text_comes_from_the_harness():
    run = arith_run("train.prompts_per_step=2")
    default = run.hook.rlmix_prompts(run=run, step=0)
    assert [m["role"] for m in default[0].messages] == ["user"]
    assert default[0].messages[0]["content"].endswith(rlmix_arith.Settings().instructions)

    run = arith_run("train.prompts_per_step=2", "arith.instructions=Answer briefly.")
    assert run.hook.rlmix_prompts(run=run, step=0)[0].messages[0]["content"].endswith(
        "? Answer briefly.")

    run.harness["instructions"] = "Think, then give the number."
    run.harness["system"] = "You are a calculator."
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    assert prompts[0].messages[0] == {"role": "system", "content": "You are a calculator."}
    assert prompts[0].messages[1]["content"].endswith("? Think, then give the number.")
    assert [problem_of(p) for p in prompts] == [problem_of(p) for p in default]

    run = arith_run("train.prompts_per_step=2", "harness.system=Be exact.")  # from the manifest
    assert run.hook.rlmix_prompts(run=run, step=0)[0].messages[0]["content"] == "Be exact."


# ---------------------------------------------------------------- scoring


def scored_batch(run, texts):
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    batch = make_batch(n_groups=len(prompts), group_size=len(texts) // len(prompts))
    batch.prompts = [p for p in prompts for _ in range(len(texts) // len(prompts))]
    batch.texts = texts
    return batch, prompts


def test_score_returns_both_terms_and_fills_info():
    run = arith_run("train.prompts_per_step=2")
    batch, prompts = scored_batch(run, ["", "", "", "", "", "", "", ""])
    a0, a1 = prompts[0].answer, prompts[1].answer
    batch.texts = [str(a0), f"It is {a0}", str(a0 + 1), "none",
                   str(a1), f"{a1} ", f"= {a1 - 1}", f"{a1}!"]
    terms = rlmix_arith.rlmix_score(run, batch)
    assert set(terms) == {"correct", "format"}
    assert all(v.shape == (8,) for v in terms.values())
    assert terms["correct"].tolist() == [1, 1, 0, 0, 1, 1, 0, 1]
    assert terms["format"].tolist() == [1, 0, 1, 0, 1, 1, 0, 0]
    assert batch.info[1]["arith"] == {"answer": a0, "parsed": a0}
    assert batch.info[3]["arith"] == {"answer": a0, "parsed": None}
    assert batch.info[6]["arith"] == {"answer": a1, "parsed": a1 - 1}


def test_core_sums_the_terms_with_manifest_weights():
    run = arith_run("train.prompts_per_step=1", "score.weights.arith.format=0.25")
    batch, prompts = scored_batch(run, ["", "", "", ""])
    a = prompts[0].answer
    batch.texts = [str(a), f"so {a}", str(a + 2), "?"]
    loop.score(run, batch)
    assert batch.reward_terms["arith.correct"].tolist() == [1, 1, 0, 0]
    assert batch.reward_terms["arith.format"].tolist() == [1, 0, 1, 0]
    torch.testing.assert_close(batch.rewards, torch.tensor([1.25, 1.0, 0.25, 0.0]))


# ---------------------------------------------------------------- evaluation


def test_evaluation_is_greedy_and_scores_the_held_out_set(monkeypatch):
    run = arith_run("arith.eval_size=8", "arith.eval_max_new_tokens=7")
    rlmix_arith.rlmix_configure(run)
    calls = []

    def fake_generate(prompts, **kwargs):
        calls.append(kwargs)
        # right on the even problems, a bare wrong number on the odd ones
        return SimpleNamespace(texts=[str(p.answer + (i % 2)) for i, p in enumerate(prompts)])

    monkeypatch.setattr(run, "generate", fake_generate)
    result = rlmix_arith.rlmix_evaluate(run)
    assert result == {"accuracy": 0.5, "format": 1.0}
    assert len(calls) == 1 and calls[0]["temperature"] == 0.0
    assert calls[0]["max_new_tokens"] == 7


def test_evaluation_on_a_tiny_random_model(monkeypatch):
    rlmix_hf = pytest.importorskip("rlmix_hf")  # the rollout engine; absent when tested alone
    run = make_run({"hf": rlmix_hf, "arith": rlmix_arith},
                   ["arith.eval_size=3", "arith.eval_max_new_tokens=4"], with_policy=True)
    rlmix_arith.rlmix_configure(run)
    seen = []
    real = rlmix_hf.sample_tokens

    def spy(model, input_ids, attention_mask, n, max_new_tokens, temperature, *args, **kw):
        seen.append((len(input_ids), n, max_new_tokens, temperature))
        return real(model, input_ids, attention_mask, n, max_new_tokens, temperature, *args,
                    **kw)

    monkeypatch.setattr(rlmix_hf, "sample_tokens", spy)
    metrics = loop.evaluate(run)
    assert set(metrics) == {"eval/accuracy", "eval/format"}
    assert 0.0 <= metrics["eval/accuracy"] <= 1.0 and 0.0 <= metrics["eval/format"] <= 1.0
    assert seen == [(3, 1, 4, 0.0)]


def test_no_held_out_set_means_no_metrics():
    run = arith_run("arith.eval_size=0")
    assert rlmix_arith.rlmix_evaluate(run) == {}


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("override", ["arith.digits=0", "arith.digits=10",
                                      "arith.operators=/", "arith.operators=+/",
                                      "arith.operators=", "arith.eval_size=-1",
                                      "arith.size=3"])
def test_bad_settings_fail(override):
    with pytest.raises(rlmix.ManifestError, match="arith"):
        arith_run(override)
