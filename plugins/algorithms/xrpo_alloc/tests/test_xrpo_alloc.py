"""Tests of XRPO's allocator: the interval shrink and the greedy allocation by hand, the wrapper's
budget and history on a synthetic env, settings checks, and the claim: at GRPO's rollout budget,
the extra rollouts concentrate on the prompts whose success is uncertain."""

from __future__ import annotations

import math
import random

import pytest
import rlmix_xrpo_alloc
from rlmix_xrpo_alloc import allocate_by_gain, interval_shrink

import rlmix
from rlmix.testing import make_run
from rlmix.testing.allocation import KnownRateEnv as SyntheticEnv
from rlmix.testing.allocation import sample_steps as _steps

# 24 tasks: impossible, trivial, and uncertain ones (10%, 30%, 50%)
RATES = [0.0] * 6 + [1.0] * 6 + [0.1] * 4 + [0.3] * 4 + [0.5] * 4
random.Random(0).shuffle(RATES)


def _extra_by_rate(rows, group_size=4):
    """Mean extra rollouts per prompt, for uncertain prompts (0 < rate < 1) and certain ones."""
    unc, cert = [], []
    for _, _, batch in rows:
        for g in range(batch.num_groups):
            idx = (batch.group == g).nonzero().flatten()
            rate = RATES[batch.prompts[int(idx[0])].answer]
            (unc if 0 < rate < 1 else cert).append(len(idx) - group_size)
    return sum(unc) / len(unc), sum(cert) / len(cert)


def _run(env, xrpo=True, group_size=4, overrides=()):
    plugins = {"env": env, "xrpo_alloc": rlmix_xrpo_alloc} if xrpo else {"env": env}
    return make_run(plugins, ["train.prompts_per_step=4", f"train.group_size={group_size}",
                              *overrides])


def test_interval_shrink_by_hand():
    p = 3.0 / 6.0  # 2 wins in 4, Beta(1, 1) posterior mean
    expected = 1.96 * math.sqrt(p * (1 - p)) * (1 / 2 - 1 / math.sqrt(6))
    assert interval_shrink(2, 4, 2) == pytest.approx(expected)
    # an uncertain prompt gains more than an all-same one with the same count
    assert interval_shrink(2, 4, 2) > interval_shrink(0, 4, 2) == pytest.approx(
        interval_shrink(4, 4, 2))
    # and the gain falls with the count already seen
    assert interval_shrink(5, 10, 2) < interval_shrink(2, 4, 2)


def test_allocate_by_gain_greedy_with_diminishing_gains_and_round_robin_ties():
    weights = [3.0, 1.0, 0.0]
    gains = lambda i, e: weights[i] / (1 + e)  # noqa: E731
    # chunks of 2: p0 (3); then p0's 3/3 ties p1's 1/1 and p1 has fewer; then p0 (1 > 1/3)
    assert allocate_by_gain(gains, 3, 6, 2) == [4, 2, 0]
    assert allocate_by_gain(lambda i, e: 0.0, 3, 7, 2) == [3, 2, 2]  # round robin, last smaller
    assert sum(allocate_by_gain(gains, 3, 9, 4)) == 9
    assert allocate_by_gain(gains, 0, 9, 4) == []


def test_wrapper_spends_the_budget_and_keeps_decayed_history():
    env = SyntheticEnv([0.0, 1.0, 0.5, 0.5], seed=1)
    run = _run(env)
    rows = _steps(run, env, 2)
    assert [r[0] for r in rows] == [32, 32] == [len(r[2]) for r in rows]
    assert run.state["xrpo_alloc"]["rollouts"] == 64
    hist = run.state["xrpo_alloc"]["history"]
    total = sum(n for _, n in hist.values())
    assert total == pytest.approx(32 * 0.9 + 32)  # step 1 decayed once, step 2 in full
    extra = run.state["xrpo_alloc"]["extra"]
    assert sum(extra.values()) == 16


@pytest.mark.parametrize("override", ["xrpo_alloc.chunk=0", "xrpo_alloc.z=0",
                                      "xrpo_alloc.history_decay=2", "xrpo_alloc.key=name"])
def test_bad_settings_are_rejected_naming_the_setting(override):
    with pytest.raises(rlmix.ConfigError, match=override.split(".")[1].split("=")[0]):
        _run(SyntheticEnv([0.5]), overrides=[override])


def test_claim_extra_rollouts_concentrate_on_uncertain_prompts_at_equal_budget():
    env_g, env_x = SyntheticEnv(RATES, seed=7), SyntheticEnv(RATES, seed=7)
    grpo = _steps(_run(env_g, xrpo=False, group_size=8), env_g, 30)
    run_x = _run(env_x)
    xrpo = _steps(run_x, env_x, 30)
    assert sum(r[0] for r in grpo) == run_x.state["xrpo_alloc"]["rollouts"] == 960
    unc, cert = _extra_by_rate(xrpo[6:])  # after one pass over the 24 tasks
    assert unc > 2.5 * max(cert, 0.1)  # certain prompts (never or always solved) get little
    assert unc > 5 and cert < 2.5
    _, cert_grpo = _extra_by_rate(grpo, group_size=4)
    assert cert_grpo == 4  # GRPO: the same 4 "extra" for everyone
