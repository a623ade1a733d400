"""Tests of the math env: the verifier against hand-made right and wrong answers (equivalent
forms, wrong values, no answer, pathological outputs), the generated word problems, the user's
JSONL / parquet data and its deterministic split, prompts, scoring through the core, greedy
evaluation, and the example manifest end to end on the tiny model."""

from __future__ import annotations

import json
import re
import threading
import time
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import rlmix_math
import torch
from rlmix_math import problems as problems_mod
from rlmix_math import verify as verify_mod
from rlmix_math.problems import Problem, generated_problems, read_rows, rows_to_problems, split
from rlmix_math.verify import has_boxed_answer, last_boxed, verify_answer

import rlmix
from rlmix import loop
from rlmix.testing import make_batch, make_run, skip_unless_installed

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "envs" / "math.yaml"


def math_run(*overrides):
    return make_run({"math": rlmix_math}, list(overrides))


# ---------------------------------------------------------------- the verifier


@pytest.mark.parametrize("completion", [
    "\\boxed{1/2}",
    "\\boxed{0.5}",
    "\\boxed{\\frac{1}{2}}",
    "So each gets half: \\boxed{\\frac12}.",
    "\\boxed{2/4}",
    "\\boxed{\\dfrac{1}{2}}",
    "The answer is 0.5",  # no box: math-verify finds the final answer in the text
    "first I thought \\boxed{3}, but it is \\boxed{1/2}",  # the last box is the answer
])
@pytest.mark.parametrize("answer", ["1/2", "0.5", "\\frac{1}{2}"])
def test_equivalent_forms_of_the_right_answer_are_correct(completion, answer):
    verdict = verify_answer(completion, answer)
    assert verdict.correct, verdict
    assert verdict.reason == "correct"


@pytest.mark.parametrize("completion, answer", [
    ("\\boxed{2/3}", "1/2"),
    ("\\boxed{-1/2}", "1/2"),
    ("\\boxed{0.51}", "1/2"),
    ("\\boxed{1/2} at first, finally \\boxed{3}", "1/2"),  # the last box counts
    ("\\boxed{13}", "12"),
    ("\\boxed{12}", "-12"),
    ("\\boxed{3/4}", "4/3"),
])
def test_wrong_values_score_zero(completion, answer):
    verdict = verify_answer(completion, answer)
    assert not verdict.correct
    assert verdict.reason == "wrong answer"


@pytest.mark.parametrize("completion, reason", [
    ("I do not know.", "no answer found"),
    ("", "empty completion"),
    ("\\boxed{}", "could not parse the boxed answer"),
    ("\\boxed{", "no answer found"),  # an unclosed box is no box
])
def test_no_answer_scores_zero_with_a_reason(completion, reason):
    verdict = verify_answer(completion, "7")
    assert not verdict.correct and verdict.reason == reason


def test_require_boxed_rejects_an_unboxed_right_answer():
    assert verify_answer("The answer is 7", "7").correct
    verdict = verify_answer("The answer is 7", "7", require_boxed=True)
    assert not verdict.correct and "boxed" in verdict.reason
    assert verify_answer("\\boxed{7}", "7", require_boxed=True).correct


def test_a_runaway_expression_times_out_and_scores_zero():
    # sympy would try to build 9^(9^(9^9)) for ever; the deadline stops it
    t0 = time.perf_counter()
    verdict = verify_answer("\\boxed{9^{9^{9^{9}}}}", "1/2", timeout_s=0.5)
    elapsed = time.perf_counter() - t0
    assert not verdict.correct
    assert verdict.reason == "verifier timed out after 0.5s"
    assert elapsed < 3.0
    # the deadline is disarmed afterwards: a normal check still works and no alarm fires later
    assert verify_answer("\\boxed{4}", "4").correct
    time.sleep(0.6)


@pytest.mark.parametrize("completion", [
    "\\boxed{" + "(" * 2000 + "1" + ")" * 2000 + "}",  # longer than max_chars
    "1" * 200_000,
    "\\boxed{" * 300,
    "\\boxed{\\frac{1}{0}}",
    "\\boxed{\\left( \\right}",
])
def test_pathological_outputs_score_zero_without_raising(completion):
    t0 = time.perf_counter()
    verdict = verify_answer(completion, "1/2", timeout_s=1.0)
    assert not verdict.correct and verdict.reason != "correct"
    assert time.perf_counter() - t0 < 4.0


def test_a_verifier_crash_becomes_a_reason(monkeypatch):
    import math_verify

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(math_verify, "verify", broken)
    verdict = verify_answer("\\boxed{1}", "1")
    assert not verdict.correct
    assert verdict.reason == "verifier error: RuntimeError: boom"


def test_the_verifier_works_off_the_main_thread():
    # signals only work in the main thread; elsewhere the check runs without a timer
    results = []
    worker = threading.Thread(target=lambda: results.append(
        (verify_answer("\\boxed{0.25}", "1/4").correct,
         verify_answer("\\boxed{0.3}", "1/4").correct)))
    worker.start()
    worker.join(30)
    assert results == [(True, False)]


@pytest.mark.parametrize("text, boxed", [
    ("\\boxed{42}", "42"),
    ("a \\boxed{1} b \\boxed{\\frac{3}{4}} c", "\\frac{3}{4}"),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
    ("\\fbox{5} and then \\boxed{6}", "6"),
    ("\\boxed{6} and then \\fbox{5}", "5"),
    ("\\boxed{7} then \\boxed{8", "7"),  # the unclosed last box is skipped
    ("no box", None),
    ("\\boxed{", None),
])
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


def test_format_reward_needs_a_closed_non_empty_box():
    texts = ["\\boxed{3}", "so \\boxed{\\frac{1}{2}}.", "3", "\\boxed{}", "\\boxed{ }",
             "\\boxed{3"]
    assert rlmix_math.format_reward(texts).tolist() == [1, 1, 0, 0, 0, 0]
    assert [has_boxed_answer(t) for t in texts] == [True, True, False, False, False, False]


# ---------------------------------------------------------------- generated problems


def test_generated_problems_are_deterministic_distinct_and_cover_every_template():
    first = generated_problems(3, 400)
    assert first == generated_problems(3, 400)
    assert first != generated_problems(4, 400)
    assert len({p.question for p in first}) == 400
    assert any("/" in p.answer for p in first) and any("/" not in p.answer for p in first)
    # every template contributes (each has its own wording)
    openings = {re.sub(r"\d+", "#", p.question)[:25] for p in first}
    assert len(openings) >= len(problems_mod.TEMPLATES)


_CHECKS = [  # an independent reading of each template's question
    (r"has (\d+) \w+ and gets (\d+) more", lambda a, b: a + b),
    (r"had (\d+) \w+ and gave away (\d+)", lambda a, b: a - b),
    (r"makes (\d+) loaves .* in (\d+) days", lambda a, d: a * d),
    (r"(\d+) friends share (\d+) pizzas", lambda n, m: Fraction(m, n)),
    (r"holds (\d+) liters and is (\d+)/(\d+) full", lambda c, p, q: Fraction(c * p, q)),
    (r"fraction of a day is (\d+) hours", lambda h: Fraction(h, 24)),
    (r"costs (\d+) dollars\. It is sold at (\d+)% off", lambda p, o: Fraction(p * (100 - o),
                                                                            100)),
    (r"sum of two numbers is (\d+) and their difference is (\d+)", lambda s, d: (s + d) // 2),
    (r"was (-?\d+) degrees .* fell by (\d+)", lambda t, d: t - d),
]


def test_generated_answers_are_right():
    checked = 0
    for p in generated_problems(0, 300):
        for pattern, solve in _CHECKS:
            match = re.search(pattern, p.question)
            if match:
                expected = Fraction(solve(*map(int, match.groups())))
                assert Fraction(p.answer) == expected, p
                checked += 1
                break
        else:
            pytest.fail(f"no check reads {p.question!r}")
    assert checked == 300


def test_every_generated_answer_verifies_against_itself_and_not_a_neighbour():
    for p in generated_problems(1, 45):  # the templates take turns: 5 of each of the 9
        assert verify_answer(f"\\boxed{{{p.answer}}}", p.answer).correct, p
        wrong = Fraction(p.answer) + 1
        assert not verify_answer(f"\\boxed{{{wrong}}}", p.answer).correct, p


# ---------------------------------------------------------------- user data


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"problem": f"What is {i} + {i}?", "solution": f"Twice {i}.\n#### {2 * i}", "id": i}
        for i in range(30)]


@pytest.mark.parametrize("loader", ["datasets", "builtin"])
def test_jsonl_and_parquet_give_the_same_problems(tmp_path, loader):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    cache = str(tmp_path / "cache")
    from_json = rows_to_problems(read_rows(str(jsonl), "auto", loader, cache), "problem",
                                 "solution", "####")
    from_parquet = rows_to_problems(read_rows(str(parquet), "auto", loader, cache), "problem",
                                    "solution", "####")
    assert from_json == from_parquet
    assert from_json[7] == Problem("What is 7 + 7?", "14")  # the text after "####"
    assert len(from_json) == 30


def test_split_is_deterministic_disjoint_and_sized():
    probs = [Problem(f"q{i}", str(i)) for i in range(50)]
    train, held = split(probs, 10, seed=0)
    assert (train, held) == split(probs, 10, seed=0)
    assert split(probs, 10, seed=1)[1] != held
    assert len(held) == 10 and len(train) == 40
    assert not {p.question for p in train} & {p.question for p in held}
    assert sorted(train + held, key=lambda p: int(p.answer)) == probs
    with pytest.raises(rlmix.ConfigError, match="math.eval_size"):
        split(probs, 50, seed=0)


def test_a_run_on_a_users_file(tmp_path):
    data = write_jsonl(tmp_path / "mine.jsonl",
                       [{"q": f"Compute {i} times 3.", "a": str(3 * i)} for i in range(12)]
                       + [{"q": "Compute 0 times 3.", "a": "0"},  # a repeat is kept once
                          {"q": "", "a": "1"}])  # and a row without a question is dropped
    run = math_run(f"math.data_files={data}", "math.question_field=q", "math.answer_field=a",
                   "math.eval_size=4", "math.loader=builtin", "train.prompts_per_step=3")
    rlmix_math.rlmix_configure(run)
    pools = run.resources["math"]
    assert len(pools["train"]) == 8 and len(pools["eval"]) == 4
    held = {p.question for p in pools["eval"]}
    for step in range(20):
        for prompt in run.hook.rlmix_prompts(run=run, step=step):
            question = prompt.messages[-1]["content"].split("\n\n")[0]
            assert question not in held
            assert prompt.answer == str(3 * int(re.search(r"\d+", question)[0]))


def test_bad_data_settings_name_the_setting(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    run = math_run(f"math.data_files={data}", "math.question_field=question")
    with pytest.raises(rlmix.ConfigError, match="math.question_field.*'question'.*problem"):
        rlmix_math.rlmix_configure(run)
    run = math_run(f"math.data_files={tmp_path / 'missing.jsonl'}")
    with pytest.raises(rlmix.ConfigError, match="math.data_files: no such file"):
        rlmix_math.rlmix_configure(run)
    odd = tmp_path / "d.txt"
    odd.write_text("{}")
    run = math_run(f"math.data_files={odd}")
    with pytest.raises(rlmix.ConfigError, match="math.data_format"):
        rlmix_math.rlmix_configure(run)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "1"}\nnot json\n')
    run = math_run(f"math.data_files={broken}", "math.loader=builtin")
    with pytest.raises(rlmix.ConfigError, match="broken.jsonl:2"):
        rlmix_math.rlmix_configure(run)


@pytest.mark.parametrize("override", ["math.loader=pandas", "math.data_format=csv",
                                      "math.eval_size=-1", "math.timeout_s=-1",
                                      "math.max_chars=0", "math.generated_size=1",
                                      "math.answer_field=", "math.size=3"])
def test_bad_settings_fail(override):
    with pytest.raises(rlmix.ManifestError, match="math"):
        math_run(override)


# ---------------------------------------------------------------- prompts


def test_prompts_are_deterministic_and_never_held_out():
    run = math_run("train.prompts_per_step=8", "math.generated_size=300", "math.eval_size=60")
    rlmix_math.rlmix_configure(run)
    held = {p.question for p in run.resources["math"]["eval"]}
    assert len(held) == 60
    p3 = run.hook.rlmix_prompts(run=run, step=3)
    run.hook.rlmix_prompts(run=run, step=4)
    assert [p.messages for p in p3] == [p.messages for p in run.hook.rlmix_prompts(run=run,
                                                                                  step=3)]
    assert [p.messages for p in p3] != [p.messages for p in run.hook.rlmix_prompts(run=run,
                                                                                  step=4)]
    seen = set()
    for step in range(100):
        for prompt in run.hook.rlmix_prompts(run=run, step=step):
            seen.add(prompt.messages[-1]["content"].split("\n\n")[0])
    assert not seen & held
    assert len(seen) > 200


def test_prompt_text_comes_from_the_harness():
    run = math_run("train.prompts_per_step=1")
    default = run.hook.rlmix_prompts(run=run, step=0)[0]
    assert default.messages[-1]["content"].endswith("\\boxed{}.")
    run.harness.update(system="You are careful.", instructions="Box it.")
    prompt = run.hook.rlmix_prompts(run=run, step=0)[0]
    assert prompt.messages[0] == {"role": "system", "content": "You are careful."}
    assert prompt.messages[1]["content"].endswith("\n\nBox it.")


# ---------------------------------------------------------------- scoring and evaluation


def scored_batch(run, per_prompt):
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    batch = make_batch(n_groups=len(prompts), group_size=len(per_prompt[0]))
    batch.prompts = [p for p in prompts for _ in per_prompt[0]]
    batch.texts = [t(p.answer) for p, texts in zip(prompts, per_prompt) for t in texts]
    return batch, prompts


def test_score_terms_info_and_weights_through_the_core():
    run = math_run("train.prompts_per_step=2", "score.weights.math.format=0.5")
    texts = [lambda a: f"\\boxed{{{a}}}", lambda a: f"It is {a}.",
             lambda a: f"\\boxed{{{Fraction(a) + 2}}}", lambda a: "no idea"]
    batch, prompts = scored_batch(run, [texts, texts])
    loop.score(run, batch)
    assert batch.reward_terms["math.correct"].tolist() == [1, 1, 0, 0] * 2
    assert batch.reward_terms["math.format"].tolist() == [1, 0, 1, 0] * 2
    torch.testing.assert_close(batch.rewards, torch.tensor([1.5, 1.0, 0.5, 0.0] * 2))
    assert batch.info[0]["math"]["reason"] == "correct"
    assert batch.info[2]["math"]["reason"] == "wrong answer"
    assert batch.info[2]["math"]["boxed"] == str(Fraction(prompts[0].answer) + 2)
    assert batch.info[3]["math"] == {"answer": prompts[0].answer, "boxed": None, "parsed": None,
                                     "correct": False, "reason": "no answer found"}


def test_evaluation_is_greedy_chunked_and_scores_the_held_out_set(monkeypatch):
    run = math_run("math.eval_size=10", "math.eval_batch_size=4", "math.eval_max_new_tokens=9")
    rlmix_math.rlmix_configure(run)
    calls = []

    def fake_generate(prompts, **kwargs):
        calls.append((len(prompts), kwargs))
        # right (boxed) on the first of each chunk, a bare right answer on the second,
        # boxed wrong answers on the rest
        return SimpleNamespace(texts=[
            f"\\boxed{{{p.answer}}}" if i == 0 else p.answer if i == 1
            else f"\\boxed{{{Fraction(p.answer) + 1}}}" for i, p in enumerate(prompts)])

    monkeypatch.setattr(run, "generate", fake_generate)
    result = rlmix_math.rlmix_evaluate(run)
    assert [n for n, _ in calls] == [4, 4, 2]
    assert all(kw == {"temperature": 0.0, "max_new_tokens": 9} for _, kw in calls)
    assert result == {"accuracy": pytest.approx(6 / 10), "format": pytest.approx(7 / 10)}
    assert rlmix_math.rlmix_evaluate(math_run("math.eval_size=0")) == {}


def test_example_manifest_runs_two_steps_on_the_tiny_model(tmp_path):
    from rlmix import cli

    skip_unless_installed(EXAMPLE)
    code = cli.main(["run", str(EXAMPLE), "model=tiny-random", "math.eval_size=3",
                     "math.eval_max_new_tokens=6", "sampling.max_new_tokens=6",
                     "train.steps=2", "train.prompts_per_step=2", "train.group_size=2",
                     "train.eval_every=0", "train.checkpoint_every=0", "log.progress=false",
                     "log.plot=false", "policy.autocast=none", f"out={tmp_path}"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert {"reward/math.correct", "reward/math.format"} <= set(steps[-1])
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]


def test_verify_module_has_no_alarm_left_armed():
    import signal

    verify_answer("\\boxed{1}", "1", timeout_s=0.3)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert verify_mod._DeadlineExceeded.__mro__[1] is BaseException


def test_an_outer_timer_is_restored():
    import signal

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 5.0)
        assert verify_answer("\\boxed{2}", "2", timeout_s=1.0).correct
        left = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 3.0 < left <= 5.0  # still armed, with what was left of it
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired


# ---------------------------------------------------------------- the generated curriculum


def _reading(question: str) -> int:
    """An independent reading of a curriculum question: its numbers and its template's words."""
    n = [int(x) for x in re.findall(r"\d+", question)]
    q = question
    if "buys" in q and "gives" in q:
        return n[0] + n[1] - n[2]
    if "bags with" in q:
        return n[0] * n[1] - n[2]
    if "pens at" in q:
        return n[2] - n[0] * n[1]
    if "shared equally among" in q and "then each child gives" in q:
        return n[0] // n[1] - n[2]
    if "more" in q and "than" in q:
        return 2 * n[0] + n[1]
    if "A book has" in q:
        return n[0] - n[1] * n[2]
    if "saves" in q:
        return n[0] * n[1] - n[2]
    if "gets" in q and "more" in q:
        return n[0] + n[1]
    if "gave" in q:
        return n[0] - n[1]
    if "boxes with" in q:
        return n[0] * n[1]
    if "shares" in q:
        return n[0] // n[1]
    if "reads" in q:
        return n[0] * n[1]
    if "change" in q:
        return n[1] - n[0]
    if "together" in q:
        return n[0] + n[1]
    raise AssertionError(f"unknown template: {question}")


def test_curriculum_problems_are_exact_distinct_and_cover_both_levels():
    from rlmix_math.curriculum import EXAMPLE as WORKED
    from rlmix_math.curriculum import ONE_STEP, TWO_STEP, curriculum_problems

    problems = curriculum_problems(0, 600)
    assert problems == curriculum_problems(0, 600) != curriculum_problems(1, 600)
    assert len({p.question for p in problems}) == 600
    assert {p.steps for p in problems} == {1, 2}
    assert abs(sum(p.steps == 2 for p in problems) - 300) <= 1
    for p in problems:
        assert p.answer == str(_reading(p.question)) and int(p.answer) >= 0, p
        assert "Zara" not in p.question and "kites" not in p.question  # the example is apart
    assert len(ONE_STEP) >= 5 and len(TWO_STEP) >= 5
    small = curriculum_problems(0, 200, (1,), 6)
    assert {p.steps for p in small} == {1}
    assert max(int(x) for p in small for x in re.findall(r"\d+", p.question)) <= 60
    assert verify_answer(WORKED[1], "5").correct and has_boxed_answer(WORKED[1])


def test_the_curriculum_is_selected_in_the_manifest_and_held_out_disjointly():
    run = math_run("math.source=curriculum", "math.eval_size=100", "math.generated_size=600",
                   "train.prompts_per_step=8")
    rlmix_math.rlmix_configure(run)
    pools = run.resources["math"]
    assert len(pools["eval"]) == 100 and {p.steps for p in pools["eval"]} == {1, 2}
    held = {p.question for p in pools["eval"]}
    assert not held & {p.question for p in pools["train"]}
    prompt = run.hook.rlmix_prompts(run=run, step=0)[0]
    assert [m["role"] for m in prompt.messages] == ["user", "assistant", "user"]
    assert "\\boxed{5}" in prompt.messages[1]["content"] and prompt.info["steps"] in (1, 2)
    seen = {p.messages[-1]["content"].split("\n\n")[0] for step in range(30)
            for p in run.hook.rlmix_prompts(run=run, step=step)}
    assert len(seen) > 150 and not seen & held
    hidden = math_run("math.source=curriculum", "math.worked_example=hide",
                      "math.generated_size=200")
    assert len(hidden.hook.rlmix_prompts(run=hidden, step=0)[0].messages) == 1
    generated = math_run("math.generated_size=200")  # the default source: no example
    assert len(generated.hook.rlmix_prompts(run=generated, step=0)[0].messages) == 1


def test_the_ramp_phases_two_step_problems_in():
    run = math_run("math.source=curriculum", "math.curriculum_ramp=10",
                   "train.prompts_per_step=40", "math.generated_size=400", "math.eval_size=40")

    def share(step):
        return sum(p.info["steps"] == 2 for p in run.hook.rlmix_prompts(run=run, step=step)) / 40

    assert share(0) == 0.0
    assert 0.05 < share(5) < 0.45
    assert 0.3 < share(20) < 0.7


def test_curriculum_evaluation_reports_each_level(monkeypatch):
    run = math_run("math.source=curriculum", "math.eval_size=8", "math.generated_size=100")
    rlmix_math.rlmix_configure(run)

    def fake_generate(prompts, **kwargs):  # right on the one-step problems only
        return SimpleNamespace(texts=[f"\\boxed{{{p.answer}}}" if p.info["steps"] == 1
                                      else "\\boxed{-1}" for p in prompts])

    monkeypatch.setattr(run, "generate", fake_generate)
    result = rlmix_math.rlmix_evaluate(run)
    ones = sum(p.steps == 1 for p in run.resources["math"]["eval"])
    assert result["accuracy_1step"] == 1.0 and result["accuracy_2step"] == 0.0
    assert result["accuracy"] == pytest.approx(ones / 8) and result["format"] == 1.0


@pytest.mark.parametrize("override", ["math.source=web", "math.source=files",
                                      "math.curriculum_levels=3", "math.curriculum_levels=x",
                                      "math.curriculum_max=1", "math.curriculum_ramp=-1",
                                      "math.worked_example=yes"])
def test_bad_curriculum_settings_fail(override):
    with pytest.raises(rlmix.ManifestError, match="math"):
        math_run(override)
