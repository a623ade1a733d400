"""Tests of TRACE's allocation: the mixed-reward gain and the predictor by hand, the wrapper's
budget and predictor state on a synthetic env, settings checks, and the claim: at GRPO's rollout
budget, the extra rollouts go to the uncertain prompts and more groups carry a signal."""

from __future__ import annotations

import random

import pytest
import rlmix_trace_alloc
import torch
from rlmix_trace_alloc import features, mixed_gain, mixed_probability, predict, predictor_update

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


def _run(env, trace=True, group_size=4, overrides=()):
    plugins = {"env": env, "trace_alloc": rlmix_trace_alloc} if trace else {"env": env}
    return make_run(plugins, ["train.prompts_per_step=4", f"train.group_size={group_size}",
                              *overrides])


def test_mixed_probability_and_gain_by_hand():
    assert mixed_probability(0.3, 4) == pytest.approx(1 - 0.3 ** 4 - 0.7 ** 4)
    assert mixed_probability(0.5, 1) == 0.0 and mixed_probability(0.0, 8) == 0.0
    # 4 sampled, 2 planned, 2 more
    assert mixed_gain(0.3, 4, 2, 2) == pytest.approx(
        (1 - 0.3 ** 8 - 0.7 ** 8) - (1 - 0.3 ** 6 - 0.7 ** 6))
    # a hard-but-possible prompt gains more than a sure one or a coin flip already near 1
    assert mixed_gain(0.1, 4, 0, 2) > mixed_gain(0.5, 4, 0, 2) > mixed_gain(0.01, 4, 0, 2)
    assert mixed_gain(1.0, 4, 0, 2) == 0.0


def test_predictor_learns_success_rates_from_features():
    texts = ["alpha alpha task", "omega omega task"]
    x = features(texts, 64)
    torch.testing.assert_close(x.norm(dim=-1), torch.ones(2))
    w = torch.zeros(65)
    torch.testing.assert_close(predict(w, x), torch.full((2,), 0.5))
    rows = torch.cat([x[0].expand(10, -1), x[1].expand(10, -1)])
    ys = torch.tensor([1.0] * 9 + [0.0] + [0.0] * 9 + [1.0])
    # one step by hand: w - lr * X^T (sigmoid(Xw) - y) / n
    xb = torch.cat([rows, torch.ones(20, 1)], 1)
    expected = w - 0.5 * xb.T @ (torch.full((20,), 0.5) - ys) / 20
    torch.testing.assert_close(predictor_update(w, rows, ys, 0.5), expected)
    for _ in range(300):
        w = predictor_update(w, rows, ys, 2.0)
    p = predict(w, x)
    assert float(p[0]) > 0.75 and float(p[1]) < 0.25


def test_wrapper_spends_the_budget_and_trains_the_predictor():
    env = SyntheticEnv([0.0, 1.0, 0.5, 0.5], seed=1)
    run = _run(env)
    rows = _steps(run, env, 3)
    assert [r[0] for r in rows] == [32] * 3 == [len(r[2]) for r in rows]
    assert run.state["trace_alloc"]["rollouts"] == 96
    assert float(run.state["trace_alloc"]["w"].abs().sum()) > 0
    extra = run.state["trace_alloc"]["extra"]
    assert sum(extra.values()) == 16 and extra["text:user: task 1"] <= extra["text:user: task 2"]


@pytest.mark.parametrize("override", ["trace_alloc.chunk=0", "trace_alloc.prior_strength=0",
                                      "trace_alloc.feature_dim=2", "trace_alloc.key=name"])
def test_bad_settings_are_rejected_naming_the_setting(override):
    with pytest.raises(rlmix.ConfigError, match=override.split(".")[1].split("=")[0]):
        _run(SyntheticEnv([0.5]), overrides=[override])


def test_claim_extra_rollouts_go_to_uncertain_prompts_and_more_groups_carry_signal():
    env_g, env_t = SyntheticEnv(RATES, seed=7), SyntheticEnv(RATES, seed=7)
    grpo = _steps(_run(env_g, trace=False, group_size=8), env_g, 30)
    run_t = _run(env_t)
    trace = _steps(run_t, env_t, 30)
    assert sum(r[0] for r in grpo) == run_t.state["trace_alloc"]["rollouts"] == 960
    unc, cert = _extra_by_rate(trace[6:])  # after one pass over the 24 tasks
    assert unc > 2.2 * max(cert, 0.1)
    informative = [sum(not f for r in rows for f in r[1]) for rows in (grpo, trace)]
    assert informative[1] >= informative[0]  # every step's prompts, same budget
