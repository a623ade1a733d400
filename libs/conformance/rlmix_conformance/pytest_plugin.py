"""``pytest --rlmix-conformance NAME``: the conformance kit on an installed plugin, as pytest items
(entry point ``pytest11``). It imports pytest only; the kit loads when the option is given."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rlmix", "rlmix plugin conformance")
    group.addoption("--rlmix-conformance", action="append", default=[], metavar="NAME",
                    help="run the rlmix conformance kit against the installed plugin NAME "
                         "(repeat for several)")
    group.addoption("--rlmix-conformance-level", choices=("quick", "full"), default="full",
                    help="quick: the checks of 'rlmix plugins --check'; full (default): also "
                         "seeded re-runs, minibatch splits, accumulation and a resume")


def pytest_configure(config: pytest.Config) -> None:
    """With ``--rlmix-conformance``, collect the kit's parametrized test module (its file name
    does not start with ``test_``; pytest collects a file named on the command line whatever its
    name). Without other paths on the command line, it is the only thing collected."""
    if not config.getoption("rlmix_conformance", default=None):
        return
    suite = str(Path(__file__).with_name("suite.py"))
    source = getattr(config, "args_source", None)
    explicit = source is not None and source == pytest.Config.ArgsSource.ARGS
    if explicit:
        if suite not in config.args:
            config.args.append(suite)
    else:
        config.args = [suite]
