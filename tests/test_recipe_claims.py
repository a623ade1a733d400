"""The claims of five recipes of examples/recipes (no new plugin each: a manifest, a README
paragraph and this test): LOOP, Flow-GRPO, AsyncWebRL's loss fix, NeMo-RL speculative decoding
and HRPO. Each runs the recipe's plugins and a baseline on the same world at the same budget.
A recipe whose plugins are not installed is skipped."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import rlmix
from rlmix import loop, manifest, ops
from rlmix.testing import ToyPolicy, make_run, toy_train
from rlmix.types import Minibatch, Normalizers

from .conftest import ROOT

RECIPES = ROOT / "examples" / "recipes"


def _plugin(name: str):
    return pytest.importorskip(f"rlmix_{name}")


def _recipe_run(stem: str, extra: list[str] | None = None):
    cfg = manifest.read(RECIPES / f"{stem}.yaml",
                        ["model=tiny-random", "log.progress=false", "train.max_staleness=0",
                         "train.prompts_per_step=2", "train.group_size=4",
                         "sampling.max_new_tokens=8", *(extra or [])])
    from rlmix.testing import skip_unless_installed

    skip_unless_installed(RECIPES / f"{stem}.yaml")
    return loop.build_run(cfg)


def _fraction_of_zeros(batch):
    return (batch.tokens[:, 1:] == 0).float().mean(-1)


class ZeroAdvantage:
    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        return torch.zeros(len(batch))


# ---------------------------------------------------------------- LOOP


def _models_held(run) -> int:
    """Model copies the run holds besides the policy (critics, references) in resources,
    including each plugin's own namespace (``run.plugin_resources(name)``, a dict in there)."""
    values = list(run.resources.values())
    values += [v for d in values if isinstance(d, dict) for v in d.values()]
    return sum(isinstance(v, torch.nn.Module) for v in values)


def test_loop_keeps_one_model_copy_and_learns_without_a_critic():
    grpo, rloo = _plugin("grpo"), _plugin("rloo")
    run = _recipe_run("loop")
    assert _models_held(run) == 0  # no value network, no reference: one copy of the LLM
    optimised = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    assert optimised == {id(p) for p in run.policy.model.parameters()}
    _plugin("ppo")
    ppo_cfg = manifest.read(ROOT / "examples" / "ppo-arith.yaml",
                            ["model=tiny-random", "log.progress=false"])
    assert _models_held(loop.build_run(ppo_cfg)) >= 1  # the baseline, PPO, holds a critic

    steps = 200
    loop_hist = toy_train(make_run({"grpo": grpo, "rloo": rloo}), ToyPolicy(seed=0),
                          _fraction_of_zeros, steps=steps)
    zero_hist = toy_train(make_run({"grpo": grpo, "zero": ZeroAdvantage}), ToyPolicy(seed=0),
                          _fraction_of_zeros, steps=steps)
    assert len(loop_hist) == len(zero_hist) == steps  # 4 x 8 rollouts a step, both
    print(f"LOOP mean reward, last 20 steps: {sum(loop_hist[-20:]) / 20:.3f}, zero advantage "
          f"{sum(zero_hist[-20:]) / 20:.3f}")
    assert sum(loop_hist[-20:]) / 20 > 0.9 > 0.4 > sum(zero_hist[-20:]) / 20


# ---------------------------------------------------------------- Flow-GRPO


def test_flow_grpo_broadcasts_the_trajectory_outcome_to_every_turn():
    grpo = _plugin("grpo")
    cfg = OmegaConf.load(RECIPES / "flow_grpo.yaml")
    assert list(cfg.plugins) == ["hf", "tools", "grpo"]
    run = make_run({"grpo": grpo}, [f"grpo.loss_mode={cfg.grpo.loss_mode}"])
    # four episodes of one prompt: turn 1 (3 tokens), a tool message (2, masked), turn 2 (2)
    n, width = 4, 1 + 3 + 2 + 2
    turn1, tool, turn2 = slice(1, 4), slice(4, 6), slice(6, 8)
    cmask = torch.zeros(n, width)
    cmask[:, turn1] = 1.0
    cmask[:, turn2] = 1.0
    batch = rlmix.RolloutBatch(
        group=torch.zeros(n, dtype=torch.long), tokens=torch.randint(0, 9, (n, width)),
        attention_mask=torch.ones(n, width, dtype=torch.long), completion_mask=cmask,
        behavior_logp=torch.zeros(n, width), policy_version=torch.zeros(n, dtype=torch.long),
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]))
    batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
    logp = torch.full((n, width), -1.0, requires_grad=True)
    mb = Minibatch(batch=batch, normalizers=Normalizers(float(cmask.sum()), float(n), 8.0))
    terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=torch.zeros(n, width))
    ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers).backward()
    grad = logp.grad
    # every model token of both turns carries its episode's outcome; the tool tokens nothing
    assert (grad[:, tool] == 0).all()
    per_token = grad[:, turn1].mean(-1)
    assert (grad[:, turn1].std(-1) == 0).all() and (grad[:, turn2].std(-1) == 0).all()
    torch.testing.assert_close(grad[:, turn1].sum(-1), grad[:, turn2].sum(-1) * 3 / 2)
    assert (per_token[[0, 3]] < 0).all() and (per_token[[1, 2]] > 0).all()
    # the baseline, credit only on the final turn, leaves the first turn with no gradient
    last_only = batch.token_advantages().clone()
    last_only[:, turn1] = 0
    assert (last_only[:, turn1] == 0).all() and (grad[:, turn1] != 0).all()


# ---------------------------------------------------------------- AsyncWebRL's loss fix

LONG = 8


def _length(draws):
    return torch.where(draws[:, 0] % 2 == 1, LONG, 1)  # odd first token: a long answer


def _correct(batch):
    return (batch.tokens[:, 1] >= 2).float()  # 2, 3 right; 0, 1 wrong: length is free


class PerTrajectoryNormaliser:
    """GRPO's 1/|tau_i|: the owner's loss averaged per sequence."""

    @rlmix.hookimpl(wrapper=True)
    def rlmix_clip(self, run, mb, logp, entropy):
        terms = yield
        terms.mode = "seq-mean-token-mean"
        return terms


def _train_sgd(run, policy, steps=150):
    opt = torch.optim.SGD(policy.parameters(), lr=2.0)  # Adam would hide per-token weights
    for step in range(steps):
        run.step = step
        batch = policy.sample(8, 8, _length)
        batch.rewards = _correct(batch)
        batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
        logp, entropy = policy.logprobs(batch)
        nz = Normalizers(float(batch.completion_mask.sum()), float(len(batch)), float(LONG))
        terms = run.hook.rlmix_clip(run=run, mb=Minibatch(batch=batch, normalizers=nz),
                                    logp=logp, entropy=entropy)
        opt.zero_grad()
        ops.aggregate_loss(terms.loss, terms.mask, terms.mode, nz).backward()
        opt.step()


def _shares(policy):
    p = torch.softmax(policy.logits.detach()[0], -1)
    return float(p[1] / (p[0] + p[1])), float(p[2] + p[3])  # P(long | wrong), P(right)


def test_asyncwebrl_constant_normaliser_stops_failures_growing_long():
    dr_grpo = _plugin("dr_grpo")
    cfg = OmegaConf.load(RECIPES / "asyncwebrl.yaml")
    assert "dr_grpo" in cfg.plugins and cfg.train.loss_norm_constant > 0
    fixed = ToyPolicy(vocab=4, length=LONG, seed=0)
    _train_sgd(make_run({"dr_grpo": dr_grpo}), fixed)
    per_traj = ToyPolicy(vocab=4, length=LONG, seed=0)
    _train_sgd(make_run({"dr_grpo": dr_grpo, "agg": PerTrajectoryNormaliser}), per_traj)
    (long_fixed, right_fixed), (long_traj, right_traj) = _shares(fixed), _shares(per_traj)
    print(f"P(long | wrong): constant 1/k {long_fixed:.3f}, 1/|tau| {long_traj:.3f}; "
          f"P(right): {right_fixed:.3f}, {right_traj:.3f}")
    assert right_fixed > 0.9 and right_traj > 0.9  # success preserved
    assert long_traj > 0.7  # 1/|tau|: failures drift long
    assert long_fixed < 0.6  # the constant: no drift


# ---------------------------------------------------------------- NeMo-RL speculative decoding


def test_speculative_rollouts_are_lossless_against_plain_generation():
    hf = _plugin("hf")
    run = _recipe_run("nemo_rl_speculative", ["sampling.max_new_tokens=12"])
    prompts = [rlmix.Prompt(messages=[{"role": "user", "content": t}], id=t)
               for t in ("What is 2+3?", "What is 40+41?")]
    request = rlmix.GenerationRequest(prompts=prompts, n=2, temperature=0.0,
                                      max_new_tokens=12)
    ours = [run.hook.rlmix_generate(run=run, request=request) for _ in range(2)][-1]
    theirs = hf.rlmix_generate(run=run, request=request)  # the baseline: plain decoding
    assert torch.equal(ours.tokens, theirs.tokens)
    assert ours.texts == theirs.texts
    torch.testing.assert_close(ours.behavior_logp, theirs.behavior_logp, atol=1e-4, rtol=0)
    owner = run.pm.hook.rlmix_generate.get_hookimpls()[-1].plugin_name
    assert owner == "speculative"


# ---------------------------------------------------------------- HRPO


class Clusters:
    """Labels each sample's question cluster before the advantage owner runs."""

    @rlmix.hookimpl(wrapper=True)
    def rlmix_advantage(self, run, batch):
        batch.info = [{"cluster": i % 2} for i in range(len(batch))]
        return (yield)


def test_hrpo_learns_with_one_rollout_per_question_where_grpo_gets_zero():
    grpo, agentwise = _plugin("grpo"), _plugin("agentwise_norm")
    cfg = OmegaConf.load(RECIPES / "hrpo.yaml")
    assert cfg.train.group_size == 1 and cfg.agentwise_norm.scope == "batch"
    steps, n = 150, 16
    hrpo = toy_train(make_run({"grpo": grpo, "agentwise_norm": agentwise, "clusters": Clusters},
                              ["agentwise_norm.key=cluster", "agentwise_norm.scope=batch"]),
                     ToyPolicy(seed=0), _fraction_of_zeros, steps=steps, n_prompts=n,
                     group_size=1)
    plain = toy_train(make_run({"grpo": grpo}), ToyPolicy(seed=0), _fraction_of_zeros,
                      steps=steps, n_prompts=n, group_size=1)
    assert len(hrpo) == len(plain) == steps  # 16 questions x 1 rollout a step, both
    end_h, end_g = sum(hrpo[-20:]) / 20, sum(plain[-20:]) / 20
    print(f"mean reward, last 20 steps: HRPO {end_h:.3f}, GRPO (group of 1) {end_g:.3f}")
    assert end_h > 0.8 and end_g < 0.35
