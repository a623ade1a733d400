"""SOLID: rewards without verified answers, from the executed artifacts of a group's rollouts.

Each rollout's artifact (an arithmetic expression, evaluated by a small AST evaluator; or a
Python program, run in ``rlmix_sandbox``, whose last printed line is its value) is executed. The
group's values are clustered within a tolerance; the strictly largest cluster (at least
``min_votes`` members) is the majority, and its first member is the group's pseudo-reference.

* ``rlmix_score``: the term ``membership`` (1 for members of the majority cluster, else 0).
* ``rlmix_clip`` wrapper: with ``nll_coef > 0``, ``nll_coef * NLL`` of each group's
  pseudo-reference row is added to the owner's per-token loss: dense self-supervision on the
  artifact the group agreed on.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.types import LossTerms, Minibatch, RolloutBatch, Run

NAME = "solid"
EXECUTORS = ("expression", "python")
REFERENCE_KEY = "solid.reference"
MAX_MAGNITUDE = 1e15  # an intermediate or final value beyond this is not a value
MAX_EXPONENT = 64


@dataclass
class Settings:
    executor: str = "expression"  # expression (AST evaluator) | python (rlmix_sandbox)
    artifact_regex: str = ""  # group 1 is the artifact; "" = the executor's default (README)
    atol: float = 1e-6  # two values agree when |a - b| <= atol + rtol * max(|a|, |b|)
    rtol: float = 1e-6
    min_votes: int = 2  # the majority cluster needs at least this many members
    nll_coef: float = 0.0  # lambda: weight of the pseudo-reference's NLL in the loss
    max_artifact_chars: int = 400  # longer artifacts are not executed
    timeout_s: float = 2.0  # python: per program
    memory_mb: int = 256  # python: per program

    def __post_init__(self) -> None:
        rlmix.check_choices(self, executor=EXECUTORS)
        if self.atol < 0 or self.rtol < 0 or self.nll_coef < 0:
            raise ValueError("atol, rtol and nll_coef must be >= 0")
        if self.min_votes < 1 or self.max_artifact_chars < 1:
            raise ValueError("min_votes and max_artifact_chars must be >= 1")
        if self.timeout_s <= 0 or self.memory_mb < 32:
            raise ValueError("timeout_s must be > 0 and memory_mb >= 32")
        if self.artifact_regex:
            try:
                compiled = re.compile(self.artifact_regex)
            except re.error as exc:
                raise ValueError(f"artifact_regex: {exc}") from None
            if compiled.groups < 1:
                raise ValueError("artifact_regex: needs a capturing group (the artifact)")


# ---------------------------------------------------------------- artifacts and their values

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def safe_eval(expression: str, max_chars: int = 400) -> float | None:
    """The value of an arithmetic expression (numbers, ``+ - * / // % **``, unary signs,
    parentheses), or ``None`` for anything else: names, calls, attributes, strings, booleans,
    a division by zero, an exponent above 64 in size, any value beyond 1e15, a non-finite result.
    Nothing is ever executed: the text is parsed and walked, so the policy's text cannot run."""
    if len(expression) > max_chars or not expression.strip():
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise ValueError("not a number")
            return check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return check(_UNARY[type(node.op)](walk(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or
                                                 (left == 0 and right < 0)):
                raise ValueError("exponent out of range")
            return check(_BINARY[type(node.op)](left, right))
        raise ValueError(f"{type(node).__name__} is not arithmetic")

    def check(value: Any) -> float:
        if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("out of range")
        return value

    try:
        return float(walk(tree))
    except (ValueError, ZeroDivisionError, OverflowError, TypeError, RecursionError):
        return None


def extract_artifact(text: str, executor: str = "expression", regex: str = "") -> str:
    """The artifact of a completion. With ``regex``: its first match's group 1 ("" when none).
    Defaults: ``expression``: the last non-empty line, cut at its first ``=`` (so "3+4 = 7"
    is the expression "3+4": the claimed result is not trusted, the expression is evaluated);
    ``python``: the first fenced code block, else the whole text."""
    if regex:
        match = re.search(regex, text, re.DOTALL)
        return match.group(1) if match else ""
    if executor == "python":
        match = re.search(r"```(?:python|py)?\s*\n(.*?)```", text, re.DOTALL)
        return match.group(1) if match else text
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].split("=", 1)[0].strip() if lines else ""


def program_values(programs: Sequence[str], timeout_s: float = 2.0,
                   memory_mb: int = 256) -> list[float | None]:
    """Run each program in ``rlmix_sandbox``; its value is the last line it printed, read as a
    number (``None`` when it failed, timed out or printed no number)."""
    from rlmix_sandbox import run_many

    results = run_many(list(programs), timeout_s=timeout_s, memory_mb=memory_mb)
    out: list[float | None] = []
    for res in results:
        lines = [line for line in res.stdout.splitlines() if line.strip()]
        value = None
        if res.status == "ok" and lines:
            try:
                value = float(lines[-1].strip())
            except ValueError:
                value = None
            if value is not None and (not math.isfinite(value) or abs(value) > MAX_MAGNITUDE):
                value = None
        out.append(value)
    return out


# ---------------------------------------------------------------- clustering


def agree(a: float, b: float, atol: float = 1e-6, rtol: float = 1e-6) -> bool:
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


def cluster(values: Sequence[float | None], atol: float = 1e-6,
            rtol: float = 1e-6) -> list[int]:
    """A cluster id per value (``-1`` for ``None``). A value joins the first cluster whose
    founding value it agrees with, else founds a new one; ids number clusters by their first
    member."""
    anchors: list[float] = []
    ids = []
    for v in values:
        if v is None:
            ids.append(-1)
            continue
        for k, anchor in enumerate(anchors):
            if agree(v, anchor, atol, rtol):
                ids.append(k)
                break
        else:
            anchors.append(v)
            ids.append(len(anchors) - 1)
    return ids


def majority(ids: Sequence[int], min_votes: int = 2) -> int | None:
    """The strictly largest cluster with at least ``min_votes`` members, or ``None`` (a tie is
    no majority)."""
    counts: dict[int, int] = {}
    for k in ids:
        if k >= 0:
            counts[k] = counts.get(k, 0) + 1
    if not counts:
        return None
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    best, size = ranked[0]
    if size < min_votes or (len(ranked) > 1 and ranked[1][1] == size):
        return None
    return best


def pseudo_reference(values: Sequence[float | None], group: torch.Tensor, atol: float = 1e-6,
                     rtol: float = 1e-6, min_votes: int = 2
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(membership, reference)``, both ``[N]`` float: membership 1 for samples in their
    group's majority cluster; reference 1 on the first such sample of each group (the
    pseudo-reference). Groups without a majority get 0 everywhere."""
    n = len(values)
    member, reference = torch.zeros(n), torch.zeros(n)
    for g in group.unique().tolist():
        rows = (group == g).nonzero().flatten().tolist()
        ids = cluster([values[i] for i in rows], atol, rtol)
        best = majority(ids, min_votes)
        if best is None:
            continue
        members = [i for i, k in zip(rows, ids) if k == best]
        member[members] = 1.0
        reference[members[0]] = 1.0
    return member, reference


def reference_nll(logp: torch.Tensor, mask: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per-token NLL ``-logp`` on the pseudo-reference rows (0 elsewhere), ``[n, T]``."""
    return -logp * mask * reference.to(logp.dtype)[:, None]


# ---------------------------------------------------------------- hooks


def artifact_values(texts: Sequence[str], s: Settings) -> list[float | None]:
    artifacts = [extract_artifact(t, s.executor, s.artifact_regex) for t in texts]
    if s.executor == "expression":
        return [safe_eval(a, s.max_artifact_chars) for a in artifacts]
    runnable = [i for i, a in enumerate(artifacts) if a.strip() and
                len(a) <= s.max_artifact_chars]
    values: list[float | None] = [None] * len(artifacts)
    for i, v in zip(runnable, program_values([artifacts[i] for i in runnable], s.timeout_s,
                                             s.memory_mb)):
        values[i] = v
    return values


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    s: Settings = run.settings(NAME)
    t0 = time.perf_counter()
    values = artifact_values(batch.texts, s)
    run.log(f"{NAME}/executions", float(len(values)))
    run.log(f"{NAME}/execute_s", time.perf_counter() - t0)
    member, reference = pseudo_reference(values, batch.group, s.atol, s.rtol, s.min_votes)
    batch.extras[REFERENCE_KEY] = reference
    groups = max(1, len(batch.group.unique()))
    run.log(f"{NAME}/groups_with_majority", float(reference.sum()) / groups)
    run.log(f"{NAME}/unexecutable", float(sum(v is None for v in values)) / max(1, len(values)))
    for info, v, m in zip(batch.info, values, member.tolist()):
        info[NAME] = {"value": v, "member": bool(m)}
    return {"membership": member}


@rlmix.hookimpl(wrapper=True)
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor,
               entropy: torch.Tensor) -> Generator[None, LossTerms | None, LossTerms | None]:
    terms = yield
    s: Settings = run.settings(NAME)
    reference = mb.batch.extras.get(REFERENCE_KEY)
    if terms is None or s.nll_coef == 0 or reference is None:
        return terms
    mask = mb.batch.completion_mask.to(logp.device, logp.dtype)
    nll = reference_nll(logp, mask, reference.to(logp.device))
    terms.loss = terms.loss + s.nll_coef * nll
    rows = float(reference.sum())
    terms.metrics[f"{NAME}/reference_nll"] = (float(nll.detach().sum()) /
                                              max(1.0, float((mask * reference[:, None]).sum()))
                                              if rows else 0.0)
    return terms
