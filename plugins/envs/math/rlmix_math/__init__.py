"""Math word problems with answers checked by ``math-verify``: chat prompts asking for a
``\\boxed{}`` final answer, reward terms ``correct`` and ``format``, and greedy held-out accuracy
as ``eval/accuracy``.

Problems come from the user's JSONL / parquet file (``math.data_files``, read through
``datasets``) or, with no file, from a seeded generator of templated word problems.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.types import Prompt, RolloutBatch, Run
from rlmix_math.problems import (
    Problem,
    generated_problems,
    read_rows,
    rows_to_problems,
    split,
)
from rlmix_math.verify import Verdict, has_boxed_answer, last_boxed, verify_answer

__all__ = ["Problem", "Settings", "Verdict", "correct_reward", "format_reward",
           "generated_problems", "has_boxed_answer", "last_boxed", "problem_pools",
           "to_prompt", "verify_answer"]

NAME = "math"


@dataclass
class Settings:
    data_files: str = ""  # JSONL / JSON / parquet path(s), comma-separated; "" = generated set
    data_format: str = "auto"  # auto (from the extension) | json | parquet
    loader: str = "datasets"  # datasets (datasets.load_dataset) | builtin (json / pyarrow)
    cache_dir: str = ""  # datasets' cache folder; "" = its default
    question_field: str = "question"
    answer_field: str = "answer"
    answer_marker: str = "####"  # keep the text after the last marker of an answer (GSM8K)
    generated_size: int = 2000  # generated problems (train + held-out) when there is no file
    seed: int = 0  # generator and train/held-out split
    eval_size: int = 100  # held-out problems; 0 = no evaluation
    eval_max_new_tokens: int = 256
    eval_batch_size: int = 32  # held-out prompts per generation call
    timeout_s: float = 2.0  # wall-clock limit of one answer check (0 = none)
    max_chars: int = 2000  # longest text handed to the verifier
    require_boxed: bool = False  # True: no \boxed{} answer scores correct = 0
    instructions: str = "Solve the problem. Put the final answer in \\boxed{}."

    def __post_init__(self) -> None:
        rlmix.check_choices(self, data_format=("auto", "json", "parquet"),
                            loader=("datasets", "builtin"))
        if self.eval_size < 0:
            raise ValueError("eval_size must be >= 0")
        if self.generated_size < 2:
            raise ValueError("generated_size must be >= 2")
        if self.timeout_s < 0:
            raise ValueError("timeout_s must be >= 0 (0 = no limit)")
        for name in ("max_chars", "eval_max_new_tokens", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.question_field or not self.answer_field:
            raise ValueError("question_field and answer_field must be non-empty")


def problem_pools(settings: Settings) -> tuple[list[Problem], list[Problem]]:
    """``(train, held_out)`` for these settings: the user's file or the generated set, split by
    a seeded permutation (deterministic, disjoint by question)."""
    if settings.data_files:
        rows = read_rows(settings.data_files, settings.data_format, settings.loader,
                         settings.cache_dir or None)
        problems = rows_to_problems(rows, settings.question_field, settings.answer_field,
                                    settings.answer_marker)
        if not problems:
            raise rlmix.ConfigError(f"math.data_files: no row of {settings.data_files} has both "
                                    f"a {settings.question_field!r} and an "
                                    f"{settings.answer_field!r}")
    else:
        problems = generated_problems(settings.seed, settings.generated_size)
    return split(problems, settings.eval_size, settings.seed)


def _pools(run: Run) -> dict[str, list[Problem]]:
    pools = run.resources.get(NAME)
    if pools is None:  # rebuilt from the settings, so nothing needs checkpointing
        train, held_out = problem_pools(run.settings(NAME))
        pools = run.resources[NAME] = {"train": train, "eval": held_out}
    return pools


def to_prompt(run: Run, problem: Problem, instructions: str, pid: str) -> Prompt:
    """A chat asking for ``problem``, built from the harness (``system``, ``instructions``)."""
    instr = run.harness.get("instructions", instructions)
    user = f"{problem.question}\n\n{instr}" if instr else problem.question
    messages = []
    if run.harness.get("system"):
        messages.append({"role": "system", "content": run.harness["system"]})
    messages.append({"role": "user", "content": user})
    return Prompt(messages=messages, answer=problem.answer, id=pid)


def check(texts: list[str], answers: list[str], settings: Settings) -> list[Verdict]:
    """One verdict per completion; identical (text, answer) pairs are checked once."""
    memo: dict[tuple[str, str], Verdict] = {}
    out = []
    for text, answer in zip(texts, answers, strict=True):
        key = (text, str(answer))
        if key not in memo:
            memo[key] = verify_answer(text, str(answer), settings.timeout_s, settings.max_chars,
                                      settings.require_boxed)
        out.append(memo[key])
    return out


def correct_reward(verdicts: list[Verdict]) -> torch.Tensor:
    return torch.tensor([float(v.correct) for v in verdicts])


def format_reward(texts: list[str]) -> torch.Tensor:
    """1 when the completion has a closed, non-empty ``\\boxed{...}``."""
    return torch.tensor([float(has_boxed_answer(t)) for t in texts])


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    pools = _pools(run)
    if not pools["train"]:
        raise rlmix.ConfigError("math: no training problems")


@rlmix.hookimpl
def rlmix_prompts(run: Run, step: int) -> list[Prompt]:
    s = run.settings(NAME)
    train = _pools(run)["train"]
    k = int(run.config.train.prompts_per_step)
    # one stream per step: a resumed run sees exactly the prompts it would have seen
    rng = random.Random(f"math-{run.config.train.seed}-{step}")
    chosen = rng.sample(train, k) if k <= len(train) else rng.choices(train, k=k)
    return [to_prompt(run, p, s.instructions, f"train-{step}-{i}") for i, p in enumerate(chosen)]


# the terms rlmix_score returns: score.weights naming another fails before the model loads
RLMIX_SCORE_TERMS = ("correct", "format")


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    s = run.settings(NAME)
    answers = [str(p.answer) for p in batch.prompts]
    verdicts = check(batch.texts, answers, s)
    for info, verdict, answer in zip(batch.info, verdicts, answers):
        info[NAME] = verdict.as_info(answer)
    return {"correct": correct_reward(verdicts), "format": format_reward(batch.texts)}


@rlmix.hookimpl
def rlmix_evaluate(run: Run) -> dict[str, float]:
    s = run.settings(NAME)
    held_out = _pools(run)["eval"]
    if not held_out:
        return {}
    prompts = [to_prompt(run, p, s.instructions, f"eval-{i}") for i, p in enumerate(held_out)]
    texts: list[str] = []
    for start in range(0, len(prompts), s.eval_batch_size):
        chunk = prompts[start:start + s.eval_batch_size]
        texts += list(run.generate(chunk, temperature=0.0,
                                   max_new_tokens=s.eval_max_new_tokens).texts)
    verdicts = check(texts, [str(p.answer) for p in prompts], s)
    result: dict[str, Any] = {"accuracy": float(correct_reward(verdicts).mean()),
                              "format": float(format_reward(texts).mean())}
    return result
