"""Tests of workflow_memory: abstraction, tf-idf retrieval, rendering, the LM inducer's parsing,
dedup and the cap on hand-made memories; then a toy stream where a success carries the
information later tasks of its topic need (the paper's claim in miniature: online induction
raises accuracy over the stream relative to no memory, and retrieval picks the relevant
workflow), offline mode, the LM inducer, the re-entrance guard, a resume, settings errors, the
real loop and the example manifest."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import rlmix_workflow_memory as awm
from rlmix_harness import generate_scored, mean
from rlmix_lm.chat_server import ScriptedLM
from rlmix_workflow_memory import (
    abstract,
    add_workflow,
    cap,
    new_memory,
    parse_workflows,
    plan,
    render,
    retrieve,
    similarities,
)

import rlmix
from rlmix import loop
from rlmix.testing import make_run, skip_unless_installed
from rlmix.testing.harness import HINTS, HintEnv, HintModel, harness_words

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "harness" / "workflow_memory-arith.yaml"

# ---------------------------------------------------------------- pure parts


def test_abstract_replaces_standalone_numbers_only():
    assert abstract("Question 12.3 on topic t2. Clue: gamma.") == \
        "Question {n} on topic t2. Clue: gamma."
    assert abstract("What is 12+34? -5") == "What is {n}+{n}? {n}"


def test_similarity_weighs_rare_words_and_penalises_unseen_ones():
    docs = ["solve topic t0 with alpha", "solve topic t1 with beta", "solve topic t2 with gamma"]
    sims = similarities("solve topic t1", docs)
    assert sims[1] > 0.3 and sims[0] < 0.1 and sims[2] < 0.1
    # a query about something the memory never saw matches nothing well
    assert max(similarities("topic t7 with delta", docs)) < 0.3
    assert similarities("x", []) == []


def wf(wid, title, steps=("do it",), sources=(), support=1, used=0):
    return {"id": wid, "title": title, "steps": list(steps), "sources": list(sources),
            "templates": [], "support": support, "used": used, "created": 0}


def test_retrieve_ranks_filters_and_caps():
    wfs = [wf("w0", "add two numbers", sources=["What is {n}+{n}?"]),
           wf("w1", "subtract two numbers", sources=["What is {n}-{n}?"]),
           wf("w2", "name a colour", sources=["Which colour is the sky?"])]
    assert retrieve(wfs, "What is 3-4?", 1, 0.1) == [1]
    assert retrieve(wfs, "Which colour is grass?", 2, 0.1)[0] == 2
    assert retrieve(wfs, "Tell me a joke about cats", 2, 0.3) == []
    assert len(retrieve(wfs, "What is 3+4?", 3, 0.0)) <= 3


def test_render_keeps_the_starting_text():
    text = render([wf("w0", "add numbers", ["read both", "add"])], "Workflows:", "Be brief.")
    assert text == "Be brief.\n\nWorkflows:\nWorkflow: add numbers\n1. read both\n2. add"
    assert render([], "Workflows:", "Be brief.") == "Be brief."


def test_rule_workflow_abstracts_the_response_and_skips_empty_ones():
    title, steps = awm.rule_workflow("What is {n}+{n}?", ["", "The sum is 46."])
    assert title == "What is {n}+{n}?"
    assert steps == ["Task: What is {n}+{n}?", "A response that passed: The sum is {n}."]
    assert awm.rule_workflow("Q", [" "])[1] == ["Task: Q"]


def test_parse_workflows_from_an_lm_reply():
    reply = ("Sure.\nWORKFLOW: add two numbers\n- read {a} and {b}\n2. add them\n"
             "**Workflow**: empty one\nWORKFLOW: <a short title>\n- <step 1>\n")
    assert parse_workflows(reply) == [("add two numbers", ["read {a} and {b}", "add them"])]
    assert parse_workflows("no workflow here") == []


def test_dedup_folds_near_duplicates_and_the_cap_evicts_the_least_supported():
    memory = new_memory()
    a, how = add_workflow(memory, "add two numbers", ["read them", "add"], ["t1"], ["t1"],
                          0.8, 4)
    assert how == "added" and a == "w0"
    b, how = add_workflow(memory, "add two numbers", ["read them", "add"], ["t2", "t3"],
                          ["t2"], 0.8, 4)
    assert (b, how) == ("w0", "folded") and memory["workflows"][0]["support"] == 3
    assert memory["workflows"][0]["sources"] == ["t1", "t2", "t3"]
    add_workflow(memory, "name a colour", ["look"], ["c"], ["c"], 0.8, 4)
    add_workflow(memory, "count letters", ["count"], ["l1", "l2"], ["l"], 0.8, 4)
    assert [w["id"] for w in memory["workflows"]] == ["w0", "w1", "w2"]
    assert cap(memory, 2) == ["w1"]  # support 1 < 2 < 3
    assert [w["id"] for w in memory["workflows"]] == ["w0", "w2"] and memory["evicted"] == 1
    # sources keep the latest `keep`
    add_workflow(memory, "count letters", ["count"], ["l3", "l4", "l5"], ["l"], 0.8, 4)
    assert memory["workflows"][1]["sources"] == ["l2", "l3", "l4", "l5"]


def test_plan_credits_reused_workflows_and_groups_new_templates():
    memory = new_memory()
    add_workflow(memory, "t0 tasks", ["x"], ["Q {n} t0"], ["Q {n} t0"], 0.8, 4)
    items = [{"task": "Q 3 t0", "output": "", "used": []},    # known template
             {"task": "Q 4 t1", "output": "", "used": ["w0"]},  # reused w0
             {"task": "Q 5 t2", "output": "a", "used": []},    # new, unaided
             {"task": "Q 6 t2", "output": "b", "used": ["w9"]}]  # w9 is gone: unaided
    credit, groups = plan(memory, items)
    assert credit == {"w0": ["Q {n} t0", "Q {n} t1"]}
    assert list(groups) == ["Q {n} t2"] and len(groups["Q {n} t2"]) == 2


# ---------------------------------------------------------------- a toy stream
# HintModel solves a topic only when the topic's hint word is in the harness part of the
# prompt. ClueEnv gives one task per step a clue (its hint word) in the question, so without
# memory exactly that task is solved; a workflow induced from it carries the hint word, and
# retrieved for later tasks of the same topic it solves them. "alpha" (t0's hint) breaks t1,
# so putting the whole memory into every prompt hurts: retrieval has to pick.


class ClueEnv(HintEnv):
    def __init__(self, clue=lambda step, i: i == step % 4, **kwargs):
        super().__init__(**kwargs)
        self.clue = clue
        self.calls = 0

    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        self.calls += 1
        prompts = super().rlmix_prompts(run, step)
        for i, p in enumerate(prompts):
            if self.clue(step, i):
                topic, user = p.answer, p.messages[-1]
                user["content"] = user["content"].replace(
                    f"on topic {topic}.", f"on topic {topic}. Clue: {self.hints[topic]}.", 1)
        return prompts


def phases(step, i):  # steps 0-3: topics t0 / t1; steps 4-7: t2 / t3 (the stream shifts)
    return f"t{2 * ((step // 4) % 2) + i % 2}"


def toy_run(tmp_path, *overrides, env=None, plugin=True):
    env = env or ClueEnv(topic_of=phases, conflicts={"t1": {"alpha"}})
    plugins = {"hintenv": env, "hintmodel": HintModel(env)}
    if plugin:
        plugins["workflow_memory"] = awm
    run = make_run(plugins, [f"out={tmp_path}", "train.prompts_per_step=4",
                             "harness.system=You answer questions.",
                             "harness.instructions=Answer.",
                             *(["workflow_memory.inducer=rule", "workflow_memory.top_k=1",
                                "workflow_memory.metric=hintenv.correct"] if plugin else []),
                             *overrides])
    loop.configure(run)
    return run


def stream(run, steps, start=0):
    """prompts -> rollouts -> score -> evolve, as the loop does; accuracy per step."""
    acc = []
    for step in range(start, start + steps):
        run.step = step
        prompts = run.hook.rlmix_prompts(run=run, step=step)
        batch = generate_scored(run, prompts)
        acc.append(mean(batch.reward_terms["hintenv.correct"].tolist()))
        for update in run.hook.rlmix_evolve(run=run, batch=batch):
            assert update is None  # retrieval is per prompt: no harness update
    return acc


def test_claim_online_memory_raises_accuracy_over_the_stream(tmp_path):
    base = stream(toy_run(tmp_path / "none", plugin=False), 8)
    assert base == [0.25] * 8  # only the clue task, every step
    run = toy_run(tmp_path / "awm")
    acc = stream(run, 8)
    # each phase: the first step solves its clue task only; then the topics seen so far are
    # solved through retrieved workflows; the new phase starts over, then recovers
    assert acc == [0.25, 0.75, 1.0, 1.0, 0.25, 0.75, 1.0, 1.0]
    assert mean(acc) == 0.75 > mean(base)
    memory = run.state["workflow_memory"]
    assert len(memory["workflows"]) == 4  # one per topic: dedup and credit keep it at that
    hints = sorted(w for wf in memory["workflows"] for w in HINTS.values() if w in wf["title"])
    assert hints == sorted(HINTS.values())
    assert (tmp_path / "awm" / "workflow_memory.json").exists()


def test_retrieval_picks_the_relevant_workflow(tmp_path):
    run = toy_run(tmp_path)
    stream(run, 8)
    wfs = {w["id"]: w for w in run.state["workflow_memory"]["workflows"]}
    prompts = run.hook.rlmix_prompts(run=run, step=96)  # a fresh step: topics t0 / t1
    picked = [p.info.get("workflow_memory", []) for p in prompts]
    for p, ids in zip(prompts, picked):
        assert len(ids) == 1
        assert f"topic {p.answer}." in wfs[ids[0]]["title"]  # its own topic's workflow
        words = set(harness_words(p))
        assert HINTS[p.answer] in words  # and so its hint word
    # prompts of one topic share a rendering; the two topics differ
    assert prompts[0].messages[0]["content"] == prompts[2].messages[0]["content"]
    assert prompts[0].messages[0]["content"] != prompts[1].messages[0]["content"]
    # the whole memory in every prompt: t1 breaks on alpha, so selective retrieval wins
    every = toy_run(tmp_path / "all", "workflow_memory.top_k=10",
                    "workflow_memory.min_similarity=0.0")
    every.state["workflow_memory"] = copy.deepcopy(run.state["workflow_memory"])
    got = generate_scored(every, every.hook.rlmix_prompts(run=every, step=96))
    chosen = generate_scored(run, prompts)
    assert mean(chosen.reward_terms["hintenv.correct"].tolist()) == 1.0
    assert mean(got.reward_terms["hintenv.correct"].tolist()) == 0.5  # the t1 tasks fail


def test_the_wrapper_renders_once_per_retrieved_set_and_never_reenters(tmp_path):
    run = toy_run(tmp_path)
    stream(run, 3)  # memory for t0 and t1
    env = run.pm.get_plugin("hintenv")
    env.calls = 0
    run.hook.rlmix_prompts(run=run, step=50)
    assert env.calls == 1 + 2  # the env's own call + one per distinct retrieved set
    assert not run.resources[awm.BUSY]  # the guard is released


def test_memory_cap_holds_on_a_stream(tmp_path):
    run = toy_run(tmp_path, "workflow_memory.max_workflows=2")
    stream(run, 8)
    memory = run.state["workflow_memory"]
    assert len(memory["workflows"]) <= 2 and memory["evicted"] >= 2


def test_offline_mode_induces_before_the_first_step_and_then_freezes(tmp_path):
    env = ClueEnv(clue=lambda step, i: i == 0)  # default topics: (step + i) % 4
    run = toy_run(tmp_path, "workflow_memory.mode=offline", "workflow_memory.offline_size=16",
                  env=env)
    acc = stream(run, 3)
    memory = run.state["workflow_memory"]
    assert memory["offline_done"] and memory["metric_calls"] == 16
    assert len(memory["workflows"]) == 4  # the four clue tasks of the offline tasks
    assert acc == [1.0, 1.0, 1.0]  # every topic solved from the very first step
    assert memory["credited"] == 0  # offline: the stream adds nothing
    assert [e["origin"] for e in memory["log"]] == ["offline"]


def test_lm_inducer_summarises_and_falls_back_to_the_rule(tmp_path):
    def reply(prompt):
        if "topic t0" in prompt:
            return "WORKFLOW: questions on topic t0\n- mention alpha\n- answer the topic"
        return "I cannot help with that."

    run = toy_run(tmp_path, "workflow_memory.inducer=lm")
    lm = ScriptedLM(reply=reply)
    run.resources["workflow_memory.lm"] = lm
    acc = stream(run, 3)
    memory = run.state["workflow_memory"]
    titles = [w["title"] for w in memory["workflows"]]
    assert titles[0] == "questions on topic t0"
    assert memory["workflows"][0]["steps"] == ["mention alpha", "answer the topic"]
    assert memory["lm_failures"] == 1 and "Clue: beta" in titles[1]  # the rule's fallback
    assert "Attempt 1" in lm.prompts[0] and "ANSWER t0" in lm.prompts[0]
    assert acc == [0.25, 0.75, 1.0]


def test_state_resumes_exactly(tmp_path):
    a = toy_run(tmp_path / "a")
    stream(a, 3)
    saved = copy.deepcopy(a.state)
    acc_a = stream(a, 4, start=3)
    b = toy_run(tmp_path / "b")
    b.state.clear()
    b.state.update(saved)
    acc_b = stream(b, 4, start=3)
    assert acc_a == acc_b and b.state["workflow_memory"] == a.state["workflow_memory"]


def test_step_end_metrics(tmp_path):
    run = toy_run(tmp_path)
    stream(run, 2)
    metrics = run.drain_metrics()  # the retrieval rates, logged while prompts were rendered
    awm.rlmix_step_end(run, metrics)
    assert metrics["workflow_memory/workflows"] == 2
    # per step (it was the count since the last step end, here steps 0 and 1 together: 2/8)
    assert metrics["workflow_memory/hit_rate"] == pytest.approx(2 / 4)  # step 1: 2 of 4 hit
    assert metrics["workflow_memory/induced"] == 2 and metrics["workflow_memory/credited"] == 2
    after: dict = {}
    awm.rlmix_step_end(run, after)
    assert "workflow_memory/hit_rate" not in after  # logged once, drained with its step


@pytest.mark.parametrize(("override", "key"), [
    ("workflow_memory.mode=sometimes", "workflow_memory.mode"),
    ("workflow_memory.inducer=magic", "workflow_memory.inducer"),
    ("workflow_memory.top_k=0", "workflow_memory.top_k"),
    ("workflow_memory.min_similarity=2", "workflow_memory.min_similarity"),
    ("workflow_memory.dedup_threshold=0", "workflow_memory.dedup_threshold"),
    ("workflow_memory.lm.source=cloud", "workflow_memory.lm"),
    ("workflow_memory.topk=3", "workflow_memory.topk"),
])
def test_settings_errors_name_the_key(override, key):
    with pytest.raises(rlmix.ManifestError, match=key.replace(".", r"\.")):
        make_run({"workflow_memory": awm}, [override])


def test_offline_needs_tasks():
    with pytest.raises(rlmix.ManifestError, match=r"workflow_memory\.offline_size"):
        make_run({"workflow_memory": awm}, ["workflow_memory.mode=offline",
                                            "workflow_memory.offline_size=0"])


def test_in_the_real_loop_harness_only(tmp_path):
    run = toy_run(tmp_path, "train.mode=harness-only", "train.group_size=2")
    loop.load_policy(run)
    rows = [loop.train_step(run) for _ in range(3)]
    for r in rows:
        run.hook.rlmix_step_end(run=run, metrics=r)
    assert [r["reward/mean"] for r in rows] == [0.25, 0.75, 1.0]
    assert rows[-1]["workflow_memory/workflows"] == 2 and run.harness_version == 0


def test_async_sampler_worker_retrieves_without_deadlock(tmp_path):
    # with train.max_staleness=1 the background worker calls rlmix_prompts (and so this
    # plugin's wrapper) up to one step ahead, so memory reaches the prompts one step later at
    # worst; the last step of each phase is solved either way
    run = toy_run(tmp_path, "train.mode=harness-only", "train.max_staleness=1",
                  "train.steps=8", "train.checkpoint_every=0", "log.plot=false")
    loop.load_policy(run)
    loop.train(run)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 8 and rewards[3] == 1.0 and rewards[7] == 1.0
    assert rewards[0] == 0.25 and rewards[4] == 0.25  # each phase starts with no memory of it
    assert rows[-1]["workflow_memory/workflows"] == 4
    assert not run.resources[awm.BUSY]


# ---------------------------------------------------------------- the example manifest


def test_example_manifest_runs_two_steps_with_the_tiny_model(tmp_path):
    from rlmix import cli

    skip_unless_installed(EXAMPLE)
    out = tmp_path / "run"
    args = ["run", str(EXAMPLE), "model=tiny-random", "train.prompts_per_step=2",
            "train.eval_every=0", "train.checkpoint_every=1", "arith.eval_size=2",
            "sampling.max_new_tokens=4", "workflow_memory.offline_size=2",
            "workflow_memory.max_new_tokens=4", "workflow_memory.lm.max_new_tokens=8",
            "log.progress=false", "log.plot=false", f"out={out}"]
    assert cli.main([*args, "train.steps=2"]) == 0
    assert cli.main([*args, "train.steps=3", "--resume"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["policy_version"] == 0 for r in rows)
    # the offline tasks ran once: not again after the resume
    assert [r["workflow_memory/metric_calls"] for r in rows] == [2, 2, 2]
    assert "workflow_memory/hit_rate" in rows[0]
