"""``rlmix plugins --check [NAME ...] [--level quick|full] [--json]``: the report the core's CLI
prints, made here (the core calls ``check_plugins`` when this distribution is installed)."""

from __future__ import annotations

import difflib
import json
import time
from typing import Any

from rlmix.errors import RlmixError


def check_plugins(found: dict[str, Any], names: list[str], level: str, as_json: bool) -> int:
    """The kit over the named (default: every installed, ``rlmix.plugins.installed()``)
    plugins: a pass/fail table, each failure's message below it; exit 1 on any failure."""
    try:
        import pytest  # noqa: F401 - the conformance kit is a pytest plugin
    except ImportError:
        raise RlmixError("plugins --check runs the conformance kit, which needs pytest: "
                         "pip install 'rlmix[test]' (or pip install pytest)") from None
    from rlmix_conformance.runner import check_plugin

    unknown = [n for n in names if n not in found]
    if unknown:
        close = difflib.get_close_matches(unknown[0], found, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise RlmixError(f"plugins --check: no installed plugin named "
                         f"{', '.join(repr(u) for u in unknown)}{hint}; installed: "
                         f"{', '.join(sorted(found)) or 'none'}")
    chosen = sorted(names or found, key=lambda n: (found[n].family, n))
    reports = []
    for name in chosen:
        started = time.perf_counter()
        report = check_plugin(name, level=level)
        reports.append((name, report, time.perf_counter() - started))
    failed = [r for _, r, _ in reports if not r.ok]
    if as_json:
        print(json.dumps([{"name": name, "family": found[name].family, "ok": r.ok,
                           "seconds": round(sec, 2),
                           "checks": [{"check": x.check, "ok": x.ok, "skipped": x.skipped,
                                       "message": x.message} for x in r.results]}
                          for name, r, sec in reports], indent=1))
        return 1 if failed else 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"rlmix conformance ({level} checks)")
    for col in ("family", "name", "result", "checks", "seconds", "first failure"):
        table.add_column(col)
    for name, r, sec in reports:
        passed = sum(x.ok and not x.skipped for x in r.results)
        skipped = sum(x.skipped for x in r.results)
        result = "pass" if r.ok else "FAIL"
        first = r.failures[0] if r.failures else None
        counts = f"{passed} passed" + (f", {len(r.failures)} failed" if r.failures else "") \
            + (f", {skipped} skipped" if skipped else "")
        table.add_row(found[name].family.removeprefix("rlmix."), name, result, counts,
                      f"{sec:.1f}",
                      escape(f"{first.check}: {first.message}") if first else "")
    console = Console(width=160)
    console.print(table)
    for _, r, _ in reports:
        if not r.ok:
            console.print(escape(r.format()), soft_wrap=True)
    summary = (f"{len(reports) - len(failed)} of {len(reports)} plugins pass" +
               (f"; failing: {', '.join(r.plugin for r in failed)}" if failed else ""))
    print(summary)
    return 1 if failed else 0
