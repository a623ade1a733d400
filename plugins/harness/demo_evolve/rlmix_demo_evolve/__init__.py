"""DemoEvolve: accept-if-better harness evolution whose proposer reads competent
demonstration trajectories beside the agent's own.

Each ``rlmix_evolve`` call is one proposal:

1. the current harness's evaluation traces (kept from when it was scored) give the failed
   tasks;
2. the demonstrations most similar to those failures (``select_demos``) come from a JSON-lines
   file (``demos_path``: one ``{"input": ..., "output": ...}`` per line) or from a teacher
   model's runs on the failed tasks (``demo_source: teacher``, ``teacher`` an ``rlmix_lm``
   block), banked for later proposals;
3. the reflection LM (``lm``) rewrites one component (round-robin) from the agent's traces and
   the demonstrations;
4. the child is scored on the same evaluation tasks and replaces the current harness only when
   its mean is strictly higher.

With ``demo_source: none`` it is self-rollout evolution, the baseline. The budget counts metric
calls (one scored rollout of one task), the seed's included; state is in
``run.state["demo_evolve"]``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlmix_harness import (
    configure_evolver,
    cut,
    evolved_components,
    fenced_text,
    guard_heldout,
    mean,
    reflection_lm,
    score_tasks,
    similarity,
    split_pool,
    task_prompts,
    traces,
)
from rlmix_lm import LMSettings, make_lm

import rlmix
from rlmix.errors import ConfigError
from rlmix.manifest import check_choices
from rlmix.types import HarnessUpdate, RolloutBatch, Run

NAME = "demo_evolve"
SOURCES = ("file", "teacher", "none")


@dataclass
class Settings:
    components: list[str] = field(default_factory=list)  # harness components; [] = all
    budget: int = 120  # metric calls (one scored rollout of one task), the seed's included
    eval_size: int = 8  # tasks every candidate is scored on (the same tasks each time)
    heldout_size: int = 0  # tasks the search never sees; scored for each accepted candidate
    demo_source: str = "file"  # file | teacher | none (self-rollout evolution, the baseline)
    demos_path: str = ""  # file: JSON lines {"input": ..., "output": ...}; "" = none (warned)
    demos_per_prompt: int = 2  # demonstrations shown per proposal, most similar first
    demo_chars: int = 600  # per demonstration output shown
    teacher: LMSettings = field(default_factory=LMSettings)  # teacher: who demonstrates
    metric: str = ""  # reward term to maximise, e.g. arith.correct; "" = the weighted reward
    temperature: float = 0.0  # task rollouts (0 = greedy: scores are repeatable)
    max_new_tokens: int = 0  # task rollouts; 0 = sampling.max_new_tokens
    task_step_base: int = 1_500_000  # tasks are rlmix_prompts(run, task_step_base + k)
    feedback_chars: int = 300  # per trace shown to the reflection LM
    traces_per_prompt: int = 4  # the agent's own failed traces shown per proposal
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        check_choices(self, demo_source=SOURCES)
        if self.budget < 1 or self.eval_size < 1:
            raise ValueError("budget: budget and eval_size must be >= 1")
        if self.demos_per_prompt < 0 or self.heldout_size < 0 or self.traces_per_prompt < 0:
            raise ValueError("demos_per_prompt: demos_per_prompt, heldout_size and "
                             "traces_per_prompt must be >= 0")


# ---------------------------------------------------------------- demonstrations (pure)


def read_demos(path: str | Path) -> list[dict[str, str]]:
    """The demonstrations of a JSON-lines file; a line without ``input`` and ``output`` is a
    ``ConfigError`` naming the file and line."""
    out = []
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{NAME}.demos_path: no such file: {p}")
    for k, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{NAME}.demos_path: {p}:{k}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not {"input", "output"} <= set(row):
            raise ConfigError(f"{NAME}.demos_path: {p}:{k}: a demonstration needs 'input' and "
                              "'output'")
        out.append({"input": str(row["input"]), "output": str(row["output"])})
    return out


def select_demos(demos: Sequence[dict[str, str]], failed_inputs: Sequence[str], k: int
                 ) -> list[int]:
    """Indices of the ``k`` demonstrations most similar (word Jaccard) to any failed input,
    most similar first; none when nothing failed."""
    if not failed_inputs or k <= 0:
        return []
    relevance = [max(similarity(d["input"], x) for x in failed_inputs) for d in demos]
    order = sorted(range(len(demos)), key=lambda i: (-relevance[i], i))
    return [i for i in order[:k] if relevance[i] > 0]


def reflection_prompt(component: str, text: str, own: list[dict[str, Any]],
                      demos: list[dict[str, str]], chars: int) -> str:
    lines = ["You are improving the instructions given to an AI assistant.",
             f'The part called "{component}" currently reads:', "```", text, "```",
             "Tasks the assistant got wrong with it:"]
    for k, t in enumerate(own, 1):
        lines += [f"## Task {k}", f"Input: {t['input']}", f"Output: {t['output']}",
                  f"Score: {t['score']:g}"]
        if t.get("feedback"):
            lines.append(f"Feedback: {t['feedback']}")
    if demos:
        lines.append("How a competent expert solved similar tasks:")
        for k, d in enumerate(demos, 1):
            lines += [f"## Demonstration {k}", f"Input: {cut(d['input'], chars)}",
                      f"Expert output: {cut(d['output'], chars)}"]
    lines.append("Write a better version of the text so that the assistant does what the "
                 "expert does. Reply with the new text only, between ``` lines.")
    return "\n".join(lines)




parse_proposal = fenced_text  # the text inside the reply's first ``` fence


# ---------------------------------------------------------------- the search


def _evaluate(run: Run, texts: dict[str, str], tasks: list[Any]
              ) -> tuple[list[float], RolloutBatch]:
    s = run.settings(NAME)
    return score_tasks(run, {**run.harness, **texts}, tasks, temperature=s.temperature,
                       max_new_tokens=s.max_new_tokens or None, metric=s.metric, owner=NAME)


def _traces(run: Run, batch: RolloutBatch, scores: list[float]) -> list[dict[str, Any]]:
    return traces(batch, scores, run.settings(NAME).feedback_chars)


def init_state(run: Run) -> dict[str, Any]:
    s = run.settings(NAME)
    names = evolved_components(run, NAME)
    pool = split_pool(run, {"selection": s.eval_size, "heldout": s.heldout_size},
                      s.task_step_base)
    demos = read_demos(s.demos_path) if (s.demo_source == "file" and s.demos_path) else []
    state = run.state[NAME] = {
        "components": names, "tasks": [list(t) for t in pool["selection"]],
        "heldout_tasks": [list(t) for t in pool["heldout"]], "demos": demos,
        "taught": [], "current": {c: run.harness[c] for c in names}, "metric_calls": 0,
        "iteration": 0, "accepted": 0, "heldout": {}, "history": [], "teacher_calls": 0}
    tasks = [tuple(t) for t in state["tasks"]]
    scores, batch = _evaluate(run, state["current"], tasks)
    state["metric_calls"] += len(tasks)
    state["scores"], state["traces"] = scores, _traces(run, batch, scores)
    return state


def _teacher_demos(run: Run, state: dict[str, Any], failed: list[int]) -> None:
    """Bank the teacher's runs on failed evaluation tasks it has not demonstrated yet."""
    s = run.settings(NAME)
    own = run.plugin_resources(NAME)
    teacher = own.get("teacher") or own.setdefault(
        "teacher", make_lm(run, s.teacher, f"{NAME}.teacher"))
    todo = [i for i in failed if i not in state["taught"]][:max(1, s.demos_per_prompt)]
    if not todo:
        return
    tasks = [tuple(state["tasks"][i]) for i in todo]
    prompts = task_prompts(run, {**run.harness, **state["current"]}, tasks)
    replies = teacher.complete_batch([p.messages for p in prompts], s.teacher.max_new_tokens,
                                     s.teacher.temperature)
    state["teacher_calls"] += len(replies)
    for i, prompt, reply in zip(todo, prompts, replies):
        user = next((m["content"] for m in reversed(prompt.messages) if m["role"] == "user"),
                    "")
        state["demos"].append({"input": user, "output": str(reply)})
        state["taught"].append(i)


def propose(run: Run, state: dict[str, Any]) -> dict[str, Any]:
    s = run.settings(NAME)
    failed = [i for i, v in enumerate(state["scores"]) if v < 1.0]
    record: dict[str, Any] = {"iteration": state["iteration"], "accepted": False}
    if s.demo_source == "teacher" and failed:
        _teacher_demos(run, state, failed)
    own = [state["traces"][i] for i in failed][:s.traces_per_prompt]
    shown = (select_demos(state["demos"], [t["input"] for t in own], s.demos_per_prompt)
             if s.demo_source != "none" else [])
    record["demos"] = shown
    names = state["components"]
    component = names[state["iteration"] % len(names)]
    record["component"] = component
    reply = reflection_lm(run, NAME).complete(
        reflection_prompt(component, state["current"][component], own,
                          [state["demos"][i] for i in shown], s.demo_chars),
        s.lm.max_new_tokens, s.lm.temperature)
    text = parse_proposal(reply)
    if not text or text == state["current"][component]:
        record["why"] = "no new text"
        return record
    child = {**state["current"], component: text}
    tasks = [tuple(t) for t in state["tasks"]]
    scores, batch = _evaluate(run, child, tasks)
    state["metric_calls"] += len(tasks)
    record["child_score"], record["parent_score"] = mean(scores), mean(state["scores"])
    if mean(scores) > mean(state["scores"]):
        state["current"], state["scores"] = child, scores
        state["traces"] = _traces(run, batch, scores)
        state["accepted"] += 1
        record["accepted"] = True
    return record


def _score_heldout(run: Run, state: dict[str, Any]) -> None:
    tasks = [tuple(t) for t in state["heldout_tasks"]]
    key = str(state["accepted"])
    if not tasks or key in state["heldout"]:
        return
    guard_heldout(run, tasks)
    scores, _ = _evaluate(run, state["current"], tasks)  # reporting: not budgeted
    state["heldout"][key] = mean(scores)


def iterate(run: Run) -> HarnessUpdate | None:
    """One proposal; the harness update when it was accepted."""
    s = run.settings(NAME)
    if NAME not in run.state and not evolved_components(run, NAME):
        return None
    state = run.state.get(NAME) or init_state(run)
    _score_heldout(run, state)
    if state["metric_calls"] + len(state["tasks"]) > s.budget:
        return None
    record = propose(run, state)
    state["history"].append(record)
    state["iteration"] += 1
    if not record["accepted"]:
        return None
    _score_heldout(run, state)
    return HarnessUpdate(
        components=dict(state["current"]),
        evidence=(f"proposal {record['iteration']} from {len(record['demos'])} "
                  f"demonstration(s): {record['parent_score']:.3f} -> "
                  f"{record['child_score']:.3f} over {len(state['tasks'])} tasks; "
                  f"{state['metric_calls']} metric calls"),
        parent_version=run.harness_version, source=NAME)


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    configure_evolver(run, NAME)
    s = run.settings(NAME)
    if s.demo_source == "file" and not s.demos_path:
        print(f"rlmix: warning: {NAME}: demo_source 'file' with no demos_path shows no "
              "demonstrations (self-rollout evolution); give a JSON-lines file of "
              '{"input": ..., "output": ...}')
    elif s.demo_source == "file":
        read_demos(s.demos_path)  # a bad file fails before the first step


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return iterate(run)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if not state:
        return
    run.log("demo_evolve/metric_calls", state["metric_calls"])
    run.log("demo_evolve/score", mean(state["scores"]))
    run.log("demo_evolve/accepted", state["accepted"])
    run.log("demo_evolve/demos", len(state["demos"]))
    run.log("demo_evolve/teacher_calls", state["teacher_calls"])
    if str(state["accepted"]) in state["heldout"]:
        run.log("demo_evolve/heldout", state["heldout"][str(state["accepted"])])
