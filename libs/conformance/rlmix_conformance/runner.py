"""Running the kit: ``plan`` (the checks that apply), ``run_check``, ``check_plugin``,
``assert_conformant``."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from rlmix_conformance import checks  # noqa: F401 - registers every check in CHECKS
from rlmix_conformance.batches import _where_raised
from rlmix_conformance.kit import (
    CHECKS,
    LEVELS,
    Check,
    ConformanceFailure,
    NotApplicable,
    Report,
    Result,
    Subject,
)


def plan(subject: Subject, level: str = "quick") -> list[Check]:
    """The checks that apply to ``subject`` at ``level``."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}")
    levels = LEVELS[:LEVELS.index(level) + 1]
    out = []
    for chk in CHECKS:
        if chk.level not in levels:
            continue
        if chk.hook and not subject.implements(chk.hook):
            continue
        if chk.hook and chk.owner_only and not subject.owns(chk.hook):
            continue
        out.append(chk)
    return out


def run_check(subject: Subject, chk: Check) -> Result:
    start = time.perf_counter()
    if subject.load_error:
        return Result(subject.name, chk.id, False, subject.load_error)
    if chk.needs_run and chk.id != "plugin/configure" and subject.cache.get("configure_error"):
        return Result(subject.name, chk.id, True, "not run: no run configures with this plugin "
                      "(see plugin/configure)", skipped=True)
    py_state = random.getstate()  # runs seed the global RNGs: leave the caller's as they were
    try:
        with torch.random.fork_rng():
            chk.fn(subject)
    except NotApplicable as exc:
        return Result(subject.name, chk.id, True, str(exc), skipped=True,
                      seconds=time.perf_counter() - start)
    except ConformanceFailure as exc:
        return Result(subject.name, chk.id, False, str(exc),
                      seconds=time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - the plugin's own error, reported with its place
        hook = chk.hook or "the plugin"
        return Result(subject.name, chk.id, False,
                      f"{hook} raised {type(exc).__name__}: {exc}{_where_raised(exc, subject)}",
                      seconds=time.perf_counter() - start)
    finally:
        random.setstate(py_state)
    return Result(subject.name, chk.id, True, seconds=time.perf_counter() - start)


def check_plugin(name: str, obj: Any = None, level: str = "quick") -> Report:
    """Run every applicable check on plugin ``name`` (installed, or ``obj`` in this process)."""
    subject = Subject(name, obj)
    report = Report(name)
    try:
        if subject.load_error:
            report.results.append(Result(name, "plugin/registers", False, subject.load_error))
            return report
        for chk in plan(subject, level):
            report.results.append(run_check(subject, chk))
    finally:
        subject.close()
    return report


def assert_conformant(name: str, obj: Any = None, level: str = "full") -> None:
    """``check_plugin`` that raises ``AssertionError`` listing every failure."""
    report = check_plugin(name, obj, level)
    if not report.ok:
        raise AssertionError(report.format())
