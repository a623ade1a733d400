"""``reagent.u`` (Reagent-U): both at once. First-pass failures are refined with the critique
(as ``reagent.c``) and every row, refined or not, gets the process score as the reward term
``process`` (as ``reagent.r``); verdicts are cached per row, so a row is judged once."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

import rlmix
from rlmix.types import Prompt, RolloutBatch, Run
from rlmix_reagent import c
from rlmix_reagent.r import process_term

NAME = "reagent.u"


@dataclass
class Settings(c.Settings):
    pass


@rlmix.hookimpl(wrapper=True)
def rlmix_sample(run: Run, prompts: list[Prompt]) -> Generator[None, RolloutBatch, RolloutBatch]:
    batch = yield
    return c.refine(run, batch, NAME, run.settings(NAME))


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    return {"process": process_term(run, batch, NAME, run.settings(NAME))}
