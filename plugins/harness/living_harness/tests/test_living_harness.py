"""Tests of Living-Harness: trajectory walking and repair extraction by hand, evidence and the
capped stores, the episode and prompt wrappers, the LM path, and the claim on a scripted
multi-turn workflow with a recurring malformed call (with against without the plugin, same
episodes, same turn limit)."""

from __future__ import annotations

import copy

import pytest
import rlmix_living_harness as lh
from rlmix_lm.chat_server import ScriptedLM

import rlmix
from rlmix import loop
from rlmix.testing import example_resumes, make_run
from rlmix.testing.memory_worlds import (
    ScriptedAgentEngine,
    Workflow,
    WorkflowEnv,
    workflow_agent,
)

EXAMPLE = lh.__file__.rsplit("/plugins/", 1)[0] + "/examples/harness/living_harness-tools.yaml"

# ---------------------------------------------------------------- trajectories by hand


def turn(action, state, error=""):
    info = {"state": state, **({"error": error} if error else {})}
    return {"assistant": f"<tool>{action}</tool>", "info": info}


def test_walk_repairs_and_transitions_by_hand():
    turns = [turn("search", "found"), turn("pay", "found", "needs a card"),
             turn("pay", "found", "needs a card"), turn("pay_verified", "done")]
    steps = lh.walk(turns, "start", "state")
    assert [(s["from"], s["action"], s["to"]) for s in steps] == [
        ("start", "search", "found"), ("found", "pay", "found"), ("found", "pay", "found"),
        ("found", "pay_verified", "done")]
    assert lh.repairs(steps) == [{"state": "found", "failed": "pay", "error": "needs a card",
                                  "recovery": "pay_verified", "to": "done"}]
    assert lh.transitions(steps) == [("start", "search", "found"),
                                     ("found", "pay_verified", "done")]
    # a failure never repaired in its state (the episode moved on by other means) is no repair
    steps = lh.walk([turn("x", "s0", "bad"), turn("y", "s1"), turn("z", "done")], "s0", "state")
    assert lh.repairs(steps) == [{"state": "s0", "failed": "x", "error": "bad",
                                  "recovery": "y", "to": "s1"}]
    steps = lh.walk([turn("x", "s0", "bad"), turn("x", "s0", "bad")], "s0", "state")
    assert lh.repairs(steps) == []
    assert lh.action_of("ok <tool> pay  now </tool>") == "pay now"


def test_evidence_merging_and_caps():
    state = {"entries": [], "edges": [], "rules": [], "states": {}, "next_id": 0}
    rep = {"state": "s", "failed": "a", "error": "e", "recovery": "r", "to": "t"}
    lh.write_repair(state, "task one", rep, 0, 60)
    lh.write_repair(state, "task two", rep, 3, 60)
    assert len(state["entries"]) == len(state["edges"]) == 1
    e = state["edges"][0]
    assert (e["attempts"], e["successes"], e["last"]) == (2, 2, 3)
    assert lh.confidence(e) == pytest.approx(3 / 4)
    e["attempts"] += 3  # shown three times, failed each time
    assert lh.confidence(e) == pytest.approx(3 / 7)
    items = [{"id": i, "attempts": a, "successes": s_, "last": last}
             for i, (a, s_, last) in enumerate([(1, 1, 0), (4, 0, 5), (1, 1, 2)])]
    gone = lh.cap(items, 2)
    assert [g["id"] for g in gone] == [1] and [i["id"] for i in items] == [0, 2]
    gone = lh.cap(items, 1)
    assert [g["id"] for g in gone] == [0]  # equal evidence: the less recently confirmed goes
    nodes = {"a": {"seen": 3, "last": 1}, "b": {"seen": 1, "last": 4}, "c": {"seen": 9, "last": 0}}
    assert lh.cap_states(nodes, 2) == 1 and set(nodes) == {"a", "b"}


# ---------------------------------------------------------------- the workflow world

BOOKING = Workflow(moves={"start": {"search": "found"}, "found": {"select": "chosen"},
                          "chosen": {"pay_verified": "done"}},
                   broken={"chosen": {"pay": "pay needs a verified card"}})
REFUND = Workflow(moves={"start": {"lookup": "open"}, "open": {"refund": "done"}})


class Recorder:
    """Keeps every scored batch (to read the episodes back)."""

    def __init__(self):
        self.batches = []

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        self.batches.append(batch)
        return {}


def workflow_run(tmp_path, flows, *overrides, plugin=True):
    env, engine, rec = WorkflowEnv(flows), ScriptedAgentEngine(workflow_agent), Recorder()
    plugins = {"workflowenv": env, "agent": engine, "recorder": rec}
    if plugin:
        plugins["living_harness"] = lh
    run = make_run(plugins, [f"out={tmp_path}", "train.prompts_per_step=2",
                             "train.group_size=1", "train.mode=harness-only",
                             "harness.system=You are an agent.", *overrides], with_policy=True)
    loop.configure(run)
    return run, engine, rec


def play(run, steps):
    while run.step < steps:
        metrics = loop.train_step(run)
        if "living_harness" in run.plugin_names:
            lh.rlmix_step_end(run, metrics)


def malformed(batch_info, state="chosen"):
    turns = batch_info["episode"]["turns"]
    return any(t["info"].get("kind") == "malformed" and t["info"].get("from") == state
               for t in turns)


def recurrence(rec, family="booking"):
    """Per step: the share of that family's episodes with the malformed call."""
    out = []
    for batch in rec.batches:
        rows = [i for i, p in enumerate(batch.prompts) if p.info["workflow"] == family]
        out.append(sum(malformed(batch.info[i]) for i in rows) / len(rows))
    return out


def test_claim_the_recurring_failure_stops_recurring(tmp_path):
    steps = 12
    flows = {"booking": BOOKING, "refund": REFUND}
    caps = ["living_harness.max_entries=2", "living_harness.max_edges=2",
            "living_harness.max_rules=4", "living_harness.max_states=5"]
    run, engine, rec = workflow_run(tmp_path / "a", flows, *caps)
    sizes = []
    while run.step < steps:
        play(run, run.step + 1)
        st = run.state["living_harness"]
        sizes.append((len(st["entries"]), len(st["edges"]), len(st["rules"]), len(st["states"])))
    base, base_engine, base_rec = workflow_run(tmp_path / "b", flows, plugin=False)
    play(base, steps)
    episodes = sum(len(b) for b in rec.batches)
    assert episodes == sum(len(b) for b in base_rec.batches) == 2 * steps  # same budget
    with_plugin, without = recurrence(rec), recurrence(base_rec)
    first = next(i for i, r in enumerate(with_plugin) if r > 0)
    after = with_plugin[first + 1:]
    rate, base_rate = sum(after) / len(after), sum(without[first + 1:]) / len(after)
    assert rate <= 0.1, with_plugin
    assert base_rate == 1.0 and set(without) == {1.0}  # without it: every episode, every step
    # the stores stay within their caps at every step
    assert all(e <= 2 and d <= 2 and r <= 4 and n <= 5 for e, d, r, n in sizes), sizes
    # every episode still reaches done (the agent recovered by trying), fewer calls with repairs
    assert all(float(b.rewards.mean()) == 1.0 for b in rec.batches)
    assert engine.calls < base_engine.calls
    edge = run.state["living_harness"]["edges"][0]
    assert (edge["from"], edge["failed"], edge["recovery"]) == ("chosen", "pay", "pay_verified")
    print(f"living_harness claim: recurrence after the first occurrence {rate:.2f} with the "
          f"plugin vs {base_rate:.2f} without; model calls {engine.calls} vs "
          f"{base_engine.calls}; store sizes at the end {sizes[-1]}")


def test_caps_hold_with_many_distinct_failures(tmp_path):
    flows = {f"w{k}": Workflow(moves={"start": {f"ok{k}": "done"}},
                               broken={"start": {f"bad{k}": f"bad call {k}"}})
             for k in range(6)}
    run, _, rec = workflow_run(tmp_path, flows, "living_harness.max_entries=3",
                               "living_harness.max_edges=2", "train.prompts_per_step=3")
    for _ in range(6):
        play(run, run.step + 1)
        st = run.state["living_harness"]
        assert len(st["entries"]) <= 3 and len(st["edges"]) <= 2
    assert run.state["living_harness"]["evicted"] > 0


def test_learn_false_and_episode_wrapper(tmp_path):
    flows = {"booking": BOOKING}
    run, _, rec = workflow_run(tmp_path, flows, "living_harness.learn=false")
    play(run, 3)
    assert run.state["living_harness"]["edges"] == [] and set(recurrence(rec)) == {1.0}
    # a known edge is shown on entering its state, and credited when its recovery fails
    st = run.state["living_harness"]
    lh.write_repair(st, "booking task", {"state": "chosen", "failed": "pay", "error": "e",
                                         "recovery": "pay_verified", "to": "done"}, 0, 60)
    prompt = run.hook.rlmix_prompts(run=run, step=9)[0]
    episode = run.hook.rlmix_episode(run=run, prompt=prompt)
    assert isinstance(episode, lh.GuidedEpisode)
    episode.reset()
    episode.step("<tool>search</tool>")
    result = episode.step("<tool>select</tool>")
    assert "[harness] In state chosen: `pay` fails; use `pay_verified`" in \
        result.messages[-1]["content"]
    assert "When in state chosen `pay` fails" in prompt.messages[0]["content"]
    steps = [{"from": "chosen", "action": "pay_verified", "to": "chosen", "error": "boom"}]
    turns = [{"info": {"living_harness": {"shown": [st["edges"][0]["id"]]}}}]
    lh.credit_shown(st, steps, turns)
    assert (st["edges"][0]["attempts"], st["edges"][0]["successes"]) == (2, 1)


def test_lm_evolution_reads_repair_lines(tmp_path):
    flows = {"booking": BOOKING}
    run, _, rec = workflow_run(tmp_path, flows, "living_harness.evolve=lm")
    lm = run.resources["living_harness.lm"] = ScriptedLM(reply=lambda p: (
        "REPAIR: state=chosen | fails=pay | use=pay_verified\n"
        "REPAIR: state=found | fails=invented | use=select"))  # not in the trajectory: ignored
    play(run, 4)
    st = run.state["living_harness"]
    assert [(e["from"], e["failed"], e["recovery"]) for e in st["edges"]] == [
        ("chosen", "pay", "pay_verified")]
    assert "chosen -> pay -> chosen ERROR pay needs a verified card" in lm.prompts[0]
    assert recurrence(rec)[1:] == [0.0, 0.0, 0.0]


def test_state_resumes_exactly(tmp_path):
    flows = {"booking": BOOKING, "refund": REFUND}
    a, _, _ = workflow_run(tmp_path / "a", flows)
    play(a, 3)
    saved = copy.deepcopy(a.state)
    play(a, 6)
    b, _, _ = workflow_run(tmp_path / "b", flows)
    b.state.clear()
    b.state.update(saved)
    b.step = 3
    play(b, 6)
    assert a.state["living_harness"] == b.state["living_harness"]


@pytest.mark.parametrize(("override", "key"), [
    ("living_harness.evolve=magic", "living_harness.evolve"),
    ("living_harness.max_edges=0", "living_harness.max_edges"),
    ("living_harness.k=-1", "living_harness.k"),
    ("living_harness.trigger_match=2", "living_harness.trigger_match")])
def test_settings_errors_name_the_key(override, key):
    with pytest.raises(rlmix.ManifestError, match=key.replace(".", r"\.")):
        make_run({"living_harness": lh}, [override])


def test_example_manifest_runs_and_resumes(tmp_path):
    rows, state = example_resumes(EXAMPLE, tmp_path / "ex", "living_harness", env="tools",
                                  tokens=8)
    assert "living_harness/edges" in rows[-1]
    assert state["living_harness"]["steps"] == 2
