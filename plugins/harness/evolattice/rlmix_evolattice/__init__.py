"""EvoLattice: the whole population of harnesses as one graph of components, each holding
several persistent alternatives; a candidate is a *path* (one alternative per component).

Each ``rlmix_evolve`` call is one round:

1. **Target** the weakest component: the one whose best alternative has the lowest mean
   credit (``alternative_means``), components never mutated first.
2. **Mutate**: the reflection LM (``rlmix_lm``) sees that component's alternatives with their
   credits and traces of the best path, and writes one new alternative; it is added beside the
   others (a duplicate is not). Past ``max_alternatives`` the lowest-credit alternative that is
   not on the best path is pruned: the best path's alternatives are never deleted.
3. **Evaluate** the best path with the new alternative swapped in, and ``explore_paths`` more
   unseen paths: first recombinations one alternative away from the best path
   (``recombine_near``), then by untried alternatives, unseen pairs and the summed upper
   confidence bound on alternative credit (``ucb_path``), each repaired (``repair_path``) so
   every alternative's declared dependencies hold. Every evaluation credits each alternative
   on its path with the path's mean score.
4. **Apply** the best path seen as a ``HarnessUpdate`` when it changed.

``representation: overwrite`` is the baseline the paper argues against: one candidate, the new
text overwrites its component (round-robin), kept when the score does not drop. The budget
counts metric calls (one scored rollout of one task), the start included; state is in
``run.state["evolattice"]``.
"""

from __future__ import annotations

import itertools
import math
import re
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

NAME = "evolattice"
REPRESENTATIONS = ("lattice", "overwrite")

Path = tuple[int, ...]  # alternative index per component, in component order
STALE_PENALTY = 0.125  # per fruitless proposal in a row, added to a component's credit


@dataclass
class Settings:
    components: list[str] = field(default_factory=list)  # harness components; [] = all
    budget: int = 160  # metric calls (one scored rollout of one task), the start included
    eval_size: int = 8  # tasks every path is scored on (the same tasks for every path)
    representation: str = "lattice"  # lattice | overwrite (one-candidate baseline)
    max_alternatives: int = 4  # per component; beyond it the weakest off-best-path is pruned
    explore_paths: int = 1  # paths chosen by UCB per round, besides the mutated best path
    ucb_c: float = 0.5  # exploration weight of the upper confidence bound
    metric: str = ""  # reward term to maximise, e.g. arith.correct; "" = the weighted reward
    temperature: float = 0.0  # task rollouts (0 = greedy: scores are repeatable)
    max_new_tokens: int = 0  # task rollouts; 0 = sampling.max_new_tokens
    task_step_base: int = 1_400_000  # tasks are rlmix_prompts(run, task_step_base + k)
    feedback_chars: int = 300  # per trace shown to the reflection LM
    traces_per_prompt: int = 4
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        check_choices(self, representation=REPRESENTATIONS)
        if self.budget < 1 or self.eval_size < 1:
            raise ValueError("budget: budget and eval_size must be >= 1")
        if self.max_alternatives < 2:
            raise ValueError("max_alternatives: must be >= 2 (the best path's and a new one)")
        if self.explore_paths < 0 or self.ucb_c < 0:
            raise ValueError("explore_paths: explore_paths and ucb_c must be >= 0")


# ---------------------------------------------------------------- the lattice (pure)


def alternative_means(credit: Sequence[Sequence[tuple[float, int]]]) -> list[list[float]]:
    """Mean credit of every alternative: ``credit[c][a] = (sum of path scores, paths)``; an
    alternative on no evaluated path has mean 0."""
    return [[s / n if n else 0.0 for s, n in comp] for comp in credit]


def credit_path(credit: list[list[list[float]]], path: Path, score: float) -> None:
    """Credit each alternative on ``path`` with the path's score (in place)."""
    for c, a in enumerate(path):
        credit[c][a][0] += float(score)
        credit[c][a][1] += 1


def weakest_component(credit: Sequence[Sequence[tuple[float, int]]],
                      mutations: Sequence[int], stale: Sequence[int] = ()) -> int:
    """The component to mutate: never-mutated components first, then the one whose best
    alternative's mean credit is lowest, raised by ``stale_penalty`` for every proposal in a
    row that added nothing there (a component whose alternatives the proposer has run out of
    stops drawing every mutation); ties: fewer mutations, then the first."""
    means = alternative_means(credit)
    stale = list(stale) or [0] * len(means)
    return min(range(len(means)),
               key=lambda c: (mutations[c] > 0, max(means[c]) + STALE_PENALTY * stale[c],
                              mutations[c], c))


def _bounds(comp: Sequence[tuple[float, int]], c: float) -> list[float]:
    total = sum(n for _, n in comp)
    return [math.inf if n == 0 else s / n + c * math.sqrt(math.log(total + 1) / n)
            for s, n in comp]


def unseen_pairs(path: Path, seen: set[Path] | frozenset[Path]) -> int:
    """How many pairs of the path's alternatives (one from each of two components) never ran
    together on an evaluated path: an interaction between two components shows only on a path
    that holds both."""
    together = {(i, path[i], j, path[j]) for p in seen for i in range(len(p))
                for j in range(i + 1, len(p)) if p[i] == path[i] and p[j] == path[j]}
    return sum((i, path[i], j, path[j]) not in together for i in range(len(path))
               for j in range(i + 1, len(path)))


def ucb_path(credit: Sequence[Sequence[tuple[float, int]]], c: float,
             seen: frozenset[Path] | set[Path] = frozenset(), limit: int = 4096
             ) -> Path | None:
    """The unseen path (greedy task scores repeat, so a path run twice teaches nothing) that
    holds the most alternatives on no path yet, then the most pairs of alternatives never run
    together (``unseen_pairs``), then the largest summed upper confidence bound
    ``mean + c * sqrt(ln(T + 1) / n)`` (``T`` the component's evaluations). Lattices of more
    than ``limit`` paths take the per-component best instead. None when every path was seen."""
    bounds = [_bounds(comp, c) for comp in credit]
    sizes = [len(b) for b in bounds]
    if math.prod(sizes) <= limit:
        best: tuple[tuple[float, ...], Path] | None = None
        for path in itertools.product(*[range(n) for n in sizes]):
            if path in seen:
                continue
            fresh = [math.isinf(bounds[k][a]) for k, a in enumerate(path)]
            key = (float(sum(fresh)), float(unseen_pairs(path, seen)),
                   sum(bounds[k][a] for k, a in enumerate(path) if not fresh[k]))
            if best is None or key > best[0]:
                best = (key, path)
        return best[1] if best else None
    path = tuple(max(range(len(b)), key=lambda a, b=b: (b[a], -a)) for b in bounds)
    return None if path in seen else path


def recombine_near(best: Path, credit: Sequence[Sequence[tuple[float, int]]], c: float,
                   seen: set[Path] | frozenset[Path] = frozenset()) -> Path | None:
    """The unseen path one alternative away from ``best`` whose swapped-in alternative has the
    largest upper confidence bound: a new best path is recombined with the alternatives the
    lattice kept, whose marginal credit may be low only because they never ran beside it."""
    options = []
    for k, comp in enumerate(credit):
        bounds = _bounds(comp, c)
        for a in range(len(comp)):
            path = (*best[:k], a, *best[k + 1:])
            if a != best[k] and path not in seen:
                options.append((bounds[a], -k, -a, path))
    return max(options)[3] if options else None


def repair_path(path: Path, requires: Sequence[Sequence[dict[int, int]]]) -> Path:
    """Make a path consistent with the alternatives' declared dependencies, without the LM.

    ``requires[c][a]`` maps other components to the alternative that alternative ``a`` of
    component ``c`` needs there. Components are visited in order; a requirement on a later
    component is imposed on it, one on an earlier component that disagrees with its (already
    fixed) choice makes ``a`` fall back to alternative 0 of ``c``, which never requires
    anything. So the dependency graph of a repaired path is acyclic (edges only point
    forward) and every requirement holds."""
    fixed = list(path)
    for c in range(len(fixed)):
        need = requires[c][fixed[c]] if fixed[c] < len(requires[c]) else {}
        if any(d < c and fixed[d] != a for d, a in need.items()):
            fixed[c] = 0
            continue
        for d, a in need.items():
            if d > c:
                fixed[d] = a
    return tuple(fixed)


def prune(credit: Sequence[Sequence[tuple[float, int]]], component: int, protected: int,
          cap: int) -> int | None:
    """The alternative of ``component`` to delete when it holds more than ``cap``: the lowest
    mean credit among those that are neither ``protected`` (on the best path) nor 0 (the
    dependency-free start); None when nothing needs deleting."""
    comp = credit[component]
    if len(comp) <= cap:
        return None
    means = alternative_means([comp])[0]
    candidates = [a for a in range(len(comp)) if a not in (protected, 0)]
    return min(candidates, key=lambda a: (means[a], -a)) if candidates else None


# ---------------------------------------------------------------- reflection

_FENCE = re.compile(r"```[^\n]*\n(.*?)\n?```", re.S)
_REQUIRES = re.compile(r"^requires:\s*(\w+)\s*=\s*(\d+)\s*$", re.M)


def reflection_prompt(component: str, alternatives: Sequence[str], means: Sequence[float],
                      records: list[dict[str, Any]]) -> str:
    lines = ["You are improving the instructions given to an AI assistant.",
             f'The part called "{component}" has these alternatives (mean score of the '
             "candidates that used each):"]
    for k, (text, m) in enumerate(zip(alternatives, means)):
        lines += [f"Alternative {k} (score {m:.2f}):", "```", text, "```"]
    lines.append("How the assistant did with the best candidate so far:")
    for k, t in enumerate(records, 1):
        lines += [f"## Task {k}", f"Input: {t['input']}", f"Output: {t['output']}",
                  f"Score: {t['score']:g}"]
    lines.append("Write one new alternative for this part, different from those above. Reply "
                 "with its text between ``` lines. If it only works together with a given "
                 "alternative of another part, add a line `requires: <part>=<number>`.")
    return "\n".join(lines)


def parse_proposal(reply: str) -> tuple[str, dict[str, int]]:
    """The fenced text, and the ``requires:`` lines outside it."""
    found = _FENCE.search(reply)
    text = (found.group(1) if found else reply.replace("```", "")).strip()
    rest = _FENCE.sub("", reply)
    return text, {m.group(1): int(m.group(2)) for m in _REQUIRES.finditer(rest)}


# ---------------------------------------------------------------- the search


def _harness(state: dict[str, Any], path: Path) -> dict[str, str]:
    return {c: state["alternatives"][k][a]
            for k, (c, a) in enumerate(zip(state["components"], path))}


def _evaluate(run: Run, state: dict[str, Any], path: Path) -> tuple[float, RolloutBatch]:
    s = run.settings(NAME)
    tasks = [tuple(t) for t in state["tasks"]]
    scores, batch = score_tasks(run, {**run.harness, **_harness(state, path)}, tasks,
                                temperature=s.temperature,
                                max_new_tokens=s.max_new_tokens or None, metric=s.metric,
                                owner=NAME)
    state["metric_calls"] += len(tasks)
    value = mean(scores)
    key = ",".join(map(str, path))
    state["paths"][key] = value
    credit_path(state["credit"], path, value)
    if value > state["best_score"]:
        state["best_score"], state["best_path"] = value, list(path)
        state["best_traces"] = traces(batch, scores, s.feedback_chars)[:s.traces_per_prompt]
    return value, batch


def init_state(run: Run) -> dict[str, Any]:
    s = run.settings(NAME)
    names = evolved_components(run, NAME)
    pool = split_pool(run, {"selection": s.eval_size}, s.task_step_base)
    state = run.state[NAME] = {
        "components": names, "tasks": [list(t) for t in pool["selection"]],
        "alternatives": [[run.harness[c]] for c in names],
        "requires": [[{}] for _ in names], "credit": [[[0.0, 0]] for _ in names],
        "mutations": [0 for _ in names], "stale": [0 for _ in names], "paths": {},
        "best_path": [0] * len(names),
        "best_score": -1.0, "best_traces": [], "metric_calls": 0, "round": 0,
        "applied": None, "pruned": [], "history": []}
    _evaluate(run, state, tuple([0] * len(names)))
    return state


def _propose(run: Run, state: dict[str, Any], component: int, shown: Sequence[int]
             ) -> tuple[str, dict[str, int]]:
    s = run.settings(NAME)
    means = alternative_means(state["credit"])[component]
    alts = state["alternatives"][component]
    reply = reflection_lm(run, NAME).complete(
        reflection_prompt(state["components"][component], [alts[a] for a in shown],
                          [means[a] for a in shown], state["best_traces"]),
        s.lm.max_new_tokens, s.lm.temperature)
    return parse_proposal(reply)


def _seen(state: dict[str, Any]) -> set[Path]:
    return {tuple(int(x) for x in key.split(",")) for key in state["paths"]}


def lattice_round(run: Run, state: dict[str, Any]) -> dict[str, Any]:
    s = run.settings(NAME)
    comp = weakest_component(state["credit"], state["mutations"], state["stale"])
    state["mutations"][comp] += 1
    alts = state["alternatives"][comp]
    text, needs = _propose(run, state, comp, range(len(alts)))
    state["stale"][comp] = 0 if (text and text not in alts) else state["stale"][comp] + 1
    record: dict[str, Any] = {"round": state["round"], "component": comp, "added": None,
                              "evaluated": []}
    plans: list[Path] = []
    if text and text not in alts:
        index = {name: k for k, name in enumerate(state["components"])}
        alts.append(text)
        state["credit"][comp].append([0.0, 0])
        state["requires"][comp].append({index[n]: a for n, a in needs.items()
                                        if n in index and index[n] != comp
                                        and a < len(state["alternatives"][index[n]])})
        record["added"] = len(alts) - 1
        best = list(state["best_path"])
        best[comp] = len(alts) - 1
        plans.append(repair_path(tuple(best), state["requires"]))
    tasks = len(state["tasks"])
    explored = 0
    while True:
        if plans:
            path = plans.pop(0)
        elif explored < s.explore_paths:
            explored += 1
            seen = _seen(state)
            found = (recombine_near(tuple(state["best_path"]), state["credit"], s.ucb_c, seen)
                     or ucb_path(state["credit"], s.ucb_c, seen))
            if found is None:
                break
            path = repair_path(found, state["requires"])
        else:
            break
        if path in _seen(state):
            continue
        if state["metric_calls"] + tasks > s.budget:
            break
        value, _ = _evaluate(run, state, path)
        record["evaluated"].append([list(path), value])
    gone = prune(state["credit"], comp, state["best_path"][comp], s.max_alternatives)
    if gone is not None:
        _delete(state, comp, gone)
        record["pruned"] = gone
    return record


def _delete(state: dict[str, Any], comp: int, gone: int) -> None:
    """Delete alternative ``gone`` of ``comp`` and renumber the references to later ones."""
    state["pruned"].append([comp, state["alternatives"][comp][gone]])
    del state["alternatives"][comp][gone]
    del state["credit"][comp][gone]
    del state["requires"][comp][gone]

    def shift(a: int) -> int:
        return a - 1 if a > gone else (0 if a == gone else a)

    state["best_path"][comp] = shift(state["best_path"][comp])
    for c, reqs in enumerate(state["requires"]):
        state["requires"][c] = [{d: (shift(a) if d == comp else a) for d, a in r.items()}
                                for r in reqs]
    # evaluated paths through the deleted alternative are gone with it
    kept = {}
    for key, value in state["paths"].items():
        path = [int(x) for x in key.split(",")]
        if path[comp] == gone:
            continue
        path[comp] = shift(path[comp])
        kept[",".join(map(str, path))] = value
    state["paths"] = kept


def overwrite_round(run: Run, state: dict[str, Any]) -> dict[str, Any]:
    """The baseline: one candidate, the proposal overwrites a component (round-robin) and is
    kept when its score does not drop."""
    s = run.settings(NAME)
    comp = state["round"] % len(state["components"])
    record: dict[str, Any] = {"round": state["round"], "component": comp, "added": None}
    current = state["alternatives"][comp][0]
    text, _ = _propose(run, state, comp, [0])
    if not text or text == current or state["metric_calls"] + len(state["tasks"]) > s.budget:
        return record
    before = state["best_score"]
    state["alternatives"][comp] = [text]
    state["credit"][comp] = [[0.0, 0]]
    state["best_score"] = -1.0  # the candidate changed: its score is measured afresh
    value, _ = _evaluate(run, state, tuple([0] * len(state["components"])))
    if value >= before:
        record["added"] = 0
    else:  # revert
        state["alternatives"][comp] = [current]
        state["best_score"] = before
    record["evaluated"] = [[[0] * len(state["components"]), value]]
    return record


def iterate(run: Run) -> HarnessUpdate | None:
    """One round; the harness update when the best path changed."""
    s = run.settings(NAME)
    if NAME not in run.state and not evolved_components(run, NAME):
        return None
    state = run.state.get(NAME) or init_state(run)
    if state["metric_calls"] + len(state["tasks"]) > s.budget:
        return None
    record = (lattice_round if s.representation == "lattice" else overwrite_round)(run, state)
    state["history"].append(record)
    state["round"] += 1
    texts = _harness(state, tuple(state["best_path"]))
    if texts == state["applied"]:
        return None
    state["applied"] = texts
    return HarnessUpdate(
        components=dict(texts),
        evidence=(f"best path {state['best_path']} scored {state['best_score']:.3f} over "
                  f"{len(state['tasks'])} tasks; {len(state['paths'])} paths evaluated; "
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
    if not state:
        return
    run.log("evolattice/metric_calls", state["metric_calls"])
    run.log("evolattice/best_score", state["best_score"])
    run.log("evolattice/paths", len(state["paths"]))
    run.log("evolattice/alternatives", sum(len(a) for a in state["alternatives"]))
    run.log("evolattice/pruned", len(state["pruned"]))
