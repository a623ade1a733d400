"""Tests of EvolveMem: retrieval under each configuration field by hand, the rule diagnosis and
its remedies, parsing of an LM's action, and the paper's claim in miniature on the hint world
(from the minimal configuration the diagnosis reaches the clearly best one; a regressing action
is reverted and the score comes back; a stagnating search explores out of it), plus the
per-prompt wrapper, resume, settings and the example manifest."""

from __future__ import annotations

import copy
import random

import pytest
import rlmix_evolve_mem as em
from rlmix_lm.chat_server import ScriptedLM

import rlmix
from rlmix import loop
from rlmix.testing import example_resumes, make_run
from rlmix.testing.harness import HINTS, HintEnv, harness_words, hint_plugins

EXAMPLE = em.__file__.rsplit("/plugins/", 1)[0] + "/examples/harness/evolve_mem-arith.yaml"


def entry(i, task, success, feedback="", score=None, output=""):
    return {"id": i, "step": 0, "task": task, "output": output or ("ok" if success else "no"),
            "score": float(success) if score is None else score, "success": success,
            "feedback": feedback}


def cfg(**kw):
    base = {"k": 1, "scoring": "recency", "store": "full", "max_size": 16,
            "placement": "system"}
    return {**base, **kw}


# ---------------------------------------------------------------- retrieval by hand


def test_each_field_changes_what_is_retrieved():
    mem = [entry(0, "topic red apple", False, "use red"),
           entry(1, "topic blue sky", True, score=0.9),
           entry(2, "topic green leaf", False, "use green", score=0.2),
           entry(3, "topic blue sea", True, score=0.7)]
    ids = [e["id"] for e in em.retrieve(mem, "topic red car", cfg(k=2))]
    assert ids == [3, 2]  # recency: newest first
    ids = [e["id"] for e in em.retrieve(mem, "topic red car", cfg(k=2, scoring="similarity"))]
    assert ids[0] == 0  # shares "topic red"; the rest share "topic" only: newest wins ties
    assert ids == [0, 3]
    ids = [e["id"] for e in em.retrieve(mem, "x", cfg(k=3, scoring="reward"))]
    assert ids == [1, 3, 2]
    assert [e["id"] for e in em.retrieve(mem, "x", cfg(k=4, store="failures"))] == [2, 0]
    assert [e["id"] for e in em.retrieve(mem, "x", cfg(k=4, store="successes"))] == [3, 1]
    assert [e["id"] for e in em.retrieve(mem, "x", cfg(k=4, max_size=2))] == [3, 2]
    assert em.retrieve(mem, "x", cfg(k=0)) == []
    full = em.render([mem[0]], "full", "M:")
    assert full == "M:\n- Task: topic red apple | Answer: no | Score: 0 | Feedback: use red"
    assert em.render([mem[1]], "summary", "M:") == "M:\n- topic blue sky -> solved: answer ok"
    assert em.render([mem[0]], "failures", "M:") == "M:\n- topic red apple -> failed: use red"


def test_rule_diagnosis_causes_and_remedies():
    s = em.Settings()
    logs = [{"success": False, "shown": [], "max_sim": 0.0},
            {"success": False, "shown": [1], "max_sim": 0.2},
            {"success": False, "shown": [1], "max_sim": 0.8},
            {"success": False, "shown": [], "max_sim": 0.0},
            {"success": True, "shown": [], "max_sim": 0.0}]
    assert dict(em.causes(logs, 0.5)) == {"no_memory": 2, "irrelevant": 1, "unhelpful": 1}
    assert em.rule_diagnosis(logs, cfg(k=0), s, set()) == ("k", 1)
    assert em.remedies("irrelevant", cfg(), s)[0] == ("scoring", "similarity")
    assert em.remedies("irrelevant", cfg(scoring="similarity"), s)[0] == ("max_size", 64)
    assert em.remedies("unhelpful", cfg(), s)[0] == ("store", "failures")
    assert em.remedies("no_memory", cfg(k=4, max_size=64), s) == []  # nothing left: no k up
    # an action reverted from this very config is not proposed again
    tabu = {(em.config_key(cfg(k=0)), "k=1")}
    assert em.rule_diagnosis(logs, cfg(k=0), s, tabu) == ("max_size", 64)
    rng = random.Random(0)
    for _ in range(50):
        f, v = em.random_action(cfg(), s, rng, {(em.config_key(cfg()), "k=2")})
        assert v != cfg()[f] and (f, v) != ("k", 2) and v in em.choices(s, f)


def test_parse_action_accepts_only_the_action_space():
    s = em.Settings()
    assert em.parse_action("cause: x\nACTION: scoring=similarity", cfg(), s) == ("scoring",
                                                                                  "similarity")
    assert em.parse_action("ACTION: k=4", cfg(), s) == ("k", 4)
    assert em.parse_action("ACTION: k=3", cfg(), s) is None  # not a k choice
    assert em.parse_action("ACTION: k=1", cfg(), s) is None  # no change
    assert em.parse_action("ACTION: temperature=0", cfg(), s) is None
    assert em.parse_action("ACTION: k=many\nACTION: store=failures", cfg(), s) == (
        "store", "failures")


# ---------------------------------------------------------------- the hint world


def hint_run(tmp_path, *overrides):
    plugins = {**hint_plugins(HintEnv()), "evolve_mem": em}
    run = make_run(plugins, [f"out={tmp_path}", "train.prompts_per_step=4", "train.group_size=1",
                             "train.mode=harness-only", "harness.instructions=Answer.",
                             "sampling.max_new_tokens=4", *overrides], with_policy=True)
    loop.configure(run)
    return run


def fixed_memory(run, failure_newest=()):
    """For each topic a failure that names its hint word and a success that does not, the
    success newer (except for the topics in ``failure_newest``): only failures help, only
    similarity finds the right topic."""
    state = em.state_of(run)
    mem = []
    for topic in sorted(HINTS):
        task = f"Question 7.7 on topic {topic}. Answer."  # no number shared with a task
        pair = [entry(0, task, False, f"hint: the instructions lack the word {HINTS[topic]}",
                      output="no idea"), entry(0, task, True, output=f"ANSWER {topic}")]
        mem += pair[::-1] if topic in failure_newest else pair
    for i, e in enumerate(mem):
        e["id"] = i
    state["memory"], state["next_id"] = mem, len(mem)
    return state


def test_wrapper_renders_each_prompt_under_the_active_config(tmp_path):
    run = hint_run(tmp_path, "evolve_mem.k=1", "evolve_mem.scoring=similarity",
                   "evolve_mem.store=failures", "evolve_mem.placement=instructions")
    fixed_memory(run)
    prompts = run.hook.rlmix_prompts(run=run, step=50)
    assert len(prompts) == 4
    for p in prompts:
        topic = p.info["topic"]
        assert HINTS[topic] in harness_words(p)  # its own topic's failure was shown
        assert sum(HINTS[t] in harness_words(p) for t in HINTS) == 1
        assert p.info["evolve_mem"]["max_sim"] > 0.5
        assert "Memory of past tasks:" in p.messages[-1]["content"]  # placement: instructions
    assert run.resources[em._RENDERING] == set()


def test_claim_diagnosis_reaches_the_best_config_from_the_minimal_one(tmp_path):
    run = hint_run(tmp_path)  # k=0: no memory (the minimal baseline)
    rewards = []
    for _ in range(8):
        metrics = loop.train_step(run)
        em.rlmix_step_end(run, metrics)
        rewards.append(metrics["reward/mean"])
    state = run.state["evolve_mem"]
    history = state["history"]
    assert history[0]["score"] == 0.0 and history[0]["diagnose"] == "k=1"
    best = state["best_config"]
    assert state["best"] == 1.0
    assert best["k"] >= 1 and best["scoring"] == "similarity" and best["store"] == "failures"
    final = state["config"]
    assert final["k"] >= 1 and final["scoring"] == "similarity" and final["store"] == "failures"
    assert history[-1]["score"] == 1.0
    # each step was a diagnosis, not a random move, and every kept action was kept on evidence
    assert [h.get("diagnose") for h in history[:3]] == ["k=1", "scoring=similarity",
                                                       "store=failures"]
    assert state["explores"] == 0
    # the training stream itself is answered with the memory: it rises from 0 to 1
    assert rewards[0] == 0.0 and rewards[-1] == 1.0
    assert metrics["evolve_mem/best"] == 1.0 and metrics["evolve_mem/metric_calls"] == 8 * 8


def test_claim_a_regression_is_reverted_and_the_score_comes_back(tmp_path):
    run = hint_run(tmp_path, "evolve_mem.k=1", "evolve_mem.scoring=similarity",
                   "evolve_mem.diagnose=lm", "evolve_mem.patience=5")
    state = fixed_memory(run)

    def saboteur(prompt):  # the diagnosis LM wants to switch memory off
        return "Root cause: too much memory.\nACTION: k=0"

    lm = run.resources["evolve_mem.lm"] = ScriptedLM(reply=saboteur)
    first = em.round_(run)
    assert first["score"] == 0.0  # the newest same-topic entry is a useless success
    assert first["diagnose"] == "k=0"
    # k=0 gives 0 as well: not a regression, kept; the LM's k=0 is now no change (invalid), so
    # the rule diagnosis answers: nothing was shown -> k=1
    second = em.round_(run)
    assert second["kept"] == "k=0" and second["score"] == 0.0
    assert second["diagnose"] == "k=1" and state["lm_fallbacks"] == 1
    # from a configuration that half works, the LM's k=0 makes the score drop: reverted
    run2 = hint_run(tmp_path / "b", "evolve_mem.k=1", "evolve_mem.scoring=similarity",
                    "evolve_mem.diagnose=lm")
    state2 = fixed_memory(run2, failure_newest=("t2", "t3"))
    run2.resources["evolve_mem.lm"] = ScriptedLM(reply=saboteur)
    r0 = em.round_(run2)
    assert r0["score"] == 0.5 and r0["diagnose"] == "k=0"
    r1 = em.round_(run2)
    assert r1["score"] == 0.0 and r1["reverted"] == "k=0"
    assert r1["parent_now"] == r1["score_after_revert"] == r0["score"]  # it came back, exactly
    assert state2["reverts"] == 1 and r1["config"]["k"] == 1
    # the reverted action is not taken again from that configuration: the LM's k=0 is refused
    # and the rule diagnosis answers (the shown entries were similar but useless)
    assert r1["diagnose"] == "store=failures"
    r2 = em.round_(run2)
    assert r2["kept"] == "store=failures" and r2["score"] == 1.0 and state2["best"] == 1.0
    # the diagnosis LM read the configuration, the allowed values and the failure logs
    assert len(lm.prompts) == 2
    assert "k=1, scoring=similarity, store=full" in lm.prompts[0]
    assert "Allowed values: k: 0, 1, 2, 4;" in lm.prompts[0]
    assert "feedback: hint: the instructions lack the word" in lm.prompts[0]


def test_a_drop_the_memory_caused_is_not_reverted(tmp_path):
    run = hint_run(tmp_path, "evolve_mem.k=1", "evolve_mem.scoring=similarity",
                   "evolve_mem.diagnose=lm", "evolve_mem.patience=5")
    state = fixed_memory(run, failure_newest=("t2", "t3"))
    run.resources["evolve_mem.lm"] = ScriptedLM(["ACTION: placement=instructions"])
    r0 = em.round_(run)
    assert r0["score"] == 0.5 and r0["diagnose"] == "placement=instructions"
    # the memory loses topic t2's failure before the next round: every config drops
    state["memory"] = [e for e in state["memory"]
                       if not (e["task"].endswith("t2. Answer.") and not e["success"])]
    r1 = em.round_(run)
    assert r1["score"] == 0.25 and r1["parent_now"] == 0.25
    assert r1["kept"] == "placement=instructions" and r1["unconfirmed_drop"]
    assert state["reverts"] == 0 and state["config"]["placement"] == "instructions"


def test_claim_explores_out_of_a_stagnation(tmp_path):
    run = hint_run(tmp_path, "evolve_mem.k=1", "evolve_mem.diagnose=lm",
                   "evolve_mem.patience=2")
    state = fixed_memory(run)

    def stuck(prompt):  # a diagnosis that only ever moves the memory around (no effect here)
        return ("ACTION: placement=instructions" if "placement=system" in prompt.splitlines()[1]
                else "ACTION: placement=system")

    run.resources["evolve_mem.lm"] = ScriptedLM(reply=stuck)
    history = [em.round_(run) for _ in range(16)]
    flat = history[0]["score"]
    assert flat == 0.0
    # two rounds without a new best, then an exploring (random) action
    assert "explore" not in history[0] and "explore" not in history[1]
    assert "explore" in history[2]
    explores = [h for h in history if "explore" in h]
    assert len(explores) >= 3 and state["explores"] == len(explores)
    # exploration (with reverts guarding it) leaves the plateau: the first rise is an explored
    # action kept on evidence
    assert state["best"] > flat
    up = next(i for i, h in enumerate(history) if h["score"] > flat)
    assert history[up]["kept"] == history[up - 1]["explore"]
    assert max(h.get("score_after_revert", h["score"]) for h in history) == state["best"]


def test_state_resumes_exactly(tmp_path):
    a = hint_run(tmp_path / "a", "evolve_mem.patience=1")
    for _ in range(3):
        loop.train_step(a)
    saved, step = copy.deepcopy(a.state), a.step
    for _ in range(3):
        loop.train_step(a)
    b = hint_run(tmp_path / "b", "evolve_mem.patience=1")
    b.state.clear()
    b.state.update(saved)
    b.step = step
    for _ in range(3):
        loop.train_step(b)
    assert b.state["evolve_mem"] == a.state["evolve_mem"]


@pytest.mark.parametrize(("override", "key"), [
    ("evolve_mem.k=3", "evolve_mem.k"), ("evolve_mem.scoring=bm25", "evolve_mem.scoring"),
    ("evolve_mem.store_choices=[full,everything]", "evolve_mem.store_choices"),
    ("evolve_mem.patience=0", "evolve_mem.patience"), ("evolve_mem.diagnose=oracle",
                                                       "evolve_mem.diagnose"),
    ("evolve_mem.k_choices=[]", "evolve_mem.k_choices"),
    ("evolve_mem.lm.source=cloud", "evolve_mem.lm")])
def test_settings_errors_name_the_key(override, key):
    with pytest.raises(rlmix.ManifestError, match=key.replace(".", r"\.")):
        make_run({"evolve_mem": em}, [override])


def test_example_manifest_runs_and_resumes(tmp_path):
    rows, state = example_resumes(EXAMPLE, tmp_path / "ex", "evolve_mem",
                                  ["evolve_mem.max_new_tokens=4", "evolve_mem.eval_size=2"],
                                  eval_size=4)
    assert rows[-1]["evolve_mem/memory"] == 4 and rows[-1]["evolve_mem/metric_calls"] >= 4
    assert state["evolve_mem"]["round"] == 2
