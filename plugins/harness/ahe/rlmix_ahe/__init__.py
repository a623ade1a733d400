"""AHE: Agentic Harness Engineering, harness edits as falsifiable, revertible contracts.

AHE (seeds 000, paragraph 71) closes the harness-evolution loop with three kinds of
observability; this plugin is our reading of each, on rlmix's text harness:

1. **components**: every evolved harness component is a file, ``<out>/ahe/<component>.txt``,
   with its whole history under ``<out>/ahe/history/<component>/vNNNN.txt``; an edit changes one
   component, and a revert is a new version holding the text from before the edit;
2. **experience**: each round distils the step's trajectories (and the check tasks' traces)
   into an evidence corpus: one item per distinct failure or success pattern (the env's
   feedback with numbers masked), with a count, the steps it was seen at and one drill-down
   example (task, output, feedback); deduplicated and capped, by rule or by the LM;
3. **decisions**: the reflection LM proposes edits in a structured reply, each with a
   *prediction* in a small checkable language (``mean rises by >= 0.1``, ``tasks c1, c4 pass``,
   ``tasks matching "topic t2" rise by >= 0.5``, ``mean does not drop``, ``no passing task
   fails``); an edit whose prediction does not parse is rejected. The next round scores the
   harness on fixed check tasks (``rlmix_harness.score_tasks``), checks every open prediction
   against the scores from before the edit, keeps the edits whose prediction held and reverts
   (file and ``run.harness``) those whose prediction failed. A ledger records every edit, its
   prediction and its outcome; failed predictions also enter the corpus as lessons.

Everything that matters (versions, open edits, ledger, corpus, counters) lives in
``run.state["ahe"]``, so a checkpointed run resumes; the files mirror it and are written
whole then renamed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlmix_harness import (
    Task,
    configure_evolver,
    evolved_components,
    generate_scored,
    mean,
    metric_values,
    reflection_lm,
    score_tasks,
    task_pool,
    traces,
)
from rlmix_lm import LM, LMSettings

import rlmix
from rlmix import loop
from rlmix.types import HarnessUpdate, RolloutBatch, Run

NAME = "ahe"
GATES = "rlmix.gates"
DISTILL = ("rule", "lm")
_SAFE = re.compile(r"^[A-Za-z0-9_.-]+$")
_NUM = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+))"
_GE = r"(?:by )?(?:>=|≥|at least)"


@dataclass
class Settings:
    components: list[str] = field(default_factory=list)  # components to evolve; [] = all
    check_size: int = 8  # fixed check tasks every prediction is verified on
    task_step_base: int = 3_000_000  # check tasks are rlmix_prompts(run, task_step_base + k)
    metric: str = ""  # reward term, e.g. arith.correct; "" = the weighted reward
    pass_threshold: float = 0.5  # a check task passes when its metric is >= this
    max_edits: int = 1  # edits applied per round (one component each)
    revert: bool = True  # revert edits whose prediction failed (false: record only, ablation)
    gate: bool = False  # a held prediction must also pass run.resources["rlmix.gates"], if any
    distill: str = "rule"  # rule (feedback patterns) | lm (the LM also writes one-line lessons)
    evidence_per_step: int = 8  # trajectories of the step's batch distilled per round
    corpus_size: int = 24  # distinct evidence items kept (oldest, rarest dropped first)
    show_evidence: int = 10  # corpus items shown to the LM per round
    show_ledger: int = 6  # recent ledger entries shown to the LM
    feedback_chars: int = 200  # per trace, in the corpus and the prompt
    temperature: float = 0.0  # check rollouts (0 = greedy: the checks repeat)
    max_new_tokens: int = 0  # check rollouts; 0 = sampling.max_new_tokens
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, distill=DISTILL)
        if self.check_size < 1:
            raise ValueError(f"check_size: must be >= 1 (predictions are checked on these "
                             f"tasks), got {self.check_size}")
        if self.max_edits < 1:
            raise ValueError(f"max_edits: must be >= 1, got {self.max_edits}")
        bad = [c for c in self.components if not _SAFE.match(str(c))]
        if bad:
            raise ValueError(f"components: {bad[0]!r} cannot be a file name (letters, digits, "
                             "'_', '.', '-')")
        for key in ("evidence_per_step", "corpus_size", "show_evidence", "show_ledger",
                    "feedback_chars", "max_new_tokens"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}: must be >= 0, got {getattr(self, key)}")


# ---------------------------------------------------------------- predictions (pure)


class PredictionError(ValueError):
    """A prediction that cannot be checked mechanically."""


_CLAUSES = [
    ("mean_gain", re.compile(rf"^(?:the )?mean(?: score)? (?:rises|increases|improves) "
                             rf"{_GE}\s*{_NUM}$")),
    ("mean_floor", re.compile(rf"^(?:the )?mean(?: score)? does not drop"
                              rf"(?: by more than\s*{_NUM})?$")),
    ("pass", re.compile(r"^tasks? ((?:c\d+[\s,]*(?:and\s+)?)+)(?:will )?pass(?:es)?$")),
    ("subset_gain", re.compile(rf"^tasks matching \"([^\"]+)\" (?:rise|improve)s? "
                               rf"{_GE}\s*{_NUM}$")),
    ("no_regress", re.compile(r"^no (?:passing task fails|task regresses)$")),
]


def parse_prediction(text: str, n_tasks: int, inputs: Sequence[str] = ()) -> list[dict]:
    """Clauses separated by ``;``, each one of the forms of ``_CLAUSES`` (case-insensitive).

    ``n_tasks`` bounds task ids ``c0 .. c{n-1}``; ``inputs`` (the check tasks' inputs) must
    hold a ``tasks matching "..."`` string at least once. Raises ``PredictionError``."""
    clauses = [c.strip().rstrip(".").strip() for c in text.split(";")]
    clauses = [re.sub(r"\s+", " ", c.lower()) for c in clauses if c.strip()]
    if not clauses:
        raise PredictionError("empty prediction")
    out: list[dict] = []
    for clause in clauses:
        kind, found = next(((k, m) for k, m in ((k, p.match(clause)) for k, p in _CLAUSES)
                            if m), ("", None))
        if found is None:
            raise PredictionError(f"cannot check {clause!r}")
        if kind == "mean_gain":
            d = float(found.group(1))
            if not d > 0.0:
                raise PredictionError(f"{clause!r}: the rise must be > 0")
            out.append({"kind": kind, "delta": d})
        elif kind == "mean_floor":
            d = float(found.group(1) or 0.0)
            if not d >= 0.0:
                raise PredictionError(f"{clause!r}: the allowed drop must be >= 0")
            out.append({"kind": kind, "delta": d})
        elif kind == "pass":
            ids = sorted({int(x) for x in re.findall(r"c(\d+)", found.group(1))})
            unknown = [i for i in ids if i >= n_tasks]
            if unknown:
                raise PredictionError(f"{clause!r}: no check task c{unknown[0]} (there are "
                                      f"c0..c{n_tasks - 1})")
            out.append({"kind": kind, "tasks": ids})
        elif kind == "subset_gain":
            needle, d = found.group(1), float(found.group(2))
            match = [k for k, x in enumerate(inputs) if needle in x.lower()]
            if not match:
                raise PredictionError(f"{clause!r}: no check task matches {needle!r}")
            if not d > 0.0:
                raise PredictionError(f"{clause!r}: the rise must be > 0")
            out.append({"kind": kind, "match": needle, "tasks": match, "delta": d})
        else:
            out.append({"kind": kind})
    return out


def check_prediction(clauses: Sequence[dict], before: Sequence[float], after: Sequence[float],
                     threshold: float = 0.5) -> tuple[bool, str]:
    """Whether every clause holds from ``before`` to ``after`` (per check task), and why."""
    eps = 1e-9
    notes, ok = [], True
    for c in clauses:
        kind = c["kind"]
        if kind in ("mean_gain", "mean_floor"):
            b, a = mean(before), mean(after)
            held = (a - b >= c["delta"] - eps) if kind == "mean_gain" else \
                (a >= b - c["delta"] - eps)
            notes.append(f"mean {b:.3f} -> {a:.3f}")
        elif kind == "pass":
            failing = [k for k in c["tasks"] if after[k] < threshold]
            held = not failing
            notes.append("all named tasks pass" if held else
                         f"still failing: {', '.join(f'c{k}' for k in failing)}")
        elif kind == "subset_gain":
            b = mean([before[k] for k in c["tasks"]])
            a = mean([after[k] for k in c["tasks"]])
            held = a - b >= c["delta"] - eps
            notes.append(f"tasks matching {c['match']!r}: {b:.3f} -> {a:.3f}")
        else:  # no_regress
            broke = [k for k, (x, y) in enumerate(zip(before, after))
                     if x >= threshold > y]
            held = not broke
            notes.append("no regressions" if held else
                         f"regressed: {', '.join(f'c{k}' for k in broke)}")
        ok = ok and held
    return ok, "; ".join(notes)


# ---------------------------------------------------------------- the LM's reply (pure)

_EDIT = re.compile(r"^\s*EDIT\s*:?\s*(\S+)\s*$", re.I | re.M)
_PREDICT = re.compile(r"^\s*PREDICT(?:ION)?\s*:\s*(.+?)\s*$", re.I | re.M)
_FENCE = re.compile(r"```[^\n`]*\n(.*?)\n?```", re.S)


def parse_edits(reply: str) -> list[dict[str, str]]:
    """``[{"component", "prediction", "text"}]`` from blocks of the form::

        EDIT <component>
        PREDICT: <clauses>
        ```
        <the component's whole new text>
        ```

    A block without a prediction or a fenced text gets an ``error`` instead."""
    heads = list(_EDIT.finditer(reply))
    out = []
    for k, head in enumerate(heads):
        body = reply[head.end():heads[k + 1].start() if k + 1 < len(heads) else len(reply)]
        edit = {"component": head.group(1).strip("`*\"'").strip(), "prediction": "", "text": ""}
        pred, text = _PREDICT.search(body), _FENCE.search(body)
        if pred:
            edit["prediction"] = pred.group(1)
        if text:
            edit["text"] = text.group(1).strip()
        if not pred or not text:
            edit["error"] = "no PREDICT line" if not pred else "no fenced text"
        out.append(edit)
    return out


# ---------------------------------------------------------------- evidence corpus (pure)


def signature(trace: dict[str, Any]) -> tuple[str, str]:
    """The pattern a trace belongs to: its kind (``failure`` / ``success``) and its feedback
    (or reward terms when there is none) with numbers masked."""
    kind = "success" if trace["score"] > 0.5 else "failure"
    text = trace.get("feedback") or trace.get("terms") or ""
    return kind, re.sub(r"-?\d+(?:\.\d+)?", "#", text).strip()


def add_evidence(corpus: list[dict], items: Sequence[dict], step: int, cap: int) -> None:
    """Fold items (``kind``, ``pattern``, ``example``) into ``corpus``: one entry per
    ``(kind, pattern)`` with a count, the first and last step and the latest example; then
    keep the ``cap`` entries ranked by (last step, count), lessons first."""
    index = {(e["kind"], e["pattern"]): e for e in corpus}
    for item in items:
        key = (item["kind"], item["pattern"])
        entry = index.get(key)
        if entry is None:
            entry = index[key] = {"kind": item["kind"], "pattern": item["pattern"], "count": 0,
                                  "first_step": step, "last_step": step}
            corpus.append(entry)
        entry["count"] += int(item.get("count", 1))
        entry["last_step"] = step
        if item.get("example"):
            entry["example"] = item["example"]
    rank = {"lesson": 0, "failure": 1, "summary": 2, "success": 3}
    corpus.sort(key=lambda e: (rank.get(e["kind"], 4), -e["last_step"], -e["count"],
                               e["pattern"]))
    del corpus[cap:]


def distill_traces(rows: Sequence[dict[str, Any]], limit: int, chars: int) -> list[dict]:
    """Corpus items from trajectories by rule: failures first, at most ``limit`` rows."""
    rows = sorted(rows, key=lambda t: t["score"])[:limit]
    out = []
    for t in rows:
        kind, pattern = signature(t)
        out.append({"kind": kind, "pattern": pattern[:chars], "example": {
            "task": t["input"][:chars], "output": t["output"][:chars],
            "feedback": (t.get("feedback") or "")[:chars]}})
    return out


# ---------------------------------------------------------------- prompts (pure)


def reflection_prompt(files: dict[str, tuple[int, str]], checks: Sequence[dict],
                      corpus: Sequence[dict], ledger: Sequence[dict], max_edits: int) -> str:
    """What the LM reads: the component files, the check tasks' current results (the ids its
    predictions may name), the evidence corpus, the recent ledger and the reply format."""
    lines = ["You are engineering the harness (the text components) around an AI assistant.",
             "Each component is a file. Edit components so the assistant solves more tasks.",
             "Every edit carries a prediction that the next round checks on the check tasks; "
             "an edit whose prediction fails is reverted.", "", "## Component files"]
    for name, (version, text) in files.items():
        lines += [f"### file {name}.txt (version {version})", "```", text, "```"]
    lines += ["", f"## Check tasks (mean score {mean([c['score'] for c in checks]):.3f})"]
    for k, c in enumerate(checks):
        state = "pass" if c["passed"] else "fail"
        lines.append(f"c{k} [{state}] input: {c['input']} | output: {c['output']} | "
                     f"feedback: {c['feedback'] or '-'}")
    if corpus:
        lines += ["", "## Evidence (distilled from trajectories, most relevant first)"]
        for e in corpus:
            lines.append(f"- [{e['kind']} x{e['count']}, steps {e['first_step']}-"
                         f"{e['last_step']}] {e['pattern']}")
            ex = e.get("example")
            if ex:
                lines.append(f"    e.g. task: {ex['task']} | output: {ex['output']}")
    if ledger:
        lines += ["", "## Ledger (recent edits and what happened)"]
        for e in ledger:
            lines.append(f"- {e['id']} {e['component']}: predicted \"{e['prediction']}\" -> "
                         f"{e['status']}{': ' + e['outcome'] if e.get('outcome') else ''}")
    lines += ["", f"## Reply with up to {max_edits} edit(s), each exactly like this:",
              "EDIT <component name>", "PREDICT: <clauses separated by ';'>", "```",
              "<the whole new text of the component>", "```",
              "Clauses: 'mean rises by >= 0.1' | 'mean does not drop' | 'tasks c1, c3 pass' | "
              "'tasks matching \"some text\" rise by >= 0.5' | 'no passing task fails'."]
    return "\n".join(lines)


def lesson_prompt(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["Summarise what these attempts of an AI assistant have in common, as lessons for "
             "its instructions. One lesson per line, each starting with 'LESSON:'."]
    for t in rows:
        lines.append(f"- task: {t['input']} | output: {t['output']} | score {t['score']:g} | "
                     f"feedback: {t.get('feedback') or '-'}")
    return "\n".join(lines)


# ---------------------------------------------------------------- files (component observability)


def folder(run: Run) -> Path:
    return Path(run.out_dir) / NAME


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # written whole, then renamed
    tmp.write_text(text)
    tmp.replace(path)


def sync_files(run: Run) -> None:
    """Make the files mirror ``run.state["ahe"]`` (after a resume, too): every component's
    current text, each version in its history, the ledger and the corpus."""
    state = run.state[NAME]
    root = folder(run)
    for name, versions in state["versions"].items():
        for v in versions:
            path = root / "history" / name / f"v{v['v']:04d}.txt"
            if not path.exists():
                _write(path, v["text"])
        current = root / f"{name}.txt"
        text = versions[-1]["text"]
        if not current.exists() or current.read_text() != text:
            _write(current, text)
    _write(root / "ledger.json", json.dumps(state["ledger"], indent=1))
    _write(root / "corpus.json", json.dumps(state["corpus"], indent=1))


def _new_version(state: dict[str, Any], name: str, text: str, why: str) -> int:
    versions = state["versions"][name]
    versions.append({"v": len(versions), "text": text, "why": why})
    return len(versions) - 1


# ---------------------------------------------------------------- the round


def components(run: Run) -> list[str]:
    names = evolved_components(run, NAME)
    bad = [c for c in names if not _SAFE.match(c)]
    if bad:
        raise rlmix.ConfigError(f"ahe.components: {bad[0]!r} cannot be a file name")
    return names


def init_state(run: Run) -> dict[str, Any]:
    s = run.settings(NAME)
    names = components(run)
    tasks = task_pool(run, s.check_size, s.task_step_base)
    state = run.state[NAME] = {
        "components": names, "tasks": [list(t) for t in tasks],
        "versions": {c: [{"v": 0, "text": run.harness[c], "why": "seed"}] for c in names},
        "round": 0, "open": [], "ledger": [], "corpus": [], "next_edit": 0,
        "metric_calls": 0, "seed_mean": None, "last_mean": None, "scores": [], "last_reply": "",
        "counts": {"proposed": 0, "applied": 0, "kept": 0, "reverted": 0, "rejected": 0,
                   "failed_kept": 0, "superseded": 0}}
    return state


def _lm(run: Run) -> LM:
    return reflection_lm(run, NAME)


def run_checks(run: Run, harness: dict[str, str]) -> tuple[list[float], RolloutBatch]:
    s = run.settings(NAME)
    state = run.state[NAME]
    tasks: list[Task] = [(int(a), int(b)) for a, b in state["tasks"]]
    scores, batch = score_tasks(run, harness, tasks, temperature=s.temperature,
                                max_new_tokens=s.max_new_tokens or None, metric=s.metric,
                                owner=NAME)
    state["metric_calls"] += len(tasks)
    return scores, batch


def verify(run: Run, scores: list[float], harness: dict[str, str]) -> list[str]:
    """Check every open edit's prediction against ``scores``; revert (in ``harness``) the ones
    that failed. Returns the components reverted."""
    s = run.settings(NAME)
    state = run.state[NAME]
    reverted = []
    for edit in state["open"]:
        entry = next(e for e in state["ledger"] if e["id"] == edit["id"])
        name = edit["component"]
        if harness.get(name) != edit["after"]:  # changed by someone else since
            entry["status"], entry["outcome"] = "superseded", "the component changed elsewhere"
            state["counts"]["superseded"] += 1
            continue
        held, detail = check_prediction(edit["clauses"], edit["baseline"], scores,
                                        s.pass_threshold)
        gates = run.resources.get(GATES) if s.gate else None
        if held and gates is not None:  # e.g. the flip gate, or the sequential gate
            verdict = gates.check(edit["baseline"], scores)
            if not verdict.passed:
                held, detail = False, f"{detail}; the gate refused: {verdict.reason}"
        entry["checked_round"] = state["round"]
        if held:
            entry["status"], entry["outcome"] = "kept", f"held ({detail})"
            state["counts"]["kept"] += 1
            continue
        lesson = (f"edit {edit['id']} to {name} predicted \"{entry['prediction']}\" and it "
                  f"failed ({detail})")
        if s.revert:
            harness[name] = edit["before"]
            _new_version(state, name, edit["before"], f"revert {edit['id']}")
            reverted.append(name)
            entry["status"], entry["outcome"] = "reverted", f"failed ({detail})"
            state["counts"]["reverted"] += 1
            lesson += "; reverted"
        else:
            entry["status"], entry["outcome"] = "failed, kept", f"failed ({detail})"
            state["counts"]["failed_kept"] += 1
        add_evidence(state["corpus"], [{"kind": "lesson", "pattern": lesson}], run.step,
                     s.corpus_size)
    state["open"] = []
    return reverted


def distill(run: Run, batch: RolloutBatch | None) -> None:
    """The step's trajectories into the evidence corpus (check tasks have their own section
    of the prompt and are not counted here)."""
    s = run.settings(NAME)
    state = run.state[NAME]
    rows: list[dict[str, Any]] = []
    if batch is not None and len(batch) and s.evidence_per_step:
        if batch.rewards is None:
            loop.score(run, batch)
        rows = traces(batch, metric_values(batch, s.metric, NAME), s.feedback_chars)
    items = distill_traces(rows, s.evidence_per_step, s.feedback_chars)
    if s.distill == "lm" and rows:
        failures = [t for t in rows if t["score"] < s.pass_threshold][:s.evidence_per_step]
        if failures:
            reply = _lm(run).complete(lesson_prompt(failures), s.lm.max_new_tokens,
                                      s.lm.temperature)
            for found in re.finditer(r"^\s*(?:[-*]\s*)?LESSON\s*:\s*(.+)$", reply, re.M | re.I):
                items.append({"kind": "summary", "pattern": found.group(1)[:s.feedback_chars]})
    add_evidence(state["corpus"], items, run.step, s.corpus_size)


def propose(run: Run, harness: dict[str, str], scores: list[float],
            check_rows: list[dict[str, Any]]) -> dict[str, str]:
    """Ask the LM for edits; apply the valid ones (to ``harness``) and open them."""
    s = run.settings(NAME)
    state = run.state[NAME]
    names = state["components"]
    files = {c: (state["versions"][c][-1]["v"], harness[c]) for c in names}
    checks = [{**r, "passed": r["score"] >= s.pass_threshold} for r in check_rows]
    prompt = reflection_prompt(files, checks, state["corpus"][:s.show_evidence],
                               state["ledger"][-s.show_ledger:] if s.show_ledger else [],
                               s.max_edits)
    reply = _lm(run).complete(prompt, s.lm.max_new_tokens, s.lm.temperature)
    state["last_reply"] = reply[:2000]  # for the audit: what the LM said this round
    inputs = [r["input"] for r in check_rows]
    applied: dict[str, str] = {}
    for edit in parse_edits(reply):
        state["counts"]["proposed"] += 1
        eid = f"e{state['next_edit']}"
        state["next_edit"] += 1
        entry = {"id": eid, "round": state["round"], "step": run.step,
                 "component": edit["component"], "prediction": edit["prediction"],
                 "status": "rejected", "outcome": ""}
        state["ledger"].append(entry)
        name = edit["component"]
        if edit.get("error"):
            entry["outcome"] = edit["error"]
        elif name not in names:
            entry["outcome"] = f"no component {name!r} (editable: {', '.join(names)})"
        elif name in applied:
            entry["outcome"] = "a second edit to the same component in one round"
        elif len(applied) >= s.max_edits:
            entry["outcome"] = f"over max_edits ({s.max_edits})"
        elif edit["text"] == harness[name]:
            entry["outcome"] = "the text is unchanged"
        else:
            try:
                clauses = parse_prediction(edit["prediction"], len(scores), inputs)
            except PredictionError as exc:
                entry["outcome"] = f"unparseable prediction: {exc}"
            else:
                before = harness[name]
                harness[name] = applied[name] = edit["text"]
                version = _new_version(state, name, edit["text"], eid)
                entry.update(status="open", outcome="", version=version)
                state["open"].append({"id": eid, "component": name, "before": before,
                                      "after": edit["text"], "clauses": clauses,
                                      "baseline": list(scores)})
                state["counts"]["applied"] += 1
                continue
        state["counts"]["rejected"] += 1
    return applied


def evolve(run: Run, batch: RolloutBatch | None) -> HarnessUpdate | None:
    """One AHE round: verify the open predictions (revert the failed edits), distil evidence,
    propose and apply new edits. Returns the changed components, or None."""
    s = run.settings(NAME)
    if NAME not in run.state and not components(run):
        return None
    state = run.state.get(NAME) or init_state(run)
    names = state["components"]
    start = {c: run.harness[c] for c in names}
    harness = dict(start)
    scores, cbatch = run_checks(run, harness)
    if state["seed_mean"] is None:
        state["seed_mean"] = mean(scores)
    reverted = verify(run, scores, harness) if state["open"] else []
    if reverted:  # the harness after the reverts is what new edits are measured against
        scores, cbatch = run_checks(run, harness)
    state["scores"] = list(scores)
    state["last_mean"] = mean(scores)
    check_rows = traces(cbatch, scores, s.feedback_chars)
    distill(run, batch)
    applied = propose(run, harness, scores, check_rows)
    state["round"] += 1
    sync_files(run)
    changed = {c: harness[c] for c in names if harness[c] != start[c]}
    if not changed:
        return None
    kept = [e["id"] for e in state["ledger"] if e.get("checked_round") == state["round"] - 1
            and e["status"] == "kept"]
    return HarnessUpdate(
        components=changed,
        evidence=(f"round {state['round'] - 1}: check mean {mean(scores):.3f}; kept "
                  f"{', '.join(kept) or 'none'}; reverted {', '.join(reverted) or 'none'}; "
                  f"new edits to {', '.join(applied) or 'none'}"),
        parent_version=run.harness_version, source=NAME)


def round_batch(run: Run, step: int) -> RolloutBatch:
    """The env's prompts for ``step`` under the current harness, generated and scored (what
    ``rlmix_evolve`` receives in a run; for tests and scripts that call ``evolve`` alone)."""
    return generate_scored(run, run.hook.rlmix_prompts(run=run, step=int(step)))


# ---------------------------------------------------------------- hooks


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    configure_evolver(run, NAME)
    components(run)  # each must also be a safe file name: fail before the first step


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return evolve(run, batch)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if not state:
        return
    counts = state["counts"]
    metrics["ahe/rounds"] = state["round"]
    metrics["ahe/check_mean"] = state["last_mean"]
    metrics["ahe/seed_check_mean"] = state["seed_mean"]
    for key in ("proposed", "applied", "kept", "reverted", "rejected"):
        metrics[f"ahe/{key}"] = counts[key]
    metrics["ahe/open"] = len(state["open"])
    metrics["ahe/corpus"] = len(state["corpus"])
    metrics["ahe/metric_calls"] = state["metric_calls"]
