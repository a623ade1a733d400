"""This process's share under data parallelism (issue 22): ``Run.shard`` / ``Run.share`` (set
by a trainer plugin) and ``Run.minibatches`` training only the share's rows, on a batch that
stays whole; a trainer's per-rank prompt share handed on through ``rlmix_select_prompts`` (a new
list, the caller's untouched); allocation plugins that need their whole selection (aero, dots)
refuse a share with a ConfigError naming the fix. No process group is started here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rlmix
from rlmix.testing import make_batch, make_run
from rlmix.testing.allocation import KnownRateEnv
from rlmix.types import Prompt, Run


class HalfShare:
    """A stand-in data-parallel trainer: rank 1 of 2 takes the second half of the prompts, as
    the ``deepspeed`` plugin's ``rlmix_select_prompts`` does (``trylast``: after the others)."""

    @rlmix.hookimpl(trylast=True)
    def rlmix_select_prompts(self, run: Run, prompts: list[Prompt]) -> list[Prompt]:
        lo, hi = run.share(len(prompts))
        return list(prompts[lo:hi])


def test_share_is_tensor_split_and_covers_every_item_once():
    run = make_run()
    for n, world in [(8, 2), (7, 3), (4, 4), (5, 1), (3, 4)]:
        spans = []
        for rank in range(world):
            run.shard = (rank, world)
            spans.append(run.share(n))
        sizes = [len(p) for p in torch.tensor_split(torch.arange(n), world)]
        assert [hi - lo for lo, hi in spans] == sizes
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    run.shard = (0, 1)
    assert run.share(6) == (0, 6)


@pytest.mark.parametrize("overrides", [[], ["train.updates_per_epoch=2", "train.grad_accum=2",
                                            "train.epochs=2"]])
def test_minibatches_train_only_this_ranks_rows_of_the_whole_batch(overrides):
    run = make_run(overrides=overrides)
    batch = make_batch(n_groups=4, group_size=2)
    batch.advantages = torch.arange(8, dtype=torch.float32)
    whole = sorted(int(a) for mb in run.minibatches(batch) for a in mb.batch.advantages)
    run.shard = (1, 2)
    mine = [mb for mb in run.minibatches(batch)]
    rows = sorted(int(a) for mb in mine for a in mb.batch.advantages)
    epochs = int(run.config.train.epochs)
    assert rows == sorted(list(range(4, 8)) * epochs)  # rows 4..7 once per epoch
    assert len(whole) == 8 * epochs and len(batch) == 8  # the batch itself stays whole
    # each update's normalisers count this rank's rows (the trainer sums them over ranks)
    seqs = {id(mb.normalizers): mb.normalizers.sequences for mb in mine}
    assert sum(seqs.values()) == 4 * epochs


def test_a_trainers_share_is_a_new_list_and_the_callers_is_untouched():
    env = KnownRateEnv([0.5] * 8, seed=1)
    run = make_run({"env": env, "dp": HalfShare()}, ["train.prompts_per_step=4",
                                                     "train.group_size=2"])
    run.shard = (1, 2)
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    before = list(prompts)
    batch = run.sample(prompts)
    assert prompts == before  # nobody cut the caller's list
    assert [p.id for p in batch.prompts] == [p.id for p in before[2:] for _ in range(2)]


def test_deepspeed_hands_its_share_on_through_select_prompts():
    ds = pytest.importorskip("rlmix_deepspeed")
    run = make_run({"deepspeed": ds})
    prompts = [Prompt(messages=[{"role": "user", "content": str(i)}], id=str(i))
               for i in range(6)]
    assert run.select_prompts(prompts) == prompts  # no trainer yet: unchanged
    run.plugin_resources("deepspeed")["trainer"] = ds.Trainer(
        engine=None, settings=ds.Settings(), rank=1, world=3, root=Path("."),
        device=torch.device("cpu"))
    run.shard = (1, 3)
    before = list(prompts)
    assert run.select_prompts(prompts) == prompts[2:4]
    assert prompts == before


@pytest.mark.parametrize("name, overrides", [("aero", []),
                                             ("dots", ["dots.pool_factor=2"])])
def test_allocation_plugins_refuse_a_per_rank_share_clearly(name, overrides):
    module = pytest.importorskip(f"rlmix_{name}")
    env = KnownRateEnv([0.2, 0.5, 0.8, 0.5] * 2, seed=2)
    run = make_run({"env": env, name: module, "dp": HalfShare()},
                   ["train.prompts_per_step=4", "train.group_size=2", *overrides])
    getattr(module, "rlmix_configure", lambda run: None)(run)
    run.shard = (1, 2)
    with pytest.raises(rlmix.ConfigError) as info:
        run.sample(run.hook.rlmix_prompts(run=run, step=0))
    text = str(info.value)
    assert f"plugin '{name}'" in text and "rlmix_select_prompts" in text
    assert "deepspeed.shard: false" in text
    # in one process the same manifest samples (the refusal is the share's, not the plugin's)
    run.shard = (0, 1)
    run.pm.unregister(name="dp")
    assert len(run.sample(run.hook.rlmix_prompts(run=run, step=1))) > 0
