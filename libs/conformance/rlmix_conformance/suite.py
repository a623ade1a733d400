"""The conformance kit as pytest items: ``pytest --rlmix-conformance NAME``.

``rlmix_conformance.pytest_plugin`` adds this file to the paths pytest collects when the option
is given; each applicable check of ``rlmix_conformance`` becomes one test, named
``test_conformance[NAME:<hook>/<check>]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import rlmix_conformance as conformance

_SUBJECTS: dict[str, conformance.Subject] = {}


def _subject(name: str) -> conformance.Subject:
    if name not in _SUBJECTS:
        _SUBJECTS[name] = conformance.Subject(name)
    return _SUBJECTS[name]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "rlmix_check" not in metafunc.fixturenames:
        return
    names = metafunc.config.getoption("rlmix_conformance") or []
    level = metafunc.config.getoption("rlmix_conformance_level") or "full"
    params: list[Any] = []
    for name in names:
        subject = _subject(name)
        if subject.load_error:
            params.append(pytest.param((name, None), id=f"{name}:plugin/registers"))
            continue
        for chk in conformance.plan(subject, level):
            params.append(pytest.param((name, chk), id=f"{name}:{chk.id}"))
    metafunc.parametrize("rlmix_check", params)


@pytest.fixture(scope="module", autouse=True)
def _close_subjects() -> Iterator[None]:
    yield
    for subject in _SUBJECTS.values():
        subject.close()
    _SUBJECTS.clear()


def test_conformance(rlmix_check: tuple[str, conformance.Check | None]) -> None:
    name, chk = rlmix_check
    subject = _subject(name)
    if chk is None:
        pytest.fail(subject.load_error or f"plugin '{name}' could not be loaded", pytrace=False)
    result = conformance.run_check(subject, chk)
    if result.skipped:
        pytest.skip(result.message)
    if not result.ok:
        pytest.fail(f"{chk.id}: {result.message}", pytrace=False)
