"""The answer check: the last ``\\boxed{...}`` of a completion against a reference answer with
``math-verify``, under a wall-clock deadline, never raising.

``math-verify`` parses LaTeX and plain expressions into sympy and compares them (fractions,
decimals, equivalent forms). Sympy can be made to run for ever (``\\boxed{9^{9^{9^9}}}``), so the
whole parse-and-compare runs under a deadline of our own (a ``SIGALRM`` interval timer, in the
main thread) with math-verify's own second-granular timers switched off; anything that goes wrong
becomes a ``Verdict`` with ``correct=False`` and a reason.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

_BOX_COMMANDS = ("\\boxed", "\\fbox")


class _DeadlineExceeded(BaseException):
    """Raised by the timer; a BaseException so that math-verify's ``except Exception`` blocks
    cannot swallow it."""


@dataclass
class Verdict:
    """What the verifier found in one completion. ``reason`` is ``"correct"`` when right,
    otherwise why it scored 0."""

    correct: bool
    boxed: str | None  # the content of the last \boxed{...}, None when there is none
    parsed: str | None  # what math-verify extracted from the completion, None when nothing
    reason: str

    def as_info(self, answer: str) -> dict[str, object]:
        return {"answer": answer, "boxed": self.boxed, "parsed": self.parsed,
                "correct": self.correct, "reason": self.reason}


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, or
    None. An unclosed box counts as no box."""
    best: tuple[int, str] | None = None
    for command in _BOX_COMMANDS:
        start = text.rfind(command + "{")
        while start != -1:
            content = _balanced(text, start + len(command))
            if content is not None:
                if best is None or start > best[0]:
                    best = (start, content)
                break
            start = text.rfind(command + "{", 0, start)
    return None if best is None else best[1]


def _balanced(text: str, open_at: int) -> str | None:
    depth = 0
    for i in range(open_at, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i]
    return None


def has_boxed_answer(text: str) -> bool:
    """The ``format`` criterion: a closed ``\\boxed{...}`` with something in it."""
    boxed = last_boxed(text)
    return boxed is not None and boxed.strip() != ""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[bool]:
    """Raise ``_DeadlineExceeded`` after ``seconds`` of wall time. Yields whether a timer is
    armed: signals only work in the main thread, so elsewhere the body runs without one."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield False
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise _DeadlineExceeded

    previous = signal.signal(signal.SIGALRM, on_alarm)
    started = time.monotonic()
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay > 0:  # someone else's timer was running: re-arm what is left of it
            left = max(outer_delay - (time.monotonic() - started), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


def verify_answer(completion: str, answer: str, timeout_s: float = 2.0,
                  max_chars: int = 2000, require_boxed: bool = False) -> Verdict:
    """Is ``completion``'s final answer equal to ``answer``?

    The last ``\\boxed{...}`` is the final answer; without one (unless ``require_boxed``),
    math-verify looks for an answer in the last ``max_chars`` characters. Never raises: a
    timeout, a parse failure or a verifier error scores 0 with the reason."""
    answer = str(answer).strip()
    boxed = last_boxed(completion)
    if not answer:
        return Verdict(False, boxed, None, "no reference answer")
    if boxed is None:
        if require_boxed:
            return Verdict(False, None, None, "no \\boxed{} answer")
        target = completion[-max_chars:]
    elif len(boxed) > max_chars:
        return Verdict(False, boxed[:80], None, f"boxed answer longer than {max_chars} chars")
    else:
        target = "\\boxed{" + boxed + "}"
    if not target.strip():
        return Verdict(False, boxed, None, "empty completion")
    try:
        from math_verify import parse, verify
    except ImportError as exc:  # pragma: no cover - a declared dependency
        return Verdict(False, boxed, None, f"math-verify is not installed: {exc}")
    _quiet_timeout_warning()
    parsed_text: str | None = None
    try:
        with _deadline(timeout_s):
            gold = parse(_as_math(answer), parsing_timeout=None)  # type: ignore[arg-type]
            if not gold:
                return Verdict(False, boxed, None, f"reference answer {answer!r} did not parse")
            pred = parse(target, parsing_timeout=None)  # type: ignore[arg-type]
            if not pred:
                reason = ("could not parse the boxed answer" if boxed is not None
                          else "no answer found")
                return Verdict(False, boxed, None, reason)
            # math-verify returns [sympy expression, extracted string]
            parsed_text = str(pred[-1]) if isinstance(pred[-1], str) else None
            ok = bool(verify(gold, pred, timeout_seconds=None))  # type: ignore[arg-type]
    except _DeadlineExceeded:
        return Verdict(False, boxed, parsed_text, f"verifier timed out after {timeout_s:g}s")
    except RecursionError:
        return Verdict(False, boxed, parsed_text, "verifier error: expression nested too deeply")
    except Exception as exc:  # noqa: BLE001 - any verifier failure scores 0 with its reason
        return Verdict(False, boxed, parsed_text,
                       f"verifier error: {type(exc).__name__}: {str(exc)[:200]}")
    return Verdict(ok, boxed, parsed_text, "correct" if ok else "wrong answer")


def _quiet_timeout_warning() -> None:
    """math-verify warns once that its timers are off; the deadline above replaces them."""
    import math_verify.grader
    import math_verify.parser

    for module in (math_verify.grader, math_verify.parser):
        if hasattr(module, "TIMEOUT_WARNING_SHOWN"):
            module.TIMEOUT_WARNING_SHOWN = True


def _as_math(answer: str) -> str:
    """A reference answer as math-verify reads it best: LaTeX in ``$...$`` unless it already is
    delimited or boxed."""
    if answer.startswith("$") or "\\boxed" in answer or "\\(" in answer:
        return answer
    return f"${answer}$"
