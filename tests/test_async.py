"""Async sampling (``train.max_staleness``): exactness in lock-step, the staleness bound under a
slow trainer and a slow sampler, weights never half-updated, clean shutdown on either side's
failure, checkpoints and resume."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import rlmix
from rlmix import async_sampling, checkpoint, loop, manifest
from rlmix.errors import ManifestError
from rlmix.types import Run

from .conftest import EXAMPLE, TINY, read_jsonl


class EvenTokens:
    """A reward that varies on a random model (the share of even token ids in the completion),
    so advantages are non-zero and every update really changes the weights."""

    @rlmix.hookimpl
    def rlmix_score(self, run: Run, batch: Any) -> dict[str, torch.Tensor]:
        even = ((batch.tokens % 2) == 0).float() * batch.completion_mask
        return {"even": even.sum(-1) / batch.completion_mask.sum(-1).clamp(min=1)}


class Delay:
    """Sleeps in the trainer (around rlmix_update) or in the sampler (around rlmix_sample)."""

    def __init__(self, update_s: float = 0.0, sample_s: float = 0.0) -> None:
        self.update_s, self.sample_s = update_s, sample_s

    @rlmix.hookimpl(wrapper=True)
    def rlmix_update(self, run: Run, loss: Any) -> Any:
        time.sleep(self.update_s)
        return (yield)

    @rlmix.hookimpl(wrapper=True)
    def rlmix_sample(self, run: Run, prompts: Any) -> Any:
        time.sleep(self.sample_s)
        return (yield)


class SlowTrainer:
    """The slowest trainer there can be, deterministically: each step, before its first update,
    waits until the worker has sampled as far ahead as the bound allows (so the batches it
    trains later were sampled with the oldest allowed weights). Waits outside rlmix_update, so
    the worker never waits for the weights lock."""

    @rlmix.hookimpl(wrapper=True)
    def rlmix_advantage(self, run: Run, batch: Any) -> Any:
        sampler = run.async_sampler
        if sampler is not None:
            target = min(run.step + sampler.lead, sampler.last_step - 1)
            deadline = time.monotonic() + 60
            while (sampler._next_step <= target and sampler.alive
                   and time.monotonic() < deadline):
                time.sleep(0.01)
            assert sampler._next_step > target, "the worker did not run ahead"
        return (yield)


def _checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


class WeightWitness:
    """Records the trainer's weights after every update (per version) and the weights and
    version each generation call used."""

    def __init__(self) -> None:
        self.trainer: dict[int, float] = {}
        self.sampler: list[tuple[int, float, int]] = []  # (version, checksum, step)

    @rlmix.hookimpl(wrapper=True)
    def rlmix_update(self, run: Run, loss: Any) -> Any:
        if not self.trainer:
            self.trainer[run.policy_version] = _checksum(run.policy.model)
        stats = yield
        self.trainer[run.policy_version] = _checksum(run.policy.model)
        return stats

    @rlmix.hookimpl(wrapper=True)
    def rlmix_sample(self, run: Run, prompts: Any) -> Any:
        self.sampler.append((run.policy_version, _checksum(run.policy.model), run.step))
        batch = yield
        assert bool((batch.policy_version == run.policy_version).all())
        return batch


class FailAt:
    """Raises ``exc`` in the sampler (rlmix_sample) or the trainer (rlmix_step_end) at a step."""

    def __init__(self, where: str, step: int, exc: BaseException) -> None:
        self.where, self.step, self.exc = where, step, exc

    @rlmix.hookimpl(wrapper=True)
    def rlmix_sample(self, run: Run, prompts: Any) -> Any:
        if self.where == "sampler" and run.step == self.step:
            raise self.exc
        return (yield)

    @rlmix.hookimpl
    def rlmix_step_end(self, run: Run, metrics: Any) -> None:
        if self.where == "trainer" and run.step == self.step:
            raise self.exc


def _build(tmp_path: Path, extra: dict[str, Any] | None = None, *overrides: str,
           resume: bool = False) -> Run:
    extra = {"even": EvenTokens(), **(extra or {})}
    names = ["hf", "arith", "grpo", *extra]
    cfg = manifest.read(EXAMPLE, [*TINY, f"out={tmp_path}", f"plugins=[{','.join(names)}]",
                                  "train.prompts_per_step=2", "train.group_size=4",
                                  "train.lr=0.01", "train.steps=4", "train.eval_every=0",
                                  "train.checkpoint_every=0", "log.plot=false",
                                  "arith.eval_size=4", *overrides])
    # a resume leaves the failing plugin out: a changed manifest, allowed on purpose
    return loop.build_run(cfg, extra_plugins=extra, resume=resume, allow_changes=resume)


def _no_worker_left() -> bool:
    return not any(t.name == async_sampling.THREAD_NAME for t in threading.enumerate())


def _rows(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]


def _comparable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith("time/")}


def test_lock_step_worker_reproduces_the_synchronous_loop(tmp_path: Path) -> None:
    """max_staleness=0 is the synchronous loop; the threaded machinery held to lead 0 (own
    weight copy, run views, version tags) gives exactly the same metrics and weights."""
    sync = _build(tmp_path / "sync", None, "train.seed=3")
    loop.train(sync)
    assert _no_worker_left()
    threaded = _build(tmp_path / "threaded", None, "train.seed=3")
    sampler = async_sampling.start(threaded, max_staleness=0)
    try:
        loop.train(threaded)
    finally:
        async_sampling.stop(threaded)
    assert sampler.stats["weight_syncs"] >= 4  # it really sampled from its own refreshed copy
    a, b = _rows(tmp_path / "sync"), _rows(tmp_path / "threaded")
    assert len(a) == 4 and [_comparable(r) for r in a] == [_comparable(r) for r in b]
    assert all(r["staleness/max"] == 0 for r in a)
    assert a[-1]["policy_version"] == 4
    assert len({r["reward/mean"] for r in a}) > 1
    for (name, p), q in zip(sync.policy.model.named_parameters(),
                            threaded.policy.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert _no_worker_left()


@pytest.mark.parametrize("k,updates", [(2, 1), (2, 2), (3, 2)])
def test_staleness_bound_under_a_slow_trainer(tmp_path: Path, k: int, updates: int) -> None:
    """The sampler is fast and the trainer slow: the worker runs as far ahead as allowed and
    never further. Staleness reaches the bound's largest multiple of the versions per step."""
    witness = WeightWitness()
    run = _build(tmp_path, {"slow": SlowTrainer(), "delay": Delay(update_s=0.05),
                            "witness": witness},
                 f"train.max_staleness={k}", f"train.updates_per_epoch={updates}",
                 "train.steps=6")
    loop.train(run)
    rows = _rows(tmp_path)
    assert len(rows) == 6
    stale = [r["staleness/max"] for r in rows]
    assert max(stale) <= k
    assert max(stale) == (k // updates) * updates  # it did run ahead
    assert all(r["staleness/mean"] <= r["staleness/max"] for r in rows)
    # every generation call used exactly the trainer's weights of the version it claims
    for version, digest, _ in witness.sampler:
        assert digest == witness.trainer[version]
    assert len(set(witness.trainer.values())) == len(witness.trainer)  # every update moved them
    assert _no_worker_left()


def test_staleness_bound_under_a_slow_sampler(tmp_path: Path) -> None:
    witness = WeightWitness()
    run = _build(tmp_path, {"delay": Delay(sample_s=0.2), "witness": witness},
                 "train.max_staleness=1", "train.steps=5")
    loop.train(run)
    rows = _rows(tmp_path)
    assert len(rows) == 5 and all(r["staleness/max"] <= 1 for r in rows)
    assert [s for _, _, s in witness.sampler] == [0, 1, 2, 3, 4]  # step order
    for version, digest, _ in witness.sampler:
        assert digest == witness.trainer[version]
    assert _no_worker_left()


def test_staleness_reaches_the_losses(tmp_path: Path) -> None:
    """Losses read staleness as run.policy_version - batch.policy_version."""
    seen: list[int] = []

    class Reader:
        @rlmix.hookimpl(wrapper=True)
        def rlmix_clip(self, run: Run, mb: Any, logp: Any, entropy: Any) -> Any:
            seen.append(int((run.policy_version - mb.batch.policy_version).max()))
            return (yield)

    run = _build(tmp_path, {"slow": SlowTrainer(), "reader": Reader()},
                 "train.max_staleness=1", "train.steps=4")
    loop.train(run)
    assert seen == [r["staleness/max"] for r in _rows(tmp_path)]
    assert max(seen) == 1


def test_a_sampler_exception_stops_the_run(tmp_path: Path) -> None:
    boom = ValueError("sampler exploded")
    run = _build(tmp_path, {"fail": FailAt("sampler", 2, boom)}, "train.max_staleness=1",
                 "train.steps=6")
    start = time.perf_counter()
    with pytest.raises(async_sampling.AsyncSamplingError, match="sampling step 2.*exploded") as e:
        loop.train(run)
    assert e.value.__cause__ is boom
    assert time.perf_counter() - start < 60
    assert run.step == 2  # steps 0 and 1 trained, then the failure surfaced
    assert _no_worker_left() and run.async_sampler is None


@pytest.mark.parametrize("exc", [RuntimeError("trainer exploded"), KeyboardInterrupt()])
def test_a_trainer_exception_stops_the_worker(tmp_path: Path, exc: BaseException) -> None:
    """The trainer fails (or Ctrl-C) while the worker is mid-generation in a slow sampler: the
    original exception propagates and the worker is joined promptly."""
    run = _build(tmp_path, {"fail": FailAt("trainer", 2, exc), "delay": Delay(sample_s=0.3)},
                 "train.max_staleness=2", "train.steps=8")
    start = time.perf_counter()
    with pytest.raises(type(exc)):
        loop.train(run)
    assert time.perf_counter() - start < 60
    assert _no_worker_left() and run.async_sampler is None


def test_crash_leaves_the_checkpoint_and_resume_works(tmp_path: Path) -> None:
    run = _build(tmp_path, {"fail": FailAt("trainer", 3, RuntimeError("crash"))},
                 "train.max_staleness=2", "train.steps=5", "train.checkpoint_every=2")
    with pytest.raises(RuntimeError, match="crash"):
        loop.train(run)
    assert _no_worker_left()
    last = checkpoint.latest(tmp_path / "checkpoints")
    assert last is not None and last.name == "step-000002"
    resumed = _build(tmp_path, None, "train.max_staleness=2", "train.steps=5",
                     "train.checkpoint_every=2", resume=True)
    assert resumed.step == 2 and resumed.policy_version == 2
    loop.train(resumed)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["policy_version"] == 5
    assert all(r["staleness/max"] <= 2 for r in rows)
    assert _no_worker_left()


def test_negative_max_staleness_is_a_manifest_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="train.max_staleness"):
        _build(tmp_path, None, "train.max_staleness=-1")


def test_decoupled_ppo_loglinear_reads_per_token_versions() -> None:
    """A sample continued across versions (partial rollouts) carries per-token versions in
    extras["token_version"]; the loglinear proximal point uses each token's own staleness."""
    dppo = pytest.importorskip("rlmix_decoupled_ppo")
    logp = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    behavior = torch.tensor([[0.0, -2.0, -3.0, -5.0]])
    per_row = dppo.loglinear_proximal(logp, behavior, torch.tensor([2]))
    same = dppo.loglinear_proximal(logp, behavior, torch.tensor([[2, 2, 2, 2]]))
    torch.testing.assert_close(per_row, same)
    mixed = dppo.loglinear_proximal(logp, behavior, torch.tensor([[2, 2, 1, 0]]))
    # alpha = d / (d + 1): 2/3 on stale tokens, 1/2 one version old, 0 (behaviour) when fresh
    expected = behavior + torch.tensor([[2 / 3, 2 / 3, 1 / 2, 0.0]]) * (logp - behavior)
    torch.testing.assert_close(mixed, expected)


class SwapsHarness:
    """A wrapper on rlmix_prompts that, like a routing plugin, renders under another harness
    inside the worker, holding it swapped for a while."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()

    @rlmix.hookimpl(wrapper=True)
    def rlmix_prompts(self, run: Run, step: int) -> Any:
        prompts = yield
        if step == 1:
            run.harness["instructions"] = "SWAPPED"
            self.inside.set()
            self.release.wait(10)
            run.harness["instructions"] = "Reply with only the final number."
        return prompts


def test_the_workers_harness_swaps_are_invisible_to_the_trainer(tmp_path: Path) -> None:
    swapper = SwapsHarness()
    run = _build(tmp_path, {"swapper": swapper}, "harness.instructions=Reply with only the "
                 "final number.")
    sampler = async_sampling.start(run, max_staleness=2)
    try:
        assert swapper.inside.wait(30)
        # the worker holds its own copy swapped; the trainer (evaluating, say) sees its own
        assert run.harness["instructions"] == "Reply with only the final number."
        swapper.release.set()
    finally:
        swapper.release.set()
        async_sampling.stop(run)
    assert sampler is not None and _no_worker_left()
