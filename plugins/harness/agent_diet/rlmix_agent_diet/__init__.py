"""AgentDiet: inference-time trajectory reduction for multi-turn agents.

AgentDiet (seed 004, paragraph 62) observes that agent trajectories are full of *useless*,
*redundant* and *expired* information, whose input tokens are paid again at every later model
call, and that it can be removed without harming the agent's performance (39.9-59.7% fewer
input tokens in the paper).

In rlmix, a wrapper on ``rlmix_episode`` wraps the env's episode. Every env message it returns
is reduced before the engine appends it, so the reduction works with append-only engines (``hf``,
whose trainer sees exactly what the sampler saw):

* **useless**: an empty tool output becomes ``(no output)``, and blank lines are dropped;
* **redundant**: runs of identical lines collapse to one line with ``(repeated N times)``, and an
  output identical to an earlier one in the episode becomes a pointer to it;
* **expired** (engines that re-send the whole conversation at each call, through the optional
  ``Episode.context(messages)``): an earlier output of a call that was issued again and answered
  differently (the state moved on) is replaced by a note that it expired;
* optionally the reflection LM (``lm_reduce``) shortens outputs longer than ``lm_min_chars``,
  kept only when its reply is shorter.

Tokens before and after are counted per turn (``info["agent_diet"]``) and summed in
``run.state["agent_diet"]``; ``rlmix_step_end`` reports them.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import reflection_lm
from rlmix_lm import LMSettings

import rlmix
from rlmix.types import Prompt, Run, StepResult

NAME = "agent_diet"
RULES = ("empty", "repeats", "duplicates", "expired")
NO_OUTPUT = "(no output)"
SAME = "(same output as an earlier identical result above)"
EXPIRED = "(expired: a later identical call returned a newer output)"
_CALL = re.compile(r"<tool>\s*(.*?)\s*</tool>", re.S)
_LOCK = threading.Lock()


@dataclass
class Settings:
    rules: list[str] = field(default_factory=lambda: list(RULES))  # which reductions run
    roles: list[str] = field(default_factory=lambda: ["tool"])  # env messages to reduce
    min_repeats: int = 2  # identical consecutive lines collapsed from this many on
    min_chars: int = 24  # outputs shorter than this are never replaced by a pointer
    lm_reduce: bool = False  # also ask the reflection LM to shorten long outputs
    lm_min_chars: int = 400
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        unknown = [r for r in self.rules if r not in RULES]
        if unknown:
            raise ValueError(f"rules: unknown rule {unknown[0]!r}; choose from "
                             f"{', '.join(RULES)}")
        if self.min_repeats < 2:
            raise ValueError(f"min_repeats: must be >= 2, got {self.min_repeats}")
        if self.min_chars < 0 or self.lm_min_chars < 1:
            raise ValueError("min_chars: min_chars must be >= 0 and lm_min_chars >= 1")


# ---------------------------------------------------------------- the rules (pure)


def collapse_repeats(text: str, min_repeats: int = 2, drop_blank: bool = True) -> str:
    """Runs of ``min_repeats`` or more identical lines become one line plus ``(repeated N
    times)``; blank lines are dropped when ``drop_blank``."""
    out: list[str] = []
    lines = [x for x in text.split("\n") if x.strip() or not drop_blank]
    i = 0
    while i < len(lines):
        j = i
        while j + 1 < len(lines) and lines[j + 1] == lines[i]:
            j += 1
        run = j - i + 1
        out.append(f"{lines[i]} (repeated {run} times)" if run >= min_repeats else lines[i])
        if run < min_repeats:
            out += lines[i + 1:j + 1]
        i = j + 1
    return "\n".join(out)


def normalise(text: str) -> str:
    return " ".join(text.split())


def reduce_output(text: str, seen: set[str], s: Settings) -> tuple[str, list[str]]:
    """One env message's content reduced against the outputs ``seen`` earlier in the episode
    (which it joins); returns the new content and the rules that fired."""
    fired = []
    key = normalise(text)
    if "empty" in s.rules and not key:
        return NO_OUTPUT, ["empty"]
    if "duplicates" in s.rules and key in seen and len(key) >= s.min_chars:
        return SAME, ["duplicates"]
    seen.add(key)
    out = text
    if "repeats" in s.rules:
        out = collapse_repeats(text, s.min_repeats, drop_blank="empty" in s.rules)
    elif "empty" in s.rules:
        out = "\n".join(x for x in text.split("\n") if x.strip())
    if out != text:
        fired.append("repeats" if "repeats" in s.rules and "(repeated " in out else "empty")
    return out, fired


def call_of(text: str) -> str:
    calls = _CALL.findall(text)
    return normalise(calls[-1]) if calls else ""


def expire(messages: Sequence[dict[str, str]], roles: Sequence[str] = ("tool",)
           ) -> list[dict[str, str]]:
    """The conversation with every env output of a call replaced by ``EXPIRED`` when the same
    call was made again later and answered with a different (non-pointer) output."""
    out = [dict(m) for m in messages]
    latest: dict[str, tuple[int, str]] = {}
    outputs: list[tuple[int, str, str]] = []  # (index, call, output)
    call = ""
    for i, m in enumerate(out):
        if m["role"] == "assistant":
            call = call_of(m["content"])
        elif m["role"] in roles and call and m["content"] not in (SAME, NO_OUTPUT, EXPIRED):
            outputs.append((i, call, normalise(m["content"])))
            latest[call] = (i, normalise(m["content"]))
    for i, c, text in outputs:
        last_i, last_text = latest[c]
        if i < last_i and text != last_text:
            out[i]["content"] = EXPIRED
    return out


def count(text: str, tokenizer: Any = None) -> int:
    if tokenizer is not None:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return len(text.split())


def lm_prompt(text: str) -> str:
    return ("An agent's tool returned the output below. Rewrite it as short as possible, "
            "keeping every value, error and fact the agent may still need; drop progress "
            "chatter and repetition. Reply with the shortened output only.\n\n" + text)


# ---------------------------------------------------------------- the episode wrapper


class DietEpisode:
    """Wraps an env's episode: reduces the env messages of every step before the engine sees
    them and offers ``context(messages)`` (the expired rule) to engines that re-send the
    conversation. ``info["agent_diet"]`` per turn: ``raw`` and ``kept`` tokens, rules fired."""

    def __init__(self, inner: Any, s: Settings, tokenizer: Any = None, lm: Any = None,
                 totals: dict[str, Any] | None = None) -> None:
        self.inner, self.s, self.tokenizer, self.lm = inner, s, tokenizer, lm
        self.stop_strings = tuple(getattr(inner, "stop_strings", ()) or ())
        self.seen: set[str] = set()
        self.totals = totals

    def reset(self) -> list[dict[str, str]]:
        return self.inner.reset()

    def _shorten(self, text: str) -> tuple[str, list[str]]:
        if self.lm is None or len(text) < self.s.lm_min_chars:
            return text, []
        reply = self.lm.complete(lm_prompt(text), self.s.lm.max_new_tokens,
                                 self.s.lm.temperature).strip()
        return (reply, ["lm"]) if reply and len(reply) < len(text) else (text, [])

    def step(self, assistant_text: str) -> StepResult:
        result = self.inner.step(assistant_text)
        raw = kept = 0
        fired: list[str] = []
        messages = []
        for m in result.messages:
            m = dict(m)
            if m.get("role") in self.s.roles:
                raw += count(m["content"], self.tokenizer)
                content, why = reduce_output(m["content"], self.seen, self.s)
                content, why_lm = self._shorten(content)
                m["content"] = content
                fired += why + why_lm
                kept += count(content, self.tokenizer)
            messages.append(m)
        if self.totals is not None:
            with _LOCK:
                for k, v in (("raw", raw), ("kept", kept), ("turns", 1)):
                    self.totals[k] = self.totals.get(k, 0) + v
                for r in fired:
                    self.totals[f"rule_{r}"] = self.totals.get(f"rule_{r}", 0) + 1
        info = {**result.info, NAME: {"raw": raw, "kept": kept, "rules": fired}}
        return StepResult(messages=messages, done=result.done, info=info)

    def context(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        shaper = getattr(self.inner, "context", None)
        messages = list(shaper(messages)) if callable(shaper) else messages
        return expire(messages, self.s.roles) if "expired" in self.s.rules else messages


# ---------------------------------------------------------------- hooks


def state_of(run: Run) -> dict[str, Any]:
    state = run.state.get(NAME)
    if state is None:
        state = run.state[NAME] = {"total": {}, "step": {}}
    return state


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    state_of(run)
    if s.lm_reduce and s.lm.source != "policy":
        reflection_lm(run, NAME)


@rlmix.hookimpl(wrapper=True)
def rlmix_episode(run: Run, prompt: Prompt) -> Generator[None, Any, Any]:
    episode = yield
    if episode is None:
        return None
    s = run.settings(NAME)
    lm = reflection_lm(run, NAME) if s.lm_reduce else None
    return DietEpisode(episode, s, run.tokenizer, lm, state_of(run)["step"])


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = state_of(run)
    with _LOCK:
        step = dict(state["step"])
        state["step"].clear()  # in place: running episodes hold this dict
    raw, kept = step.get("raw", 0), step.get("kept", 0)
    total = state["total"]
    for k, v in step.items():
        total[k] = total.get(k, 0) + v
    metrics[f"{NAME}/env_tokens_raw"] = raw
    metrics[f"{NAME}/env_tokens_kept"] = kept
    metrics[f"{NAME}/saved_fraction"] = (raw - kept) / raw if raw else 0.0
    metrics[f"{NAME}/saved_total"] = total.get("raw", 0) - total.get("kept", 0)
    for k, v in step.items():
        if k.startswith("rule_"):
            metrics[f"{NAME}/{k}"] = v
