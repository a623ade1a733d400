"""SPA: steps, features, the progress fit, normalisation and spreading by hand, the hook, the
claim (the deciding step gets the largest contribution; the grounding term raises the valid-
action rate, ablation in the same test; speed against outcome-only GRPO recorded), and the
example manifest on tiny-random."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import rlmix_spa as spa
import torch
from omegaconf import OmegaConf

import rlmix
from rlmix import cli, ops
from rlmix.testing import ToyPolicy, make_batch, make_run, skip_unless_installed
from rlmix.types import LossTerms, Minibatch, Normalizers

EXAMPLE = Path(spa.__file__).parents[4] / "examples" / "rewards" / "spa-arith.yaml"

# ---------------------------------------------------------------- by hand


def test_token_steps_and_step_texts():
    cmask = torch.tensor([[0, 1, 1, 1]]).float()
    assert spa.token_steps(cmask).tolist() == [[-1, 0, 1, 2]]
    ends = torch.tensor([[0, 1, 0, 0]]).bool()
    ids = spa.token_steps(cmask, ends)
    assert ids.tolist() == [[-1, 0, 1, 1]]
    texts = spa.step_texts_of(torch.tensor([[9, 1, 2, 3]]), ids, lambda t: "".join(map(str, t)))
    assert texts == [["1", "23"]]


def test_features_hash_words_and_bigrams_unit_length():
    v = spa.features("open door", 64)
    assert float(v.norm()) == pytest.approx(1.0) and int((v > 0).sum()) in (2, 3)
    assert torch.equal(spa.features("Open  DOOR", 64), v)
    assert float(spa.features("", 64).norm()) == 0.0


def test_fit_progress_makes_contributions_sum_to_outcomes():
    eye = torch.eye(4)
    feats = [eye[[0, 1]], eye[[0, 2]], eye[[3]]]  # three trajectories over 4 step kinds
    outcomes = torch.tensor([1.0, 0.0, 0.5])
    w, loss = spa.fit_progress(torch.zeros(4), feats, outcomes, lr=0.2, epochs=500)
    sums = [float(c.sum()) for c in spa.contributions(w, feats)]
    assert sums == pytest.approx([1.0, 0.0, 0.5], abs=1e-3) and loss < 1e-6
    # minimum-norm answer from 0: the shared step 0 takes half the difference
    assert float(w[1] - w[2]) == pytest.approx(1.0, abs=1e-3)
    w0, loss0 = spa.fit_progress(torch.zeros(4), [torch.zeros(0, 4)], torch.ones(1), 0.1, 3)
    assert torch.equal(w0, torch.zeros(4)) and loss0 == 0.0  # no steps: nothing to fit


def test_step_advantages_and_spread_by_hand():
    rewards = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, -1.0])]
    group = torch.tensor([0, 0])
    adv = spa.step_advantages(rewards, group, eps=0.0)
    # the group's steps: 1, 0, 0, -1 -> mean 0, unbiased std sqrt(2/3)
    s = (2 / 3) ** 0.5
    assert adv[0].tolist() == pytest.approx([1 / s, 0.0]) and adv[1].tolist() == \
        pytest.approx([0.0, -1 / s])
    ids = torch.tensor([[-1, 0, 1, 1], [-1, 0, 0, 1]])
    got = spa.spread(adv, ids)
    assert got[0].tolist() == pytest.approx([0, 1 / s, 0, 0])
    assert got[1].tolist() == pytest.approx([0, 0, 0, -1 / s])
    assert spa.deciding_rank([torch.tensor([0.1, -0.9]), torch.tensor([0.5, 0.2])], 1) == 0.5


def test_hook_through_a_run_logs_and_records_contributions():
    run = make_run({"spa": spa}, ["spa.steps=tokens", "spa.alpha=1.0", "spa.head_epochs=5"])
    batch = make_batch(n_groups=2, group_size=2)
    batch.info = [{"valid_steps": [True] * 5} for _ in range(4)]
    adv = run.hook.rlmix_advantage(run=run, batch=batch)
    assert adv.shape == batch.tokens.shape and torch.isfinite(adv).all()
    assert (adv[batch.completion_mask == 0] == 0).all()
    assert run.pending_metrics["spa/valid_rate"] == 1.0
    assert len(batch.info[0]["spa"]["contributions"]) == int(batch.completion_mask[0].sum())
    assert "weights" in run.state["spa"]


def test_valid_pattern_reads_the_step_text():
    s = spa.Settings(valid_pattern=r"^act\(")
    got = spa._validity(make_batch(n_groups=1, group_size=1), [["act(x)", "oops"]], s)
    assert got[0].tolist() == [1.0, 0.0]


def test_settings_are_checked():
    with pytest.raises(ValueError, match="steps"):
        spa.Settings(steps="turns")
    with pytest.raises(ValueError, match="valid_pattern"):
        spa.Settings(valid_pattern="(")


# ---------------------------------------------------------------- the claim

DECIDES, RIGHT, INVALID = 1, 3, 0  # step 2 of 4 decides; token 0 is an invalid action


class GroupNormPG:
    """Outcome-only GRPO on the toy (the baseline, and the clip owner under SPA)."""

    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        r = batch.rewards
        return (r - ops.group_mean(r, batch.group)) / (ops.group_std(r, batch.group) + 1e-6)

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        loss, _ = ops.clipped_surrogate(logp, logp.detach(), mb.batch.token_advantages(), 0.2,
                                        0.2)
        return LossTerms(loss=loss, mask=mb.batch.completion_mask, mode="token-mean")


def world_reward(batch):
    """Success when step 2's token is 3; validity (token != 0) is reported per step and does
    not change the outcome."""
    draws = batch.tokens[:, 1:]
    for info, row in zip(batch.info, (draws != INVALID).tolist()):
        info["valid_steps"] = row
    return (draws[:, DECIDES] == RIGHT).float()


def _train(arm: str, seed: int, alpha: float = 0.5, steps: int = 40, lr: float = 1.0):
    """``arm``: spa (owns the advantage, pg keeps the clip) | grpo. Plain SGD on the toy's
    logits (Adam's per-parameter scaling hides differences in advantage scale: README).
    Returns the first step whose 5-step mean reward is >= 0.9, the valid-action rate per
    step, the first rollouts and the run."""
    plugins = {"pg": GroupNormPG()}
    if arm == "spa":
        plugins["spa"] = spa  # after pg: owns rlmix_advantage, pg keeps the clip
    overrides = ["spa.steps=tokens", f"spa.alpha={alpha}", "spa.head_lr=0.5",
                 "spa.feature_dim=256"]
    run = make_run(plugins, overrides if arm == "spa" else [])
    policy = ToyPolicy(vocab=6, length=4, seed=seed)
    optimizer = torch.optim.SGD(policy.parameters(), lr=lr)
    history, valid, first = [], [], None
    for step in range(steps):
        run.step = step
        batch = policy.sample(4, 8)
        if first is None:
            first = batch.tokens.clone()
        batch.rewards = world_reward(batch)
        history.append(float(batch.rewards.mean()))
        valid.append(float((batch.tokens[:, 1:] != INVALID).float().mean()))
        batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
        logp, entropy = policy.logprobs(batch)
        norm = Normalizers(tokens=float(batch.completion_mask.sum()), sequences=32.0,
                           norm_constant=4.0)
        terms = run.hook.rlmix_clip(run=run, mb=Minibatch(batch=batch, normalizers=norm),
                                    logp=logp, entropy=entropy)
        loss = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, norm)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    reached = next((i for i in range(len(history))
                    if sum(history[max(0, i - 4):i + 1]) / len(history[max(0, i - 4):i + 1])
                    >= 0.9), None)
    return reached, valid, first, run


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_claim_deciding_step_first_grounding_and_speed_against_grpo(seed):
    """One test, four arms from the same seed at the same budget (40 steps of 4 x 8, SGD lr
    1): SPA (alpha 0.5), SPA without g_t (alpha 0, the ablation), outcome-only GRPO, and GRPO
    at twice the step size (the control that explains the speed-up, README)."""
    s_reached, s_valid, s_first, run = _train("spa", seed)
    a_reached, a_valid, a_first, _ = _train("spa", seed, alpha=0.0)  # ablation: no g_t
    g_reached, g_valid, g_first, _ = _train("grpo", seed)
    g2_reached, _, g2_first, _ = _train("grpo", seed, lr=2.0)
    for other in (a_first, g_first, g2_first):
        assert torch.equal(s_first, other)  # the same first rollouts
    assert len(s_valid) == len(a_valid) == len(g_valid) == 40  # the same budget
    # the progress estimator credits the deciding step: it has the largest |c_t| on fresh
    # trajectories (contributions from the weights trained in the run)
    fresh = ToyPolicy(vocab=6, length=4, seed=200 + seed).sample(16, 8)
    feats = [torch.stack([spa.features(f"p{k}t{t}", 256) for k, t in enumerate(row)])
             for row in fresh.tokens[:, 1:].tolist()]
    contrib = spa.contributions(run.state["spa"]["weights"], feats)
    assert spa.deciding_rank(contrib, DECIDES) >= 0.9
    # the grounding signal: the valid-action rate rises faster with g_t than without
    window = slice(5, 20)
    mean = lambda xs: sum(xs[window]) / len(xs[window])  # noqa: E731
    assert mean(s_valid) > mean(a_valid) + 0.03
    assert mean(s_valid) > mean(g_valid) + 0.03
    # the target in fewer steps than outcome-only GRPO at the same optimiser and step size
    assert s_reached is not None and (g_reached is None or s_reached < g_reached)
    # ... and GRPO at twice the step size is at least as fast: the gain is the size of the
    # deciding step's normalised advantage, not a better direction (README)
    assert g2_reached is not None and g2_reached <= s_reached


# ---------------------------------------------------------------- the example manifest


def test_example_manifest_runs_on_tiny_random(tmp_path):
    skip_unless_installed(EXAMPLE)
    cfg = OmegaConf.load(EXAMPLE)
    assert cfg.model == "tiny-random" and "spa" in cfg.plugins
    out = tmp_path / "ex"
    assert cli.main(["run", str(EXAMPLE), "train.steps=2", "arith.eval_size=2",
                     "arith.eval_max_new_tokens=4", "sampling.max_new_tokens=6",
                     "log.progress=false", "log.plot=false", "train.eval_every=0",
                     f"out={out}"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert "spa/progress_loss" in rows[-1] and "spa/valid_rate" in rows[-1]
