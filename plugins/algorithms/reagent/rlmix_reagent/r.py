"""``reagent.r`` (Reagent-R): the reasoning reward model's process score as a reward term,
``process`` (``reward/reagent.r.process``); a malformed verdict scores 0 and is counted."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlmix
from rlmix.types import RolloutBatch, Run
from rlmix_reagent.judge import JudgeSettings, judge, question_of

NAME = "reagent.r"
INFO = "reagent"  # batch.info[i]["reagent"]: the row's verdict (shared with reagent.c / .u)


@dataclass
class Settings(JudgeSettings):
    def __post_init__(self) -> None:
        self.check_judge()


def cached(batch: RolloutBatch, i: int) -> dict | None:
    """The verdict already recorded for row ``i`` (by a refinement pass), if it is for this
    row's text."""
    got = batch.info[i].get(INFO)
    return got if got and got.get("text") == batch.texts[i] and "score" in got else None


def verdicts_for(run: Run, batch: RolloutBatch, rows: list[int], owner: str,
                 s: JudgeSettings) -> None:
    """Judge ``rows`` that have no cached verdict; record each in ``batch.info[i]["reagent"]``
    (``score`` 0 and ``malformed`` True for an unreadable reply) and log the cost."""
    from rlmix_harness import reflection_lm

    todo = [i for i in rows if cached(batch, i) is None]
    if todo:
        found = judge(reflection_lm(run, owner), [question_of(batch, i) for i in todo],
                      [batch.texts[i] for i in todo], s.max_response_chars, s.lm.max_new_tokens)
        for i, v in zip(todo, found):
            batch.info[i][INFO] = {
                **batch.info[i].get(INFO, {}), "text": batch.texts[i],
                "score": v.score if v else 0.0, "critique": v.critique if v else "",
                "malformed": v is None}
    calls = run.pending_metrics.get(f"{owner}/judge_calls", 0.0)
    run.log(f"{owner}/judge_calls", calls + len(todo))
    bad = sum(bool(batch.info[i][INFO]["malformed"]) for i in todo)
    run.log(f"{owner}/malformed", run.pending_metrics.get(f"{owner}/malformed", 0.0) + bad)


def process_term(run: Run, batch: RolloutBatch, owner: str, s: JudgeSettings) -> torch.Tensor:
    verdicts_for(run, batch, list(range(len(batch))), owner, s)
    return torch.tensor([float(batch.info[i][INFO]["score"]) for i in range(len(batch))])


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    return {"process": process_term(run, batch, NAME, run.settings(NAME))}
