"""Tests of DemoEvolve: demonstration files and their selection by similarity to failures, the
reflection prompt, the acceptance rule and budget, teacher demonstrations, resume, and the
paper's claim in miniature in a sparse-feedback hint world (no feedback names the missing
word): self-rollout evolution stays at the seed's 0.25, two relevant demonstrations lift it to
0.75, two unrelated ones do not (control)."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import rlmix_demo_evolve
from rlmix_demo_evolve import parse_proposal, read_demos, reflection_prompt, select_demos
from rlmix_lm.chat_server import ScriptedLM

from rlmix import loop
from rlmix.errors import ConfigError, ManifestError
from rlmix.testing import harness_example_resumes, make_run
from rlmix.testing.demos import SparseHintEnv, demo_reader, hint_demos
from rlmix.testing.harness import HINTS, HintModel

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "harness" / "demo_evolve-arith.yaml"

# ---------------------------------------------------------------- pure parts


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_demos_and_its_errors(tmp_path):
    good = write(tmp_path / "d.jsonl", [{"input": "a", "output": "b", "extra": 1}])
    assert read_demos(good) == [{"input": "a", "output": "b"}]
    with pytest.raises(ConfigError, match="no such file"):
        read_demos(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"input": "a"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: a demonstration needs"):
        read_demos(tmp_path / "bad.jsonl")
    (tmp_path / "junk.jsonl").write_text("\nnot json\n")
    with pytest.raises(ConfigError, match=r"junk.jsonl:2: not JSON"):
        read_demos(tmp_path / "junk.jsonl")


def test_demos_are_chosen_by_similarity_to_the_failures():
    demos = hint_demos(["t1", "t2", "t3"])
    failed = ["Question 5.0 on topic t2. alpha", "Question 5.1 on topic t3. alpha"]
    assert select_demos(demos, failed, 2) == [1, 2]
    assert select_demos(demos, failed, 1) == [1]  # ties: the earlier demonstration
    assert select_demos(demos, [], 2) == []  # nothing failed: nothing shown
    assert select_demos([{"input": "zz", "output": "y"}], failed, 2) == []  # unrelated words


def test_reflection_prompt_shows_failures_and_demonstrations():
    prompt = reflection_prompt("instructions", "alpha",
                               [{"input": "Q t1", "output": "no idea", "score": 0.0}],
                               hint_demos(["t1"]), 600)
    assert "```\nalpha\n```" in prompt and "Output: no idea" in prompt
    assert "## Demonstration 1" in prompt and "Expert output: Recall beta. ANSWER t1" in prompt
    assert "Demonstration" not in reflection_prompt("i", "x", [], [], 600)
    assert parse_proposal("```\nalpha beta\n```") == "alpha beta"


def test_settings_are_checked(tmp_path, capsys):
    # no demonstration file: a warning at configure, and proposals show no demonstrations
    run = world_run(tmp_path / "none", "demo_evolve.budget=24")
    assert "no demos_path shows no demonstrations" in capsys.readouterr().out
    run.resources["demo_evolve.lm"] = ScriptedLM(reply=demo_reader(seed=0))
    rlmix_demo_evolve.iterate(run)
    assert run.state["demo_evolve"]["demos"] == []
    with pytest.raises(ConfigError, match="no such file"):
        world_run(tmp_path / "missing", "demo_evolve.demos_path=/nonexistent.jsonl")
    with pytest.raises(ManifestError, match="demo_evolve.demo_source"):
        make_run({"demo_evolve": rlmix_demo_evolve}, ["demo_evolve.demo_source=web"])


# ---------------------------------------------------------------- the search in a hint world


def world_run(tmp_path, *overrides):
    env = SparseHintEnv()
    run = make_run({"hintenv": env, "hintmodel": HintModel(env),
                    "demo_evolve": rlmix_demo_evolve},
                   [f"out={tmp_path}", "train.prompts_per_step=4", "harness.instructions=alpha",
                    "demo_evolve.metric=hintenv.correct", "demo_evolve.eval_size=8",
                    *overrides])
    loop.configure(run)
    return run


BUDGET = 8 * (1 + 6)  # the seed and six proposals, 8 tasks each


def evolve(run, limit=20):
    for _ in range(limit):
        update = rlmix_demo_evolve.iterate(run)
        if update is not None:
            loop.apply_harness_update(run, update)
        state = run.state["demo_evolve"]
        if state["metric_calls"] + len(state["tasks"]) > BUDGET:
            break
    return run.state["demo_evolve"]


def arm(tmp_path, name, source, demos=None):
    extra = [f"demo_evolve.demo_source={source}", f"demo_evolve.budget={BUDGET}"]
    if demos is not None:
        extra.append(f"demo_evolve.demos_path={write(tmp_path / f'{name}.jsonl', demos)}")
    run = world_run(tmp_path / name, *extra)
    lm = ScriptedLM(reply=demo_reader(seed=0))
    run.resources["demo_evolve.lm"] = lm
    state = evolve(run)
    return state, lm, run


def test_claim_relevant_demonstrations_lift_sparse_feedback_evolution(tmp_path):
    self_play, self_lm, _ = arm(tmp_path, "self", "none")
    relevant, rel_lm, run = arm(tmp_path, "relevant", "file", hint_demos(["t1", "t2"]))
    unrelated, _, _ = arm(tmp_path, "unrelated", "file",
                          hint_demos(["t5", "t6"], {"t5": "omega", "t6": "sigma"}))
    for state in (self_play, relevant, unrelated):  # one budget, fully spent by each arm
        assert state["metric_calls"] == BUDGET
    score = {k: sum(s["scores"]) / 8 for k, s in
             (("self", self_play), ("relevant", relevant), ("unrelated", unrelated))}
    assert score["self"] == 0.25  # blind edits with sparse feedback: nothing to go on
    assert score["relevant"] >= 0.75
    assert score["unrelated"] == 0.25  # demonstrations must be relevant (control)
    assert set(run.harness["instructions"].split()) >= {"alpha", "beta", "gamma"}
    # no feedback ever named a missing word: the sparse world hands over nothing
    assert not any(re.search(r"lack the word", p) for p in self_lm.prompts + rel_lm.prompts)
    assert HINTS["t3"] not in run.harness["instructions"]  # no demonstration of t3, not found


def test_a_child_is_kept_only_when_it_scores_strictly_higher(tmp_path):
    state, lm, run = arm(tmp_path, "self", "none")
    assert state["accepted"] == 0 and run.harness_version == 0
    assert len(lm.prompts) == 6 and all(not h["accepted"] for h in state["history"])


def test_teacher_demonstrations_are_banked_and_used(tmp_path):
    def teacher(prompt: str) -> str:  # competent: recalls the hint of the prompt's topic
        topic = re.search(r"on topic (t\d)", prompt).group(1)
        return f"Recall {HINTS[topic]}. ANSWER {topic}"

    run = world_run(tmp_path, "demo_evolve.demo_source=teacher", f"demo_evolve.budget={BUDGET}")
    run.resources["demo_evolve.lm"] = ScriptedLM(reply=demo_reader(seed=0))
    run.plugin_resources("demo_evolve")["teacher"] = ScriptedLM(reply=teacher)
    state = evolve(run)
    assert sum(state["scores"]) / 8 == 1.0
    assert state["teacher_calls"] == len(state["demos"]) >= 3
    assert all(d["output"].startswith("Recall ") for d in state["demos"])


def test_state_pickles_and_resumes(tmp_path):
    demos = write(tmp_path / "d.jsonl", hint_demos(["t1", "t2"]))
    run = world_run(tmp_path / "a", f"demo_evolve.demos_path={demos}",
                    f"demo_evolve.budget={BUDGET}")
    run.resources["demo_evolve.lm"] = ScriptedLM(reply=demo_reader(seed=0))
    rlmix_demo_evolve.iterate(run)
    saved = pickle.loads(pickle.dumps(run.state))
    resumed = world_run(tmp_path / "b", f"demo_evolve.demos_path={demos}",
                        f"demo_evolve.budget={BUDGET}")
    resumed.resources["demo_evolve.lm"] = ScriptedLM(reply=demo_reader(seed=0))
    resumed.state.update(saved)
    state = evolve(resumed)
    assert state["metric_calls"] == BUDGET and state["iteration"] >= 2


def test_example_manifest_runs_and_resumes_on_the_tiny_model(tmp_path):
    demos = ROOT / "examples" / "harness" / "demos" / "arith-demos.jsonl"
    overrides = [
        "demo_evolve.eval_size=2", "demo_evolve.budget=8", f"demo_evolve.demos_path={demos}",
        "demo_evolve.max_new_tokens=4", "demo_evolve.lm.max_new_tokens=8"]
    harness_example_resumes(EXAMPLE, tmp_path / "run", overrides, "demo_evolve/metric_calls", 8)
