"""On-policy self-distillation for rlmix: one distribution, five plugins a manifest takes one at a
time: ``opsd`` (plain), ``opsd.hdpo``, ``opsd.pw``, ``opsd.rp`` and ``opsd.opsa``.

Each is a submodule with its own hooks and settings; the shared parts (privileged prompt,
teacher pass, clipped forward-KL target) are in ``rlmix_opsd.base`` and re-exported here."""

from __future__ import annotations

from rlmix_opsd.base import (
    clip_token_loss,
    distill_tokens,
    forward_kl,
    mean_one,
    position_weights,
    privileged_messages,
    render,
    to_columns,
)

__all__ = ["clip_token_loss", "distill_tokens", "forward_kl", "mean_one", "position_weights",
           "privileged_messages", "render", "to_columns"]
