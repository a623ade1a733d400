"""Generated arithmetic tasks: chat prompts, reward terms ``correct`` and ``format``, and greedy
held-out accuracy as ``eval/accuracy``."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

import rlmix
from rlmix.types import Prompt, RolloutBatch, Run

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_INT = re.compile(r"-?\d+")
_ONLY_NUMBER = re.compile(r"^\s*-?\d+\s*\.?\s*$")


@dataclass
class Settings:
    digits: int = 2  # operands have exactly this many digits
    operators: str = "+"  # any of + - *
    eval_size: int = 100
    eval_seed: int = 1234
    eval_max_new_tokens: int = 24
    instructions: str = "Reply with only the final number."

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise ValueError(f"digits must be 1..9, got {self.digits}")
        bad = set(self.operators) - set(OPERATORS)
        if not self.operators or bad:
            raise ValueError(f"operators must be made of {' '.join(OPERATORS)}, got "
                             f"{self.operators!r}")
        if self.eval_size < 0:
            raise ValueError("eval_size must be >= 0")


def make_problem(rng: random.Random, digits: int, operators: str) -> tuple[int, str, int]:
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    op = rng.choice(operators)
    return a, op, b


def problem_space(digits: int, operators: str) -> int:
    """How many distinct problems ``make_problem`` can draw."""
    return (10**digits - (0 if digits == 1 else 10 ** (digits - 1))) ** 2 * len(set(operators))


def problem_set(seed: int, size: int, digits: int, operators: str) -> list[tuple[int, str, int]]:
    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    out = []
    space = problem_space(digits, operators)
    while len(out) < min(size, space):
        p = make_problem(rng, digits, operators)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def parse_answer(text: str) -> int | None:
    """The last integer in a completion (what a reader takes as the final answer)."""
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def correct_reward(texts: list[str], answers: list[int]) -> torch.Tensor:
    return torch.tensor([float(parse_answer(t) == a) for t, a in zip(texts, answers)])


def format_reward(texts: list[str]) -> torch.Tensor:
    """1 when the completion is only a number (the instruction asks for that)."""
    return torch.tensor([float(bool(_ONLY_NUMBER.match(t))) for t in texts])


def to_prompt(run: Run, problem: tuple[int, str, int], instructions: str, pid: str) -> Prompt:
    a, op, b = problem
    user = f"What is {a}{op}{b}?"
    instr = run.harness.get("instructions", instructions)
    if instr:
        user = f"{user} {instr}"
    messages = []
    if run.harness.get("system"):
        messages.append({"role": "system", "content": run.harness["system"]})
    messages.append({"role": "user", "content": user})
    return Prompt(messages=messages, answer=OPERATORS[op](a, b), id=pid)


def _eval_set(run: Run) -> list[tuple[int, str, int]]:
    s = run.settings("arith")
    key = "arith"
    cache = run.state.setdefault(key, {})
    if "eval" not in cache:
        cache["eval"] = problem_set(s.eval_seed, s.eval_size, s.digits, s.operators)
    return cache["eval"]


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    _eval_set(run)


@rlmix.hookimpl
def rlmix_prompts(run: Run, step: int) -> list[Prompt]:
    s = run.settings("arith")
    held_out = set(_eval_set(run))
    # held-out problems are never trained on, unless they are the whole problem space
    avoid = len(held_out) < problem_space(s.digits, s.operators)
    # one stream per step: a resumed run sees exactly the prompts it would have seen
    rng = random.Random(f"arith-{run.config.train.seed}-{step}")
    prompts = []
    while len(prompts) < int(run.config.train.prompts_per_step):
        p = make_problem(rng, s.digits, s.operators)
        if avoid and p in held_out:
            continue
        prompts.append(to_prompt(run, p, s.instructions, f"train-{step}-{len(prompts)}"))
    return prompts


# the terms rlmix_score returns: score.weights naming another fails before the model loads
RLMIX_SCORE_TERMS = ("correct", "format")


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    answers = [p.answer for p in batch.prompts]
    correct = correct_reward(batch.texts, answers)
    for info, text, answer in zip(batch.info, batch.texts, answers):
        info["arith"] = {"answer": answer, "parsed": parse_answer(text)}
    return {"correct": correct, "format": format_reward(batch.texts)}


@rlmix.hookimpl
def rlmix_evaluate(run: Run) -> dict[str, float]:
    s = run.settings("arith")
    problems = _eval_set(run)
    if not problems:
        return {}
    prompts = [to_prompt(run, p, s.instructions, f"eval-{i}") for i, p in enumerate(problems)]
    batch = run.generate(prompts, temperature=0.0, max_new_tokens=s.eval_max_new_tokens)
    answers = [p.answer for p in prompts]
    return {"accuracy": float(correct_reward(batch.texts, answers).mean()),
            "format": float(format_reward(batch.texts).mean())}
