"""Tests of Adaptive Auto-Harness: the text router, the oracle-gap decomposition and the
edit / split / draft rule on hand-made numbers; solve-time routing as a wrapper on
``rlmix_prompts`` in the core's plugin manager; and the paper's claim in miniature on a toy
stream whose topics shift and conflict (one densely updated harness peaks then declines, the
routed tree keeps improving), with the budget, a resume, settings errors and the example
manifest checked along the way."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import rlmix_auto_harness as ah
from rlmix_auto_harness import (
    cosine,
    decide,
    estimates,
    features,
    oracle_gap,
    parse_proposal,
    reflection_prompt,
    route,
)
from rlmix_lm.chat_server import ScriptedLM

import rlmix
from rlmix import cli, loop
from rlmix.testing import load_script, make_run, skip_unless_installed
from rlmix.testing.harness import HintEnv, hint_plugins, hint_reflection

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "harness" / "auto_harness-stream.yaml"

# ---------------------------------------------------------------- the router


def test_features_cut_the_harness_and_fold_numbers():
    f = features("What is 12+34? Reply with only the number.", ["Reply with only the number."])
    assert f == {"what": 1, "is": 1, "#": 2, "+": 1}
    assert features("What is 12-3?")["-"] == 1
    assert cosine(f, f) == pytest.approx(1.0)
    assert cosine(f, features("What is 5-9?")) == pytest.approx(6 / 7)  # only + vs - differ
    assert cosine(f, {}) == 0.0


def hist(text, scores, served=0):
    return {"task": [0, 0], "features": features(text), "scores": scores, "served": served}


def test_route_follows_the_nodes_that_scored_on_similar_tasks():
    history = [hist("What is 1+2?", {0: 1.0, 1: 0.0}), hist("What is 3+4?", {0: 1.0, 1: 0.0}),
               hist("What is 9-4?", {0: 0.0, 1: 1.0}), hist("What is 8-1?", {0: 0.0, 1: 1.0}),
               hist("Ana has 3 pens and finds 2 more.", {0: 0.0, 1: 0.0, 2: 1.0})]
    assert route(features("What is 5+5?"), history, [0, 1, 2], neighbors=2) == 0
    assert route(features("What is 7-5?"), history, [0, 1, 2], neighbors=2) == 1
    assert route(features("Bo has 4 cards and finds 1 more."), history, [0, 1, 2], 2) == 2
    # with every neighbour: each task weighs by its similarity (+ tasks 1, - tasks 6/7)
    est = estimates(features("What is 5+5?"), history, neighbors=10)
    sim_w = cosine(features("What is 5+5?"), features("Ana has 3 pens and finds 2 more."))
    assert est[0] == pytest.approx(2 / (2 + 12 / 7 + sim_w))
    assert est[1] == pytest.approx((12 / 7) / (2 + 12 / 7 + sim_w))
    assert est[2] == 1.0  # known on one task only: the mean over what is known
    # no evidence, or a tie: the lowest id (the root)
    assert route(features("zebra"), history, [0, 1, 2], 4) == 0
    assert route(features("What is 5+5?"), [], [0, 1], 4) == 0
    tie = [hist("What is 1+2?", {0: 1.0, 1: 1.0})]
    assert route(features("What is 5+5?"), tie, [0, 1], 4) == 0
    # only nodes still in the tree are candidates
    assert route(features("What is 7-5?"), history, [0, 2], neighbors=2) == 0


# ---------------------------------------------------------------- the losses and the rule


def test_oracle_gap_splits_into_evolution_and_adaptation_loss_by_hand():
    scores = {0: [1.0, 0.0, 0.0, 1.0], 1: [0.0, 1.0, 0.0, 1.0]}
    gap = oracle_gap(scores, routed=[0, 0, 1, 1], oracle=1.0)
    # routed: 1, 0, 0, 1; best in tree: 1, 1, 0, 1
    assert gap["routed"] == 0.5 and gap["best_in_tree"] == 0.75
    assert gap["evolution_loss"] == pytest.approx(0.25)  # task 2: no node solves it
    assert gap["adaptation_loss"] == pytest.approx(0.25)  # task 1: node 1 would have
    assert gap["evolution_loss"] + gap["adaptation_loss"] == pytest.approx(gap["oracle_gap"])
    assert oracle_gap(scores, [1, 1, 1, 1], 1.0)["adaptation_loss"] == pytest.approx(0.25)
    assert oracle_gap(scores, [], 1.0) == {}


@pytest.mark.parametrize(("parent", "child", "split", "room", "want"), [
    ([1, 0, 0], [1, 1, 0], True, True, "edit"),  # gains, no losses
    ([1, 0, 0], [0, 1, 1], True, True, "split"),  # gains and losses: keep both
    ([1, 0, 0], [0, 1, 1], True, False, "edit"),  # tree full: net gain wins
    ([1, 1, 0], [0, 0, 1], True, False, "draft"),  # tree full, net loss
    ([1, 0, 0], [0, 0, 0], True, True, "draft"),  # no gain
    ([1, 0, 0], [0, 1, 1], False, True, "edit"),  # single harness: net gain
    ([1, 1, 0], [0, 1, 1], False, True, "draft"),  # single harness: no net gain
])
def test_decide(parent, child, split, room, want):
    assert decide(parent, child, split, room) == want


def test_reflection_prompt_carries_the_text_first_and_the_failures():
    row = {"input": "What is 2+2?", "output": "5", "score": 0.0, "terms": "s.correct=0",
           "feedback": '{"stream": {"answer": 4}}'}
    prompt = reflection_prompt("instructions", "Be brief.", [row])
    assert prompt.index("```\nBe brief.\n```") < prompt.index("What is 2+2?")
    assert '"answer": 4' in prompt and "Output: 5" in prompt
    assert parse_proposal("ok\n```\nAdd carefully.\n```") == "Add carefully."
    assert parse_proposal(" plain ") == "plain"


# ---------------------------------------------------------------- a toy stream
# rlmix.testing.harness: a topic is solved when its hint word is in the harness and none of its
# conflicting words is. Phase A asks t0 only, phase B t0 and t1, phase C t0, t1 and t2; t1
# conflicts with alpha (t0's word), t2 with alpha and beta: no single harness solves two topics.

PHASE = 6


def topic_of(step, i):
    if step < PHASE:
        return "t0"
    if step < 2 * PHASE:
        return ("t0", "t1")[i % 2]
    return ("t0", "t1", "t2")[i % 3]


class CountingEnv(HintEnv):
    """HintEnv that records the steps it was asked for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        self.calls.append(step)
        return super().rlmix_prompts(run, step)


def toy_run(tmp_path, *overrides):
    env = CountingEnv(topic_of=topic_of, conflicts={"t1": {"alpha"}, "t2": {"alpha", "beta"}})
    run = make_run({**hint_plugins(env), "auto_harness": ah},
                   [f"out={tmp_path}", "train.prompts_per_step=6", "train.group_size=1",
                    "train.mode=harness-only", "harness.instructions=Answer.",
                    "auto_harness.metric=hintenv.correct", *overrides], with_policy=True)
    loop.configure(run)
    run.resources["auto_harness.lm"] = ScriptedLM(reply=hint_reflection)
    return run


def stream(run, steps):
    rows = []
    for _ in range(steps):
        metrics = loop.train_step(run)
        run.hook.rlmix_step_end(run=run, metrics=metrics)
        rows.append(metrics)
    return rows


def phase_means(rows):
    acc = [r["reward/hintenv.correct"] for r in rows]
    return [sum(acc[k:k + PHASE]) / PHASE for k in range(0, len(acc), PHASE)]


def test_claim_single_harness_peaks_then_declines_while_the_routed_tree_keeps_improving(
        tmp_path):
    single = stream(toy_run(tmp_path / "single", "auto_harness.split=false"), 3 * PHASE)
    tree_run = toy_run(tmp_path / "tree")
    tree = stream(tree_run, 3 * PHASE)
    s_a, s_b, s_c = phase_means(single)
    t_a, t_b, t_c = phase_means(tree)
    # one densely updated harness: best in the first phase, then worse in each later one
    assert s_a > s_b > s_c and s_c <= 1 / 3 + 1e-6
    # the routed tree does not decline, and ends far above the single harness
    assert t_a <= t_b <= t_c and t_c > s_c + 0.4
    assert [r["reward/hintenv.correct"] for r in tree[-3:]] == [1.0, 1.0, 1.0]
    state = tree_run.state["auto_harness"]
    assert len(state["nodes"]) == 3 and state["splits"] == 2
    texts = sorted(n["texts"]["instructions"] for n in state["nodes"])
    assert texts == ["Answer. alpha", "Answer. beta", "Answer. gamma"]
    # both losses are reported every step; the tree ends with no gap, the single harness with
    # an evolution loss of 2/3 (no harness it has solves t1 or t2)
    assert all("auto_harness/evolution_loss" in r and "auto_harness/adaptation_loss" in r
               for r in tree + single)
    assert tree[-1]["auto_harness/oracle_gap"] == 0.0
    assert single[-1]["auto_harness/evolution_loss"] == pytest.approx(2 / 3)
    assert (tmp_path / "tree" / "auto_harness" / "tree.json").exists()
    # the root is the run's harness; the specialists live in the tree only
    assert tree_run.harness["instructions"] == "Answer. alpha"


def test_routing_wraps_rlmix_prompts_and_does_not_reenter(tmp_path):
    run = toy_run(tmp_path)
    state = run.state["auto_harness"]
    state["nodes"].append({"id": 1, "parent": 0, "texts": {"instructions": "Answer. beta"},
                           "origin": "split", "born": 0, "edits": 0})
    # history: node 1 solved t1 tasks, the root t0 tasks
    for t, scores in (("t0", {0: 1.0, 1: 0.0}), ("t1", {0: 0.0, 1: 1.0})):
        state["history"].append(hist(f"Question 1.0 on topic {t}.", scores))
    calls = run.pm.get_plugin("hintenv").calls
    prompts = run.hook.rlmix_prompts(run=run, step=PHASE)  # t0, t1, t0, t1, ...
    texts = [p.messages[-1]["content"] for p in prompts]
    assert texts[0].endswith("topic t0. Answer.") and texts[1].endswith("topic t1. Answer. beta")
    assert [p.info["auto_harness"]["node"] for p in prompts] == [0, 1] * 3
    assert prompts[3].info["auto_harness"]["task"] == [PHASE, 3]
    assert calls == [PHASE, PHASE]  # the env once, then once more under node 1: no loop
    assert run.harness["instructions"] == "Answer."  # restored after re-rendering


def test_budget_is_never_overspent(tmp_path):
    run = toy_run(tmp_path, "auto_harness.budget=100")
    rows = stream(run, 2 * PHASE)
    calls = run.state["auto_harness"]["metric_calls"]
    assert 50 < calls <= 100
    assert "auto_harness/evolution_loss" not in rows[-1]  # nothing fits any more


def test_state_resumes_exactly(tmp_path):
    a = toy_run(tmp_path / "a")
    stream(a, PHASE + 1)
    saved = (copy.deepcopy(a.state), dict(a.harness), a.step, a.harness_version)
    stream(a, 6)
    b = toy_run(tmp_path / "b")
    b.state.clear()
    b.state.update(copy.deepcopy(saved[0]))
    b.harness.clear()
    b.harness.update(saved[1])
    b.step, b.harness_version = saved[2], saved[3]
    stream(b, 6)
    assert b.state["auto_harness"] == a.state["auto_harness"]
    assert b.harness == a.harness and len(a.state["auto_harness"]["nodes"]) == 2


def test_settings_and_missing_component_errors(tmp_path):
    with pytest.raises(rlmix.ManifestError, match="auto_harness.max_nodes"):
        make_run({"auto_harness": ah}, ["auto_harness.max_nodes=0"])
    with pytest.raises(rlmix.ManifestError, match="auto_harness.history_size"):
        make_run({"auto_harness": ah}, ["auto_harness.neighbors=0"])
    with pytest.raises(rlmix.ManifestError, match=r"auto_harness.lm.*source: 'cloud'"):
        make_run({"auto_harness": ah}, ["auto_harness.lm.source=cloud"])
    with pytest.raises(rlmix.ManifestError, match="auto_harness.splt"):
        make_run({"auto_harness": ah}, ["auto_harness.splt=false"])
    run = make_run({**hint_plugins(), "auto_harness": ah},
                   [f"out={tmp_path}", "auto_harness.components=[system]"])
    with pytest.raises(rlmix.ConfigError, match="auto_harness.components.*no component"):
        loop.configure(run)


def test_example_manifest_runs_two_steps_with_tiny_random(tmp_path):
    skip_unless_installed(EXAMPLE)
    out = tmp_path / "run"
    code = cli.main(["run", str(EXAMPLE), "model=tiny-random", "train.steps=2",
                     "train.prompts_per_step=2", "sampling.max_new_tokens=4",
                     "auto_harness.max_new_tokens=4", "auto_harness.lm.max_new_tokens=8",
                     "stream.eval_size=3", "stream.eval_max_new_tokens=4",
                     "train.eval_every=0", "train.checkpoint_every=1", "log.progress=false",
                     "log.plot=false", f"out={out}"])
    assert code == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["policy_version"] == 0 and "auto_harness/adaptation_loss" in r for r in steps)
    # one hindsight rollout per task per node (one node), plus the reflection's check
    assert steps[0]["auto_harness/metric_calls"] >= 2
    assert "rlmix_prompts          owner: stream  wrappers: auto_harness" in \
        (out / "hooks.txt").read_text()


# ---------------------------------------------------------------- bench/harness_stream.py


def load_bench():
    return load_script(ROOT / "bench" / "harness_stream.py")


def test_bench_summary_and_table_by_hand():
    bench = load_bench()
    assert bench.schedule_override(["add", "word"], 3) == \
        "stream.schedule=[{kind: 'add', steps: 3}, {kind: 'word', steps: 3}]"
    rows = [{"step": 0, "eval/accuracy": 0.25},
            {"step": 1, "reward/mean": 0, "stream/accuracy": 0.5, "time/step_s": 1.0},
            {"step": 2, "reward/mean": 0, "stream/accuracy": 1.0, "time/step_s": 1.0,
             "eval/accuracy": 0.5, "eval/accuracy/add": 1.0, "eval/accuracy/word": 0.0},
            {"step": 3, "reward/mean": 0, "stream/accuracy": 0.0, "time/step_s": 1.0},
            {"step": 4, "reward/mean": 0, "stream/accuracy": 0.25, "time/step_s": 1.0,
             "eval/accuracy": 0.75, "eval/accuracy/add": 0.5, "eval/accuracy/word": 1.0,
             "auto_harness/nodes": 2, "auto_harness/adaptation_loss": 0.1}]
    s = bench.summarise(rows, 2, ["add", "word"])
    assert s["eval_over_time"] == [[0, 0.25], [2, 0.5], [4, 0.75]]
    assert s["stream_accuracy_per_phase"] == [0.75, 0.125]
    assert s["final_eval_per_kind"] == {"add": 0.5, "word": 1.0}
    assert s["auto_harness"] == {"nodes": 2, "adaptation_loss": 0.1}
    text = bench.table({"x": {**s, "wall_s": 9.0}, "y": {"skipped": "not installed"}},
                       ["add", "word"])
    assert "| x | 0: 0.25, 2: 0.50, 4: 0.75 | 0.75 | 0.12 | 0.50 | 1.00 | 9 |" in text
    assert "| y | skipped: not installed |" in text
