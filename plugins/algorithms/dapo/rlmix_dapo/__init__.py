"""DAPO (Yu et al. 2025, arXiv:2503.14476) as four plugins a manifest takes one at a time:
``dapo.clip_higher``, ``dapo.dynamic_sampling``, ``dapo.token_loss`` and ``dapo.overlong``.

Each part is a submodule with its own hooks and settings; the pure tensor functions are
re-exported here."""

from __future__ import annotations

from rlmix_dapo.clip_higher import decoupled_clip_surrogate
from rlmix_dapo.dynamic_sampling import extra_prompt_key, informative_groups
from rlmix_dapo.overlong import overlong_penalty

__all__ = ["decoupled_clip_surrogate", "extra_prompt_key", "informative_groups",
           "overlong_penalty"]
