"""EvolveMem: an episodic memory whose retrieval configuration is searched, one field at a time,
from diagnosed failures, with revert-on-regression and explore-on-stagnation.

EvolveMem (seed 000, paragraph 110) exposes a memory system's whole retrieval configuration as
a structured action space; each round a diagnosis module reads per-question failure logs, names
root causes and proposes a targeted change, and a guarded meta-analyser applies it, reverting it
when the next evaluation regresses and exploring when the score stagnates.

In rlmix the memory is an episodic memory of past tasks built by this plugin: every training
step adds one entry per prompt (task, answer, score, the env's feedback). A wrapper on
``rlmix_prompts`` renders, for each prompt, the entries the *active configuration* retrieves into
a harness component and rebuilds the env's prompt under it. The configuration:

* ``k``: entries shown per prompt (0 = no memory);
* ``scoring``: ``recency`` (newest first), ``similarity`` (word overlap with the task),
  ``reward`` (best score first);
* ``store``: which entries are eligible and how they read: ``full`` (every entry, the whole
  trace), ``summary`` (every entry, task, outcome and lesson), ``failures`` / ``successes``
  (only those, as summaries);
* ``max_size``: only the newest ``max_size`` entries are eligible;
* ``placement``: the harness component the memory goes into (``system`` or ``instructions``).

One ``rlmix_evolve`` call is one round: evaluate the active configuration on fixed tasks
(greedy, scored by the run's scorers); if the score dropped by more than ``tolerance`` since the
previous round's action, score the previous configuration again and revert the action when that
one is now better; after ``patience`` rounds without a new best,
explore (a random one-field change, seeded); otherwise diagnose the failures (rule-based or by
the reflection LM) and change one field. State lives in ``run.state["evolve_mem"]``.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    Task,
    cut,
    feedback_text,
    generate_scored,
    inside_rendering,
    mean,
    metric_values,
    prompts_under,
    reflection_lm,
    rendering,
    similarity,
    task_pool,
    user_text,
)
from rlmix_lm import LM, LMSettings

import rlmix
from rlmix import loop
from rlmix.types import HarnessUpdate, Prompt, RolloutBatch, Run

NAME = "evolve_mem"
SCORINGS = ("recency", "similarity", "reward")
STORES = ("full", "summary", "failures", "successes")
PLACEMENTS = ("system", "instructions")
DIAGNOSES = ("rule", "lm")
FIELDS = ("k", "scoring", "store", "max_size", "placement")
_RENDERING = "evolve_mem.rendering"
_ACTION = re.compile(r"ACTION\s*:\s*([a-z_]+)\s*=\s*([A-Za-z0-9_]+)", re.I)


@dataclass
class Settings:
    # the starting configuration (the paper starts from a minimal baseline: no memory shown)
    k: int = 0
    scoring: str = "recency"
    store: str = "full"
    max_size: int = 16
    placement: str = "system"
    # the action space: the values each field may take
    k_choices: list[int] = field(default_factory=lambda: [0, 1, 2, 4])
    max_size_choices: list[int] = field(default_factory=lambda: [4, 16, 64])
    scoring_choices: list[str] = field(default_factory=lambda: list(SCORINGS))
    store_choices: list[str] = field(default_factory=lambda: list(STORES))
    placement_choices: list[str] = field(default_factory=lambda: list(PLACEMENTS))
    capacity: int = 256  # entries kept at all (the oldest go first)
    eval_size: int = 8  # tasks every configuration is evaluated on
    task_step_base: int = 3_000_000  # eval tasks are rlmix_prompts(run, task_step_base + k)
    tolerance: float = 0.0  # a score drop larger than this is a regression (reverted)
    patience: int = 2  # rounds without a new best score before an exploring action
    diagnose: str = "rule"  # rule | lm (falls back to rule when the reply names no valid action)
    sim_threshold: float = 0.5  # diagnosis: a shown entry this similar to the task is relevant
    metric: str = ""  # reward term to maximise, e.g. arith.correct; "" = the weighted reward
    success_threshold: float = 0.5
    header: str = "Memory of past tasks:"
    text_chars: int = 160  # task, answer and feedback are cut to this many characters
    max_new_tokens: int = 0  # eval rollouts; 0 = sampling.max_new_tokens
    seed: int = 0
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, diagnose=DIAGNOSES)
        for name, allowed in (("scoring", SCORINGS), ("store", STORES),
                              ("placement", PLACEMENTS)):
            choices = getattr(self, f"{name}_choices")
            bad = [c for c in choices if c not in allowed]
            if not choices or bad:
                raise ValueError(f"{name}_choices: must be a non-empty subset of "
                                 f"{', '.join(allowed)}, got {list(choices)}")
        for name in ("k", "max_size"):
            choices = getattr(self, f"{name}_choices")
            if not choices or any(int(c) < (0 if name == "k" else 1) for c in choices):
                raise ValueError(f"{name}_choices: must be a non-empty list of "
                                 f"{'>= 0' if name == 'k' else '>= 1'} integers")
        for name in FIELDS:
            if getattr(self, name) not in getattr(self, f"{name}_choices"):
                raise ValueError(f"{name}: {getattr(self, name)!r} is not among {name}_choices "
                                 f"{list(getattr(self, f'{name}_choices'))}")
        if self.capacity < 1 or self.eval_size < 1:
            raise ValueError("capacity: capacity and eval_size must be >= 1")
        if self.patience < 1:
            raise ValueError(f"patience: must be >= 1 round, got {self.patience}")
        if self.tolerance < 0 or not 0.0 <= self.sim_threshold <= 1.0:
            raise ValueError("tolerance: must be >= 0 (and sim_threshold in [0, 1])")
        if self.text_chars < 16 or self.max_new_tokens < 0:
            raise ValueError("text_chars: must be >= 16 (and max_new_tokens >= 0)")


def _reset_state(run: Run, value: dict[str, Any]) -> dict[str, Any]:
    """``run.plugin_state(NAME)`` (checkpointed) set to ``value``, in place."""
    state = run.plugin_state(NAME)
    state.clear()
    state.update(value)
    return state


def initial_config(s: Settings) -> dict[str, Any]:
    return {f: getattr(s, f) for f in FIELDS}


def choices(s: Settings, name: str) -> list[Any]:
    return list(getattr(s, f"{name}_choices"))


# ---------------------------------------------------------------- the memory (pure)


def eligible(memory: Sequence[dict[str, Any]], config: dict[str, Any]) -> list[dict[str, Any]]:
    """The entries a configuration may show: the newest ``max_size``, filtered by ``store``."""
    window = list(memory)[-int(config["max_size"]):]
    if config["store"] == "failures":
        return [e for e in window if not e["success"]]
    if config["store"] == "successes":
        return [e for e in window if e["success"]]
    return window


def retrieve(memory: Sequence[dict[str, Any]], task: str, config: dict[str, Any]
             ) -> list[dict[str, Any]]:
    """The ``k`` entries the configuration shows for ``task`` (deterministic; ties go to the
    newer entry)."""
    pool = eligible(memory, config)
    if config["scoring"] == "similarity":
        pool.sort(key=lambda e: (similarity(task, e["task"]), e["id"]), reverse=True)
    elif config["scoring"] == "reward":
        pool.sort(key=lambda e: (e["score"], e["id"]), reverse=True)
    else:
        pool.sort(key=lambda e: e["id"], reverse=True)
    return pool[:int(config["k"])]


def entry_text(e: dict[str, Any], store: str) -> str:
    if store == "full":
        text = f"Task: {e['task']} | Answer: {e['output']} | Score: {e['score']:g}"
        return text + (f" | Feedback: {e['feedback']}" if e["feedback"] else "")
    lesson = e["feedback"] if (not e["success"] and e["feedback"]) else f"answer {e['output']}"
    return f"{e['task']} -> {'solved' if e['success'] else 'failed'}: {lesson}"


def render(entries: Sequence[dict[str, Any]], store: str, header: str) -> str:
    if not entries:
        return ""
    return "\n".join([header] + [f"- {entry_text(e, store)}" for e in entries])


# ---------------------------------------------------------------- diagnosis and actions (pure)


def causes(logs: Sequence[dict[str, Any]], sim_threshold: float) -> Counter[str]:
    """Root causes of the failed tasks: ``no_memory`` (nothing was shown), ``irrelevant``
    (nothing shown was similar to the task), ``unhelpful`` (a similar entry was shown and the
    task still failed)."""
    out: Counter[str] = Counter()
    for log in logs:
        if log["success"]:
            continue
        if not log["shown"]:
            out["no_memory"] += 1
        elif log["max_sim"] < sim_threshold:
            out["irrelevant"] += 1
        else:
            out["unhelpful"] += 1
    return out


def _step_up(values: list[Any], current: Any) -> Any | None:
    bigger = sorted(v for v in values if v > current)
    return bigger[0] if bigger else None


def remedies(cause: str, config: dict[str, Any], s: Settings) -> list[tuple[str, Any]]:
    """One-field changes that address ``cause``, best first (only values in the action space
    that differ from the current ones)."""
    k_up = _step_up(choices(s, "k"), config["k"])
    size_up = _step_up(choices(s, "max_size"), config["max_size"])
    out: list[tuple[str, Any]] = []
    if cause == "no_memory":
        out += [("k", k_up), ("store", "full"), ("max_size", size_up)]
    elif cause == "irrelevant":
        out += [("scoring", "similarity"), ("max_size", size_up), ("k", k_up)]
    elif cause == "unhelpful":
        out += [("store", "failures"), ("max_size", size_up), ("k", k_up), ("store", "summary")]
        out += [("placement", p) for p in choices(s, "placement")]
    return [(f, v) for f, v in out
            if v is not None and v in choices(s, f) and v != config[f]]


def rule_diagnosis(logs: Sequence[dict[str, Any]], config: dict[str, Any], s: Settings,
                   tabu: set[tuple[str, str]]) -> tuple[str, Any] | None:
    """The remedy of the most frequent cause that was not already reverted from this config."""
    key = config_key(config)
    for cause, _ in sorted(causes(logs, s.sim_threshold).items(), key=lambda c: (-c[1], c[0])):
        for f, v in remedies(cause, config, s):
            if (key, f"{f}={v}") not in tabu:
                return f, v
    return None


def random_action(config: dict[str, Any], s: Settings, rng: random.Random,
                  tabu: set[tuple[str, str]] = frozenset()) -> tuple[str, Any] | None:
    """A uniformly random one-field change, not one already reverted from this config (unless
    every change was)."""
    key = config_key(config)
    options = [(f, v) for f in FIELDS for v in choices(s, f) if v != config[f]]
    fresh = [(f, v) for f, v in options if (key, f"{f}={v}") not in tabu]
    pool = fresh or options
    return rng.choice(pool) if pool else None


def config_key(config: dict[str, Any]) -> str:
    return ",".join(f"{f}={config[f]}" for f in FIELDS)


def parse_action(reply: str, config: dict[str, Any], s: Settings) -> tuple[str, Any] | None:
    """``ACTION: field=value`` with a field of the action space and one of its values that
    differs from the current one; else None."""
    for f, raw in _ACTION.findall(reply):
        f = f.lower()
        if f not in FIELDS:
            continue
        value: Any = raw
        if f in ("k", "max_size"):
            if not raw.isdigit():
                continue
            value = int(raw)
        if value in choices(s, f) and value != config[f]:
            return f, value
    return None


def diagnosis_prompt(config: dict[str, Any], s: Settings, logs: Sequence[dict[str, Any]],
                     score: float) -> str:
    lines = ["You tune the memory of an AI assistant. Its retrieval configuration:",
             ", ".join(f"{f}={config[f]}" for f in FIELDS),
             "Allowed values: " + "; ".join(f"{f}: {', '.join(str(v) for v in choices(s, f))}"
                                            for f in FIELDS),
             "(k: entries shown per task; scoring: how entries are ranked; store: which entries "
             "are shown and how; max_size: only the newest this many are eligible; placement: "
             "where the memory is written.)",
             f"Score on the evaluation tasks: {score:.3f}. Failures:"]
    for log in [x for x in logs if not x["success"]][:6]:
        lines.append(f"- Task: {log['task']} | shown {len(log['shown'])} entries (best "
                     f"similarity {log['max_sim']:.2f}) | answer: {log['output']} | "
                     f"feedback: {log['feedback']}")
    lines.append("Name the root cause, then change one field: end with one line "
                 "'ACTION: <field>=<value>'.")
    return "\n".join(lines)


# ---------------------------------------------------------------- state, rendering


def state_of(run: Run) -> dict[str, Any]:
    state = run.plugin_state(NAME)
    if not state:
        s = run.settings(NAME)
        state = _reset_state(run, {
            "config": initial_config(s), "memory": [], "next_id": 0, "round": 0,
            "score": None, "best": None, "best_config": initial_config(s), "stagnant": 0,
            "pending": None, "tabu": [], "metric_calls": 0, "reverts": 0, "explores": 0,
            "lm_fallbacks": 0, "history": []})
    return state


def _lm(run: Run) -> LM:
    return reflection_lm(run, NAME)


def with_memory(run: Run, step: int, prompts: list[Prompt], config: dict[str, Any]
                ) -> list[Prompt]:
    """Each prompt of ``step`` rebuilt by the env under a harness holding the entries
    ``config`` retrieves for it; ``info["evolve_mem"]`` records the shown ids, their best
    similarity to the task and the task text."""
    s = run.settings(NAME)
    memory = list(state_of(run)["memory"])  # a snapshot (an async sampler builds prompts too)
    rendered: dict[str, list[Prompt]] = {}
    out = []
    for i, p in enumerate(prompts):
        task = user_text(p)
        shown = retrieve(memory, task, config)
        block = render(shown, str(config["store"]), s.header)
        record = {"shown": [e["id"] for e in shown], "task": cut(task, s.text_chars),
                  "max_sim": max((similarity(task, e["task"]) for e in shown), default=0.0)}
        q = p
        if block:
            if block not in rendered:
                where = str(config["placement"])
                base = run.harness.get(where, "")
                harness = {**run.harness, where: f"{base}\n\n{block}".strip()}
                with rendering(run, NAME):
                    rendered[block] = prompts_under(run, harness, [step])[step]
            if i >= len(rendered[block]):
                raise RuntimeError(f"evolve_mem: the env returned {len(rendered[block])} prompts "
                                   f"for step {step} under a memory harness, {len(prompts)} "
                                   f"without (rlmix_prompts must be deterministic in step)")
            q = rendered[block][i]
        out.append(Prompt(messages=q.messages, answer=q.answer, id=q.id,
                          info={**q.info, NAME: record}))
    return out


# ---------------------------------------------------------------- a round


def eval_tasks(run: Run) -> list[Task]:
    s = run.settings(NAME)
    return task_pool(run, s.eval_size, s.task_step_base)


def evaluate(run: Run, config: dict[str, Any]) -> tuple[float, list[dict[str, Any]]]:
    """Mean metric of ``config`` on the eval tasks (greedy), and one failure-log record per
    task: task, shown ids, best similarity, answer, feedback, success. Counts metric calls."""
    s = run.settings(NAME)
    tasks = eval_tasks(run)
    prompts: list[Prompt] = []
    with rendering(run, NAME):
        plain = prompts_under(run, dict(run.harness), sorted({t[0] for t in tasks}))
    for step in sorted(plain):
        wanted = [i for st, i in tasks if st == step]
        dressed = with_memory(run, step, plain[step], config)
        prompts += [dressed[i] for i in wanted]
    batch = generate_scored(run, prompts, 0.0, s.max_new_tokens or None)
    values = metric_values(batch, s.metric, NAME)
    state_of(run)["metric_calls"] += len(prompts)
    logs = []
    for row, p in enumerate(batch.prompts):
        meta = p.info[NAME]
        logs.append({"task": meta["task"], "shown": meta["shown"], "max_sim": meta["max_sim"],
                     "output": cut(batch.texts[row], s.text_chars),
                     "feedback": cut(feedback_text(batch.info[row], NAME), s.text_chars),
                     "success": values[row] >= s.success_threshold})
    return mean(values), logs


def remember(run: Run, batch: RolloutBatch) -> int:
    """One entry per prompt of the training batch (its best row); returns how many."""
    s = run.settings(NAME)
    state = state_of(run)
    values = metric_values(batch, s.metric, NAME)
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(batch.group.tolist()):
        groups.setdefault(int(g), []).append(row)
    for rows in groups.values():
        best = max(rows, key=lambda r: (values[r], -r))
        p = batch.prompts[best]
        task = (p.info.get(NAME) or {}).get("task") or cut(user_text(p), s.text_chars)
        state["memory"].append({
            "id": state["next_id"], "step": run.step, "task": task,
            "output": cut(batch.texts[best], s.text_chars), "score": values[best],
            "success": values[best] >= s.success_threshold,
            "feedback": cut(feedback_text(batch.info[best], NAME), s.text_chars)})
        state["next_id"] += 1
    del state["memory"][:-s.capacity]
    return len(groups)


def choose(run: Run, logs: list[dict[str, Any]], score: float, rng: random.Random
           ) -> tuple[str, tuple[str, Any] | None]:
    """``(kind, action)``: ``hold`` when no eval task failed; ``explore`` after ``patience``
    rounds without a new best (or when diagnosis finds nothing to change); else
    ``diagnose``."""
    s = run.settings(NAME)
    state = state_of(run)
    config = state["config"]
    tabu = {(str(a), str(b)) for a, b in state["tabu"]}
    if all(log["success"] for log in logs):
        return "hold", None
    if state["stagnant"] >= s.patience:
        return "explore", random_action(config, s, rng, tabu)
    action = None
    if s.diagnose == "lm":
        reply = _lm(run).complete(diagnosis_prompt(config, s, logs, score), s.lm.max_new_tokens,
                                  s.lm.temperature)
        action = parse_action(reply, config, s)
        if action is not None and (config_key(config), f"{action[0]}={action[1]}") in tabu:
            action = None  # already reverted from this very configuration
        if action is None:
            state["lm_fallbacks"] += 1
    if action is None:
        action = rule_diagnosis(logs, config, s, tabu)
    if action is None:
        return "explore", random_action(config, s, rng, tabu)
    return "diagnose", action


def round_(run: Run) -> dict[str, Any]:
    """One EvolveMem round; returns its history record."""
    s = run.settings(NAME)
    state = state_of(run)
    record: dict[str, Any] = {"round": state["round"], "step": run.step,
                              "config": dict(state["config"])}
    score, logs = evaluate(run, state["config"])
    record["score"] = score
    pending = state["pending"]
    if pending is not None:
        if score < pending["score"] - s.tolerance:
            # a drop: the memory grew since the parent was scored, so score the parent again
            # now; revert only when it beats the change on today's memory
            parent_score, parent_logs = evaluate(run, pending["config"])
            record["parent_now"] = parent_score
            if parent_score > score:
                state["tabu"].append([config_key(pending["config"]), pending["action"]])
                state["config"] = dict(pending["config"])
                state["reverts"] += 1
                score, logs = parent_score, parent_logs
                record.update(reverted=pending["action"], score_after_revert=score,
                              config=dict(state["config"]))
            else:
                record["kept"] = pending["action"]
                record["unconfirmed_drop"] = True
        else:
            record["kept"] = pending["action"]
    if state["best"] is None or score > state["best"] + 1e-12:
        state["best"], state["best_config"], state["stagnant"] = score, dict(state["config"]), 0
    else:
        state["stagnant"] += 1
    state["score"] = score
    rng = random.Random(f"{NAME}-{s.seed}-{state['round']}")
    kind, action = choose(run, logs, score, rng)
    record["causes"] = dict(causes(logs, s.sim_threshold))
    if kind == "explore":
        state["explores"] += 1
        state["stagnant"] = 0
    record["action_kind"] = kind
    if action is None:
        state["pending"] = None
    else:
        f, v = action
        state["pending"] = {"config": dict(state["config"]), "score": score,
                            "action": f"{f}={v}"}
        state["config"] = {**state["config"], f: v}
        record[kind] = f"{f}={v}"
    record["metric_calls"] = state["metric_calls"]
    state["round"] += 1
    state["history"].append(record)
    return record


def evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    """Remember the batch, then one round. ``run.harness`` itself is not changed (the memory
    is added per prompt), so no harness update is returned."""
    if batch.rewards is None:
        loop.score(run, batch)
    remember(run, batch)
    round_(run)
    return None


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    state_of(run)
    if s.diagnose == "lm" and s.lm.source != "policy":
        _lm(run)  # load or connect now, so a bad model or URL fails before the first step


@rlmix.hookimpl(wrapper=True)
def rlmix_prompts(run: Run, step: int) -> Generator[None, Any, Any]:
    prompts = yield
    if not prompts or inside_rendering(run, NAME):
        return prompts
    return with_memory(run, int(step), list(prompts), state_of(run)["config"])


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return evolve(run, batch)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.plugin_state(NAME)
    if not state or state["score"] is None:
        return
    metrics[f"{NAME}/score"] = state["score"]
    metrics[f"{NAME}/best"] = state["best"]
    metrics[f"{NAME}/memory"] = len(state["memory"])
    metrics[f"{NAME}/k"] = state["config"]["k"]
    metrics[f"{NAME}/reverts"] = state["reverts"]
    metrics[f"{NAME}/explores"] = state["explores"]
    metrics[f"{NAME}/metric_calls"] = state["metric_calls"]
    metrics[f"{NAME}/config"] = config_key(state["config"])
