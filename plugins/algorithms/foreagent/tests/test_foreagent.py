"""FOREAGENT: round-robin wins, predict-then-verify and calibration by hand, the LM predictor
(scripted, malformed verdicts), the evaluate hook's counts, the claim (same best score with >= 2x
fewer metric calls; a random predictor loses the saving), and the example manifest."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import rlmix_foreagent as fa
import torch
from omegaconf import OmegaConf
from rlmix_lm.judges import ScriptedJudge, every_kth_malformed

import rlmix
from rlmix import cli
from rlmix.testing import make_run, skip_unless_installed
from rlmix.types import GenerationRequest, Prompt, RolloutBatch

EXAMPLE = Path(fa.__file__).parents[4] / "examples" / "rewards" / "foreagent-arith.yaml"

# ---------------------------------------------------------------- the loop by hand


def test_win_scores_round_robin_and_unusable_answers():
    table = {(0, 1): 0.9, (0, 2): 0.2, (1, 2): None}
    wins, calls, unusable = fa.win_scores(3, lambda i, j: table[(i, j)])
    assert wins == pytest.approx([1.1, 0.1 + 0.5, 0.8 + 0.5])
    assert calls == 3 and unusable == 1


def test_predict_then_verify_executes_only_the_top():
    quality = [0.1, 0.9, 0.5, 0.7]
    executed_calls = []

    def execute(idx):
        executed_calls.append(list(idx))
        return [quality[i] for i in idx]

    oracle = lambda i, j: float(quality[i] > quality[j])  # noqa: E731
    got = fa.predict_then_verify(4, oracle, execute, verify_top=2)
    assert executed_calls == [[1, 3]] and got["best"] == 1 and got["score"] == 0.9
    assert got["predictor_calls"] == 6 and got["executed"] == {1: 0.9, 3: 0.7}
    # a wrong predictor: the best is never executed
    got = fa.predict_then_verify(4, lambda i, j: 1.0 - oracle(i, j), execute, verify_top=2)
    assert got["score"] == 0.5
    # verify_top = n executes everything and asks the predictor nothing
    got = fa.predict_then_verify(4, lambda i, j: 1 / 0, execute, verify_top=4)
    assert got["score"] == 0.9 and got["predictor_calls"] == 0


def test_calibration_by_hand():
    acc, brier = fa.calibration([(0.8, True), (0.6, False), (0.5, True)])
    assert acc == pytest.approx((1 + 0 + 0.5) / 3)
    assert brier == pytest.approx((0.04 + 0.36 + 0.25) / 3)
    assert fa.calibration([]) == (0.0, 0.0)


def judge_by_quality(text):
    """Reads q=... of both candidates; prefers the larger with confidence 0.9."""
    qa = float(re.search(r"<<<A\nq=([0-9.]+)", text).group(1))
    qb = float(re.search(r"<<<B\nq=([0-9.]+)", text).group(1))
    return {"better": "A" if qa >= qb else "B", "confidence": 0.9}


def test_lm_preference_parses_and_counts_malformed():
    judge = ScriptedJudge(every_kth_malformed(3, judge_by_quality))
    prefer = fa.lm_preference(judge, "the metric is q", "task", ["q=0.2", "q=0.8", "q=0.5"])
    assert prefer(0, 1) == pytest.approx(0.1) and prefer(0, 2) == pytest.approx(0.1)
    assert prefer(1, 2) is None  # the third call is malformed
    assert prefer(0, 1) == pytest.approx(0.1) and judge.calls == 3  # cached
    assert "Report:\nthe metric is q" in judge.prompts[0]
    for bad in ({"better": "C", "confidence": 0.9}, {"better": "A", "confidence": 0.2},
                {"better": "A", "confidence": True}):
        assert fa.lm_preference(ScriptedJudge(lambda t, b=bad: b), "", "t", ["a", "b"])(0, 1) \
            is None


# ---------------------------------------------------------------- a world with costly metrics


class QualityWorld:
    """Env, engine and scorer: each candidate is "q=<quality>" (uniform in [0, 1]); the metric
    (the scorer ``value``) returns the quality and counts every row it scores."""

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.metric_calls = 0

    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        return [Prompt(messages=[{"role": "user", "content": f"task {step}-{i}"}])
                for i in range(int(run.config.train.prompts_per_step))]

    @rlmix.hookimpl
    def rlmix_generate(self, run, request: GenerationRequest):
        n = len(request.prompts) * request.n
        q = torch.rand(n, generator=self.gen)
        cmask = torch.tensor([[0.0, 1.0]]).repeat(n, 1)
        return RolloutBatch(
            group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
            tokens=torch.ones(n, 2, dtype=torch.long),
            attention_mask=torch.ones(n, 2, dtype=torch.long), completion_mask=cmask,
            behavior_logp=-cmask, policy_version=torch.zeros(n, dtype=torch.long),
            texts=[f"q={v:.4f}" for v in q.tolist()],
            prompts=[p for p in request.prompts for _ in range(request.n)])

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        self.metric_calls += len(batch)
        return {"value": torch.tensor([float(t[2:]) for t in batch.texts])}


def noisy_predictor(noise: float = 0.1, seed: int = 0):
    """A learned-head stand-in that misjudges: it perceives each candidate's quality with
    Gaussian noise (std ``noise``, fixed per candidate text) and answers
    P(a better) = sigmoid((perceived_a - perceived_b) / 0.05)."""
    perceived: dict[str, float] = {}
    gen = torch.Generator().manual_seed(1000 + seed)

    def look(text):
        if text not in perceived:
            perceived[text] = float(text[2:]) + noise * float(torch.randn(1, generator=gen))
        return perceived[text]

    def predict(task, a, b):
        return 1 / (1 + math.exp(-(look(a) - look(b)) / 0.05))
    return predict


def _evaluate(predictor: str, verify_top: int, seed: int = 0, tasks: int = 64,
              noise: float = 0.1):
    world = QualityWorld(seed)
    run = make_run({"world": world, "foreagent": fa},
                   [f"foreagent.predictor={predictor}", f"foreagent.verify_top={verify_top}",
                    "foreagent.candidates=8", f"foreagent.eval_tasks={tasks}",
                    "foreagent.metric=world.value", f"foreagent.seed={seed}"])
    run.plugin_resources("foreagent")["predictor"] = noisy_predictor(noise, seed)
    (metrics,) = [m for m in run.hook.rlmix_evaluate(run=run) if m]
    return metrics, world.metric_calls


def test_evaluate_hook_counts_calls_and_calibration():
    metrics, calls = _evaluate("resource", 2, tasks=4)
    assert calls == 8 and metrics["foreagent/metric_calls"] == 2
    assert metrics["foreagent/predictor_calls"] == 28  # 8 * 7 / 2 per task
    assert metrics["foreagent/calibrated_pairs"] <= 4
    assert 0 <= metrics["foreagent/pairwise_accuracy"] <= 1


def test_lm_predictor_through_the_hook_never_crashes_on_malformed_replies():
    world = QualityWorld(0)
    run = make_run({"world": world, "foreagent": fa},
                   ["foreagent.candidates=4", "foreagent.eval_tasks=2",
                    "foreagent.metric=world.value", "foreagent.report=higher q is better"])
    run.resources["foreagent.lm"] = ScriptedJudge(every_kth_malformed(4, judge_by_quality))
    (metrics,) = [m for m in run.hook.rlmix_evaluate(run=run) if m]
    assert metrics["foreagent/predictor_calls"] == 6 and metrics["foreagent/unusable"] == 3
    assert world.metric_calls == 4


def test_settings_are_checked():
    with pytest.raises(ValueError, match="predictor"):
        fa.Settings(predictor="oracle")
    with pytest.raises(ValueError, match="verify_top"):
        fa.Settings(candidates=4, verify_top=5)


# ---------------------------------------------------------------- the claim


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_claim_same_best_with_2x_fewer_metric_calls_random_predictor_loses_it(seed):
    """8 candidates per task, 64 tasks; the predictor misjudges (noise 0.2: about 0.65-0.75
    pairwise accuracy on executed pairs, near the paper's 61.5%)."""
    everything, all_calls = _evaluate("resource", 8, seed, noise=0.2)
    predicted, pred_calls = _evaluate("resource", 4, seed, noise=0.2)
    control, ctrl_calls = _evaluate("random", 4, seed)
    assert all_calls == 64 * 8 and pred_calls == ctrl_calls == 64 * 4
    assert all_calls >= 2 * pred_calls  # >= 2x fewer metric calls
    # the same candidates in every arm (same seed), so the best possible is the same
    best_all = everything["foreagent/best"]
    assert predicted["foreagent/best"] >= best_all - 0.01
    assert control["foreagent/best"] < best_all - 0.05  # the saving needs the predictor
    assert 0.6 < predicted["foreagent/pairwise_accuracy"] < 0.9  # an imperfect predictor


# ---------------------------------------------------------------- the example manifest


@pytest.mark.slow
def test_example_manifest_runs_on_tiny_random(tmp_path):
    skip_unless_installed(EXAMPLE)
    cfg = OmegaConf.load(EXAMPLE)
    assert cfg.model == "tiny-random" and "foreagent" in cfg.plugins
    out = tmp_path / "ex"
    assert cli.main(["run", str(EXAMPLE), "train.steps=1", "arith.eval_size=2",
                     "arith.eval_max_new_tokens=4", "sampling.max_new_tokens=6",
                     "foreagent.eval_tasks=2", "foreagent.candidates=3",
                     "foreagent.lm.max_new_tokens=8", "log.progress=false", "log.plot=false",
                     "train.eval_every=0", f"out={out}"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/foreagent/best" in r]
    assert evals and evals[-1]["eval/foreagent/metric_calls"] == 1
    assert evals[-1]["eval/foreagent/predictor_calls"] == 3
