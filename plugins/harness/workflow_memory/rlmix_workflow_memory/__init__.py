"""Agent Workflow Memory: reusable workflows induced from successful attempts, retrieved per
prompt (Wang et al., 2024, *Agent Workflow Memory*, arXiv:2409.07429).

The memory is a list of *workflows*: a title naming a kind of task and a few steps, with the
values specific to one task abstracted (numbers become ``{n}``), plus the abstracted texts of
the tasks it came from (its retrieval keys). The plugin

* **induces** workflows from successful attempts (reward, or ``metric``, >= ``success_threshold``).
  Successes are grouped by their task's *template* (the task text with numbers abstracted). A
  success that reused retrieved workflows credits them (support + 1, its task becomes a key); an
  unaided success of a new template is summarised into a new workflow, by the reflection LM
  (``inducer: lm``, ``rlmix_lm``) or by a rule (``inducer: rule``: the template and the response
  that passed, abstracted). ``offline`` induces once from ``offline_size`` training tasks before
  the first step, ``online`` from every step's rollouts as the stream goes, ``both`` does both.
* **keeps** the memory small: a new workflow whose text nearly repeats one already there
  (word-set Jaccard >= ``dedup_threshold``) is folded into it, and past ``max_workflows`` the
  least supported (then oldest) workflow is evicted.
* **retrieves** per prompt: a pluggy wrapper on ``rlmix_prompts`` takes the env's prompts, scores
  every workflow against each prompt's task text (tf-idf cosine; a query word the memory never saw
  counts against the match), and re-renders prompt ``i`` under a harness whose ``component`` holds
  its ``top_k`` workflows above ``min_similarity`` (``rlmix_harness.prompts_under``). Prompts with
  the same retrieved set are rendered together.

State lives in ``run.state["workflow_memory"]`` (checkpointed); the memory is also written to
``<out>/workflow_memory.json`` (whole, then renamed) whenever it changes.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    mean,
    metric_values,
    prompts_under,
    reflection_lm,
    rendering,
    score_tasks,
    task_pool,
    user_text,
)
from rlmix_lm import LM, LMSettings

import rlmix
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "workflow_memory"
MODES = ("online", "offline", "both")
INDUCERS = ("lm", "rule")
BUSY = "workflow_memory.rendering"  # run.resources: threads inside this plugin's wrapper
STATS = "retrieval"  # run.plugin_resources(NAME): this step's retrieval counts
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)*(?!\w)")
_TOKEN = re.compile(r"[a-z][a-z0-9_]*|[+\-*/%^=<>]")
_TITLE = re.compile(r"^\s*(?:#+\s*)?\**\s*WORKFLOW\s*\**\s*:\s*(.+?)\s*$", re.I)
_STEP = re.compile(r"^\s*(?:[-*]|\d+[.)])\s+(.+?)\s*$")


@dataclass
class Settings:
    mode: str = "online"  # online | offline | both
    inducer: str = "lm"  # lm (the reflection model summarises) | rule (no model)
    component: str = "system"  # harness component the retrieved workflows are appended to
    header: str = "Workflows that solved similar tasks before:"
    top_k: int = 2  # workflows retrieved per prompt
    min_similarity: float = 0.3  # tf-idf cosine a workflow needs to be retrieved
    max_workflows: int = 32  # memory cap (least supported, then oldest, evicted)
    dedup_threshold: float = 0.8  # word-set Jaccard at which two workflows count as one
    success_threshold: float = 0.5  # an attempt succeeded when its metric is >= this
    metric: str = ""  # reward term that decides success, e.g. arith.correct; "" = the reward
    induce_max: int = 8  # successes shown to the inducer per new workflow
    sources_kept: int = 8  # task texts kept per workflow as retrieval keys (latest)
    offline_size: int = 16  # offline / both: training tasks induced from before the first step
    task_step_base: int = 4_000_000  # offline tasks are rlmix_prompts(run, task_step_base + k)
    temperature: float = 0.0  # offline rollouts
    max_new_tokens: int = 0  # offline rollouts; 0 = sampling.max_new_tokens
    trace_chars: int = 400  # task and response text shown to the inducer, per success
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, mode=MODES, inducer=INDUCERS)
        if not self.component:
            raise ValueError("component: name the harness component the workflows go into")
        if self.top_k < 1:
            raise ValueError(f"top_k: must be >= 1, got {self.top_k}")
        if not 0.0 <= self.min_similarity <= 1.0:
            raise ValueError(f"min_similarity: must be in [0, 1], got {self.min_similarity}")
        if self.max_workflows < 1:
            raise ValueError(f"max_workflows: must be >= 1, got {self.max_workflows}")
        if not 0.0 < self.dedup_threshold <= 1.0:
            raise ValueError(f"dedup_threshold: must be in (0, 1], got {self.dedup_threshold}")
        if self.induce_max < 1 or self.sources_kept < 1:
            raise ValueError("induce_max: induce_max and sources_kept must be >= 1")
        if self.mode != "online" and self.offline_size < 1:
            raise ValueError(f"offline_size: mode {self.mode!r} needs offline_size >= 1")
        if self.offline_size < 0 or self.max_new_tokens < 0 or self.trace_chars < 1:
            raise ValueError("offline_size: offline_size and max_new_tokens must be >= 0, "
                             "trace_chars >= 1")
        if self.temperature < 0:
            raise ValueError("temperature: must be >= 0")


# ---------------------------------------------------------------- text (pure)


def abstract(text: str) -> str:
    """``text`` with standalone numbers (``12``, ``-3``, ``5.2``) replaced by ``{n}``; numbers
    inside words (``t2``) stay."""
    return _NUMBER.sub("{n}", text)


def tokens(text: str) -> list[str]:
    """Lower-case words (starting with a letter) and arithmetic symbols."""
    return _TOKEN.findall(text.lower())


def jaccard(a: str, b: str) -> float:
    sa, sb = set(tokens(a)), set(tokens(b))
    if not sa and not sb:
        return 1.0
    return len(sa & sb) / len(sa | sb)


def workflow_text(wf: dict[str, Any]) -> str:
    return "\n".join([wf["title"], *wf["steps"]])


def document(wf: dict[str, Any]) -> str:
    """What a workflow is retrieved by: its title, steps and source tasks."""
    return "\n".join([workflow_text(wf), *wf["sources"]])


def similarities(query: str, docs: Sequence[str]) -> list[float]:
    """tf-idf cosine of ``query`` with each of ``docs``. ``idf(w) = log((N + 1) / (df(w) +
    0.5))`` over the ``N`` docs, so a word in every doc weighs little and a query word in no doc
    weighs most: it lowers every match (the memory has not seen this kind of task)."""
    n = len(docs)
    if n == 0:
        return []
    bags = [Counter(tokens(d)) for d in docs]
    df = Counter(w for bag in bags for w in bag)

    def idf(w: str) -> float:
        return math.log((n + 1) / (df.get(w, 0) + 0.5))

    q = Counter(tokens(query))
    qv = {w: c * idf(w) for w, c in q.items()}
    qn = math.sqrt(sum(v * v for v in qv.values()))
    out = []
    for bag in bags:
        dv = {w: c * idf(w) for w, c in bag.items()}
        dn = math.sqrt(sum(v * v for v in dv.values()))
        dot = sum(v * dv.get(w, 0.0) for w, v in qv.items())
        out.append(dot / (qn * dn) if qn > 0 and dn > 0 else 0.0)
    return out


def retrieve(workflows: Sequence[dict[str, Any]], query: str, top_k: int,
             min_similarity: float) -> list[int]:
    """Indices of the ``top_k`` most similar workflows scoring >= ``min_similarity`` (best
    first; ties to the older workflow)."""
    sims = similarities(query, [document(w) for w in workflows])
    ranked = sorted((i for i, s in enumerate(sims) if s >= min_similarity and s > 0),
                    key=lambda i: (-sims[i], i))
    return ranked[:top_k]


def render(workflows: Sequence[dict[str, Any]], header: str, preamble: str = "") -> str:
    """``preamble``, then ``header`` and each workflow as a title and numbered steps."""
    parts = [preamble.strip()] if preamble.strip() else []
    if workflows:
        lines = [header]
        for wf in workflows:
            lines.append(f"Workflow: {wf['title']}")
            lines += [f"{n}. {step}" for n, step in enumerate(wf["steps"], 1)]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def rule_workflow(template: str, outputs: Sequence[str]) -> tuple[str, list[str]]:
    """The no-model inducer: the template names the task; the steps restate it and show the
    (abstracted) response that passed."""
    title = template.strip().replace("\n", " ")[:160]
    steps = [f"Task: {title}"]
    shown = next((o for o in outputs if o.strip()), "")
    if shown:
        steps.append(f"A response that passed: {abstract(shown).strip()[:200]}")
    return title, steps


def induction_prompt(items: Sequence[dict[str, Any]], chars: int = 400) -> str:
    lines = ["Below are successful attempts by an AI assistant at tasks of one kind.",
             "Summarise them into one reusable workflow: what kind of task it is, and the steps "
             "that solved it."]
    for k, it in enumerate(items, 1):
        lines += [f"## Attempt {k}", f"Task: {it['task'][:chars]}",
                  f"Response: {it['output'][:chars]}"]
    lines += ["Reply in exactly this form, and write nothing else:",
              "WORKFLOW: <a short title naming the kind of task>", "- <step 1>", "- <step 2>",
              "Replace values specific to one task (numbers, names) with placeholders such as "
              "{number}."]
    return "\n".join(lines)


def parse_workflows(reply: str) -> list[tuple[str, list[str]]]:
    """``WORKFLOW: title`` lines, each followed by ``- step`` (or ``1. step``) lines; a workflow
    needs a title and at least one step; an echo of the prompt's ``<placeholder>`` is dropped."""
    out: list[tuple[str, list[str]]] = []
    title, steps = "", []
    for line in reply.splitlines():
        m = _TITLE.match(line)
        if m:
            if title and steps:
                out.append((title, steps))
            title, steps = m.group(1).strip(), []
            continue
        s = _STEP.match(line)
        if s and title:
            steps.append(s.group(1))
    if title and steps:
        out.append((title, steps))
    return [(t, st) for t, st in out
            if not t.startswith("<") and not all(x.startswith("<") for x in st)]


# ---------------------------------------------------------------- the memory (pure)


def new_memory() -> dict[str, Any]:
    return {"workflows": [], "next_id": 0, "induced": 0, "credited": 0, "folded": 0,
            "evicted": 0, "lm_failures": 0, "offline_done": False, "metric_calls": 0,
            "log": []}


def _add_sources(wf: dict[str, Any], sources: Sequence[str], keep: int) -> None:
    for src in sources:
        if src in wf["sources"]:
            wf["sources"].remove(src)
        wf["sources"].append(src)
    del wf["sources"][:-keep]


def add_workflow(memory: dict[str, Any], title: str, steps: Sequence[str],
                 sources: Sequence[str], templates: Sequence[str], threshold: float,
                 keep: int, step: int = 0) -> tuple[str, str]:
    """Add a workflow, or fold it into an existing near-duplicate (Jaccard of the title and
    steps >= ``threshold``). Returns ``(id, "added" | "folded")``."""
    text = "\n".join([title, *steps])
    for wf in memory["workflows"]:
        if jaccard(workflow_text(wf), text) >= threshold:
            wf["support"] += len(sources)
            _add_sources(wf, sources, keep)
            wf["templates"] += [t for t in templates if t not in wf["templates"]]
            memory["folded"] += 1
            return wf["id"], "folded"
    wid = f"w{memory['next_id']}"
    memory["next_id"] += 1
    wf = {"id": wid, "title": title, "steps": list(steps), "sources": [], "templates":
          list(dict.fromkeys(templates)), "support": len(sources), "used": 0, "created": step}
    _add_sources(wf, sources, keep)
    memory["workflows"].append(wf)
    memory["induced"] += 1
    return wid, "added"


def cap(memory: dict[str, Any], max_workflows: int) -> list[str]:
    """Evict the least supported (then least used, then oldest) workflows past the cap."""
    gone = []
    wfs = memory["workflows"]
    while len(wfs) > max_workflows:
        victim = min(wfs, key=lambda w: (w["support"], w["used"], int(w["id"][1:])))
        wfs.remove(victim)
        gone.append(victim["id"])
    memory["evicted"] += len(gone)
    return gone


def plan(memory: dict[str, Any], items: Sequence[dict[str, Any]]
         ) -> tuple[dict[str, list[str]], dict[str, list[dict[str, Any]]]]:
    """Split successes ``{"task", "output", "used"}`` into credit for existing workflows
    (``{id: [task templates]}``: the template is already a workflow's, or the success reused
    retrieved workflows) and groups of unaided successes to induce from (``{template:
    [items]}``)."""
    by_template = {t: wf["id"] for wf in memory["workflows"] for t in wf["templates"]}
    live = {wf["id"] for wf in memory["workflows"]}
    credit: dict[str, list[str]] = {}
    groups: dict[str, list[dict[str, Any]]] = {}
    for it in items:
        tpl = abstract(it["task"]).strip()
        used = [u for u in it.get("used", []) if u in live]
        if tpl in by_template:
            credit.setdefault(by_template[tpl], []).append(tpl)
        elif used:
            for u in used:
                credit.setdefault(u, []).append(tpl)
        else:
            groups.setdefault(tpl, []).append(it)
    return credit, groups


# ---------------------------------------------------------------- the plugin


def _lm(run: Run) -> LM:
    return reflection_lm(run, NAME)


def memory_of(run: Run) -> dict[str, Any]:
    memory = run.state.get(NAME)
    if memory is None:
        memory = run.state[NAME] = new_memory()
    return memory


def task_text(run: Run, prompt: Prompt) -> str:
    """The task as the model saw it (the last user message), without this plugin's block when
    the workflows were rendered into it."""
    text = user_text(prompt)
    header = run.settings(NAME).header
    cut = text.find("\n\n" + header)
    return (text[:cut] if cut >= 0 else text).strip()


def induce(run: Run, items: Sequence[dict[str, Any]], origin: str) -> dict[str, Any]:
    """Credit or induce from successes ``{"task", "output", "used"}``; cap the memory."""
    s = run.settings(NAME)
    memory = memory_of(run)
    credit, groups = plan(memory, items)
    index = {wf["id"]: wf for wf in memory["workflows"]}
    for wid, templates in credit.items():
        wf = index[wid]
        wf["support"] += len(templates)
        _add_sources(wf, templates, s.sources_kept)
        memory["credited"] += len(templates)
    proposals: dict[str, list[tuple[str, list[str]]]] = {}
    if groups and s.inducer == "lm":
        order = list(groups)
        prompts = [induction_prompt(groups[t][:s.induce_max], s.trace_chars) for t in order]
        replies = _lm(run).complete_batch(prompts, s.lm.max_new_tokens, s.lm.temperature)
        for t, reply in zip(order, replies):
            found = parse_workflows(reply)
            if found:
                proposals[t] = found
            else:
                memory["lm_failures"] += 1
    results = []
    for tpl, group in groups.items():
        # the rule inducer, and the fallback when the LM gave nothing usable
        found = proposals.get(tpl) or [rule_workflow(tpl, [g["output"] for g in group])]
        for title, steps in found:
            results.append(add_workflow(memory, title, steps, [tpl] * len(group), [tpl],
                                        s.dedup_threshold, s.sources_kept, run.step))
    evicted = cap(memory, s.max_workflows)
    entry = {"step": run.step, "origin": origin, "successes": len(items),
             "credited": sum(len(v) for v in credit.values()),
             "added": [w for w, r in results if r == "added"],
             "folded": [w for w, r in results if r == "folded"], "evicted": evicted}
    memory["log"].append(entry)
    del memory["log"][:-200]
    if entry["added"] or entry["folded"] or entry["credited"] or evicted:
        _save(run)
    return entry


def successes(run: Run, batch: RolloutBatch) -> list[dict[str, Any]]:
    """One record per task with a successful attempt in ``batch`` (its first success)."""
    s = run.settings(NAME)
    scores = metric_values(batch, s.metric, NAME)
    out, seen = [], set()
    for i, prompt in enumerate(batch.prompts):
        task = task_text(run, prompt)
        if scores[i] >= s.success_threshold and task not in seen:
            seen.add(task)
            out.append({"task": task, "output": batch.texts[i],
                        "used": list(prompt.info.get(NAME, []))})
    return out


def ensure_offline(run: Run) -> None:
    """Offline induction, once: run ``offline_size`` training tasks under the current harness
    and induce from the successes."""
    s = run.settings(NAME)
    memory = memory_of(run)
    if s.mode == "online" or memory["offline_done"]:
        return
    memory["offline_done"] = True
    tasks = task_pool(run, s.offline_size, s.task_step_base)
    _, batch = score_tasks(run, dict(run.harness), tasks, temperature=s.temperature,
                           max_new_tokens=s.max_new_tokens or None, metric=s.metric, owner=NAME)
    memory["metric_calls"] += len(tasks)
    induce(run, successes(run, batch), "offline")


def _save(run: Run) -> None:
    try:
        run.out_dir.mkdir(parents=True, exist_ok=True)
        path = run.out_dir / "workflow_memory.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(memory_of(run)["workflows"], indent=1))
        tmp.replace(path)
    except OSError as exc:  # the checkpointed state still holds the memory
        print(f"rlmix: warning: workflow_memory could not write its memory file: {exc}")


def _quiet(run: Run) -> Run:
    """The run as seen from inside ``rlmix_prompts``: no async sampler to pause (the caller
    already holds whatever lock it needs; pausing again from the same thread would deadlock)."""
    if getattr(run, "async_sampler", None) is None:
        return run
    view = copy.copy(run)
    view.async_sampler = None
    return view


def with_workflows(run: Run, step: int, prompts: list[Prompt]) -> list[Prompt]:
    """``prompts`` with each one re-rendered under a harness holding its retrieved workflows."""
    s = run.settings(NAME)
    wfs = memory_of(run)["workflows"]
    own = run.plugin_resources(NAME)
    stats = own.get(STATS)
    if stats is None or stats["step"] != run.step:  # counts are per step
        stats = own[STATS] = {"step": run.step, "prompts": 0, "hits": 0, "retrieved": 0}
    stats["prompts"] += len(prompts)
    if not wfs:
        _log_retrieval(run, stats)
        return prompts
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        picked = tuple(retrieve(wfs, task_text(run, p), s.top_k, s.min_similarity))
        if picked:
            groups.setdefault(picked, []).append(i)
    out = list(prompts)
    for picked, rows in groups.items():
        chosen = [wfs[k] for k in picked]
        harness = {**run.harness, s.component: render(chosen, s.header,
                                                      run.harness.get(s.component, ""))}
        rendered = prompts_under(run, harness, [step])[step]
        if len(rendered) != len(prompts):
            raise RuntimeError(f"workflow_memory: rlmix_prompts gave {len(rendered)} prompts for "
                               f"step {step} under another harness, {len(prompts)} before; "
                               "the env must be deterministic in step")
        for i in rows:
            p = rendered[i]
            p.info = {**p.info, NAME: [w["id"] for w in chosen]}
            out[i] = p
        for wf in chosen:
            wf["used"] += len(rows)
        stats["hits"] += len(rows)
        stats["retrieved"] += len(rows) * len(chosen)
    _log_retrieval(run, stats)
    return out


def _log_retrieval(run: Run, stats: dict[str, int]) -> None:
    """The step's retrieval rates so far, written with the step's metrics (the last call of a
    step wins, and it has seen every prompt of the step)."""
    if stats["prompts"]:
        run.log(f"{NAME}/hit_rate", stats["hits"] / stats["prompts"])
        run.log(f"{NAME}/retrieved_mean", stats["retrieved"] / stats["prompts"])


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    memory_of(run)
    if s.inducer == "lm" and s.lm.source != "policy":
        _lm(run)  # load or connect now, so a bad model or URL fails before the first step


@rlmix.hookimpl(wrapper=True)
def rlmix_prompts(run: Run, step: int) -> Iterator[None]:
    prompts = yield
    if not prompts:
        return prompts
    with rendering(run, NAME) as first:
        if not first:  # our own re-rendering (or offline tasks): the env's prompts as they are
            return prompts
        view = _quiet(run)
        ensure_offline(view)
        return with_workflows(view, step, list(prompts))


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> None:
    s = run.settings(NAME)
    ensure_offline(run)
    if s.mode == "offline":
        return None
    if batch.rewards is None:
        from rlmix import loop

        loop.score(run, batch)
    induce(run, successes(run, batch), "online")
    return None


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    memory = run.state.get(NAME)
    if memory is None:
        return
    p = "workflow_memory/"
    metrics[p + "workflows"] = len(memory["workflows"])
    metrics[p + "induced"] = memory["induced"]
    metrics[p + "credited"] = memory["credited"]
    metrics[p + "folded"] = memory["folded"]
    metrics[p + "evicted"] = memory["evicted"]
    metrics[p + "metric_calls"] = memory["metric_calls"]
    if memory["lm_failures"]:
        metrics[p + "lm_failures"] = memory["lm_failures"]
    if memory["workflows"]:
        metrics[p + "support_mean"] = mean([w["support"] for w in memory["workflows"]])
