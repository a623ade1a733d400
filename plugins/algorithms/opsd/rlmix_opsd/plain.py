"""OPSD: the student samples, the same weights under a privileged prompt (the answer appended to
the question) score the student's own tokens, and the student is trained towards the teacher's
next-token distribution at every completion token (per-token clipped forward KL).

Reward-free: it declares ``RLMIX_NOT_NEEDED`` so a manifest needs neither a scorer nor an
advantage owner (a scorer, when present, is still called and logged)."""

from __future__ import annotations

import torch

import rlmix
from rlmix.types import LossTerms, Minibatch, Run
from rlmix_opsd import base

NAME = "opsd"
RLMIX_NOT_NEEDED = ("rlmix_score", "rlmix_advantage")


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    run.settings(NAME)  # validated already; fail here if the block went missing


Settings = base.Settings


def opsd_loss(run: Run, mb: Minibatch, s: base.Settings, template: str,
              weights: torch.Tensor | None = None, name: str = NAME) -> LossTerms:
    """The OPSD ``LossTerms`` of a minibatch under ``template``, each token's loss times
    ``weights`` (``[n, T]``, default 1)."""
    batch = mb.batch
    messages = [base.privileged_messages(p, template) for p in batch.prompts]
    loss, kl, _ = base.distill_tokens(run, batch, messages, s.top_k, s.kl_clip)
    mask = batch.completion_mask.to(loss.device)
    if weights is not None:
        loss = loss * weights.to(loss.device)
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode,
                     metrics={f"{name}/kl": base.kl_metric(kl, mask)})


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
               ) -> LossTerms:
    s = run.settings(NAME)
    return opsd_loss(run, mb, s, s.template)
