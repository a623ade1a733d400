"""GEPA: reflective evolution of harness text with Pareto-front candidate selection.

Each ``rlmix_evolve`` call is one GEPA iteration (Agrawal et al., 2025, arXiv:2507.19457):

1. pick a parent from the Pareto front of the candidates' per-task scores on the selection set
   (dominated candidates dropped, sampled by the number of tasks each one wins);
2. run the parent on a minibatch of search tasks, keeping traces (input, output, reward terms,
   the env's feedback in ``batch.info``);
3. ask the reflection LM (``rlmix_lm``) to rewrite one component from those traces;
4. run the child on the same minibatch; keep it only if its minibatch score strictly improves,
   then score it on every selection task (and pass the flip gate when ``gates`` is listed);
5. now and then, merge two front candidates that share an ancestor, taking each component from
   the one that changed it.

The budget counts metric calls: one scored rollout of one task. The candidate with the best mean
selection score is applied to ``run.harness``. All state lives in ``run.state["gepa"]``, so a
checkpointed run resumes where it stopped.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    GATES,
    Task,
    configure_evolver,
    evolved_components,
    guard_heldout,
    mean,
    reflection_lm,
    score_tasks,
    split_pool,
    traces,
)
from rlmix_lm import LM, LMSettings

import rlmix
from rlmix.types import HarnessUpdate, RolloutBatch, Run

NAME = "gepa"


@dataclass
class Settings:
    components: list[str] = field(default_factory=list)  # harness components to evolve; [] = all
    budget: int = 200  # metric calls (one scored rollout of one task), the seed's included
    search_size: int = 16  # tasks the minibatches (and reflection traces) come from
    selection_size: int = 8  # tasks every accepted candidate is scored on (the Pareto set)
    heldout_size: int = 0  # tasks the search never sees; scored for the seed and each new best
    minibatch_size: int = 3  # search tasks per reflection (parent and child both run them)
    merge: bool = True  # try merging two front candidates after an accepted mutation
    max_merges: int = 5  # merge attempts in the whole run
    metric: str = ""  # reward term to maximise, e.g. arith.correct; "" = the weighted reward
    temperature: float = 0.0  # task rollouts (0 = greedy: scores are repeatable)
    max_new_tokens: int = 0  # task rollouts; 0 = sampling.max_new_tokens
    task_step_base: int = 1_000_000  # tasks are rlmix_prompts(run, task_step_base + k)
    feedback_chars: int = 400  # per trace shown to the reflection LM
    seed: int = 0  # parent sampling and merge choices
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget: must be >= 1 metric call, got {self.budget}")
        if self.search_size < 1 or self.selection_size < 1:
            raise ValueError("search_size: search_size and selection_size must be >= 1")
        if self.heldout_size < 0:
            raise ValueError("heldout_size: must be >= 0")
        if not 1 <= self.minibatch_size <= self.search_size:
            raise ValueError(f"minibatch_size: must be in 1..search_size ({self.search_size}), "
                             f"got {self.minibatch_size}")
        if self.max_merges < 0 or self.max_new_tokens < 0 or self.feedback_chars < 0:
            raise ValueError("max_merges: max_merges, max_new_tokens and feedback_chars must "
                             "be >= 0")


# ---------------------------------------------------------------- Pareto selection (pure)


def instance_fronts(scores: Sequence[Sequence[float]]) -> list[set[int]]:
    """For each task, the candidates that reach the best score on it."""
    if not scores:
        return []
    fronts = []
    for t in range(len(scores[0])):
        best = max(s[t] for s in scores)
        fronts.append({c for c, s in enumerate(scores) if s[t] == best})
    return fronts


def pareto_candidates(scores: Sequence[Sequence[float]]) -> list[int]:
    """Candidates on some task's front, after dropping dominated ones.

    A candidate is dominated when every task it is best on is also won by another remaining
    candidate. Candidates are examined from the lowest mean score up, one at a time, so of two
    identical candidates one stays."""
    fronts = instance_fronts(scores)
    alive = set().union(*fronts) if fronts else set()
    means = {c: sum(scores[c]) / max(1, len(scores[c])) for c in alive}
    for c in sorted(alive, key=lambda c: (means[c], -c)):
        own = [f for f in fronts if c in f]
        if own and all(any(o in alive and o != c for o in f) for f in own):
            alive.discard(c)
    return sorted(alive)


def front_wins(scores: Sequence[Sequence[float]]) -> dict[int, int]:
    """Number of tasks each non-dominated candidate is best on."""
    alive = pareto_candidates(scores)
    wins = {c: 0 for c in alive}
    for f in instance_fronts(scores):
        for c in f:
            if c in wins:
                wins[c] += 1
    return wins


def select_parent(scores: Sequence[Sequence[float]], rng: random.Random) -> int:
    """Sample a front candidate with probability proportional to the tasks it wins."""
    wins = front_wins(scores)
    items = sorted(wins.items())
    return rng.choices([c for c, _ in items], weights=[w for _, w in items])[0]


# ---------------------------------------------------------------- merge (pure)


def ancestors(c: int, parents: Sequence[Sequence[int]]) -> set[int]:
    """Every candidate ``c`` descends from (not ``c`` itself)."""
    out: set[int] = set()
    todo = list(parents[c])
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(parents[p])
    return out


def merge_texts(a: dict[str, str], i: dict[str, str], j: dict[str, str],
                i_better: bool = True) -> dict[str, str]:
    """Component-wise merge of ``i`` and ``j`` against their common ancestor ``a``: take each
    component from the one that changed it; when both changed it, from the better one."""
    out = {}
    for name in a:
        ti, tj, ta = i[name], j[name], a[name]
        if ti == ta:
            out[name] = tj
        elif tj == ta:
            out[name] = ti
        else:
            out[name] = ti if i_better else tj
    return out


def find_merge(candidates: Sequence[dict[str, str]], parents: Sequence[Sequence[int]],
               scores: Sequence[Sequence[float]], tried: set[tuple[int, int, int]],
               rng: random.Random) -> tuple[int, int, int, dict[str, str]] | None:
    """A pair of front candidates with a common ancestor whose merge is new: ``(i, j, ancestor,
    merged texts)``, or None. Neither may descend from the other."""
    front = pareto_candidates(scores)
    means = [sum(s) / max(1, len(s)) for s in scores]
    pairs = [(i, j) for x, i in enumerate(front) for j in front[x + 1:]]
    rng.shuffle(pairs)
    seen = {tuple(sorted(c.items())) for c in candidates}
    for i, j in pairs:
        ai, aj = ancestors(i, parents), ancestors(j, parents)
        if i in aj or j in ai:
            continue
        common = ai & aj
        if not common:
            continue
        a = max(common, key=lambda c: (means[c], c))
        if (i, j, a) in tried:
            continue
        merged = merge_texts(candidates[a], candidates[i], candidates[j], means[i] >= means[j])
        if tuple(sorted(merged.items())) in seen:
            tried.add((i, j, a))
            continue
        return i, j, a, merged
    return None


# ---------------------------------------------------------------- reflection (pure)

_FENCE = re.compile(r"```[^\n`]*\n?(.*?)```", re.S)


def reflection_prompt(component: str, text: str, traces: list[dict[str, Any]]) -> str:
    lines = [
        "You are improving the instructions given to an AI assistant.",
        f'The part of the instructions called "{component}" currently reads:',
        "```", text, "```",
        "Here is how the assistant did on some tasks with these instructions:",
    ]
    for k, t in enumerate(traces, 1):
        lines += [f"## Task {k}", f"Input: {t['input']}", f"Assistant's output: {t['output']}",
                  f"Score: {t['score']:g} ({t['terms']})"]
        if t.get("feedback"):
            lines.append(f"Feedback: {t['feedback']}")
    lines += ["Write a better version of the text above so that the assistant gets these tasks "
              "right, keeping what already works. Reply with the new text only, between ``` "
              "lines."]
    return "\n".join(lines)


def parse_proposal(reply: str) -> str:
    """The text between the first pair of ``` fences, else the whole reply, stripped."""
    found = _FENCE.search(reply)
    return (found.group(1) if found else reply.replace("```", "")).strip()


# ---------------------------------------------------------------- tasks and evaluation


def run_tasks(run: Run, harness: dict[str, str], tasks: Sequence[Task],
              ) -> tuple[list[float], RolloutBatch]:
    """Generate once per task under ``harness`` and score with the run's scorers. Returns the
    per-task metric (``gepa.metric``) and the scored batch (traces); counts the metric calls."""
    s = run.settings(NAME)
    scores, batch = score_tasks(run, harness, tasks, temperature=s.temperature,
                                max_new_tokens=s.max_new_tokens or None, metric=s.metric,
                                owner=NAME)
    run.state[NAME]["metric_calls"] += len(tasks)
    return scores, batch


# ---------------------------------------------------------------- the iteration


def _lm(run: Run) -> LM:
    return reflection_lm(run, NAME)


def components(run: Run) -> list[str]:
    """The components to evolve (``gepa.components``, default every harness component; none
    when the harness is empty)."""
    return evolved_components(run, NAME)


def init_state(run: Run) -> dict[str, Any]:
    """Tasks, the seed candidate and its selection scores (counted against the budget)."""
    s = run.settings(NAME)
    names = components(run)
    sets = split_pool(run, {"search": s.search_size, "selection": s.selection_size,
                            "heldout": s.heldout_size}, s.task_step_base)
    state = run.state[NAME] = {
        "components": names, "tasks": {k: [list(t) for t in v] for k, v in sets.items()},
        "candidates": [], "parents": [], "origin": [], "scores": [], "heldout": {},
        "metric_calls": 0, "heldout_calls": 0, "iteration": 0, "merges": 0,
        "merge_due": False, "tried_merges": [], "applied": 0, "history": []}
    seed = {c: run.harness[c] for c in names}
    scores, _ = run_tasks(run, seed, _tasks(state, "selection"))
    _add(state, seed, [], "seed", scores)
    _score_heldout(run, 0)
    return state


def _tasks(state: dict[str, Any], name: str) -> list[Task]:
    return [(int(a), int(b)) for a, b in state["tasks"][name]]


def _add(state: dict[str, Any], cand: dict[str, str], parents: list[int], origin: str,
         scores: list[float]) -> int:
    state["candidates"].append(dict(cand))
    state["parents"].append(list(parents))
    state["origin"].append(origin)
    state["scores"].append(list(scores))
    return len(state["candidates"]) - 1


def _score_heldout(run: Run, c: int) -> None:
    state = run.state[NAME]
    tasks = _tasks(state, "heldout")
    if not tasks or str(c) in state["heldout"]:
        return
    guard_heldout(run, tasks)
    calls = state["metric_calls"]
    scores, _ = run_tasks(run, state["candidates"][c], tasks)
    state["metric_calls"] = calls  # held-out scoring is reporting, not search
    state["heldout_calls"] += len(tasks)
    state["heldout"][str(c)] = mean(scores)


def _gate(run: Run, parent: int, child_scores: list[float]) -> tuple[bool, str]:
    gates = run.resources.get(GATES)
    if gates is None:
        return True, ""
    result = gates.check(run.state[NAME]["scores"][parent], child_scores)
    return result.passed, result.reason


def best_candidate(state: dict[str, Any]) -> int:
    means = [mean(s) for s in state["scores"]]
    return max(range(len(means)), key=lambda c: (means[c], -c))


def mutate(run: Run, rng: random.Random) -> dict[str, Any]:
    s = run.settings(NAME)
    state = run.state[NAME]
    parent = select_parent(state["scores"], rng)
    search = _tasks(state, "search")
    it = state["iteration"]
    start = (it * s.minibatch_size) % len(search)
    minibatch = [search[(start + k) % len(search)] for k in range(s.minibatch_size)]
    names = state["components"]
    component = names[it % len(names)]  # round-robin over components
    record: dict[str, Any] = {"kind": "mutation", "parent": parent, "component": component}
    parent_texts = state["candidates"][parent]
    p_scores, batch = run_tasks(run, parent_texts, minibatch)
    record["parent_minibatch"] = sum(p_scores)
    prompt = reflection_prompt(component, parent_texts[component],
                               traces(batch, p_scores, s.feedback_chars))
    reply = _lm(run).complete(prompt, s.lm.max_new_tokens, s.lm.temperature)
    proposal = parse_proposal(reply)
    record["proposal"] = proposal
    if not proposal or proposal == parent_texts[component]:
        record["accepted"], record["why"] = False, "no new text proposed"
        return record
    child = {**parent_texts, component: proposal}
    c_scores, _ = run_tasks(run, child, minibatch)
    record["child_minibatch"] = sum(c_scores)
    if not sum(c_scores) > sum(p_scores):
        record["accepted"], record["why"] = False, "minibatch score did not improve"
        return record
    full, _ = run_tasks(run, child, _tasks(state, "selection"))
    ok, why = _gate(run, parent, full)
    record["selection"] = mean(full)
    if not ok:
        record["accepted"], record["why"] = False, f"flip gate: {why}"
        return record
    record["accepted"], record["child"] = True, _add(state, child, [parent], "mutation", full)
    return record


def merge(run: Run, rng: random.Random) -> dict[str, Any] | None:
    s = run.settings(NAME)
    state = run.state[NAME]
    tried = {tuple(t) for t in state["tried_merges"]}
    found = find_merge(state["candidates"], state["parents"], state["scores"], tried, rng)
    if found is None:
        return None
    i, j, a, merged = found
    state["tried_merges"].append([i, j, a])
    state["merges"] += 1
    record: dict[str, Any] = {"kind": "merge", "parents": [i, j], "ancestor": a}
    si, sj = state["scores"][i], state["scores"][j]
    selection = _tasks(state, "selection")
    # judge the merge first on a few selection tasks where its parents disagree
    differ = [k for k in range(len(selection)) if si[k] != sj[k]] or list(range(len(selection)))
    rng.shuffle(differ)
    pick = sorted(differ[:s.minibatch_size])
    m_scores, _ = run_tasks(run, merged, [selection[k] for k in pick])
    record["merge_minibatch"] = sum(m_scores)
    if sum(m_scores) < max(sum(si[k] for k in pick), sum(sj[k] for k in pick)):
        record["accepted"], record["why"] = False, "worse than a parent on the subsample"
        return record
    full, _ = run_tasks(run, merged, selection)
    better = i if mean(si) >= mean(sj) else j
    ok, why = _gate(run, better, full)
    record["selection"] = mean(full)
    if not ok:
        record["accepted"], record["why"] = False, f"flip gate: {why}"
        return record
    record["accepted"], record["child"] = True, _add(state, merged, [i, j], "merge", full)
    return record


def iterate(run: Run) -> HarnessUpdate | None:
    """One GEPA iteration; returns the harness update when the best candidate changed."""
    s = run.settings(NAME)
    if NAME not in run.state and not components(run):
        return None
    state = run.state.get(NAME) or init_state(run)
    # an iteration starts only when its worst case fits: parent and child on the minibatch, then
    # the accepted child on the whole selection set; so the budget is never overspent
    worst = 2 * s.minibatch_size + len(_tasks(state, "selection"))
    if state["metric_calls"] + worst > s.budget:
        return None
    rng = random.Random(f"gepa-{s.seed}-{state['iteration']}")
    record = None
    if s.merge and state["merge_due"] and state["merges"] < s.max_merges:
        record = merge(run, rng)
    if record is None:
        record = mutate(run, rng)
    state["merge_due"] = bool(record.get("accepted")) and record["kind"] == "mutation"
    record["iteration"] = state["iteration"]
    record["metric_calls"] = state["metric_calls"]
    state["history"].append(record)
    state["iteration"] += 1
    best = best_candidate(state)
    if best == state["applied"]:
        return None
    state["applied"] = best
    _score_heldout(run, best)
    means = [mean(x) for x in state["scores"]]
    return HarnessUpdate(
        components=dict(state["candidates"][best]),
        evidence=(f"candidate {best} ({state['origin'][best]} of {state['parents'][best]}): "
                  f"selection mean {means[best]:.3f} over {len(state['scores'][best])} tasks "
                  f"(seed {means[0]:.3f}); {state['metric_calls']} metric calls"),
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
    best = state["applied"]
    metrics["gepa/metric_calls"] = state["metric_calls"]
    metrics["gepa/candidates"] = len(state["candidates"])
    metrics["gepa/best"] = best
    metrics["gepa/best_selection"] = mean(state["scores"][best])
    metrics["gepa/seed_selection"] = mean(state["scores"][0])
    if str(best) in state["heldout"]:
        metrics["gepa/heldout"] = state["heldout"][str(best)]
        metrics["gepa/seed_heldout"] = state["heldout"]["0"]
