"""HarnessEvolve: harness edits learned from reference trajectories, admitted through a quality
gate (no leaked answers, no bloat) and a performance gate (better on this batch, no worse on
the recent ones), with the best held-out snapshot kept.

Each ``rlmix_evolve`` call is one batch of search tasks:

1. run the current harness on the batch; for every failed task, run it again with its ground
   truth in the prompt (the *reference trajectory*);
2. align each failed output with its reference (``error_signal``: what the reference says that
   the failure and the task did not) and cluster the failures by signal
   (``failure_patterns``);
3. per pattern, ask the reflection LM for one edit of the evolved component;
4. the **quality gate** rejects an edit that writes any training answer into the text
   (``leaks``) or grows it past ``max_chars`` (bloat); the **performance gate** accepts an edit
   only when it raises this batch's score and lowers none of the last ``recent_batches``;
5. at the end of every pass over the search batches the harness is scored on held-out tasks,
   and the best held-out snapshot is the one applied.

``gated: false`` is the baseline: no quality gate, and an edit is kept whenever it raises the
batch's score. The budget counts metric calls (scored rollouts) and reference rollouts; state
is in ``run.state["harness_evolve"]``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    fenced_text,
    generate_scored,
    guard_heldout,
    mean,
    metric_values,
    reflection_lm,
    split_pool,
    task_prompts,
    user_text,
    words,
)
from rlmix_lm import LMSettings

import rlmix
from rlmix.errors import ConfigError
from rlmix.types import HarnessUpdate, Prompt, RolloutBatch, Run

NAME = "harness_evolve"


@dataclass
class Settings:
    component: str = "instructions"  # the harness component edited
    budget: int = 200  # scored rollouts and reference rollouts
    search_size: int = 8  # search tasks, split into batches
    batch_size: int = 0  # tasks per batch; 0 = the whole search set
    heldout_size: int = 8  # tasks the search never sees; the snapshot choice
    recent_batches: int = 2  # the performance gate: none of these may get worse
    max_chars: int = 400  # the quality gate's length budget for the edited component
    gated: bool = True  # false: the ungated baseline
    max_patterns: int = 3  # edits proposed per batch at most
    metric: str = ""  # reward term to maximise, e.g. arith.correct; "" = the weighted reward
    max_new_tokens: int = 0  # rollouts; 0 = sampling.max_new_tokens
    task_step_base: int = 1_700_000  # tasks are rlmix_prompts(run, task_step_base + k)
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        if self.budget < 1 or self.search_size < 1 or self.heldout_size < 0:
            raise ValueError("budget: budget and search_size must be >= 1, heldout_size >= 0")
        if self.batch_size < 0 or self.recent_batches < 0 or self.max_patterns < 1:
            raise ValueError("batch_size: batch_size and recent_batches must be >= 0, "
                             "max_patterns >= 1")
        if self.max_chars < 1:
            raise ValueError("max_chars: must be >= 1")


# ---------------------------------------------------------------- pure parts


def error_signal(failed_output: str, reference_output: str, task_input: str) -> set[str]:
    """What the reference trajectory says that the failed run and the task itself did not."""
    return words(reference_output) - words(failed_output) - words(task_input)


def failure_patterns(signals: Sequence[set[str]]) -> list[tuple[frozenset[str], list[int]]]:
    """Failures grouped by their signal, words every failure's signal shares removed first
    (when the failures are of more than one kind): ``[(signal, [failure indices])]``, the
    largest group first, empty signals dropped."""
    kinds = {frozenset(s) for s in signals}
    common = set.intersection(*map(set, signals)) if len(kinds) > 1 else set()
    groups: dict[frozenset[str], list[int]] = {}
    for i, s in enumerate(signals):
        key = frozenset(set(s) - common)
        if key:
            groups.setdefault(key, []).append(i)
    return sorted(groups.items(), key=lambda kv: (-len(kv[1]), sorted(kv[0])))


def leaks(old: str, new: str, answers: Sequence[str]) -> list[str]:
    """The training answers the edit writes into the text (whole words, not there before)."""
    before, after = words(old), words(new)
    return sorted({a for a in answers if words(a) and words(a) <= after
                   and not words(a) <= before})


def performance_ok(child_now: Sequence[float], current_now: Sequence[float],
                   recent: Sequence[tuple[Sequence[float], Sequence[float]]]) -> bool:
    """Better on this batch, and no worse on any recent batch (``(child, current)`` pairs)."""
    return mean(child_now) > mean(current_now) and all(mean(c) >= mean(p) for c, p in recent)


def with_reference(prompt: Prompt) -> Prompt:
    """The task with its ground truth appended to the last user message."""
    p = copy.deepcopy(prompt)
    for m in reversed(p.messages):
        if m["role"] == "user":
            m["content"] = f"{m['content']} (Reference: the correct answer is {p.answer}.)"
            break
    return p


def edit_prompt(component: str, text: str, signal: Sequence[str],
                examples: list[dict[str, Any]]) -> str:
    lines = ["You are improving the instructions given to an AI assistant.",
             f'The part called "{component}" currently reads:', "```", text, "```",
             "These tasks failed; a correct run of each said what the failed run did not:",
             f"Signal: {' '.join(sorted(signal))}"]
    for e in examples:
        lines += [f"Task {e['task']} answer {e['answer']}", f"Failed output: {e['output']}",
                  f"Reference output: {e['reference']}"]
    lines.append("Write the improved text, general enough to help other tasks too. Reply with "
                 "the new text only, between ``` lines.")
    return "\n".join(lines)




parse_proposal = fenced_text  # the text inside the reply's first ``` fence


# ---------------------------------------------------------------- the loop


def _tasks(state: dict[str, Any], key: str) -> list[tuple[int, int]]:
    return [tuple(t) for t in state[key]]


def _score(run: Run, state: dict[str, Any], text: str, tasks: list[Any]) -> list[float]:
    s = run.settings(NAME)
    prompts = task_prompts(run, {**run.harness, s.component: text}, tasks)
    batch = generate_scored(run, prompts, 0.0, s.max_new_tokens or None)
    state["calls"] += len(tasks)
    return metric_values(batch, s.metric, NAME)


def init_state(run: Run) -> dict[str, Any]:
    s = run.settings(NAME)
    _check_component(run)
    pool = split_pool(run, {"search": s.search_size, "heldout": s.heldout_size},
                      s.task_step_base)
    size = s.batch_size or s.search_size
    search = [list(t) for t in pool["search"]]
    state = run.state[NAME] = {
        "batches": [search[k:k + size] for k in range(0, len(search), size)],
        "heldout": [list(t) for t in pool["heldout"]], "current": run.harness[s.component],
        "calls": 0, "reference_calls": 0, "iteration": 0, "accepted": 0,
        "rejected": {"leak": 0, "bloat": 0, "performance": 0}, "history": [],
        "snapshots": [], "best": None, "search_accuracy": None}
    _snapshot(run, state)
    return state


def _snapshot(run: Run, state: dict[str, Any]) -> None:
    tasks = _tasks(state, "heldout")
    if not tasks:
        return
    guard_heldout(run, tasks)
    calls = state["calls"]
    held = mean(_score(run, state, state["current"], tasks))
    state["calls"] = calls  # held-out scoring is the snapshot choice, not search: unbudgeted
    state["snapshots"].append({"text": state["current"], "heldout": held,
                               "iteration": state["iteration"]})
    if state["best"] is None or held > state["snapshots"][state["best"]]["heldout"]:
        state["best"] = len(state["snapshots"]) - 1


def one_batch(run: Run, state: dict[str, Any]) -> dict[str, Any]:
    s = run.settings(NAME)
    k = state["iteration"] % len(state["batches"])
    tasks = [tuple(t) for t in state["batches"][k]]
    record: dict[str, Any] = {"iteration": state["iteration"], "batch": k, "edits": []}
    prompts = task_prompts(run, {**run.harness, s.component: state["current"]}, tasks)
    batch = generate_scored(run, prompts, 0.0, s.max_new_tokens or None)
    state["calls"] += len(tasks)
    now = metric_values(batch, s.metric, NAME)
    failed = [i for i, v in enumerate(now) if v < 1.0]
    record["score"] = mean(now)
    if not failed:
        return record
    refs = run.generate([with_reference(prompts[i]) for i in failed],
                        max_new_tokens=s.max_new_tokens or None)
    state["reference_calls"] += len(failed)
    state["calls"] += len(failed)
    signals = [error_signal(batch.texts[i], refs.texts[j], user_text(prompts[i]))
               for j, i in enumerate(failed)]
    answers = [str(p.answer) for b in state["batches"]
               for p in task_prompts(run, run.harness, [tuple(t) for t in b])]
    for signal, members in failure_patterns(signals)[:s.max_patterns]:
        if state["calls"] + len(tasks) > s.budget:
            break
        examples = [{"task": f"{tasks[failed[j]][0]}.{tasks[failed[j]][1]}",
                     "answer": prompts[failed[j]].answer, "output": batch.texts[failed[j]],
                     "reference": refs.texts[j]} for j in members]
        reply = reflection_lm(run, NAME).complete(
            edit_prompt(s.component, state["current"], sorted(signal), examples),
            s.lm.max_new_tokens, s.lm.temperature)
        new = parse_proposal(reply)
        edit: dict[str, Any] = {"signal": sorted(signal), "accepted": False}
        record["edits"].append(edit)
        if not new or new == state["current"]:
            edit["why"] = "no new text"
            continue
        if s.gated:
            leaked = leaks(state["current"], new, answers)
            if leaked:
                state["rejected"]["leak"] += 1
                edit["why"] = f"leaks training answers {leaked}"
                continue
            if len(new) > s.max_chars:
                state["rejected"]["bloat"] += 1
                edit["why"] = f"{len(new)} chars > max_chars {s.max_chars}"
                continue
        child_now = _score(run, state, new, tasks)
        recent: list[tuple[list[float], list[float]]] = []
        if s.gated:
            for back in range(1, s.recent_batches + 1):
                j = (k - back) % len(state["batches"])
                if j == k or state["iteration"] - back < 0:
                    continue
                other = [tuple(t) for t in state["batches"][j]]
                recent.append((_score(run, state, new, other),
                               _score(run, state, state["current"], other)))
        ok = (performance_ok(child_now, now, recent) if s.gated
              else mean(child_now) > mean(now))
        if not ok:
            state["rejected"]["performance"] += 1
            edit["why"] = "performance gate"
            continue
        state["current"], now = new, child_now
        state["accepted"] += 1
        edit["accepted"] = True
    return record


def iterate(run: Run) -> HarnessUpdate | None:
    """One batch; the harness update when the applied snapshot changed."""
    s = run.settings(NAME)
    if NAME not in run.state and s.component not in run.harness:
        return None  # nothing to evolve (warned at configure)
    state = run.state.get(NAME) or init_state(run)
    size = len(state["batches"][0])
    if state["calls"] + 2 * size > s.budget:
        return None
    state["history"].append(one_batch(run, state))
    state["iteration"] += 1
    if state["iteration"] % len(state["batches"]) == 0:  # a pass over the search set
        calls = state["calls"]
        state["search_accuracy"] = mean(
            _score(run, state, state["current"], [tuple(t) for b in state["batches"]
                                                  for t in b]))
        state["calls"] = calls  # reporting, not search
        _snapshot(run, state)
    text = (state["snapshots"][state["best"]]["text"] if state["snapshots"]
            else state["current"])
    if text == run.harness.get(s.component):
        return None
    held = (f"held-out {state['snapshots'][state['best']]['heldout']:.3f}"
            if state["snapshots"] else "no held-out set")
    return HarnessUpdate(
        components={s.component: text},
        evidence=(f"{state['accepted']} edits accepted, rejected {state['rejected']}; {held}; "
                  f"{state['calls']} calls"),
        parent_version=run.harness_version, source=NAME)


def _check_component(run: Run) -> None:
    component = run.settings(NAME).component
    if component not in run.harness:
        raise ConfigError(
            f"{NAME}.component: the harness has no component {component!r}; give its starting "
            f"text under 'harness:' (present: {', '.join(sorted(run.harness)) or 'none'})")


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    component = run.settings(NAME).component
    if component not in run.harness:
        print(f"rlmix: warning: {NAME} has nothing to evolve: the harness has no component "
              f"{component!r} (give its starting text under 'harness:')")
        return
    if run.settings(NAME).lm.source != "policy":
        reflection_lm(run, NAME)  # a bad model name or URL fails before the first step


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return iterate(run)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if not state:
        return
    run.log("harness_evolve/calls", state["calls"])
    run.log("harness_evolve/accepted", state["accepted"])
    for why, n in state["rejected"].items():
        run.log(f"harness_evolve/rejected_{why}", n)
    if state["search_accuracy"] is not None:
        run.log("harness_evolve/search_accuracy", state["search_accuracy"])
    if state["snapshots"]:
        run.log("harness_evolve/heldout", state["snapshots"][state["best"]]["heldout"])
