"""rlmix_harness: tasks, prompts under a candidate harness (the run's own restored after),
scored rollouts of tasks, the reflection model's place, the pool split, and the text helpers
harness plugins share."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import rlmix_harness as harness
from rlmix_lm import LMSettings

from rlmix.errors import ConfigError
from rlmix.testing import make_run, standins
from rlmix.types import Prompt


def _run(*overrides: str, policy: bool = False):
    return make_run(dict(standins.STANDINS), ["train.prompts_per_step=3", *overrides],
                    with_policy=policy)


def test_task_pool_walks_steps_by_prompts_per_step() -> None:
    run = _run()
    assert harness.task_pool(run, 7, 1000) == [(1000, 0), (1000, 1), (1000, 2), (1001, 0),
                                               (1001, 1), (1001, 2), (1002, 0)]


def test_prompts_under_a_candidate_then_the_runs_own_harness_again() -> None:
    run = _run()
    run.harness.update({"instructions": "OWN"})
    tasks = [(2000, 1), (2001, 0)]
    under = harness.task_prompts(run, {"instructions": "CANDIDATE"}, tasks)
    assert len(under) == 2 and all("CANDIDATE" in harness.user_text(p) for p in under)
    assert run.harness == {"instructions": "OWN"}  # restored after the block
    again = harness.task_prompts(run, {"instructions": "CANDIDATE"}, tasks)
    assert [p.messages for p in again] == [p.messages for p in under]  # deterministic in step
    own = harness.task_prompts(run, dict(run.harness), tasks)
    assert all("OWN" in harness.user_text(p) for p in own)
    # the same task under two harnesses differs only by the harness text
    assert [harness.user_text(p).replace("OWN", "CANDIDATE") for p in own] == \
        [harness.user_text(p) for p in under]


@pytest.fixture(scope="module")
def policy_run():
    """One run with the tiny model, shared by the tests that generate (loading it is the cost)."""
    return _run("sampling.max_new_tokens=3", policy=True)


def test_score_tasks_scores_greedy_rollouts_and_leaves_the_model_in_train_mode(policy_run) -> None:
    run = policy_run
    run.policy.model.train()
    tasks = harness.task_pool(run, 4, 3000)
    scores, batch = harness.score_tasks(run, {}, tasks, max_new_tokens=3)
    assert len(scores) == 4 and batch.rewards is not None
    assert scores == [float(r) for r in batch.rewards]
    assert run.policy.model.training
    again, _ = harness.score_tasks(run, {}, tasks, max_new_tokens=3)
    assert again == scores  # greedy: the same scores
    term = next(iter(batch.reward_terms))
    assert harness.metric_values(batch, term) == [float(v) for v in batch.reward_terms[term]]
    with pytest.raises(ConfigError, match=r"gepa\.metric: no reward term 'nope\.x'"):
        harness.metric_values(batch, "nope.x", owner="gepa")


def test_text_helpers() -> None:
    assert harness.fenced_text("Here:\n```text\nnew rule\n```\nthanks") == "new rule"
    assert harness.fenced_text("  no fence ``` here ") == "no fence  here"
    assert harness.similarity("The cat sat", "the CAT ran") == pytest.approx(2 / 4)
    assert harness.similarity("", "") == 1.0
    assert harness.cut("a  b\nc", 10) == "a b c" and harness.cut("abcdefghij", 6) == "abc..."
    assert harness.mean([]) == 0.0 and harness.mean([1.0, 2.0]) == 1.5
    info = {"episode": {"turns": []}, "gepa": {"x": 1}, "tests": ["t1", "t2"],
            "error": {"kind": "timeout", "detail": ""}}
    assert harness.feedback_text(info, owner="gepa") == "tests: t1, t2; kind: timeout"
    prompt = Prompt(messages=[{"role": "user", "content": "first"},
                              {"role": "assistant", "content": "x"},
                              {"role": "user", "content": "last"}])
    assert harness.user_text(prompt) == "last"


def test_traces_carry_input_output_score_terms_and_feedback(policy_run) -> None:
    run = policy_run
    _, batch = harness.score_tasks(run, {}, harness.task_pool(run, 2, 4000), max_new_tokens=2)
    batch.info[0]["tests"] = "failed 2 of 3"
    rows = harness.traces(batch, [0.5, 1.0], chars=30)
    assert [r["score"] for r in rows] == [0.5, 1.0]
    assert rows[0]["output"] == batch.texts[0] and rows[0]["input"]
    assert '"tests": "failed 2 of 3"' in rows[0]["feedback"] and len(rows[0]["feedback"]) <= 30
    assert all("=" in r["terms"] for r in rows)


def test_rendering_is_per_thread_and_not_reentrant() -> None:
    run = _run()
    seen: list[bool] = []
    with harness.rendering(run, "router") as first:
        with harness.rendering(run, "router") as second:
            seen += [first, second, harness.inside_rendering(run, "router")]
        other = threading.Thread(target=lambda: seen.append(harness.inside_rendering(run,
                                                                                     "router")))
        other.start()
        other.join()
    assert seen == [True, False, True, False]
    assert not harness.inside_rendering(run, "router")


def test_split_pool_in_order_without_gates_and_by_the_gates_with_them() -> None:
    run = _run()
    split = harness.split_pool(run, {"search": 2, "selection": 1, "heldout": 2}, 100)
    assert split == {"search": [(100, 0), (100, 1)], "selection": [(100, 2)],
                     "heldout": [(101, 0), (101, 1)]}

    class Gates:
        guarded: list = []

        def split(self, pool, sizes):
            class Split:
                search, selection, heldout = pool[-2:], pool[:1], pool[1:3]
            return Split

        def guard_heldout(self, tasks):
            self.guarded.append(list(tasks))

    run.resources[harness.GATES] = Gates()
    split = harness.split_pool(run, {"search": 2, "selection": 1, "heldout": 2}, 100)
    assert split["search"] == [(101, 0), (101, 1)] and split["selection"] == [(100, 0)]
    harness.guard_heldout(run, split["heldout"])
    assert Gates.guarded == [[(100, 1), (100, 2)]]


def test_reflection_lm_is_made_once_from_the_lm_block_and_a_placed_one_wins() -> None:
    from rlmix_lm import PolicyLM

    class Evolver:
        @dataclasses.dataclass
        class Settings:
            lm: LMSettings = dataclasses.field(default_factory=LMSettings)

    run = make_run({**standins.STANDINS, "evolver": Evolver()})
    lm = harness.reflection_lm(run, "evolver")
    assert isinstance(lm, PolicyLM) and harness.reflection_lm(run, "evolver") is lm
    assert run.resources["evolver.lm"] is lm
    scripted = object()
    run.resources["evolver.lm"] = scripted  # where tests put a scripted model
    assert harness.reflection_lm(run, "evolver") is scripted
