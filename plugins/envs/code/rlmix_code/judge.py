"""Verdicts decided where the solution cannot reach: in the trainer, on plain values.

The threat: a completion is written by the policy, and RL rewards whatever passes. If the test's
comparisons run in the solution's process, the solution can reach them (``__main__``, frames,
``gc``, patched builtins, an object whose ``__eq__`` is always true, ``sys.exit(0)`` before the
asserts). So for most problems nothing of the test runs there.

**The split path.** A problem's tests (``split_tests``) are run here, in the trainer, once with
the problem's canonical solution standing in for the candidate, recording the arguments of every
call the tests make (:func:`plan`). The sandboxed child (``runner.py``, mode ``calls``) gets only
the solution and those argument lists, and returns the value of each call as a plain literal
(``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes`` and
``list``/``tuple``/``dict``/``set``/``frozenset`` of them, exact types only: a subclass of
``int`` is refused). The tests then run here again (:func:`replay`) with a stand-in that returns
those values, so ``==``, ``abs(a - b) < tol``, ``isinstance`` and every other comparison is
evaluated by the trainer on values the solution cannot change any more. Helpers the tests use
(HumanEval/32's ``poly``, /38's ``encode_cyclic``) come from the problem's prompt, never from the
solution (which could redefine them). ``random`` in the tests is a private, seeded generator per
test (HumanEval/38, /50, /53 draw unseeded), so both runs make the same calls.

A problem takes **the nonce path** when this cannot be done: no canonical solution, an argument
or a canonical return value that is not a plain value, a test that uses the candidate other
than by calling it, a canonical solution that fails its own tests, calls that differ between two
recordings, or tests that fail when replayed on the canonical solution's own values (a test that
reads an argument the solution mutated, or compares identities). Then the whole
test program runs in the sandbox with the solution (``runner.py``, mode ``check``) and passes
only on both a nonce the solution's process never holds and a clean exit of that process observed
by its parent (see ``runner.py``).
"""

from __future__ import annotations

import builtins
import json
import random
import re
import types
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

MAX_DEPTH = 100
MAX_INT_HEX = 100_000  # hex digits of a returned int (400 kbit)
MAX_CHARS = 4_000_000  # of one returned value's JSON
_HEX = re.compile(r"-?[0-9a-f]+\Z")


class NotPlain(ValueError):
    """A value that is not a plain literal (the reason is the message)."""


# ------------------------------------------------------------------------------ plain values


def encode(x: Any, depth: int = 0) -> Any:
    """``x`` as tagged JSON (the format of ``runner.py``); exact types only."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return {"i": format(x, "x")}
    if t is float:
        return {"f": repr(x)}
    if t is complex:
        return {"c": [repr(x.real), repr(x.imag)]}
    if t is bytes:
        return {"b": x.hex()}
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "s", frozenset: "z"}[t]
        return {tag: [encode(v, depth + 1) for v in x]}
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}
    raise NotPlain(f"a {t.__module__}.{t.__qualname__} is not a plain value")


def decode(x: Any, depth: int = 0) -> Any:
    """The value of tagged JSON, strictly: anything malformed raises ``NotPlain``."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    if x is None or type(x) in (bool, str):
        return x
    if type(x) is not dict or len(x) != 1:
        raise NotPlain(f"malformed value {str(x)[:60]!r}")
    (tag, v), = x.items()
    try:
        if tag == "i" and type(v) is str and len(v) <= MAX_INT_HEX and _HEX.match(v):
            return int(v, 16)
        if tag == "f" and type(v) is str and len(v) < 40:
            return float(v)
        if tag == "c" and type(v) is list and len(v) == 2 and all(type(e) is str for e in v):
            return complex(float(v[0]), float(v[1]))
        if tag == "b" and type(v) is str:
            return bytes.fromhex(v)
        if tag in ("l", "t", "s", "z") and type(v) is list:
            items = [decode(e, depth + 1) for e in v]
            return {"l": list, "t": tuple, "s": set, "z": frozenset}[tag](items)
        if tag == "d" and type(v) is list:
            out = {}
            for pair in v:
                if type(pair) is not list or len(pair) != 2:
                    raise NotPlain("malformed dict item")
                out[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
            return out
    except (TypeError, ValueError, OverflowError) as e:  # unhashable key, bad float text
        raise NotPlain(f"malformed {tag!r} value: {e}") from None
    raise NotPlain(f"malformed {tag!r} value")


def parse_value(text: str) -> Any:
    """A returned value from its JSON text."""
    if len(text) > MAX_CHARS:
        raise NotPlain(f"returned value longer than {MAX_CHARS} characters")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise NotPlain(f"unreadable value: {str(e)[:80]}") from None
    return decode(raw)


def encode_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return json.dumps(encode((tuple(args), dict(kwargs))))


# ------------------------------------------------------------------------------ trusted runs


class _Unsplittable(BaseException):
    """The tests use the candidate in a way the split path cannot replay."""


class Diverged(BaseException):
    """A replayed test made a call that the recording did not (or not in that order)."""


class NotReached(BaseException):
    """The solution never returned a value for this call (killed, timed out, crashed)."""


class CandidateFailed(BaseException):
    """The solution's call raised, timed out or returned a non-plain value."""


def _private_random(seed: str) -> types.ModuleType:
    """A ``random`` module whose functions draw from one seeded generator of its own."""
    rng = random.Random(seed)
    mod = types.ModuleType("random")
    for name in dir(random):
        if name.startswith("_"):
            continue
        attr = getattr(random, name)
        bound = getattr(rng, name, None)
        mod.__dict__[name] = bound if callable(attr) and not isinstance(attr, type) \
            and bound is not None else attr
    return mod


def _namespace(problem: Any, seed: str) -> dict[str, Any]:
    """The prompt's definitions (the tests' helpers), with a private ``random``."""
    private = _private_random(seed)
    real_import = builtins.__import__

    def importer(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (),
                 level: int = 0) -> Any:
        if name == "random" and level == 0:
            return private
        return real_import(name, globals, locals, fromlist, level)

    g: dict[str, Any] = {"__name__": "rlmix_check",
                         "__builtins__": {**builtins.__dict__, "__import__": importer}}
    exec(compile(problem.prompt, "prompt.py", "exec"), g)
    return g


class _Recorder:
    def __init__(self, fn: Any) -> None:
        self.fn, self.calls, self.values = fn, [], []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            self.calls.append(encode_call(args, kwargs))
        except NotPlain as e:
            raise _Unsplittable(f"an argument is not a plain value ({e})") from None
        value = self.fn(*args, **kwargs)
        try:
            self.values.append(("ok", encode(value)))
        except NotPlain as e:
            raise _Unsplittable(f"the canonical solution returns a non-plain value ({e})") \
                from None
        return value

    def __getattr__(self, name: str) -> Any:
        raise _Unsplittable(f"the test reads candidate.{name}")


class _Replayer:
    def __init__(self, calls: tuple[str, ...], values: list[tuple[str, Any] | None]) -> None:
        self.calls, self.values, self.n = calls, values, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        k = self.n
        self.n += 1
        try:
            call = encode_call(args, kwargs)
        except NotPlain as e:
            raise Diverged(f"call {k}: an argument is not a plain value ({e})") from None
        if k >= len(self.calls) or call != self.calls[k]:
            raise Diverged(f"call {k} differs from the recorded one")
        got = self.values[k]
        if got is None:
            raise NotReached(f"call {k}: the solution returned no value")
        kind, payload = got
        if kind == "err":
            raise CandidateFailed(f"call {k}: {payload}")
        return decode(payload)  # a fresh object per call: the test may mutate it

    def __getattr__(self, name: str) -> Any:
        raise Diverged(f"the test reads candidate.{name}")


def _seed(problem: Any, k: int) -> str:
    return f"rlmix-code-{problem.task_id}-{k}"


def _record(problem: Any, tests: list[str]) -> tuple[list[tuple[str, ...]], list[Any]]:
    """Each test's calls (encoded arguments) and the canonical solution's values for them."""
    solution_ns = _namespace(problem, "unused")
    exec(compile(problem.prompt + problem.canonical_solution + "\n", "canonical.py", "exec"),
         solution_ns)
    canonical = solution_ns[problem.entry_point]
    out, values = [], []
    for k, test in enumerate(tests):
        g = _namespace(problem, _seed(problem, k))
        recorder = _Recorder(canonical)
        g[problem.entry_point] = recorder
        exec(compile(test, f"test_{k}.py", "exec"), g)
        out.append(tuple(recorder.calls))
        values += recorder.values
    return out, values


@dataclass(frozen=True)
class Plan:
    """How one problem is verified."""

    path: str  # "split" or "nonce"
    why: str  # why the nonce path ("" on the split path)
    tests: tuple[str, ...]  # the test programs (each run on its own)
    calls: tuple[str, ...] = ()  # split path: every call's encoded arguments, tests in order
    spans: tuple[tuple[int, int], ...] = ()  # test k's calls are calls[a:b]


@lru_cache(maxsize=4096)
def plan(problem: Any, split_tests: Any, full_test: Any) -> Plan:
    """The verification plan of ``problem`` (cached: the recording runs once per problem).
    ``split_tests(problem)`` gives its tests; ``full_test(problem)`` its whole test program."""
    tests = list(split_tests(problem))

    def nonce(why: str) -> Plan:
        return Plan("nonce", why, tuple(tests) or (full_test(problem),))

    if not problem.canonical_solution.strip():
        return nonce("no canonical solution to record the calls with")
    try:
        first, values = _record(problem, tests)
        second, _ = _record(problem, tests)
    except _Unsplittable as e:
        return nonce(str(e))
    except Exception as e:  # noqa: BLE001  (the canonical solution failing its own tests)
        return nonce(f"the canonical solution fails while recording: {type(e).__name__}: {e}")
    if first != second:
        return nonce("the tests make different calls on two recordings")
    if not any(first):
        return nonce("the tests never call the candidate")
    calls, spans, at = [], [], 0
    for rec in first:
        calls += rec
        spans.append((at, at + len(rec)))
        at += len(rec)
    the_plan = Plan("split", "", tuple(tests), tuple(calls), tuple(spans))
    # the split path must give the canonical solution's own values a pass: a test that depends
    # on anything else (an argument the solution mutates, object identity) cannot be split
    failed = [why for ok, why in replay(problem, the_plan, values) if not ok]
    if failed:
        return nonce(f"the tests fail on the canonical solution's returned values: {failed[0]}")
    return the_plan


def replay(problem: Any, the_plan: Plan, values: list[tuple[str, Any] | None]
           ) -> list[tuple[bool, str]]:
    """Run each test here on the values the solution returned: ``(passed, reason)`` per test."""
    out = []
    for k, (test, (a, b)) in enumerate(zip(the_plan.tests, the_plan.spans, strict=True)):
        replayer = _Replayer(the_plan.calls[a:b], values[a:b])
        try:
            g = _namespace(problem, _seed(problem, k))
            g[problem.entry_point] = replayer
            exec(compile(test, f"test_{k}.py", "exec"), g)
            if replayer.n != b - a:
                raise Diverged(f"the test made {replayer.n} of its {b - a} recorded calls")
            out.append((True, ""))
        except (Diverged, NotReached, CandidateFailed, NotPlain) as e:
            out.append((False, str(e)[:300]))
        except AssertionError as e:
            out.append((False, f"AssertionError: {str(e)[:200]}".rstrip(": ")))
        except Exception as e:  # noqa: BLE001  (a test's own error on the returned values)
            out.append((False, f"{type(e).__name__}: {str(e)[:200]}"))
    return out
