"""Living-Harness: every finished trajectory becomes bounded updates of two stores that guide
later episodes, an episodic failure-recovery memory and a state graph with repair edges.

Living-Harness (seed 003, paragraph 64) notes that an agent may recover from a failure inside an
episode, yet the same failure recurs in later tasks because nothing revises the persistent
harness. After each trajectory an evolution procedure turns the trajectory and its evaluator
signal into evidence for bounded harness updates, written as *episodic memory* (trigger
condition, failure pattern, recovery action) and a *state graph* (state nodes, repair edges,
transition rules); the updated state is retrieved to guide later interactions while tools and
base context stay frozen.

In rlmix:

1. **evolution** (``rlmix_evolve``): each episode's turns (``batch.info[i]["episode"]``, the
   per-turn ``info`` of the env: the state after the turn under ``state_key``, an ``error``) are
   walked; a failed call ``a`` in state ``S`` followed, in the same state, by a different call
   ``r`` that did not fail is a repair ``S: a -> r``. With ``evolve: rule`` that is the whole
   procedure; with ``evolve: lm`` the reflection model reads the trajectory and writes
   ``REPAIR:`` lines. A repair counts as evidence only when the episode's metric (the evaluator
   signal) reached ``success_threshold``. At most ``max_updates`` writes per trajectory;
2. **stores** (``run.state["living_harness"]``, checkpointed): episodic entries ``{trigger: (state,
   task words), failure: (action, error), recovery}``, graph nodes, repair edges ``(S, a) -> r ->
   S'`` and transition rules ``(S, action) -> S'``, each with posterior evidence ``(successes + 1)
   / (attempts + 2)``; all capped (``max_entries``, ``max_edges``, ``max_states``, ``max_rules``),
   the least confident, then least recently confirmed, evicted first;
3. **retrieval**: a wrapper on ``rlmix_prompts`` appends the entries whose trigger matches the
   task (word Jaccard ``>= trigger_match``) to the harness component ``component``; a wrapper on
   ``rlmix_episode`` appends to each observation the repair edges of the state the episode is now
   in. A shown repair that the agent took and that failed again lowers its evidence.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    cut,
    inside_rendering,
    mean,
    metric_values,
    prompts_under,
    reflection_lm,
    rendering,
    similarity,
    user_text,
)
from rlmix_lm import LMSettings

import rlmix
from rlmix import loop
from rlmix.trajectories import tool_call as action_of
from rlmix.trajectories import walk
from rlmix.types import HarnessUpdate, Prompt, RolloutBatch, Run, StepResult

NAME = "living_harness"
EVOLVES = ("rule", "lm")
_REPAIR = re.compile(r"^\s*REPAIR\s*:\s*state\s*=\s*(\S+)\s*\|\s*fails\s*=\s*(.+?)\s*\|\s*"
                     r"use\s*=\s*(.+?)\s*$", re.I | re.M)


@dataclass
class Settings:
    component: str = "system"  # harness component the matching entries are appended to
    header: str = "Known failures and their repairs:"
    state_key: str = "state"  # per-turn info key holding the state after the turn
    start_state: str = "start"  # the state before the first turn (or Prompt.info[state_key])
    evolve: str = "rule"  # rule | lm (the reflection LM writes REPAIR lines)
    learn: bool = True  # false: the stores never change (the ablation)
    k: int = 2  # entries shown per prompt
    edge_k: int = 2  # repair edges shown per state
    trigger_match: float = 0.3  # an entry is shown when its task words are this similar
    min_confidence: float = 0.5  # posterior evidence needed to be shown
    success_threshold: float = 0.5  # the evaluator signal that makes a repair evidence
    max_updates: int = 4  # writes per trajectory (bounded updates)
    max_entries: int = 16
    max_edges: int = 16
    max_states: int = 32
    max_rules: int = 64
    metric: str = ""  # reward term; "" = the weighted reward
    text_chars: int = 120
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, evolve=EVOLVES)
        if not self.component or not self.state_key:
            raise ValueError("component: component and state_key must be non-empty")
        for name in ("k", "edge_k", "max_updates"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("max_entries", "max_edges", "max_states", "max_rules"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.trigger_match <= 1.0 or not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError("trigger_match: trigger_match and min_confidence must be in [0, 1]")
        if self.text_chars < 16:
            raise ValueError(f"text_chars: must be >= 16, got {self.text_chars}")


# ---------------------------------------------------------------- trajectories (pure)


def repairs(steps: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """Each failed call in a state followed, in that state, by a different call that did not
    fail: ``{state, failed, error, recovery, to}`` (the first repair per failed call)."""
    found, seen = [], set()
    for i, s in enumerate(steps):
        if not s["error"] or (s["from"], s["action"]) in seen:
            continue
        for later in steps[i + 1:]:
            if later["from"] != s["from"]:
                break
            if not later["error"] and later["action"] != s["action"]:
                found.append({"state": s["from"], "failed": s["action"], "error": s["error"],
                              "recovery": later["action"], "to": later["to"]})
                seen.add((s["from"], s["action"]))
                break
    return found


def transitions(steps: Sequence[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Successful moves ``(from, action, to)``."""
    return [(s["from"], s["action"], s["to"]) for s in steps
            if not s["error"] and s["to"] != s["from"]]


def confidence(item: dict[str, Any]) -> float:
    """Posterior evidence ``(successes + 1) / (attempts + 2)``."""
    return (float(item["successes"]) + 1.0) / (float(item["attempts"]) + 2.0)


def cap(items: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Drop beyond ``limit``: least confident first, then least recently confirmed, oldest."""
    if len(items) <= limit:
        return []
    ranked = sorted(items, key=lambda e: (confidence(e), int(e["last"]), int(e["id"])))
    gone = ranked[:len(items) - limit]
    ids = {int(e["id"]) for e in gone}
    items[:] = [e for e in items if int(e["id"]) not in ids]
    return gone


def render_entry(e: dict[str, Any]) -> str:
    return (f"- When in state {e['trigger']['state']} `{e['failure']['action']}` fails "
            f"({e['failure']['error']}): use `{e['recovery']}` instead.")


def render_edges(state: str, edges: Sequence[dict[str, Any]]) -> str:
    return "\n".join(f"[harness] In state {state}: `{e['failed']}` fails; use `{e['recovery']}` "
                     f"(leads to {e['to']})." for e in edges)


def lm_prompt(task: str, steps: Sequence[dict[str, Any]], score: float) -> str:
    lines = ["An agent's trajectory, one line per call (state before -> call -> state after, "
             "error if any):", f"Task: {task}"]
    lines += [f"{s['from']} -> {s['action']} -> {s['to']}" + (f" ERROR {s['error']}"
                                                              if s["error"] else "")
              for s in steps]
    lines.append(f"Evaluator score: {score:g}")
    lines.append("For each failure that a later call in the same state repaired, write one line "
                 "'REPAIR: state=<state> | fails=<failed call> | use=<repairing call>'.")
    return "\n".join(lines)


# ---------------------------------------------------------------- state and updates


def state_of(run: Run) -> dict[str, Any]:
    state = run.state.get(NAME)
    if state is None:
        state = run.state[NAME] = {"entries": [], "states": {}, "edges": [], "rules": [],
                                   "next_id": 0, "steps": 0, "updates": 0, "evicted": 0,
                                   "log": []}
    return state


def _new_id(state: dict[str, Any]) -> int:
    state["next_id"] += 1
    return int(state["next_id"] - 1)


def write_repair(state: dict[str, Any], task: str, rep: dict[str, str], step: int,
                 chars: int) -> None:
    """One repair as evidence for an entry and an edge (merged with an equal one)."""
    key = (rep["state"], rep["failed"], rep["recovery"])
    entry = next((e for e in state["entries"] if (e["trigger"]["state"], e["failure"]["action"],
                                                  e["recovery"]) == key), None)
    if entry is None:
        state["entries"].append({
            "id": _new_id(state), "trigger": {"state": rep["state"], "task": cut(task, chars)},
            "failure": {"action": rep["failed"], "error": cut(rep["error"], chars)},
            "recovery": rep["recovery"], "attempts": 1, "successes": 1, "born": step,
            "last": step})
    else:
        entry["attempts"] += 1
        entry["successes"] += 1
        entry["last"] = step
    edge = next((e for e in state["edges"] if (e["from"], e["failed"], e["recovery"]) == key),
                None)
    if edge is None:
        state["edges"].append({"id": _new_id(state), "from": rep["state"],
                               "failed": rep["failed"], "recovery": rep["recovery"],
                               "to": rep["to"], "attempts": 1, "successes": 1, "born": step,
                               "last": step})
    else:
        edge["attempts"] += 1
        edge["successes"] += 1
        edge["last"] = step


def write_rule(state: dict[str, Any], move: tuple[str, str, str], step: int) -> None:
    for name in (move[0], move[2]):
        node = state["states"].setdefault(name, {"seen": 0, "last": step})
        node["seen"] += 1
        node["last"] = step
    rule = next((r for r in state["rules"] if (r["from"], r["action"], r["to"]) == move), None)
    if rule is None:
        state["rules"].append({"id": _new_id(state), "from": move[0], "action": move[1],
                               "to": move[2], "attempts": 1, "successes": 1, "born": step,
                               "last": step})
    else:
        rule["attempts"] += 1
        rule["successes"] += 1
        rule["last"] = step


def cap_states(states: dict[str, dict[str, Any]], limit: int) -> int:
    """Drop the least recently seen nodes beyond ``limit``; returns how many."""
    extra = len(states) - limit
    if extra <= 0:
        return 0
    for name in sorted(states, key=lambda n: (states[n]["last"], states[n]["seen"], n))[:extra]:
        del states[name]
    return extra


def shown_edges(state: dict[str, Any], at: str, s: Settings) -> list[dict[str, Any]]:
    edges = [e for e in state["edges"] if e["from"] == at and confidence(e) >= s.min_confidence]
    return sorted(edges, key=lambda e: (-confidence(e), -int(e["last"]), int(e["id"])))[:s.edge_k]


def matching_entries(state: dict[str, Any], task: str, s: Settings) -> list[dict[str, Any]]:
    scored = [(similarity(task, e["trigger"]["task"]) * confidence(e), e) for e in state["entries"]
              if similarity(task, e["trigger"]["task"]) >= s.trigger_match
              and confidence(e) >= s.min_confidence]
    scored.sort(key=lambda p: (-p[0], int(p[1]["id"])))
    return [e for _, e in scored[:s.k]]


# ---------------------------------------------------------------- the episode wrapper


class GuidedEpisode:
    """Wraps an env's episode: appends the repair edges of the state it is in (at the start and
    after every turn that changes state) to the observation; records what it showed in the
    turn's info under ``living_harness``."""

    def __init__(self, inner: Any, edges: dict[str, list[dict[str, Any]]], start: str,
                 state_key: str) -> None:
        self.inner, self.edges, self.state, self.state_key = inner, edges, start, state_key
        self.stop_strings = tuple(getattr(inner, "stop_strings", ()) or ())
        self.shown: dict[str, list[int]] = {}

    def _advice(self, state: str) -> str:
        if state in self.shown or not self.edges.get(state):
            return ""
        self.shown[state] = [int(e["id"]) for e in self.edges[state]]
        return render_edges(state, self.edges[state])

    def reset(self) -> list[dict[str, str]]:
        messages = [dict(m) for m in self.inner.reset()]
        advice = self._advice(self.state)
        if advice and messages:
            messages[-1]["content"] += "\n" + advice
        return messages

    def step(self, assistant_text: str) -> StepResult:
        result = self.inner.step(assistant_text)
        before = self.state
        self.state = str(result.info.get(self.state_key, before))
        info = {**result.info, NAME: {"shown": self.shown.get(before, [])}}
        messages = [dict(m) for m in result.messages]
        advice = self._advice(self.state) if not result.done else ""
        if advice and messages:
            messages[-1]["content"] += "\n" + advice
        elif advice:
            messages.append({"role": "user", "content": advice})
        return StepResult(messages=messages, done=result.done, info=info)


# ---------------------------------------------------------------- the step


def credit_shown(state: dict[str, Any], steps: Sequence[dict[str, Any]],
                 turns: Sequence[dict[str, Any]]) -> None:
    """A shown edge whose recovery the agent took: one more attempt, a success when the call
    did not fail."""
    by_id = {int(e["id"]): e for e in state["edges"]}
    for s_, t in zip(steps, turns):
        for i in ((t.get("info") or {}).get(NAME) or {}).get("shown", []):
            e = by_id.get(int(i))
            if e is not None and e["recovery"] == s_["action"]:
                e["attempts"] += 1
                e["successes"] += int(not s_["error"])


def evolve(run: Run, batch: RolloutBatch) -> None:
    s = run.settings(NAME)
    state = state_of(run)
    if batch.rewards is None:
        loop.score(run, batch)
    values = metric_values(batch, s.metric, NAME)
    failures = updates = 0
    work = []
    for row, (info, prompt) in enumerate(zip(batch.info, batch.prompts)):
        turns = (info.get("episode") or {}).get("turns") or []
        start = str(prompt.info.get(s.state_key, s.start_state))
        steps = walk(turns, start, s.state_key)
        failures += sum(bool(x["error"]) for x in steps)
        work.append((row, prompt, turns, steps))
    if s.learn:
        found = []
        if s.evolve == "lm":
            todo = [(row, prompt, steps) for row, prompt, _, steps in work
                    if any(x["error"] for x in steps)]
            replies = reflection_lm(run, NAME).complete_batch(
                [lm_prompt(user_text(p), st, values[r]) for r, p, st in todo],
                s.lm.max_new_tokens, s.lm.temperature) if todo else []
            for (row, prompt, steps), reply in zip(todo, replies):
                errors = {(x["from"], x["action"]): x for x in steps if x["error"]}
                nexts = {(x["from"], x["action"]): x["to"] for x in steps if not x["error"]}
                reps = []
                for st, failed, use in _REPAIR.findall(reply):
                    failed, use = action_of(failed), action_of(use)
                    if (st, failed) in errors:  # only failures the trajectory shows
                        reps.append({"state": st, "failed": failed, "recovery": use,
                                     "error": errors[(st, failed)]["error"],
                                     "to": nexts.get((st, use), st)})
                found.append((row, prompt, reps))
        else:
            found = [(row, prompt, repairs(steps)) for row, prompt, _, steps in work]
        for row, prompt, reps in found:
            if values[row] < s.success_threshold:
                continue  # the evaluator did not confirm the recovery
            for rep in reps[:s.max_updates]:
                write_repair(state, user_text(prompt), rep, run.step, s.text_chars)
                updates += 1
        for _, _, turns, steps in work:
            credit_shown(state, steps, turns)
            for move in transitions(steps)[:s.max_updates]:
                write_rule(state, move, run.step)
    gone = (len(cap(state["entries"], s.max_entries)) + len(cap(state["edges"], s.max_edges))
            + len(cap(state["rules"], s.max_rules)) + cap_states(state["states"], s.max_states))
    state["updates"] += updates
    state["evicted"] += gone
    state["steps"] += 1
    last = {"accuracy": mean(values), "failures": float(failures),
            "failure_rate": failures / max(1, len(batch)), "updates": float(updates),
            "entries": float(len(state["entries"])), "edges": float(len(state["edges"])),
            "rules": float(len(state["rules"])), "states": float(len(state["states"])),
            "evicted": float(gone)}
    state["log"].append({"step": run.step, **last})
    del state["log"][:-50]
    for k, v in last.items():
        run.log(f"{NAME}/{k}", v)


def with_entries(run: Run, step: int, prompts: list[Prompt]) -> list[Prompt]:
    s = run.settings(NAME)
    state = state_of(run)
    out, rendered = [], {}
    for i, p in enumerate(prompts):
        picked = matching_entries(state, user_text(p), s) if s.k else []
        q = p
        if picked:
            block = "\n".join([s.header, *(render_entry(e) for e in picked)])
            if block not in rendered:
                base = run.harness.get(s.component, "")
                harness = {**run.harness, s.component: f"{base}\n\n{block}".strip()}
                with rendering(run, NAME):
                    rendered[block] = prompts_under(run, harness, [step])[step]
            q = rendered[block][i]
        out.append(Prompt(messages=q.messages, answer=q.answer, id=q.id,
                          info={**q.info, NAME: {"entries": [int(e["id"]) for e in picked]}}))
    return out


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    state_of(run)
    if s.evolve == "lm" and s.lm.source != "policy":
        reflection_lm(run, NAME)


@rlmix.hookimpl(wrapper=True)
def rlmix_prompts(run: Run, step: int) -> Generator[None, Any, Any]:
    prompts = yield
    if not prompts or inside_rendering(run, NAME):
        return prompts
    return with_entries(run, int(step), list(prompts))


@rlmix.hookimpl(wrapper=True)
def rlmix_episode(run: Run, prompt: Prompt) -> Generator[None, Any, Any]:
    episode = yield
    if episode is None:
        return None
    s = run.settings(NAME)
    state = state_of(run)
    edges: dict[str, list[dict[str, Any]]] = {}
    for name in {e["from"] for e in state["edges"]}:  # a snapshot: evolve edits the stores
        edges[name] = [dict(e) for e in shown_edges(state, name, s)]
    start = str(prompt.info.get(s.state_key, s.start_state))
    return GuidedEpisode(episode, edges, start, s.state_key)


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    evolve(run, batch)
    return None  # tools and base context stay frozen: guidance is added per prompt / state


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if state:
        metrics[f"{NAME}/updates_total"] = state["updates"]
        metrics[f"{NAME}/evicted_total"] = state["evicted"]
