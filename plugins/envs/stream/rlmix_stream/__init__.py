"""A task stream whose distribution shifts with the step, on a schedule from the manifest.

Each phase of ``stream.schedule`` names a task kind (``add``, ``sub``, ``word``) or a mix of
kinds (``add+sub``: each prompt draws one of them) and how many steps it lasts. After the last
phase the stream stays in it (``after: stay``) or starts the schedule again (``after: cycle``).
Prompts are built from ``run.harness`` (``system`` as a system message, ``instructions``
appended to the question) and are deterministic in ``train.seed`` and ``step``. Reward terms
``correct`` and ``format``; per-sample feedback in ``batch.info[i]["stream"]`` (kind, expected
and parsed answer). ``rlmix_evaluate`` reports greedy accuracy per kind on a fixed held-out set
that covers every kind of the schedule.

The kind is in ``Prompt.info["kind"]`` for reporting only: a router that picks a harness at
solve time must read the prompt text, never this label.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from rlmix_arith import correct_reward, format_reward, parse_answer

import rlmix
from rlmix.manifest import check_choices
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "stream"
KINDS = ("add", "sub", "word")


@dataclass
class Phase:
    kind: str = "add"  # add | sub | word, or a mix such as add+sub
    steps: int = 10


def _default_schedule() -> list[Phase]:
    return [Phase("add", 10), Phase("sub", 10), Phase("word", 10)]


@dataclass
class Settings:
    schedule: list[Phase] = field(default_factory=_default_schedule)
    after: str = "stay"  # after the last phase: stay in it | cycle through the schedule again
    digits: int = 2  # add / sub operands have exactly this many digits
    word_max: int = 20  # numbers in word problems are 2..word_max
    eval_size: int = 30  # held-out tasks, kinds in turn; 0 = no evaluation
    eval_seed: int = 1234
    eval_max_new_tokens: int = 24
    eval_step_base: int = 900_000  # rlmix_prompts(run, eval_step_base + k) are the eval tasks
    reserved_step_base: int = 1_000_000  # steps from here (harness plugins' task pools) mix
    # every kind of the schedule uniformly
    instructions: str = "Reply with only the final number."  # used when the harness has none

    def __post_init__(self) -> None:
        check_choices(self, after=("stay", "cycle"))
        if not self.schedule:
            raise ValueError("schedule: needs at least one phase, e.g. [{kind: add, steps: 10}]")
        for k, phase in enumerate(self.schedule):
            parts = phase_kinds(phase.kind)
            bad = [p for p in parts if p not in KINDS]
            if not parts or bad:
                raise ValueError(f"schedule: phase {k} has kind {phase.kind!r}; use one of "
                                 f"{', '.join(KINDS)} or a mix joined by '+' (add+sub)")
            if phase.steps < 1:
                raise ValueError(f"schedule: phase {k} ({phase.kind}) must last >= 1 step, got "
                                 f"{phase.steps}")
        if not 1 <= self.digits <= 6:
            raise ValueError(f"digits: must be 1..6, got {self.digits}")
        if self.word_max < 3:
            raise ValueError(f"word_max: must be >= 3, got {self.word_max}")
        if self.eval_size < 0 or self.eval_max_new_tokens < 1:
            raise ValueError("eval_size: eval_size must be >= 0 and eval_max_new_tokens >= 1")
        if not 0 < self.eval_step_base < self.reserved_step_base:
            raise ValueError("eval_step_base: must be > 0 and below reserved_step_base")


def phase_kinds(kind: str) -> list[str]:
    """``"add+sub"`` -> ``["add", "sub"]``."""
    return [p.strip() for p in str(kind).split("+") if p.strip()]


def schedule_kinds(schedule: Sequence[Phase]) -> list[str]:
    """Every kind of the schedule, in order of first appearance."""
    out: list[str] = []
    for phase in schedule:
        out += [k for k in phase_kinds(phase.kind) if k not in out]
    return out


def phase_index(schedule: Sequence[Phase], step: int, after: str = "stay") -> int:
    """The phase that training step ``step`` falls in."""
    total = sum(p.steps for p in schedule)
    if step >= total:
        step = step % total if after == "cycle" else total - 1
    for k, phase in enumerate(schedule):
        if step < phase.steps:
            return k
        step -= phase.steps
    return len(schedule) - 1  # pragma: no cover


def kinds_at(s: Settings, step: int) -> list[str]:
    """The kinds prompts of ``step`` draw from: the phase's, or every kind on reserved steps."""
    if step >= s.reserved_step_base:
        return schedule_kinds(s.schedule)
    return phase_kinds(s.schedule[phase_index(s.schedule, step, s.after)].kind)


# ---------------------------------------------------------------- tasks (pure)

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo")
ITEMS = ("apples", "books", "coins", "marbles", "pens", "stickers", "cards", "shells")


def make_task(rng: random.Random, kind: str, digits: int, word_max: int) -> tuple[str, int]:
    """One task of ``kind``: ``(question, answer)``, with an integer answer >= 0."""
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    if kind == "add":
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return f"What is {a}+{b}?", a + b
    if kind == "sub":
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        a, b = max(a, b), min(a, b)
        return f"What is {a}-{b}?", a - b
    if kind != "word":
        raise ValueError(f"unknown task kind {kind!r}; kinds: {', '.join(KINDS)}")
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    form = rng.randrange(4)
    a, b = rng.randint(2, word_max), rng.randint(2, word_max)
    if form == 0:
        return (f"{name} has {a} {item} and finds {b} more. How many {item} does {name} have "
                f"now?", a + b)
    if form == 1:
        a, b = max(a, b), min(a, b)
        return (f"{name} has {a} {item} and gives {b} of them away. How many {item} does "
                f"{name} have left?", a - b)
    if form == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return (f"{name} fills {a} bags with {b} {item} each. How many {item} is that in all?",
                a * b)
    return (f"There are {a} {item} on a table and {b} {item} on a shelf. How many {item} are "
            f"there together?", a + b)


def task_at(s: Settings, seed: Any, step: int, i: int) -> tuple[str, str, int]:
    """``(kind, question, answer)`` of prompt ``i`` of ``step`` (no held-out check)."""
    rng = random.Random(f"stream-{seed}-{step}-{i}")
    kind = rng.choice(kinds_at(s, step))
    question, answer = make_task(rng, kind, s.digits, s.word_max)
    return kind, question, answer


def eval_tasks(s: Settings) -> list[tuple[str, str, int]]:
    """The held-out set: ``eval_size`` distinct tasks, the schedule's kinds in turn."""
    kinds = schedule_kinds(s.schedule)
    rng = random.Random(f"stream-eval-{s.eval_seed}")
    out: list[tuple[str, str, int]] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < s.eval_size and tries < 100 * max(1, s.eval_size):
        tries += 1
        kind = kinds[len(out) % len(kinds)]
        question, answer = make_task(rng, kind, s.digits, s.word_max)
        if question not in seen:
            seen.add(question)
            out.append((kind, question, answer))
    return out


def accuracy_by_kind(kinds: Sequence[str], correct: Sequence[float]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for k, c in zip(kinds, correct):
        sums.setdefault(k, []).append(float(c))
    return {k: sum(v) / len(v) for k, v in sums.items()}


# ---------------------------------------------------------------- prompts


def to_prompt(run: Run, kind: str, question: str, answer: int, pid: str,
              info: dict[str, Any] | None = None) -> Prompt:
    s = run.settings(NAME)
    user = question
    instr = run.harness.get("instructions", s.instructions)
    if instr:
        user = f"{user} {instr}"
    messages = []
    if run.harness.get("system"):
        messages.append({"role": "system", "content": run.harness["system"]})
    messages.append({"role": "user", "content": user})
    return Prompt(messages=messages, answer=answer, id=pid, info={"kind": kind, **(info or {})})


def _held_out(run: Run) -> tuple[list[tuple[str, str, int]], set[str]]:
    cached = run.plugin_resources(NAME).get("eval")
    if cached is None:
        tasks = eval_tasks(run.settings(NAME))
        cached = run.plugin_resources(NAME)["eval"] = (tasks, {q for _, q, _ in tasks})
    return cached


def prompts_at(run: Run, step: int) -> list[Prompt]:
    """The env's prompts of ``step`` under ``run.harness`` (what ``rlmix_prompts`` returns)."""
    s = run.settings(NAME)
    per_step = int(run.config.train.prompts_per_step)
    tasks, questions = _held_out(run)
    if s.eval_step_base <= step < s.reserved_step_base:
        out = []
        for i in range(per_step):
            k = (step - s.eval_step_base) * per_step + i
            if k < len(tasks):
                kind, question, answer = tasks[k]
                out.append(to_prompt(run, kind, question, answer, f"stream-eval-{k}",
                                     {"step": step, "index": i, "eval": True}))
        return out
    seed = run.config.train.seed
    out = []
    for i in range(per_step):
        kind, question, answer = task_at(s, seed, step, i)
        retry = 0
        while question in questions and retry < 50:  # held-out tasks are never trained on
            retry += 1
            kind, question, answer = task_at(s, f"{seed}-r{retry}", step, i)
        out.append(to_prompt(run, kind, question, answer, f"stream-{step}-{i}",
                             {"step": step, "index": i}))
    return out


# ---------------------------------------------------------------- hooks


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    _held_out(run)
    run.state.setdefault(NAME, {"scored_step": -1})


@rlmix.hookimpl
def rlmix_prompts(run: Run, step: int) -> list[Prompt]:
    return prompts_at(run, step)


# the terms rlmix_score returns: score.weights naming another fails before the model loads
RLMIX_SCORE_TERMS = ("correct", "format")


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    answers = [p.answer for p in batch.prompts]
    correct = correct_reward(batch.texts, answers)
    kinds = [p.info.get("kind", "?") for p in batch.prompts]
    for info, text, answer, kind in zip(batch.info, batch.texts, answers, kinds):
        info[NAME] = {"kind": kind, "answer": answer, "parsed": parse_answer(text)}
    # the step's accuracy per kind: from the first batch of this step's own tasks scored in
    # the step (the training batch; harness plugins score the same tasks again later)
    state = run.state.setdefault(NAME, {"scored_step": -1})
    own = all(p.info.get("step") == run.step and not p.info.get("eval") for p in batch.prompts)
    if batch.prompts and own and state["scored_step"] != run.step:
        state["scored_step"] = run.step
        run.log(f"{NAME}/accuracy", float(correct.mean()))  # written with the step's metrics
        for kind, acc in sorted(accuracy_by_kind(kinds, correct).items()):
            run.log(f"{NAME}/accuracy/{kind}", acc)
    return {"correct": correct, "format": format_reward(batch.texts)}


@rlmix.hookimpl
def rlmix_evaluate(run: Run) -> dict[str, float]:
    s = run.settings(NAME)
    tasks, _ = _held_out(run)
    if not tasks:
        return {}
    per_step = max(1, int(run.config.train.prompts_per_step))
    prompts: list[Prompt] = []
    # through the hook, so harness plugins that wrap rlmix_prompts (routing) apply to eval too
    for j in range(math.ceil(len(tasks) / per_step)):
        got = run.hook.rlmix_prompts(run=run, step=s.eval_step_base + j) or []
        prompts += [p for p in got if p.info.get("eval")]
    if len(prompts) != len(tasks):  # another env owns rlmix_prompts: build them here
        prompts = [to_prompt(run, k, q, a, f"stream-eval-{i}", {"eval": True})
                   for i, (k, q, a) in enumerate(tasks)]
    batch = run.generate(prompts, temperature=0.0, max_new_tokens=s.eval_max_new_tokens)
    correct = correct_reward(batch.texts, [p.answer for p in prompts])
    by_kind = accuracy_by_kind([p.info["kind"] for p in prompts], correct)
    return {"accuracy": float(correct.mean()), "format": float(format_reward(batch.texts).mean()),
            **{f"accuracy/{k}": v for k, v in sorted(by_kind.items())}}


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    s = run.settings(NAME)
    step = run.step - 1  # the step whose tasks were just solved
    metrics[f"{NAME}/phase"] = phase_index(s.schedule, step, s.after)
