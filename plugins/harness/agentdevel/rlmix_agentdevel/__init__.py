"""AgentDevel: harness improvement as release engineering on one canonical version line.

Each ``rlmix_evolve`` call is one release round:

1. run the current release on the fixed check tasks;
2. an **implementation-blind critic** (``critic``, an ``rlmix_lm`` block) labels each failure
   with a symptom ``<kind>: <detail>``; it sees the task as posed (rendered with an empty
   harness), the output and the env's feedback, never the harness text;
3. **executable diagnosis** (``diagnose``, plain code): the dominant symptom kind, and a spec
   listing its details (minus those earlier flip evidence blocked);
4. the reflection LM writes exactly one **release candidate** from the spec;
5. **flip-centred gating** (``flip_gate``): the candidate is promoted only when its pass -> fail
   regressions are at most ``flip_tolerance`` and it fixes at least one task (fail -> pass).
   A rejected candidate's regressions are evidence: the critic labels them, and the spec items
   they name are blocked for later rounds.

``gate: mean`` is the baseline: the same loop promoting any candidate with a higher mean score.
Every release is kept with its spec and flips (``run.state["agentdevel"]["releases"]``). The
budget counts metric calls (one scored rollout of one task), the first run included.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    fenced_text,
    mean,
    reflection_lm,
    score_tasks,
    split_pool,
    task_prompts,
    traces,
    user_text,
)
from rlmix_lm import LMSettings, make_lm

import rlmix
from rlmix.manifest import check_choices
from rlmix.types import HarnessUpdate, RolloutBatch, Run

NAME = "agentdevel"
GATES = ("flip", "mean")


@dataclass
class Settings:
    component: str = "instructions"  # the harness component a release changes
    budget: int = 120  # metric calls (one scored rollout of one task), the first run included
    check_size: int = 8  # the fixed check tasks every release runs
    gate: str = "flip"  # flip | mean (baseline)
    flip_tolerance: int = 0  # pass -> fail regressions a promoted release may have
    metric: str = ""  # reward term to maximise, e.g. arith.correct; "" = the weighted reward
    max_new_tokens: int = 0  # task rollouts; 0 = sampling.max_new_tokens
    task_step_base: int = 1_900_000  # tasks are rlmix_prompts(run, task_step_base + k)
    feedback_chars: int = 300
    critic: LMSettings = field(default_factory=LMSettings)
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        check_choices(self, gate=GATES)
        if self.budget < 1 or self.check_size < 1 or self.flip_tolerance < 0:
            raise ValueError("budget: budget and check_size must be >= 1, flip_tolerance >= 0")


# ---------------------------------------------------------------- pure parts

_SYMPTOM = re.compile(r"symptom:\s*([\w-]+)\s*:\s*(.+)", re.I)


def parse_symptom(reply: str) -> tuple[str, str]:
    """``(kind, detail)`` from a critic's ``symptom: <kind>: <detail>``; ``("unknown", "")``
    for anything else (counted, never a crash)."""
    found = _SYMPTOM.search(reply)
    if not found:
        return ("unknown", "")
    return (found.group(1).lower(), found.group(2).strip().split("\n")[0].strip())


def diagnose(symptoms: Sequence[tuple[str, str]], blocked: set[tuple[str, str]]
             ) -> tuple[str, list[str]] | None:
    """The dominant symptom kind (most failures; ties: the name first in order) and its spec,
    the distinct details of that kind that are not blocked; None when nothing is left."""
    usable = [s for s in symptoms if s[0] != "unknown" and s not in blocked]
    if not usable:
        return None
    counts = Counter(k for k, _ in usable)
    kind = max(sorted(counts), key=lambda k: counts[k])
    return kind, sorted({d for k, d in usable if k == kind})


def flips(before: Sequence[float], after: Sequence[float]) -> tuple[list[int], list[int]]:
    """Indices of the pass -> fail and fail -> pass tasks."""
    p2f = [i for i, (b, a) in enumerate(zip(before, after)) if b >= 1.0 > a]
    f2p = [i for i, (b, a) in enumerate(zip(before, after)) if a >= 1.0 > b]
    return p2f, f2p


def flip_gate(p2f: Sequence[int], f2p: Sequence[int], tolerance: int) -> bool:
    return len(p2f) <= tolerance and len(f2p) > 0


def critic_prompt(task: str, output: str, feedback: str) -> str:
    return "\n".join([
        "You review an AI assistant's failed answer without seeing how it is built.",
        f"Task: {task}", f"Answer: {output}", f"Feedback: {feedback}",
        "Name the symptom as `symptom: <kind>: <detail>` (kind: missing-knowledge, "
        "forbidden-content, wrong-format, other)."])


def release_prompt(component: str, text: str, kind: str, spec: Sequence[str]) -> str:
    return "\n".join([
        "You are preparing the next release of an AI assistant's instructions.",
        f'The part called "{component}" currently reads:', "```", text, "```",
        f"Engineering spec ({kind}), to address in this release: {', '.join(spec)}",
        "Write the release candidate: the new text only, between ``` lines."])




parse_proposal = fenced_text  # the text inside the reply's first ``` fence


# ---------------------------------------------------------------- the release line


def _run_release(run: Run, state: dict[str, Any], text: str) -> tuple[list[float], RolloutBatch]:
    s = run.settings(NAME)
    tasks = [tuple(t) for t in state["tasks"]]
    scores, batch = score_tasks(run, {**run.harness, s.component: text}, tasks,
                                max_new_tokens=s.max_new_tokens or None, metric=s.metric,
                                owner=NAME)
    state["metric_calls"] += len(tasks)
    return scores, batch


def _critic(run: Run) -> Any:
    own = run.plugin_resources(NAME)
    if "critic" not in own:
        own["critic"] = make_lm(run, run.settings(NAME).critic, f"{NAME}.critic")
    return own["critic"]


def _label(run: Run, state: dict[str, Any], batch: RolloutBatch, scores: list[float],
           rows: Sequence[int]) -> list[tuple[str, str]]:
    """The critic's symptom for each of ``rows``: it sees the task as posed (the env's prompt
    under an empty harness), the output and the feedback, never the harness."""
    s = run.settings(NAME)
    tasks = [tuple(state["tasks"][i]) for i in rows]
    blind = task_prompts(run, {**run.harness, s.component: ""}, tasks)
    records = traces(batch, scores, s.feedback_chars)
    out = []
    for prompt, i in zip(blind, rows):
        text = critic_prompt(user_text(prompt), records[i]["output"], records[i]["feedback"])
        state["critic_prompts"].append(text)
        symptom = parse_symptom(_critic(run).complete(text, 64, 0.0))
        state["malformed"] += int(symptom[0] == "unknown")
        out.append(symptom)
    return out


def init_state(run: Run) -> dict[str, Any]:
    s = run.settings(NAME)
    if s.component not in run.harness:
        from rlmix.errors import ConfigError

        raise ConfigError(f"{NAME}.component: the harness has no component {s.component!r}")
    pool = split_pool(run, {"selection": s.check_size}, s.task_step_base)
    state = run.state[NAME] = {
        "tasks": [list(t) for t in pool["selection"]], "metric_calls": 0, "round": 0,
        "blocked": [], "releases": [], "malformed": 0, "critic_prompts": [],
        "regressing_promotions": 0, "history": []}
    text = run.harness[s.component]
    scores, batch = _run_release(run, state, text)
    state["releases"].append({"text": text, "scores": scores, "spec": None, "flips": None})
    state["last_batch"] = batch
    return state


def release_round(run: Run, state: dict[str, Any]) -> dict[str, Any]:
    s = run.settings(NAME)
    current = state["releases"][-1]
    record: dict[str, Any] = {"round": state["round"], "promoted": False}
    failed = [i for i, v in enumerate(current["scores"]) if v < 1.0]
    if not failed:
        record["why"] = "nothing fails"
        return record
    batch = state["last_batch"]
    symptoms = _label(run, state, batch, current["scores"], failed)
    blocked = {tuple(b) for b in state["blocked"]}
    diagnosis = diagnose(symptoms, blocked)
    if diagnosis is None:
        record["why"] = "no unblocked symptom"
        return record
    kind, spec = diagnosis
    record["spec"] = [kind, spec]
    reply = reflection_lm(run, NAME).complete(
        release_prompt(s.component, current["text"], kind, spec), s.lm.max_new_tokens,
        s.lm.temperature)
    text = parse_proposal(reply)
    if not text or text == current["text"]:
        record["why"] = "no new text"
        state["blocked"] += [[kind, d] for d in spec]
        return record
    scores, rc_batch = _run_release(run, state, text)
    p2f, f2p = flips(current["scores"], scores)
    record["flips"] = {"pass_to_fail": len(p2f), "fail_to_pass": len(f2p)}
    promote = (flip_gate(p2f, f2p, s.flip_tolerance) if s.gate == "flip"
               else mean(scores) > mean(current["scores"]))
    if promote:
        state["regressing_promotions"] += int(len(p2f) > 0)
        state["releases"].append({"text": text, "scores": scores, "spec": [kind, spec],
                                  "flips": record["flips"]})
        state["last_batch"] = rc_batch
        record["promoted"] = True
        return record
    # the regressions are evidence: block the spec items the regressed tasks' symptoms name
    named = _label(run, state, rc_batch, scores, p2f) if p2f else []
    hit = [d for d in spec if any(d in detail.split() or d == detail for _, detail in named)]
    state["blocked"] += [[kind, d] for d in (hit or spec)]
    record["blocked"] = hit or spec
    return record


def iterate(run: Run) -> HarnessUpdate | None:
    s = run.settings(NAME)
    if NAME not in run.state and _nothing_to_evolve(run):
        return None
    state = run.state.get(NAME) or init_state(run)
    if state["metric_calls"] + len(state["tasks"]) > s.budget:
        return None
    record = release_round(run, state)
    state["history"].append(record)
    state["round"] += 1
    if not record["promoted"]:
        return None
    rel = state["releases"][-1]
    return HarnessUpdate(
        components={s.component: rel["text"]},
        evidence=(f"release {len(state['releases']) - 1}: spec {rel['spec'][0]} "
                  f"{', '.join(rel['spec'][1])}; flips {rel['flips']}; mean "
                  f"{mean(rel['scores']):.3f}"),
        parent_version=run.harness_version, source=NAME)


def _nothing_to_evolve(run: Run) -> bool:
    """True (with a warning at configure) when the harness lacks the component: nothing to do."""
    return run.settings(NAME).component not in run.harness


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    if _nothing_to_evolve(run):
        print(f"rlmix: warning: {NAME} has nothing to evolve: the harness has no component "
              f"{s.component!r} (give its starting text under 'harness:')")
        return
    if s.lm.source != "policy":
        reflection_lm(run, NAME)
    if s.critic.source != "policy":
        _critic(run)


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return iterate(run)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if not state:
        return
    run.log("agentdevel/metric_calls", state["metric_calls"])
    run.log("agentdevel/releases", len(state["releases"]) - 1)
    run.log("agentdevel/score", mean(state["releases"][-1]["scores"]))
    run.log("agentdevel/regressing_promotions", state["regressing_promotions"])
    run.log("agentdevel/malformed_symptoms", state["malformed"])
