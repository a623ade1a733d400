"""Tests of DOTS: trigram embeddings, attention-weighted difficulty and moderate selection by
hand, the wrapper's budget, memory and replay buffer on a synthetic env, settings checks, and the
claim: fewer zero-advantage groups than GRPO at the same number of generated rollouts."""

from __future__ import annotations

import math
import random

import pytest
import rlmix_dots
import torch
from rlmix_dots import attention_difficulty, embed_texts, select_moderate

import rlmix
from rlmix.loop import score
from rlmix.testing import make_run
from rlmix.testing.allocation import KnownRateEnv as SyntheticEnv
from rlmix.testing.allocation import flat_groups as _flat_groups
from rlmix.testing.allocation import sample_steps as _steps
from rlmix.types import Prompt

FAMILIES = ["zebra crossing", "quantum harmonic", "velvet orchestra", "marble fountain",
            "copper lantern", "saffron meadow"]
#: each family shares its words and its success rate: similar questions, similar difficulty
FAMILY_RATES = [0.0, 1.0, 0.5, 0.05, 0.95, 0.4]


class FamilyEnv(SyntheticEnv):
    """60 tasks in 6 families; task i is in family i % 6, with that family's success rate."""

    def __init__(self, seed=0):
        super().__init__([FAMILY_RATES[i % 6] for i in range(60)], seed)

    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        size, total = int(run.config.train.prompts_per_step), len(self.rates)
        rng = random.Random(step)
        idx = rng.sample(range(total), size)
        return [Prompt(messages=[{"role": "user", "content":
                                  f"{FAMILIES[i % 6]} question number {i}"}], answer=i)
                for i in idx]


def _run(env, overrides=(), dots=True, prompts=4, group_size=8):
    plugins = {"env": env, "dots": rlmix_dots} if dots else {"env": env}
    return make_run(plugins, [f"train.prompts_per_step={prompts}",
                              f"train.group_size={group_size}", *overrides])


def test_embeddings_are_unit_and_similar_texts_are_closer():
    e = embed_texts(["zebra crossing question 1", "zebra crossing question 2",
                     "copper lantern question 1"], 256)
    torch.testing.assert_close(e.norm(dim=-1), torch.ones(3))
    assert float(e[0] @ e[1]) > float(e[0] @ e[2])
    torch.testing.assert_close(embed_texts(["abc"], 256), embed_texts(["abc"], 256))


def test_attention_difficulty_by_hand():
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    q = torch.tensor([[1.0, 0.0], [math.sqrt(0.5), math.sqrt(0.5)]])
    d = torch.tensor([0.2, 0.8])
    tau = 0.5
    w0 = torch.softmax(torch.tensor([1.0, 0.0]) / tau, 0)
    expected = torch.tensor([float(w0 @ d), 0.5])  # the second query is equally similar to both
    torch.testing.assert_close(attention_difficulty(q, ref, d, tau), expected)
    # a sharper temperature moves the first query toward its nearest reference
    assert float(attention_difficulty(q[:1], ref, d, 0.05)) < float(expected[0])
    assert attention_difficulty(q, torch.zeros(0, 2), torch.zeros(0), tau).tolist() == [0.5, 0.5]


def test_select_moderate_picks_the_closest_to_target():
    pred = torch.tensor([0.0, 0.45, 1.0, 0.7, 0.5, 0.1])
    assert select_moderate(pred, 2) == [1, 4]
    assert select_moderate(pred, 3, target=0.9) == [2, 3, 4]


def test_wrapper_budget_memory_and_replay():
    env = FamilyEnv(seed=1)
    run = _run(env)
    rows = _steps(run, env, 6)
    state = run.state["dots"]
    # step 1 has an empty buffer: 4 fresh groups; later steps replay one group, generate 3
    assert [r[0] for r in rows[:2]] == [32, 24] and state["rollouts"] == sum(r[0] for r in rows)
    assert all(r[2].num_groups == 4 for r in rows)
    assert state["replayed"] == 5 and len(state["memory"]) == 4 + 5 * 3
    assert all(not f for f in rows[-1][1][-1:])  # the replayed group is informative
    assert len(state["buffer"]) <= 64


@pytest.mark.parametrize("override", ["dots.tau=0", "dots.ref_size=0", "dots.target=2",
                                      "dots.key=name", "dots.pool_factor=0"])
def test_bad_settings_are_rejected_naming_the_setting(override):
    with pytest.raises(rlmix.ConfigError, match=override.split(".")[1].split("=")[0]):
        _run(FamilyEnv(), [override])


def test_claim_fewer_zero_advantage_groups_than_grpo_at_equal_budget():
    env_g, env_d = FamilyEnv(seed=3), FamilyEnv(seed=3)
    run_d = _run(env_d)
    dots = []
    spent = 0  # DOTS generates 24 or 32 per step: stop at a multiple of GRPO's 32 per step
    while spent < 960 or spent % 32:
        dots += _steps_from(run_d, env_d, len(dots))
        spent = run_d.state["dots"]["rollouts"]
    grpo = _steps(_run(env_g, dots=False), env_g, spent // 32)
    assert spent == env_d.generated == env_g.generated  # the same generated rollouts

    def zero_share(rows, fresh_only=False):
        flat = [f for r in rows for f in (r[1][:-1] if fresh_only and r[0] == 24 else r[1])]
        return sum(flat) / len(flat), sum(not f for f in flat)

    share_g, informative_g = zero_share(grpo)
    share_d, informative_d = zero_share(dots)
    fresh_share_d, _ = zero_share(dots, fresh_only=True)
    assert share_g > 0.4  # half the families are (nearly) always or never solved
    assert fresh_share_d < 0.6 * share_g  # selection alone: fresh groups are less often dead
    assert share_d < 0.5 * share_g
    assert informative_d > 1.5 * informative_g


def _steps_from(run, env, step):
    run.step = step
    before = env.generated
    batch = run.sample(run.hook.rlmix_prompts(run=run, step=step))
    score(run, batch)
    return [(env.generated - before, _flat_groups(batch), batch)]


def test_replay_budget_shrinks_to_fit_small_batches():
    from rlmix_dots import Settings, replay_budget

    s = Settings(ref_size=1, replay_groups=2)
    assert replay_budget(s, 8) == 2  # room for both
    assert replay_budget(s, 3) == 1  # one fresh prompt besides the reference must remain
    assert replay_budget(s, 2) == 0  # the default batch of 2: no replay, the run still starts
