"""examples/recipes/trl_grpo.yaml holds TRL's GRPOConfig defaults: read them from the installed
TRL (parity; skipped without it), and check the learning-rate schedule the recipe selects is
TRL's, step by step, on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlmix import cli
from rlmix.testing import load_script

from .conftest import ROOT, read_jsonl

RECIPE = ROOT / "examples" / "recipes" / "trl_grpo.yaml"
BENCH = ROOT / "bench" / "learn_vs_trl.py"
LOSS_TYPE_TO_MODE = {"dapo": "token-mean", "grpo": "seq-mean-token-mean", "bnpo": "token-mean"}


@pytest.mark.parity
def test_recipe_is_trls_grpo_config_defaults(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    from trl import GRPOConfig

    trl = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    r = OmegaConf.load(RECIPE)
    train, sampling, grpo = r.train, r.sampling, r.grpo
    assert train.lr == trl.learning_rate
    assert train.lr_schedule == str(getattr(trl.lr_scheduler_type, "value",
                                            trl.lr_scheduler_type))
    assert train.warmup_steps == trl.warmup_steps and train.weight_decay == trl.weight_decay
    assert (train.adam_beta1, train.adam_beta2) == (trl.adam_beta1, trl.adam_beta2)
    assert trl.adam_epsilon == 1e-8  # torch's AdamW default, which rlmix uses
    assert train.max_grad_norm == trl.max_grad_norm
    assert train.group_size == trl.num_generations
    assert train.prompts_per_step * train.group_size == trl.generation_batch_size
    assert train.grad_accum == trl.gradient_accumulation_steps == trl.steps_per_generation
    assert train.epochs * train.updates_per_epoch == trl.num_iterations
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (
        trl.temperature, trl.top_p, trl.top_k)
    assert sampling.max_new_tokens == trl.max_completion_length
    assert grpo.loss_mode == LOSS_TYPE_TO_MODE[trl.loss_type]
    assert grpo.scale == trl.scale_rewards and grpo.beta == trl.beta
    assert grpo.eps_low == trl.epsilon
    assert grpo.eps_high == (trl.epsilon if trl.epsilon_high is None else trl.epsilon_high)
    assert (r.policy.autocast == "bfloat16") == bool(trl.bf16)
    assert r.policy.gradient_checkpointing == trl.gradient_checkpointing


def test_bench_matches_trl_with_the_recipes_keys() -> None:
    """bench/learn_vs_trl.py's ``rlmix-trl`` config sets exactly this recipe's values."""
    bench = load_script(BENCH)
    recipe = OmegaConf.load(RECIPE)
    for override in bench.TRL_DEFAULTS:
        key, value = override.split("=", 1)
        assert OmegaConf.select(recipe, key) == OmegaConf.create({"v": value}).v \
            or str(OmegaConf.select(recipe, key)) == value \
            or float(OmegaConf.select(recipe, key)) == float(value), override


def test_recipe_decays_the_rate_linearly_on_the_tiny_model(tmp_path: Path) -> None:
    tiny = ["model=tiny-random", "arith.eval_size=4", "train.steps=3", "train.group_size=4",
            "sampling.max_new_tokens=8", "arith.eval_max_new_tokens=4", "log.progress=false",
            "log.plot=false", "train.checkpoint_every=0", "train.eval_every=0",
            f"out={tmp_path}"]
    assert cli.main(["run", str(RECIPE), *tiny]) == 0
    lrs = [row["update/lr"] for row in read_jsonl(tmp_path / "metrics.jsonl")
           if "update/lr" in row]
    assert lrs == pytest.approx([1e-6, 2e-6 / 3, 1e-6 / 3])
