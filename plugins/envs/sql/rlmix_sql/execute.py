"""Running a model's query safely, and comparing result sets.

A query runs only if it is one ``SELECT`` / ``WITH`` statement, on a connection that is read-only
three times over: the file is opened ``mode=ro``, ``PRAGMA query_only`` is on, and an authorizer
allows only reads (no ATTACH, PRAGMA or pragma functions, writes, schema changes,
``load_extension``, ``printf``). A progress handler aborts it after ``timeout_ms``; at most
``max_rows + 1`` rows and ``MAX_RESULT_BYTES`` are fetched; strings and blobs are capped at
``MAX_VALUE_BYTES``. The red-team suite (``tests/test_sql_redteam.py``) tries each way around.
Nothing here raises: every failure is a ``QueryResult`` with an ``error`` (the reason).
"""

from __future__ import annotations

import itertools
import re
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                    getattr(sqlite3, "SQLITE_RECURSIVE", 33)}
# printf/format: a width such as printf('%.*c', 2000000000, 'x') runs for minutes inside one
# function call, where neither the progress handler nor the length limit stops it
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer",
                     "printf", "format"}
_LEADING_COMMENT = re.compile(r"^\s*(?:--[^\n]*(?:\n|$)|/\*.*?\*/)", re.S)
_FIRST_WORD = re.compile(r"^[\s(]*([A-Za-z]+)")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.S)
MAX_VALUE_BYTES = 1_000_000  # longest string or blob a query may build
MAX_SQL_CHARS = 20_000
MAX_RESULT_BYTES = 8_000_000  # all fetched values together (1000 rows of 1 MB would be 1 GB)


@dataclass
class QueryResult:
    rows: list[tuple[Any, ...]] | None  # None when the query did not run to the end
    error: str | None = None  # why it did not; None on success
    columns: int = 0
    tables: frozenset[str] = frozenset()  # the tables the query read (from the authorizer)


def extract_query(text: str) -> str | None:
    """The model's query: the last closed ```sql block; else an unclosed final one (generation
    may stop before the closing fence, but a block cut off after a complete one is a truncated
    repeat, not the answer); else the same for plain ``` blocks; else the text itself when it
    starts with SELECT or WITH."""
    blocks = [(m.group(1).lower(), m.group(2), m.group(0).endswith("```"))
              for m in _FENCE.finditer(text)]
    for wanted in (("sql", "sqlite"), ("",)):
        found = [(body, closed) for lang, body, closed in blocks
                 if lang in wanted and body.strip()]
        closed = [body for body, is_closed in found if is_closed]
        if closed:
            return closed[-1].strip()
        if found:
            return found[-1][0].strip()
    stripped = text.strip()
    if first_keyword(stripped) in ("SELECT", "WITH"):
        return stripped
    return None


def has_sql_block(text: str) -> bool:
    """The ``format`` criterion: a closed ```sql code block with something in it."""
    return any(m.group(1).lower() in ("sql", "sqlite") and m.group(2).strip()
               and m.group(0).endswith("```") for m in _FENCE.finditer(text))


def first_keyword(sql: str) -> str:
    """The first word of ``sql`` after comments and opening parentheses, upper-cased."""
    match = _FIRST_WORD.match(_strip_comments(sql))
    return match.group(1).upper() if match else ""


def _authorize(action: int, arg1: str | None, arg2: str | None, db: str | None,
               trigger: str | None) -> int:
    if action not in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def connect_read_only(path: Path) -> sqlite3.Connection:
    """A connection that can only read ``path``."""
    conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True,
                           check_same_thread=False)
    conn.execute("PRAGMA query_only = ON")
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_CHARS)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.set_authorizer(_authorize)
    return conn


def run_query(path: Path, sql: str, timeout_ms: int = 1000, max_rows: int = 1000,
              steps_per_check: int = 1000) -> QueryResult:
    """Run one read-only query on the database file at ``path``."""
    sql = sql.strip()
    while sql.endswith(";"):
        sql = sql[:-1].rstrip()
    if not sql:
        return QueryResult(None, "empty query")
    if len(sql) > MAX_SQL_CHARS:
        return QueryResult(None, f"query longer than {MAX_SQL_CHARS} characters")
    keyword = first_keyword(sql)
    if keyword not in ("SELECT", "WITH"):
        return QueryResult(None, f"only one SELECT or WITH query is allowed, got "
                                 f"{keyword or 'no statement'}")
    if not sqlite3.complete_statement(sql + ";") or _has_second_statement(sql):
        return QueryResult(None, "only one statement is allowed")
    try:
        conn = connect_read_only(path)
    except sqlite3.Error as exc:
        return QueryResult(None, f"cannot open the database: {exc}")
    read: set[str] = set()

    def authorize(action: int, arg1: str | None, arg2: str | None, db: str | None,
                  trigger: str | None) -> int:
        verdict = _authorize(action, arg1, arg2, db, trigger)
        if verdict == sqlite3.SQLITE_OK and action == sqlite3.SQLITE_READ and arg1:
            read.add(arg1.lower())
        return verdict

    conn.set_authorizer(authorize)
    deadline = time.monotonic() + timeout_ms / 1000
    timed_out = False

    def progress() -> int:
        nonlocal timed_out
        if time.monotonic() > deadline:
            timed_out = True
            return 1  # non-zero aborts the statement
        return 0

    conn.set_progress_handler(progress, steps_per_check)
    try:
        cursor = conn.execute(sql)
        columns = len(cursor.description or ())
        rows, size = [], 0
        for row in cursor:  # one at a time, so the size cap holds before memory is spent
            rows.append(row)
            size += sum(len(v) if isinstance(v, str | bytes) else 8 for v in row)
            if size > MAX_RESULT_BYTES:
                return QueryResult(None, f"result larger than {MAX_RESULT_BYTES} bytes", columns)
            if len(rows) > max_rows or time.monotonic() > deadline:
                break
        if time.monotonic() > deadline and len(rows) <= max_rows:
            timed_out = True
            return QueryResult(None, f"query timed out after {timeout_ms} ms")
    except (sqlite3.Error, sqlite3.Warning, OverflowError, MemoryError, ValueError) as exc:
        if timed_out:
            return QueryResult(None, f"query timed out after {timeout_ms} ms")
        text = str(exc) or type(exc).__name__
        if "one statement at a time" in text:
            return QueryResult(None, "only one statement is allowed")
        return QueryResult(None, f"sqlite error: {text}")
    finally:
        conn.close()
    if len(rows) > max_rows:
        return QueryResult(None, f"more than {max_rows} rows", columns)
    return QueryResult([tuple(r) for r in rows], None, columns, frozenset(read))


def _has_second_statement(sql: str) -> bool:
    """Whether text follows the first complete statement (``;`` outside strings/comments)."""
    for i, ch in enumerate(sql):
        if ch == ";" and sqlite3.complete_statement(sql[:i + 1]):
            return _strip_comments(sql[i + 1:]) != ""
    return False


def _strip_comments(sql: str) -> str:
    """``sql`` without its leading comments and spaces."""
    previous = None
    while previous != sql:
        previous, sql = sql, _LEADING_COMMENT.sub("", sql, count=1)
    return sql.strip()


def normalise_value(value: Any, decimals: int = 2) -> Any:
    """Numbers compare by value rounded to ``decimals`` (3 == 3.0, 61234.5333 == 61234.53);
    strings lose surrounding spaces; anything else is kept."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        rounded = round(float(value), decimals)
        return 0.0 if rounded == 0 else rounded  # -0.0 and 0.0 alike
    if isinstance(value, str):
        return value.strip()
    return value


def same_result(got: list[tuple[Any, ...]], expected: list[tuple[Any, ...]], ordered: bool,
                decimals: int = 2, any_column_order: bool = True) -> tuple[bool, str]:
    """Whether two result sets match: as multisets of normalised rows (or as sequences when
    ``ordered``), allowing the columns in any order when ``any_column_order``. Returns
    ``(match, reason)``."""
    norm_got = [tuple(normalise_value(v, decimals) for v in row) for row in got]
    norm_exp = [tuple(normalise_value(v, decimals) for v in row) for row in expected]
    width_got = len(norm_got[0]) if norm_got else None
    width_exp = len(norm_exp[0]) if norm_exp else None
    if width_got is not None and width_exp is not None and width_got != width_exp:
        return False, f"{width_got} columns, the reference has {width_exp}"
    if len(norm_got) != len(norm_exp):
        return False, f"{len(norm_got)} rows, the reference has {len(norm_exp)}"
    if not norm_exp:
        return True, "correct"
    width = width_exp or 0
    orders = (itertools.permutations(range(width)) if any_column_order and width <= 5
              else [tuple(range(width))])
    target: Any = norm_exp if ordered else Counter(norm_exp)
    same_rows = False
    for perm in orders:
        shuffled = [tuple(row[i] for i in perm) for row in norm_got]
        if (shuffled if ordered else Counter(shuffled)) == target:
            return True, "correct"
        same_rows = same_rows or Counter(shuffled) == Counter(norm_exp)
    if same_rows:
        return False, "right rows in the wrong order"
    return False, "result differs from the reference"
