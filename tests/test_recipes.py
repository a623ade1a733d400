"""Every recipe in examples/recipes runs 2 steps on the tiny model, and cites its paper.

A recipe whose plugins are not installed is skipped, naming them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlmix import cli
from rlmix.testing import skip_unless_installed

from .conftest import ROOT, read_jsonl

RECIPES = sorted((ROOT / "examples" / "recipes").glob("*.yaml"))
#: the paper-scale batch and length settings shrunk to seconds on a CPU
TINY = ["model=tiny-random", "arith.eval_size=4", "train.steps=2", "train.prompts_per_step=2",
        "train.group_size=4", "sampling.max_new_tokens=8", "arith.eval_max_new_tokens=4",
        "log.progress=false", "log.plot=false", "train.checkpoint_every=0"]


def test_there_is_a_recipe_per_paper() -> None:
    assert {p.stem for p in RECIPES} >= {"dapo", "dr_grpo", "gspo", "cispo", "gapo", "sat",
                                         "loop", "flow_grpo", "asyncwebrl",
                                         "nemo_rl_speculative", "hrpo"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_cites_its_paper_at_the_top(recipe: Path) -> None:
    head = recipe.read_text().split("\nmodel:")[0]
    assert head.startswith("# "), "the citation comes first"
    assert re.search(r"arXiv:\d{4}\.\d{5}", head) or "shared/seeds" in head, head[:200]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_runs_two_steps_on_the_tiny_model(recipe: Path, tmp_path: Path) -> None:
    skip_unless_installed(recipe)
    names = list(OmegaConf.load(recipe).plugins)
    # the arith overrides only where the recipe runs arith (flow_grpo runs the tools env)
    tiny = [o for o in TINY if not o.startswith("arith.") or "arith" in names]
    if "tools" in names:
        tiny += ["tools.eval_size=4", "tools.eval_max_new_tokens=4"]
    assert cli.main(["run", str(recipe), *tiny, f"out={tmp_path}"]) == 0
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)
    resolved = OmegaConf.load(tmp_path / "manifest.yaml")
    assert list(resolved.plugins) == names
