"""The easy setting of the code env (``code.data: easy``): small generated functions.

Each problem is a one-line transformation of an int, a string or a list (``return x + 3``,
``return s[::-1]``, ``return max(xs)``), written HumanEval's way: a signature and a docstring
with one doctest, a canonical solution, and asserts as tests (each one test, so ``pass_rate``
gives partial credit). A family with a constant (``add_{k}``) gives one problem per constant;
problems are distinct by (family, constant), so the seeded train / held-out split of
``rlmix_code.split`` never shares a function between the two. Test inputs are drawn from a
generator seeded by the problem's id, and the expected values come from the canonical solution
run here (it is our code, not the model's). Verification is the env's own: the split path, the
same verdict rules and red team as HumanEval.

The worked example easy prompts show (:data:`EXAMPLE_PROMPT`) is a function no family
generates (``shout``), so it gives away no problem.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

WORDS = ("apple", "level", "banana", "kiwi", "rotor", "python", "cat", "moon", "tree",
         "river", "stone", "noon", "garden", "yellow", "zebra", "orbit", "hello", "radar",
         "piano", "tomato", "kayak", "civic", "madam", "lemon", "desk", "fish", "umbrella",
         "ice", "dream", "salad")
LETTERS = "abcdefghilmnoprstuy"
Inputs = Callable[[random.Random, Any], tuple[Any, ...]]


def _int(rng: random.Random, k: Any) -> tuple[Any, ...]:
    return (rng.randint(-20, 40),)


def _near(rng: random.Random, k: Any) -> tuple[Any, ...]:
    """An int close to the constant (so comparisons with it go both ways)."""
    return (k + rng.randint(-6, 6),)


def _pos(rng: random.Random, k: Any) -> tuple[Any, ...]:
    return (rng.randint(0, 60),)


def _multiple_or_not(rng: random.Random, k: Any) -> tuple[Any, ...]:
    return (k * rng.randint(0, 9) + rng.choice((0, 0, 1, k - 1)),)


def _word(rng: random.Random, k: Any) -> tuple[Any, ...]:
    return (rng.choice(WORDS),)


def _word_starting(rng: random.Random, k: Any) -> tuple[Any, ...]:
    word = rng.choice(WORDS)
    return (k + word[1:] if rng.random() < 0.5 else word,)


def _word_ending(rng: random.Random, k: Any) -> tuple[Any, ...]:
    word = rng.choice(WORDS)
    return (word[:-1] + k if rng.random() < 0.5 else word,)


def _word_with(rng: random.Random, k: Any) -> tuple[Any, ...]:
    word = list(rng.choice(WORDS))
    for _ in range(rng.randint(0, 2)):
        word[rng.randrange(len(word))] = k
    return ("".join(word),)


def _long_word(rng: random.Random, k: Any) -> tuple[Any, ...]:
    return (rng.choice([w for w in WORDS if len(w) > 4]),)


def _ints(rng: random.Random, k: Any) -> tuple[Any, ...]:
    return ([rng.randint(-9, 20) for _ in range(rng.randint(1, 6))],)


def _small_ints(rng: random.Random, k: Any) -> tuple[Any, ...]:
    return ([rng.randint(0, 9) for _ in range(rng.randint(2, 7))],)


@dataclass(frozen=True)
class Family:
    name: str  # the function's name; {k} is the constant
    args: str  # the signature's parameters
    returns: str  # its return annotation
    doc: str  # the docstring's sentence; {k} is the constant (quoted with !r for strings)
    body: str  # the canonical body's one line; {k} is the constant
    inputs: Inputs  # one call's arguments, from a generator and the constant
    constants: Sequence[Any] = (None,)
    boundary: bool = False  # one test calls it on the constant itself (x > k at x == k)


def _r(a: int, b: int) -> tuple[int, ...]:
    return tuple(range(a, b + 1))


FAMILIES: tuple[Family, ...] = (
    # integers
    Family("add_{k}", "x: int", "int", "Return x plus {k}.", "return x + {k}", _int, _r(1, 30)),
    Family("subtract_{k}", "x: int", "int", "Return x minus {k}.", "return x - {k}", _int,
           _r(1, 30)),
    Family("times_{k}", "x: int", "int", "Return x multiplied by {k}.", "return x * {k}", _int,
           _r(3, 15)),
    Family("remainder_{k}", "x: int", "int", "Return the remainder of x divided by {k}.",
           "return x % {k}", _pos, _r(2, 12)),
    Family("divide_{k}", "x: int", "int", "Return x divided by {k}, rounded down.",
           "return x // {k}", _pos, _r(2, 12)),
    Family("greater_than_{k}", "x: int", "bool", "Return True if x is greater than {k}, else "
           "False.", "return x > {k}", _near, _r(0, 20), True),
    Family("less_than_{k}", "x: int", "bool", "Return True if x is less than {k}, else False.",
           "return x < {k}", _near, _r(0, 20), True),
    Family("divisible_by_{k}", "x: int", "bool", "Return True if x is divisible by {k}, else "
           "False.", "return x % {k} == 0", _multiple_or_not, _r(2, 12)),
    Family("at_most_{k}", "x: int", "int", "Return the smaller of x and {k}.",
           "return min(x, {k})", _near, _r(0, 15), True),
    Family("at_least_{k}", "x: int", "int", "Return the larger of x and {k}.",
           "return max(x, {k})", _near, _r(0, 15), True),
    Family("subtract_from_{k}", "x: int", "int", "Return {k} minus x.", "return {k} - x", _int,
           _r(1, 30)),
    Family("double_plus_{k}", "x: int", "int", "Return twice x plus {k}.",
           "return 2 * x + {k}", _int, _r(1, 20)),
    Family("square", "x: int", "int", "Return x squared.", "return x * x", _int),
    Family("cube", "x: int", "int", "Return x cubed.", "return x ** 3", _int),
    Family("negate", "x: int", "int", "Return x with its sign flipped.", "return -x", _int),
    Family("absolute", "x: int", "int", "Return the absolute value of x.", "return abs(x)",
           _int),
    Family("is_even", "x: int", "bool", "Return True if x is even, else False.",
           "return x % 2 == 0", _int),
    Family("is_odd", "x: int", "bool", "Return True if x is odd, else False.",
           "return x % 2 == 1", _int),
    Family("last_digit", "x: int", "int", "Return the last digit of x (x is not negative).",
           "return x % 10", _pos),
    # strings
    Family("reverse", "s: str", "str", "Return the string reversed.", "return s[::-1]", _word),
    Family("to_upper", "s: str", "str", "Return the string in upper case.", "return s.upper()",
           _word),
    Family("first_char", "s: str", "str", "Return the first character of the string.",
           "return s[0]", _word),
    Family("last_char", "s: str", "str", "Return the last character of the string.",
           "return s[-1]", _word),
    Family("twice", "s: str", "str", "Return the string written twice.", "return s + s",
           _word),
    Family("length", "s: str", "int", "Return the number of characters in the string.",
           "return len(s)", _word),
    Family("drop_first", "s: str", "str", "Return the string without its first character.",
           "return s[1:]", _word),
    Family("is_palindrome", "s: str", "bool", "Return True if the string reads the same "
           "backwards, else False.", "return s == s[::-1]", _word),
    Family("capitalized", "s: str", "str", "Return the string with its first letter in upper "
           "case.", "return s.capitalize()", _word),
    Family("first_{k}_chars", "s: str", "str", "Return the first {k} characters of the string.",
           "return s[:{k}]", _word, _r(2, 6)),
    Family("last_{k}_chars", "s: str", "str", "Return the last {k} characters of the string.",
           "return s[-{k}:]", _word, _r(2, 6)),
    Family("repeat_{k}", "s: str", "str", "Return the string repeated {k} times.",
           "return s * {k}", _word, _r(3, 6)),
    Family("count_{k}", "s: str", "int", "Return how many times the letter {k!r} occurs in the "
           "string.", "return s.count({k!r})", _word_with, tuple(LETTERS)),
    Family("starts_with_{k}", "s: str", "bool", "Return True if the string starts with the "
           "letter {k!r}, else False.", "return s.startswith({k!r})", _word_starting,
           tuple(LETTERS)),
    Family("ends_with_{k}", "s: str", "bool", "Return True if the string ends with the letter "
           "{k!r}, else False.", "return s.endswith({k!r})", _word_ending, tuple(LETTERS)),
    Family("char_at_{k}", "s: str", "str", "Return the character at index {k} of the string "
           "(the first character has index 0).", "return s[{k}]", _long_word, _r(1, 3)),
    Family("add_suffix_{k}", "s: str", "str", "Return the string followed by {k!r}.",
           "return s + {k!r}", _word, ("s", "ed", "ing", "er", "ly")),
    Family("add_prefix_{k}", "s: str", "str", "Return {k!r} followed by the string.",
           "return {k!r} + s", _word, ("un", "re", "pre")),
    # lists
    Family("largest", "xs: list", "int", "Return the largest number in the list.",
           "return max(xs)", _ints),
    Family("smallest", "xs: list", "int", "Return the smallest number in the list.",
           "return min(xs)", _ints),
    Family("total", "xs: list", "int", "Return the sum of the numbers in the list.",
           "return sum(xs)", _ints),
    Family("count_items", "xs: list", "int", "Return the number of items in the list.",
           "return len(xs)", _ints),
    Family("first_item", "xs: list", "int", "Return the first item of the list.",
           "return xs[0]", _ints),
    Family("last_item", "xs: list", "int", "Return the last item of the list.",
           "return xs[-1]", _ints),
    Family("sorted_list", "xs: list", "list", "Return the list sorted from smallest to largest.",
           "return sorted(xs)", _ints),
    Family("reversed_list", "xs: list", "list", "Return the list in reverse order.",
           "return xs[::-1]", _ints),
    Family("add_{k}_to_each", "xs: list", "list", "Return a new list with {k} added to each "
           "number.", "return [x + {k} for x in xs]", _ints, _r(1, 15)),
    Family("multiply_each_by_{k}", "xs: list", "list", "Return a new list with each number "
           "multiplied by {k}.", "return [x * {k} for x in xs]", _ints, _r(2, 10)),
    Family("keep_above_{k}", "xs: list", "list", "Return the numbers of the list that are "
           "greater than {k}, in order.", "return [x for x in xs if x > {k}]", _small_ints,
           _r(0, 8)),
    Family("count_of_{k}", "xs: list", "int", "Return how many times {k} occurs in the list.",
           "return xs.count({k})", _small_ints, _r(0, 9)),
    Family("contains_{k}", "xs: list", "bool", "Return True if {k} is in the list, else False.",
           "return {k} in xs", _small_ints, _r(0, 9)),
    Family("count_above_{k}", "xs: list", "int", "Return how many numbers in the list are "
           "greater than {k}.", "return len([x for x in xs if x > {k}])", _small_ints,
           _r(0, 8)),
    Family("drop_{k}_items", "xs: list", "list", "Return the list without its first {k} items.",
           "return xs[{k}:]", _ints, _r(1, 4)),
    Family("first_{k}_items", "xs: list", "list", "Return the first {k} items of the list.",
           "return xs[:{k}]", _ints, _r(1, 5)),
)

#: the worked example easy prompts show, as (problem prompt, the assistant's reply): a function
#: no family generates
EXAMPLE_PROMPT = ('def shout(s: str) -> str:\n    """Return the string followed by an '
                  'exclamation mark.\n\n    >>> shout(\'hi\')\n    \'hi!\'\n    """\n')
EXAMPLE_REPLY = '```python\ndef shout(s: str) -> str:\n    return s + "!"\n```'


def _reference(name: str, args: str, body: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(f"def {name}({args}):\n    {body}\n", namespace)  # our own template, never the model's
    return namespace[name]


@dataclass(frozen=True)
class EasyProblem:
    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    asserts: tuple[str, ...]


def _varied(values: list[Any], tests: int) -> bool:
    """Whether no constant function passes: two distinct expected values at least, and for
    True/False answers at least two of each (when there are 4 or more tests)."""
    if len({repr(v) for v in values}) < 2:
        return False
    if all(isinstance(v, bool) for v in values) and tests >= 4:
        return min(values.count(True), values.count(False)) >= 2
    return True


@lru_cache(maxsize=4)
def easy_problems(tests: int = 5) -> tuple[EasyProblem, ...]:
    """Every easy problem, in a fixed order: one per (family, constant), ``tests`` asserts each
    on distinct inputs whose expected values no constant function gives (``_varied``), and the
    docstring's doctest on one more input."""
    out = []
    for family in FAMILIES:
        for k in family.constants:
            name = family.name.format(k=k)
            ref = _reference(name, family.args, family.body.format(k=k))
            rng = random.Random(f"rlmix-code-easy-{name}")
            for _ in range(500):
                inputs: list[tuple[Any, ...]] = []
                while len(inputs) < tests + 1:
                    if family.boundary and len(inputs) == 1 and (k,) not in inputs:
                        inputs.append((k,))  # the first test: the edge
                        continue
                    args = family.inputs(rng, k)
                    if args not in inputs:
                        inputs.append(args)
                if _varied([ref(*a) for a in inputs[1:]], tests):
                    break
            else:
                raise AssertionError(f"{name}: no varied tests found")  # a bug in a family
            calls = [", ".join(repr(a) for a in args) for args in inputs]
            prompt = (f"def {name}({family.args}) -> {family.returns}:\n"
                      f'    """{family.doc.format(k=k)}\n\n    >>> {name}({calls[0]})\n'
                      f'    {ref(*inputs[0])!r}\n    """\n')
            asserts = tuple(f"assert {name}({c}) == {ref(*a)!r}"
                            for c, a in zip(calls[1:], inputs[1:], strict=True))
            out.append(EasyProblem(f"easy/{name}", prompt, name,
                                   f"    {family.body.format(k=k)}\n", asserts))
    return tuple(out)
