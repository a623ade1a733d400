"""What every OPSD variant shares: the privileged prompt, the teacher pass on the student's own
tokens, and the per-token clipped forward-KL target.

Pure tensor functions (``forward_kl``, ``clip_token_loss``, ``position_weights``,
``to_columns``) plus ``distill_tokens``, which fetches the student's and the teacher's logits
through the core seam ``rlmix.distill`` and returns the per-token loss aligned with
``batch.tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix import distill, ops
from rlmix.types import LOSS_MODES, Prompt, RolloutBatch, Run

Messages = list[dict[str, str]]
DEFAULT_TEMPLATE = "\n\nA correct final answer is: {answer}. Reason towards it."


@dataclass
class Settings:
    """The manifest block every OPSD variant starts from."""

    template: str = DEFAULT_TEMPLATE  # appended to the last user message: the privileged view
    top_k: int = 0  # KL over the teacher's top-k tokens (renormalised); 0 = full vocabulary
    kl_clip: float = 10.0  # each token's KL capped at this value (gradient rescaled); 0 = off
    loss_mode: str = "token-mean"

    def __post_init__(self) -> None:
        rlmix.check_choices(self, loss_mode=LOSS_MODES)
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 = full vocabulary)")
        if self.kl_clip < 0:
            raise ValueError("kl_clip must be >= 0 (0 = no clipping)")


def render(template: str, prompt: Prompt) -> str:
    """``template`` with ``{answer}`` and any plain ``prompt.info`` field filled in;
    ``{reference}`` (a reference solution) falls back to the answer when the prompt has none."""
    fields: dict[str, Any] = {k: v for k, v in prompt.info.items()
                              if isinstance(v, str | int | float)}
    fields["answer"] = prompt.answer
    fields.setdefault("reference", prompt.answer)
    try:
        return template.format(**fields)
    except KeyError as exc:
        raise ValueError(f"privileged template names {exc} but prompt {prompt.id!r} has no "
                         f"such field (answer or info: {', '.join(sorted(fields))})") from None


def privileged_messages(prompt: Prompt, template: str) -> Messages:
    """``prompt.messages`` with the rendered ``template`` appended to the last user message (a
    user message is added when there is none). The original prompt is not changed."""
    messages = [dict(m) for m in prompt.messages]
    extra = render(template, prompt)
    for m in reversed(messages):
        if m.get("role") == "user":
            m["content"] = str(m.get("content", "")) + extra
            return messages
    return [*messages, {"role": "user", "content": extra.lstrip()}]


def forward_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor,
               top_k: int = 0) -> torch.Tensor:
    """Per-position ``KL(p_teacher || p_student)`` over the last dimension, ``[...]``.

    With ``top_k > 0`` both distributions are restricted to the teacher's ``top_k`` most
    likely tokens and renormalised there (the usual approximation when ``V`` is large).
    The gradient with respect to the student's logits is ``p_student - p_teacher``."""
    teacher_logits = teacher_logits.float()
    student_logits = student_logits.float()
    if 0 < top_k < teacher_logits.shape[-1]:
        index = teacher_logits.topk(top_k, dim=-1).indices
        teacher_logits = teacher_logits.gather(-1, index)
        student_logits = student_logits.gather(-1, index)
    log_t = torch.log_softmax(teacher_logits, -1)
    log_s = torch.log_softmax(student_logits, -1)
    return (log_t.exp() * (log_t - log_s)).sum(-1)


def clip_token_loss(loss: torch.Tensor, clip: float) -> torch.Tensor:
    """Each token's loss capped at ``clip`` by rescaling (value ``min(l, clip)``; above the cap
    the gradient keeps its direction with magnitude scaled by ``clip / l``). ``clip == 0``: off."""
    if clip <= 0:
        return loss
    scale = (clip / loss.detach().clamp(min=1e-12)).clamp(max=1.0)
    return loss * scale


def to_columns(values: torch.Tensor, width: int) -> torch.Tensor:
    """``[n, t]`` values of the last ``t`` columns, left-padded with zeros to ``[n, width]``."""
    missing = width - values.shape[1]
    if missing == 0:
        return values
    return torch.cat([values.new_zeros(values.shape[0], missing), values], 1)


def position_weights(mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``((t + 1) / T_i) ** gamma`` for the ``t``-th completion token (from 0) of a row with
    ``T_i`` completion tokens, normalised to mean 1 over each row's tokens; 0 off the mask.
    ``gamma == 0`` gives exactly 1 on every token."""
    mask = mask.float()
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    length = mask.sum(-1, keepdim=True).clamp(min=1)
    raw = ((position + 1) / length) ** gamma * mask
    return raw * mask.sum(-1, keepdim=True) / raw.sum(-1, keepdim=True).clamp(min=1e-12)


def mean_one(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``scores`` normalised to mean 1 over each row's masked tokens (uniform where a row's
    scores are all 0); 0 off the mask."""
    mask = mask.float()
    scores = scores.clamp(min=0) * mask
    total = scores.sum(-1, keepdim=True)
    count = mask.sum(-1, keepdim=True)
    uniform = mask
    return torch.where(total > 0, scores * count / total.clamp(min=1e-12), uniform)


def distill_tokens(run: Run, batch: RolloutBatch, teacher_messages: list[Messages],
                   top_k: int = 0, kl_clip: float = 0.0,
                   student_messages: list[Messages] | None = None,
                   teacher: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The OPSD target on ``batch``'s completion tokens: ``(loss, kl, teacher)``.

    ``loss`` ``[n, T]`` is the clipped per-token ``KL(teacher || student)`` with the student's
    gradient, ``kl`` the unclipped value (detached), both 0 off the completion; ``teacher`` the
    ``[n, T - first, V]`` teacher logits (pass them back in to avoid a second teacher pass).
    The teacher is the same weights under ``teacher_messages`` (no gradient); the student
    is scored under its own prompts, or under ``student_messages``."""
    if teacher is None:
        teacher = distill.teacher_logits(run, batch, teacher_messages)
    student = distill.completion_logits(run, batch, student_messages)
    region = distill.completion_region(batch).to(student.device)
    kl = forward_kl(teacher.to(student.device), student, top_k) * region
    loss = clip_token_loss(kl, kl_clip) * region
    width = batch.tokens.shape[1]
    return to_columns(loss, width), to_columns(kl.detach(), width), teacher


def kl_metric(kl: torch.Tensor, mask: torch.Tensor) -> float:
    return float(ops.masked_mean(kl, mask.to(kl.dtype)))
