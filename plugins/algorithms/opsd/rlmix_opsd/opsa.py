"""OPSA: OPSD whose privileged context is chosen by teacher flip rate.

Candidate contexts (``contexts``: templates appended to the question) are ranked on the
student's own failed rollouts: a context's flip rate is the share of failed rollouts whose
prompt the context-conditioned teacher (same weights, ``probe_n`` rollouts) solves. The best
context is the privileged view of the dense per-token KL supervision (as ``opsd``).
``select_by: success`` ranks by the teacher's overall success instead (the baseline the paper
argues against). The choice is made on the first step, again every ``reselect_every`` steps,
and is checkpointed in ``run.state["opsd.opsa"]``; probe rollouts are counted in
``run.state["opsd.opsa"]["rollouts"]``.

Needs rewards to know which rollouts failed: keep an env scorer in the manifest."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import rlmix
from rlmix import sampling
from rlmix.types import LossTerms, Minibatch, Prompt, RolloutBatch, Run
from rlmix_opsd import base
from rlmix_opsd.plain import opsd_loss

NAME = "opsd.opsa"
RLMIX_NOT_NEEDED = ("rlmix_advantage",)
SELECT_BY = ("flip", "success")


@dataclass
class Settings(base.Settings):
    contexts: list[str] = field(default_factory=lambda: [base.DEFAULT_TEMPLATE])
    select_by: str = "flip"  # flip (OPSA) | success (overall teacher success)
    probe_n: int = 4  # teacher rollouts per prompt and context when ranking
    success_threshold: float = 1.0  # a rollout with reward >= this succeeded
    reselect_every: int = 0  # steps between re-rankings; 0 = rank once

    def __post_init__(self) -> None:
        super().__post_init__()
        rlmix.check_choices(self, select_by=SELECT_BY)
        if not self.contexts:
            raise ValueError("contexts must name at least one privileged context")
        if self.probe_n < 1 or self.reselect_every < 0:
            raise ValueError("probe_n must be >= 1 and reselect_every >= 0")


def flip_and_success(failed_rows_prompt: torch.Tensor, teacher_success: torch.Tensor
                     ) -> tuple[float, float]:
    """``(flip rate, overall success)`` of one context: ``teacher_success[p]`` is the
    context-conditioned teacher's success rate on prompt ``p``; ``failed_rows_prompt`` the
    prompt index of every failed student rollout. Flip rate = mean of the teacher's success
    over the failed rollouts (0 when none failed)."""
    overall = float(teacher_success.mean()) if len(teacher_success) else 0.0
    if len(failed_rows_prompt) == 0:
        return 0.0, overall
    return float(teacher_success[failed_rows_prompt].mean()), overall


def rank_contexts(run: Run, batch: RolloutBatch, s: Settings) -> dict[str, list[float]]:
    """Probe every context on the batch's distinct prompts; flip rates and successes."""
    assert batch.rewards is not None
    prompts: list[Prompt] = []
    index_of: dict[int, int] = {}
    row_prompt = []
    for p in batch.prompts:
        key = id(p)
        if key not in index_of:
            index_of[key] = len(prompts)
            prompts.append(p)
        row_prompt.append(index_of[key])
    failed = torch.tensor(row_prompt)[batch.rewards < s.success_threshold]
    flips, successes = [], []
    state = run.state.setdefault(NAME, {})
    for context in s.contexts:
        probe_prompts = [Prompt(messages=base.privileged_messages(p, context), answer=p.answer,
                                id=p.id, info=p.info) for p in prompts]
        probe = sampling.generate(run, probe_prompts, s.probe_n)
        state["rollouts"] = state.get("rollouts", 0) + len(probe)
        ok = (sampling.score(run, probe) >= s.success_threshold).float()
        per_prompt = ok.view(len(prompts), s.probe_n).mean(-1)
        flip, success = flip_and_success(failed, per_prompt)
        flips.append(flip)
        successes.append(success)
    return {"flip": flips, "success": successes}


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
               ) -> LossTerms:
    s = run.settings(NAME)
    state = run.state.setdefault(NAME, {})
    due = "choice" not in state or (s.reselect_every > 0 and mb.index == 0 and mb.epoch == 0
                                    and run.step - state.get("chosen_at", 0) >= s.reselect_every)
    if due:
        ranks = rank_contexts(run, mb.batch, s)
        scores = ranks[s.select_by]
        state.update(choice=int(max(range(len(scores)), key=scores.__getitem__)),
                     chosen_at=run.step, **ranks)
    choice = state["choice"]
    terms = opsd_loss(run, mb, s, s.contexts[choice], name=NAME)
    terms.metrics[f"{NAME}/context"] = float(choice)
    terms.metrics[f"{NAME}/flip_rate"] = state["flip"][choice]
    return terms
