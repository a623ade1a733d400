"""Text-to-SQL on generated SQLite databases: the prompt shows the schema and a question, the
model answers with one query in a ```sql block, and the reward ``correct`` is execution match
against the reference query (``valid``: the query runs and reads a table of the database;
``format``: a ```sql block is present). Greedy execution accuracy on held-out databases is
``eval/accuracy``. ``difficulty: easy`` swaps the three multi-table schemas for generated
single-table databases and one-filter questions, and shows a worked example.

Queries run read-only (``mode=ro`` file, ``PRAGMA query_only``, an authorizer that allows only
reads), one SELECT / WITH statement at a time, under a time limit and a row cap; a query that
fails for any reason scores 0 with the reason in ``batch.info[i]["sql"]``.
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import rlmix
from rlmix.types import Prompt, RolloutBatch, Run
from rlmix_sql.easy import EXAMPLE, EXAMPLE_DDL, build_easy_database, make_easy_task
from rlmix_sql.execute import (
    QueryResult,
    extract_query,
    has_sql_block,
    run_query,
    same_result,
)
from rlmix_sql.schemas import SCHEMAS, Database, Task, build_database, make_task

__all__ = ["SCHEMAS", "Database", "QueryResult", "Settings", "Task", "build_database",
           "check_answer", "extract_query", "has_sql_block", "make_task", "run_query",
           "same_result"]

NAME = "sql"
DIFFICULTIES = ("standard", "easy")


@dataclass
class Settings:
    # standard: the three multi-table schemas and their templates (joins, group-by, order);
    # easy: generated single-table databases, one-filter SELECTs, a worked example shown
    difficulty: str = "standard"
    schemas: str = "company,shop,school"  # comma-separated, from: company, shop, school
    train_databases: int = 4  # databases per schema (easy: in all) that training prompts use
    eval_databases: int = 2  # further databases per schema (easy: in all), only for evaluation
    seed: int = 0  # database generation
    eval_size: int = 60  # held-out questions; 0 = no evaluation
    eval_seed: int = 1234
    eval_max_new_tokens: int = 128
    eval_batch_size: int = 16  # held-out prompts per generation call
    timeout_ms: int = 1000  # a query is aborted after this long
    max_rows: int = 1000  # a query returning more rows scores 0
    decimals: int = 2  # numbers compare rounded to this many decimals
    any_column_order: bool = True  # columns may come in any order
    db_dir: str = ""  # where database files go; "" = a temporary folder removed at exit
    instructions: str = ("Write one SQLite query that answers the question. Put it in a "
                         "```sql code block.")
    # a worked example (question and its query, as an earlier chat turn) before the task:
    # auto = shown when difficulty is easy
    worked_example: str = "auto"

    def __post_init__(self) -> None:
        rlmix.check_choices(self, difficulty=DIFFICULTIES,
                            worked_example=("auto", "show", "hide"))
        names = [s.strip() for s in self.schemas.split(",") if s.strip()]
        bad = [s for s in names if s not in SCHEMAS]
        if not names or bad:
            raise ValueError(f"schemas: {', '.join(bad) or 'none given'} not known; choose "
                             f"from {', '.join(SCHEMAS)}")
        for name in ("train_databases", "timeout_ms", "max_rows", "eval_max_new_tokens",
                     "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("eval_databases", "eval_size", "decimals"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.eval_size > 0 and self.eval_databases == 0:
            raise ValueError("eval_size > 0 needs eval_databases >= 1 (held-out databases)")

    @property
    def schema_names(self) -> list[str]:
        return [s.strip() for s in self.schemas.split(",") if s.strip()]

    @property
    def shows_example(self) -> bool:
        return self.worked_example == "show" or (self.worked_example == "auto"
                                                and self.difficulty == "easy")


def build_databases(settings: Settings, folder: Path) -> tuple[dict[str, Database], list[str],
                                                                list[str]]:
    """Every database of these settings, and the keys of the training and held-out ones."""
    dbs: dict[str, Database] = {}
    train, held_out = [], []
    per_schema = settings.train_databases + settings.eval_databases
    if settings.difficulty == "easy":  # one pool of generated single-table databases
        for i in range(per_schema):
            db = build_easy_database(settings.seed * 10_000 + i, folder)
            dbs[db.key] = db
            (train if i < settings.train_databases else held_out).append(db.key)
        return dbs, train, held_out
    for schema in settings.schema_names:
        for i in range(per_schema):
            db = build_database(schema, settings.seed * 10_000 + i, folder)
            dbs[db.key] = db
            (train if i < settings.train_databases else held_out).append(db.key)
    return dbs, train, held_out


def _state(run: Run) -> dict[str, Any]:
    state = run.resources.get(NAME)
    if state is None:  # rebuilt from the settings: deterministic, so nothing is checkpointed
        s = run.settings(NAME)
        holder = None
        if s.db_dir:
            folder = Path(s.db_dir).expanduser()
            folder.mkdir(parents=True, exist_ok=True)
        else:
            holder = tempfile.TemporaryDirectory(prefix="rlmix-sql-")  # removed at exit
            folder = Path(holder.name)
        dbs, train, held_out = build_databases(s, folder)
        rng = random.Random(f"sql-eval-{s.eval_seed}")
        eval_tasks: list[tuple[str, Task]] = []
        seen: set[tuple[str, str]] = set()
        tries = 0
        while held_out and len(eval_tasks) < s.eval_size and tries < 50 * s.eval_size:
            tries += 1
            key = rng.choice(held_out)
            task = new_task(s, rng, dbs[key])
            if (key, task.question) not in seen:
                seen.add((key, task.question))
                eval_tasks.append((key, task))
        # easy: a training prompt never shows a held-out prompt's schema and question (two
        # generated tables can share both); standard keeps its templates' fixed questions
        held_prompts = ({(dbs[k].schema_sql, t.question) for k, t in eval_tasks}
                        if s.difficulty == "easy" else set())
        state = run.resources[NAME] = {"dbs": dbs, "train": train, "held_out": held_out,
                                       "eval": eval_tasks, "folder": holder, "reference": {},
                                       "held_prompts": held_prompts}
    return state


def new_task(settings: Settings, rng: random.Random, db: Database) -> Task:
    """A question about ``db`` at the settings' difficulty."""
    return make_easy_task(rng, db) if settings.difficulty == "easy" else make_task(rng, db)


def _user_text(schema_sql: str, question: str, instr: str) -> str:
    user = f"Here is an SQLite database:\n\n```sql\n{schema_sql}\n```\n\nQuestion: {question}"
    return f"{user}\n\n{instr}" if instr else user


def to_prompt(run: Run, db: Database, task: Task, instructions: str, pid: str,
              example: bool = False) -> Prompt:
    """A chat showing ``db``'s schema and ``task``'s question, built from the harness; with
    ``example``, a worked example first (the same kind of question about a ``fruits`` table no
    generated database has, answered by the assistant with one query in a ```sql block)."""
    instr = run.harness.get("instructions", instructions)
    messages = []
    if run.harness.get("system"):
        messages.append({"role": "system", "content": run.harness["system"]})
    if example:
        messages.append({"role": "user",
                         "content": _user_text(EXAMPLE_DDL, EXAMPLE.question, instr)})
        messages.append({"role": "assistant", "content": f"```sql\n{EXAMPLE.sql}\n```"})
    messages.append({"role": "user", "content": _user_text(db.schema_sql, task.question, instr)})
    return Prompt(messages=messages, answer=task.sql, id=pid,
                  info={"db": db.key, "ordered": task.ordered, "question": task.question})


def check_answer(text: str, db: Database, reference_sql: str, ordered: bool,
                 settings: Settings, reference_cache: dict[Any, QueryResult] | None = None,
                 ) -> dict[str, Any]:
    """Score one completion: ``{"correct": bool, "valid": bool, "query": ..., "reason": ...,
    ...}``; ``valid``: the query ran and read at least one of ``db``'s tables."""
    info: dict[str, Any] = {"db": db.key, "reference": reference_sql, "ordered": ordered,
                            "valid": False}
    query = extract_query(text)
    info["query"] = query
    if query is None:
        return {**info, "correct": False, "reason": "no SQL query found"}
    cache = reference_cache if reference_cache is not None else {}
    ref_key = (db.key, reference_sql)
    if ref_key not in cache:
        cache[ref_key] = run_query(db.path, reference_sql, max(settings.timeout_ms, 5000),
                                   settings.max_rows)
    expected = cache[ref_key]
    if expected.rows is None:
        return {**info, "correct": False,
                "reason": f"the reference query failed: {expected.error}"}
    got = run_query(db.path, query, settings.timeout_ms, settings.max_rows)
    if got.rows is None:
        return {**info, "correct": False, "reason": got.error}
    match, reason = same_result(got.rows, expected.rows, ordered, settings.decimals,
                                settings.any_column_order)
    info["rows"] = len(got.rows)
    # partial credit: the query ran on this database and read at least one of its tables
    # (``SELECT 1`` runs anywhere and earns nothing)
    valid = bool(got.tables & {t.lower() for t in db.rows})
    if not valid and not match:
        reason = f"{reason}; reads none of the database's tables"
    return {**info, "correct": match, "valid": valid or match, "reason": reason}


def _score_texts(run: Run, texts: list[str], prompts: list[Prompt]) -> list[dict[str, Any]]:
    s = run.settings(NAME)
    state = _state(run)
    memo: dict[tuple[str, str, str, bool], dict[str, Any]] = {}
    out = []
    for text, prompt in zip(texts, prompts, strict=True):
        key = str(prompt.info.get("db", ""))
        db = state["dbs"].get(key)
        if db is None:
            out.append({"db": key, "query": None, "correct": False, "valid": False,
                        "reason": f"unknown database {key!r} in the prompt"})
            continue
        ordered = bool(prompt.info.get("ordered", False))
        memo_key = (text, key, str(prompt.answer), ordered)
        if memo_key not in memo:
            memo[memo_key] = check_answer(text, db, str(prompt.answer), ordered, s,
                                          state["reference"])
        out.append(dict(memo[memo_key]))
    return out


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    _state(run)


@rlmix.hookimpl
def rlmix_prompts(run: Run, step: int) -> list[Prompt]:
    s = run.settings(NAME)
    state = _state(run)
    # one stream per step: a resumed run sees exactly the prompts it would have seen
    rng = random.Random(f"sql-{run.config.train.seed}-{step}")
    prompts = []
    for i in range(int(run.config.train.prompts_per_step)):
        for _ in range(100):
            db = state["dbs"][rng.choice(state["train"])]
            task = new_task(s, rng, db)
            if (db.schema_sql, task.question) not in state["held_prompts"]:
                break
        else:
            raise rlmix.ConfigError("sql: 100 draws in a row gave a held-out prompt; use more "
                                    "training databases (sql.train_databases)")
        prompts.append(to_prompt(run, db, task, s.instructions, f"train-{step}-{i}",
                                 s.shows_example))
    return prompts


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    verdicts = _score_texts(run, list(batch.texts), list(batch.prompts))
    for info, verdict in zip(batch.info, verdicts):
        info[NAME] = verdict
    return {"correct": torch.tensor([float(v["correct"]) for v in verdicts]),
            "valid": torch.tensor([float(v.get("valid", False)) for v in verdicts]),
            "format": torch.tensor([float(has_sql_block(t)) for t in batch.texts])}


# the terms rlmix_score returns: score.weights naming another fails before the model loads
RLMIX_SCORE_TERMS = ("correct", "valid", "format")


@rlmix.hookimpl
def rlmix_evaluate(run: Run) -> dict[str, float]:
    s = run.settings(NAME)
    state = _state(run)
    if not state["eval"]:
        return {}
    prompts = [to_prompt(run, state["dbs"][key], task, s.instructions, f"eval-{i}",
                         s.shows_example) for i, (key, task) in enumerate(state["eval"])]
    texts: list[str] = []
    for start in range(0, len(prompts), s.eval_batch_size):
        chunk = prompts[start:start + s.eval_batch_size]
        texts += list(run.generate(chunk, temperature=0.0,
                                   max_new_tokens=s.eval_max_new_tokens).texts)
    verdicts = _score_texts(run, texts, prompts)
    n = len(verdicts)
    return {"accuracy": sum(v["correct"] for v in verdicts) / n,
            "format": sum(has_sql_block(t) for t in texts) / n,
            "valid_sql": sum(bool(v.get("valid")) for v in verdicts) / n}
