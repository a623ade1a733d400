"""Tests of the GAPO plugin: the window choice and the advantage against hand-computed values,
edge cases, the hook through a fake run, settings checks, and the paper's claim (a reward
outlier barely moves the other samples' advantages, unlike GRPO's mean baseline)."""

from __future__ import annotations

import math

import pytest
import rlmix_gapo
import torch
from rlmix_gapo import adaptive_q, adaptive_window, gapo_advantage, min_window

import rlmix
from rlmix.testing import ToyPolicy, make_batch, make_run, toy_train

ONE_GROUP = torch.zeros(6, dtype=torch.long)

# ---------------------------------------------------------------- the window and Q


@pytest.mark.parametrize("size, fraction, expected", [
    (8, 0.5, 4), (5, 0.5, 3), (6, 0.5, 3), (2, 0.5, 2), (3, 0.1, 2), (7, 1.0, 7), (1, 0.5, 1),
])
def test_min_window(size, fraction, expected):
    assert min_window(size, fraction) == expected


def test_snr_and_hdi_pick_different_windows_hand_computed():
    # sorted rewards 0, .25, .5, 1.5, 1.75, 2 (exact in binary); windows of at least 3
    # snr: [1.5 1.75 2] has mean 1.75, std .25 -> 7; [0 .25 .5] has mean .25, std .25 -> 1;
    #      every longer run mixes the two clusters (e.g. [.5 1.5 1.75 2]: 1.44 / .66 -> 2.2)
    # hdi: the narrowest three are [0 .25 .5] and [1.5 1.75 2] (width .5 each): the lower wins
    values = torch.tensor([0.0, 0.25, 0.5, 1.5, 1.75, 2.0])
    assert adaptive_window(values, 3, "snr") == (3, 5)
    assert adaptive_window(values, 3, "hdi") == (0, 2)
    shuffled = values[torch.tensor([4, 0, 5, 2, 1, 3])]
    q_snr = adaptive_q(shuffled, ONE_GROUP, 0.5, "snr")
    q_hdi = adaptive_q(shuffled, ONE_GROUP, 0.5, "hdi")
    torch.testing.assert_close(q_snr, torch.full((6,), 1.75))
    torch.testing.assert_close(q_hdi, torch.full((6,), 0.25))


def test_snr_window_hand_computed_scores():
    # sorted .1 .5 .52 .55 .9, windows of >= 3:
    # [.5 .52 .55]: mean .52333, std sqrt(.0012667 / 2) = .025166 -> SNR 20.8, the best
    values = torch.tensor([0.1, 0.5, 0.52, 0.55, 0.9])
    i, j = adaptive_window(values, 3, "snr")
    assert (i, j) == (1, 3)
    window = values[i:j + 1].double()
    best = float(window.mean() / window.std())
    assert best == pytest.approx(0.523333 / 0.025166, rel=1e-3)
    for a in range(5):  # every other candidate scores lower
        for b in range(a + 2, 5):
            w = values[a:b + 1].double()
            if (a, b) != (1, 3):
                assert float(w.mean() / w.std()) < best


def test_even_window_median_is_the_mean_of_the_middle_pair():
    # G = 4, windows of >= 2; [.4 .5] (mean .45, std .0707 -> 6.4) beats every other run
    rewards = torch.tensor([3.0, 0.4, 0.0, 0.5])
    q = adaptive_q(rewards, torch.zeros(4, dtype=torch.long), 0.5, "snr")
    torch.testing.assert_close(q, torch.full((4,), 0.45))


def test_a_noise_free_run_beats_any_noisy_run():
    # [1 1 1] has std 0: infinite SNR, above [.9 .95 1 1 1] (mean .97, std .045 -> 21.7)
    rewards = torch.tensor([1.0, 0.9, 1.0, 0.2, 0.95, 1.0])
    torch.testing.assert_close(adaptive_q(rewards, ONE_GROUP, 0.5, "snr"), torch.ones(6))


@pytest.mark.parametrize("correct, expected_q", [(1, 0.0), (3, 0.0), (4, 0.0), (5, 1.0),
                                                 (7, 1.0)])
def test_binary_rewards_take_the_majority_as_baseline(correct, expected_q):
    # a class with >= G/2 members is a noise-free window; with 4 and 4 the tie goes to the
    # lower run. The released code's narrowest-half interval makes the same choice.
    rewards = torch.tensor([1.0] * correct + [0.0] * (8 - correct))
    group = torch.zeros(8, dtype=torch.long)
    for interval in ("snr", "hdi"):
        q = adaptive_q(rewards, group, 0.5, interval)
        torch.testing.assert_close(q, torch.full((8,), expected_q))


def test_among_noise_free_runs_the_largest_wins():
    # windows of >= 3: three 0s and five 1s are both noise-free; the larger cluster is Q
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    group = torch.zeros(8, dtype=torch.long)
    torch.testing.assert_close(adaptive_q(rewards, group, 0.375, "snr"), torch.ones(8))
    torch.testing.assert_close(adaptive_q(1.0 - rewards, group, 0.375, "snr"), torch.zeros(8))


def test_groups_are_independent_and_interleaved_ids_work():
    a = torch.tensor([0.0, 0.1, 0.2, 0.6, 0.7, 0.8])
    b = torch.tensor([3.0, 0.4, 0.0, 0.5])
    rewards = torch.cat([a, b])
    group = torch.tensor([0] * 6 + [1] * 4)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    q = adaptive_q(rewards[perm], group[perm], 0.5, "snr")
    expected = torch.tensor([0.7] * 6 + [0.45] * 4)[perm]
    torch.testing.assert_close(q, expected)


# ---------------------------------------------------------------- the advantage


def test_advantage_hand_computed_for_each_scale():
    rewards = torch.tensor([0.0, 0.1, 0.2, 0.6, 0.7, 0.8])
    centred = rewards - 0.7  # Q = .7 (snr)
    torch.testing.assert_close(gapo_advantage(rewards, ONE_GROUP, scale="none"), centred)
    # baseline: sqrt(sum (r - Q)^2 / (G - 1)) = sqrt((.49 + .36 + .25 + .01 + 0 + .01) / 5)
    dev = math.sqrt(1.12 / 5)
    eps = 1e-6
    torch.testing.assert_close(gapo_advantage(rewards, ONE_GROUP, scale="baseline", eps=eps),
                               centred / (dev + eps))
    # group: the group's unbiased std, as GRPO divides by
    std = float(rewards.std())
    torch.testing.assert_close(gapo_advantage(rewards, ONE_GROUP, scale="group", eps=eps),
                               centred / (std + eps))
    assert abs(dev - std) > 0.05  # the two scales differ on these rewards


def test_baseline_scale_with_the_mean_as_q_would_be_grpos_std():
    # the 'baseline' deviation is the std formula around Q: with Q = mean it is GRPO's std
    rewards = torch.tensor([0.3, 0.9, 0.4, 0.5])
    mean = float(rewards.mean())
    around_mean = math.sqrt(float(((rewards - mean) ** 2).sum()) / 3)
    assert around_mean == pytest.approx(float(rewards.std()), rel=1e-6)


@pytest.mark.parametrize("scale", ["baseline", "group", "none"])
@pytest.mark.parametrize("interval", ["snr", "hdi"])
def test_identical_rewards_and_groups_of_one_give_zero_never_nan(scale, interval):
    rewards = torch.tensor([0.7, 0.7, 0.7, 0.7, 2.0, -1.0, -1.0, -1.0])
    group = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2])  # group 1 is a single sample
    adv = gapo_advantage(rewards, group, interval, 0.5, scale)
    assert torch.isfinite(adv).all()
    assert (adv == 0).all()


def test_single_sample_batch():
    adv = gapo_advantage(torch.tensor([4.0]), torch.tensor([0]))
    assert torch.isfinite(adv).all() and float(adv[0]) == 0.0


def test_hdi_is_shift_invariant():
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(16, generator=g)
    group = torch.arange(2).repeat_interleave(8)
    for scale in ("baseline", "group", "none"):
        a = gapo_advantage(rewards, group, "hdi", 0.5, scale)
        b = gapo_advantage(rewards - 3.0, group, "hdi", 0.5, scale)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_unknown_choices_raise():
    with pytest.raises(ValueError, match="interval"):
        adaptive_window(torch.tensor([0.0, 1.0, 2.0]), 2, "mode")
    with pytest.raises(ValueError, match="scale"):
        gapo_advantage(torch.ones(2), torch.zeros(2, dtype=torch.long), scale="batch")


# ---------------------------------------------------------------- the claim: outlier robustness


def _grpo_advantage(rewards, group, scale, eps=1e-6):
    """GRPO's mean baseline with the same scale (written here, so the test needs no grpo)."""
    import rlmix.ops as ops

    centred = rewards - ops.group_mean(rewards, group)
    if scale == "none":
        return centred
    return centred / (ops.group_std(rewards, group) + eps)  # 'baseline' around the mean = std


CLEAN = torch.tensor([0.70, 0.72, 0.75, 0.71, 0.74, 0.73, 0.76, 0.78])


@pytest.mark.parametrize("outlier", [10.0, -5.0])
def test_an_outlier_does_not_move_the_baseline_of_the_others(outlier):
    group = torch.zeros(8, dtype=torch.long)
    noisy = CLEAN.clone()
    noisy[0] = outlier
    ours = gapo_advantage(noisy, group, scale="none") - gapo_advantage(CLEAN, group,
                                                                       scale="none")
    theirs = _grpo_advantage(noisy, group, "none") - _grpo_advantage(CLEAN, group, "none")
    # GRPO shifts every other sample by (outlier - 0.70) / 8
    torch.testing.assert_close(theirs[1:], torch.full((7,), -(outlier - 0.70) / 8))
    assert float(ours[1:].abs().max()) < 1e-6
    assert float(theirs[1:].abs().min()) > 0.7


@pytest.mark.parametrize("scale", ["baseline", "group", "none"])
def test_an_outlier_keeps_the_others_signs_under_gapo_but_flips_them_under_grpo(scale):
    group = torch.zeros(8, dtype=torch.long)
    noisy = CLEAN.clone()
    noisy[0] = 10.0
    grpo_scale = "none" if scale == "none" else "group"
    before, after = gapo_advantage(CLEAN, group, scale=scale), gapo_advantage(noisy, group,
                                                                             scale=scale)
    g_before, g_after = _grpo_advantage(CLEAN, group, grpo_scale), _grpo_advantage(
        noisy, group, grpo_scale)
    assert torch.equal(torch.sign(before[1:]), torch.sign(after[1:]))  # GAPO: none flips
    flipped = int((torch.sign(g_before[1:]) != torch.sign(g_after[1:])).sum())
    assert flipped >= 3  # GRPO: every sample above the old mean turns negative
    assert (g_after[1:] < 0).all()
    # and the others' advantages move less than under GRPO with the same scale
    ours = float((after - before)[1:].abs().max())
    theirs = float((g_after - g_before)[1:].abs().max())
    assert ours < theirs


# ---------------------------------------------------------------- the hook


def test_advantage_hook_reads_settings():
    batch = make_batch(rewards=torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.2, 0.9]))
    run = make_run({"gapo": rlmix_gapo}, ["gapo.scale=none"])
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    # group 0: three zeros are a noise-free window of >= 2: Q = 0
    # group 1: sorted 0 .1 .2 .9; [0 .1] and [.1 .2] have std .0707, means .05 and .15: the
    #          latter (SNR 2.1) beats every other run, so Q = .15
    torch.testing.assert_close(adv, torch.tensor([1.0, 0.0, 0.0, 0.0,
                                                  -0.15, -0.05, 0.05, 0.75]))
    run = make_run({"gapo": rlmix_gapo}, ["gapo.interval=hdi", "gapo.scale=none"])
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    # hdi, pairs: [0 .1] and [.1 .2] both have width .1; the lower wins: Q = .05
    torch.testing.assert_close(adv[4:], torch.tensor([-0.05, 0.05, 0.15, 0.85]))


def test_hook_without_rewards_fails_loudly():
    batch = make_batch()
    batch.rewards = None
    run = make_run({"gapo": rlmix_gapo})
    with pytest.raises(RuntimeError, match="rewards"):
        run.hook.rlmix_advantage(run=run, batch=batch)


@pytest.mark.parametrize("override", [
    "gapo.interval=mean", "gapo.scale=batch", "gapo.min_fraction=0", "gapo.min_fraction=1.5",
    "gapo.eps=-1", "gapo.window=3",
])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="gapo"):
        make_run({"gapo": rlmix_gapo}, [override])


def test_settings_defaults():
    s = rlmix_gapo.Settings()
    assert (s.interval, s.min_fraction, s.scale, s.eps) == ("snr", 0.5, "baseline", 1e-6)


# ---------------------------------------------------------------- learning on the toy policy


class PlainClip:
    """A minimal REINFORCE loss (-A logp) so this test needs no other plugin."""

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        adv = mb.batch.token_advantages()
        return rlmix.LossTerms(loss=-adv * logp, mask=mb.batch.completion_mask,
                               mode="seq-mean-token-mean")


def _fraction_of_zeros(batch):
    return (batch.tokens[:, 1:] == 0).float().mean(-1)


def test_gapo_learns_the_toy_task():
    toy = ToyPolicy(vocab=6, length=4, seed=0)
    history = toy_train(make_run({"clip": PlainClip, "gapo": rlmix_gapo}), toy,
                        _fraction_of_zeros, steps=150)
    assert sum(history[:3]) / 3 < 0.4  # chance is 1/6
    assert sum(history[-20:]) / 20 > 0.85
