"""Agent-RRM / Reagent as three plugins a manifest takes one at a time: ``reagent.r`` (the
judge's process score as a reward term), ``reagent.c`` (the judge's critique appended to the
prompt of first-pass failures, which are generated again and join their group) and
``reagent.u`` (both). The judge is an ``rlmix_lm`` model (``lm`` in each block)."""

from __future__ import annotations

from rlmix_reagent.c import failures, refined_prompt
from rlmix_reagent.judge import Verdict, judge, parse

__all__ = ["Verdict", "failures", "judge", "parse", "refined_prompt"]
