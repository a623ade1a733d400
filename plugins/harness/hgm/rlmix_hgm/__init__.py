"""HGM, the Huxley-Goedel Machine: a tree of harness self-modifications, expanded where the
*clade* (a node and all its descendants) has done well, not where the node itself scores best.

Each ``rlmix_evolve`` call is one expansion:

1. choose the node to expand (``selection``): ``clade_thompson`` Thompson-samples Beta
   posteriors over each node's clade-metaproductivity (CMP: the pooled results of its
   descendants), level by level from the root; ``own_score`` (the baseline the paper argues
   against) takes the node with the best score of its own;
2. ask the reflection LM (``rlmix_lm``) to rewrite one component of that node (round-robin over
   the components by how often the node was expanded), from traces of its evaluation;
3. score the child on the fixed evaluation tasks and add it to the tree; its results now count
   for every ancestor's clade.

The node with the best own score is applied to ``run.harness``. The budget counts metric calls
(one scored rollout of one task), the root's evaluation included. All state is in
``run.state["hgm"]``, so a checkpointed run resumes where it stopped.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    configure_evolver,
    evolved_components,
    fenced_text,
    guard_heldout,
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

NAME = "hgm"
SELECTIONS = ("clade_thompson", "own_score")
EVIDENCE = ("node", "task")


@dataclass
class Settings:
    components: list[str] = field(default_factory=list)  # harness components to edit; [] = all
    budget: int = 120  # metric calls (one scored rollout of one task), the root's included
    eval_size: int = 8  # tasks every node is scored on (the same tasks for every node)
    heldout_size: int = 0  # tasks the search never sees; scored for each new best (reporting)
    selection: str = "clade_thompson"  # clade_thompson | own_score (greedy baseline)
    evidence: str = "node"  # what one Beta trial is: a node's mean score, or one task
    metric: str = ""  # reward term to maximise, e.g. arith.correct; "" = the weighted reward
    temperature: float = 0.0  # task rollouts (0 = greedy: scores are repeatable)
    max_new_tokens: int = 0  # task rollouts; 0 = sampling.max_new_tokens
    task_step_base: int = 1_300_000  # tasks are rlmix_prompts(run, task_step_base + k)
    feedback_chars: int = 300  # per trace shown to the reflection LM
    traces_per_prompt: int = 4  # evaluation traces of the node shown to the reflection LM
    seed: int = 0  # Thompson draws and tie breaks
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        check_choices(self, selection=SELECTIONS, evidence=EVIDENCE)
        if self.budget < 1 or self.eval_size < 1:
            raise ValueError("budget: budget and eval_size must be >= 1")
        if self.heldout_size < 0 or self.max_new_tokens < 0 or self.traces_per_prompt < 0:
            raise ValueError("heldout_size: heldout_size, max_new_tokens and "
                             "traces_per_prompt must be >= 0")


# ---------------------------------------------------------------- the tree (pure)


def clade_totals(parents: Sequence[int | None], successes: Sequence[float],
                 trials: Sequence[float]) -> list[tuple[float, float]]:
    """``(successes, trials)`` summed over each node's clade: the node and every descendant.
    ``parents[i]`` is node ``i``'s parent (``None`` for the root); parents come before their
    children, as in a tree grown by expansion."""
    s, n = list(map(float, successes)), list(map(float, trials))
    for child in range(len(parents) - 1, -1, -1):  # children after parents: fold upwards
        parent = parents[child]
        if parent is not None:
            s[parent] += s[child]
            n[parent] += n[child]
    return list(zip(s, n))


def evidence_counts(scores: Sequence[Sequence[float]], evidence: str
                    ) -> tuple[list[float], list[float]]:
    """Each node's own ``(successes, trials)``: with ``node`` evidence its mean score counts as
    one trial (metaproductivity is a property of descendants, so a descendant is the unit of
    evidence); with ``task`` evidence every scored task is a trial."""
    if evidence == "node":
        return [mean(x) for x in scores], [1.0 if x else 0.0 for x in scores]
    return [float(sum(x)) for x in scores], [float(len(x)) for x in scores]


def metaproductivity_counts(parents: Sequence[int | None], successes: Sequence[float],
                            trials: Sequence[float]) -> list[tuple[float, float]]:
    """Each node's evidence of clade-metaproductivity: the pooled ``(successes, trials)`` of its
    descendants (what growing from it has produced), or its own result while it has none."""
    clade = clade_totals(parents, successes, trials)
    has_children = {p for p in parents if p is not None}
    return [(s - float(successes[i]), n - float(trials[i])) if i in has_children
            else (float(successes[i]), float(trials[i])) for i, (s, n) in enumerate(clade)]


def clade_thompson(parents: Sequence[int | None], scores: Sequence[Sequence[float]],
                   rng: random.Random, evidence: str = "node") -> int:
    """The node to expand, by Thompson sampling of estimated clade-metaproductivity (CMP),
    level by level. From the root: one draw from ``Beta(1 + S, 1 + N - S)`` over the current
    node's CMP evidence (expanding it again) and one over each child's; stop at the current
    node when its draw wins, else descend into the winning child. A subtree of many nodes
    competes as one clade, so a plateau of look-alike descendants does not drown a sibling
    line in draws; and a node is judged by its descendants, not by its own score."""
    own_s, own_n = evidence_counts(scores, evidence)
    cmp = metaproductivity_counts(parents, own_s, own_n)
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        if parent is not None:
            children.setdefault(parent, []).append(node)

    def draw(node: int) -> float:
        s, n = cmp[node]
        return rng.betavariate(1.0 + s, 1.0 + max(0.0, n - s))

    node = next(i for i, p in enumerate(parents) if p is None)
    while children.get(node):
        here = draw(node)
        best_draw, best_child = max((draw(c), c) for c in children[node])
        if here >= best_draw:
            return node
        node = best_child
    return node


def best_own_score(scores: Sequence[Sequence[float]], rng: random.Random | None = None) -> int:
    """The node with the best mean score of its own; ties broken at random with ``rng``, else
    towards the earliest node."""
    means = [mean(x) for x in scores]
    top = max(means)
    tied = [i for i, m in enumerate(means) if m == top]
    return rng.choice(tied) if rng is not None else tied[0]


def depth(parents: Sequence[int | None], node: int) -> int:
    d = 0
    while parents[node] is not None:
        node, d = parents[node], d + 1
    return d


# ---------------------------------------------------------------- reflection



def reflection_prompt(component: str, text: str, records: list[dict[str, Any]]) -> str:
    lines = ["You are improving the instructions given to an AI assistant.",
             f'The part called "{component}" currently reads:', "```", text, "```",
             "How the assistant did with them on some tasks:"]
    for k, t in enumerate(records, 1):
        lines += [f"## Task {k}", f"Input: {t['input']}", f"Output: {t['output']}",
                  f"Score: {t['score']:g}"]
        if t.get("feedback"):
            lines.append(f"Feedback: {t['feedback']}")
    lines.append("Write a changed version of the text that could do better. Reply with the new "
                 "text only, between ``` lines.")
    return "\n".join(lines)


parse_proposal = fenced_text  # the text inside the reply's first ``` fence


# ---------------------------------------------------------------- the search


def _evaluate(run: Run, texts: dict[str, str], tasks: list[Any]
              ) -> tuple[list[float], RolloutBatch]:
    s = run.settings(NAME)
    return score_tasks(run, {**run.harness, **texts}, tasks, temperature=s.temperature,
                       max_new_tokens=s.max_new_tokens or None, metric=s.metric, owner=NAME)


def _add_node(state: dict[str, Any], texts: dict[str, str], parent: int | None,
              scores: list[float], batch: RolloutBatch, keep: int, chars: int) -> int:
    state["nodes"].append({"texts": dict(texts), "parent": parent, "scores": scores,
                           "expansions": 0, "traces": traces(batch, scores, chars)[:keep]})
    return len(state["nodes"]) - 1


def init_state(run: Run) -> dict[str, Any]:
    s = run.settings(NAME)
    names = evolved_components(run, NAME)
    pool = split_pool(run, {"selection": s.eval_size, "heldout": s.heldout_size},
                      s.task_step_base)
    state = run.state[NAME] = {
        "components": names, "tasks": [list(t) for t in pool["selection"]],
        "heldout_tasks": [list(t) for t in pool["heldout"]], "nodes": [], "metric_calls": 0,
        "iteration": 0, "applied": 0, "heldout": {}, "history": []}
    root = {c: run.harness[c] for c in names}
    tasks = [tuple(t) for t in state["tasks"]]
    scores, batch = _evaluate(run, root, tasks)
    state["metric_calls"] += len(tasks)
    _add_node(state, root, None, scores, batch, s.traces_per_prompt, s.feedback_chars)
    return state


def choose(run: Run, state: dict[str, Any], rng: random.Random) -> int:
    s = run.settings(NAME)
    scores = [n["scores"] for n in state["nodes"]]
    if s.selection == "own_score":
        return best_own_score(scores, rng)
    return clade_thompson([n["parent"] for n in state["nodes"]], scores, rng, s.evidence)


def expand(run: Run) -> dict[str, Any] | None:
    """One expansion; its record, or None when the budget cannot pay for one more child."""
    s = run.settings(NAME)
    state = run.state.get(NAME) or init_state(run)
    tasks = [tuple(t) for t in state["tasks"]]
    if state["metric_calls"] + len(tasks) > s.budget:
        return None
    rng = random.Random(f"hgm-{s.seed}-{state['iteration']}")
    parent = choose(run, state, rng)
    node = state["nodes"][parent]
    names = state["components"]
    component = names[node["expansions"] % len(names)]
    node["expansions"] += 1
    record: dict[str, Any] = {"iteration": state["iteration"], "parent": parent,
                              "component": component}
    state["iteration"] += 1
    reply = reflection_lm(run, NAME).complete(
        reflection_prompt(component, node["texts"][component], node["traces"]),
        s.lm.max_new_tokens, s.lm.temperature)
    proposal = parse_proposal(reply)
    if not proposal or proposal == node["texts"][component]:
        record["child"] = None
        state["history"].append(record)
        return record
    texts = {**node["texts"], component: proposal}
    scores, batch = _evaluate(run, texts, tasks)
    state["metric_calls"] += len(tasks)
    record["child"] = _add_node(state, texts, parent, scores, batch, s.traces_per_prompt,
                                s.feedback_chars)
    record["score"] = mean(scores)
    state["history"].append(record)
    return record


def _score_heldout(run: Run, state: dict[str, Any], node: int) -> None:
    tasks = [tuple(t) for t in state["heldout_tasks"]]
    if not tasks or str(node) in state["heldout"]:
        return
    guard_heldout(run, tasks)
    scores, _ = _evaluate(run, state["nodes"][node]["texts"], tasks)  # reporting: not budgeted
    state["heldout"][str(node)] = mean(scores)


def iterate(run: Run) -> HarnessUpdate | None:
    """One expansion; the harness update when the best node changed."""
    if NAME not in run.state and not evolved_components(run, NAME):
        return None
    state = run.state.get(NAME) or init_state(run)
    _score_heldout(run, state, 0)
    if expand(run) is None:
        return None
    best = best_own_score([n["scores"] for n in state["nodes"]])
    if best == state["applied"]:
        return None
    state["applied"] = best
    _score_heldout(run, state, best)
    parents = [n["parent"] for n in state["nodes"]]
    return HarnessUpdate(
        components=dict(state["nodes"][best]["texts"]),
        evidence=(f"node {best} at depth {depth(parents, best)}: mean "
                  f"{mean(state['nodes'][best]['scores']):.3f} over {len(state['tasks'])} tasks "
                  f"(root {mean(state['nodes'][0]['scores']):.3f}); "
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
    if not state or not state["nodes"]:
        return
    best = state["applied"]
    run.log("hgm/metric_calls", state["metric_calls"])
    run.log("hgm/nodes", len(state["nodes"]))
    run.log("hgm/best", best)
    run.log("hgm/best_score", mean(state["nodes"][best]["scores"]))
    run.log("hgm/root_score", mean(state["nodes"][0]["scores"]))
    if str(best) in state["heldout"]:
        run.log("hgm/heldout", state["heldout"][str(best)])
        run.log("hgm/root_heldout", state["heldout"]["0"])
