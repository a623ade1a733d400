"""Score once (issue 22): every generated sample is scored exactly once per step, also when a
sample wrapper scores candidate batches (dapo's dynamic sampling, aero, the allocation plugins
that use ``rlmix.sampling.score``) and with the ``code`` env, whose verifier runs the model's
programs in a sandbox (the expensive case). A counting scorer and the world's rollout counter
are compared step by step; ``loop.score`` keeps the terms already in ``batch.reward_terms``."""

from __future__ import annotations

import importlib
import random
from typing import Any

import pytest
import torch

import rlmix
from rlmix import loop
from rlmix.testing import make_batch, make_run
from rlmix.testing.allocation import KnownRateEnv
from rlmix.types import GenerationRequest, RolloutBatch, Run

RATES = [0.0, 0.2, 0.5, 0.8, 1.0, 0.5, 0.3, 0.7]


class CountingScorer:
    """A scorer that counts the samples it is asked to score."""

    def __init__(self) -> None:
        self.scored = 0
        self.calls = 0

    @rlmix.hookimpl
    def rlmix_score(self, run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        self.scored += len(batch)
        self.calls += 1
        return {"length": batch.completion_mask.sum(-1)}


def _step(run: Run) -> RolloutBatch:
    """What ``loop.train_step`` does up to the advantages: prompts, ``Run.sample``, score."""
    prompts = run.hook.rlmix_prompts(run=run, step=run.step)
    batch = run.sample(prompts)
    loop.score(run, batch)
    return batch


WRAPPERS = {
    "dapo.dynamic_sampling": ("rlmix_dapo.dynamic_sampling", ["dapo.dynamic_sampling.max_rounds=3",
                                                             "dapo.dynamic_sampling.metric=env.correct"]),
    "aero": ("rlmix_aero", []),
    "e3": ("rlmix_e3", []),
    "ar3po": ("rlmix_ar3po", []),
    "roc": ("rlmix_roc", []),
    "dots": ("rlmix_dots", ["dots.pool_factor=2", "dots.replay_groups=1"]),
    "xrpo_alloc": ("rlmix_xrpo_alloc", []),
    "trace_alloc": ("rlmix_trace_alloc", []),
}


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_every_sample_is_scored_once_per_step_with_a_scoring_sample_wrapper(name):
    module_name, overrides = WRAPPERS[name]
    module = pytest.importorskip(module_name)
    env, counter = KnownRateEnv(RATES, seed=3), CountingScorer()
    run = make_run({"env": env, "count": counter, name: module},
                   ["train.prompts_per_step=4", "train.group_size=4", *overrides])
    configure = getattr(module, "rlmix_configure", None)
    if configure is not None:
        configure(run)
    wrapper_scored = False
    for step in range(4):
        run.step = step
        generated, scored, calls = env.generated, counter.scored, counter.calls
        batch = run.sample(run.hook.rlmix_prompts(run=run, step=run.step))
        wrapper_scored |= counter.calls > calls  # the wrapper scored candidate batches
        loop.score(run, batch)  # as loop.train_step does next
        # every completion generated this step was scored exactly once (none twice, none never)
        assert counter.scored - scored == env.generated - generated, (name, step)
        assert batch.rewards is not None and "count.length" in batch.reward_terms
        assert batch.reward_terms["env.correct"].tolist() == [float(t == "1")
                                                              for t in batch.texts]
    assert wrapper_scored, "the wrapper never scored a candidate batch"


def test_score_keeps_present_terms_and_fills_them_as_scorers_return():
    seen: list[set[str]] = []

    class First:
        @rlmix.hookimpl
        def rlmix_score(self, run, batch):
            return {"x": torch.ones(len(batch))}

    class Second:
        @rlmix.hookimpl
        def rlmix_score(self, run, batch):
            seen.append(set(batch.reward_terms))  # the earlier scorer's term is already there
            return {"y": 2 * loop.scorer_terms(run, batch, "first")["first.x"]}

    counter = CountingScorer()
    run = make_run({"first": First(), "second": Second(), "count": counter},
                   ["score.weights.second.y=0.5"])
    batch = make_batch(n_groups=1, group_size=3)
    batch.reward_terms = {}
    loop.score(run, batch)
    assert seen == [{"first.x"}]
    assert batch.rewards.tolist() == [1.0 + 1.0 + float(n) for n in
                                      batch.completion_mask.sum(-1).tolist()]
    loop.score(run, batch)  # scored already: nothing is called again, the sum is the same
    assert counter.calls == 1 and len(seen) == 1
    # a sample wrapper that scored a candidate batch hands on rows with their terms
    part = batch.select([0, 2])
    loop.score(run, part)
    assert counter.calls == 1 and part.rewards.tolist() == batch.rewards[[0, 2]].tolist()


def test_a_term_is_owned_by_the_longest_plugin_name_prefix():
    assert loop._term_owner("dapo.dynamic_sampling.x", ["dapo", "dapo.dynamic_sampling"]) == \
        "dapo.dynamic_sampling"
    assert loop._term_owner("dapo.x", ["dapo", "dapo.dynamic_sampling"]) == "dapo"


class CodeRollout:
    """Completions for the ``code`` env: the problem's canonical solution or a wrong body, at
    random, so groups disagree now and then and dynamic sampling draws extra rounds."""

    def __init__(self) -> None:
        self.generated = 0
        self.rng = random.Random(0)

    @rlmix.hookimpl
    def rlmix_generate(self, run: Run, request: GenerationRequest) -> RolloutBatch:
        code = importlib.import_module("rlmix_code")
        by_id = {p.task_id: p for p in code._problems(run)}
        texts = []
        for prompt in request.prompts:
            problem = code._problem_of(prompt, by_id)
            for _ in range(request.n):
                right = self.rng.random() < 0.5
                texts.append(problem.canonical_solution if right else "    return None\n")
        batch = make_batch(n_groups=len(request.prompts), group_size=request.n)
        batch.texts = texts
        batch.prompts = [p for p in request.prompts for _ in range(request.n)]
        self.generated += len(batch)
        return batch


def test_the_code_verifier_runs_once_per_sample_under_dynamic_sampling(monkeypatch):
    code = pytest.importorskip("rlmix_code")
    dynamic = pytest.importorskip("rlmix_dapo.dynamic_sampling")
    verified: list[int] = []
    real_verify = code.verify

    def counting_verify(completions: list[str], *args: Any, **kwargs: Any):
        verified.append(len(completions))
        return real_verify(completions, *args, **kwargs)

    monkeypatch.setattr(code, "verify", counting_verify)
    rollout = CodeRollout()
    run = make_run({"code": code, "rollout": rollout, "dapo.dynamic_sampling": dynamic},
                   ["train.prompts_per_step=2", "train.group_size=2", "code.timeout_s=5",
                    "dapo.dynamic_sampling.max_rounds=2",
                    "dapo.dynamic_sampling.metric=code.passed"])
    code.rlmix_configure(run)
    for step in range(2):
        run.step = step
        generated, before = rollout.generated, sum(verified)
        batch = _step(run)
        assert sum(verified) - before == rollout.generated - generated  # no program ran twice
        assert len(verified) >= 1 and batch.rewards is not None


class LateScorer:
    """Returns nothing for the first batch it sees, then a term ``a``."""

    def __init__(self) -> None:
        self.calls = 0

    @rlmix.hookimpl
    def rlmix_score(self, run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {} if self.calls == 1 else {"a": torch.ones(len(batch))}


def test_a_weight_naming_a_term_no_scorer_returns_is_a_manifest_error_also_when_late():
    """``score.weights.late.b``: ``late`` returns nothing for the first batch (not judged then,
    while ``count`` is), then only ``a``: the manifest error comes at that second batch; it is
    never a silent weight of 1.0."""
    run = make_run({"count": CountingScorer(), "late": LateScorer()},
                   ["score.weights.late.b=2", "score.weights.count.length=1"])
    loop.score(run, make_batch())  # late returned nothing: not judged yet
    with pytest.raises(rlmix.ManifestError, match=r"score\.weights\.late\.b.*no term 'b'.*: a"):
        loop.score(run, make_batch(seed=1))
    ok = make_run({"count": CountingScorer(), "late": LateScorer()},
                  ["score.weights.late.a=2"])
    for seed in range(3):
        batch = make_batch(seed=seed)
        loop.score(ok, batch)
    assert ok.state["rlmix.score"]["weights_checked"] is True
    torch.testing.assert_close(batch.rewards, batch.completion_mask.sum(-1) + 2.0)
