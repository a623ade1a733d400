"""SAGE (Self-Abstraction from Grounded Experience): a first rollout, a concise plan abstracted
from it, and a second execution that sees the plan.

SAGE (seed 000, paragraph 53): after an initial rollout, the agent induces a concise plan
abstraction from its grounded experience (key steps, dependencies, constraints), which is fed
back as contextual guidance for a more structured subsequent execution.

In rlmix, a wrapper on ``rlmix_generate`` (so that training's sampling *and* evaluation, which
calls ``rlmix_generate`` directly, use the second execution):

1. **first pass**: one rollout per prompt (``first_temperature``; the request's settings
   otherwise), scored by the run's scorers;
2. **abstraction** (``abstract: rule``): from the first rollout's trajectory (multi-turn: every
   call with the state it was made in, the state it led to and the env's error; single-turn:
   the answer, its score and the env's feedback) the key steps in order (``in state S: use `a`
   (then S')``), the constraints (``in state S: `b` fails: <error>``) and the outcome;
   ``abstract: lm``: the reflection model (or the policy, ``lm.source: policy``) writes the plan
   from the transcript. Cut to ``max_tokens``;
3. **second execution**: each prompt's last user message gets ``header`` and the plan; the
   owner generates the request's ``n`` completions of these prompts, which is what the caller
   (the trainer, the evaluator) receives.

``context: raw`` is the ablation: the raw transcript of the first rollout, cut to the token
count the abstraction would have had, instead of the abstraction. Rollouts per task: ``1 + n``.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    cut,
    feedback_text,
    inside_rendering,
    mean,
    metric_values,
    reflection_lm,
    rendering,
    user_text,
)
from rlmix_lm import LMSettings

import rlmix
from rlmix import loop
from rlmix.trajectories import walk
from rlmix.types import GenerationRequest, Prompt, RolloutBatch, Run

NAME = "sage_abstraction"
ABSTRACTS = ("rule", "lm")
CONTEXTS = ("abstraction", "raw")


@dataclass
class Settings:
    abstract: str = "rule"  # rule | lm
    context: str = "abstraction"  # abstraction | raw (the cut raw transcript: the ablation)
    header: str = "Plan from your previous attempt at this task:"
    max_tokens: int = 160  # the plan (and the raw transcript) is cut to this many tokens
    first_temperature: float = -1.0  # the first pass; < 0 = the request's temperature
    first_max_new_tokens: int = 0  # 0 = the request's
    state_key: str = "state"  # per-turn info key of the state after the turn
    start_state: str = "start"
    metric: str = ""  # the first pass's outcome; "" = the weighted reward
    text_chars: int = 120  # an answer, error or feedback in the plan is cut to this
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, abstract=ABSTRACTS, context=CONTEXTS)
        if self.max_tokens < 8:
            raise ValueError(f"max_tokens: must be >= 8, got {self.max_tokens}")
        if self.first_max_new_tokens < 0:
            raise ValueError("first_max_new_tokens: must be >= 0 (0 = the request's)")
        if self.text_chars < 16:
            raise ValueError(f"text_chars: must be >= 16, got {self.text_chars}")


# ---------------------------------------------------------------- abstraction (pure)


def rule_plan(turns: list[dict[str, Any]] | None, text: str, score: float, feedback: str,
              s: Settings) -> list[str]:
    """The plan's lines: key steps, constraints and the outcome of one rollout."""
    if not turns:
        lines = [f"- your answer was: {cut(text, s.text_chars)}", f"- its score: {score:g}"]
        if feedback:
            lines.append(f"- the checker said: {cut(feedback, s.text_chars)}")
        return lines
    steps = walk(turns, s.start_state, s.state_key)
    lines, seen = [], set()
    for st in steps:
        if st["error"]:
            key = ("fail", st["from"], st["action"])
            if key not in seen:
                lines.append(f"- in state {st['from']}: `{st['action']}` fails: "
                             f"{cut(st['error'], s.text_chars)}")
        else:
            key = ("step", st["from"], st["action"])
            if key not in seen:
                lines.append(f"- in state {st['from']}: use `{st['action']}` (then {st['to']})")
        seen.add(key)
    last = steps[-1]["to"] if steps else s.start_state
    lines.append(f"- outcome: score {score:g}, ended in state {last}")
    return lines


def transcript(turns: list[dict[str, Any]] | None, text: str, feedback: str,
               s: Settings) -> str:
    """The raw first rollout, one line per call: ``state S: called `a` -> <observation>``."""
    if not turns:
        return f"your answer: {text}\nchecker: {feedback}".strip()
    rows = []
    for st in walk(turns, s.start_state, s.state_key):
        seen = st["observation"] or ("ok (episode over)" if not st["error"] else st["error"])
        rows.append(f"state {st['from']}: called `{st['action']}` -> {seen}")
    return "\n".join(rows)


def count_tokens(text: str, tokenizer: Any = None) -> int:
    if tokenizer is not None:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return len(text.split())


def cut_tokens(text: str, budget: int, tokenizer: Any = None) -> str:
    """The first ``budget`` tokens of ``text`` (words when there is no tokenizer)."""
    if tokenizer is not None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return text if len(ids) <= budget else tokenizer.decode(ids[:budget])
    words = text.split(" ")
    return text if len(text.split()) <= budget else " ".join(words[:budget])


def lm_prompt(task: str, raw: str, score: float) -> str:
    return ("You attempted a task. Task:\n" + task + "\n\nWhat happened, call by call (state "
            "before, call, what the environment answered):\n" + raw + f"\n\nScore: {score:g}\n"
            "Write a concise plan for the next attempt: the key steps in order, their "
            "dependencies and the constraints you learned, one per line, each starting with "
            "'- '. Write only the plan.")


def with_context(prompt: Prompt, block: str, record: dict[str, Any]) -> Prompt:
    messages = [dict(m) for m in prompt.messages]
    last = max(i for i, m in enumerate(messages) if m["role"] == "user") if any(
        m["role"] == "user" for m in messages) else len(messages) - 1
    messages[last]["content"] = f"{messages[last]['content']}\n\n{block}"
    return Prompt(messages=messages, answer=prompt.answer, id=prompt.id,
                  info={**prompt.info, NAME: record})


# ---------------------------------------------------------------- the wrapper's work


def state_of(run: Run) -> dict[str, Any]:
    state = run.state.get(NAME)
    if state is None:
        state = run.state[NAME] = {"first_rollouts": 0, "calls": 0}
    return state


def first_pass(run: Run, request: GenerationRequest) -> RolloutBatch:
    s = run.settings(NAME)
    first = GenerationRequest(
        prompts=list(request.prompts), n=1,
        temperature=request.temperature if s.first_temperature < 0 else s.first_temperature,
        top_p=request.top_p, top_k=request.top_k,
        max_new_tokens=s.first_max_new_tokens or request.max_new_tokens)
    batch = run.hook.rlmix_generate(run=run, request=first)
    if batch is None:
        raise RuntimeError("sage_abstraction: no plugin returned the first pass")
    loop.score(run, batch)
    return batch


def contexts(run: Run, batch: RolloutBatch) -> tuple[list[str], list[dict[str, Any]]]:
    """The block each prompt's second execution sees, and what to record about it."""
    s = run.settings(NAME)
    values = metric_values(batch, s.metric, NAME)
    tok = run.tokenizer
    plans, raws = [], []
    for i in range(len(batch)):
        episode = batch.info[i].get("episode") or {}
        turns = episode.get("turns") if isinstance(episode, dict) else None
        text = episode.get("model_text", batch.texts[i]) if turns else batch.texts[i]
        feedback = feedback_text(batch.info[i], NAME)
        raws.append(transcript(turns, text, feedback, s))
        plans.append(rule_plan(turns, text, values[i], feedback, s))
    if s.abstract == "lm":
        asks = [lm_prompt(user_text(p), raw, v) for p, raw, v in zip(batch.prompts, raws, values)]
        replies = reflection_lm(run, NAME).complete_batch(asks, s.lm.max_new_tokens,
                                                          s.lm.temperature)
        plans = [[x for x in r.strip().splitlines() if x.strip()] or ["- (no plan)"]
                 for r in replies]
    blocks, records = [], []
    for plan, raw, v in zip(plans, raws, values):
        abstraction = cut_tokens("\n".join([s.header, *plan]), s.max_tokens, tok)
        budget = count_tokens(abstraction, tok)
        block = (abstraction if s.context == "abstraction"
                 else cut_tokens(f"{s.header}\n{raw}", budget, tok))
        blocks.append(block)
        records.append({"first_score": v, "tokens": count_tokens(block, tok), "budget": budget,
                        "context": s.context})
    return blocks, records


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    state_of(run)
    if s.abstract == "lm" and s.lm.source != "policy":
        reflection_lm(run, NAME)


@rlmix.hookimpl(wrapper=True)
def rlmix_generate(run: Run, request: GenerationRequest) -> Generator[None, Any, Any]:
    if not request.prompts or inside_rendering(run, NAME):
        return (yield)  # our own first pass (or the policy writing a plan): plain generation
    with rendering(run, NAME):
        first = first_pass(run, request)
        blocks, records = contexts(run, first)
    # rebinding (not mutating) the request's list for the owner, and putting the caller's back
    # after it (below): the caller's list and request are as they were once the call returns
    original = request.prompts
    request.prompts = [with_context(p, b, r) for p, b, r in zip(original, blocks, records)]
    state = state_of(run)
    state["first_rollouts"] += len(first)
    state["calls"] += 1
    firsts = [r["first_score"] for r in records]
    run.log(f"{NAME}/first_pass_score", mean(firsts))
    run.log(f"{NAME}/context_tokens", mean([float(r["tokens"]) for r in records]))
    run.log(f"{NAME}/first_rollouts_total", state["first_rollouts"])
    try:
        return (yield)
    finally:
        request.prompts = original


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if state:
        metrics[f"{NAME}/first_rollouts"] = state["first_rollouts"]
