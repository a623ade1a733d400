"""DarwinX: harness evolution as selection over a population of lineages, with the model
frozen.

- **Preserve and extend.** A variant is admitted only when the set of tasks it solves strictly
  contains its parent's (each parent's, for a recombination): no admitted edit ever loses a
  task, so every lineage's solved set grows monotonically.
- **An archive of lineages.** A child of the root starts a lineage; a child of a lineage's head
  extends it. The root and every head stay expandable, so alternative lines are kept.
- **Recombination.** Two heads whose lines changed different components are merged component
  by component (each component from the head that changed it).
- **One edit interface.** Failure evidence (the parent's failed traces), teacher evidence
  (demonstrations from a file) and self evidence (its solved traces) go into one edit prompt as
  typed blocks.

``mode: single_lineage`` is the baseline: one line, components in turn, a child kept when its
mean score rises (accept-if-better), no recombination. The budget counts metric calls (one
scored rollout of one task), the seed's included; state is in ``run.state["darwinx"]``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlmix_harness import (
    configure_evolver,
    evolved_components,
    fenced_text,
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

NAME = "darwinx"
MODES = ("darwinx", "single_lineage")


@dataclass
class Settings:
    components: list[str] = field(default_factory=list)  # harness components; [] = all
    budget: int = 120  # metric calls (one scored rollout of one task), the seed's included
    eval_size: int = 8  # tasks every variant is scored on (the same tasks each time)
    mode: str = "darwinx"  # darwinx | single_lineage (accept-if-better baseline)
    recombine: bool = True  # merge two heads that changed different components
    teacher_path: str = ""  # optional JSON lines of {"input", "output"}: teacher evidence
    metric: str = ""  # reward term to maximise, e.g. arith.correct; "" = the weighted reward
    temperature: float = 0.0  # task rollouts (0 = greedy: scores are repeatable)
    max_new_tokens: int = 0  # task rollouts; 0 = sampling.max_new_tokens
    task_step_base: int = 1_800_000  # tasks are rlmix_prompts(run, task_step_base + k)
    feedback_chars: int = 300
    traces_per_block: int = 3  # traces per evidence block
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        check_choices(self, mode=MODES)
        if self.budget < 1 or self.eval_size < 1 or self.traces_per_block < 0:
            raise ValueError("budget: budget and eval_size must be >= 1, traces_per_block >= 0")


# ---------------------------------------------------------------- pure parts


def solved(scores: Sequence[float]) -> set[int]:
    return {i for i, v in enumerate(scores) if v >= 1.0}


def extends(child: set[int], parents: Sequence[set[int]]) -> bool:
    """The preserve-and-extend contract: a strict superset of every parent's solved set."""
    return all(child > p for p in parents)


def changed(texts: dict[str, str], root: dict[str, str]) -> set[str]:
    return {c for c in texts if texts[c] != root.get(c)}


def recombination(a: dict[str, str], b: dict[str, str], root: dict[str, str],
                  solved_a: set[int], solved_b: set[int]) -> dict[str, str] | None:
    """Component-wise merge of two heads: each component from the head that changed it (the
    one solving more when both did); None when their changes do not complement each other
    (one head changed nothing the other did not)."""
    ca, cb = changed(a, root), changed(b, root)
    if not ca - cb or not cb - ca:
        return None
    out = {}
    for c in root:
        if c in ca and c in cb:
            out[c] = a[c] if len(solved_a) >= len(solved_b) else b[c]
        elif c in ca:
            out[c] = a[c]
        elif c in cb:
            out[c] = b[c]
        else:
            out[c] = root[c]
    return out


def edit_prompt(component: str, texts: dict[str, str], failures: list[dict[str, Any]],
                teacher: list[dict[str, str]], own: list[dict[str, Any]]) -> str:
    lines = ["You are improving an AI assistant's harness. Its components:"]
    for name, text in texts.items():
        lines += [f"Component {name}:", "```", text, "```"]
    lines.append(f"Edit: {component}")
    for kind, rows in (("failure", failures), ("teacher", teacher), ("self", own)):
        for t in rows:
            lines.append(f"[{kind}] Input: {t['input']} | Output: {t['output']}")
    lines.append("Rewrite the component named after 'Edit:' so that the failures are solved and "
                 "nothing solved is lost. Reply with its new text between ``` lines.")
    return "\n".join(lines)




parse_proposal = fenced_text  # the text inside the reply's first ``` fence


def read_teacher(path: str) -> list[dict[str, str]]:
    if not path:
        return []
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [{"input": str(r["input"]), "output": str(r["output"])} for r in rows]


# ---------------------------------------------------------------- the search


def _evaluate(run: Run, state: dict[str, Any], texts: dict[str, str]
              ) -> tuple[list[float], RolloutBatch]:
    s = run.settings(NAME)
    tasks = [tuple(t) for t in state["tasks"]]
    scores, batch = score_tasks(run, {**run.harness, **texts}, tasks, temperature=s.temperature,
                                max_new_tokens=s.max_new_tokens or None, metric=s.metric,
                                owner=NAME)
    state["metric_calls"] += len(tasks)
    return scores, batch


def _add(state: dict[str, Any], texts: dict[str, str], parents: list[int], scores: list[float],
         batch: RolloutBatch, chars: int, lineage: int | None) -> int:
    state["variants"].append({"texts": dict(texts), "parents": parents, "scores": scores,
                              "traces": traces(batch, scores, chars), "lineage": lineage})
    return len(state["variants"]) - 1


def init_state(run: Run) -> dict[str, Any]:
    s = run.settings(NAME)
    names = evolved_components(run, NAME)
    pool = split_pool(run, {"selection": s.eval_size}, s.task_step_base)
    state = run.state[NAME] = {
        "components": names, "tasks": [list(t) for t in pool["selection"]], "variants": [],
        "lineages": [], "tried": [], "merged": [], "metric_calls": 0, "iteration": 0,
        "history": [], "teacher": read_teacher(s.teacher_path)}
    root = {c: run.harness[c] for c in names}
    scores, batch = _evaluate(run, state, root)
    _add(state, root, [], scores, batch, s.feedback_chars, None)
    return state


def heads(state: dict[str, Any]) -> list[int]:
    return [line[-1] for line in state["lineages"]]


def _propose(run: Run, state: dict[str, Any], parent: int, component: str) -> str:
    s = run.settings(NAME)
    v = state["variants"][parent]
    fails = [t for t in v["traces"] if t["score"] < 1.0][:s.traces_per_block]
    own = [t for t in v["traces"] if t["score"] >= 1.0][:s.traces_per_block]
    reply = reflection_lm(run, NAME).complete(
        edit_prompt(component, v["texts"], fails, state["teacher"][:s.traces_per_block], own),
        s.lm.max_new_tokens, s.lm.temperature)
    return parse_proposal(reply)


def _try_recombination(run: Run, state: dict[str, Any]) -> dict[str, Any] | None:
    s = run.settings(NAME)
    root = state["variants"][0]["texts"]
    tips = heads(state)
    for i, a in enumerate(tips):
        for b in tips[i + 1:]:
            if [a, b] in state["merged"]:
                continue
            va, vb = state["variants"][a], state["variants"][b]
            merged = recombination(va["texts"], vb["texts"], root, solved(va["scores"]),
                                   solved(vb["scores"]))
            state["merged"].append([a, b])
            if merged is None:
                continue
            record = {"kind": "recombination", "parents": [a, b], "admitted": False}
            scores, batch = _evaluate(run, state, merged)
            record["score"] = mean(scores)
            if extends(solved(scores), [solved(va["scores"]), solved(vb["scores"])]):
                line = len(state["lineages"])
                child = _add(state, merged, [a, b], scores, batch, s.feedback_chars, line)
                state["lineages"].append([child])
                record["admitted"], record["child"] = True, child
            return record
    return None


def darwinx_round(run: Run, state: dict[str, Any]) -> dict[str, Any]:
    s = run.settings(NAME)
    if s.recombine:
        record = _try_recombination(run, state)
        if record is not None:
            return record
    # the expandable nodes (root and lineage heads) x components, least-tried pair first
    options = [(n, c) for n in [0, *heads(state)] for c in state["components"]
               if [n, c] not in state["tried"]]
    if not options:
        return {"kind": "none", "why": "every node and component tried", "admitted": False}
    parent, component = options[0]
    state["tried"].append([parent, component])
    record: dict[str, Any] = {"kind": "mutation", "parent": parent, "component": component,
                              "admitted": False}
    text = _propose(run, state, parent, component)
    v = state["variants"][parent]
    if not text or text == v["texts"][component]:
        record["why"] = "no new text"
        return record
    child_texts = {**v["texts"], component: text}
    scores, batch = _evaluate(run, state, child_texts)
    record["score"] = mean(scores)
    if not extends(solved(scores), [solved(v["scores"])]):
        record["why"] = "does not preserve and extend its parent's solved set"
        return record
    line = v["lineage"]
    if line is None:  # a child of the root starts a lineage
        line = len(state["lineages"])
        state["lineages"].append([])
    child = _add(state, child_texts, [parent], scores, batch, s.feedback_chars, line)
    state["lineages"][line].append(child)
    record["admitted"], record["child"] = True, child
    return record


def single_round(run: Run, state: dict[str, Any]) -> dict[str, Any]:
    """The baseline: one line, components in turn, accept-if-better."""
    s = run.settings(NAME)
    if not state["lineages"]:
        state["lineages"].append([0])
    parent = state["lineages"][0][-1]
    component = state["components"][state["iteration"] % len(state["components"])]
    record: dict[str, Any] = {"kind": "mutation", "parent": parent, "component": component,
                              "admitted": False}
    text = _propose(run, state, parent, component)
    v = state["variants"][parent]
    if not text or text == v["texts"][component]:
        record["why"] = "no new text"
        return record
    child_texts = {**v["texts"], component: text}
    scores, batch = _evaluate(run, state, child_texts)
    record["score"] = mean(scores)
    if mean(scores) > mean(v["scores"]):
        child = _add(state, child_texts, [parent], scores, batch, s.feedback_chars, 0)
        state["lineages"][0].append(child)
        record["admitted"], record["child"] = True, child
    return record


def best(state: dict[str, Any]) -> int:
    means = [mean(v["scores"]) for v in state["variants"]]
    return max(range(len(means)), key=lambda k: (means[k], -k))


def iterate(run: Run) -> HarnessUpdate | None:
    s = run.settings(NAME)
    if NAME not in run.state and not evolved_components(run, NAME):
        return None
    state = run.state.get(NAME) or init_state(run)
    if state["metric_calls"] + len(state["tasks"]) > s.budget:
        return None
    record = (darwinx_round if s.mode == "darwinx" else single_round)(run, state)
    record["iteration"] = state["iteration"]
    state["history"].append(record)
    state["iteration"] += 1
    top = best(state)
    texts = state["variants"][top]["texts"]
    if all(run.harness.get(c) == t for c, t in texts.items()):
        return None
    return HarnessUpdate(
        components=dict(texts),
        evidence=(f"variant {top} ({len(state['lineages'])} lineages): mean "
                  f"{mean(state['variants'][top]['scores']):.3f} over {len(state['tasks'])} "
                  f"tasks; {state['metric_calls']} metric calls"),
        parent_version=run.harness_version, source=NAME)


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    configure_evolver(run, NAME)
    read_teacher(run.settings(NAME).teacher_path)


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return iterate(run)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if not state or not state["variants"]:
        return
    run.log("darwinx/metric_calls", state["metric_calls"])
    run.log("darwinx/lineages", len(state["lineages"]))
    run.log("darwinx/variants", len(state["variants"]))
    run.log("darwinx/best", mean(state["variants"][best(state)]["scores"]))
