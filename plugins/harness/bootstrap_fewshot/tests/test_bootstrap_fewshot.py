"""Tests of bootstrap_fewshot: the pure parts (which traces become demos, the candidate demo
sets, rendering, tie-breaking), and the whole search on a toy world where a demonstration
carries the information a task needs (the paper's claim in miniature: bootstrapped demos raise
validation and held-out accuracy over zero-shot, and the set selected on validation beats a
random demo set), with the budget, a resume, settings errors and the example manifest."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import rlmix_bootstrap_fewshot as bfs
from rlmix_bootstrap_fewshot import (
    best_candidate,
    candidate_sets,
    passing_demos,
    render_demos,
)
from rlmix_harness import mean, score_tasks

import rlmix
from rlmix import loop
from rlmix.testing import make_run, skip_unless_installed
from rlmix.testing.harness import HintEnv, HintModel, harness_words

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "harness" / "bootstrap_fewshot-arith.yaml"

# ---------------------------------------------------------------- pure parts


def test_only_passing_traces_become_demos_once_per_input():
    demos = passing_demos(["a", "b", "a", "c"], ["A", "B", "A2", "C" * 10], [1.0, 0.0, 1.0, 0.9],
                          threshold=0.9, chars=4)
    assert [(d["input"], d["output"], d["row"]) for d in demos] == [("a", "A", 0), ("c", "CCCC", 3)]
    assert passing_demos(["a"], ["A"], [0.5], threshold=1.0) == []


def test_candidate_sets_zero_shot_first_then_distinct_seeded_subsets():
    sets = candidate_sets(6, 3, 8, random.Random(0))
    assert sets[0] == [] and sets[1] == [0, 1, 2]
    assert len(sets) == 9 and all(len(s) == 3 for s in sets[1:])
    assert len({tuple(sorted(s)) for s in sets}) == len(sets)  # no two sets alike
    assert all(0 <= i < 6 for s in sets for i in s)
    assert sets == candidate_sets(6, 3, 8, random.Random(0))  # seeded
    assert sets != candidate_sets(6, 3, 8, random.Random(1))
    # a small pool: as many distinct sets as exist (C(3, 2) = 3), k capped at the pool
    small = candidate_sets(3, 2, 10, random.Random(0))
    assert len(small) == 4 and candidate_sets(2, 4, 5, random.Random(0))[1] == [0, 1]
    assert candidate_sets(0, 4, 5, random.Random(0)) == [[]]


def test_render_keeps_the_starting_text_and_numbers_the_demos():
    demos = [{"input": "What is 1+1?", "output": "2"}, {"input": "What is 2+3?", "output": "5"}]
    text = render_demos(demos, "Examples:", "Be brief.")
    assert text == ("Be brief.\n\nExamples:\nExample 1\nInput: What is 1+1?\nOutput: 2\n"
                    "Example 2\nInput: What is 2+3?\nOutput: 5")
    assert render_demos([], "Examples:", "Be brief.") == "Be brief."


def test_best_candidate_skips_unscored_and_breaks_ties_to_the_earlier_set():
    assert best_candidate([[0.0, 1.0], None, [1.0, 0.0], [1.0, 1.0], None]) == 3
    assert best_candidate([[1.0], [1.0], [0.0]]) == 0
    assert best_candidate([[0.0], None, [0.5], [0.5]]) == 2


# ---------------------------------------------------------------- a toy where demos carry hints
# HintModel answers a topic right only when the topic's hint word is in the harness part of the
# prompt. ClueEnv gives task i == 0 of every step a clue (the hint word) in its question, so the
# zero-shot program solves exactly those; a solved clue task, shown as a demo, carries the hint
# word into the system prompt and so solves every task of its topic. "alpha" (t0's hint) breaks
# t1, so which demos are shown matters: the validation set has to pick them.

BASE = 3_000_000
CONFLICTS = {"t1": {"alpha"}}


class ClueEnv(HintEnv):
    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        prompts = super().rlmix_prompts(run, step)
        for i, p in enumerate(prompts):
            if i == 0:
                topic = p.answer
                user = p.messages[-1]
                user["content"] = user["content"].replace(
                    f"on topic {topic}.", f"on topic {topic}. Clue: {self.hints[topic]}.", 1)
        return prompts


def toy_run(tmp_path, *overrides, with_gates=False):
    env = ClueEnv(conflicts=CONFLICTS)
    plugins = {"hintenv": env, "hintmodel": HintModel(env)}
    if with_gates:  # optional: skipped where rlmix-gates is not installed (nox isolated)
        plugins["gates"] = pytest.importorskip("rlmix_gates")
    plugins["bootstrap_fewshot"] = bfs
    run = make_run(plugins, [f"out={tmp_path}", "train.prompts_per_step=4",
                             "harness.system=You answer questions.",
                             "harness.instructions=Answer.",
                             "bootstrap_fewshot.metric=hintenv.correct",
                             "bootstrap_fewshot.train_size=16", "bootstrap_fewshot.val_size=16",
                             "bootstrap_fewshot.heldout_size=16",
                             "bootstrap_fewshot.max_demos=2",
                             "bootstrap_fewshot.num_candidates=4", *overrides])
    loop.configure(run)
    return run


def evolve(run, calls):
    for _ in range(calls):
        update = bfs.iterate(run)
        if update is not None:
            loop.apply_harness_update(run, update)


def test_claim_bootstrapped_demos_beat_zero_shot_and_selection_beats_random(tmp_path):
    run = toy_run(tmp_path, "bootstrap_fewshot.budget=200")
    evolve(run, 3)
    state = run.state["bootstrap_fewshot"]
    # only the four clue tasks of the 16 training tasks passed: one demo per topic, each with
    # its topic's hint word
    assert len(state["pool"]) == 4
    assert all("Clue:" in d["input"] and d["output"].startswith("ANSWER") for d in state["pool"])
    assert all(v is not None for v in state["val"])  # 5 sets, 2 per call after the first
    zero_val, zero_held = mean(state["val"][0]), state["heldout"]["0"]
    best = state["applied"]
    assert zero_val == 0.25 and zero_held == 0.25  # the clue tasks only
    assert mean(state["val"][best]) == 0.625 and state["heldout"][str(best)] == 0.625
    # the harness now holds the best set's demos (two topics, no alpha-breaks-t1 pair)
    chosen = {state["pool"][i]["task"][0] % 4 for i in state["candidates"][best]}
    assert len(chosen) == 2 and chosen != {0, 1}
    assert run.harness["system"].startswith("You answer questions.\n\nWorked examples")
    # every non-empty demo set on the held-out tasks: the one chosen on validation is the best,
    # and strictly better than a random set on average
    held = [tuple(t) for t in state["tasks"]["heldout"]]
    per_set = []
    for c in range(1, len(state["candidates"])):
        scores, _ = score_tasks(run, bfs.harness_with(state, run, c), held,
                                metric="hintenv.correct")
        per_set.append(mean(scores))
    assert state["heldout"][str(best)] == max(per_set)
    assert mean(per_set) < state["heldout"][str(best)] - 0.05
    # metric calls: 16 bootstrap + 5 sets x 16 validation (held-out scoring is not counted)
    assert state["metric_calls"] == 16 + 5 * 16
    assert (tmp_path / "harness" / "v0001.json").exists()


def test_demos_are_what_fixes_the_tasks(tmp_path):
    # the same search where passing traces carry nothing useful (no clues): no demos, no gain
    env = HintEnv()
    run2 = make_run({"hintenv": env, "hintmodel": HintModel(env), "bootstrap_fewshot": bfs},
                    [f"out={tmp_path / 'plain'}", "train.prompts_per_step=4",
                     "harness.instructions=Answer.", "bootstrap_fewshot.metric=hintenv.correct",
                     "bootstrap_fewshot.val_size=8"])
    loop.configure(run2)
    evolve(run2, 2)
    state = run2.state["bootstrap_fewshot"]
    assert state["pool"] == [] and state["candidates"] == [[]]
    assert state["applied"] == 0 and run2.harness_version == 0
    assert state["metric_calls"] == 16 + 8  # bootstrap + zero-shot, nothing more to try


def test_teacher_bootstraps_and_demos_show_the_students_input(tmp_path):
    run = toy_run(tmp_path, "bootstrap_fewshot.budget=200",
                  "bootstrap_fewshot.teacher.instructions=Answer. gamma")
    evolve(run, 1)
    pool = run.state["bootstrap_fewshot"]["pool"]
    topics = sorted({d["output"] for d in pool})
    # the teacher solves every t2 task (and the clue tasks); the demo inputs are rendered
    # under the student's harness, so the teacher's word is not in them
    assert "ANSWER t2" in topics and len(pool) == 4 + 3
    assert all("gamma" not in d["input"] or "Clue: gamma" in d["input"] for d in pool)


@pytest.mark.parametrize(("budget", "scored"), [(32, 1), (48, 2), (80, 4)])
def test_budget_is_never_overspent(tmp_path, budget, scored):
    run = toy_run(tmp_path, f"bootstrap_fewshot.budget={budget}")
    evolve(run, 4)
    state = run.state["bootstrap_fewshot"]
    assert state["metric_calls"] <= budget
    assert sum(v is not None for v in state["val"]) == scored


def test_retry_rounds_only_rerun_failed_tasks(tmp_path):
    run = toy_run(tmp_path, "bootstrap_fewshot.budget=200", "bootstrap_fewshot.max_rounds=3")
    model = run.pm.get_plugin("hintmodel")
    bfs.bootstrap(run)
    state = run.state["bootstrap_fewshot"]
    # 16 tasks, 4 pass; the two retry passes see only the 12 failures (the toy is deterministic)
    assert [r["tasks"] for r in state["rounds"]] == [16, 12, 12]
    assert [r["passed"] for r in state["rounds"]] == [4, 0, 0]
    assert state["metric_calls"] == 16 + 12 + 12 + 16 and model.calls >= 56 + 16


def test_gates_split_keeps_heldout_apart(tmp_path):
    run = toy_run(tmp_path, "bootstrap_fewshot.budget=200", with_gates=True)
    evolve(run, 1)
    tasks = run.state["bootstrap_fewshot"]["tasks"]
    sets = [{tuple(t) for t in tasks[k]} for k in ("train", "val", "heldout")]
    assert [len(s) for s in sets] == [16, 16, 16]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])


def test_state_resumes_exactly(tmp_path):
    a = toy_run(tmp_path / "a", "bootstrap_fewshot.budget=200")
    evolve(a, 1)
    saved_state, saved_harness = copy.deepcopy(a.state), dict(a.harness)
    evolve(a, 2)
    b = toy_run(tmp_path / "b", "bootstrap_fewshot.budget=200")
    b.state.clear()
    b.state.update(saved_state)
    b.harness.clear()
    b.harness.update(saved_harness)
    evolve(b, 2)
    assert b.state["bootstrap_fewshot"] == a.state["bootstrap_fewshot"]
    assert b.harness == a.harness


def test_step_end_metrics(tmp_path):
    run = toy_run(tmp_path)
    metrics: dict = {}
    bfs.rlmix_step_end(run, metrics)
    assert metrics == {}
    evolve(run, 1)
    bfs.rlmix_step_end(run, metrics)
    assert metrics["bootstrap_fewshot/demos"] == 4
    assert metrics["bootstrap_fewshot/zero_shot_val"] == 0.25
    assert metrics["bootstrap_fewshot/scored"] == 3
    assert metrics["bootstrap_fewshot/best_val"] >= 0.25
    assert "bootstrap_fewshot/heldout" in metrics


@pytest.mark.parametrize(("override", "key"), [
    ("bootstrap_fewshot.max_demos=0", "bootstrap_fewshot.max_demos"),
    ("bootstrap_fewshot.budget=10", "bootstrap_fewshot.budget"),
    ("bootstrap_fewshot.max_rounds=0", "bootstrap_fewshot.max_rounds"),
    ("bootstrap_fewshot.component=", "bootstrap_fewshot.component"),
    ("bootstrap_fewshot.shots=3", "bootstrap_fewshot.shots"),
])
def test_settings_errors_name_the_key(override, key):
    with pytest.raises(rlmix.ManifestError, match=key.replace(".", r"\.")):
        make_run({"bootstrap_fewshot": bfs}, [override])


def test_harness_words_see_the_rendered_demos(tmp_path):
    run = toy_run(tmp_path)
    evolve(run, 3)
    prompts = run.hook.rlmix_prompts(run=run, step=5)
    words = set(harness_words(prompts[1]))
    demo_words = {w for i in run.state["bootstrap_fewshot"]["candidates"][
        run.state["bootstrap_fewshot"]["applied"]]
        for w in run.state["bootstrap_fewshot"]["pool"][i]["input"].replace(".", " ").split()}
    assert "Clue:" in words and demo_words <= words


# ---------------------------------------------------------------- the example manifest


def test_example_manifest_runs_two_steps_with_the_tiny_model(tmp_path):
    from rlmix import checkpoint, cli

    skip_unless_installed(EXAMPLE)
    out = tmp_path / "run"
    code = cli.main(["run", str(EXAMPLE), "model=tiny-random", "train.steps=2",
                     "train.prompts_per_step=2", "train.eval_every=0", "train.checkpoint_every=1",
                     "arith.eval_size=2", "sampling.max_new_tokens=4",
                     "bootstrap_fewshot.max_new_tokens=4", "bootstrap_fewshot.train_size=4",
                     "bootstrap_fewshot.val_size=2", "log.progress=false", "log.plot=false",
                     f"out={out}"])
    assert code == 0
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["policy_version"] == 0 for r in rows)
    # bootstrap (4 train tasks + 2 zero-shot validation) then up to two sets per step
    assert rows[0]["bootstrap_fewshot/metric_calls"] >= 6
    import torch

    saved = torch.load(checkpoint.latest(out / "checkpoints") / "state.pt", weights_only=False)
    assert saved["bootstrap_fewshot"]["metric_calls"] == rows[-1]["bootstrap_fewshot/metric_calls"]
