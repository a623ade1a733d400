"""The ``loss`` metric is the mean over the step's optimizer updates of each update's loss (the
sum of its accumulation chunks, each already divided by the whole update's normalisers). It was
the sum over every minibatch of every epoch, which grew with ``epochs x updates_per_epoch``."""

from __future__ import annotations

import pytest

import rlmix
from rlmix import loop, manifest
from rlmix.testing import standins


class UpdateRecorder:
    def __init__(self) -> None:
        self.chunks: list[tuple[float, bool]] = []

    @rlmix.hookimpl(wrapper=True)
    def rlmix_update(self, run, loss):
        self.chunks.append((float(loss.value.detach()), bool(loss.minibatch.last)))
        return (yield)


def test_loss_is_the_mean_over_updates_of_each_updates_summed_chunks(tmp_path):
    recorder = UpdateRecorder()
    plugins = {**{k: v() for k, v in standins.STANDINS.items()}, "rec": recorder}
    cfg = manifest.read(None, [
        "model=tiny-random", f"plugins=[{','.join(plugins)}]", f"out={tmp_path}",
        "log.progress=false", "log.plot=false", "train.steps=1", "train.eval_every=0",
        "train.prompts_per_step=4", "train.group_size=4", "train.epochs=2",
        "train.updates_per_epoch=2", "train.grad_accum=2", "policy.threads=1"])
    run = loop.build_run(cfg, extra_plugins=plugins)
    metrics = loop.train_step(run)
    assert len(recorder.chunks) == 8  # 2 epochs x 2 updates x 2 accumulation chunks
    updates, current = [], 0.0
    for value, last in recorder.chunks:
        current += value
        if last:
            updates.append(current)
            current = 0.0
    assert len(updates) == 4 and run.policy_version == 4
    assert metrics["loss"] == pytest.approx(sum(updates) / len(updates), rel=1e-12)
    total = sum(v for v, _ in recorder.chunks)  # the old definition
    assert abs(total - metrics["loss"]) > 1e-6
