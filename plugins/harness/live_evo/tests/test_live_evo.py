"""Tests of Live-Evo: retrieval in proportion to weight and relevance, the reinforce / decay /
prune rule by hand, rule distillation with merging, the per-prompt ``rlmix_prompts`` wrapper,
and the paper's claim in miniature on a stream with a distribution shift (helpful experiences
gain weight, stale ones decay and are forgotten, and the stream's accuracy rises and recovers
after the shift faster than with frozen weights), plus the LM path, resume and settings."""

from __future__ import annotations

import copy
import random
from collections import Counter

import pytest
import rlmix_live_evo as le
from rlmix_harness import feedback_text
from rlmix_lm.chat_server import ScriptedLM

import rlmix
from rlmix import loop
from rlmix.testing import example_resumes, make_run
from rlmix.testing.harness import HintEnv, harness_words, hint_plugins

EXAMPLE = le.__file__.rsplit("/plugins/", 1)[0] + "/examples/harness/live_evo-arith.yaml"

# ---------------------------------------------------------------- retrieval


def test_sampling_follows_scores_and_is_seeded():
    scores = [1.0, 3.0, 0.0, 6.0]
    rng = random.Random(0)
    counts = Counter(le.weighted_sample(scores, 1, rng)[0] for _ in range(6000))
    assert counts[2] == 0  # a zero score is never drawn
    assert counts[0] / 6000 == pytest.approx(0.1, abs=0.02)
    assert counts[1] / 6000 == pytest.approx(0.3, abs=0.02)
    assert counts[3] / 6000 == pytest.approx(0.6, abs=0.02)
    two = le.weighted_sample(scores, 2, random.Random(5))
    assert len(set(two)) == 2 and 2 not in two  # without replacement
    assert two == le.weighted_sample(scores, 2, random.Random(5))


def test_retrieval_score_is_weight_times_exp_relevance_similarity():
    bank = [{"id": 0, "task": "topic t0 alpha", "weight": 2.0},
            {"id": 1, "task": "topic t1", "weight": 1.0}]
    # task words {topic, t0}: similarity 2/3 with item 0, 1/3 with item 1
    got = le.retrieval_scores(bank, "topic t0", relevance=3.0)
    assert got == pytest.approx([2.0 * 2.718281828 ** 2.0, 1.0 * 2.718281828 ** 1.0])
    assert le.retrieval_scores(bank, "topic t0", relevance=0.0) == [2.0, 1.0]
    # for "topic t1": similarity 1/4 with item 0, 1 with item 1
    assert le.top_guidelines(bank, "topic t1", 1, relevance=0.0) == [0]  # weight alone
    assert le.top_guidelines(bank, "topic t1", 1, relevance=3.0) == [1]  # 2e^0.75 < e^3


# ---------------------------------------------------------------- the weight rule


def test_reinforce_decay_cap_prune_by_hand():
    s = le.Settings(reinforce=2.0, decay=0.5, max_weight=3.0, prune_below=0.3, forget=0.9)
    bank = [{"id": i, "weight": 1.0, "shown": 0, "helped": 0} for i in range(4)]
    # prompt A (gain 1) was shown 0 and 1, prompt B (gain 0) was shown 1 and 2
    le.credit(bank, [([0, 1], 1.0), ([1, 2], 0.0), ([9], 1.0)], s)  # 9: pruned, ignored
    assert [e["weight"] for e in bank] == [2.0, 1.0, 0.5, 1.0]
    assert [e["shown"] for e in bank] == [1, 2, 1, 0]
    assert [e["helped"] for e in bank] == [1, 1, 0, 0]
    le.credit(bank, [([0], 1.0), ([2], -1.0)], s)
    assert bank[0]["weight"] == 3.0  # capped at max_weight
    assert bank[2]["weight"] == 0.25
    dropped = le.forget_and_prune(bank, s, cap=2)
    # forget: 2.7, 0.9, 0.225 (pruned), 0.9; cap 2 keeps the heaviest, the newer of equals
    assert [e["id"] for e in dropped] == [1, 2]
    assert [(e["id"], round(e["weight"], 3)) for e in bank] == [(0, 2.7), (3, 0.9)]
    frozen = le.Settings(learn=False)
    bank = [{"id": 0, "weight": 1.0, "shown": 0, "helped": 0}]
    le.credit(bank, [([0], -1.0)] * 5, frozen)
    assert bank[0]["weight"] == 1.0 and bank[0]["shown"] == 5
    assert le.update_weight(1.0, 0.0, s) == 0.5  # no gain is not a help: it decays


# ---------------------------------------------------------------- distillation


def test_rule_distillation_feedback_and_merging():
    info = {"hint": {"hint": "the instructions lack the word beta"}, "episode": {"x": 1},
            "live_evo": {"shown": [1]}}
    assert feedback_text(info, le.NAME) == "hint: the instructions lack the word beta"
    assert feedback_text({"arith": {"answer": 46, "parsed": None}}) == "answer: 46"
    assert le.rule_lesson(False, "no idea", "hint: lack beta", 100) == "hint: lack beta"
    assert le.rule_lesson(True, " 46 ", "", 100) == "answering '46' was right"
    assert le.rule_lesson(False, "45", "", 100) == "answering '45' was wrong"
    bank = [{"lesson": "the instructions lack the word beta", "seen": 1, "weight": 1.0, "id": 0}]
    assert le.find_duplicate(bank, "The instructions lack the word BETA.", 0.9) is bank[0]
    assert le.find_duplicate(bank, "the instructions lack the word gamma", 0.9) is None
    bank[0]["seen"] = 2
    assert le.rule_guidelines(bank, set(), 2, 1.0) == [(bank[0]["lesson"], [0])]
    assert le.rule_guidelines(bank, {bank[0]["lesson"]}, 2, 1.0) == []
    assert le.rule_guidelines(bank, set(), 3, 1.0) == []


# ---------------------------------------------------------------- the stream (HintEnv)

SHIFT = 12


def stream_run(tmp_path, *overrides, env=None):
    env = env or HintEnv(topic_of=lambda step, i: f"t{i % 2}")
    plugins = {**hint_plugins(env), "live_evo": le}
    run = make_run(plugins, [f"out={tmp_path}", "train.prompts_per_step=4", "train.group_size=1",
                             "train.mode=harness-only", "harness.instructions=Answer.",
                             "sampling.max_new_tokens=4", *overrides], with_policy=True)
    loop.configure(run)
    return run, env


def play(run, env, steps, shift=SHIFT):
    """Train steps through the core loop; at ``shift`` the hint words change (t0: alpha ->
    omega, t1: beta -> sigma), so the old lessons go stale. Returns per-step accuracy."""
    accs = []
    while run.step < steps:
        if run.step == shift:
            env.hints.update({"t0": "omega", "t1": "sigma"})
        metrics = loop.train_step(run)
        le.rlmix_step_end(run, metrics)
        accs.append(metrics["reward/mean"])
    return accs


def lesson_kind(text):
    if "omega" in text or "sigma" in text:
        return "current"
    return "stale" if ("alpha" in text or "beta" in text) else "useless"


def test_wrapper_gives_each_prompt_its_own_memory(tmp_path):
    run, env = stream_run(tmp_path, "live_evo.k=1", "live_evo.guideline_k=0",
                          "harness.system=Be brief.")
    state = le.state_of(run)
    for i, (topic, word) in enumerate([("t0", "alpha"), ("t1", "beta")]):
        state["experiences"].append({
            "id": i, "task": f"Question 0.{i} on topic {topic}. Answer.", "action": "no idea",
            "outcome": 0.0, "success": False, "lesson": f"the instructions lack the word {word}",
            "weight": 1.0, "shown": 0, "helped": 0, "seen": 1, "born": 0})
    prompts = run.hook.rlmix_prompts(run=run, step=40)
    again = run.hook.rlmix_prompts(run=run, step=40)
    assert [p.messages for p in prompts] == [p.messages for p in again]  # seeded by step
    for p in prompts:
        topic = p.info["topic"]
        shown = p.info["live_evo"]["shown"]
        assert len(shown) == 1
        system = p.messages[0]["content"]
        assert system.startswith("Be brief.\n\nExperience from similar past tasks:")
        # relevance 8: the same topic's lesson wins by exp(8 * 0.25) to 1, most of the time
        assert p.info["live_evo"]["plain"][0]["content"] == "Be brief."
        assert p.info["live_evo"]["task"] == p.messages[-1]["content"]
        assert topic in p.info["live_evo"]["task"]
    words = [("alpha" in harness_words(p)) == (p.info["topic"] == "t0") for p in prompts]
    assert sum(words) >= 3
    assert run.resources[le._RENDERING] == set()  # the guard is released


def test_claim_helpful_experiences_gain_weight_stale_ones_are_forgotten(tmp_path):
    # one experience per prompt, no guidelines: each prompt's gain credits exactly one entry
    over = ["live_evo.k=1", "live_evo.guideline_k=0"]
    run, env = stream_run(tmp_path / "a", *over)
    accs = play(run, env, 2 * SHIFT)
    frozen, fenv = stream_run(tmp_path / "b", *over, "live_evo.learn=false")
    accs_frozen = play(frozen, fenv, 2 * SHIFT)
    state = run.state["live_evo"]
    weights = {}
    for e in state["experiences"]:
        weights.setdefault(lesson_kind(e["lesson"]), []).append(e["weight"])
    # the lessons that help now were reinforced above their starting weight
    assert max(weights["current"]) > 2.0
    # every stale lesson (alpha, beta) was decayed below prune_below and forgotten
    assert "stale" not in weights
    forgotten = [f for f in state["forgotten"] if f["step"] >= SHIFT]
    assert {lesson_kind(f["text"]) for f in forgotten} >= {"stale", "useless"}
    assert all(f["weight"] < 0.25 for f in forgotten)
    # forgotten entries are no longer retrieved: only live ids are shown
    prompts = run.hook.rlmix_prompts(run=run, step=run.step)
    live = {e["id"] for e in state["experiences"]}
    assert all(set(p.info["live_evo"]["shown"]) <= live for p in prompts)
    # with frozen weights nothing is forgotten and every lesson is retrieved as often as before
    assert all(e["weight"] == 1.0 for e in frozen.state["live_evo"]["experiences"])
    assert frozen.state["live_evo"]["pruned"] == 0
    # stream accuracy: starts at 0, learning beats frozen weights before and after the shift
    assert accs[0] == 0.0 and accs[SHIFT] == 0.0
    before, after = sum(accs[1:SHIFT]) / (SHIFT - 1), sum(accs[SHIFT:]) / SHIFT
    f_before = sum(accs_frozen[1:SHIFT]) / (SHIFT - 1)
    f_after = sum(accs_frozen[SHIFT:]) / SHIFT
    assert before >= f_before + 0.25, (accs, accs_frozen)
    assert after >= f_after + 0.25, (accs, accs_frozen)


def test_claim_default_settings_recover_after_a_shift(tmp_path):
    run, env = stream_run(tmp_path / "a")
    accs = play(run, env, 2 * SHIFT)
    frozen, fenv = stream_run(tmp_path / "b", "live_evo.learn=false")
    accs_frozen = play(frozen, fenv, 2 * SHIFT)
    # accuracy rises from 0 to (nearly) 1 before the shift, for both
    assert accs[0] == 0.0 and sum(accs[4:SHIFT]) / (SHIFT - 4) >= 0.9
    # after the shift: back to 1 within 4 steps; the last 8 steps well above frozen weights
    assert max(accs[SHIFT:SHIFT + 4]) == 1.0
    late, late_frozen = sum(accs[-8:]) / 8, sum(accs_frozen[-8:]) / 8
    assert late >= 0.85 and late >= late_frozen + 0.25, (accs, accs_frozen)
    m = {}
    le.rlmix_step_end(run, m)
    assert m["live_evo/experiences"] >= 2 and m["live_evo/baseline_rollouts"] > 0
    assert 0.0 <= m["live_evo/helped"] <= 1.0 and m["live_evo/guidelines"] >= 1


def test_baselines_decide_the_direction(tmp_path):
    # a fixed baseline of 1.0 can never be beaten: every shown entry only decays
    run, env = stream_run(tmp_path, "live_evo.baseline=fixed", "live_evo.baseline_value=1.0",
                          "live_evo.prune_below=0.0001")
    play(run, env, 6)
    state = run.state["live_evo"]
    assert state["baseline_rollouts"] == 0
    assert all(e["weight"] <= 1.0 for e in state["experiences"])
    assert any(e["weight"] < 1.0 for e in state["experiences"])
    run, env = stream_run(tmp_path / "ema", "live_evo.baseline=ema", "live_evo.ema=0.5")
    accs = play(run, env, 3)
    expected = accs[0]
    for a in accs[1:]:
        expected = 0.5 * expected + 0.5 * a
    assert run.state["live_evo"]["ema"] == pytest.approx(expected)


def test_lm_distillation_and_guidelines(tmp_path):
    def reply(prompt):
        if "RULE:" in prompt:
            return "RULE: name the missing word of each topic\nRULE: <rule>"
        word = prompt.split("lack the word ")[-1].split()[0] if "lack the word" in prompt else ""
        return f"LESSON: always write {word}" if word else "I cannot tell."

    run, env = stream_run(tmp_path, "live_evo.distill=lm")
    lm = run.resources["live_evo.lm"] = ScriptedLM(reply=reply)
    accs = play(run, env, 6)
    state = run.state["live_evo"]
    lessons = {e["lesson"] for e in state["experiences"]}
    assert {"always write alpha", "always write beta"} <= lessons
    assert state["distill_failed"] > 0  # successes give the scripted LM nothing to say
    assert [g["text"] for g in state["guidelines"]] == ["name the missing word of each topic"]
    first = lm.prompts[0]
    assert "Task: Question 0.0 on topic t0. Answer." in first and "lack the word alpha" in first
    assert accs[0] == 0.0 and accs[-1] == 1.0


def test_state_resumes_exactly(tmp_path):
    a, env_a = stream_run(tmp_path / "a")
    play(a, env_a, 5)
    saved = copy.deepcopy(a.state)
    play(a, env_a, 10)
    b, env_b = stream_run(tmp_path / "b")
    b.state.clear()
    b.state.update(saved)
    b.step = 5
    play(b, env_b, 10)
    assert b.state["live_evo"] == a.state["live_evo"]


@pytest.mark.parametrize(("override", "key"), [
    ("live_evo.decay=1.5", "live_evo.decay"), ("live_evo.reinforce=0.5", "live_evo.reinforce"),
    ("live_evo.baseline=median", "live_evo.baseline"), ("live_evo.k=-1", "live_evo.k"),
    ("live_evo.prune_below=2.0", "live_evo.initial_weight"), ("live_evo.component=", "component"),
    ("live_evo.lm.source=cloud", "live_evo.lm"), ("live_evo.dedup=0", "live_evo.dedup")])
def test_settings_errors_name_the_key(override, key):
    with pytest.raises(rlmix.ManifestError, match=key.replace(".", r"\.")):
        make_run({"live_evo": le}, [override])


def test_example_manifest_runs_and_resumes(tmp_path):
    rows, state = example_resumes(EXAMPLE, tmp_path / "ex", "live_evo",
                                  ["live_evo.max_new_tokens=4"], eval_size=4)
    assert rows[-1]["live_evo/experiences"] >= 1 and rows[-1]["policy_version"] == 0
    assert state["live_evo"]["steps"] == 2
