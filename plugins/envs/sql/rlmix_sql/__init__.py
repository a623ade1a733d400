"""Text-to-SQL on generated SQLite databases: the prompt shows the schema and a question, the
model answers with one query in a ```sql block, and the reward ``correct`` is execution match
against the reference query (``format``: a ```sql block is present). Greedy execution accuracy
on held-out databases is ``eval/accuracy``.

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


@dataclass
class Settings:
    schemas: str = "company,shop,school"  # comma-separated, from: company, shop, school
    train_databases: int = 4  # generated databases per schema that training prompts use
    eval_databases: int = 2  # further databases per schema, used only for evaluation
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

    def __post_init__(self) -> None:
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


def build_databases(settings: Settings, folder: Path) -> tuple[dict[str, Database], list[str],
                                                                list[str]]:
    """Every database of these settings, and the keys of the training and held-out ones."""
    dbs: dict[str, Database] = {}
    train, held_out = [], []
    per_schema = settings.train_databases + settings.eval_databases
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
            task = make_task(rng, dbs[key])
            if (key, task.question) not in seen:
                seen.add((key, task.question))
                eval_tasks.append((key, task))
        state = run.resources[NAME] = {"dbs": dbs, "train": train, "held_out": held_out,
                                       "eval": eval_tasks, "folder": holder, "reference": {}}
    return state


def to_prompt(run: Run, db: Database, task: Task, instructions: str, pid: str) -> Prompt:
    """A chat showing ``db``'s schema and ``task``'s question, built from the harness."""
    instr = run.harness.get("instructions", instructions)
    user = (f"Here is an SQLite database:\n\n```sql\n{db.schema_sql}\n```\n\n"
            f"Question: {task.question}")
    if instr:
        user = f"{user}\n\n{instr}"
    messages = []
    if run.harness.get("system"):
        messages.append({"role": "system", "content": run.harness["system"]})
    messages.append({"role": "user", "content": user})
    return Prompt(messages=messages, answer=task.sql, id=pid,
                  info={"db": db.key, "ordered": task.ordered, "question": task.question})


def check_answer(text: str, db: Database, reference_sql: str, ordered: bool,
                 settings: Settings, reference_cache: dict[Any, QueryResult] | None = None,
                 ) -> dict[str, Any]:
    """Score one completion: ``{"correct": bool, "query": ..., "reason": ..., ...}``."""
    info: dict[str, Any] = {"db": db.key, "reference": reference_sql, "ordered": ordered}
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
    return {**info, "correct": match, "reason": reason}


def _score_texts(run: Run, texts: list[str], prompts: list[Prompt]) -> list[dict[str, Any]]:
    s = run.settings(NAME)
    state = _state(run)
    memo: dict[tuple[str, str, str, bool], dict[str, Any]] = {}
    out = []
    for text, prompt in zip(texts, prompts, strict=True):
        key = str(prompt.info.get("db", ""))
        db = state["dbs"].get(key)
        if db is None:
            out.append({"db": key, "query": None, "correct": False,
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
        db = state["dbs"][rng.choice(state["train"])]
        prompts.append(to_prompt(run, db, make_task(rng, db), s.instructions,
                                 f"train-{step}-{i}"))
    return prompts


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    verdicts = _score_texts(run, list(batch.texts), list(batch.prompts))
    for info, verdict in zip(batch.info, verdicts):
        info[NAME] = verdict
    return {"correct": torch.tensor([float(v["correct"]) for v in verdicts]),
            "format": torch.tensor([float(has_sql_block(t)) for t in batch.texts])}


@rlmix.hookimpl
def rlmix_evaluate(run: Run) -> dict[str, float]:
    s = run.settings(NAME)
    state = _state(run)
    if not state["eval"]:
        return {}
    prompts = [to_prompt(run, state["dbs"][key], task, s.instructions, f"eval-{i}")
               for i, (key, task) in enumerate(state["eval"])]
    texts: list[str] = []
    for start in range(0, len(prompts), s.eval_batch_size):
        chunk = prompts[start:start + s.eval_batch_size]
        texts += list(run.generate(chunk, temperature=0.0,
                                   max_new_tokens=s.eval_max_new_tokens).texts)
    verdicts = _score_texts(run, texts, prompts)
    n = len(verdicts)
    return {"accuracy": sum(v["correct"] for v in verdicts) / n,
            "format": sum(has_sql_block(t) for t in texts) / n,
            "valid_sql": sum(v.get("rows") is not None for v in verdicts) / n}
