"""The loop end to end on tiny-random: outputs and metric names of DESIGN §5, policy versions,
and the default update's NaN/inf skip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import rlmix
from rlmix import checkpoint, loop, manifest
from rlmix.types import LossTerms, Run

from .conftest import EXAMPLE, TIMINGS, TINY, read_jsonl

TRAINING_KEYS = ("step", "reward/mean", "reward/arith.correct", "reward/arith.format", "loss",
                 "time/step_s", "policy_version")


def test_run_finishes_in_seconds(tiny_run_dir: Path) -> None:
    assert TIMINGS["tiny_run_s"] < 60


def test_run_writes_its_outputs(tiny_run_dir: Path) -> None:
    resolved = OmegaConf.load(tiny_run_dir / "manifest.yaml")
    assert resolved.model == "tiny-random"
    assert list(resolved.plugins) == list(OmegaConf.load(EXAMPLE).plugins)
    assert resolved.train.steps == 4 and resolved.train.updates_per_epoch == 2
    assert resolved.out == str(tiny_run_dir)
    assert resolved.grpo.scale == "group"  # a plugin default, filled in
    assert resolved.arith.eval_size == 8  # an override
    # a value the example file sets and no override touches
    assert resolved.train.lr == pytest.approx(OmegaConf.load(EXAMPLE).train.lr)
    owners = {line.split()[0]: line.split()[1:3]
              for line in (tiny_run_dir / "hooks.txt").read_text().splitlines()}
    for hook, owner in (("rlmix_generate", "hf"), ("rlmix_prompts", "arith"),
                        ("rlmix_advantage", "grpo"), ("rlmix_clip", "grpo"),
                        ("rlmix_update", "rlmix.defaults")):
        assert owners[hook] == ["owner:", owner]
    ckpts = checkpoint.list_checkpoints(tiny_run_dir / "checkpoints")
    assert [p.name for p in ckpts] == ["step-000002", "step-000004"]
    for name in ("reward", "eval"):
        png = tiny_run_dir / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_metrics_have_the_contract_names(tiny_run_dir: Path) -> None:
    rows = read_jsonl(tiny_run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["policy_version"] == 0 and "eval/accuracy" in rows[0]
    for row in rows[1:]:
        for key in TRAINING_KEYS:
            assert key in row, (key, row)
        assert row["time/step_s"] > 0
        assert 0.0 <= row["reward/arith.correct"] <= 1.0
        # score.weights of the example: correct 1.0, format 0.0
        assert row["reward/mean"] == pytest.approx(row["reward/arith.correct"])
        assert row["update/skipped"] == 0.0
    eval_steps = [r["step"] for r in rows if "eval/accuracy" in r]
    assert eval_steps == [0, 2, 4]  # start, every eval_every=2, and the last step
    for row in rows:
        if "eval/accuracy" in row:
            assert 0.0 <= row["eval/accuracy"] <= 1.0


def test_policy_version_counts_optimizer_steps(tiny_run_dir: Path) -> None:
    rows = read_jsonl(tiny_run_dir / "metrics.jsonl")
    # updates_per_epoch=2: two optimizer steps per training step
    assert [r["policy_version"] for r in rows] == [0, 2, 4, 6, 8]


# -- the default update skips a non-finite loss ---------------------------------------------


def _bad_loss(kind: str, only_index: int | None = None) -> type:
    value = {"nan": float("nan"), "inf": float("inf")}[kind]

    class BadLoss:
        """Owns rlmix_clip (listed after grpo) and returns a non-finite loss."""

        @rlmix.hookimpl
        def rlmix_clip(self, run, mb, logp, entropy):  # noqa: ANN001, ANN201
            mask = mb.batch.completion_mask
            loss = -logp
            if only_index is None or mb.index == only_index:
                loss = loss * value
            return LossTerms(loss=loss, mask=mask, mode="token-mean")

    return BadLoss


def _run(tmp_path: Path, extra: dict[str, type], *overrides: str) -> Run:
    names = ["hf", "arith", "grpo", *extra]
    cfg = manifest.read(EXAMPLE, [*TINY, f"out={tmp_path}", f"plugins=[{','.join(names)}]",
                                  "train.prompts_per_step=1", "train.group_size=4",
                                  "train.lr=0.01", *overrides])
    return loop.build_run(cfg, extra_plugins=extra)


def _weights(run: Run) -> dict[str, torch.Tensor]:
    assert run.policy is not None
    return {k: v.detach().clone() for k, v in run.policy.model.state_dict().items()}


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_update_skips_a_non_finite_loss(tmp_path: Path, kind: str) -> None:
    run = _run(tmp_path, {"bad": _bad_loss(kind)})
    before = _weights(run)
    metrics = loop.train_step(run)
    after = _weights(run)
    for k, v in before.items():
        assert torch.equal(after[k], v), k  # bitwise unchanged
    assert run.policy_version == 0
    assert metrics["policy_version"] == 0
    assert metrics["update/skipped"] == 1
    assert run.state["rlmix.defaults"]["skipped_steps"] == 1
    assert run.state["rlmix.defaults"]["optimizer_steps"] == 0
    assert run.step == 1


def test_one_bad_minibatch_skips_the_whole_update(tmp_path: Path) -> None:
    """With accumulation, the finite minibatch's gradient must not be applied either."""
    run = _run(tmp_path, {"bad": _bad_loss("nan", only_index=1)}, "train.grad_accum=2")
    before = _weights(run)
    metrics = loop.train_step(run)
    for k, v in _weights(run).items():
        assert torch.equal(before[k], v), k
    assert run.policy_version == 0 and metrics["update/skipped"] == 1


def test_finite_loss_steps_and_changes_weights(tmp_path: Path) -> None:
    """The control: the same loss, finite, moves the weights and bumps policy_version."""
    run = _run(tmp_path, {"good": _bad_loss("nan", only_index=-1)})
    before = _weights(run)
    metrics = loop.train_step(run)
    assert metrics["update/skipped"] == 0
    assert run.policy_version == 1 and metrics["policy_version"] == 1
    assert any(not torch.equal(before[k], v) for k, v in _weights(run).items())


def test_tensorboard_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """log.tensorboard writes event files; the run ends by printing eval before -> after."""
    pytest.importorskip("tensorboard")
    from rlmix import cli

    out = tmp_path / "tb"
    code = cli.main(["run", str(EXAMPLE), *TINY, "train.steps=2", "train.eval_every=0",
                     "log.tensorboard=true", f"out={out}"])
    assert code == 0
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    printed = capsys.readouterr().out
    assert "eval/accuracy:" in printed and "(step 0) ->" in printed and "(step 2)" in printed


def test_default_optimizer_is_fused_adamw_with_the_per_tensor_update():
    from rlmix.defaults import adamw

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(50, 7)), torch.nn.Parameter(torch.randn(3))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    fused = adamw(a, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"] is True
    for _ in range(3):
        grads = [torch.randn_like(p) for p in a]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        plain.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert not torch.equal(p.detach(), torch.zeros_like(p))


def test_run_end_is_called_once_after_the_last_step_and_on_a_crash(tmp_path):
    calls: list[tuple[str, int]] = []

    class Closer:
        @rlmix.hookimpl
        def rlmix_run_end(self, run):
            calls.append(("end", run.step))

    class Crash:
        @rlmix.hookimpl
        def rlmix_step_end(self, run, metrics):
            if run.step == 2:
                raise RuntimeError("boom")

    run = _run(tmp_path / "ok", {"closer": Closer()}, "train.steps=2", "train.eval_every=0")
    loop.train(run)
    assert calls == [("end", 2)]
    calls.clear()
    run = _run(tmp_path / "crash", {"closer": Closer(), "crash": Crash()}, "train.steps=4",
               "train.eval_every=0")
    with pytest.raises(RuntimeError, match="boom"):
        loop.train(run)
    assert calls == [("end", 2)]


def test_plugins_report_metrics_through_run_log(tmp_path):
    """``run.log`` from any hook (the advantage wrapper, the evaluator, step_end) lands in that
    step's metrics line, and nothing leaks into the next step's line."""

    class Logger:
        @rlmix.hookimpl(hookwrapper=True)
        def rlmix_advantage(self, run, batch):
            run.log("probe/rows", len(batch) + 100 * run.step)
            yield

        @rlmix.hookimpl
        def rlmix_evaluate(self, run):
            if run.step == 2:
                run.log("probe/evaluated", 1.0)
            return {}

        @rlmix.hookimpl
        def rlmix_step_end(self, run, metrics):
            run.log("probe/ended", run.step)

    run = _run(tmp_path / "run", {"probe": Logger()}, "train.steps=3", "train.eval_every=2")
    loop.train(run)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    n = 1 * 4  # prompts_per_step x group_size of _run's manifest
    assert [r["probe/rows"] for r in rows] == [n + 100 * s for s in range(3)]
    assert [("probe/evaluated" in r) for r in rows] == [False, True, False]
    assert [r["probe/ended"] for r in rows] == [1, 2, 3]  # logged in step_end: the same line
