"""Tests of the Dr. MAS agent-wise normalisation: hand-computed advantages for two agents of
very different reward scales, the default agent, group and batch scopes, edge cases, the hook,
equality with GRPO's estimator without agents (inline, and against rlmix-grpo when installed),
and the paper's claim: per-agent normalisation equalises the advantage and gradient scale across
agents, where one global baseline lets the large-reward agent dominate."""

from __future__ import annotations

import math

import pytest
import rlmix_agentwise_norm
import torch
from rlmix_agentwise_norm import agent_ids, agentwise_advantage

import rlmix
from rlmix import ops
from rlmix.testing import ToyPolicy, make_batch, make_run
from rlmix.types import RolloutBatch


def _global(rewards, group, eps=1e-6):
    """GRPO's one baseline for every agent of a group (its group-normalised advantage)."""
    return (rewards - ops.group_mean(rewards, group)) / (ops.group_std(rewards, group) + eps)


class GlobalBaseline:
    """GRPO's estimator as an inline plugin (these tests run without rlmix-grpo installed)."""

    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        return _global(batch.rewards, batch.group)


def test_agent_ids_in_order_of_appearance_with_a_default_agent():
    info = [{"agent": "solver"}, {}, {"agent": "critic"}, {"agent": "solver"}, {"other": 1},
            {"agent": 0}]
    assert agent_ids(info).tolist() == [0, 1, 2, 0, 1, 3]
    assert agent_ids(info, key="other").tolist() == [0, 0, 0, 0, 1, 0]


def test_two_agents_of_very_different_scales_by_hand():
    # one group: solver rewards 1, 3; verifier rewards 10, 30; one sample without an agent
    rewards = torch.tensor([1.0, 10.0, 3.0, 30.0, 5.0])
    group = torch.zeros(5, dtype=torch.long)
    agents = torch.tensor([0, 1, 0, 1, 2])
    eps = 1e-6
    # solver: mean 2, unbiased std sqrt(2); verifier: mean 20, std sqrt(200); lone sample: 0
    s = 1 / math.sqrt(2)
    expected = torch.tensor([-s, -s, s, s, 0.0])
    expected[[0, 2]] *= math.sqrt(2) / (math.sqrt(2) + eps)
    expected[[1, 3]] *= math.sqrt(200) / (math.sqrt(200) + eps)
    torch.testing.assert_close(agentwise_advantage(rewards, group, agents, eps=eps), expected)
    # centring only
    torch.testing.assert_close(agentwise_advantage(rewards, group, agents, scale=False),
                               torch.tensor([-1.0, -10.0, 1.0, 10.0, 0.0]))
    # the global (GRPO) baseline instead: mean 9.8 over all five, one std for everyone
    glob = _global(rewards, group, eps)
    assert float(glob[0]) < 0 and float(glob[2]) < 0  # the solver's better sample looks bad


def test_group_scope_separates_groups_and_batch_scope_pools_them():
    rewards = torch.tensor([0.0, 2.0, 10.0, 14.0, 4.0, 8.0, 20.0, 40.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    agents = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    by_group = agentwise_advantage(rewards, group, agents, "group", scale=False)
    torch.testing.assert_close(by_group, torch.tensor([-1.0, 1, -2, 2, -2, 2, -10, 10]))
    # batch scope: agent 0 has mean 3.5 over both groups, agent 1 mean 21
    by_batch = agentwise_advantage(rewards, group, agents, "batch", scale=False)
    torch.testing.assert_close(by_batch, torch.tensor([-3.5, -1.5, -11, -7, 0.5, 4.5, -1, 19]))
    scaled = agentwise_advantage(rewards, group, agents, "batch")
    a0 = torch.tensor([0.0, 2.0, 4.0, 8.0])
    torch.testing.assert_close(scaled[[0, 1, 4, 5]], (a0 - a0.mean()) / (a0.std() + 1e-6))


def test_without_agents_it_is_grpo_group_normalisation():
    batch = make_batch(n_groups=3, group_size=4, seed=1)
    batch.rewards = torch.randn(12, generator=torch.Generator().manual_seed(0))
    run = make_run({"agentwise_norm": rlmix_agentwise_norm})
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    torch.testing.assert_close(adv, _global(batch.rewards, batch.group))


def test_without_agents_it_matches_the_grpo_plugin():
    grpo = pytest.importorskip("rlmix_grpo")
    batch = make_batch(n_groups=3, group_size=4, seed=1)
    batch.rewards = torch.randn(12, generator=torch.Generator().manual_seed(0))
    batch.rewards[:4] = 1.0  # one group whose rewards all agree
    run = make_run({"agentwise_norm": rlmix_agentwise_norm})
    torch.testing.assert_close(run.hook.rlmix_advantage(run=run, batch=batch),
                               grpo.group_normalized_advantage(batch.rewards, batch.group))


@pytest.mark.parametrize("scope", ["group", "batch"])
def test_identical_rewards_single_samples_and_empty_batches_never_nan(scope):
    rewards = torch.tensor([3.0, 3.0, 3.0, 7.0, 1.0])
    group = torch.tensor([0, 0, 0, 1, 2])
    agents = torch.tensor([0, 1, 0, 0, 1])
    out = agentwise_advantage(rewards, group, agents, scope)
    assert torch.isfinite(out).all()
    if scope == "group":
        assert (out == 0).all()  # every (group, agent) cell is constant or a single sample
    empty = agentwise_advantage(torch.zeros(0), torch.zeros(0, dtype=torch.long),
                                torch.zeros(0, dtype=torch.long), scope)
    assert empty.shape == (0,)


def test_hook_reads_the_agent_key_and_reports_the_agent_count():
    batch = make_batch(n_groups=1, group_size=4)
    batch.rewards = torch.tensor([1.0, 100.0, 3.0, 300.0])
    for i, role in enumerate(["a", "b", "a", "b"]):
        batch.info[i]["role"] = role
    run = make_run({"agentwise_norm": rlmix_agentwise_norm},
                   ["agentwise_norm.key=role", "agentwise_norm.scale=false"])
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    torch.testing.assert_close(adv, torch.tensor([-1.0, -100.0, 1.0, 100.0]))
    assert run.drain_metrics() == {"agentwise_norm/agents": 2.0}  # logged for the step


@pytest.mark.parametrize("override", ["agentwise_norm.scope=global", "agentwise_norm.eps=-1",
                                      "agentwise_norm.key=''", "agentwise_norm.std=1"])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="agentwise_norm"):
        make_run({"agentwise_norm": rlmix_agentwise_norm}, [override])


# ---------------------------------------------------------------- the claim


def _two_agent_batch(seed):
    """64 groups of 8: four samples of a "solver" whose reward is 0 or 10, four of a
    "verifier" whose reward is 0 or 0.1 (a hundred times smaller), success rate 1/2 each."""
    g = torch.Generator().manual_seed(seed)
    toy = ToyPolicy(vocab=6, length=4, seed=seed)
    batch = toy.sample(64, 8)
    agents = torch.tensor([0, 1] * 4).repeat(64)
    wins = (torch.rand(len(batch), generator=g) < 0.5).float()
    batch.rewards = torch.where(agents == 0, 10.0 * wins, 0.1 * wins)
    for info, a in zip(batch.info, agents.tolist()):
        info["agent"] = ["solver", "verifier"][a]
    return toy, batch, agents


def _signal(adv, agents, won, a):
    """How far agent ``a``'s successes sit above its failures: its learning signal."""
    rows = agents == a
    return float(adv[rows & won].mean() - adv[rows & ~won].mean())


def _offset(adv, agents, a):
    return float(adv[agents == a].mean())


def test_agentwise_normalisation_equalises_agents_where_a_global_baseline_lets_one_dominate():
    run_agent = make_run({"agentwise_norm": rlmix_agentwise_norm})
    run_glob = make_run({"global": GlobalBaseline()})
    for seed in range(5):
        _, batch, agents = _two_agent_batch(seed)
        won = batch.rewards > 0
        a_glob = run_glob.hook.rlmix_advantage(run=run_glob, batch=batch)
        a_agent = run_agent.hook.rlmix_advantage(run=run_agent, batch=batch)
        # one shared baseline: the solver's success/failure signal dwarfs the verifier's (100x
        # in groups where the solver's outcomes are mixed; the verifier only gets a signal in
        # groups where the solver's rewards all agree)
        assert _signal(a_glob, agents, won, 0) / _signal(a_glob, agents, won, 1) > 10
        # ... and the baseline sits between the two reward distributions: the verifier's
        # samples are pushed down on average, the solver's up
        assert _offset(a_glob, agents, 1) < -0.3 and _offset(a_glob, agents, 0) > 0.3
        # per-agent statistics: both agents centred, both signals on the same scale
        ratio = _signal(a_agent, agents, won, 0) / _signal(a_agent, agents, won, 1)
        assert 0.7 < ratio < 1.4
        assert abs(_offset(a_agent, agents, 0)) < 1e-5
        assert abs(_offset(a_agent, agents, 1)) < 1e-5
        assert (a_agent[won] >= 0).all() and (a_agent[~won] <= 0).all()

def _train_two_agents(run, steps=150, seed=0, lr=0.1):
    """Two agents with their own toy policies in one group-structured batch (16 groups of 4
    solver + 4 verifier samples): the solver earns 10 x its share of token 0, the verifier
    0.1 x its share of token 1. Advantages come from the run's estimator over the joint batch;
    each policy takes a policy-gradient step on its own rows. Returns, per step, each agent's
    success share (reward / its scale)."""
    solver, verifier = ToyPolicy(6, 4, seed=seed), ToyPolicy(6, 4, seed=seed + 100)
    opts = [torch.optim.Adam(p.parameters(), lr=lr) for p in (solver, verifier)]
    history = []
    for _ in range(steps):
        b_s, b_v = solver.sample(16, 4), verifier.sample(16, 4)
        batch = RolloutBatch.concat([b_s, b_v])
        batch.group = torch.cat([b_s.group, b_v.group])  # the same 16 groups, two agents each
        n = len(b_s)
        r_s = 10 * (b_s.tokens[:, 1:] == 0).float().mean(-1)
        r_v = 0.1 * (b_v.tokens[:, 1:] == 1).float().mean(-1)
        batch.rewards = torch.cat([r_s, r_v])
        for i, info in enumerate(batch.info):
            info["agent"] = "solver" if i < n else "verifier"
        adv = run.hook.rlmix_advantage(run=run, batch=batch)
        for opt, pol, b, a in ((opts[0], solver, b_s, adv[:n]), (opts[1], verifier, b_v, adv[n:])):
            logp, _ = pol.logprobs(b)
            loss = -(a[:, None] * logp * b.completion_mask).sum() / len(b)
            opt.zero_grad()
            loss.backward()
            opt.step()
        history.append((float(r_s.mean()) / 10, float(r_v.mean()) / 0.1))
    return history


def test_with_a_global_baseline_the_small_reward_agent_does_not_learn_per_agent_it_does():
    glob_runs = make_run({"global": GlobalBaseline()})
    agent_runs = make_run({"agentwise_norm": rlmix_agentwise_norm})
    verifier_glob = []
    for seed in range(3):
        g = _train_two_agents(glob_runs, seed=seed)[-20:]
        a = _train_two_agents(agent_runs, seed=seed)[-20:]
        solver_g, verifier_g = (sum(x[k] for x in g) / 20 for k in (0, 1))
        solver_a, verifier_a = (sum(x[k] for x in a) / 20 for k in (0, 1))
        assert solver_g > 0.9 and solver_a > 0.9  # the large-reward agent learns either way
        assert verifier_a > 0.9  # calibrated per agent, the verifier learns too
        assert verifier_g < 0.75  # under the shared baseline its signal drowns in the offset
        verifier_glob.append(verifier_g)
    assert sum(verifier_glob) / 3 < 0.5
