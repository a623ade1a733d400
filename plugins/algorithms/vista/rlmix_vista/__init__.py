"""VISTA (View-Consistent Self-Verified Training): each comparison group is built from rollouts on
several target-preserving views of one task (``Prompt.info["views"]``: rephrasings, crops,
reorderings with the same answer), and a self-verified cross-view anchor adds the oracle answer
as an extra row, advantage-weighted, excluded from the group baseline and active only when some
rollout of the group reached the maximum reward.

Owns ``rlmix_sample`` (the ``train.group_size`` rollouts of a prompt are spread round-robin over
its views and regrouped under the prompt; a prompt without views samples as usual) and
``rlmix_advantage`` (group-normalised over the rollouts; for each group where a rollout reached
``max_reward`` an anchor row, the group's prompt followed by the oracle answer, with advantage
``anchor_coef * (max_reward - mean) / (std + eps)`` of the rollouts), and wraps ``rlmix_clip``
to add the anchors' advantage-weighted NLL to the owner's loss (``LossTerms.extra``, once per
optimizer step). The anchors are extra rows outside the batch (``rlmix_sample`` returns
exactly ``len(prompts) * group_size`` rollouts), so they never enter a baseline."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix import distill, ops, sampling
from rlmix.types import LossTerms, Minibatch, Prompt, RolloutBatch, Run

NAME = "vista"
PENDING = "anchors"  # run.plugin_resources("vista"): (step, anchor rows, advantages)


@dataclass
class Settings:
    cross_view: bool = True  # False: every rollout on the first view (single-view GRPO)
    anchor: bool = True  # add the self-verified oracle anchor row per group
    anchor_coef: float = 1.0
    max_reward: float = 1.0  # the anchor is active when a rollout reached this
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.anchor_coef < 0 or self.eps <= 0:
            raise ValueError("anchor_coef must be >= 0 and eps > 0")


def view_prompts(prompt: Prompt, cross_view: bool) -> list[Prompt]:
    """The prompt under each of its views (``info["views"]``: chats, or texts that replace
    the last user message); just the prompt when it has none."""
    views: list[Any] = list(prompt.info.get("views") or [])
    if not views:
        return [prompt]
    out = []
    for j, view in enumerate(views[:1] if not cross_view else views):
        if isinstance(view, str):
            messages = [dict(m) for m in prompt.messages]
            users = [m for m in messages if m.get("role") == "user"]
            (users[-1] if users else messages[-1])["content"] = view
        else:
            messages = [dict(m) for m in view]
        out.append(Prompt(messages=messages, answer=prompt.answer, id=prompt.id,
                          info={**prompt.info, "view": j}))
    return out


def spread(n: int, parts: int) -> list[int]:
    """``n`` rollouts over ``parts`` views, round-robin: the first ``n % parts`` get one more."""
    return [n // parts + (1 if j < n % parts else 0) for j in range(parts)]


def group_advantage(rewards: torch.Tensor, group: torch.Tensor, eps: float) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` per group (unbiased std): GRPO's, over the rollouts."""
    r = rewards.float()
    return (r - ops.group_mean(r, group)) / (ops.group_std(r, group) + eps)


def anchor_advantage(rewards: torch.Tensor, group: torch.Tensor, max_reward: float,
                     coef: float, eps: float) -> torch.Tensor:
    """Per group ``[G]``: ``coef * (max_reward - mean) / (std + eps)`` of its rollouts' rewards
    when one of them reached ``max_reward`` (the self-verification), else 0. The anchor is not
    in the mean or the std."""
    r = rewards.float()
    size = int(group.max()) + 1
    mean = torch.zeros(size).index_put_((group,), ops.group_mean(r, group))
    std = torch.zeros(size).index_put_((group,), ops.group_std(r, group))
    best = torch.full((size,), -float("inf")).scatter_reduce(0, group, r, reduce="amax")
    return torch.where(best >= max_reward, coef * (max_reward - mean) / (std + eps),
                       torch.zeros(size))


def anchor_loss(logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                sequences: float) -> torch.Tensor:
    """``sum_rows(A * mean_tokens(-logp)) / sequences``: the anchors' advantage-weighted NLL,
    each anchor weighing as one sequence of the optimizer step."""
    per_row = (-logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return (advantages.to(per_row.device) * per_row).sum() / max(sequences, 1.0)


def oracle_ids(run: Run, prompt: Prompt, end: int | None = None) -> list[int]:
    """The oracle answer's token ids, closed by ``end`` (the engine's stop token)."""
    ids = prompt.info.get("oracle_ids")
    if ids is not None:
        return [int(i) for i in ids]
    tok = run.tokenizer
    if tok is None:
        raise RuntimeError("vista: the prompt has no info['oracle_ids'] and the run has no "
                           "tokenizer to encode its answer")
    text = str(prompt.info.get("oracle", prompt.answer))
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    return ids + ([end] if end is not None else [])


@rlmix.hookimpl
def rlmix_sample(run: Run, prompts: list[Prompt]) -> RolloutBatch:
    s = run.settings(NAME)
    n = int(run.config.train.group_size)
    parts, keys = [], []
    for i, prompt in enumerate(prompts):
        views = view_prompts(prompt, s.cross_view)
        for view, count in zip(views, spread(n, len(views)), strict=True):
            if count:
                parts.append(sampling.generate(run, [view], count))
                keys += [str(i)] * count
    return sampling.regroup(parts, keys, sampling.pad_id(run))


@rlmix.hookimpl
def rlmix_advantage(run: Run, batch: RolloutBatch) -> torch.Tensor:
    s = run.settings(NAME)
    assert batch.rewards is not None
    adv = group_advantage(batch.rewards, batch.group, s.eps)
    spread_ = ops.group_std(batch.rewards.float(), batch.group)
    groups = batch.group.unique()
    zero = torch.zeros(int(batch.group.max()) + 1).index_put_((batch.group,), spread_)
    run.log(f"{NAME}/zero_advantage_groups", float((zero[groups] == 0).float().mean()))
    run.plugin_resources(NAME).pop(PENDING, None)
    if s.anchor:
        per_group = anchor_advantage(batch.rewards, batch.group, s.max_reward,
                                     s.anchor_coef, s.eps)
        active = [int(g) for g in (per_group != 0).nonzero().flatten()]
        run.log(f"{NAME}/anchors_active", len(active))
        if active:
            first = batch.group.tolist()
            rows = [first.index(g) for g in active]
            end = distill.stop_token(run, batch)
            anchors = distill.forced_completions(
                run, batch, rows, [oracle_ids(run, batch.prompts[r], end) for r in rows])
            run.plugin_resources(NAME)[PENDING] = (run.step, anchors, per_group[active])
    return adv


@rlmix.hookimpl(wrapper=True)
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
               ) -> Generator[None, LossTerms | None, LossTerms | None]:
    terms = yield
    pending = run.plugin_resources(NAME).get(PENDING)
    if terms is None or pending is None or not mb.last or pending[0] != run.step:
        return terms
    _, anchors, advantages = pending
    anchor_logp, _ = run.policy.logprobs(run, anchors)
    mask = anchors.completion_mask.to(anchor_logp.device)
    extra = anchor_loss(anchor_logp, mask, advantages, mb.normalizers.sequences)
    terms.extra = extra if terms.extra is None else terms.extra + extra
    return terms
