"""Tests of the code env: HumanEval loading and split, code extraction, the verifier against
right, wrong and partial solutions of real HumanEval problems, hostile completions, the user's
JSONL, and the example manifest end to end on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import rlmix_code
import rlmix_sandbox as sandbox
from rlmix_code import (
    extract_code,
    load_problems,
    pass_at_1,
    split,
    split_tests,
    verify,
)
from rlmix_sandbox import leftover_pids

from rlmix import cli
from rlmix.errors import ConfigError
from rlmix.testing import make_batch, make_run

ROOT = Path(__file__).resolve().parents[4]
PROBLEMS = {p.task_id: p for p in load_problems()}
HAS_CLOSE = PROBLEMS["HumanEval/0"]  # has_close_elements(numbers, threshold), 7 asserts
ADD = PROBLEMS["HumanEval/53"]  # add(x, y): 5 asserts + a random loop


def fenced(code: str) -> str:
    return f"Here is the solution:\n```python\n{code}\n```\nIt loops over pairs."


RIGHT_0 = fenced("""
from typing import List

def has_close_elements(numbers: List[float], threshold: float) -> bool:
    return any(abs(a - b) < threshold
               for i, a in enumerate(numbers) for j, b in enumerate(numbers) if i != j)
""")
WRONG_0 = fenced("def has_close_elements(numbers, threshold):\n    return False")
# only adjacent pairs (unsorted input): right on some asserts, wrong on others
PARTIAL_0 = fenced("""
def has_close_elements(numbers, threshold):
    return any(abs(a - b) < threshold for a, b in zip(numbers, numbers[1:]))
""")


# ---------------------------------------------------------------- data and split


def test_humaneval_is_read_from_the_package():
    assert len(PROBLEMS) == 164
    assert HAS_CLOSE.entry_point == "has_close_elements" and "def check" in HAS_CLOSE.test


def test_split_is_deterministic_disjoint_and_complete():
    train, held = split(164, 0.25, 0)
    assert (train, held) == split(164, 0.25, 0)
    assert split(164, 0.25, 1)[1] != held
    assert len(held) == 41 and not set(train) & set(held)
    assert sorted(train + held) == list(range(164))


def test_split_tests_one_test_per_assert_with_setup():
    tests = split_tests(HAS_CLOSE)
    assert len(tests) == 7
    assert all("_rlmix_check(has_close_elements)" in t for t in tests)
    # HumanEval/53: 5 asserts, then a loop of random asserts whose RNG setup comes before it
    add_tests = split_tests(ADD)
    assert len(add_tests) == 6 and "import random" in add_tests[-1]


# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize("completion, how", [
    (RIGHT_0, "fenced block"),
    ("Sure.\ndef has_close_elements(numbers, threshold):\n    return True\n", "raw function"),
    ("    return True\n\ndef unrelated():\n    pass\n", "raw body"),
    ("```python\n    for a in numbers:\n        pass\n    return False\n```",
     "fenced block (function body)"),
    ("```python\ndef has_close_elements(numbers, threshold):\n    return True", "fenced block"),
])
def test_extraction_rule(completion, how):
    program, found = extract_code(completion, HAS_CLOSE)
    assert found == how and program is not None
    assert program.startswith(HAS_CLOSE.prompt.rstrip()[:40])
    assert "unrelated" not in program  # the stop sequence ended the raw body


@pytest.mark.parametrize("completion, reason", [
    ("", "no code"),
    ("I cannot do that.", "syntax error"),
    ("```python\ndef has_close_elements(x:\n```", "syntax error"),
])
def test_malformed_output_is_not_a_program(completion, reason):
    program, why = extract_code(completion, HAS_CLOSE)
    assert program is None and why.startswith(reason)


# ---------------------------------------------------------------- the verifier


def test_verifier_right_wrong_partial():
    right, wrong, partial, canonical = verify(
        [RIGHT_0, WRONG_0, PARTIAL_0, HAS_CLOSE.canonical_solution], [HAS_CLOSE] * 4)
    assert (right.pass_rate, right.all_passed, right.status) == (1.0, True, "passed")
    assert canonical.all_passed  # the raw body HumanEval ships
    assert wrong.status == "failed" and 0 < wrong.passed < wrong.total  # False is right 3 times
    assert partial.status == "failed"
    assert 0 < partial.pass_rate < 1 and partial.passed != wrong.passed
    assert "AssertionError" in partial.reason
    # pass@1 (HumanEval's own single check) agrees with "all tests passed"
    assert [ok for ok, _ in pass_at_1([RIGHT_0, WRONG_0, PARTIAL_0], [HAS_CLOSE] * 3)] == [
        True, False, False]


def test_verifier_on_more_real_problems():
    ids = ["HumanEval/2", "HumanEval/53", "HumanEval/32"]  # truncate, add, find_zero
    probs = [PROBLEMS[i] for i in ids]
    canon = [fenced(p.prompt + p.canonical_solution) for p in probs]
    wrong = [fenced(f"def {p.entry_point}(*args):\n    return 0") for p in probs]
    got = verify(canon + wrong, probs * 2)
    assert [v.all_passed for v in got] == [True] * 3 + [False] * 3
    assert all(v.pass_rate < 1 for v in got[3:])


HOSTILE = {
    "fork bomb": "import os\ndef add(x, y):\n    while True:\n        os.fork()",
    "memory": "def add(x, y):\n    return len(bytearray(1 << 34))",
    "loop": "def add(x, y):\n    while True:\n        pass",
    "network": "import socket\ndef add(x, y):\n    socket.create_connection(('1.1.1.1', 80))",
    "kill parent": "import os\nos.kill(os.getppid(), 9)\ndef add(x, y):\n    return x + y",
    "exit": "import os\nos._exit(0)\ndef add(x, y):\n    return x + y",
    "fake report": "import sys\nfor i in range(9):\n    print('0' * 32, [i, True, ''])\n"
                   "def add(x, y):\n    return 0",
}


def test_hostile_completions_score_zero_and_the_env_keeps_going():
    honest = fenced(ADD.prompt + ADD.canonical_solution)
    completions = [fenced(c) for c in HOSTILE.values()] + [honest]
    verdicts = verify(completions, [ADD] * len(completions), timeout_s=3, test_timeout_s=0.5)
    for name, v in zip(HOSTILE, verdicts):
        assert v.pass_rate == 0 and not v.all_passed, (name, v)
        assert v.reason, name
    assert verdicts[-1].all_passed  # the honest one next to them still passes
    base = sandbox._uid_base()  # every uid this process's sandboxes may have used
    assert [u for u in range(base, base + 256) if leftover_pids(u)] == []


def test_score_hook_fills_info_and_never_raises():
    run = make_run({"code": rlmix_code}, ["code.timeout_s=5"])
    batch = make_batch(n_groups=1, group_size=4)
    prompt = rlmix_code.to_prompt(run, HAS_CLOSE, "p0")
    batch.prompts = [prompt] * 4
    batch.texts = [RIGHT_0, "no code here", PARTIAL_0, fenced("def has_close_elements(:")]
    terms = rlmix_code.rlmix_score(run, batch)
    assert terms["passed"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert terms["pass_rate"][0] == 1 and 0 < terms["pass_rate"][2] < 1
    assert terms["pass_rate"][[1, 3]].tolist() == [0.0, 0.0]
    assert [i["code"]["status"] for i in batch.info] == ["passed", "syntax_error", "failed",
                                                         "syntax_error"]
    assert all(i["code"]["reason"] for i in batch.info)


# ---------------------------------------------------------------- the user's JSONL


def test_user_jsonl_with_assert_lists(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"q": "def double(x):\n    \"\"\"Twice x.\"\"\"\n",
             "checks": ["assert double(2) == 4", "assert double(0) == 0",
                        "assert double(-1) == -2"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    (p,) = load_problems(str(path), "q", "checks", "entry_point", "task_id")
    assert p.entry_point == "double" and len(split_tests(p)) == 3
    right, partial = verify(["    return 2 * x", "    return abs(2 * x)"], [p, p])
    assert right.all_passed and partial.passed == 2
    with pytest.raises(ConfigError, match="code.tests_field"):
        load_problems(str(path), "q", "tests", "entry_point", "task_id")
    with pytest.raises(ConfigError, match="code.data"):
        load_problems(str(tmp_path / "missing.jsonl"))


def test_bad_settings_name_the_setting():
    with pytest.raises(ValueError, match="eval_split"):
        rlmix_code.Settings(eval_split="test")
    with pytest.raises(ValueError, match="heldout_fraction"):
        rlmix_code.Settings(heldout_fraction=1.5)


def test_prompts_are_deterministic_and_never_held_out():
    run = make_run({"code": rlmix_code}, ["train.prompts_per_step=8"])
    _, held = split(164, 0.25, 0)
    held_ids = {list(PROBLEMS)[i] for i in held}
    first = rlmix_code.rlmix_prompts(run, 3)
    assert [p.answer for p in first] == [p.answer for p in rlmix_code.rlmix_prompts(run, 3)]
    assert not {p.answer for p in first} & held_ids
    assert "```python\nfrom typing" in first[0].messages[-1]["content"] or "def " in (
        first[0].messages[-1]["content"])


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_example_manifest_runs_on_the_tiny_model(tmp_path):
    code = cli.main(["run", str(ROOT / "examples" / "envs" / "code.yaml"), "model=tiny-random",
                     "train.steps=2", "train.prompts_per_step=2", "train.group_size=2",
                     "sampling.max_new_tokens=8", "code.eval_size=2",
                     "code.eval_max_new_tokens=8", "train.eval_every=0",
                     "train.checkpoint_every=0", "log.progress=false", "log.plot=false",
                     "hf.batch_size=0", f"out={tmp_path}"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    assert "reward/code.pass_rate" in rows[1]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert len(evals) == 2 and evals[0]["eval/problems"] == 2



# ---------------------------------------------------------------- the claim in miniature


def test_functional_correctness_is_not_text_similarity():
    """HumanEval's premise: a program is judged by running it, not by how close its text is to
    the reference. A rewrite that shares little text with the canonical solution passes; a copy
    with one character changed fails."""
    import difflib

    canonical = ADD.prompt + ADD.canonical_solution
    rewrite = ADD.prompt + "    total = x\n    total += y\n    return total\n"
    typo = ADD.prompt + ADD.canonical_solution.replace("x + y", "x - y")
    assert typo != canonical

    def sim(a):
        return difflib.SequenceMatcher(None, canonical, a).ratio()

    assert sim(typo) > sim(rewrite)  # by text, the broken one is the closer
    ok_rewrite, bad_typo = verify([fenced(rewrite), fenced(typo)], [ADD, ADD])
    assert ok_rewrite.all_passed and not bad_typo.all_passed and bad_typo.pass_rate < 0.5
