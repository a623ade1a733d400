"""OPRL: preference pairs, the DPO loss, step rewards and the combined advantage by hand, the
hook with a table PRM, the claim (credit on the deciding position, 0.9 reached sooner than GRPO,
held-out pairs ordered by summed step rewards), and the example manifest on tiny-random."""

from __future__ import annotations

import copy
import io
import json
import math
from pathlib import Path

import pytest
import rlmix_oprl as oprl
import torch
from omegaconf import OmegaConf

import rlmix
from rlmix import cli, ops
from rlmix.testing import ToyPolicy, make_run, skip_unless_installed, toy_train
from rlmix.types import LossTerms

EXAMPLE = Path(oprl.__file__).parents[4] / "examples" / "rewards" / "oprl-arith.yaml"

# ---------------------------------------------------------------- by hand


def test_preference_pairs_inside_groups_only():
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.0])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    assert oprl.preference_pairs(rewards, group) == [(0, 1), (0, 2), (2, 1), (3, 5), (4, 5)]
    assert oprl.preference_pairs(rewards, group, max_pairs=1) == [(0, 1), (3, 5)]
    assert oprl.preference_pairs(torch.ones(4), torch.zeros(4, dtype=torch.long)) == []


def test_dpo_loss_and_log_ratio_by_hand():
    logp = torch.tensor([[0.0, -1.0, -1.0], [0.0, -2.0, -1.0]])
    ref = torch.tensor([[0.0, -1.5, -1.5], [0.0, -1.5, -1.5]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    d = oprl.sequence_log_ratio(logp, ref, mask)
    assert d.tolist() == [1.0, 0.0]
    loss = oprl.dpo_loss(d, [(0, 1)], beta=2.0)
    assert float(loss) == pytest.approx(-math.log(1 / (1 + math.exp(-2.0))))
    assert float(oprl.dpo_loss(d, [], 2.0)) == 0.0


def test_step_rewards_and_advantage_by_hand():
    prm = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.0, -1.0]])
    ref = torch.full((2, 3), -1.0)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    r = oprl.step_rewards(prm, ref, mask, beta=0.5)
    assert r.tolist() == [[0.0, 0.0, -0.5], [0.0, 0.0, 0.0]]
    group = torch.tensor([0, 0])
    # step rewards over the group's 4 tokens: mean -0.125, unbiased std 0.25
    norm = oprl.group_token_normalize(r, mask, group, eps=0.0)
    torch.testing.assert_close(norm, torch.tensor([[0.0, 0.5, -1.5], [0.0, 0.5, 0.5]]))
    rewards = torch.tensor([1.0, 0.0])  # episode: +-1 / sqrt(0.5)
    adv = oprl.oprl_advantage(rewards, group, r, mask, alpha=2.0, eps=0.0)
    e = 0.5 / math.sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.0, e + 1.0, e - 3.0],
                                                  [0.0, -e + 1.0, -e + 1.0]]))
    assert oprl.pair_order_accuracy(torch.tensor([1.0, 0.0, 1.0]), [(0, 1), (1, 2), (0, 2)]) \
        == pytest.approx(1.5 / 3)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="beta"):
        oprl.Settings(beta=0)
    with pytest.raises(ValueError, match="prm_steps"):
        oprl.Settings(prm_steps=-1)


# ---------------------------------------------------------------- a toy where position 2 decides

DECIDES, RIGHT = 1, 3  # completion column 1 (position 2 of 4) decides; token 3 succeeds


class TablePRM:
    """The implicit PRM on the toy: a trainable copy of the starting ToyPolicy's table."""

    def __init__(self, policy: ToyPolicy) -> None:
        self.table = copy.deepcopy(policy)

    def parameters(self):
        return self.table.parameters()

    def logprobs(self, batch):
        return self.table.logprobs(batch)[0]


class GroupNormPG:
    """GRPO on the toy (the baseline, and the clip owner under OPRL)."""

    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        r = batch.rewards
        return (r - ops.group_mean(r, batch.group)) / (ops.group_std(r, batch.group) + 1e-6)

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        loss, _ = ops.clipped_surrogate(logp, logp.detach(), mb.batch.token_advantages(), 0.2,
                                        0.2)
        return LossTerms(loss=loss, mask=mb.batch.completion_mask, mode="token-mean")


class Probe:
    """Records each step's share of advantage magnitude on the deciding position and the
    first batch's tokens (a wrapper: it sees the owner's advantages)."""

    def __init__(self) -> None:
        self.shares: list[float] = []
        self.first: torch.Tensor | None = None

    @rlmix.hookimpl(wrapper=True)
    def rlmix_advantage(self, run, batch):
        adv = yield
        if self.first is None:
            self.first = batch.tokens.clone()
        full = (adv if adv.dim() == 2 else adv[:, None].expand_as(batch.completion_mask))
        full = (full * batch.completion_mask).abs()
        total = float(full.sum())
        self.shares.append(float(full[:, 1 + DECIDES].sum()) / total if total else float("nan"))
        return adv


def deciding_reward(batch):
    return (batch.tokens[:, 1 + DECIDES] == RIGHT).float()


def _train(arm: str, seed: int, steps: int = 60):
    probe = Probe()
    plugins = {"pg": GroupNormPG()}
    if arm == "oprl":
        plugins["oprl"] = oprl  # listed after pg: owns rlmix_advantage, pg keeps the clip
    plugins["probe"] = probe
    run = make_run(plugins, ["oprl.alpha=3.0", "oprl.prm_lr=0.05", "oprl.beta=1.0"]
                   if arm == "oprl" else [])
    policy = ToyPolicy(vocab=6, length=4, seed=seed)
    prm = None
    if arm == "oprl":
        reference = copy.deepcopy(policy)
        run.plugin_resources("oprl")["ref_logprobs"] = lambda b: reference.logprobs(b)[0].detach()
        run.plugin_resources("oprl")["prm"] = prm = TablePRM(policy)
        oprl.rlmix_configure(run)
    history = toy_train(run, policy, deciding_reward, steps=steps, lr=0.05, n_prompts=4,
                        group_size=8)
    reached = next((i for i in range(len(history))
                    if sum(history[max(0, i - 4):i + 1]) / len(history[max(0, i - 4):i + 1])
                    >= 0.9), None)
    return probe, reached, prm, run


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_claim_step_credit_lands_on_the_deciding_position(seed):
    o_probe, o_reached, prm, run = _train("oprl", seed)
    g_probe, g_reached, _, _ = _train("grpo", seed)
    assert torch.equal(o_probe.first, g_probe.first)  # the same first rollouts
    assert len(o_probe.shares) == len(g_probe.shares) == 60  # the same budget
    # steps 25-35: OPRL puts >= 60% of the advantage magnitude on position 2, GRPO 25%
    window = [x for x in o_probe.shares[25:35] if not math.isnan(x)]
    assert sum(window) / len(window) >= 0.6
    g_window = [x for x in g_probe.shares[25:35] if not math.isnan(x)]
    assert all(x == pytest.approx(0.25) for x in g_window)
    # a 5-step mean reward of 0.9 is reached sooner
    assert o_reached is not None and g_reached is not None and o_reached < g_reached
    # held-out pairs from a fresh policy: summed step rewards order them like their outcomes
    fresh = ToyPolicy(vocab=6, length=4, seed=100 + seed).sample(32, 8)
    outcome = deciding_reward(fresh)
    pairs = oprl.preference_pairs(outcome, fresh.group, max_pairs=64)
    with torch.no_grad():
        ref = run.plugin_resources("oprl")["ref_logprobs"](fresh)
        summed = oprl.step_rewards(prm.logprobs(fresh), ref, fresh.completion_mask, 1.0).sum(-1)
    assert len(pairs) >= 100
    assert oprl.pair_order_accuracy(summed, pairs) >= 0.9
    assert run.pending_metrics["oprl/pairs"] >= 0


# ---------------------------------------------------------------- checkpoint and resume


def _oprl_toy_run(start: ToyPolicy, prm: TablePRM):
    run = make_run({"pg": GroupNormPG(), "oprl": oprl},
                   ["oprl.alpha=3.0", "oprl.prm_lr=0.05", "oprl.beta=1.0"])
    reference = copy.deepcopy(start)
    run.plugin_resources("oprl")["ref_logprobs"] = lambda b: reference.logprobs(b)[0].detach()
    run.plugin_resources("oprl")["prm"] = prm
    oprl.rlmix_configure(run)
    return run


def test_resume_restores_the_implicit_prm_and_its_optimizer():
    start = ToyPolicy(vocab=6, length=4, seed=3)
    run = _oprl_toy_run(start, TablePRM(start))
    policy = copy.deepcopy(start)
    toy_train(run, policy, deciding_reward, steps=8, lr=0.05, n_prompts=4, group_size=8)
    trained = run.plugin_resources("oprl")["prm"].table.logits.detach().clone()
    assert not torch.equal(trained, start.logits)  # the PRM learned something
    saved = io.BytesIO()
    torch.save(run.state, saved)  # what the core's checkpoint writes (state.pt)
    # the resumed run: configure builds a fresh PRM from the starting policy, then the core
    # restores run.state; the next advantage call must continue from the checkpointed PRM
    resumed = _oprl_toy_run(start, TablePRM(start))
    saved.seek(0)
    resumed.state.clear()
    resumed.state.update(torch.load(saved, weights_only=False))
    cold = _oprl_toy_run(start, TablePRM(start))  # the old behaviour: the state is lost
    batch = policy.sample(4, 8)
    batch.rewards = deciding_reward(batch)
    adv = {name: r.hook.rlmix_advantage(run=r, batch=copy.deepcopy(batch))
           for name, r in (("live", run), ("resumed", resumed), ("cold", cold))}
    assert resumed.pending_metrics["oprl/restored"] == 1.0
    assert "oprl/restored" not in run.pending_metrics  # the live run is not reloaded
    live_prm = run.plugin_resources("oprl")["prm"].table.logits
    torch.testing.assert_close(resumed.plugin_resources("oprl")["prm"].table.logits, live_prm)
    torch.testing.assert_close(adv["resumed"], adv["live"])
    assert not torch.allclose(adv["cold"], adv["live"])
    # Adam's moments came back too (step count and state), not only the weights
    steps = [int(v["step"]) for v in resumed.plugin_resources("oprl")["optimizer"].state.values()]
    assert steps and steps == [int(v["step"]) for v in run.plugin_resources("oprl")["optimizer"]
                               .state.values()]
    assert resumed.state["oprl"]["prm"][0] is not None  # and the live state is synced again


# ---------------------------------------------------------------- the example manifest


def test_example_manifest_runs_and_resumes_on_tiny_random(tmp_path):
    """Two steps with a checkpoint each step, then ``--resume`` to three: the real PRM (a copy
    of the model) and its Adam state come back from the checkpoint (``oprl/restored`` on the
    resumed step only)."""
    skip_unless_installed(EXAMPLE)
    cfg = OmegaConf.load(EXAMPLE)
    assert cfg.model == "tiny-random" and "oprl" in cfg.plugins
    out = tmp_path / "ex"
    args = ["run", str(EXAMPLE), "arith.eval_size=2", "arith.eval_max_new_tokens=4",
            "sampling.max_new_tokens=6", "log.progress=false", "log.plot=false",
            "train.eval_every=0", "train.checkpoint_every=1", f"out={out}"]
    assert cli.main([*args, "train.steps=2"]) == 0
    saved = torch.load(out / "checkpoints" / "step-000002" / "state.pt", weights_only=False)
    assert saved["oprl"]["prm"] and "optimizer" in saved["oprl"]  # (no pairs: no Adam step)
    assert cli.main([*args, "train.steps=3", "--resume"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "oprl/dpo_loss" in rows[-1] and "oprl/pair_accuracy" in rows[-1]
    assert [r.get("oprl/restored", 0.0) for r in rows] == [0.0, 0.0, 1.0]
