"""Tests of the Step-GRPO plugin: step splitting on examples, the step-aware relative penalty by
hand (baselines, eligibility, cap, groups), the score hook through the core's weighted sum, and
the paper's claim in miniature on the toy policy: fewer reasoning steps at no cost in accuracy."""

from __future__ import annotations

import pytest
import rlmix_step_grpo
import torch
from rlmix_step_grpo import count_steps, split_steps, step_penalty

import rlmix
from rlmix import ops
from rlmix.loop import score
from rlmix.testing import ToyPolicy, make_batch, make_run, toy_train
from rlmix.types import LossTerms

# ---------------------------------------------------------------- splitting


@pytest.mark.parametrize("text, steps", [
    ("First, add 3 and 4. Then multiply by 2. Finally, the answer is 14.",
     ["First, add 3 and 4.", "Then multiply by 2.", "Finally, the answer is 14."]),
    ("Step 1: add. Step 2: carry the one.\nSo 57", ["Step 1: add.", "Step 2: carry the one.",
                                                    "So 57"]),
    ("Wait, no.\n\n\nAlternatively, 7 - 2 = 5", ["Wait, no.", "Alternatively, 7 - 2 = 5"]),
    ("We add them; Hmm, 12? Therefore 12.", ["We add them;", "Hmm, 12?", "Therefore 12."]),
    ("I think then we add and finally stop", ["I think then we add and finally stop"]),
    ("Firstly we add. Thenceforth it is 9", ["Firstly we add. Thenceforth it is 9"]),
    ("42", ["42"]),
    ("", []),
    ("  \n\n  ", []),
])
def test_split_steps_examples(text, steps):
    assert split_steps(text) == steps


def test_split_steps_without_newlines_and_with_custom_markers():
    text = "Step 1: add.\nStep 2: done.\nthe sum is 9\nok"
    assert len(split_steps(text)) == 4  # every line is a step
    # without newline steps, only markers (after a line break or a sentence end) split
    assert split_steps(text, newlines=False) == ["Step 1: add.",
                                                 "Step 2: done.\nthe sum is 9\nok"]
    assert split_steps("Let me see. Let me add. ok", markers=["Let me"], newlines=False) == [
        "Let me see.", "Let me add. ok"]
    assert split_steps("a. Then b", markers=[], newlines=False) == ["a. Then b"]
    torch.testing.assert_close(count_steps(["a\nb\nc", "", "Then x. Then y."]),
                               torch.tensor([3.0, 0.0, 2.0]))


# ---------------------------------------------------------------- the penalty by hand


def test_penalty_relative_to_the_group_median_by_hand():
    steps = torch.tensor([2.0, 3.0, 5.0, 4.0, 6.0, 6.0, 6.0, 6.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # group 0: median 3.5; excess 1.5 and 0.5 over it, relative 1.5/3.5 and 0.5/3.5
    # group 1: all the same length: no penalty
    expected = torch.tensor([0.0, 0.0, -0.2 * 1.5 / 3.5, -0.2 * 0.5 / 3.5, 0, 0, 0, 0])
    torch.testing.assert_close(step_penalty(steps, group), expected)
    # absolute excess, coefficient 0.1, large cap
    torch.testing.assert_close(
        step_penalty(steps, group, coef=0.1, relative=False, cap=10.0),
        torch.tensor([0.0, 0.0, -0.15, -0.05, 0, 0, 0, 0]))


def test_penalty_only_for_correct_samples_against_the_correct_ones_baseline():
    steps = torch.tensor([2.0, 10.0, 4.0, 6.0, 3.0, 9.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    correct = torch.tensor([True, False, True, True, False, False])
    # group 0: baseline = median of the correct ones (2, 4, 6) = 4; the wrong 10-step one is
    # neither penalised nor part of the baseline. Group 1: nobody correct, nothing
    expected = torch.tensor([0.0, 0.0, 0.0, -0.2 * 2 / 4, 0.0, 0.0])
    torch.testing.assert_close(step_penalty(steps, group, correct), expected)


@pytest.mark.parametrize("baseline, expected", [
    ("median", [0.0, -0.3 * 4.5 / 5.5]),   # median 5.5
    ("mean", [0.0, -0.3 * 4.5 / 5.5]),     # mean 5.5 too
    ("min", [0.0, -0.3 * 1.0]),            # baseline 1: excess 9, capped at 1
])
def test_penalty_baselines_and_cap(baseline, expected):
    out = step_penalty(torch.tensor([1.0, 10.0]), torch.tensor([0, 0]), coef=0.3,
                       baseline=baseline)
    torch.testing.assert_close(out, torch.tensor(expected))
    mean3 = step_penalty(torch.tensor([1.0, 2.0, 9.0]), torch.zeros(3, dtype=torch.long),
                         baseline="mean", coef=1.0, cap=5.0)
    torch.testing.assert_close(mean3, torch.tensor([0.0, 0.0, -5.0 / 4.0]))


def test_penalty_edge_cases_never_nan():
    # single sample groups, zero-step completions (empty texts), identical groups
    steps = torch.tensor([0.0, 0.0, 3.0, 7.0, 0.0, 4.0])
    group = torch.tensor([0, 1, 1, 2, 3, 3])
    out = step_penalty(steps, group)
    assert torch.isfinite(out).all() and (out <= 0).all()
    assert out[0] == 0 and out[3] == 0  # a group of one is its own baseline
    # group 1 (0 and 3 steps): median 1.5, excess 1.5, divided by max(1.5, 1)
    assert float(out[2]) == pytest.approx(-0.2)
    # group 3 (0 and 4): median 2 -> relative excess 1 -> -0.2
    assert float(out[5]) == pytest.approx(-0.2)
    with pytest.raises(ValueError, match="baseline"):
        step_penalty(steps, group, baseline="max")


# ---------------------------------------------------------------- the hook


class TextEnv:
    """Fixed completions; ``correct`` when the text ends with the prompt's answer."""

    def __init__(self, texts):
        self.texts = texts

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        return {"correct": torch.tensor([float(t.strip().endswith("7")) for t in batch.texts])}


TEXTS = ["Then 7", "First 3. Then 4. Then 7", "First 1. Then 2. Then 3. Then 4. Then 7",
         "Then 8",
         "Then 5", "First 3. Then 9", "7", "Then 1. Then 2. Then 3. Then 4. Then 5. Then 6"]


def _batch():
    batch = make_batch(n_groups=2, group_size=4)
    batch.texts = list(TEXTS)
    return batch


def test_score_hook_adds_a_non_positive_penalty_term_to_correctness():
    run = make_run({"env": TextEnv(TEXTS), "step_grpo": rlmix_step_grpo})
    batch = _batch()
    score(run, batch)
    correct = batch.reward_terms["env.correct"]
    penalty = batch.reward_terms["step_grpo.penalty"]
    assert correct.tolist() == [1, 1, 1, 0, 0, 0, 1, 0]
    # group 0: correct ones take 1, 3 and 5 steps -> median 3 -> the 5-step one pays
    # 0.2 * min(1, 2/3); group 1: one correct (its own baseline) -> nothing
    expected = torch.tensor([0.0, 0.0, -0.2 * 2 / 3, 0, 0, 0, 0, 0])
    torch.testing.assert_close(penalty, expected)
    torch.testing.assert_close(batch.rewards, correct + expected)
    assert [i["step_grpo"]["steps"] for i in batch.info] == [1, 3, 5, 1, 1, 2, 1, 6]


def test_correct_term_choices_and_manifest_order():
    # listed before the env: "auto" still finds the env's "correct" term
    run = make_run({"step_grpo": rlmix_step_grpo, "env": TextEnv(TEXTS)},
                   ["step_grpo.correct_term=env.correct"])
    batch = _batch()
    score(run, batch)
    assert float(batch.reward_terms["step_grpo.penalty"][2]) == pytest.approx(-0.2 * 2 / 3)
    # "" penalises everyone against the whole group's median
    run = make_run({"env": TextEnv(TEXTS), "step_grpo": rlmix_step_grpo},
                   ["step_grpo.correct_term=''"])
    batch = _batch()
    score(run, batch)
    steps = torch.tensor([1.0, 3.0, 5.0, 1.0, 1.0, 2.0, 1.0, 6.0])
    torch.testing.assert_close(batch.reward_terms["step_grpo.penalty"],
                               step_penalty(steps, batch.group))
    assert float(batch.reward_terms["step_grpo.penalty"][7]) < 0  # wrong, long: penalised now
    # no scorer with a "correct" term: "auto" treats every sample as eligible
    run = make_run({"step_grpo": rlmix_step_grpo})
    batch = _batch()
    score(run, batch)
    torch.testing.assert_close(batch.reward_terms["step_grpo.penalty"],
                               step_penalty(steps, batch.group))


def test_a_correct_term_of_a_missing_plugin_fails_at_configure():
    run = make_run({"step_grpo": rlmix_step_grpo}, ["step_grpo.correct_term=math.correct"])
    with pytest.raises(rlmix.ConfigError, match="math"):
        rlmix_step_grpo.rlmix_configure(run)
    with pytest.raises(rlmix.ConfigError, match="math.correct"):
        score(run, _batch())


@pytest.mark.parametrize("override", [
    "step_grpo.baseline=max", "step_grpo.coef=-1", "step_grpo.markers=['(']",
    "step_grpo.correct_term=correct", "step_grpo.steps=3",
])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="step_grpo"):
        make_run({"step_grpo": rlmix_step_grpo}, [override])


# ---------------------------------------------------------------- the claim, in miniature


class GRPOLike:
    """Group-normalised advantages and the single-update policy-gradient surrogate, inline so
    these tests run with this plugin alone installed."""

    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        r, g = batch.rewards, batch.group
        return (r - ops.group_mean(r, g)) / (ops.group_std(r, g) + 1e-6)

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        adv = mb.batch.token_advantages()
        return LossTerms(loss=-adv * torch.exp(logp - logp.detach()),
                         mask=mb.batch.completion_mask, mode="seq-mean-token-mean")


def _toy_texts(batch):
    # token 0 is "nothing", any other token is one reasoning step; token 5 states the answer
    return [" ".join(f"Then s{v}." for v in row if v != 0) for row in batch.tokens[:, 1:].tolist()]


def _correct(batch):
    return (batch.tokens[:, 1:] == 5).any(-1)


def _train(with_penalty, steps=200):
    history = {"steps": [], "accuracy": []}

    def reward(batch):
        texts = _toy_texts(batch)
        n = count_steps(texts)
        correct = _correct(batch)
        history["steps"].append(float(n[correct].mean()) if correct.any() else 0.0)
        history["accuracy"].append(float(correct.float().mean()))
        total = correct.float()
        if with_penalty:
            total = total + step_penalty(n, batch.group, correct, coef=0.5)
        return total

    toy = ToyPolicy(vocab=6, length=6, seed=0)
    toy_train(make_run({"pg": GRPOLike()}), toy, reward, steps=steps, lr=0.05)
    return history


def test_step_aware_reward_shortens_correct_reasoning_without_losing_accuracy():
    plain, step = _train(False), _train(True)
    last = slice(-30, None)

    def mean(xs):
        return sum(xs[last]) / len(xs[last])

    # at the start a correct completion takes about 5 steps
    assert 4.0 < sum(step["steps"][:5]) / 5 < 6.5
    assert mean(plain["accuracy"]) > 0.95 and mean(step["accuracy"]) > 0.95
    assert mean(step["accuracy"]) > mean(plain["accuracy"]) - 0.03
    # GRPO on correctness alone keeps the long answers; the step-aware penalty cuts them
    assert mean(plain["steps"]) > 4.0
    assert mean(step["steps"]) < 0.35 * mean(plain["steps"])
