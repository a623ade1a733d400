"""EvoTool: a harness of named modules improved by trajectory-grounded blame attribution,
targeted mutation of the blamed module only, and diversity-aware selection.

Each ``rlmix_evolve`` call is one reflection:

1. **Select** a parent from the population (``diverse_parent``): among the candidates no other
   candidate dominates on the per-task scores, drawn in proportion to one plus the number of
   tasks only that candidate solves, so candidates that solve complementary subsets survive.
2. **Blame** each failed evaluation trace of the parent on one module (``blame``): ``tags``
   reads the first module name in the trace's output or feedback; ``judge`` asks the
   reflection LM which module failed.
3. **Mutate** (``target``): ``blame`` rewrites only the module blamed most, from the traces
   blamed on it; the baselines are ``round_robin`` (GEPA's component choice: the next module in
   turn, from all failed traces) and ``whole`` (every module rewritten at once).
4. **Accept** the child when its mean on the evaluation tasks is strictly higher than its
   parent's; an accepted child that fails a task its parent solved is a *collateral
   regression* (counted).

The candidate with the best mean is applied. The budget counts metric calls (one scored rollout
of one task), the seed's included; state is in ``run.state["evotool"]``.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    configure_evolver,
    evolved_components,
    mean,
    reflection_lm,
    score_tasks,
    split_pool,
    traces,
)
from rlmix_lm import LMSettings

import rlmix
from rlmix.manifest import check_choices
from rlmix.types import HarnessUpdate, RolloutBatch, Run

NAME = "evotool"
TARGETS = ("blame", "round_robin", "whole")
BLAMES = ("tags", "judge")


@dataclass
class Settings:
    components: list[str] = field(default_factory=list)  # the modules; [] = every component
    budget: int = 120  # metric calls (one scored rollout of one task), the seed's included
    eval_size: int = 8  # tasks every candidate is scored on (the same tasks each time)
    target: str = "blame"  # blame | round_robin | whole (baselines)
    blame: str = "tags"  # tags (module names in the trace) | judge (the reflection LM)
    population: int = 8  # candidates kept; beyond it the lowest mean dominated one goes
    metric: str = ""  # reward term to maximise, e.g. arith.correct; "" = the weighted reward
    temperature: float = 0.0  # task rollouts (0 = greedy: scores are repeatable)
    max_new_tokens: int = 0  # task rollouts; 0 = sampling.max_new_tokens
    task_step_base: int = 1_600_000  # tasks are rlmix_prompts(run, task_step_base + k)
    feedback_chars: int = 300
    traces_per_prompt: int = 4
    seed: int = 0
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        check_choices(self, target=TARGETS, blame=BLAMES)
        if self.budget < 1 or self.eval_size < 1 or self.population < 1:
            raise ValueError("budget: budget, eval_size and population must be >= 1")


# ---------------------------------------------------------------- pure parts


def dominated(scores: Sequence[Sequence[float]], c: int) -> bool:
    """Whether another candidate is at least as good on every task and better on one."""
    mine = scores[c]
    return any(all(o >= m for o, m in zip(other, mine)) and any(o > m for o, m in zip(other, mine))
               for k, other in enumerate(scores) if k != c)


def unique_wins(scores: Sequence[Sequence[float]]) -> list[int]:
    """Per candidate, the tasks it alone solves (score 1) among all candidates."""
    out = [0] * len(scores)
    for t in range(len(scores[0]) if scores else 0):
        solvers = [c for c, s in enumerate(scores) if s[t] >= 1.0]
        if len(solvers) == 1:
            out[solvers[0]] += 1
    return out


def diverse_parent(scores: Sequence[Sequence[float]], rng: random.Random) -> int:
    """A non-dominated candidate, drawn with weight one plus its unique wins."""
    front = [c for c in range(len(scores)) if not dominated(scores, c)]
    wins = unique_wins(scores)
    return rng.choices(front, weights=[1 + wins[c] for c in front])[0]


def blame_by_tags(record: dict[str, Any], modules: Sequence[str]) -> str | None:
    """The module whose name comes first in the trace's output, else in its feedback."""
    for text in (record.get("output", ""), record.get("feedback", "")):
        hits = [(m.start(), m.group(0)) for m in
                re.finditer(r"\b(" + "|".join(map(re.escape, modules)) + r")\b", str(text))]
        if hits:
            return min(hits)[1]
    return None


def most_blamed(blames: Sequence[str | None], modules: Sequence[str]) -> str | None:
    """The module blamed for the most failures (ties: the earlier module)."""
    counts = Counter(b for b in blames if b is not None)
    if not counts:
        return None
    return max(modules, key=lambda m: (counts.get(m, 0), -modules.index(m))) \
        if counts else None


def regressions(parent: Sequence[float], child: Sequence[float]) -> int:
    """Tasks the parent solved and the child fails (pass -> fail)."""
    return sum(p >= 1.0 and c < 1.0 for p, c in zip(parent, child))


# ---------------------------------------------------------------- prompts

_BLOCK = re.compile(r"Module (\w+):\s*\n```[^\n]*\n(.*?)\n?```", re.S)
_FENCE = re.compile(r"```[^\n]*\n(.*?)\n?```", re.S)


def reflection_prompt(modules: dict[str, str], records: list[dict[str, Any]]) -> str:
    lines = ["You are improving an AI assistant made of modules. Rewrite the module(s) below "
             "so that the failures go away."]
    for name, text in modules.items():
        lines += [f"Module {name}:", "```", text, "```"]
    lines.append("Failures:")
    for k, t in enumerate(records, 1):
        lines += [f"## Failure {k}", f"Input: {t['input']}", f"Output: {t['output']}"]
        if t.get("feedback"):
            lines.append(f"Feedback: {t['feedback']}")
    lines.append("Reply with each rewritten module as `Module <name>:` followed by its new text "
                 "between ``` lines.")
    return "\n".join(lines)


def parse_modules(reply: str, asked: Sequence[str]) -> dict[str, str]:
    """``{module: text}`` from ``Module <name>:`` blocks for the modules asked about; a single
    asked module may also come as one bare fenced block."""
    found = {m: t.strip() for m, t in _BLOCK.findall(reply) if m in asked}
    if not found and len(asked) == 1:
        bare = _FENCE.search(reply)
        if bare:
            found = {asked[0]: bare.group(1).strip()}
    return found


def judge_prompt(modules: Sequence[str], record: dict[str, Any]) -> str:
    return "\n".join([f"An AI assistant made of the modules {', '.join(modules)} failed a task.",
                      f"Input: {record['input']}", f"Output: {record['output']}",
                      f"Feedback: {record.get('feedback', '')}",
                      "Which one module caused the failure? Answer with its name only."])


# ---------------------------------------------------------------- the search


def _evaluate(run: Run, texts: dict[str, str], tasks: list[Any]
              ) -> tuple[list[float], RolloutBatch]:
    s = run.settings(NAME)
    return score_tasks(run, {**run.harness, **texts}, tasks, temperature=s.temperature,
                       max_new_tokens=s.max_new_tokens or None, metric=s.metric, owner=NAME)


def _add(state: dict[str, Any], texts: dict[str, str], scores: list[float],
         batch: RolloutBatch, chars: int) -> int:
    state["candidates"].append({"texts": dict(texts), "scores": scores,
                                "traces": traces(batch, scores, chars)})
    return len(state["candidates"]) - 1


def init_state(run: Run) -> dict[str, Any]:
    s = run.settings(NAME)
    names = evolved_components(run, NAME)
    pool = split_pool(run, {"selection": s.eval_size}, s.task_step_base)
    state = run.state[NAME] = {
        "components": names, "tasks": [list(t) for t in pool["selection"]], "candidates": [],
        "metric_calls": 0, "iteration": 0, "reflections": 0, "judge_calls": 0,
        "collateral": 0, "reached_at": None, "applied": 0, "history": []}
    tasks = [tuple(t) for t in state["tasks"]]
    scores, batch = _evaluate(run, {c: run.harness[c] for c in names}, tasks)
    state["metric_calls"] += len(tasks)
    _add(state, {c: run.harness[c] for c in names}, scores, batch, s.feedback_chars)
    return state


def _blame(run: Run, state: dict[str, Any], record: dict[str, Any]) -> str | None:
    s = run.settings(NAME)
    modules = state["components"]
    if s.blame == "tags":
        return blame_by_tags(record, modules)
    state["judge_calls"] += 1
    reply = reflection_lm(run, NAME).complete(judge_prompt(modules, record), 16, 0.0)
    return blame_by_tags({"output": reply}, modules)


def _prune(state: dict[str, Any], cap: int) -> None:
    cands = state["candidates"]
    while len(cands) > cap:
        scores = [c["scores"] for c in cands]
        weak = [k for k in range(len(cands)) if dominated(scores, k)] or list(range(len(cands)))
        gone = min(weak, key=lambda k: (mean(cands[k]["scores"]), -k))
        if gone == state["applied"]:
            break
        del cands[gone]
        state["applied"] -= int(state["applied"] > gone)


def reflect(run: Run, state: dict[str, Any]) -> dict[str, Any]:
    s = run.settings(NAME)
    rng = random.Random(f"evotool-{s.seed}-{state['iteration']}")
    scores = [c["scores"] for c in state["candidates"]]
    parent = diverse_parent(scores, rng)
    cand = state["candidates"][parent]
    failed = [t for t in cand["traces"] if t["score"] < 1.0]
    record: dict[str, Any] = {"iteration": state["iteration"], "parent": parent,
                              "accepted": False}
    modules = state["components"]
    if s.target == "blame":
        blames = [_blame(run, state, t) for t in failed]
        chosen = most_blamed(blames, modules)
        if chosen is None:
            record["why"] = "nothing to blame"
            return record
        shown = [t for t, b in zip(failed, blames) if b == chosen]
        asked = [chosen]
    elif s.target == "round_robin":
        asked = [modules[state["iteration"] % len(modules)]]
        shown = failed
    else:
        asked = list(modules)
        shown = failed
    record["modules"] = asked
    state["reflections"] += 1
    reply = reflection_lm(run, NAME).complete(
        reflection_prompt({m: cand["texts"][m] for m in asked}, shown[:s.traces_per_prompt]),
        s.lm.max_new_tokens, s.lm.temperature)
    new = {m: t for m, t in parse_modules(reply, asked).items() if t != cand["texts"][m]}
    if not new:
        record["why"] = "no new text"
        return record
    child = {**cand["texts"], **new}
    tasks = [tuple(t) for t in state["tasks"]]
    c_scores, batch = _evaluate(run, child, tasks)
    state["metric_calls"] += len(tasks)
    record["child_mean"], record["parent_mean"] = mean(c_scores), mean(cand["scores"])
    if mean(c_scores) > mean(cand["scores"]):
        record["accepted"] = True
        record["regressions"] = regressions(cand["scores"], c_scores)
        state["collateral"] += int(record["regressions"] > 0)
        record["child"] = _add(state, child, c_scores, batch, s.feedback_chars)
        if mean(c_scores) == 1.0 and state["reached_at"] is None:
            state["reached_at"] = state["reflections"]
        _prune(state, s.population)
    return record


def best(state: dict[str, Any]) -> int:
    means = [mean(c["scores"]) for c in state["candidates"]]
    return max(range(len(means)), key=lambda k: (means[k], -k))


def iterate(run: Run) -> HarnessUpdate | None:
    """One reflection; the harness update when the best candidate changed."""
    s = run.settings(NAME)
    if NAME not in run.state and not evolved_components(run, NAME):
        return None
    state = run.state.get(NAME) or init_state(run)
    if state["metric_calls"] + len(state["tasks"]) > s.budget:
        return None
    state["history"].append(reflect(run, state))
    state["iteration"] += 1
    top = best(state)
    texts = state["candidates"][top]["texts"]
    if texts == state["candidates"][state["applied"]]["texts"]:
        return None
    state["applied"] = top
    return HarnessUpdate(
        components=dict(texts),
        evidence=(f"candidate {top}: mean {mean(state['candidates'][top]['scores']):.3f} over "
                  f"{len(state['tasks'])} tasks after {state['reflections']} reflections "
                  f"({state['collateral']} with collateral regressions); "
                  f"{state['metric_calls']} metric calls"),
        parent_version=run.harness_version, source=NAME)


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    configure_evolver(run, NAME)


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return iterate(run)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if not state or not state["candidates"]:
        return
    run.log("evotool/metric_calls", state["metric_calls"])
    run.log("evotool/reflections", state["reflections"])
    run.log("evotool/collateral_regressions", state["collateral"])
    run.log("evotool/best", mean(state["candidates"][best(state)]["scores"]))
    run.log("evotool/population", len(state["candidates"]))
