"""Every manifest in examples/ runs end to end on the tiny model (2 steps).

A manifest whose plugins are not installed is skipped with their names, so an environment with
only some plugins (the isolated sessions) still passes."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlmix import cli
from rlmix.testing import skip_unless_installed

from .conftest import ROOT, read_jsonl

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_on_the_tiny_model(path: Path, tmp_path: Path) -> None:
    skip_unless_installed(path)
    wanted = list(OmegaConf.load(path).plugins)
    code = cli.main(["run", str(path), "model=tiny-random", "arith.eval_size=4",
                     "arith.eval_max_new_tokens=6", "sampling.max_new_tokens=6",
                     "train.steps=2", "train.prompts_per_step=2", "train.group_size=4",
                     "train.eval_every=0", "train.checkpoint_every=0", "log.progress=false",
                     "log.plot=false", f"out={tmp_path}"])
    assert code == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    hooks = (tmp_path / "hooks.txt").read_text()
    for name in wanted:  # every listed plugin is registered and shows up somewhere
        assert name in hooks, f"{name} implements no hook in {path.name}"
