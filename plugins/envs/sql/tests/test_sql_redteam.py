"""The sql env's red team: queries a policy could write to get around the read-only, one-statement,
bounded executor. Each must score ``correct == 0`` with a reason, end quickly, leave the database
file unchanged and keep the trainer's memory bounded."""

from __future__ import annotations

import hashlib
import time

import pytest
from rlmix_sql import Settings, check_answer
from rlmix_sql.schemas import build_database

# (name, query): every one a WRONG answer that tries to escape or stall the executor
HACKS: list[tuple[str, str]] = [
    ("ATTACH another database", "ATTACH DATABASE ':memory:' AS x"),
    ("ATTACH after a SELECT", "SELECT 1; ATTACH DATABASE '/tmp/rlmix-x.db' AS x"),
    ("PRAGMA query_only off", "PRAGMA query_only = OFF"),
    ("PRAGMA writable_schema", "PRAGMA writable_schema = ON"),
    ("pragma table function", "SELECT * FROM pragma_database_list"),
    ("load_extension", "SELECT load_extension('/tmp/evil.so')"),
    ("recursive CTE without end", "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c)"
                                  " SELECT count(*) FROM c"),
    ("recursive CTE doubling a string", "WITH RECURSIVE c(x, s) AS (SELECT 1, 'a' UNION ALL "
                                        "SELECT x + 1, s || s FROM c WHERE x < 40) "
                                        "SELECT length(s) FROM c"),
    ("recursive CTE sorted in memory", "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 "
                                       "FROM c ORDER BY 1 LIMIT 100000000) SELECT max(x) FROM c"),
    ("1000 rows of 1 MB blobs", "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c "
                                "LIMIT 1000) SELECT randomblob(999000) FROM c"),
    ("printf with a 2e9 width", "SELECT printf('%.*c', 2000000000, 'x')"),
    ("zeroblob of 2 GB", "SELECT zeroblob(2000000000)"),
    ("two statements", "SELECT 1; DROP TABLE employees"),
    ("a second statement after a comment", "SELECT 1 /* ; */ ; SELECT 2"),
    ("WITH ... INSERT", "WITH x AS (SELECT 1) INSERT INTO departments SELECT * FROM x"),
    ("WITH ... DELETE", "WITH x AS (SELECT 1) DELETE FROM employees"),
    ("VACUUM INTO a host file", "VACUUM INTO '/tmp/rlmix-copy.db'"),
    ("CREATE TEMP TABLE", "CREATE TEMP TABLE z(x)"),
    ("5000 nested parentheses", "SELECT " + "(" * 5000 + "1" + ")" * 5000),
    ("five-way cross join", "SELECT count(*) FROM employees a, employees b, employees c, "
                            "employees d, employees e, employees f"),
]


# valid SQL that runs to an answer on the task's tables: it earns the partial-credit term
# ``valid`` (what that term is for) and nothing else
RUNS_ON_THE_TABLES = {"five-way cross join"}


@pytest.fixture(scope="module")
def company(tmp_path_factory):
    return build_database("company", 7, tmp_path_factory.mktemp("dbs"))


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name,query", HACKS, ids=[h[0] for h in HACKS])
def test_hack_scores_zero_and_ends(name: str, query: str, company) -> None:
    before = _digest(company.path)
    settings = Settings(timeout_ms=500)
    reference = "SELECT name FROM employees WHERE salary < 0"  # no row: only a non-empty-safe
    started = time.monotonic()
    verdict = check_answer(f"```sql\n{query}\n```", company, reference, False, settings)
    elapsed = time.monotonic() - started
    assert not verdict["correct"] and verdict["reason"] != "correct", (name, verdict)
    assert verdict["reason"], name
    # the partial credit: none for a query that escapes, stalls, errs or reads no table
    # (the cross join may also time out on a loaded machine: then it earns nothing)
    assert not verdict["valid"] or name in RUNS_ON_THE_TABLES, (name, verdict)
    assert elapsed < 5.0, (name, elapsed)
    assert _digest(company.path) == before, name


def test_the_honest_query_still_passes(company) -> None:
    settings = Settings()
    reference = "SELECT count(*) FROM employees"
    verdict = check_answer("```sql\nSELECT COUNT(*) FROM employees\n```", company, reference,
                           False, settings)
    assert verdict["correct"], verdict
