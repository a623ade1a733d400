"""``train.lr_schedule``: the learning-rate multiplier by hand, against Hugging Face's linear
schedule (what TRL's trainers use), in a run's logged ``update/lr``, and in the manifest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlmix import cli, loop, manifest
from rlmix.defaults import lr_scale
from rlmix.errors import ManifestError

from .conftest import EXAMPLE, TINY, read_jsonl


def test_constant_is_flat_after_warm_up() -> None:
    assert [lr_scale(d, 0, "constant", 4) for d in range(4)] == [1.0, 1.0, 1.0, 1.0]
    assert [lr_scale(d, 2, "constant", 4) for d in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_linear_decays_to_zero_at_the_last_step_by_hand() -> None:
    # 4 steps, no warm-up: full rate first, then 3/4, 2/4, 1/4 (the step after the last is 0)
    assert [lr_scale(d, 0, "linear", 4) for d in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    # 2 warm-up steps of 6: 1/2, 1, then (6 - d) / 4 for d = 2..5
    assert [lr_scale(d, 2, "linear", 6) for d in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]


def test_linear_matches_hugging_face_without_warm_up() -> None:
    transformers = pytest.importorskip("transformers")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = transformers.get_linear_schedule_with_warmup(opt, 0, 40)
    theirs = []
    for _ in range(40):
        theirs.append(opt.param_groups[0]["lr"])  # the rate this optimizer step uses
        opt.step()
        sched.step()
    ours = [lr_scale(d, 0, "linear", 40) for d in range(40)]
    assert ours == pytest.approx(theirs, abs=1e-12)
    assert ours[-1] == pytest.approx(1 / 40)


def test_a_run_logs_the_decaying_rate(tmp_path: Path) -> None:
    code = cli.main(["run", str(EXAMPLE), *TINY, "train.steps=4", "train.updates_per_epoch=1",
                     "train.eval_every=0", "train.checkpoint_every=0", "train.lr=0.01",
                     "train.lr_schedule=linear", f"out={tmp_path}"])
    assert code == 0
    lrs = [r["update/lr"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "update/lr" in r]
    assert lrs == pytest.approx([0.01, 0.0075, 0.005, 0.0025])


def test_the_default_stays_constant_and_typos_are_rejected(tmp_path: Path) -> None:
    cfg = manifest.read(EXAMPLE, [*TINY, f"out={tmp_path}"])
    assert manifest.validate_core(cfg).train.lr_schedule == "constant"
    with pytest.raises(ManifestError, match="lr_schedule"):
        loop.prepare(manifest.read(EXAMPLE, [*TINY, "train.lr_schedule=cosine"]))
