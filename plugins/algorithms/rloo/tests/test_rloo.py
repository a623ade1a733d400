"""Tests of the RLOO plugin: the leave-one-out advantage against hand-computed values, edge cases,
the hook and settings, the paper's claim (unbiasedness, against the (k-1)/k shrinkage of a
baseline that includes the sample) computed exactly on the toy policy, learning on the toy task,
and parity with verl and TRL when they are installed."""

from __future__ import annotations

import itertools
import statistics

import pytest
import rlmix_rloo
import torch
from rlmix_rloo import leave_one_out_advantage, whiten

import rlmix
from rlmix import ops
from rlmix.testing import ToyPolicy, make_batch, make_run, toy_train
from rlmix.types import LossTerms, RolloutBatch

# ---------------------------------------------------------------- leave_one_out_advantage


def test_hand_computed_with_ragged_groups_an_agreeing_group_and_a_group_of_one():
    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0, 4.0, 4.0, 4.0, 7.0, 1.0, 2.0, 9.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3])
    expected = torch.tensor([
        1 - 5 / 3, 0 - 6 / 3, 3 - 3 / 3, 2 - 4 / 3,  # group 0: r_i - mean of the other three
        0.0, 0.0, 0.0,                             # group 1: everyone agrees
        7 - 1.5, 1 - 4.5, 2 - 4.0,                 # group 2: three samples
        0.0,                                       # group 3: alone, nothing to compare with
    ])
    adv = leave_one_out_advantage(rewards, group)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv, expected)


def test_is_k_over_k_minus_1_times_the_group_centred_reward():
    g = torch.Generator().manual_seed(0)
    for k in (2, 3, 5, 8):
        rewards = torch.randn(4 * k, generator=g, dtype=torch.float64)
        group = torch.arange(4).repeat_interleave(k)
        centred = rewards - ops.group_mean(rewards, group)
        torch.testing.assert_close(leave_one_out_advantage(rewards, group), k / (k - 1) * centred)


def test_a_batch_of_one_and_interleaved_groups():
    assert leave_one_out_advantage(torch.tensor([3.0]), torch.tensor([0])).tolist() == [0.0]
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(12, generator=g)
    group = torch.arange(3).repeat_interleave(4)
    perm = torch.randperm(12, generator=g)
    torch.testing.assert_close(leave_one_out_advantage(rewards[perm], group[perm]),
                               leave_one_out_advantage(rewards, group)[perm])


def test_whiten_uses_the_unbiased_batch_std_plus_eps_and_is_zero_for_one_sample():
    values = [1.0, -2.0, 0.5, 4.0]
    adv = whiten(torch.tensor(values), eps=0.5)
    mean, std = statistics.mean(values), statistics.stdev(values)
    torch.testing.assert_close(adv, torch.tensor([(v - mean) / (std + 0.5) for v in values]))
    assert whiten(torch.tensor([3.0])).tolist() == [0.0]
    assert (whiten(torch.full((5,), 2.0)) == 0).all()


# ---------------------------------------------------------------- hook and settings


def test_hook_returns_the_leave_one_out_advantage_and_normalises_when_asked():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 1.0, 5.0])
    batch = make_batch(rewards=rewards)
    run = make_run({"rloo": rlmix_rloo})
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    torch.testing.assert_close(adv, leave_one_out_advantage(rewards, batch.group))
    assert adv.shape == (8,)
    run = make_run({"rloo": rlmix_rloo}, ["rloo.normalize=true", "rloo.eps=0.1"])
    torch.testing.assert_close(run.hook.rlmix_advantage(run=run, batch=batch),
                               whiten(leave_one_out_advantage(rewards, batch.group), 0.1))


@pytest.mark.parametrize("override", ["rloo.eps=-1", "rloo.normalize=maybe", "rloo.scale=1"])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="rloo"):
        make_run({"rloo": rlmix_rloo}, [override])


def test_settings_defaults():
    s = rlmix_rloo.Settings()
    assert (s.normalize, s.eps) == (False, 1e-4)


# ---------------------------------------------------------------- the claim, exactly


def _all_outcomes(toy: ToyPolicy) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(toy.vocab), repeat=toy.length)))


def _batch_of(draws: torch.Tensor, group: torch.Tensor) -> RolloutBatch:
    n = len(draws)
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), draws], 1)
    return RolloutBatch(group=group, tokens=tokens,
                        attention_mask=torch.ones_like(tokens),
                        completion_mask=torch.cat([torch.zeros(n, 1),
                                                   torch.ones(n, draws.shape[1])], 1),
                        behavior_logp=torch.zeros(tokens.shape),
                        policy_version=torch.zeros(n, dtype=torch.long))


def _expected_gradients(k: int):
    """Exact expectations over every k-tuple of completions of the toy policy of the policy
    gradient estimate ``(1/k) sum_i A_i grad log pi(y_i)``, for the leave-one-out advantage and
    for ``r_i - mean(group)``; and the true gradient of ``E[r]``."""
    toy = ToyPolicy(vocab=3, length=2, seed=0)
    with torch.no_grad():
        toy.logits.copy_(torch.randn(toy.logits.shape, generator=torch.Generator().manual_seed(3)))
    outcomes = _all_outcomes(toy)  # the 9 possible completions
    reward = outcomes[:, 0].float() + 0.5 * (outcomes[:, 1] == 2).float()  # any fixed reward

    logp_outcome, _ = toy.logprobs(_batch_of(outcomes, torch.zeros(9, dtype=torch.long)))
    true = torch.autograd.grad((logp_outcome.sum(-1).exp() * reward).sum(), toy.logits)[0]

    tuples = torch.tensor(list(itertools.product(range(len(outcomes)), repeat=k)))  # [9^k, k]
    rows = tuples.reshape(-1)
    group = torch.arange(len(tuples)).repeat_interleave(k)
    batch = _batch_of(outcomes[rows], group)
    logp, _ = toy.logprobs(batch)
    logp_seq = logp.sum(-1)
    prob_tuple = logp_seq.detach().view(-1, k).sum(-1).exp()[group]
    assert float(prob_tuple.sum()) == pytest.approx(k, rel=1e-4)  # each tuple counted k times
    r = reward[rows]
    grads = {}
    for name, adv in (("loo", leave_one_out_advantage(r, group)),
                      ("mean", r - ops.group_mean(r, group))):
        surrogate = (prob_tuple * adv * logp_seq).sum() / k
        grads[name] = torch.autograd.grad(surrogate, toy.logits, retain_graph=True)[0]
    return true, grads


@pytest.mark.parametrize("k", [2, 3, 4])
def test_leave_one_out_is_unbiased_and_the_inclusive_baseline_shrinks_by_k_minus_1_over_k(k):
    true, grads = _expected_gradients(k)
    assert float(true.abs().max()) > 0.05  # a real gradient to estimate
    torch.testing.assert_close(grads["loo"], true, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["mean"], (k - 1) / k * true, rtol=1e-4, atol=1e-6)
    shortfall = float((true - grads["mean"]).norm() / true.norm())
    assert shortfall == pytest.approx(1 / k, rel=1e-3)  # a bias, not noise


class PolicyGradient:
    """A local loss owner: plain REINFORCE, -A * logp per token (no other plugin needed)."""

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        adv = mb.batch.token_advantages()
        return LossTerms(loss=-adv * logp, mask=mb.batch.completion_mask,
                         mode="seq-mean-token-sum")


class ZeroAdvantage:
    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        return torch.zeros(len(batch))


def _fraction_of_zeros(batch):
    return (batch.tokens[:, 1:] == 0).float().mean(-1)


def test_rloo_learns_the_toy_task_and_beats_zero_advantage():
    steps = 150
    history = toy_train(make_run({"pg": PolicyGradient, "rloo": rlmix_rloo}),
                        ToyPolicy(vocab=6, length=4, seed=0), _fraction_of_zeros, steps=steps)
    baseline = toy_train(make_run({"pg": PolicyGradient, "zero": ZeroAdvantage}),
                         ToyPolicy(vocab=6, length=4, seed=0), _fraction_of_zeros, steps=steps)
    assert sum(history[:3]) / 3 < 0.4
    assert sum(history[-20:]) / 20 > 0.85
    assert sum(baseline[-20:]) / 20 < 0.4


# ---------------------------------------------------------------- parity


def _parity_rewards():
    g = torch.Generator().manual_seed(11)
    rewards = torch.randint(0, 5, (16,), generator=g).float() + torch.rand(16, generator=g)
    rewards[4:8] = 1.5  # one group whose rewards agree
    return rewards


@pytest.mark.parity
def test_parity_with_verl_rloo_advantages():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    import numpy as np

    rewards = _parity_rewards()[:14]
    group = torch.tensor([0] * 4 + [1] * 4 + [2] * 3 + [3] * 2 + [4])  # ragged, one alone
    width = 6
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, width + 1, (len(rewards),), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(rewards)), lengths - 1] = rewards
    ours = leave_one_out_advantage(rewards, group)[:, None] * mask
    index = np.array(group.tolist())

    vectorised, _ = core_algos.compute_rloo_vectorized_outcome_advantage(
        token_rewards.clone(), mask, index)
    torch.testing.assert_close(ours, vectorised, atol=1e-5, rtol=1e-5)

    looped, _ = core_algos.compute_rloo_outcome_advantage(token_rewards.clone(), mask, index)
    alone = group == 4
    torch.testing.assert_close(ours[~alone], looped[~alone], atol=1e-5, rtol=1e-5)
    # verl's loop version leaves a sample that is alone in its group at its raw reward (its
    # vectorised version, TRL and rlmix give 0)
    torch.testing.assert_close(looped[alone], rewards[alone][:, None] * mask[alone])


@pytest.mark.parity
@pytest.mark.parametrize("normalize", [False, True])
def test_parity_with_trl_rloo_trainer_advantages(normalize):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import tempfile

    from trl import RLOOConfig, RLOOTrainer

    from rlmix.policy import tiny_random

    rewards = _parity_rewards()
    k = 4

    def fixed_rewards(completions, **kwargs):
        # TRL's own generation runs; the reward function hands back our rewards in row order
        assert len(completions) == len(rewards)
        return rewards.tolist()

    model, tok = tiny_random()
    args = RLOOConfig(output_dir=tempfile.mkdtemp(prefix="rlmix-trl-"), use_cpu=True,
                      report_to="none", save_strategy="no", num_generations=k,
                      per_device_train_batch_size=len(rewards), max_completion_length=3,
                      beta=0.0, normalize_advantages=normalize)
    trainer = RLOOTrainer(model=model, reward_funcs=fixed_rewards, args=args,
                          train_dataset=datasets.Dataset.from_dict({"prompt": ["ab"]}),
                          processing_class=tok)
    prompts = [{"prompt": p} for p in ("ab", "cd", "ef", "gh") for _ in range(k)]
    theirs = trainer._generate_and_score_completions(prompts)["advantages"]

    group = torch.arange(len(rewards) // k).repeat_interleave(k)
    ours = leave_one_out_advantage(rewards, group)
    if normalize:
        ours = whiten(ours, 1e-4)  # TRL's normalize_advantages: (A - mean) / (std + 1e-4)
    torch.testing.assert_close(ours, theirs.float(), atol=1e-5, rtol=1e-5)
    assert (theirs[4:8] == 0).all() or normalize
