"""The generated curriculum (``math.source: curriculum``): one- and two-step word problems.

Each template draws its numbers from a seeded generator and computes the answer exactly (every
answer is a non-negative integer: shares divide evenly, change is never negative). One-step
problems take one operation (``a + b``, ``a - b``, ``a * b``, ``a / b``); two-step problems
chain two (``a + b - c``, ``B - k * p``, ``a / n - e``). ``max_number`` bounds the operands,
so the curriculum's easy end is small numbers and one step.

The worked example that curriculum prompts show (:data:`EXAMPLE`) uses a name and an item no
template uses (Zara, kites), so it is never one of the problems.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from rlmix_math.problems import ITEMS, NAMES, Problem

Template = Callable[[random.Random, int], tuple[str, int]]


def _n(rng: random.Random, top: int, low: int = 2) -> int:
    return rng.randint(low, max(low, top))


# ------------------------------------------------------------------------------- one step


def _gets_more(rng: random.Random, top: int) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = _n(rng, top), _n(rng, top)
    return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b


def _gives_away(rng: random.Random, top: int) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a = _n(rng, top, 3)
    b = rng.randint(1, a - 1)
    return (f"{name} had {a} {item} and gave {b} of them away. How many {item} does {name} have "
            "left?", a - b)


def _boxes(rng: random.Random, top: int) -> tuple[str, int]:
    item = rng.choice(ITEMS)
    k, n = _n(rng, min(top, 10)), _n(rng, top)
    return f"There are {k} boxes with {n} {item} in each box. How many {item} are there?", k * n


def _share(rng: random.Random, top: int) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    n, each = _n(rng, min(top, 10)), _n(rng, top, 1)
    return (f"{name} shares {n * each} {item} equally among {n} friends. How many {item} does "
            "each friend get?", each)


def _pages(rng: random.Random, top: int) -> tuple[str, int]:
    name = rng.choice(NAMES)
    p, d = _n(rng, top), _n(rng, min(top, 10))
    return f"{name} reads {p} pages every day. How many pages does {name} read in {d} days?", p * d


def _change(rng: random.Random, top: int) -> tuple[str, int]:
    name = rng.choice(NAMES)
    price = _n(rng, top, 1)
    paid = price + rng.randint(1, max(1, top))
    return (f"A toy costs {price} dollars. {name} pays with {paid} dollars. How much change does "
            f"{name} get, in dollars?", paid - price)


def _together(rng: random.Random, top: int) -> tuple[str, int]:
    a, b = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    x, y = _n(rng, top), _n(rng, top)
    return f"{a} has {x} {item} and {b} has {y} {item}. How many {item} do they have together?", \
        x + y


# ------------------------------------------------------------------------------- two steps


def _buys_then_gives(rng: random.Random, top: int) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = _n(rng, top), _n(rng, top)
    c = rng.randint(1, a + b - 1)
    return (f"{name} has {a} {item}, buys {b} more and then gives {c} away. How many {item} does "
            f"{name} have now?", a + b - c)


def _bags_minus(rng: random.Random, top: int) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    k, n = _n(rng, min(top, 10)), _n(rng, top)
    e = rng.randint(1, k * n - 1)
    return (f"{name} has {k} bags with {n} {item} in each bag and loses {e} {item}. How many "
            f"{item} does {name} have left?", k * n - e)


def _shopping(rng: random.Random, top: int) -> tuple[str, int]:
    name = rng.choice(NAMES)
    k, p = _n(rng, min(top, 10)), _n(rng, min(top, 15), 1)
    bill = k * p + rng.randint(0, max(1, top))
    return (f"{name} buys {k} pens at {p} dollars each and pays with {bill} dollars. How much "
            f"change does {name} get, in dollars?", bill - k * p)


def _share_then_eat(rng: random.Random, top: int) -> tuple[str, int]:
    item = rng.choice(ITEMS)
    n, each = _n(rng, min(top, 10)), _n(rng, top)
    e = rng.randint(1, each - 1)
    return (f"{n * each} {item} are shared equally among {n} children, and then each child gives "
            f"{e} of them to a teacher. How many {item} does each child have left?", each - e)


def _more_than(rng: random.Random, top: int) -> tuple[str, int]:
    a, b = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    x, more = _n(rng, top), _n(rng, top, 1)
    return (f"{a} has {x} {item}. {b} has {more} more {item} than {a}. How many {item} do they "
            "have together?", 2 * x + more)


def _pages_left(rng: random.Random, top: int) -> tuple[str, int]:
    name = rng.choice(NAMES)
    p, d = _n(rng, top), _n(rng, min(top, 10))
    total = p * d + rng.randint(1, max(1, 5 * top))
    return (f"A book has {total} pages. {name} reads {p} pages a day for {d} days. How many pages "
            "are left to read?", total - p * d)


def _saves(rng: random.Random, top: int) -> tuple[str, int]:
    name = rng.choice(NAMES)
    w, k = _n(rng, top), _n(rng, min(top, 10))
    s = rng.randint(1, w * k - 1)
    return (f"{name} saves {w} dollars every week for {k} weeks and then spends {s} dollars. How "
            "many dollars are left?", w * k - s)


ONE_STEP: tuple[Template, ...] = (_gets_more, _gives_away, _boxes, _share, _pages, _change,
                                  _together)
TWO_STEP: tuple[Template, ...] = (_buys_then_gives, _bags_minus, _shopping, _share_then_eat,
                                  _more_than, _pages_left, _saves)

#: the worked example curriculum prompts show, as (question, the assistant's reply)
EXAMPLE = ("Zara has 3 kites, buys 4 more and then gives 2 away. How many kites does Zara have "
           "now?", "Zara has 3 + 4 = 7 kites, then 7 - 2 = 5. The answer is \\boxed{5}.")


def curriculum_problems(seed: int, size: int, levels: tuple[int, ...] = (1, 2),
                        max_number: int = 20) -> list[Problem]:
    """``size`` distinct problems (fewer only if the templates run out), deterministic in the
    arguments: the levels' templates take turns, so each level and template is represented."""
    rng = random.Random(f"math-curriculum-{seed}-{max_number}")
    active = [(level, t) for level in levels for t in (ONE_STEP if level == 1 else TWO_STEP)]
    seen: set[str] = set()
    misses = dict.fromkeys(active, 0)
    out: list[Problem] = []
    turn = 0
    while len(out) < size and active:
        level, template = active[turn % len(active)]
        question, answer = template(rng, max_number)
        if question in seen:
            misses[(level, template)] += 1
            if misses[(level, template)] >= 200:  # its space is used up
                active.remove((level, template))
            continue
        misses[(level, template)] = 0
        seen.add(question)
        out.append(Problem(question, str(answer), level))
        turn += 1
    return out
