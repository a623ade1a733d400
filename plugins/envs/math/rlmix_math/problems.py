"""Where problems come from: a seeded generator of templated word problems (integer and fraction
answers), or the user's JSONL / parquet file, split deterministically into train and held-out."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from rlmix.errors import ConfigError

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kofi",
         "Lena", "Mateo", "Nia", "Omar", "Priya")
ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cards", "shells", "coins")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # as math-verify reads it: "12", "3/4", "-5"
    steps: int = 0  # the curriculum's level (1 or 2 operations); 0 for other sources


def format_answer(value: Fraction | int) -> str:
    """An exact answer as text: integers plainly, other rationals as ``p/q`` in lowest terms."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}"


def _more(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 90), rng.randint(2, 90)
    return Problem(f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have "
                   "now?", format_answer(a + b))


def _left(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(20, 150)
    b = rng.randint(1, a - 1)
    return Problem(f"{name} had {a} {item} and gave away {b}. How many {item} are left?",
                   format_answer(a - b))


def _rate(rng: random.Random) -> Problem:
    a, d = rng.randint(3, 40), rng.randint(2, 12)
    return Problem(f"A baker makes {a} loaves of bread every day. How many loaves does the baker "
                   f"make in {d} days?", format_answer(a * d))


def _share(rng: random.Random) -> Problem:
    n = rng.randint(2, 9)
    m = rng.randint(1, 12)
    return Problem(f"{n} friends share {m} pizzas equally. How many pizzas does each friend get? "
                   "Give an exact fraction if needed.", format_answer(Fraction(m, n)))


def _fraction_of(rng: random.Random) -> Problem:
    q = rng.choice((2, 3, 4, 5, 6, 8, 10))
    p = rng.randint(1, q - 1)
    c = rng.randint(2, 30) * rng.choice((1, q))
    return Problem(f"A tank holds {c} liters and is {p}/{q} full. How many liters of water are "
                   "in the tank?", format_answer(Fraction(c * p, q)))


def _hours(rng: random.Random) -> Problem:
    h = rng.randint(1, 23)
    return Problem(f"What fraction of a day is {h} hours? Answer in lowest terms.",
                   format_answer(Fraction(h, 24)))


def _discount(rng: random.Random) -> Problem:
    price = rng.randint(4, 200)
    off = rng.choice((10, 20, 25, 50, 75))
    return Problem(f"A jacket costs {price} dollars. It is sold at {off}% off. What is the new "
                   "price in dollars?", format_answer(Fraction(price * (100 - off), 100)))


def _sum_difference(rng: random.Random) -> Problem:
    small, large = sorted(rng.sample(range(1, 80), 2))
    return Problem(f"The sum of two numbers is {small + large} and their difference is "
                   f"{large - small}. What is the larger number?", format_answer(large))


def _temperature(rng: random.Random) -> Problem:
    start, drop = rng.randint(-10, 15), rng.randint(3, 30)
    return Problem(f"The temperature was {start} degrees in the evening and fell by {drop} "
                   "degrees overnight. What was the temperature in the morning?",
                   format_answer(start - drop))


TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (
    _more, _left, _rate, _share, _fraction_of, _hours, _discount, _sum_difference, _temperature)


def generated_problems(seed: int, size: int) -> list[Problem]:
    """``size`` distinct word problems (fewer only if every template runs out), deterministic
    in ``seed``. The templates take turns, so every kind is represented; a template that keeps
    repeating itself (a small space, like the 23 hour fractions) leaves the rotation."""
    rng = random.Random(f"math-generated-{seed}")
    seen: set[str] = set()
    out: list[Problem] = []
    active = list(TEMPLATES)
    misses = dict.fromkeys(active, 0)
    turn = 0
    while len(out) < size and active:
        template = active[turn % len(active)]
        problem = template(rng)
        if problem.question in seen:
            misses[template] += 1
            if misses[template] >= 200:
                active.remove(template)
            continue
        misses[template] = 0
        seen.add(problem.question)
        out.append(problem)
        turn += 1
    return out


def clean_answer(raw: object, marker: str) -> str:
    """A data set's answer field as a final answer: the text after the last ``marker`` (GSM8K
    writes its reasoning, then ``#### 72``) when it occurs, stripped."""
    text = "" if raw is None else str(raw)
    if marker and marker in text:
        text = text.rsplit(marker, 1)[1]
    return text.strip()


def _files(data_files: str) -> list[Path]:
    paths = [Path(p.strip()).expanduser() for p in data_files.split(",") if p.strip()]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ConfigError(f"math.data_files: no such file: {', '.join(missing)}")
    return paths


def file_format(paths: list[Path], data_format: str) -> str:
    if data_format != "auto":
        return data_format
    kinds = {"parquet" if p.suffix.lower() in (".parquet", ".pq") else
             "json" if p.suffix.lower() in (".json", ".jsonl") else "?" for p in paths}
    if len(kinds) != 1 or "?" in kinds:
        names = ", ".join(map(str, paths))
        raise ConfigError(f"math.data_format: cannot tell the format of {names}"
                          " from the extension (.jsonl, .json, .parquet); set math.data_format to "
                          "json or parquet")
    return kinds.pop()


def read_rows(data_files: str, data_format: str = "auto", loader: str = "datasets",
              cache_dir: str | None = None) -> list[dict[str, object]]:
    """The rows of the user's files, in file order. ``loader="datasets"`` goes through
    ``datasets.load_dataset``; ``"builtin"`` reads JSONL with ``json`` and parquet with
    ``pyarrow`` (imported only then)."""
    paths = _files(data_files)
    fmt = file_format(paths, data_format)
    if loader == "datasets":
        import datasets

        ds = datasets.load_dataset(fmt, data_files=[str(p) for p in paths], split="train",
                                   cache_dir=cache_dir)
        return [dict(row) for row in ds]
    rows: list[dict[str, object]] = []
    for path in paths:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            rows.extend(pq.read_table(path).to_pylist())
            continue
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):  # a JSON array
            rows.extend(json.loads(text))
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"math.data_files: {path}:{number} is not JSON: {exc}"
                                      ) from None
    return rows


def rows_to_problems(rows: list[dict[str, object]], question_field: str, answer_field: str,
                     marker: str) -> list[Problem]:
    if rows:
        missing = [f for f in (question_field, answer_field) if f not in rows[0]]
        if missing:
            setting = "question_field" if question_field in missing else "answer_field"
            raise ConfigError(f"math.{setting}: field {missing[0]!r} is not in the data (fields: "
                              f"{', '.join(map(str, rows[0]))})")
    out = []
    seen: set[str] = set()
    for row in rows:
        question = str(row.get(question_field) or "").strip()
        answer = clean_answer(row.get(answer_field), marker)
        # rows without a question or an answer cannot be scored; a repeated question is kept
        # once, so the held-out split never shares a question with training
        if question and answer and question not in seen:
            seen.add(question)
            out.append(Problem(question, answer))
    return out


def split(problems: list[Problem], eval_size: int, seed: int) -> tuple[list[Problem],
                                                                       list[Problem]]:
    """``(train, held_out)``: a seeded permutation; the first ``eval_size`` are held out. The
    same problems and seed always give the same split."""
    if eval_size >= len(problems):
        raise ConfigError(f"math.eval_size: {eval_size} held-out problems leave none of the "
                          f"{len(problems)} to train on; lower it")
    order = list(range(len(problems)))
    random.Random(f"math-split-{seed}").shuffle(order)
    held = sorted(order[:eval_size])
    train = sorted(order[eval_size:])
    return [problems[i] for i in train], [problems[i] for i in held]
