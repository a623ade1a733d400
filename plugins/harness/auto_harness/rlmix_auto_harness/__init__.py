"""Adaptive Auto-Harness: a tree of harnesses, routed per task at solve time, on a task stream.

Adaptive Auto-Harness (seed 000, paragraph 6) argues that on an open-ended task stream one
densely updated harness peaks early and then declines, and splits the gap to an oracle harness
into **evolution loss** (no harness built so far solves the task) and **adaptation loss** (one
does, but the task was not given to it). This plugin keeps a tree of harness nodes (the root is
the manifest's harness; a child specialises its parent on the tasks where they disagree) and:

* **routes at solve time**: a wrapper on ``rlmix_prompts`` reads each prompt's *text* (never an
  env's label), finds the most similar tasks in the history (cosine over bag-of-words), and
  re-renders the prompt under the node that scored best on those neighbours;
* **measures both losses** every step: every node solves the step's tasks once more, greedily
  (hindsight); ``evolution_loss = oracle - mean(best node per task)`` and
  ``adaptation_loss = mean(best node per task) - mean(routed node per task)``;
* **evolves statefully**: the node that served the most failures is reflected on (``rlmix_lm``,
  traces of its failures); the child is checked on the tasks that node served recently. Gains
  and no losses: the node is edited in place. Gains and losses: the child is kept as a new node
  beside its parent (a split). No gains: the child is kept as a *draft* that the next step
  refines from its own traces (``draft_tries`` times).

``split: false`` turns it into one densely updated harness (the paper's brittle baseline): an
edit is accepted when it raises the summed score on the check set. State lives in
``run.state["auto_harness"]``, so a checkpointed run resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    Task,
    configure_evolver,
    evolved_components,
    inside_rendering,
    mean,
    prompts_under,
    reflection_lm,
    rendering,
    score_tasks,
    traces,
    user_text,
)
from rlmix_lm import LM, LMSettings

import rlmix
from rlmix.types import HarnessUpdate, Prompt, RolloutBatch, Run

NAME = "auto_harness"
_TOKEN = re.compile(r"[a-z]+\d*|\d+|[+\-*/=×÷]")
_FENCE = re.compile(r"```[^\n`]*\n?(.*?)```", re.S)


@dataclass
class Settings:
    components: list[str] = field(default_factory=list)  # harness components to evolve; [] = all
    split: bool = True  # False: one densely updated harness (no tree, no routing)
    max_nodes: int = 6  # the tree's size limit (root included)
    metric: str = ""  # reward term to maximise, e.g. stream.correct; "" = the weighted reward
    oracle_score: float = 1.0  # the oracle harness's score per task (the metric's best value)
    history_size: int = 64  # most recent tasks kept for routing (with every node's score)
    neighbors: int = 8  # k of the router's nearest-neighbour vote
    check_window: int = 8  # recent tasks served by a node that an edit of it is checked on
    draft_tries: int = 2  # steps a draft with no gain is refined before it is dropped
    max_traces: int = 6  # failures shown to the reflection model
    budget: int = 0  # metric calls (scored rollouts) in all; 0 = unlimited
    temperature: float = 0.0  # hindsight and check rollouts (0 = greedy, repeatable)
    max_new_tokens: int = 0  # those rollouts; 0 = sampling.max_new_tokens
    feedback_chars: int = 400  # env feedback per trace shown to the reflection model
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes: must be >= 1, got {self.max_nodes}")
        if self.history_size < 1 or self.neighbors < 1:
            raise ValueError("history_size: history_size and neighbors must be >= 1")
        if self.check_window < 0 or self.draft_tries < 0 or self.max_traces < 1:
            raise ValueError("check_window: check_window and draft_tries must be >= 0, "
                             "max_traces >= 1")
        if self.budget < 0 or self.max_new_tokens < 0 or self.feedback_chars < 0:
            raise ValueError("budget: budget, max_new_tokens and feedback_chars must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature: must be >= 0")


# ---------------------------------------------------------------- routing (pure)


def _reset_state(run: Run, value: dict[str, Any]) -> dict[str, Any]:
    """``run.plugin_state(NAME)`` (checkpointed) set to ``value``, in place."""
    state = run.plugin_state(NAME)
    state.clear()
    state.update(value)
    return state


def features(text: str, harness_texts: Sequence[str] = ()) -> dict[str, int]:
    """Bag of words of a task's text with the harness texts cut out; numbers count as ``#``."""
    for t in sorted((t for t in harness_texts if t and t.strip()), key=len, reverse=True):
        text = text.replace(t, " ")
    words = ["#" if w.isdigit() else w for w in _TOKEN.findall(text.lower())]
    return dict(Counter(words))


def cosine(a: dict[str, int], b: dict[str, int]) -> float:
    dot = sum(v * b.get(k, 0) for k, v in a.items())
    na = math.sqrt(sum(v * v for v in a.values()))
    nb = math.sqrt(sum(v * v for v in b.values()))
    return dot / (na * nb) if na and nb else 0.0


def estimates(feats: dict[str, int], history: Sequence[dict[str, Any]], neighbors: int
              ) -> dict[int, float]:
    """Each node's similarity-weighted mean score over the ``neighbors`` most similar tasks of
    the history (most recent first among equals); nodes with no score there are absent."""
    ranked = sorted(((cosine(feats, h["features"]), -k, h) for k, h in enumerate(history)),
                    key=lambda x: (x[0], x[1]), reverse=True)
    num: dict[int, float] = {}
    den: dict[int, float] = {}
    for sim, _, h in ranked[:neighbors]:
        if sim <= 0:
            continue
        for node, score in h["scores"].items():
            num[int(node)] = num.get(int(node), 0.0) + sim * float(score)
            den[int(node)] = den.get(int(node), 0.0) + sim
    return {n: num[n] / den[n] for n in num}


def route(feats: dict[str, int], history: Sequence[dict[str, Any]], nodes: Sequence[int],
          neighbors: int) -> int:
    """The node to solve a task with: the best estimate among ``nodes``; ties and no evidence
    go to the lowest id (the root)."""
    est = estimates(feats, history, neighbors)
    known = [n for n in nodes if n in est]
    if not known:
        return min(nodes)
    return max(known, key=lambda n: (est[n], -n))


def oracle_gap(scores: dict[int, Sequence[float]], routed: Sequence[int], oracle: float
               ) -> dict[str, float]:
    """Per-step decomposition over tasks ``i``: ``routed_i`` = score of the node the task was
    routed to, ``best_i`` = best node in the tree on it (hindsight), the oracle's score
    ``oracle``. ``evolution_loss + adaptation_loss = oracle - routed`` (the whole gap)."""
    n = len(routed)
    if not n:
        return {}
    best = [max(float(s[i]) for s in scores.values()) for i in range(n)]
    got = [float(scores[routed[i]][i]) for i in range(n)]
    return {"routed": mean(got), "best_in_tree": mean(best),
            "evolution_loss": oracle - mean(best), "adaptation_loss": mean(best) - mean(got),
            "oracle_gap": oracle - mean(got)}


def decide(parent: Sequence[float], child: Sequence[float], split: bool, room: bool) -> str:
    """What to do with a child checked on the same tasks as its parent: ``edit`` (replace the
    parent), ``split`` (keep both), or ``draft`` (refine it next step)."""
    gains = sum(1 for p, c in zip(parent, child) if c > p)
    losses = sum(1 for p, c in zip(parent, child) if c < p)
    if not split:
        return "edit" if sum(child) > sum(parent) else "draft"
    if gains and not losses:
        return "edit"
    if gains and room:
        return "split"
    if gains and sum(child) > sum(parent):
        return "edit"  # the tree is full: fall back to the single-harness rule
    return "draft"


# ---------------------------------------------------------------- reflection (pure)


def reflection_prompt(component: str, text: str, rows: list[dict[str, Any]]) -> str:
    lines = [f'This is the "{component}" text of an assistant\'s instructions:', "```", text,
             "```", "It failed these tasks:"]
    for k, t in enumerate(rows, 1):
        lines += [f"## Task {k}", f"Input: {t['input']}", f"Output: {t['output']}",
                  f"Score: {t['score']:g} ({t['terms']})"]
        if t.get("feedback"):
            lines.append(f"Feedback: {t['feedback']}")
    lines.append("Rewrite the text so the assistant solves tasks like these. Reply with the new "
                 "text only, between ``` lines.")
    return "\n".join(lines)


def parse_proposal(reply: str) -> str:
    found = _FENCE.search(reply)
    return (found.group(1) if found else reply.replace("```", "")).strip()


# ---------------------------------------------------------------- state


def components(run: Run) -> list[str]:
    return evolved_components(run, NAME)


def init_state(run: Run) -> dict[str, Any]:
    names = components(run)
    root = {"id": 0, "parent": None, "texts": {c: run.harness[c] for c in names},
            "origin": "root", "born": run.step, "edits": 0}
    state = _reset_state(run, {
        "components": names, "nodes": [root], "history": [], "drafts": {}, "metric_calls": 0,
        "splits": 0, "edits": 0, "round": 0, "steps": 0, "log": [], "last": {},
        "served": {}})
    return state


def node_harness(run: Run, node: dict[str, Any]) -> dict[str, str]:
    return {**run.harness, **node["texts"]}


def _lm(run: Run) -> LM:
    return reflection_lm(run, NAME)


def _run_tasks(run: Run, harness: dict[str, str], tasks: Sequence[Task]
               ) -> tuple[list[float], RolloutBatch | None]:
    if not tasks:
        return [], None
    s = run.settings(NAME)
    with rendering(run, NAME):
        scores, batch = score_tasks(run, harness, tasks, temperature=s.temperature,
                                    max_new_tokens=s.max_new_tokens or None, metric=s.metric,
                                    owner=NAME)
    run.plugin_state(NAME)["metric_calls"] += len(tasks)
    return scores, batch


def _save_tree(run: Run, state: dict[str, Any]) -> None:
    folder = run.out_dir / NAME
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tree.json"
    tmp = path.with_suffix(".json.tmp")  # whole, then renamed: a crash leaves no half file
    tmp.write_text(json.dumps({"step": run.step, "nodes": state["nodes"]}, indent=1))
    tmp.replace(path)


# ---------------------------------------------------------------- solve-time routing


def route_prompts(run: Run, step: int, prompts: list[Prompt]) -> list[Prompt]:
    """Each prompt re-rendered under the node the router picks from its text."""
    state = run.plugin_state(NAME)
    if not state:
        return prompts
    s = run.settings(NAME)
    nodes = [n["id"] for n in state["nodes"]]
    cut = [t for t in run.harness.values()]
    rendered: dict[int, list[Prompt]] = {}
    out = []
    for i, prompt in enumerate(prompts):
        node = route(features(user_text(prompt), cut), state["history"], nodes, s.neighbors)
        chosen = prompt
        if state["nodes"][node]["texts"] != {c: run.harness.get(c) for c in state["components"]}:
            if node not in rendered:
                with rendering(run, NAME):
                    harness = node_harness(run, state["nodes"][node])
                    rendered[node] = prompts_under(run, harness, [step])[step]
            chosen = rendered[node][i]
        chosen.info = {**chosen.info, NAME: {"node": node, "task": [int(step), i]}}
        out.append(chosen)
    return out


# ---------------------------------------------------------------- evolution


def step_tasks(run: Run, batch: RolloutBatch) -> tuple[list[Task], list[int], list[Prompt]]:
    """The step's tasks (one per prompt), the node each was routed to, and its prompt."""
    tasks, routed, prompts, seen = [], [], [], set()
    for k, prompt in enumerate(batch.prompts):
        info = prompt.info.get(NAME)
        task = (tuple(info["task"]) if info else (run.step, int(batch.group[k])))
        if task in seen:
            continue
        seen.add(task)
        tasks.append((int(task[0]), int(task[1])))
        routed.append(int(info["node"]) if info else 0)
        prompts.append(prompt)
    return tasks, routed, prompts


def _check_set(state: dict[str, Any], node: int, tasks: list[Task], routed: list[int],
               window: int) -> tuple[list[Task], list[float]]:
    """The tasks an edit of ``node`` is checked on: those it served this step and the last
    ``window`` it served before (with its scores on them)."""
    now = {tuple(t) for t in tasks}
    past = [h for h in state["history"] if h["served"] == node and tuple(h["task"]) not in now
            and node in h["scores"]]
    past = past[len(past) - window:] if window else []
    own = [h for h in state["history"] if tuple(h["task"]) in now and
           routed[tasks.index(tuple(h["task"]))] == node]
    rows = past + own
    return [tuple(h["task"]) for h in rows], [float(h["scores"][node]) for h in rows]


def evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    """One step: hindsight scores of every node, the losses, history, then one reflection."""
    s = run.settings(NAME)
    state = run.plugin_state(NAME) or init_state(run)
    if not state["components"]:
        return None
    tasks, routed, prompts = step_tasks(run, batch)
    nodes = state["nodes"]
    worst = len(nodes) * len(tasks) + len(tasks) + len(tasks) + s.check_window
    if s.budget and state["metric_calls"] + worst > s.budget:
        state["last"] = {}
        return None
    state["steps"] += 1
    # hindsight: every node on every task of the step
    scores: dict[int, list[float]] = {}
    batches: dict[int, RolloutBatch | None] = {}
    for node in nodes:
        scores[node["id"]], batches[node["id"]] = _run_tasks(run, node_harness(run, node), tasks)
    state["last"] = oracle_gap(scores, routed, s.oracle_score)
    for i, task in enumerate(tasks):
        node = nodes[routed[i]]
        feats = features(user_text(prompts[i]), list(node_harness(run, node).values()))
        state["history"].append({"task": list(task), "features": feats, "served": routed[i],
                                 "scores": {n: scores[n][i] for n in scores}})
        state["served"][str(routed[i])] = state["served"].get(str(routed[i]), 0) + 1
    state["history"] = state["history"][-s.history_size:]
    # the node that served the most failures is reflected on
    fails: dict[int, list[int]] = {}
    for i, n in enumerate(routed):
        if scores[n][i] < s.oracle_score:
            fails.setdefault(n, []).append(i)
    record: dict[str, Any] = {"step": run.step, **state["last"]}
    update = None
    if fails:
        target = max(fails, key=lambda n: (len(fails[n]), -n))
        update = _reflect(run, state, target, tasks, routed, fails[target], scores, batches,
                          record)
    state["log"].append(record)
    state["log"] = state["log"][-200:]
    _save_tree(run, state)
    return update


def _reflect(run: Run, state: dict[str, Any], target: int, tasks: list[Task],
             routed: list[int], failed: list[int], scores: dict[int, list[float]],
             batches: dict[int, RolloutBatch | None], record: dict[str, Any]
             ) -> HarnessUpdate | None:
    s = run.settings(NAME)
    node = state["nodes"][target]
    draft = state["drafts"].get(str(target))
    record.update(node=target, failures=len(failed))
    failed_tasks = [tasks[i] for i in failed]
    if draft is not None:  # the stateful part: refine the draft from its own traces
        base = dict(draft["texts"])
        d_scores, d_batch = _run_tasks(run, {**run.harness, **base}, failed_tasks)
        rows = traces(d_batch, d_scores, s.feedback_chars) if d_batch is not None else []
        rows = [r for r in rows if r["score"] < s.oracle_score]
        record["from_draft"] = True
    else:
        base = dict(node["texts"])
        b = batches[target]
        all_rows = traces(b, scores[target], s.feedback_chars) if b is not None else []
        rows = [all_rows[i] for i in failed]
    names = state["components"]
    component = names[state["round"] % len(names)]
    state["round"] += 1
    record["component"] = component
    if not rows:
        state["drafts"].pop(str(target), None)
        record["outcome"] = "draft solves its tasks; dropped"
        return None
    prompt = reflection_prompt(component, base[component], rows[:s.max_traces])
    reply = _lm(run).complete(prompt, s.lm.max_new_tokens, s.lm.temperature)
    proposal = parse_proposal(reply)
    record["proposal"] = proposal[:300]
    if not proposal or proposal == base[component]:
        state["drafts"].pop(str(target), None)
        record["outcome"] = "no new text"
        return None
    child = {**base, component: proposal}
    check, parent_scores = _check_set(state, target, tasks, routed, s.check_window)
    child_scores, _ = _run_tasks(run, {**run.harness, **child}, check)
    room = len(state["nodes"]) < s.max_nodes
    outcome = decide(parent_scores, child_scores, s.split, room)
    record.update(outcome=outcome, parent_check=sum(parent_scores),
                  child_check=sum(child_scores), check=len(check))
    by_task = {tuple(t): c for t, c in zip(check, child_scores)}
    if outcome == "draft":
        tries = (draft["tries"] + 1) if draft is not None else 1
        if tries > s.draft_tries:
            state["drafts"].pop(str(target), None)
        else:
            state["drafts"][str(target)] = {"texts": child, "tries": tries}
        return None
    state["drafts"].pop(str(target), None)
    if outcome == "split":
        new = {"id": len(state["nodes"]), "parent": target, "texts": child, "origin": "split",
               "born": run.step, "edits": 0}
        state["nodes"].append(new)
        state["splits"] += 1
        for h in state["history"]:  # what the child is known to score
            if tuple(h["task"]) in by_task:
                h["scores"][new["id"]] = by_task[tuple(h["task"])]
        record["child"] = new["id"]
        return None
    # edit in place: scores not re-measured under the new text are dropped
    node["texts"] = child
    node["edits"] += 1
    state["edits"] += 1
    for h in state["history"]:
        if tuple(h["task"]) in by_task:
            h["scores"][target] = by_task[tuple(h["task"])]
        else:
            h["scores"].pop(target, None)
    if target != 0:
        return None
    return HarnessUpdate(components=dict(child), parent_version=run.harness_version,
                         source=NAME,
                         evidence=(f"root edited: check {sum(parent_scores):g} -> "
                                   f"{sum(child_scores):g} on {len(check)} recent tasks"))


# ---------------------------------------------------------------- hooks


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    configure_evolver(run, NAME)
    if not run.plugin_state(NAME):
        init_state(run)


@rlmix.hookimpl(wrapper=True)
def rlmix_prompts(run: Run, step: int) -> Generator[None, list[Prompt] | None,
                                                    list[Prompt] | None]:
    prompts = yield
    if not prompts or inside_rendering(run, NAME) or not run.settings(NAME).split:
        return prompts
    return route_prompts(run, step, list(prompts))


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return evolve(run, batch)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.plugin_state(NAME)
    if not state:
        return
    metrics[f"{NAME}/nodes"] = len(state["nodes"])
    metrics[f"{NAME}/splits"] = state["splits"]
    metrics[f"{NAME}/edits"] = state["edits"]
    metrics[f"{NAME}/drafts"] = len(state["drafts"])
    metrics[f"{NAME}/metric_calls"] = state["metric_calls"]
    for k, v in state["last"].items():
        metrics[f"{NAME}/{k}"] = v
    state["last"] = {}  # a step that did not evolve reports no losses
