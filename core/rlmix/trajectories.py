"""Reading multi-turn episode records (``batch.info[i]["episode"]["turns"]``, as the ``hf``
engine writes them): the call a turn made and the states it went through. Shared by harness
plugins that learn from trajectories."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_CALL = re.compile(r"<tool>\s*(.*?)\s*</tool>", re.S)


def tool_call(text: str) -> str:
    """The call inside the last ``<tool>...</tool>`` of a turn (whitespace collapsed), else the
    turn's whole text."""
    calls = _CALL.findall(text)
    return " ".join((calls[-1] if calls else text).split())


def walk(turns: Sequence[dict[str, Any]], start: str, state_key: str = "state"
         ) -> list[dict[str, Any]]:
    """Per turn: ``{from, action, to, error, observation}``. ``to`` is the env's per-turn
    ``info[state_key]`` (the state after the turn), or the state before when the env reports
    none; ``observation`` is the env's messages after the turn, joined."""
    out, state = [], start
    for t in turns:
        info = t.get("info") or {}
        to = str(info.get(state_key, state))
        observation = " ".join(str(m.get("content", "")) for m in t.get("messages") or [])
        out.append({"from": state, "action": tool_call(t.get("assistant", "")), "to": to,
                    "error": str(info.get("error") or ""), "observation": observation})
        state = to
    return out
