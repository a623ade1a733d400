"""Tests of the sql env: the generated databases and their reference queries, the safe executor
(read-only, one statement, timeouts, row cap), the result comparison, the verifier against
hand-made right and wrong queries, prompts, scoring through the core, greedy evaluation, and the
example manifest end to end on the tiny model."""

from __future__ import annotations

import json
import operator
import random
import re
import sqlite3
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import rlmix_sql
import torch
from rlmix_sql import Settings, check_answer
from rlmix_sql.easy import DOMAINS, build_easy_database, make_easy_task
from rlmix_sql.execute import (
    extract_query,
    first_keyword,
    has_sql_block,
    normalise_value,
    run_query,
    same_result,
)
from rlmix_sql.schemas import SCHEMAS, build_database

import rlmix
from rlmix import loop
from rlmix.testing import make_batch, make_run, skip_unless_installed

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "envs" / "sql.yaml"


@pytest.fixture(scope="module")
def company(tmp_path_factory):
    return build_database("company", 7, tmp_path_factory.mktemp("dbs"))


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    return build_database("shop", 7, tmp_path_factory.mktemp("dbs"))


def table_dump(db):
    conn = sqlite3.connect(db.path)
    try:
        return {t: conn.execute(f"SELECT * FROM {t} ORDER BY rowid").fetchall() for t in db.rows}
    finally:
        conn.close()


def sql_run(*overrides, tmp=None):
    extra = [f"sql.db_dir={tmp}"] if tmp else []
    return make_run({"sql": rlmix_sql}, [*extra, *overrides])


# ---------------------------------------------------------------- databases and references


def test_databases_are_deterministic_and_match_their_rows(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = build_database("shop", 3, tmp_path / "a")
    b = build_database("shop", 3, tmp_path / "b")
    c = build_database("shop", 4, tmp_path)
    assert table_dump(a) == table_dump(b) != table_dump(c)
    assert table_dump(a) == {t: [tuple(r) for r in rows] for t, rows in a.rows.items()}
    assert a.schema_sql.count("CREATE TABLE") == 3
    assert not list(tmp_path.glob("*.tmp-*"))  # no half-written file left


@pytest.mark.parametrize("schema", sorted(SCHEMAS))
def test_every_reference_query_runs_and_answers_something(schema, tmp_path):
    for seed in range(4):
        db = build_database(schema, seed, tmp_path)
        for template in SCHEMAS[schema].templates:
            for k in range(4):
                task = template(random.Random(k), db.rows)
                result = run_query(db.path, task.sql)
                assert result.error is None, (task, result)
                assert result.rows and result.rows[0][0] not in (None, 0), task


def test_reference_answers_agree_with_a_python_reading_of_the_rows(company):
    rows = company.rows
    dept_of = {d[0]: d for d in rows["departments"]}
    for k in range(10):
        rng = random.Random(k)
        task = rlmix_sql.schemas._c_count_in_dept(rng, rows)
        name = task.question.split("the ")[1].split(" department")[0]
        expected = sum(dept_of[e[2]][1] == name for e in rows["employees"])
        assert run_query(company.path, task.sql).rows == [(expected,)]
        task = rlmix_sql.schemas._c_top_paid(random.Random(k), rows)
        k_top = int(re.search(r"of the (\d+) highest", task.question)[1])
        top = sorted(rows["employees"], key=lambda e: -e[3])[:k_top]
        assert task.ordered
        assert run_query(company.path, task.sql).rows == [(e[1], e[3]) for e in top]


# ---------------------------------------------------------------- the verifier


def verdict(db, text, reference, ordered=False, **settings):
    return check_answer(text, db, reference, ordered, Settings(**settings))


def block(sql):
    return f"Here is the query:\n```sql\n{sql}\n```"


EQUIVALENT = [
    # (reference, equivalent query written differently)
    ("SELECT name FROM employees WHERE salary > 60000",
     "select e.name from employees as e where 60000 < e.salary"),
    ("SELECT name FROM employees WHERE salary > 60000",
     "SELECT name FROM employees WHERE NOT salary <= 60000 ORDER BY name DESC"),
    ("SELECT COUNT(*) FROM employees JOIN departments ON employees.department_id = "
     "departments.id WHERE departments.name = 'Sales'",
     "SELECT COUNT(e.id) FROM employees e WHERE e.department_id IN "
     "(SELECT id FROM departments WHERE name = 'Sales')"),
    ("SELECT departments.name, COUNT(*) FROM departments JOIN employees ON "
     "employees.department_id = departments.id GROUP BY departments.id",
     "WITH c AS (SELECT department_id AS d, COUNT(*) AS n FROM employees GROUP BY "
     "department_id) SELECT n, name FROM c JOIN departments ON departments.id = c.d"),
    ("SELECT AVG(salary) FROM employees",  # an average, rounded by the model
     "SELECT ROUND(SUM(salary) * 1.0 / COUNT(*), 2) FROM employees;"),
]


@pytest.mark.parametrize("reference, query", EQUIVALENT)
def test_equivalent_queries_written_differently_match(company, reference, query):
    if "'Sales'" in reference and not any(d[1] == "Sales" for d in company.rows["departments"]):
        name = company.rows["departments"][0][1]
        reference, query = reference.replace("Sales", name), query.replace("Sales", name)
    v = verdict(company, block(query), reference)
    assert v["correct"], v
    assert v["reason"] == "correct"


@pytest.mark.parametrize("query, reason", [
    ("SELECT name FROM employees WHERE salary >= 60000", None),  # an off-by-one filter
    ("SELECT name FROM employees WHERE salary < 60000", None),
    ("SELECT name, salary FROM employees WHERE salary > 60000", "2 columns, the reference has 1"),
    ("SELECT name FROM employees", "rows, the reference has"),
])
def test_a_wrong_filter_fails(company, query, reason):
    salaries = sorted(e[3] for e in company.rows["employees"])
    threshold = salaries[len(salaries) // 2]  # an existing salary: > and >= differ by one row
    reference = f"SELECT name FROM employees WHERE salary > {threshold}"
    v = verdict(company, block(query.replace("60000", str(threshold))), reference)
    assert not v["correct"]
    if reason:
        assert reason in v["reason"]


def test_order_matters_only_when_the_question_asks_for_it(company):
    reference = "SELECT name, salary FROM employees ORDER BY salary DESC LIMIT 3"
    reversed_order = ("SELECT * FROM (SELECT name, salary FROM employees ORDER BY salary DESC "
                      "LIMIT 3) ORDER BY salary ASC")
    assert verdict(company, block(reference), reference, ordered=True)["correct"]
    v = verdict(company, block(reversed_order), reference, ordered=True)
    assert not v["correct"] and v["reason"] == "right rows in the wrong order"
    assert verdict(company, block(reversed_order), reference, ordered=False)["correct"]
    # columns swapped are fine unless any_column_order is off
    swapped = "SELECT salary, name FROM employees ORDER BY salary DESC LIMIT 3"
    assert verdict(company, block(swapped), reference, ordered=True)["correct"]
    assert not verdict(company, block(swapped), reference, ordered=True,
                       any_column_order=False)["correct"]


@pytest.mark.parametrize("attack", [
    "DROP TABLE employees",
    "INSERT INTO employees VALUES (999, 'Mallory', 1, 1, 2020)",
    "DELETE FROM employees",
    "UPDATE employees SET salary = 0",
    "ATTACH DATABASE '{tmp}/evil.db' AS evil",
    "SELECT 1; DROP TABLE employees",
    "SELECT COUNT(*) FROM employees; DELETE FROM employees;",
    "WITH x AS (SELECT 1) DELETE FROM employees",
    "WITH x AS (SELECT 1) INSERT INTO departments SELECT 99, 'X', 'Y' FROM x",
    "PRAGMA query_only = OFF",
    "CREATE TABLE t (x)",
    "SELECT load_extension('/tmp/x')",
    "VACUUM INTO '{tmp}/copy.db'",
])
def test_write_attempts_score_zero_and_leave_the_database_intact(company, tmp_path, attack):
    before = table_dump(company)
    attack = attack.replace("{tmp}", str(tmp_path))
    v = verdict(company, block(attack), "SELECT COUNT(*) FROM employees")
    assert not v["correct"]
    assert v["reason"] and v["reason"] != "correct"
    assert table_dump(company) == before
    assert not list(tmp_path.iterdir())  # nothing written next to it


def test_the_connection_is_read_only_even_for_a_statement_that_passes_the_checks(company):
    # below the statement checks: the file is opened mode=ro, query_only is on, and the
    # authorizer refuses anything but reads
    conn = rlmix_sql.execute.connect_read_only(company.path)
    try:
        for statement in ("DELETE FROM employees", "PRAGMA query_only = OFF",
                          f"ATTACH DATABASE '{company.path}' AS again"):
            with pytest.raises(sqlite3.DatabaseError):
                conn.execute(statement)
        assert conn.execute("SELECT COUNT(*) FROM employees").fetchone()[0] == len(
            company.rows["employees"])
    finally:
        conn.close()
    plain = sqlite3.connect(f"file:{company.path}?mode=ro", uri=True)
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            plain.execute("DELETE FROM employees")
    finally:
        plain.close()


def test_a_runaway_recursive_cte_times_out_quickly(company):
    runaway = ("WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) "
               "SELECT COUNT(*) FROM n")
    t0 = time.perf_counter()
    v = verdict(company, block(runaway), "SELECT COUNT(*) FROM employees", timeout_ms=300)
    elapsed = time.perf_counter() - t0
    assert not v["correct"]
    assert v["reason"] == "query timed out after 300 ms"
    assert elapsed < 2.0
    # a cross join explosion too
    heavy = ("SELECT COUNT(*) FROM employees a, employees b, employees c, employees d, "
             "employees e, employees f, employees g, employees h")
    assert run_query(company.path, heavy, timeout_ms=200).error == "query timed out after 200 ms"


def test_row_cap_and_value_size_cap(company):
    assert run_query(company.path, "SELECT * FROM employees", max_rows=3).error == \
        "more than 3 rows"
    assert len(run_query(company.path, "SELECT * FROM employees", max_rows=100).rows) == \
        len(company.rows["employees"])
    big = run_query(company.path, "SELECT randomblob(50000000)")
    assert big.rows is None and "too big" in big.error


@pytest.mark.parametrize("text, reason", [
    ("I cannot write SQL.", "no SQL query found"),
    ("", "no SQL query found"),
    (block("SELEC name FROM employees"), "only one SELECT or WITH query is allowed, got SELEC"),
    (block("SELECT nme FROM employees"), "sqlite error: no such column: nme"),
    (block("SELECT name FROM"), "sqlite error: incomplete input"),
    (block("SELECT name FROM employees WHERE name = 'x"), "only one statement is allowed"),
    (block("SELECT * FROM nowhere"), "sqlite error: no such table: nowhere"),
    ("```sql\n```", "no SQL query found"),
])
def test_invalid_sql_scores_zero_with_the_reason(company, text, reason):
    v = verdict(company, text, "SELECT COUNT(*) FROM employees")
    assert not v["correct"]
    assert v["reason"] == reason


@pytest.mark.parametrize("text, query", [
    ("```sql\nSELECT 1\n```", "SELECT 1"),
    ("```SQL\nSELECT 1;\n```\nand then\n```sql\nSELECT 2\n```", "SELECT 2"),
    ("```\nSELECT 3\n```", "SELECT 3"),
    ("```sql\nSELECT 4\n```\n```python\nprint(1)\n```", "SELECT 4"),
    ("```sql\nSELECT 5 FROM t", "SELECT 5 FROM t"),  # cut off before the closing fence
    # a complete block, then a repeat cut off by the token limit: the complete one counts
    ("```sql\nSELECT 8 FROM t\n```\nIt runs:\n```sql\nSELECT 8 FR", "SELECT 8 FROM t"),
    ("```sql\nSELECT 9\n```\n```sql\n\n```", "SELECT 9"),  # an empty block is skipped
    ("  select 6 ", "select 6"),
    ("The answer is 7", None),
])
def test_extract_query(text, query):
    assert extract_query(text) == query


def test_format_needs_a_closed_sql_block():
    texts = ["```sql\nSELECT 1\n```", "```sqlite\nSELECT 1\n```", "```\nSELECT 1\n```",
             "SELECT 1", "```sql\nSELECT 1", "```sql\n\n```"]
    assert [has_sql_block(t) for t in texts] == [True, True, False, False, False, False]


def test_first_keyword_skips_comments_and_parentheses():
    assert first_keyword("-- hi\n/* x */ (select 1)") == "SELECT"
    assert first_keyword("  with x as (select 1) select * from x") == "WITH"
    assert first_keyword("/* unclosed") == ""


def test_result_comparison_normalises_values():
    assert normalise_value(3) == normalise_value(3.0) == normalise_value(3.001)
    assert normalise_value(" a ") == "a"
    assert same_result([(1, "a"), (2, "b")], [(2.0, "b"), (1.0, "a")], ordered=False)[0]
    assert not same_result([(1, "a"), (2, "b")], [(2.0, "b"), (1.0, "a")], ordered=True)[0]
    # a multiset: duplicates count
    assert not same_result([(1,), (1,), (2,)], [(1,), (2,), (2,)], ordered=False)[0]
    assert not same_result([(1,), (2,)], [(1,), (2,), (2,)], ordered=False)[0]
    assert same_result([(None,)], [(None,)], ordered=False)[0]
    assert same_result([], [], ordered=False)[0]
    assert not same_result([(1.5,)], [(1.51,)], ordered=False, decimals=2)[0]
    assert same_result([(1.5,)], [(1.51,)], ordered=False, decimals=1)[0]


def test_the_executor_works_off_the_main_thread(company):
    out = []
    t = threading.Thread(target=lambda: out.append(run_query(
        company.path, "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) "
        "SELECT COUNT(*) FROM n", timeout_ms=200).error))
    t.start()
    t.join(20)
    assert out == ["query timed out after 200 ms"]


# ---------------------------------------------------------------- prompts, scoring, evaluation


def test_prompts_are_deterministic_show_the_schema_and_never_use_held_out_databases(tmp_path):
    run = sql_run("train.prompts_per_step=6", tmp=tmp_path)
    rlmix_sql.rlmix_configure(run)
    state = run.resources["sql"]
    assert len(state["train"]) == 12 and len(state["held_out"]) == 6
    assert not set(state["train"]) & set(state["held_out"])
    p3 = run.hook.rlmix_prompts(run=run, step=3)
    run.hook.rlmix_prompts(run=run, step=4)
    again = run.hook.rlmix_prompts(run=run, step=3)
    assert [(p.messages, p.answer, p.info) for p in p3] == [
        (p.messages, p.answer, p.info) for p in again]
    used = set()
    for step in range(40):
        for p in run.hook.rlmix_prompts(run=run, step=step):
            used.add(p.info["db"])
            db = state["dbs"][p.info["db"]]
            text = p.messages[-1]["content"]
            assert db.schema_sql in text and p.info["question"] in text
            assert text.endswith("```sql code block.")
    assert used <= set(state["train"]) and len(used) == 12
    assert {key for key, _ in state["eval"]} <= set(state["held_out"])
    assert len(state["eval"]) == 60


def test_prompt_text_comes_from_the_harness(tmp_path):
    run = sql_run("train.prompts_per_step=1", "harness.system=You write SQL.", tmp=tmp_path)
    run.harness["instructions"] = "Only SQL please."
    prompt = run.hook.rlmix_prompts(run=run, step=0)[0]
    assert prompt.messages[0] == {"role": "system", "content": "You write SQL."}
    assert prompt.messages[1]["content"].endswith("\n\nOnly SQL please.")


def test_score_terms_info_and_weights_through_the_core(tmp_path):
    run = sql_run("train.prompts_per_step=2", "score.weights.sql.format=0.5",
                  "score.weights.sql.valid=0.25", tmp=tmp_path)
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    batch = make_batch(n_groups=2, group_size=4)
    batch.prompts = [p for p in prompts for _ in range(4)]
    batch.texts = [t for p in prompts for t in (
        block(p.answer), p.answer, block("SELECT x FROM nowhere"), "no idea")]
    loop.score(run, batch)
    assert batch.reward_terms["sql.correct"].tolist() == [1, 1, 0, 0] * 2
    assert batch.reward_terms["sql.valid"].tolist() == [1, 1, 0, 0] * 2
    assert batch.reward_terms["sql.format"].tolist() == [1, 0, 1, 0] * 2
    torch.testing.assert_close(batch.rewards, torch.tensor([1.75, 1.25, 0.5, 0.0] * 2))
    assert batch.info[0]["sql"]["reason"] == "correct"
    assert batch.info[2]["sql"]["reason"] == "sqlite error: no such table: nowhere"
    assert batch.info[3]["sql"]["reason"] == "no SQL query found"
    assert batch.info[3]["sql"]["db"] == prompts[0].info["db"]


def test_an_unknown_database_scores_zero(tmp_path):
    run = sql_run("train.prompts_per_step=1", tmp=tmp_path)
    prompt = rlmix.Prompt(messages=[], answer="SELECT 1", info={"db": "shop-999"})
    batch = make_batch(n_groups=1, group_size=2)
    batch.prompts, batch.texts = [prompt, prompt], [block("SELECT 1")] * 2
    terms = rlmix_sql.rlmix_score(run, batch)
    assert terms["correct"].tolist() == [0, 0]
    assert "unknown database" in batch.info[0]["sql"]["reason"]


def test_evaluation_is_greedy_chunked_on_held_out_databases(tmp_path, monkeypatch):
    run = sql_run("sql.eval_size=7", "sql.eval_batch_size=3", "sql.eval_max_new_tokens=11",
                  "sql.schemas=company", tmp=tmp_path)
    rlmix_sql.rlmix_configure(run)
    calls = []

    def fake_generate(prompts, **kwargs):
        calls.append((len(prompts), kwargs))
        assert all(p.info["db"] in run.resources["sql"]["held_out"] for p in prompts)
        # right on the first of each chunk, invalid SQL on the second, nothing on the rest
        return SimpleNamespace(texts=[block(p.answer) if i == 0 else block("SELECT x FROM y")
                                      if i == 1 else "?" for i, p in enumerate(prompts)])

    monkeypatch.setattr(run, "generate", fake_generate)
    result = rlmix_sql.rlmix_evaluate(run)
    assert [n for n, _ in calls] == [3, 3, 1]
    assert all(kw == {"temperature": 0.0, "max_new_tokens": 11} for _, kw in calls)
    assert result == {"accuracy": pytest.approx(3 / 7), "format": pytest.approx(5 / 7),
                      "valid_sql": pytest.approx(3 / 7)}
    assert rlmix_sql.rlmix_evaluate(sql_run("sql.eval_size=0", tmp=tmp_path)) == {}


@pytest.mark.parametrize("override", ["sql.schemas=company,bank", "sql.schemas=",
                                      "sql.timeout_ms=0", "sql.max_rows=0",
                                      "sql.train_databases=0", "sql.decimals=-1",
                                      "sql.eval_databases=0", "sql.size=3"])
def test_bad_settings_fail(override):
    with pytest.raises(rlmix.ManifestError, match="sql"):
        sql_run(override)


def test_the_default_folder_is_temporary_and_removed():
    run = sql_run("sql.schemas=school", "sql.eval_size=0")
    rlmix_sql.rlmix_configure(run)
    state = run.resources["sql"]
    folder = Path(state["folder"].name)
    assert len(list(folder.glob("*.db"))) == 6
    state["folder"].cleanup()
    assert not folder.exists()


def test_example_manifest_runs_two_steps_on_the_tiny_model(tmp_path):
    from rlmix import cli

    skip_unless_installed(EXAMPLE)
    code = cli.main(["run", str(EXAMPLE), "model=tiny-random", "sql.eval_size=3",
                     "sql.eval_max_new_tokens=6", "sampling.max_new_tokens=6",
                     "train.steps=2", "train.prompts_per_step=2", "train.group_size=2",
                     "train.eval_every=0", "train.checkpoint_every=0", "log.progress=false",
                     "log.plot=false", "policy.autocast=none", f"out={tmp_path}"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert {"reward/sql.correct", "reward/sql.valid", "reward/sql.format"} <= set(steps[-1])
    assert "eval/accuracy" in rows[0] and "eval/valid_sql" in rows[-1]




# ---------------------------------------------------------------- the easy end (difficulty: easy)


def test_easy_databases_are_one_generated_table_and_deterministic(tmp_path):
    (tmp_path / "a").mkdir()
    a = build_easy_database(5, tmp_path / "a")
    b = build_easy_database(5, tmp_path)
    assert table_dump(a) == table_dump(b) == {t: list(r) for t, r in a.rows.items()}
    assert len(a.rows) == 1 and a.schema_sql.count("CREATE TABLE") == 1
    tables = {next(iter(build_easy_database(s, tmp_path).rows)) for s in range(30)}
    assert len(tables) >= 5 and "fruits" not in tables  # the worked example's table is apart
    assert "fruits" not in {d.table for d in DOMAINS}


def test_easy_questions_are_one_filter_selects_that_answer_something(tmp_path):
    kinds = set()
    for seed in range(12):
        db = build_easy_database(seed, tmp_path)
        rng = random.Random(seed)
        for _ in range(30):
            task = make_easy_task(rng, db)
            sql = task.sql.upper()
            assert sql.startswith("SELECT ") and sql.count(" WHERE ") == 1, task
            assert not re.search(r"\b(JOIN|AND|OR|GROUP|ORDER)\b", sql), task
            result = run_query(db.path, task.sql)
            assert result.rows and result.rows[0][0] is not None, (task, result)
            kinds.add(task.question.split()[0] + ("COUNT" if "COUNT(*)" in sql else ""))
    assert kinds == {"List", "HowCOUNT", "What"}


def test_easy_reference_queries_agree_with_a_python_reading_of_the_rows(tmp_path):
    for seed in range(4):
        db = build_easy_database(seed, tmp_path)
        table = db.spec
        cols = ["id", "name", *(c for c, _ in table.columns)]
        rng = random.Random(seed)
        for _ in range(25):
            task = make_easy_task(rng, db)
            m = re.fullmatch(r"SELECT (\S+) FROM \w+ WHERE (\w+) ([=<>]) (.+)", task.sql)
            assert m, task
            what, col, op, literal = m.groups()
            value = literal.strip("'") if literal.startswith("'") else int(literal)
            compare = {"=": operator.eq, "<": operator.lt, ">": operator.gt}[op]
            keep = [r for r in table.rows if compare(r[cols.index(col)], value)]
            expected = ([(len(keep),)] if what == "COUNT(*)"
                        else sorted((r[cols.index(what)],) for r in keep))
            assert sorted(run_query(db.path, task.sql).rows) == expected, task


def test_the_easy_held_out_prompts_are_never_trained_on(tmp_path):
    run = sql_run("sql.difficulty=easy", "sql.train_databases=6", "sql.eval_databases=3",
                  "sql.eval_size=100", "train.prompts_per_step=8", tmp=tmp_path)
    rlmix_sql.rlmix_configure(run)
    state = run.resources["sql"]
    assert len(state["train"]) == 6 and len(state["held_out"]) == 3
    assert all(k.startswith("easy-") for k in state["dbs"])
    assert len(state["eval"]) == 100 and {k for k, _ in state["eval"]} <= set(state["held_out"])
    held = {(state["dbs"][k].schema_sql, t.question) for k, t in state["eval"]}
    assert len(held) == len(state["held_prompts"]) > 50
    seen = set()
    for step in range(60):
        for p in run.hook.rlmix_prompts(run=run, step=step):
            assert p.info["db"] in state["train"]
            seen.add((state["dbs"][p.info["db"]].schema_sql, p.info["question"]))
    assert len(seen) > 200 and not seen & held
    # the check is not idle: training tables share schemas with held-out ones, so the same
    # (schema, question) prompt can be drawn for both
    train_schemas = {state["dbs"][k].schema_sql for k in state["train"]}
    assert any(state["dbs"][k].schema_sql in train_schemas for k in state["held_out"])


def test_easy_prompts_show_a_worked_example_then_the_task(tmp_path):
    run = sql_run("sql.difficulty=easy", "train.prompts_per_step=1", tmp=tmp_path)
    (prompt,) = run.hook.rlmix_prompts(run=run, step=0)
    roles = [m["role"] for m in prompt.messages]
    assert roles == ["user", "assistant", "user"]
    example, answer, task = (m["content"] for m in prompt.messages)
    assert "CREATE TABLE fruits" in example and "Question: List the names of the fruits" in example
    assert answer == "```sql\nSELECT name FROM fruits WHERE color = 'red';\n```"
    assert extract_query(answer) and has_sql_block(answer)
    assert task.endswith("```sql code block.") and prompt.info["question"] in task
    hidden = sql_run("sql.difficulty=easy", "sql.worked_example=hide",
                     "train.prompts_per_step=1", tmp=tmp_path)
    assert len(hidden.hook.rlmix_prompts(run=hidden, step=0)[0].messages) == 1
    standard = sql_run("train.prompts_per_step=1", "sql.schemas=shop", tmp=tmp_path)
    assert len(standard.hook.rlmix_prompts(run=standard, step=0)[0].messages) == 1
    shown = sql_run("sql.worked_example=show", "sql.schemas=shop", "train.prompts_per_step=1",
                    tmp=tmp_path)
    assert len(shown.hook.rlmix_prompts(run=shown, step=0)[0].messages) == 3


def test_valid_is_partial_credit_for_a_query_that_reads_the_tasks_table(tmp_path):
    db = build_easy_database(2, tmp_path)
    table = next(iter(db.rows))
    task = make_easy_task(random.Random(0), db)
    cases = {
        block(task.sql): (True, True),
        block(f"SELECT * FROM {table}"): (False, True),
        block(f"SELECT name FROM {table} WHERE id < 0"): (False, True),
        block("SELECT 1"): (False, False),  # runs anywhere: no credit
        block("SELECT name FROM sqlite_master"): (False, False),
        block(f"SELECT nme FROM {table}"): (False, False),
        block(f"DELETE FROM {table}"): (False, False),
        "no query": (False, False),
    }
    for text, (correct, valid) in cases.items():
        v = check_answer(text, db, task.sql, False, Settings(difficulty="easy"))
        assert (v["correct"], v["valid"]) == (correct, valid), (text, v)
        assert v["reason"]
    assert "reads none of the database's tables" in check_answer(
        block("SELECT 1"), db, task.sql, False, Settings())["reason"]


def test_easy_evaluation_scores_the_held_out_questions(tmp_path, monkeypatch):
    run = sql_run("sql.difficulty=easy", "sql.eval_size=6", "sql.eval_batch_size=4", tmp=tmp_path)
    rlmix_sql.rlmix_configure(run)
    table = {k: next(iter(db.rows)) for k, db in run.resources["sql"]["dbs"].items()}

    def fake_generate(prompts, **kwargs):
        assert all(len(p.messages) == 3 for p in prompts)
        return SimpleNamespace(texts=[block(p.answer) if i % 2 == 0 else
                                      block(f"SELECT * FROM {table[p.info['db']]}")
                                      for i, p in enumerate(prompts)])

    monkeypatch.setattr(run, "generate", fake_generate)
    assert rlmix_sql.rlmix_evaluate(run) == {"accuracy": pytest.approx(3 / 6),
                                             "format": 1.0, "valid_sql": 1.0}


@pytest.mark.parametrize("override", ["sql.difficulty=hard", "sql.worked_example=yes"])
def test_bad_easy_settings_fail(override):
    with pytest.raises(rlmix.ManifestError, match="sql"):
        sql_run(override)
