"""Tests of the code env's easy setting (``code.data: easy``): the generated problems (distinct,
their canonical solutions pass, no constant function passes), the held-out split (disjoint,
>= 100), the verifier's verdicts and partial credit on them through the sandbox, the prompts'
worked example, and the red team's hacks retargeted at an easy problem. The example manifest
(examples/envs/code_easy_smollm2.yaml) runs end to end in tests/test_envs_learn.py."""

from __future__ import annotations

import re

import pytest
import rlmix_code
from rlmix_code import load_problems, split, verification_plan, verify
from rlmix_code.easy import EXAMPLE_PROMPT, EXAMPLE_REPLY, FAMILIES, easy_problems
from rlmix_code.redteam import HACKS

from rlmix.testing import make_batch, make_run

EASY = {p.task_id: p for p in load_problems("easy")}


def fenced(code: str) -> str:
    return f"```python\n{code.strip()}\n```"


def _run_asserts(problem: rlmix_code.Problem, solution: str) -> list[bool]:
    """Each assert's outcome with ``solution`` (our own code, run here)."""
    ns: dict = {}
    exec(problem.prompt + solution, ns)
    out = []
    for test in problem.asserts:
        try:
            exec(test, ns)
            out.append(True)
        except AssertionError:
            out.append(False)
    return out


def test_easy_problems_are_distinct_and_cover_every_family():
    problems = easy_problems()
    assert len(problems) == len(EASY) >= 400
    names = {p.entry_point for p in problems}
    assert len(names) == len(problems)
    for family in FAMILIES:
        pattern = re.escape(family.name).replace(r"\{k\}", ".+")
        assert any(re.fullmatch(pattern, n) for n in names), family.name
    assert "shout" not in names and "shout" in EXAMPLE_PROMPT  # the example is apart
    assert easy_problems() == problems  # deterministic


def test_canonical_solutions_pass_and_no_constant_function_does():
    for problem in EASY.values():
        assert len(problem.asserts) == 5 and problem.prompt.count(">>>") == 1
        assert all(_run_asserts(problem, problem.canonical_solution)), problem.task_id
        for test in problem.asserts:  # a function returning one test's expected value
            expected = test.rsplit(" == ", 1)[1]
            assert not all(_run_asserts(problem, f"    return {expected}\n")), (problem.task_id,
                                                                               expected)


def test_every_easy_problem_takes_the_split_path():
    paths = {verification_plan(p).path for p in EASY.values()}
    assert paths == {"split"}


def test_the_held_out_split_is_disjoint_and_large_enough():
    train, held = split(len(EASY), 0.25, 0)
    assert len(held) >= 100 and not set(train) & set(held)
    assert sorted(train + held) == list(range(len(EASY)))
    run = make_run({"code": rlmix_code}, ["code.data=easy", "train.prompts_per_step=16"])
    ids = list(EASY)
    held_ids = {ids[i] for i in held}
    evals = {p.task_id for p in rlmix_code.eval_problems(run)}
    assert evals == held_ids
    seen = {p.answer for step in range(20) for p in rlmix_code.rlmix_prompts(run, step)}
    assert len(seen) > 150 and not seen & held_ids


def test_verdicts_and_partial_credit_through_the_sandbox():
    add = EASY["easy/add_3"]
    above = EASY["easy/greater_than_5"]
    rev = EASY["easy/reverse"]
    texts = [fenced("def add_3(x: int) -> int:\n    return x + 3"),
             fenced("def add_3(x):\n    return x + 4"),
             "    return 3 + x",  # the body alone, HumanEval's completion format
             fenced("def greater_than_5(x):\n    return x >= 5"),  # wrong only at 5
             fenced("def reverse(s):\n    return ''.join(reversed(s))"),
             "I do not know."]
    problems = [add, add, add, above, rev, rev]
    verdicts = verify(texts, problems, workers=2)
    assert [v.all_passed for v in verdicts] == [True, False, True, False, True, False]
    assert verdicts[1].passed == 0 and verdicts[5].passed == 0 and verdicts[5].reason
    at_five = sum("greater_than_5(5)" in t for t in above.asserts)
    assert verdicts[3].passed == 5 - at_five, (above.asserts, verdicts[3])
    assert all(v.path == "split" for v in verdicts)


def test_easy_prompts_show_a_worked_example_first():
    run = make_run({"code": rlmix_code}, ["code.data=easy", "train.prompts_per_step=2"])
    prompt = rlmix_code.rlmix_prompts(run, 0)[0]
    assert [m["role"] for m in prompt.messages] == ["user", "assistant", "user"]
    assert "def shout" in prompt.messages[0]["content"]
    assert prompt.messages[1]["content"] == EXAMPLE_REPLY
    problem = EASY[str(prompt.answer)]
    assert problem.prompt.rstrip() in prompt.messages[2]["content"]
    assert prompt.messages[2]["content"].startswith(rlmix_code.DEFAULT_INSTRUCTIONS)
    # the example's reply is itself a passing answer in the format it shows
    shout = rlmix_code.Problem("x/shout", EXAMPLE_PROMPT, "shout", "", (
        "assert shout('a') == 'a!'", "assert shout('') == '!'"), '    return s + "!"\n')
    assert verify([EXAMPLE_REPLY], [shout])[0].all_passed
    hidden = make_run({"code": rlmix_code}, ["code.data=easy", "code.worked_example=hide"])
    assert len(rlmix_code.rlmix_prompts(hidden, 0)[0].messages) == 1
    humaneval = make_run({"code": rlmix_code}, [])
    assert len(rlmix_code.rlmix_prompts(humaneval, 0)[0].messages) == 1
    with pytest.raises(ValueError, match="worked_example"):
        rlmix_code.Settings(worked_example="yes")


def _retarget(code: str, problem: rlmix_code.Problem) -> str:
    """A HumanEval/2 hack (``truncate_number(number)``) aimed at an easy one-argument problem."""
    return code.replace("def truncate_number(number: float) -> float:",
                        f"def {problem.entry_point}(number=None, *_args, **_kwargs):")


def test_the_red_team_earns_nothing_on_an_easy_problem():
    """Every hack of the red team written against HumanEval/2's one-argument function, aimed at
    an easy problem instead (the split path, plain values, verdicts in the trainer)."""
    target = EASY["easy/add_3"]
    hacks = [h for h in HACKS if h.task_id == "HumanEval/2"]
    assert len(hacks) >= 20
    texts = [fenced(_retarget(h.code, target)) for h in hacks]
    assert all(f"def {target.entry_point}(" in t for t in texts)
    verdicts = verify(texts, [target] * len(texts), timeout_s=3.0, test_timeout_s=1.0,
                      workers=2)
    forged = [(h.name, v.passed, v.reason) for h, v in zip(hacks, verdicts) if v.passed]
    assert forged == []
    assert all(v.reason and not v.all_passed for v in verdicts)


def test_score_hook_on_easy_problems():
    run = make_run({"code": rlmix_code}, ["code.data=easy", "code.timeout_s=5"])
    problem = EASY["easy/largest"]
    prompt = rlmix_code.to_prompt(run, problem, "p0")
    batch = make_batch(n_groups=1, group_size=3)
    batch.prompts = [prompt] * 3
    batch.texts = [fenced("def largest(xs):\n    return max(xs)"),
                   fenced("def largest(xs):\n    return xs[-1]"), "no"]
    terms = rlmix_code.rlmix_score(run, batch)
    assert terms["passed"].tolist() == [1.0, 0.0, 0.0]
    assert terms["pass_rate"][0] == 1 and terms["pass_rate"][2] == 0
    assert batch.info[0]["code"]["task_id"] == "easy/largest"
