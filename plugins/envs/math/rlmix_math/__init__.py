"""Math word problems with answers checked by ``math-verify``: chat prompts asking for a
``\\boxed{}`` final answer, reward terms ``correct`` and ``format``, and greedy held-out accuracy
as ``eval/accuracy``.

Problems come from the user's JSONL / parquet file (``math.data_files``, read through
``datasets``), from a seeded generator of templated word problems, or from the generated
curriculum of one- and two-step problems (``math.source: curriculum``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.types import Prompt, RolloutBatch, Run
from rlmix_math.curriculum import EXAMPLE, curriculum_problems
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
    # where problems come from: files (data_files), generated (nine templates), curriculum
    # (one- and two-step word problems); auto = files when data_files is set, else generated
    source: str = "auto"
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
    curriculum_levels: str = "1,2"  # curriculum: which step counts, comma-separated (1, 2)
    curriculum_max: int = 20  # curriculum: the largest operand a template draws
    # curriculum: training steps over which two-step problems phase in (their share of the
    # prompts rises linearly from 0 to their share of the pool); 0 = mixed from the start
    curriculum_ramp: int = 0
    # a worked example (a problem and its boxed answer, as an earlier chat turn) before the
    # task: auto = shown for the curriculum
    worked_example: str = "auto"

    def __post_init__(self) -> None:
        rlmix.check_choices(self, data_format=("auto", "json", "parquet"),
                            loader=("datasets", "builtin"),
                            source=("auto", "files", "generated", "curriculum"),
                            worked_example=("auto", "show", "hide"))
        if self.source == "files" and not self.data_files:
            raise ValueError("source: files needs data_files")
        if not self.levels or any(level not in (1, 2) for level in self.levels):
            raise ValueError(f"curriculum_levels must list 1 and/or 2, got "
                             f"{self.curriculum_levels!r}")
        if self.curriculum_max < 3:
            raise ValueError("curriculum_max must be >= 3")
        if self.curriculum_ramp < 0:
            raise ValueError("curriculum_ramp must be >= 0 (0 = no ramp)")
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

    @property
    def levels(self) -> tuple[int, ...]:
        try:
            return tuple(sorted({int(x) for x in str(self.curriculum_levels).split(",")
                                 if x.strip()}))
        except ValueError:
            return ()

    @property
    def kind(self) -> str:
        """The source in effect: files, generated or curriculum."""
        if self.source != "auto":
            return self.source
        return "files" if self.data_files else "generated"

    @property
    def shows_example(self) -> bool:
        return self.worked_example == "show" or (self.worked_example == "auto"
                                                and self.kind == "curriculum")


def problem_pools(settings: Settings) -> tuple[list[Problem], list[Problem]]:
    """``(train, held_out)`` for these settings: the user's file or the generated set, split by
    a seeded permutation (deterministic, disjoint by question)."""
    if settings.kind == "files":
        rows = read_rows(settings.data_files, settings.data_format, settings.loader,
                         settings.cache_dir or None)
        problems = rows_to_problems(rows, settings.question_field, settings.answer_field,
                                    settings.answer_marker)
        if not problems:
            raise rlmix.ConfigError(f"math.data_files: no row of {settings.data_files} has both "
                                    f"a {settings.question_field!r} and an "
                                    f"{settings.answer_field!r}")
    elif settings.kind == "curriculum":
        problems = curriculum_problems(settings.seed, settings.generated_size, settings.levels,
                                       settings.curriculum_max)
    else:
        problems = generated_problems(settings.seed, settings.generated_size)
    return split(problems, settings.eval_size, settings.seed)


def _pools(run: Run) -> dict[str, list[Problem]]:
    pools = run.resources.get(NAME)
    if pools is None:  # rebuilt from the settings, so nothing needs checkpointing
        train, held_out = problem_pools(run.settings(NAME))
        pools = run.resources[NAME] = {"train": train, "eval": held_out}
    return pools


def to_prompt(run: Run, problem: Problem, instructions: str, pid: str,
              example: bool = False) -> Prompt:
    """A chat asking for ``problem``, built from the harness (``system``, ``instructions``);
    with ``example``, a worked two-step problem and its boxed answer as an earlier turn."""
    instr = run.harness.get("instructions", instructions)

    def ask(question: str) -> str:
        return f"{question}\n\n{instr}" if instr else question

    messages = []
    if run.harness.get("system"):
        messages.append({"role": "system", "content": run.harness["system"]})
    if example:
        messages.append({"role": "user", "content": ask(EXAMPLE[0])})
        messages.append({"role": "assistant", "content": EXAMPLE[1]})
    messages.append({"role": "user", "content": ask(problem.question)})
    info = {"steps": problem.steps} if problem.steps else {}
    return Prompt(messages=messages, answer=problem.answer, id=pid, info=info)


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
    if s.kind == "curriculum" and s.curriculum_ramp > 0:
        chosen = _ramped(rng, train, k, min(1.0, step / s.curriculum_ramp))
    else:
        chosen = rng.sample(train, k) if k <= len(train) else rng.choices(train, k=k)
    return [to_prompt(run, p, s.instructions, f"train-{step}-{i}", s.shows_example)
            for i, p in enumerate(chosen)]


def _ramped(rng: random.Random, train: list[Problem], k: int, progress: float) -> list[Problem]:
    """``k`` problems where two-step ones make up ``progress`` times their share of the pool
    (the rest one-step): the curriculum's ramp."""
    one = [p for p in train if p.steps == 1]
    two = [p for p in train if p.steps == 2]
    if not one or not two:
        return rng.sample(train, k) if k <= len(train) else rng.choices(train, k=k)
    share = progress * len(two) / len(train)
    return [rng.choice(two if rng.random() < share else one) for _ in range(k)]


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
    prompts = [to_prompt(run, p, s.instructions, f"eval-{i}", s.shows_example)
               for i, p in enumerate(held_out)]
    texts: list[str] = []
    for start in range(0, len(prompts), s.eval_batch_size):
        chunk = prompts[start:start + s.eval_batch_size]
        texts += list(run.generate(chunk, temperature=0.0,
                                   max_new_tokens=s.eval_max_new_tokens).texts)
    verdicts = check(texts, [str(p.answer) for p in prompts], s)
    result: dict[str, Any] = {"accuracy": float(correct_reward(verdicts).mean()),
                              "format": float(format_reward(texts).mean())}
    for level in sorted({p.steps for p in held_out} - {0}):  # the curriculum, per level
        mine = [v.correct for v, p in zip(verdicts, held_out) if p.steps == level]
        result[f"accuracy_{level}step"] = sum(mine) / len(mine)
    return result
