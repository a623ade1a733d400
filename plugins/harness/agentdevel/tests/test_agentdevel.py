"""Tests of AgentDevel: symptom parsing (malformed counted), executable diagnosis, flips and the
flip gate, the blind critic, the budget and resume; and the paper's claim in miniature on a hint
world with conflicts: the flip-gated release line has no pass -> fail regressions and ends no
lower than the same loop promoting by mean score, which promotes releases that break solved
tasks; the critic never sees the harness text."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import rlmix_agentdevel
from rlmix_agentdevel import diagnose, flip_gate, flips, parse_proposal, parse_symptom
from rlmix_lm.chat_server import ScriptedLM

from rlmix import loop
from rlmix.errors import ManifestError
from rlmix.testing import harness_example_resumes, make_run
from rlmix.testing.harness import HintEnv, hint_plugins

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "harness" / "agentdevel-arith.yaml"


def hint_critic(prompt: str) -> str:
    """Labels a failure from the env's feedback alone."""
    missing = re.search(r"lack the word (\w+)", prompt)
    if missing:
        return f"symptom: missing-knowledge: {missing.group(1)}"
    banned = re.search(r"must not have the word (\w+)", prompt)
    if banned:
        return f"symptom: forbidden-content: {banned.group(1)}"
    return "I cannot tell"


def spec_writer(prompt: str) -> str:
    """Writes exactly what the spec asks: adds missing words, removes forbidden ones."""
    current = re.search(r"```\n(.*?)\n```", prompt, re.S).group(1).split()
    kind, items = re.search(r"Engineering spec \(([\w-]+)\), .*?: (.*)", prompt).groups()
    items = [w.strip() for w in items.split(",")]
    if kind == "missing-knowledge":
        new = current + [w for w in items if w not in current]
    else:
        new = [w for w in current if w not in items]
    return "```\n" + " ".join(new) + "\n```"


def test_symptoms_parse_and_malformed_ones_are_unknown():
    assert parse_symptom("symptom: missing-knowledge: beta") == ("missing-knowledge", "beta")
    assert parse_symptom("Symptom: Wrong-Format: no number\nmore") == ("wrong-format", "no number")
    assert parse_symptom("no idea") == ("unknown", "")


def test_diagnosis_takes_the_dominant_kind_and_skips_blocked_details():
    symptoms = [("missing-knowledge", "beta"), ("missing-knowledge", "gamma"),
                ("forbidden-content", "beta"), ("unknown", ""), ("missing-knowledge", "beta")]
    assert diagnose(symptoms, set()) == ("missing-knowledge", ["beta", "gamma"])
    # with beta blocked the kinds tie (one failure each): the name first in order wins
    assert diagnose(symptoms, {("missing-knowledge", "beta")}) == \
        ("forbidden-content", ["beta"])
    assert diagnose(symptoms, {("missing-knowledge", "beta"), ("forbidden-content", "beta")}) \
        == ("missing-knowledge", ["gamma"])
    assert diagnose([("unknown", "")], set()) is None


def test_flips_and_the_flip_gate():
    p2f, f2p = flips([1, 1, 0, 0], [1, 0, 1, 0])
    assert (p2f, f2p) == ([1], [2])
    assert not flip_gate(p2f, f2p, 0) and flip_gate(p2f, f2p, 1)
    assert not flip_gate([], [], 0)  # a release must fix something
    assert parse_proposal("```\nalpha\n```") == "alpha"


def test_settings_are_checked():
    with pytest.raises(ManifestError, match="agentdevel.gate"):
        make_run({"agentdevel": rlmix_agentdevel}, ["agentdevel.gate=vibes"])


def world_run(tmp_path, *overrides, critic=hint_critic):
    env = HintEnv(conflicts={"t0": {"beta"}, "t2": {"beta"}})
    run = make_run({**hint_plugins(env), "agentdevel": rlmix_agentdevel},
                   [f"out={tmp_path}", "train.prompts_per_step=4", "harness.instructions=alpha",
                    "agentdevel.metric=hintenv.correct", *overrides])
    loop.configure(run)
    run.resources["agentdevel.lm"] = ScriptedLM(reply=spec_writer)
    run.plugin_resources("agentdevel")["critic"] = ScriptedLM(reply=critic)
    return run


BUDGET = 8 * 11  # the first run and ten release candidates


def release(run, rounds=10):
    for _ in range(rounds):
        update = rlmix_agentdevel.iterate(run)
        if update is not None:
            loop.apply_harness_update(run, update)
    return run.state["agentdevel"]


def test_claim_flip_gating_never_regresses_and_ends_no_lower_than_mean_gating(tmp_path):
    flip_run = world_run(tmp_path / "flip", f"agentdevel.budget={BUDGET}")
    mean_run = world_run(tmp_path / "mean", f"agentdevel.budget={BUDGET}",
                         "agentdevel.gate=mean")
    flip, by_mean = release(flip_run), release(mean_run)
    for state in (flip, by_mean):
        assert state["metric_calls"] <= BUDGET and state["round"] == 10
    final = {k: sum(s["releases"][-1]["scores"]) / 8 for k, s in
             (("flip", flip), ("mean", by_mean))}
    assert flip["regressing_promotions"] == 0
    assert all(r["flips"] is None or r["flips"]["pass_to_fail"] == 0 for r in flip["releases"])
    assert final["flip"] >= final["mean"]
    assert by_mean["regressing_promotions"] >= 2  # mean gating shipped releases that broke tasks
    assert final["flip"] == 0.75
    # the critic is implementation-blind: no harness text of any release in its prompts
    for state in (flip, by_mean):
        texts = [r["text"] for r in state["releases"]]
        for prompt in state["critic_prompts"]:
            assert not any(t in prompt.split("Task: ", 1)[1].split("\n")[0] for t in texts)
            assert "alpha" not in prompt  # the seed's harness word never reaches the critic


def test_a_malformed_critic_reply_is_counted_not_a_crash(tmp_path):
    run = world_run(tmp_path, f"agentdevel.budget={BUDGET}", critic=lambda p: "???")
    state = release(run, rounds=2)
    assert state["malformed"] > 0 and len(state["releases"]) == 1


def test_budget_and_resume(tmp_path):
    state = release(world_run(tmp_path / "a", "agentdevel.budget=20"))
    assert state["metric_calls"] == 16
    run = world_run(tmp_path / "b", f"agentdevel.budget={BUDGET}")
    release(run, rounds=1)
    saved = pickle.loads(pickle.dumps({k: v for k, v in run.state.items()}))
    resumed = world_run(tmp_path / "c", f"agentdevel.budget={BUDGET}")
    resumed.state.update(saved)
    state = release(resumed, rounds=9)
    assert state["regressing_promotions"] == 0
    assert sum(state["releases"][-1]["scores"]) / 8 == 0.75


def test_example_manifest_runs_and_resumes_on_the_tiny_model(tmp_path):
    overrides = [
        "agentdevel.check_size=2", "agentdevel.budget=8", "agentdevel.max_new_tokens=4",
        "agentdevel.lm.max_new_tokens=8", "agentdevel.critic.max_new_tokens=8"]
    harness_example_resumes(EXAMPLE, tmp_path / "run", overrides, "agentdevel/metric_calls", 8)
