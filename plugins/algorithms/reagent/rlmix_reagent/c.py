"""``reagent.c`` (Reagent-C): text-augmented refinement. An ``rlmix_sample`` wrapper: rows that
fail the first pass get the judge's critique appended to their prompt (after their own answer)
and are generated once more; the refined rows join their group."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

import rlmix
from rlmix import sampling
from rlmix.types import Prompt, RolloutBatch, Run
from rlmix_reagent.judge import JudgeSettings
from rlmix_reagent.r import INFO, verdicts_for

NAME = "reagent.c"


@dataclass
class Settings(JudgeSettings):
    correct_term: str = ""  # "<plugin>.<term>", "" = the weighted reward; fails at <= threshold
    threshold: float = 0.5
    max_refine: int = 8  # refined rows per group at most
    feedback: str = "A reviewer's critique of your answer:\n{critique}\nWrite an improved answer."

    def __post_init__(self) -> None:
        self.check_judge()
        if self.correct_term and "." not in self.correct_term:
            raise ValueError(f"correct_term: {self.correct_term!r} must be '' or "
                             f"'<plugin>.<term>'")
        if self.max_refine < 0:
            raise ValueError("max_refine must be >= 0")
        if "{critique}" not in self.feedback:
            raise ValueError("feedback: must contain {critique}")


def refined_prompt(prompt: Prompt, answer: str, critique: str, feedback: str) -> Prompt:
    """The original chat, the row's own answer, then the critique as a new user turn."""
    messages = [dict(m) for m in prompt.messages]
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": feedback.format(critique=critique)}]
    return Prompt(messages=messages, answer=prompt.answer, id=prompt.id,
                  info={**prompt.info, "reagent_refined": True})


def failures(correct: torch.Tensor, group: torch.Tensor, max_per_group: int) -> list[int]:
    """Failed rows, at most ``max_per_group`` per group, in row order."""
    out, taken = [], {}
    for i in (~correct).nonzero().flatten().tolist():
        g = int(group[i])
        if taken.get(g, 0) < max_per_group:
            out.append(i)
            taken[g] = taken.get(g, 0) + 1
    return out


def refine(run: Run, batch: RolloutBatch, owner: str, s: Settings) -> RolloutBatch:
    """``batch`` plus one critique-refined row per failed row (in its group)."""
    rewards = sampling.score(run, batch)
    if s.correct_term and s.correct_term not in batch.reward_terms:
        raise rlmix.ConfigError(f"{owner}.correct_term: no scorer returned {s.correct_term!r}; "
                                f"terms: {', '.join(sorted(batch.reward_terms))}")
    values = batch.reward_terms[s.correct_term] if s.correct_term else rewards
    correct = values > s.threshold
    rows = failures(correct, batch.group, s.max_refine)
    run.log(f"{owner}/first_pass_failures", float(len(rows)))
    if not rows:
        return batch
    verdicts_for(run, batch, rows, owner, s)
    prompts = [refined_prompt(batch.prompts[i], batch.texts[i],
                              batch.info[i][INFO]["critique"] or "(no critique)", s.feedback)
               for i in rows]
    new = sampling.generate(run, prompts, 1)
    for j, i in enumerate(rows):
        new.info[j][INFO] = {"refined_from": i}
    sampling.count_rollouts(run, owner, len(new))
    keys = [str(int(g)) for g in batch.group] + [str(int(batch.group[i])) for i in rows]
    out = sampling.regroup([batch, new], keys, sampling.pad_id(run))
    run.log(f"{owner}/refined", float(len(new)))
    return out


@rlmix.hookimpl(wrapper=True)
def rlmix_sample(run: Run, prompts: list[Prompt]) -> Generator[None, RolloutBatch, RolloutBatch]:
    batch = yield
    return refine(run, batch, NAME, run.settings(NAME))
