"""In-context distillation with a self-consistency cascade: a frozen student shown retrieved
teacher demonstrations, trusted when its samples agree, deferring to the teacher otherwise.

The paper (seed 004, paragraph 13) cuts agent inference cost without fine-tuning: at each
step it retrieves relevant teacher demonstrations as in-context examples for a cheap student
(in-context distillation), and a self-consistency cascade decides when to trust the student.
On ALFWorld it matches teacher accuracy at 2.5x lower cost.

In rlmix, a wrapper on ``rlmix_generate`` (the rollout engine is the frozen student; the
teacher is an ``rlmix_lm`` model):

1. **retrieval**: the ``k`` banked teacher runs most similar to the task (word Jaccard) are
   inserted before the task as user / assistant turns;
2. **self-consistency**: the student is sampled ``samples`` times (``temperature``); each reply
   is reduced to its answer (``answer``: the last number, the stripped text, or ``regex``'s
   first group) and the majority answer's share is computed;
3. **cascade**: share ``>= tau`` returns the student's majority reply; otherwise the teacher
   answers the task (without demonstrations) and its run ``(task, reply)`` is banked (capped at
   ``max_demos``: the least used, then the oldest, is evicted). Teacher calls and tokens (prompt
   + reply) are counted.

``mode: teacher`` always defers (teacher-only), ``mode: student`` never does (student-only);
both are the claim's baselines. The caller gets its ``n`` rows per prompt; in harness-only mode
(``teacher_rows: auto``) a row answered by the teacher carries the teacher's text with
``completion_mask`` zeroed, so no trainer learns from tokens the student did not produce; when
training, the student's own samples are kept (the teacher's reply is in ``info``). State (bank,
counters) in ``run.state["icl_cascade"]``.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    cut,
    inside_rendering,
    reflection_lm,
    rendering,
    similarity,
    user_text,
)
from rlmix_lm import LMSettings

import rlmix
from rlmix.types import GenerationRequest, Prompt, RolloutBatch, Run

NAME = "icl_cascade"
MODES = ("cascade", "teacher", "student")
TEACHER_ROWS = ("auto", "replace", "keep")
ANSWERS = ("last_number", "text", "regex")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_LOCK = threading.Lock()


@dataclass
class Settings:
    mode: str = "cascade"  # cascade | teacher (always defer) | student (never defer)
    k: int = 2  # demonstrations shown per task
    samples: int = 5  # student samples per task (self-consistency)
    temperature: float = 0.7  # student sampling temperature
    tau: float = 0.8  # the majority answer's share needed to trust the student
    answer: str = "last_number"  # last_number | text | regex
    regex: str = ""  # answer: regex, the answer is the first group
    max_demos: int = 256  # bank cap: the least used, then the oldest, is evicted
    min_similarity: float = 0.0  # demonstrations less similar than this are not shown
    text_chars: int = 400  # a banked task or reply is cut to this many characters
    # a deferred task's rows: replace (the teacher's text, completion_mask zeroed), keep (the
    # student's own samples; the teacher's reply only in info), auto (replace in harness-only
    # mode, keep when training: RL learns from the student's own samples)
    teacher_rows: str = "auto"
    lm: LMSettings = field(default_factory=LMSettings)  # the teacher

    def __post_init__(self) -> None:
        rlmix.check_choices(self, mode=MODES, answer=ANSWERS, teacher_rows=TEACHER_ROWS)
        if self.k < 0:
            raise ValueError(f"k: must be >= 0, got {self.k}")
        if self.samples < 1:
            raise ValueError(f"samples: must be >= 1, got {self.samples}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"tau: must be in (0, 1], got {self.tau}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.answer == "regex":
            if not self.regex:
                raise ValueError("regex: answer 'regex' needs a regex with one group")
            re.compile(self.regex)
        if self.max_demos < 1:
            raise ValueError(f"max_demos: must be >= 1, got {self.max_demos}")


# ---------------------------------------------------------------- pure pieces


def extract(text: str, s: Settings) -> str:
    """The answer a reply gives, for voting ("" when it gives none)."""
    if s.answer == "text":
        return " ".join(text.split())
    if s.answer == "regex":
        found = re.search(s.regex, text, re.S)
        return found.group(1).strip() if found and found.groups() else ""
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else ""


def majority(answers: list[str]) -> tuple[str, float]:
    """The most common non-empty answer (the first reached among ties) and its share of all
    samples (empty answers count against it)."""
    votes = Counter(a for a in answers if a)
    if not votes:
        return "", 0.0
    best = max(votes, key=lambda a: (votes[a], -answers.index(a)))
    return best, votes[best] / len(answers)


def retrieve(bank: list[dict[str, Any]], task: str, k: int, floor: float
             ) -> list[dict[str, Any]]:
    """The ``k`` banked runs most similar to ``task`` (newer first among equals), at least
    ``floor`` similar."""
    scored = [(similarity(task, d["task"]), d) for d in bank]
    scored = [(v, d) for v, d in scored if v >= floor]
    scored.sort(key=lambda p: (-p[0], -int(p[1]["id"])))
    return [d for _, d in scored[:k]]


def with_demos(prompt: Prompt, demos: list[dict[str, Any]]) -> Prompt:
    """The prompt with each demonstration as a user / assistant turn before its last user
    message (the most similar nearest to the task)."""
    if not demos:
        return prompt
    messages = [dict(m) for m in prompt.messages]
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"),
               default=len(messages) - 1)
    turns = []
    for d in reversed(demos):
        turns += [{"role": "user", "content": d["task"]},
                  {"role": "assistant", "content": d["reply"]}]
    return Prompt(messages=messages[:last] + turns + messages[last:], answer=prompt.answer,
                  id=prompt.id, info=dict(prompt.info))


def bank_run(bank: list[dict[str, Any]], state: dict[str, Any], task: str, reply: str,
             step: int, cap: int) -> list[dict[str, Any]]:
    """Bank a teacher run (replacing one of the same task); evict beyond ``cap``."""
    bank[:] = [d for d in bank if d["task"] != task]
    bank.append({"id": int(state["next_id"]), "task": task, "reply": reply, "uses": 0,
                 "step": step})
    state["next_id"] += 1
    if len(bank) <= cap:
        return []
    ranked = sorted(bank, key=lambda d: (int(d["uses"]), int(d["id"])))
    gone = ranked[:len(bank) - cap]
    ids = {int(d["id"]) for d in gone}
    bank[:] = [d for d in bank if int(d["id"]) not in ids]
    return gone


def count_tokens(text: str, tokenizer: Any = None) -> int:
    if tokenizer is not None:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return len(text.split())


# ---------------------------------------------------------------- the wrapper's work


def state_of(run: Run) -> dict[str, Any]:
    state = run.state.get(NAME)
    if state is None:
        state = run.state[NAME] = {"bank": [], "next_id": 0, "tasks": 0, "teacher_calls": 0,
                                   "teacher_tokens": 0, "student_samples": 0, "evicted": 0}
    return state


def student_samples(s: Settings) -> int:
    """Samples per task: one in teacher-only mode (the student's reply is never used)."""
    return 1 if s.mode == "teacher" else s.samples


def finish(run: Run, prompts: list[Prompt], n: int, student: RolloutBatch) -> RolloutBatch:
    """Vote, defer, bank, and build the caller's ``n`` rows per prompt."""
    s = run.settings(NAME)
    state = state_of(run)
    samples = student_samples(s)
    rows, deferred, shares = [], [], []
    votes = []
    for i in range(len(prompts)):
        block = list(range(i * samples, (i + 1) * samples))
        answers = [extract(student.texts[r], s) for r in block]
        best, share = majority(answers)
        shares.append(share)
        trust = s.mode == "student" or (s.mode == "cascade" and share >= s.tau and best)
        if trust:
            agreeing = [r for r, a in zip(block, answers) if a == best] or block
            rows += [agreeing[j % len(agreeing)] for j in range(n)]
        else:
            deferred.append(i)
            rows += [block[j % len(block)] for j in range(n)]
        votes.append((best, share, bool(trust)))
    replies: dict[int, str] = {}
    if deferred:
        teacher = reflection_lm(run, NAME)
        asks = [prompts[i].messages for i in deferred]
        got = teacher.complete_batch(asks, s.lm.max_new_tokens, s.lm.temperature)
        tok = run.tokenizer
        with _LOCK:
            for i, reply in zip(deferred, got):
                replies[i] = reply
                task = cut(user_text(prompts[i]), s.text_chars)
                state["teacher_tokens"] += count_tokens(
                    "\n".join(m["content"] for m in prompts[i].messages), tok) + \
                    count_tokens(reply, tok)
                gone = bank_run(state["bank"], state, task, cut(reply, s.text_chars), run.step,
                                s.max_demos)
                state["evicted"] += len(gone)
            state["teacher_calls"] += len(deferred)
    replace = s.teacher_rows == "replace" or (
        s.teacher_rows == "auto" and str(run.config.train.mode) == "harness-only")
    out = student.select(rows)
    out.info = [dict(x) for x in out.info]
    out.completion_mask = out.completion_mask.clone()
    for j in range(len(out)):
        i = j // n
        best, share, trusted = votes[i]
        source = "student" if trusted else "teacher"
        out.info[j][NAME] = {"share": share, "majority": best, "source": source}
        if not trusted:
            out.info[j][NAME]["teacher"] = replies[i]
        if not trusted and replace:
            out.texts[j] = replies[i]
            out.completion_mask[j] = 0.0  # the student did not produce these tokens
    with _LOCK:
        state["tasks"] += len(prompts)
        state["student_samples"] += len(student)
    run.log(f"{NAME}/deferral_rate", len(deferred) / max(1, len(prompts)))
    run.log(f"{NAME}/agreement", sum(shares) / max(1, len(shares)))
    return out


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    state_of(run)
    if s.mode != "student" and s.lm.source != "policy":
        reflection_lm(run, NAME)  # load or connect to the teacher now


@rlmix.hookimpl(wrapper=True)
def rlmix_generate(run: Run, request: GenerationRequest) -> Generator[None, Any, Any]:
    if not request.prompts or inside_rendering(run, NAME):
        return (yield)  # the teacher is the policy (lm.source: policy): plain generation
    s = run.settings(NAME)
    state = state_of(run)
    original = (request.prompts, request.n, request.temperature)
    prompts = list(request.prompts)
    shown = []
    for p in prompts:
        demos = retrieve(state["bank"], user_text(p), s.k, s.min_similarity) if s.k else []
        for d in demos:
            d["uses"] += 1
        shown.append(with_demos(p, demos))
    # the owner (the frozen student) samples every task `samples` times, demonstrations shown
    request.prompts, request.n, request.temperature = shown, student_samples(s), s.temperature
    try:
        student = yield
    finally:
        request.prompts, request.n, request.temperature = original
    with rendering(run, NAME):
        return finish(run, prompts, int(original[1]), student)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if state:
        metrics[f"{NAME}/teacher_calls"] = state["teacher_calls"]
        metrics[f"{NAME}/teacher_tokens"] = state["teacher_tokens"]
        metrics[f"{NAME}/teacher_call_rate"] = state["teacher_calls"] / max(1, state["tasks"])
        metrics[f"{NAME}/bank"] = len(state["bank"])
