"""HDPO: RL plus privileged self-distillation on cliff prompts (every rollout failed, so the RL
gradient there is exactly 0).

A wrapper on the advantage owner (GRPO or any other) finds the cliff prompts of the step's
batch, regenerates each ``n_privileged`` times with the ground truth in the prompt, and keeps
the correct generations only (reward >= ``success_threshold``, the paper's R = 1 filter). A
wrapper on the ``rlmix_clip`` owner then adds ``lam * KL(teacher || student)``, token-averaged
over the kept generations, to the loss of each optimizer step: the teacher is the same weights
under the privileged prompt, the student sees the plain prompt, both on the kept tokens.
``lam = 0`` leaves the owner's run untouched bit for bit (nothing is generated).
Privileged rollouts are counted in ``run.state["opsd.hdpo"]["rollouts"]``."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

import rlmix
from rlmix import ops, sampling
from rlmix.types import LossTerms, Minibatch, Prompt, RolloutBatch, Run
from rlmix_opsd import base

NAME = "opsd.hdpo"
PENDING = "kept"  # run.plugin_resources("opsd.hdpo"): (step, kept batch, plain messages)


@dataclass
class Settings:
    lam: float = 0.1  # the paper's lambda: weight of the distillation term; 0 = the RL owner
    template: str = base.DEFAULT_TEMPLATE  # the ground truth appended to the question
    n_privileged: int = 0  # privileged rollouts per cliff prompt; 0 = train.group_size
    success_threshold: float = 1.0  # a rollout with reward >= this is correct
    top_k: int = 0
    kl_clip: float = 10.0

    def __post_init__(self) -> None:
        if self.lam < 0 or self.n_privileged < 0 or self.top_k < 0 or self.kl_clip < 0:
            raise ValueError("lam, n_privileged, top_k and kl_clip must be >= 0")


def cliff_groups(rewards: torch.Tensor, group: torch.Tensor, threshold: float
                 ) -> list[int]:
    """Groups in which no rollout reached ``threshold`` (all failed), ascending."""
    successes, _ = sampling.group_outcomes((rewards >= threshold).float(), group)
    return [int(g) for g in (successes == 0).nonzero().flatten()]


def privileged_rollouts(run: Run, batch: RolloutBatch, s: Settings
                        ) -> tuple[RolloutBatch, list[list[dict[str, str]]]] | None:
    """The correct privileged generations for the batch's cliff prompts, and each kept row's
    plain messages; ``None`` when there is no cliff prompt or nothing correct."""
    assert batch.rewards is not None
    cliffs = cliff_groups(batch.rewards, batch.group, s.success_threshold)
    run.log(f"{NAME}/cliff_prompts", len(cliffs))
    if not cliffs:
        return None
    first_row = {int(g): i for i, g in reversed(list(enumerate(batch.group.tolist())))}
    plain = [batch.prompts[first_row[g]] for g in cliffs]
    n = s.n_privileged or int(run.config.train.group_size)
    privileged = [Prompt(messages=base.privileged_messages(p, s.template), answer=p.answer,
                         id=p.id, info=p.info) for p in plain]
    generated = sampling.generate(run, privileged, n)
    state = run.state.setdefault(NAME, {})
    state["rollouts"] = state.get("rollouts", 0) + len(generated)
    keep = (sampling.score(run, generated) >= s.success_threshold).nonzero().flatten()
    run.log(f"{NAME}/kept", len(keep))
    if len(keep) == 0:
        return None
    plain_messages = [plain[i // n].messages for i in keep.tolist()]
    return generated.select(keep), plain_messages


def distillation(run: Run, kept: RolloutBatch, plain_messages: list[list[dict[str, str]]],
                 s: Settings) -> torch.Tensor:
    """Token mean over the kept generations of the clipped ``KL(teacher || student)``."""
    teacher_messages = [p.messages for p in kept.prompts]
    loss, kl, _ = base.distill_tokens(run, kept, teacher_messages, s.top_k, s.kl_clip,
                                      student_messages=plain_messages)
    mask = kept.completion_mask.to(loss.device)
    run.log(f"{NAME}/kl", base.kl_metric(kl, mask))
    return ops.masked_mean(loss, mask)


@rlmix.hookimpl(wrapper=True)
def rlmix_advantage(run: Run, batch: RolloutBatch
                    ) -> Generator[None, torch.Tensor | None, torch.Tensor | None]:
    advantages = yield
    s = run.settings(NAME)
    run.plugin_resources(NAME).pop(PENDING, None)
    if s.lam > 0:
        found = privileged_rollouts(run, batch, s)
        if found is not None:
            run.plugin_resources(NAME)[PENDING] = (run.step, *found)
    return advantages


@rlmix.hookimpl(wrapper=True)
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
               ) -> Generator[None, LossTerms | None, LossTerms | None]:
    terms = yield
    s = run.settings(NAME)
    pending = run.plugin_resources(NAME).get(PENDING)
    if terms is None or s.lam == 0 or pending is None or not mb.last or pending[0] != run.step:
        return terms
    _, kept, plain_messages = pending
    extra = s.lam * distillation(run, kept, plain_messages, s)
    terms.extra = extra if terms.extra is None else terms.extra + extra
    return terms
