"""VISTA: the anchored advantage by hand, the views and the anchor rows of the sampler, and the
claim: cross-view groups have >= 40% fewer zero-advantage groups than single-view groups at
equal rollouts."""

from __future__ import annotations

import math

import pytest
import rlmix_vista
import torch
from rlmix_vista import (
    PENDING,
    anchor_advantage,
    anchor_loss,
    group_advantage,
    spread,
    view_prompts,
)

import rlmix
from rlmix import loop
from rlmix.testing import make_run
from rlmix.testing.privileged import PrivilegedToyPolicy, PrivilegedToyWorld, toy_world_run


def _grpo():
    """The GRPO baseline, skipped where rlmix-grpo is not installed (nox -s isolated)."""
    return pytest.importorskip("rlmix_grpo")



def test_anchor_advantage_and_loss_hand_computed():
    # group 0: rollouts 1, 0, 0, 1; group 1: all fail; group 2: all succeed
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2])
    eps = 1e-6
    std0 = math.sqrt(1 / 3)  # of (1, 0, 0, 1): the anchor is not in the baseline
    per_group = anchor_advantage(rewards, group, 1.0, 2.0, eps)
    torch.testing.assert_close(per_group, torch.tensor([2.0 * 0.5 / (std0 + eps), 0.0, 0.0]))
    adv = group_advantage(rewards, group, eps)
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std0 + eps))
    assert adv[4:].abs().max() == 0
    # two anchor rows: mean token NLL 1.0 and 0.5, advantages 2 and 1, over 8 sequences
    logp = torch.tensor([[-1.0, -1.0, 0.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss = anchor_loss(logp, mask, torch.tensor([2.0, 1.0]), 8.0)
    assert float(loss) == pytest.approx((2 * 1.0 + 1 * 0.5) / 8)


def test_views_and_spread():
    p = rlmix.Prompt(messages=[{"role": "user", "content": "a"}], answer=1,
                     info={"views": ["a", "a, rephrased", [{"role": "user", "content": "A"}]]})
    views = view_prompts(p, True)
    assert [v.messages[-1]["content"] for v in views] == ["a", "a, rephrased", "A"]
    assert [v.info["view"] for v in views] == [0, 1, 2] and all(v.answer == 1 for v in views)
    assert len(view_prompts(p, False)) == 1
    assert spread(8, 3) == [3, 3, 2] and spread(2, 3) == [1, 1, 0]


def _world(seed: int = 0) -> PrivilegedToyWorld:
    """8 tasks, 2 tokens of 6, two views each. Under view 0 tasks 0-3 are easy (answer +5:
    0.94) and 4-7 hard (1/36); under view 1 tasks 0-3 are harder (+1: 0.12) and 4-7 easier
    (+2.5: 0.50). The answer is the same under both views."""
    g = torch.Generator().manual_seed(7)
    answers = torch.randint(0, 6, (8, 2), generator=g)

    def shift(first: float, second: float) -> torch.Tensor:
        out = torch.zeros(8, 2, 6)
        out[:4] = torch.zeros(4, 2, 6).scatter_(-1, answers[:4, :, None], first)
        out[4:] = torch.zeros(4, 2, 6).scatter_(-1, answers[4:, :, None], second)
        return out

    policy = PrivilegedToyPolicy(8, 2, 6, views={"(view 0)": shift(5.0, 0.0),
                                                 "(view 1)": shift(1.0, 2.5)}, seed=seed)
    info = {p: {"views": [f"task {p} (view 0)", f"task {p} (view 1)"],
                "oracle_ids": answers[p].tolist()} for p in range(8)}
    return PrivilegedToyWorld(policy, answers, info=info)


OVERRIDES = ["train.prompts_per_step=8", "train.group_size=8"]


def test_views_per_group_and_the_anchor_rows_with_the_oracle():
    world = _world()
    run = toy_world_run(world, {"grpo": _grpo(), "vista": rlmix_vista}, OVERRIDES)
    batch = run.sample(world.rlmix_prompts(run, 0))
    assert world.generated_rows == len(batch) == 64  # the sampling contract holds
    views = [p.info["view"] for p in batch.prompts]
    assert views.count(0) == views.count(1) == 32  # 4 + 4 per task
    for g in range(8):  # each group: one task
        rows = (batch.group == g).nonzero().flatten()
        assert len({batch.prompts[int(r)].id for r in rows}) == 1
    loop.score(run, batch)
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    torch.testing.assert_close(adv, group_advantage(batch.rewards, batch.group, 1e-6))
    per_group = anchor_advantage(batch.rewards, batch.group, 1.0, 1.0, 1e-6)
    step, anchors, anchor_adv = run.plugin_resources("vista")[PENDING]
    active = (per_group != 0).nonzero().flatten()
    assert len(anchors) == len(active) > 0
    torch.testing.assert_close(anchor_adv, per_group[active])
    for row, g in enumerate(active.tolist()):  # the oracle after the group's prompt
        task = int(batch.prompts[int((batch.group == g).nonzero()[0])].id)
        assert anchors.tokens[row, 1:].tolist() == world.answers[task].tolist()
    metrics = loop.train_step(run)  # the whole step with grpo's loss and the anchor term
    assert math.isfinite(metrics["loss"])


def _zero_advantage_share(cross_view: bool, batches: int = 20) -> tuple[float, int]:
    world = _world()
    run = toy_world_run(world, {"grpo": _grpo(), "vista": rlmix_vista},
                        [*OVERRIDES, f"vista.cross_view={cross_view}"])
    zero, total = 0, 0
    for step in range(batches):
        batch = run.sample(world.rlmix_prompts(run, step))
        loop.score(run, batch)
        adv = run.hook.rlmix_advantage(run=run, batch=batch)
        for g in range(batch.num_groups):
            zero += int(bool((adv[batch.group == g] == 0).all()))
            total += 1
    return zero / total, world.generated_rows


def test_cross_view_groups_have_far_fewer_zero_advantage_groups():
    cross, cross_rows = _zero_advantage_share(True)
    single, single_rows = _zero_advantage_share(False)
    assert cross_rows == single_rows == 20 * 64
    print(f"zero-advantage groups: cross-view {cross:.3f}, single-view {single:.3f}")
    assert single > 0.3
    assert cross <= 0.6 * single  # at least 40% fewer


@pytest.mark.parametrize("override", ["vista.anchor_coef=-1", "vista.eps=0"])
def test_bad_settings_fail(override):
    with pytest.raises(rlmix.ManifestError, match="vista"):
        make_run({"vista": rlmix_vista}, [override])
