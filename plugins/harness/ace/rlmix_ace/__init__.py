"""ACE: the harness as an evolving playbook of bullets, grown by delta operations.

ACE (Zhang et al., 2025, *Agentic Context Engineering*, arXiv:2510.04618) keeps a playbook of
itemised bullets instead of one prompt, and changes it only by small, structured edits so that
detail is never lost to a rewrite (its "context collapse"). Each ``rlmix_evolve`` call:

1. **generator**: the policy answered this step's prompts with the playbook in its context and
   was asked to cite the ids of the bullets it used (``[b-a]``); the citations are parsed;
2. **reflector** (an ``rlmix_lm`` model): for a few samples, reads the task, answer, reward and
   the env's feedback, tags each cited bullet helpful or harmful, and states a lesson;
   cited bullets it does not tag are tagged from the reward (``tagging: reward`` always does);
3. counters: each tag adds one to the bullet's ``helpful`` or ``harmful`` count;
4. **curator** (the same model): reads the playbook and the lessons and emits delta operations,
   one per line (``ADD: text``, ``UPDATE b-c: text``, ``REMOVE b-d``), merged deterministically:
   in order, unknown ids skipped, near-duplicates of existing bullets refused, at most
   ``max_ops`` per step and ``max_bullets`` in all;
5. pruning of bullets whose ``harmful - helpful`` reaches ``prune_margin``, and a pass that folds
   near-identical bullets (normalised word-set Jaccard, or difflib's ratio, >= ``dedup_threshold``)
   into the older one, counters summed;
6. the playbook is rendered into the harness component ``component`` after its starting text;
   with the ``gates`` plugin listed and ``check_size > 0``, the new playbook must first pass the
   flip gate on ``check_size`` fixed tasks.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import reflection_lm, score_tasks, task_pool, user_text
from rlmix_lm import LM, LMSettings

import rlmix
from rlmix import loop
from rlmix.types import HarnessUpdate, RolloutBatch, Run

NAME = "ace"
GATES = "rlmix.gates"
TAGGINGS = ("lm", "reward")
DEDUP_METRICS = ("jaccard", "difflib")
_CITE = re.compile(r"\[(b-[a-z]+)\]")
_OP = re.compile(r"^\s*(?:[-*]\s*)?(ADD|UPDATE|REMOVE)\b\s*(b-[a-z]+)?\s*:?\s*(.*)$", re.I)
_TAG = re.compile(r"(b-[a-z]+)\W+(helpful|harmful|neutral)", re.I)
_LESSON = re.compile(r"^\s*LESSON\s*:\s*(.+)$", re.I | re.M)


@dataclass
class Settings:
    component: str = "system"  # the harness component the playbook is rendered into
    header: str = ("Playbook. Use the bullets that help and cite their ids in square brackets, "
                   "like [b-a], at the start of your reply.")
    initial: list[str] = field(default_factory=list)  # starting bullets
    max_bullets: int = 30
    max_ops: int = 4  # curator operations applied per step
    dedup_threshold: float = 0.8  # similarity at which two bullets count as one
    dedup_metric: str = "jaccard"  # jaccard (word sets) | difflib (sequence ratio)
    prune_margin: int = 3  # drop a bullet when harmful - helpful >= this; 0 = never
    reflect_samples: int = 4  # samples the reflector reads per step
    tagging: str = "lm"  # lm (reward for untagged bullets) | reward
    success_threshold: float = 0.5  # a reward >= this is a success
    check_size: int = 0  # flip-gate tasks (needs the gates plugin); 0 = no gate
    task_step_base: int = 2_000_000  # check tasks are rlmix_prompts(run, task_step_base + k)
    max_new_tokens: int = 0  # check rollouts; 0 = sampling.max_new_tokens
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, tagging=TAGGINGS, dedup_metric=DEDUP_METRICS)
        if not self.component:
            raise ValueError("component: name the harness component the playbook goes into")
        if self.max_bullets < 1 or self.max_ops < 0:
            raise ValueError("max_bullets: must be >= 1 (and max_ops >= 0)")
        if not 0.0 < self.dedup_threshold <= 1.0:
            raise ValueError(f"dedup_threshold: must be in (0, 1], got {self.dedup_threshold}")
        if self.prune_margin < 0 or self.reflect_samples < 0 or self.check_size < 0:
            raise ValueError("prune_margin: prune_margin, reflect_samples and check_size must "
                             "be >= 0")


# ---------------------------------------------------------------- playbook (pure)


def bullet_id(n: int) -> str:
    """``b-a``, ``b-b``, ..., ``b-z``, ``b-ba``, ...: letters only, so citing one never adds a
    number to an answer."""
    letters = ""
    while True:
        n, r = divmod(n, 26)
        letters = chr(ord("a") + r) + letters
        if n == 0:
            return "b-" + letters


def new_playbook(texts: Sequence[str] = ()) -> dict[str, Any]:
    book: dict[str, Any] = {"bullets": [], "next_id": 0}
    for t in texts:
        add_bullet(book, t)
    return book


def add_bullet(book: dict[str, Any], text: str) -> str:
    bid = bullet_id(book["next_id"])
    book["next_id"] += 1
    book["bullets"].append({"id": bid, "text": text.strip(), "helpful": 0, "harmful": 0})
    return bid


def find(book: dict[str, Any], bid: str) -> dict[str, Any] | None:
    return next((b for b in book["bullets"] if b["id"] == bid), None)


def render(book: dict[str, Any], header: str, preamble: str = "") -> str:
    lines = [preamble.strip()] if preamble.strip() else []
    if book["bullets"]:
        lines.append(header)
        lines += [f"[{b['id']}] {b['text']}" for b in book["bullets"]]
    return "\n".join(lines)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def similarity(a: str, b: str, metric: str = "jaccard") -> float:
    """How alike two bullets are after normalisation (lower case, words only): the Jaccard
    index of their word sets (``jaccard``) or difflib's ratio of the word strings
    (``difflib``; stricter on order, looser on one changed word). 1 = the same."""
    wa, wb = _words(a), _words(b)
    if not wa and not wb:
        return 1.0
    if metric == "difflib":
        return difflib.SequenceMatcher(None, " ".join(wa), " ".join(wb)).ratio()
    sa, sb = set(wa), set(wb)
    return len(sa & sb) / len(sa | sb)


def near_duplicate(book: dict[str, Any], text: str, threshold: float, skip: str = "",
                   metric: str = "jaccard") -> str | None:
    """The id of an existing bullet (other than ``skip``) that ``text`` nearly repeats."""
    for b in book["bullets"]:
        if b["id"] != skip and similarity(b["text"], text, metric) >= threshold:
            return b["id"]
    return None


def parse_citations(text: str) -> list[str]:
    out: list[str] = []
    for bid in _CITE.findall(text):
        if bid not in out:
            out.append(bid)
    return out


def parse_tags(text: str) -> dict[str, str]:
    """``b-a: helpful`` lines (the last word for an id wins)."""
    return {bid.lower(): tag.lower() for bid, tag in _TAG.findall(text)}


def parse_lessons(text: str) -> list[str]:
    """``LESSON: ...`` lines; an echo of the prompt's ``<placeholder>`` is not a lesson."""
    return [m.strip() for m in _LESSON.findall(text)
            if m.strip() and not m.strip().startswith("<")]


def parse_operations(text: str) -> list[dict[str, str]]:
    """Curator lines ``ADD: text``, ``UPDATE b-c: text``, ``REMOVE b-d``; other lines are
    ignored, as are ADDs without text and UPDATE / REMOVE without an id."""
    ops = []
    for line in text.splitlines():
        m = _OP.match(line)
        if not m:
            continue
        kind, bid, rest = m.group(1).upper(), (m.group(2) or "").lower(), m.group(3).strip()
        if kind == "ADD" and rest:
            ops.append({"op": "ADD", "text": rest})
        elif kind == "UPDATE" and bid and rest:
            ops.append({"op": "UPDATE", "id": bid, "text": rest})
        elif kind == "REMOVE" and bid:
            ops.append({"op": "REMOVE", "id": bid})
    return ops


def apply_operations(book: dict[str, Any], ops: Sequence[dict[str, str]], max_ops: int,
                     max_bullets: int, threshold: float,
                     metric: str = "jaccard") -> list[dict[str, Any]]:
    """Merge delta operations into ``book`` in order; returns what happened to each (the
    ``result`` is ``added``, ``updated``, ``removed`` or why it was skipped). Never rewrites
    the playbook as a whole: only the named bullets change."""
    log = []
    applied = 0
    for op in ops:
        entry: dict[str, Any] = dict(op)
        if applied >= max_ops:
            entry["result"] = "skipped: max_ops reached"
        elif op["op"] == "ADD":
            dup = near_duplicate(book, op["text"], threshold, metric=metric)
            if dup is not None:
                entry["result"] = f"skipped: near-duplicate of {dup}"
            elif len(book["bullets"]) >= max_bullets:
                entry["result"] = "skipped: playbook full"
            else:
                entry["id"] = add_bullet(book, op["text"])
                entry["result"] = "added"
        else:
            target = find(book, op["id"])
            if target is None:
                entry["result"] = f"skipped: no bullet {op['id']}"
            elif op["op"] == "REMOVE":
                book["bullets"].remove(target)
                entry["result"] = "removed"
            else:
                dup = near_duplicate(book, op["text"], threshold, target["id"], metric)
                if dup is not None:
                    entry["result"] = f"skipped: near-duplicate of {dup}"
                else:
                    target["text"] = op["text"].strip()
                    entry["result"] = "updated"
        applied += entry["result"] in ("added", "updated", "removed")
        log.append(entry)
    return log


def update_counters(book: dict[str, Any], tags: Sequence[tuple[str, str]]) -> None:
    """Add one to ``helpful`` or ``harmful`` of each tagged bullet (``neutral`` counts nothing;
    unknown ids are ignored)."""
    for bid, tag in tags:
        b = find(book, bid)
        if b is not None and tag in ("helpful", "harmful"):
            b[tag] += 1


def prune(book: dict[str, Any], margin: int) -> list[str]:
    """Remove bullets with ``harmful - helpful >= margin`` (``margin`` 0 keeps all)."""
    if margin <= 0:
        return []
    gone = [b["id"] for b in book["bullets"] if b["harmful"] - b["helpful"] >= margin]
    book["bullets"] = [b for b in book["bullets"] if b["id"] not in gone]
    return gone


def deduplicate(book: dict[str, Any], threshold: float,
                metric: str = "jaccard") -> list[tuple[str, str]]:
    """Fold each bullet that nearly repeats an older one into it (counters summed); returns
    ``(removed id, kept id)`` pairs."""
    merged = []
    kept: list[dict[str, Any]] = []
    for b in book["bullets"]:
        twin = next((k for k in kept if similarity(k["text"], b["text"], metric) >= threshold),
                    None)
        if twin is None:
            kept.append(b)
        else:
            twin["helpful"] += b["helpful"]
            twin["harmful"] += b["harmful"]
            merged.append((b["id"], twin["id"]))
    book["bullets"] = kept
    return merged


# ---------------------------------------------------------------- prompts to the LM


def reflector_prompt(task: str, output: str, reward: float, success: bool, feedback: str,
                     cited: list[dict[str, Any]]) -> str:
    lines = ["You review one attempt of an AI assistant at a task.", f"Task: {task}",
             f"Assistant's answer: {output}",
             f"Reward: {reward:g} ({'success' if success else 'failure'})"]
    if feedback:
        lines.append(f"Feedback from the checker: {feedback}")
    if cited:
        lines.append("Playbook bullets the assistant said it used:")
        lines += [f"[{b['id']}] {b['text']}" for b in cited]
        lines.append("For each of them write one line '<id>: helpful' or '<id>: harmful'.")
    lines.append("Then write one line 'LESSON: <a short, general tip that would help on tasks "
                 "like this>'.")
    return "\n".join(lines)


def curator_prompt(book: dict[str, Any], lessons: list[str], max_ops: int) -> str:
    lines = ["You maintain a playbook of tips for an AI assistant. Current playbook "
             "(id, helpful/harmful counts, text):"]
    lines += [f"[{b['id']}] (+{b['helpful']}/-{b['harmful']}) {b['text']}"
              for b in book["bullets"]] or ["(empty)"]
    lines.append("New lessons from recent attempts:")
    lines += [f"- {x}" for x in lessons] or ["(none)"]
    lines.append(f"Reply with at most {max_ops} edits, one per line, each exactly one of:\n"
                 "ADD: <new tip>\nUPDATE <id>: <better text for that tip>\nREMOVE <id>\n"
                 "Do not repeat tips that are already there. Write nothing else.")
    return "\n".join(lines)


# ---------------------------------------------------------------- the step


def _lm(run: Run) -> LM:
    return reflection_lm(run, NAME)


def state_of(run: Run) -> dict[str, Any]:
    s = run.settings(NAME)
    state = run.state.get(NAME)
    if state is None:
        state = run.state[NAME] = {
            "book": new_playbook(s.initial), "preamble": run.harness.get(s.component, ""),
            "steps": 0, "log": [], "rejected": 0}
    return state


def reflect(run: Run, batch: RolloutBatch, book: dict[str, Any]
            ) -> tuple[list[tuple[str, str]], list[str]]:
    """Tags ``[(bullet id, helpful|harmful)]`` for every cited bullet of every sample, and the
    reflector's lessons from up to ``reflect_samples`` samples (failures first, one sample per
    prompt before a second one of any prompt)."""
    s = run.settings(NAME)
    assert batch.rewards is not None
    rewards = [float(r) for r in batch.rewards]
    known = {b["id"] for b in book["bullets"]}
    cited = [[c for c in parse_citations(t) if c in known] for t in batch.texts]
    groups = [int(g) for g in batch.group]
    rank = [groups[:i].count(groups[i]) for i in range(len(batch))]  # one per prompt first
    order = sorted(range(len(batch)), key=lambda i: (rewards[i] >= s.success_threshold,
                                                     rank[i], -len(cited[i]), i))
    chosen = order[:s.reflect_samples]
    replies: dict[int, str] = {}
    if chosen:
        prompts = []
        for i in chosen:
            info = {k: v for k, v in batch.info[i].items() if k != "episode"}
            prompts.append(reflector_prompt(
                user_text(batch.prompts[i]), batch.texts[i], rewards[i],
                rewards[i] >= s.success_threshold, json.dumps(info, default=str)[:300],
                [find(book, c) for c in cited[i]]))  # type: ignore[misc]
        outs = _lm(run).complete_batch(prompts, s.lm.max_new_tokens, s.lm.temperature)
        replies = dict(zip(chosen, outs))
    tags: list[tuple[str, str]] = []
    lessons: list[str] = []
    for i in range(len(batch)):
        said = parse_tags(replies.get(i, "")) if s.tagging == "lm" else {}
        for c in cited[i]:
            tag = said.get(c) or ("helpful" if rewards[i] >= s.success_threshold else "harmful")
            tags.append((c, tag))
        lessons += parse_lessons(replies.get(i, ""))
    unique: list[str] = []
    for x in lessons:
        if all(similarity(x, u, s.dedup_metric) < s.dedup_threshold for u in unique):
            unique.append(x)
    return tags, unique


def check_tasks(run: Run, harness: dict[str, str]) -> list[float]:
    s = run.settings(NAME)
    tasks = task_pool(run, s.check_size, s.task_step_base)
    scores, _ = score_tasks(run, harness, tasks, max_new_tokens=s.max_new_tokens or None)
    return scores


def evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    s = run.settings(NAME)
    state = state_of(run)
    book = state["book"]
    if batch.rewards is None:
        loop.score(run, batch)
    tags, lessons = reflect(run, batch, book)
    update_counters(book, tags)
    before = json.loads(json.dumps(book))
    ops: list[dict[str, str]] = []
    if lessons and s.max_ops > 0:
        reply = _lm(run).complete(curator_prompt(book, lessons, s.max_ops),
                                  s.lm.max_new_tokens, s.lm.temperature)
        ops = parse_operations(reply)
    log = apply_operations(book, ops, s.max_ops, s.max_bullets, s.dedup_threshold,
                           s.dedup_metric)
    pruned = prune(book, s.prune_margin)
    folded = deduplicate(book, s.dedup_threshold, s.dedup_metric)
    state["steps"] += 1
    entry = {"step": run.step, "tags": len(tags), "lessons": lessons, "ops": log,
             "pruned": pruned, "folded": folded}
    state["log"].append(entry)
    text = render(book, s.header, state["preamble"])
    if text == run.harness.get(s.component, ""):
        return None
    gates = run.resources.get(GATES)
    if gates is not None and s.check_size > 0:
        new_harness = {**run.harness, s.component: text}
        result = gates.check(check_tasks(run, dict(run.harness)), check_tasks(run, new_harness))
        entry["gate"] = result.reason
        if not result.passed:
            state["rejected"] += 1
            # the edits are undone; the counters learnt this step stay
            counts = {b["id"]: (b["helpful"], b["harmful"]) for b in book["bullets"]}
            for b in before["bullets"]:
                b["helpful"], b["harmful"] = counts.get(b["id"], (b["helpful"], b["harmful"]))
            before["next_id"] = book["next_id"]
            state["book"] = before
            return None
    done = [f"{o['op']} {o.get('id', '')}".strip() for o in log if o["result"] in
            ("added", "updated", "removed")]
    return HarnessUpdate(
        components={s.component: text},
        evidence=(f"{len(tags)} bullet tags, {len(lessons)} lessons; ops: "
                  f"{', '.join(done) or 'none'}; pruned: {', '.join(pruned) or 'none'}; "
                  f"folded: {', '.join(a for a, _ in folded) or 'none'}"),
        parent_version=run.harness_version, source=NAME)


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    state = state_of(run)
    if state["book"]["bullets"] and run.harness.get(s.component, "") == state["preamble"]:
        run.harness[s.component] = render(state["book"], s.header, state["preamble"])
    if s.lm.source != "policy":
        _lm(run)


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return evolve(run, batch)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if not state:
        return
    bullets = state["book"]["bullets"]
    metrics["ace/bullets"] = len(bullets)
    metrics["ace/helpful"] = sum(b["helpful"] for b in bullets)
    metrics["ace/harmful"] = sum(b["harmful"] for b in bullets)
    metrics["ace/rejected"] = state["rejected"]
