"""Tests of AHE: the prediction language (parsing and checking by hand), the structured reply,
the evidence corpus (dedup, cap, lessons first), the component files and their history, and
the claim in miniature on the hint world: an engineer LM that alternates good edits with true
predictions and harmful edits with false ones ends with every harmful edit reverted, every good
one kept, and a higher score than both the start and the same loop that never reverts. Also:
unparseable predictions are rejected, a resumed state continues exactly, LM distillation, the
example manifest runs, and settings errors name their keys."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import rlmix_ahe
from rlmix_ahe import (
    PredictionError,
    add_evidence,
    check_prediction,
    parse_edits,
    parse_prediction,
    signature,
)
from rlmix_harness import score_tasks, task_pool
from rlmix_lm.chat_server import ScriptedLM

import rlmix
from rlmix import loop
from rlmix.testing import make_run, skip_unless_installed
from rlmix.testing.harness import HintEnv, hint_plugins

ROOT = Path(__file__).resolve().parents[4]

# ---------------------------------------------------------------- predictions


def test_predictions_parse_into_checkable_clauses():
    inputs = ["Question 1.0 on topic t1.", "Question 1.1 on topic t2.", "Question 2.0 on topic t2."]
    clauses = parse_prediction("Mean rises by >= 0.25; tasks c0, c2 pass; "
                               "tasks matching \"topic t2\" rise by at least 0.5; "
                               "no passing task fails; mean does not drop by more than 0.1.",
                               3, inputs)
    assert clauses == [
        {"kind": "mean_gain", "delta": 0.25}, {"kind": "pass", "tasks": [0, 2]},
        {"kind": "subset_gain", "match": "topic t2", "tasks": [1, 2], "delta": 0.5},
        {"kind": "no_regress"}, {"kind": "mean_floor", "delta": 0.1}]
    assert parse_prediction("the mean does not drop", 3) == [{"kind": "mean_floor",
                                                               "delta": 0.0}]
    for bad, why in [("it will be much better", "cannot check"), ("tasks c7 pass", "no check"),
                     ("mean rises by >= 0", "> 0"), ("", "empty"),
                     ("tasks matching \"topic t9\" rise by >= 0.5", "no check task matches"),
                     ("mean rises by >= 0.1; and more", "cannot check")]:
        with pytest.raises(PredictionError, match=why):
            parse_prediction(bad, 3, inputs)


def test_predictions_checked_by_hand():
    before = [1.0, 0.0, 0.0, 1.0]
    after = [1.0, 1.0, 0.0, 0.0]  # c1 fixed, c3 broken: mean 0.5 -> 0.5
    cases = [
        ([{"kind": "mean_gain", "delta": 0.25}], False),
        ([{"kind": "mean_floor", "delta": 0.0}], True),
        ([{"kind": "pass", "tasks": [0, 1]}], True),
        ([{"kind": "pass", "tasks": [1, 2]}], False),
        ([{"kind": "subset_gain", "match": "x", "tasks": [1, 2], "delta": 0.5}], True),
        ([{"kind": "subset_gain", "match": "x", "tasks": [1, 2], "delta": 0.6}], False),
        ([{"kind": "no_regress"}], False),
        ([{"kind": "pass", "tasks": [1]}, {"kind": "no_regress"}], False),  # all must hold
    ]
    for clauses, expected in cases:
        held, why = check_prediction(clauses, before, after)
        assert held is expected, (clauses, why)
    held, why = check_prediction([{"kind": "no_regress"}], before, after)
    assert "regressed: c3" in why
    held, why = check_prediction([{"kind": "pass", "tasks": [1, 2]}], before, after)
    assert "still failing: c2" in why


def test_structured_reply_is_parsed_per_edit():
    reply = ("Here are my edits.\nEDIT instructions\nPREDICT: tasks c1 pass\n```\nAnswer. beta\n"
             "```\n\nEDIT: `system`\nPrediction: mean does not drop\n```text\nBe kind.\n```\n"
             "EDIT examples\nno prediction here\n```\nx\n```\nEDIT notes\nPREDICT: mean does "
             "not drop\n")
    edits = parse_edits(reply)
    assert [e["component"] for e in edits] == ["instructions", "system", "examples", "notes"]
    assert edits[0] == {"component": "instructions", "prediction": "tasks c1 pass",
                        "text": "Answer. beta"}
    assert edits[1]["text"] == "Be kind." and edits[1]["prediction"] == "mean does not drop"
    assert edits[2]["error"] == "no PREDICT line" and edits[3]["error"] == "no fenced text"
    assert parse_edits("I have no edits this round.") == []


def test_corpus_dedups_masks_numbers_caps_and_puts_lessons_first():
    a = {"score": 0.0, "feedback": '{"answer": 42, "parsed": 41}', "terms": ""}
    b = {"score": 0.0, "feedback": '{"answer": -7, "parsed": 9.5}', "terms": ""}
    assert signature(a) == signature(b) == ("failure", '{"answer": #, "parsed": #}')
    assert signature({"score": 1.0, "feedback": "", "terms": "x.correct=1"})[0] == "success"
    corpus: list = []
    add_evidence(corpus, [{"kind": "failure", "pattern": "p1"}] * 3 +
                 [{"kind": "success", "pattern": "s"}], step=1, cap=10)
    add_evidence(corpus, [{"kind": "failure", "pattern": "p2"},
                          {"kind": "lesson", "pattern": "edit e0 failed"}], step=2, cap=10)
    assert [(e["kind"], e["pattern"], e["count"]) for e in corpus] == [
        ("lesson", "edit e0 failed", 1), ("failure", "p2", 1), ("failure", "p1", 3),
        ("success", "s", 1)]
    assert corpus[2]["first_step"] == 1 and corpus[1]["last_step"] == 2
    add_evidence(corpus, [{"kind": "failure", "pattern": "p1"}], step=3, cap=2)
    assert [(e["pattern"], e["count"]) for e in corpus] == [("edit e0 failed", 1), ("p1", 4)]


# ---------------------------------------------------------------- the hint world

CONFLICTS = {"t0": {"zeta"}, "t1": {"zeta"}}  # "zeta" in the harness breaks topics t0 and t1


def hint_run(tmp_path, *overrides, conflicts=CONFLICTS):
    plugins = hint_plugins(HintEnv(conflicts=conflicts))
    plugins["ahe"] = rlmix_ahe
    run = make_run(plugins, [f"out={tmp_path}", "train.prompts_per_step=4",
                             "harness.instructions=Answer.", "ahe.metric=hintenv.correct",
                             "ahe.check_size=8", *overrides])
    loop.configure(run)
    return run


def current_text(prompt: str, component: str = "instructions") -> str:
    return re.search(rf"### file {component}\.txt \(version \d+\)\n```\n(.*?)\n```", prompt,
                     re.S).group(1)


def missing_words(prompt: str) -> dict[str, list[int]]:
    """``{word: [failing check ids whose feedback says the word is missing]}``."""
    out: dict[str, list[int]] = {}
    for k, word in re.findall(r"^c(\d+) \[fail\].*?lack the word (\w+)", prompt, re.M):
        out.setdefault(word, []).append(int(k))
    return out


def good_edit(prompt: str) -> str:
    """Add the first missing hint word and predict that its failing check tasks pass."""
    missing = missing_words(prompt)
    if not missing:
        return "No edits this round."
    word = sorted(missing)[0]
    ids = ", ".join(f"c{k}" for k in missing[word])
    return (f"EDIT instructions\nPREDICT: tasks {ids} pass\n```\n{current_text(prompt)} {word}"
            f"\n```")


def engineer():
    """An engineer LM: odd calls make a good edit with a true prediction; even calls add the
    word 'zeta' (which breaks two topics) and predict that the mean rises by 0.25."""
    calls = [0]

    def reply(prompt: str) -> str:
        calls[0] += 1
        if calls[0] % 2 == 0:
            return (f"EDIT instructions\nPREDICT: mean rises by >= 0.25\n```\n"
                    f"{current_text(prompt)} zeta\n```")
        return good_edit(prompt)

    return ScriptedLM(reply=reply)


def rounds(run, n: int) -> None:
    for _ in range(n):
        batch = rlmix_ahe.round_batch(run, run.step)
        update = rlmix_ahe.evolve(run, batch)
        if update is not None:
            loop.apply_harness_update(run, update)
        run.step += 1


def check_mean(run) -> float:
    s = run.settings("ahe")
    tasks = task_pool(run, s.check_size, s.task_step_base)  # the check tasks
    scores, _ = score_tasks(run, dict(run.harness), tasks, metric="hintenv.correct")
    return sum(scores) / len(scores)


def test_claim_failed_predictions_are_reverted_and_the_score_ends_higher(tmp_path):
    ahe = hint_run(tmp_path / "ahe")
    ahe.resources["ahe.lm"] = engineer()
    start = check_mean(ahe)
    rounds(ahe, 9)
    never = hint_run(tmp_path / "never", "ahe.revert=false")
    never.resources["ahe.lm"] = engineer()
    rounds(never, 9)
    final, final_never = check_mean(ahe), check_mean(never)
    assert (start, final, final_never) == (0.0, 1.0, 0.5)
    ledger = ahe.state["ahe"]["ledger"]
    harmful = [e for e in ledger if e["prediction"] == "mean rises by >= 0.25"]
    assert len(harmful) == 4
    assert all(e["status"] == "reverted" and e["outcome"].startswith("failed (mean")
               for e in harmful)
    good = [e for e in ledger if e not in harmful]
    assert len(good) == 4 and all(e["status"] == "kept" for e in good)
    assert "zeta" not in ahe.harness["instructions"]
    assert set(ahe.harness["instructions"].split()) == {"Answer.", "alpha", "beta", "gamma",
                                                        "delta"}
    counts = ahe.state["ahe"]["counts"]
    assert (counts["kept"], counts["reverted"], counts["applied"]) == (4, 4, 8)
    # without reverts the failed predictions are recorded, and the edits stay
    statuses = [e["status"] for e in never.state["ahe"]["ledger"]]
    assert "failed, kept" in statuses and "reverted" not in statuses
    assert "zeta" in never.harness["instructions"]
    # failed predictions become lessons in the evidence corpus the LM reads
    lessons = [e for e in ahe.state["ahe"]["corpus"] if e["kind"] == "lesson"]
    assert lessons and "reverted" in lessons[0]["pattern"]
    assert "## Ledger" in ahe.resources["ahe.lm"].prompts[-1]


def test_component_files_and_history_mirror_every_version_and_revert(tmp_path):
    run = hint_run(tmp_path)
    run.resources["ahe.lm"] = engineer()
    rounds(run, 3)  # good edit (kept), zeta edit, its revert, next good edit
    root = tmp_path / "ahe"
    versions = run.state["ahe"]["versions"]["instructions"]
    assert [v["why"] for v in versions] == ["seed", "e0", "e1", "revert e1", "e2"]
    assert versions[3]["text"] == versions[1]["text"]  # a revert restores the exact text
    history = sorted((root / "history" / "instructions").glob("v*.txt"))
    assert [p.read_text() for p in history] == [v["text"] for v in versions]
    assert (root / "instructions.txt").read_text() == run.harness["instructions"]
    ledger = json.loads((root / "ledger.json").read_text())
    assert [e["status"] for e in ledger] == ["kept", "reverted", "open"]
    assert not list(root.rglob("*.tmp"))
    # the core versioned every update (edits and reverts) as well
    assert run.harness_version == 3
    metrics: dict = {}
    rlmix_ahe.rlmix_step_end(run=run, metrics=metrics)
    assert metrics["ahe/rounds"] == 3 and metrics["ahe/reverted"] == 1
    assert metrics["ahe/metric_calls"] == 8 * 4  # 3 rounds + a rescore after the revert


def test_with_gate_a_held_prediction_must_also_pass_the_flip_gate(tmp_path):
    rlmix_gates = pytest.importorskip("rlmix_gates")

    def add_gamma(prompt: str) -> str:  # true prediction for t2, but gamma breaks t0
        ids = ", ".join(f"c{k}" for k in missing_words(prompt).get("gamma", []))
        return (f"EDIT instructions\nPREDICT: tasks {ids} pass\n```\n"
                f"{current_text(prompt)} gamma\n```")

    outcomes = {}
    for gate in (True, False):
        plugins = hint_plugins(HintEnv(conflicts={"t0": {"gamma"}}))
        plugins["gates"] = rlmix_gates
        plugins["ahe"] = rlmix_ahe
        run = make_run(plugins, [f"out={tmp_path / str(gate)}", "train.prompts_per_step=4",
                                 "harness.instructions=Answer. alpha",
                                 "ahe.metric=hintenv.correct", f"ahe.gate={gate}"])
        loop.configure(run)
        run.resources["ahe.lm"] = ScriptedLM(reply=add_gamma)
        rounds(run, 2)
        outcomes[gate] = run.state["ahe"]["ledger"][0]
    assert outcomes[False]["status"] == "kept"
    assert outcomes[True]["status"] == "reverted"
    assert "the gate refused" in outcomes[True]["outcome"]


def test_unparseable_or_invalid_edits_are_rejected_without_change(tmp_path):
    run = hint_run(tmp_path, "ahe.max_edits=2")
    run.resources["ahe.lm"] = ScriptedLM([
        "EDIT instructions\nPREDICT: it will be much better\n```\nAnswer. alpha\n```\n"
        "EDIT system\nPREDICT: mean does not drop\n```\nHi.\n```\n"
        "EDIT instructions\nPREDICT: tasks c99 pass\n```\nAnswer. beta\n```"])
    assert rlmix_ahe.evolve(run, None) is None
    ledger = run.state["ahe"]["ledger"]
    assert [e["status"] for e in ledger] == ["rejected"] * 3
    assert "unparseable prediction" in ledger[0]["outcome"]
    assert "no component 'system'" in ledger[1]["outcome"]
    assert "c99" in ledger[2]["outcome"]
    assert run.harness["instructions"] == "Answer." and not run.state["ahe"]["open"]


def test_state_resumes_exactly(tmp_path):
    a = hint_run(tmp_path / "a")
    a.resources["ahe.lm"] = ScriptedLM(reply=good_edit)
    rounds(a, 2)
    saved_state, saved_harness, step = copy.deepcopy(a.state), dict(a.harness), a.step
    rounds(a, 3)
    b = hint_run(tmp_path / "b")
    b.resources["ahe.lm"] = ScriptedLM(reply=good_edit)
    b.state.update(copy.deepcopy(saved_state))
    b.harness.update(saved_harness)
    b.step = step
    rounds(b, 3)
    assert b.state["ahe"] == a.state["ahe"] and b.harness == a.harness
    # the resumed run's files were rebuilt from the state
    assert (tmp_path / "b" / "ahe" / "history" / "instructions" / "v0000.txt").read_text() == \
        "Answer."


def test_lm_distillation_adds_lessons(tmp_path):
    run = hint_run(tmp_path, "ahe.distill=lm")

    def reply(prompt: str) -> str:
        if prompt.startswith("Summarise"):
            return "LESSON: name the topic's hint word\nLESSON: keep answers short"
        return "no edits"

    run.resources["ahe.lm"] = ScriptedLM(reply=reply)
    rlmix_ahe.evolve(run, rlmix_ahe.round_batch(run, 0))
    kinds = {(e["kind"], e["pattern"]) for e in run.state["ahe"]["corpus"]}
    assert ("summary", "name the topic's hint word") in kinds
    assert any(k == "failure" and "lack the word" in p for k, p in kinds)


def test_settings_and_missing_component_errors(tmp_path):
    with pytest.raises(rlmix.ManifestError, match="ahe.check_size"):
        make_run({"ahe": rlmix_ahe}, ["ahe.check_size=0"])
    with pytest.raises(rlmix.ManifestError, match="ahe.distill"):
        make_run({"ahe": rlmix_ahe}, ["ahe.distill=magic"])
    with pytest.raises(rlmix.ManifestError, match="ahe.components"):
        make_run({"ahe": rlmix_ahe}, ["ahe.components=[../etc]"])
    run = make_run({**hint_plugins(), "ahe": rlmix_ahe},
                   [f"out={tmp_path}", "ahe.components=[system]"])
    with pytest.raises(rlmix.ConfigError, match="ahe.components.*no component .system."):
        loop.configure(run)


@pytest.mark.slow  # about 8 s: the CLI, the tiny model and arith
def test_example_manifest_runs_on_the_tiny_model(tmp_path):

    from rlmix import cli

    example = ROOT / "examples" / "harness" / "ahe-arith.yaml"
    skip_unless_installed(example)
    out = tmp_path / "run"
    code = cli.main(["run", str(example), "model=tiny-random", "train.steps=2",
                     "train.prompts_per_step=2", "train.eval_every=0", "arith.eval_size=0",
                     "sampling.max_new_tokens=4", "ahe.max_new_tokens=4", "ahe.check_size=2",
                     "ahe.lm.max_new_tokens=8", "log.progress=false", "log.plot=false",
                     f"out={out}"])
    assert code == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["ahe/rounds"] for r in rows] == [1, 2]
    assert all(r["policy_version"] == 0 for r in rows)
    assert (out / "ahe" / "instructions.txt").exists()
    assert (out / "ahe" / "ledger.json").exists()
