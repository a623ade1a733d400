"""FAPO: the rule detector, the judge detector (scripted, malformed verdicts), the scheduled
penalty by hand, the hook through the core's scoring, the claim on a toy policy, and the example
manifest on tiny-random."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import rlmix_fapo as fapo
import torch
from omegaconf import OmegaConf
from rlmix_lm.judges import ScriptedJudge, every_kth_malformed

import rlmix
from rlmix import cli, loop, ops
from rlmix.testing import ToyPolicy, make_batch, make_run, skip_unless_installed, toy_train
from rlmix.types import LossTerms, Prompt

EXAMPLE = Path(fapo.__file__).parents[4] / "examples" / "rewards" / "fapo-arith.yaml"

# ---------------------------------------------------------------- detectors


def test_rule_detector_guess_words_and_jump_in():
    texts = ["I guess 7", "3 + 4 = 7\n7", "Probably 7", "7", "a\nb\n7", "guessing: 7",
             "the unguessable 7"]
    assert fapo.rule_flaws(texts).tolist() == [True, False, True, False, False, True, False]
    # min_steps 2: the answer needs two reasoning lines before it
    got = fapo.rule_flaws(texts, guess_patterns=[], min_steps=2)
    assert got.tolist() == [True, True, True, True, False, True, True]
    assert fapo.rule_flaws([""], [], 1).tolist() == [True]


def guess_verdict(text):
    """Flawed when the solution (between the prompt's markers) says "guess"."""
    return {"flawed": "guess" in text.split("<<<SOLUTION")[1]}


def test_judge_detector_reads_verdicts_and_counts_malformed():
    judge = ScriptedJudge(every_kth_malformed(2, guess_verdict))
    questions = ["1+1?"] * 4
    flawed, malformed = fapo.judge_flaws(judge, questions, ["guess 2", "1+1=2\n2", "guess", "x"])
    # calls 2 and 4 are malformed: scored as not flawed, and counted
    assert flawed.tolist() == [True, False, True, False]
    assert malformed.tolist() == [False, True, False, True]
    assert judge.calls == 4 and "1+1?" in judge.prompts[0] and "guess 2" in judge.prompts[0]


def test_judge_prompt_is_cut_and_fenced():
    judge = ScriptedJudge(lambda text: {"flawed": False})
    fapo.judge_flaws(judge, ["q"], ["x" * 50 + "TAIL"], max_chars=10)
    assert "TAIL" not in judge.prompts[0] and "<<<SOLUTION\nxxxxxxxxxx\nSOLUTION>>>" in \
        judge.prompts[0]


# ---------------------------------------------------------------- the penalty by hand


def test_penalty_scaled_by_group_accuracy():
    # group 0: 1 correct of 4 (flawed) -> -0.25; group 1: 4 of 4, two flawed -> -1 each
    correct = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1]).bool()
    flawed = torch.tensor([1, 1, 0, 0, 1, 0, 1, 0]).bool()
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    got = fapo.flaw_penalty(correct, flawed, group)
    assert got.tolist() == [-0.25, 0, 0, 0, -1, 0, -1, 0]
    got = fapo.flaw_penalty(correct, flawed, group, "constant", 0.5)
    assert got.tolist() == [-0.5, 0, 0, 0, -0.5, 0, -0.5, 0]
    # a flawed positive still earns at least a wrong answer (coef 1), and less than a clean one
    total = correct.float() + fapo.flaw_penalty(correct, flawed, group)
    assert total[4] < total[5] and total[0] > total[1]


def test_settings_are_checked():
    with pytest.raises(ValueError, match="detector"):
        fapo.Settings(detector="genrm")
    with pytest.raises(ValueError, match="correct_term"):
        fapo.Settings(correct_term="correct")
    with pytest.raises(ValueError, match="guess_patterns"):
        fapo.Settings(guess_patterns=["("])


# ---------------------------------------------------------------- the hook


class Verifier:
    """A scorer whose ``correct`` term is ``batch.info[i]["ok"]``."""

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        return {"correct": torch.tensor([float(i["ok"]) for i in batch.info])}


def _batch(texts, ok):
    batch = make_batch(n_groups=1, group_size=len(texts))
    batch.texts = list(texts)
    batch.prompts = [Prompt(messages=[{"role": "user", "content": "what is 3+4?"}])] * len(texts)
    batch.info = [{"ok": o} for o in ok]
    return batch


def test_hook_sums_with_the_verifier_through_core_scoring():
    run = make_run({"verifier": Verifier(), "fapo": fapo}, ["fapo.correct_term=verifier.correct"])
    batch = _batch(["I guess 7", "3+4=7\n7", "maybe 8", "9"], [1, 1, 0, 0])
    loop.score(run, batch)
    # accuracy 0.5: the flawed positive pays 0.5; a flawed negative pays nothing
    assert batch.reward_terms["fapo.penalty"].tolist() == [-0.5, 0, 0, 0]
    assert batch.rewards.tolist() == [0.5, 1, 0, 0]
    assert run.pending_metrics["fapo/flawed_positive_rate"] == 0.5
    assert batch.info[0]["fapo"] == {"flawed": True, "correct": True}


def test_hook_with_scripted_judge_only_judges_positives_and_never_crashes():
    run = make_run({"verifier": Verifier(), "fapo": fapo},
                   ["fapo.correct_term=verifier.correct", "fapo.detector=judge"])
    judge = ScriptedJudge(every_kth_malformed(2, guess_verdict))
    run.resources["fapo.lm"] = judge
    batch = _batch(["I guess 7", "guess 7", "3+4=7\n7", "guess 8"], [1, 1, 1, 0])
    loop.score(run, batch)
    assert judge.calls == 3  # the wrong answer is not sent
    # row 1's verdict is malformed: no penalty; accuracy 3/4
    assert batch.reward_terms["fapo.penalty"].tolist() == [-0.75, 0, 0, 0]
    assert run.pending_metrics["fapo/malformed"] == 1
    assert run.pending_metrics["fapo/judge_calls"] == 3


def test_auto_finds_a_correct_term_and_without_one_penalises_nothing():
    run = make_run({"verifier": Verifier(), "fapo": fapo}, [])  # correct_term: auto
    batch = _batch(["I guess 7", "3+4=7\n7"], [1, 1])
    loop.score(run, batch)
    assert batch.reward_terms["fapo.penalty"].tolist() == [-1.0, 0.0]
    alone = make_run({"fapo": fapo}, [])
    batch = _batch(["I guess 7"], [1])
    loop.score(alone, batch)
    assert batch.reward_terms["fapo.penalty"].tolist() == [0.0]


def test_missing_verifier_plugin_fails_at_configure():
    run = make_run({"fapo": fapo}, ["fapo.correct_term=arith.correct"])
    with pytest.raises(rlmix.ConfigError, match="arith"):
        fapo.rlmix_configure(run)


# ---------------------------------------------------------------- the claim on a toy policy

GUESS_TOKEN, P_GUESS, TARGET = 5, 0.8, (2, 3)


class GuessWorld:
    """A ToyPolicy of 3 positions. Token 5 first is a guess ("I guess the answer."), correct
    with probability 0.8 whatever follows; any other first token reasons, and is correct only
    when the next two tokens are (2, 3) (1 in 36 at the start). Guessing pays early; reasoning
    is the route to full accuracy. The verifier term is ``correct``."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed + 100)
        self.completions = 0

    def render(self, batch):
        draws = batch.tokens[:, 1:]
        guess = draws[:, 0] == GUESS_TOKEN
        batch.texts = ["I guess the answer." if g else "first a step\nthen a step\nthe answer."
                       for g in guess.tolist()]
        clean = (draws[:, 1] == TARGET[0]) & (draws[:, 2] == TARGET[1])
        lucky = torch.rand(len(batch), generator=self.gen) < P_GUESS
        batch.extras["correct"] = torch.where(guess, lucky, clean).float()
        self.completions += len(batch)

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        return {"correct": batch.extras["correct"]}


class GroupNormPG:
    """Outcome-only GRPO on the toy: group-normalised advantages, on-policy surrogate."""

    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        r = batch.rewards
        return (r - ops.group_mean(r, batch.group)) / (ops.group_std(r, batch.group) + 1e-6)

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        adv = mb.batch.token_advantages()
        loss, _ = ops.clipped_surrogate(logp, logp.detach(), adv, 0.2, 0.2)
        return LossTerms(loss=loss, mask=mb.batch.completion_mask, mode="token-mean")


def _train(with_fapo: bool, seed: int, steps: int = 150):
    world = GuessWorld(seed)
    plugins = {"world": world, "pg": GroupNormPG()}
    if with_fapo:
        plugins["fapo"] = fapo
    run = make_run(plugins, ["fapo.correct_term=world.correct"] if with_fapo else [])
    policy = ToyPolicy(vocab=6, length=3, seed=seed)
    trace: list[tuple[float, float, str]] = []

    def reward(batch):
        world.render(batch)
        loop.score(run, batch)
        correct = batch.extras["correct"].bool()
        flawed = correct & torch.tensor([t.startswith("I guess") for t in batch.texts])
        trace.append((float(correct.float().mean()), float(flawed.sum()) /
                      max(1, int(correct.sum())), batch.texts[0]))
        return batch.rewards

    toy_train(run, policy, reward, steps=steps, lr=0.1, n_prompts=4, group_size=8)
    return trace, world.completions


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_claim_fapo_keeps_accuracy_without_flawed_positives(seed):
    grpo, grpo_rollouts = _train(False, seed)
    fapo_run, fapo_rollouts = _train(True, seed)
    assert grpo_rollouts == fapo_rollouts == 150 * 32  # the same rollout budget
    assert grpo[0] == fapo_run[0]  # the same first rollouts (same seed, same policy)

    def tail(trace, k):
        return sum(t[k] for t in trace[-20:]) / 20

    # outcome-only GRPO settles on guessing; FAPO ends on reasoning, at least as accurate
    assert tail(grpo, 1) >= 0.7
    assert tail(fapo_run, 1) <= 0.1
    assert tail(fapo_run, 0) >= tail(grpo, 0) - 0.02
    # the shortcut still pays early: outcome reward over the first 20 steps within 0.05
    early = [sum(t[0] for t in trace[:20]) / 20 for trace in (grpo, fapo_run)]
    assert abs(early[0] - early[1]) <= 0.05


# ---------------------------------------------------------------- the example manifest


def test_example_manifest_runs_on_tiny_random(tmp_path):
    skip_unless_installed(EXAMPLE)
    cfg = OmegaConf.load(EXAMPLE)
    assert cfg.model == "tiny-random" and "fapo" in cfg.plugins
    out = tmp_path / "ex"
    assert cli.main(["run", str(EXAMPLE), "train.steps=2", "arith.eval_size=2",
                     "arith.eval_max_new_tokens=4", "sampling.max_new_tokens=6",
                     "log.progress=false", "log.plot=false", "train.eval_every=0",
                     f"out={out}"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert "reward/fapo.penalty" in rows[-1] and "fapo/flawed_positive_rate" in rows[-1]
