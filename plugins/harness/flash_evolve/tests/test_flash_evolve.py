"""Tests of flash_evolve: the staleness policy on hand-made versions, the budget under
concurrency, shutdown, worker errors, resume accounting, the example manifest, and the paper's
claim in miniature (more proposals per second than synchronous GEPA on the same budget, with an
equal or better final selection score) on the hint world of ``rlmix.testing.harness``, with a
reflection LM that sleeps like a remote model."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import rlmix_flash_evolve as fe
import rlmix_gepa
import torch
from omegaconf import OmegaConf
from rlmix_flash_evolve import Budget, resolve_stale
from rlmix_lm.chat_server import ScriptedLM

import rlmix
from rlmix import checkpoint, cli, loop
from rlmix.testing import make_run, skip_unless_installed
from rlmix.testing.harness import HINTS, HintEnv, HintModel, hint_reflection

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "harness" / "flash_evolve-arith.yaml"


# ---------------------------------------------------------------- the staleness policy

P = {"system": "S", "instructions": "I0"}  # the parent
B_SAME = {"system": "S2", "instructions": "I0"}  # a newer best that left `instructions` alone
B_DIFF = {"system": "S", "instructions": "I1"}  # a newer best that changed `instructions`


def decide(policy, stamped, now, best=3, best_texts=B_SAME, parent=1):
    return resolve_stale(policy, stamped, now, parent, P, best, best_texts, "instructions",
                         "I9")


@pytest.mark.parametrize("policy", ["update", "discard", "patch"])
def test_a_fresh_proposal_is_evaluated_against_its_parent_under_every_policy(policy):
    d = decide(policy, stamped=4, now=4)
    assert d.action == "fresh" and d.base is None
    assert d.child == {"system": "S", "instructions": "I9"}


def test_update_rebases_a_stale_proposal_on_the_current_best():
    d = decide("update", stamped=2, now=4)
    assert d.action == "update" and d.base == 3
    assert d.child == {"system": "S", "instructions": "I9"}  # the proposal as made
    assert "v4" in d.why and "v2" in d.why
    # stale, but its parent is still the best: nothing to re-base on
    d = decide("update", stamped=2, now=4, best=1, best_texts=P)
    assert d.action == "update" and d.base is None


def test_discard_drops_a_stale_proposal():
    d = decide("discard", stamped=2, now=3)
    assert d.action == "discard" and d.child is None


def test_patch_applies_the_edit_onto_the_best_when_it_applies_cleanly():
    d = decide("patch", stamped=2, now=5, best_texts=B_SAME)
    assert d.action == "patch" and d.base == 3
    assert d.child == {"system": "S2", "instructions": "I9"}  # the best's system, the edit
    # the best changed the edited component: the edit does not apply; fall back to update
    d = decide("patch", stamped=2, now=5, best_texts=B_DIFF)
    assert d.action == "update" and d.base == 3
    assert d.child == {"system": "S", "instructions": "I9"}
    with pytest.raises(ValueError, match="staleness"):
        decide("rebase", 1, 2)


# ---------------------------------------------------------------- the budget


def test_budget_reservations_never_exceed_the_total_under_concurrency():
    budget = Budget(100, spent=10)
    assert budget.reserve(91) is None
    r = budget.reserve(20)
    r.charge(5)
    with pytest.raises(RuntimeError, match="exceed"):
        r.charge(16)
    r.close()
    assert (budget.spent, budget.reserved) == (15, 0)
    peaks, charged = [], []

    def hammer(k):
        for n in range(300):
            got = budget.reserve(1 + (n + k) % 7)
            if got is None:
                continue
            with budget.lock:
                peaks.append(budget.spent + budget.reserved)
            got.charge(min(got.left, 1 + n % 3))
            charged.append(got.charged)
            got.close()

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(peaks) <= 100 and budget.reserved == 0
    assert budget.spent == 15 + sum(charged) <= 100
    assert budget.spent == 100 or budget.reserve(1) is not None


# ---------------------------------------------------------------- the hint world, timed


class SlowLM:
    """The scripted reflection of the hint world, sleeping like a remote model."""

    def __init__(self, delay: float = 0.05, reply=hint_reflection) -> None:
        self.inner, self.delay = ScriptedLM(reply=reply), delay
        self.calls = 0
        self.lock = threading.Lock()

    def complete(self, prompt, max_new_tokens=256, temperature=0.0):
        time.sleep(self.delay)
        with self.lock:
            self.calls += 1
            return self.inner.complete(prompt)


class SlowHintModel(HintModel):
    """The hint world's rollout engine, ``delay`` seconds per rollout; checks that no two
    generation calls overlap (the generation lock)."""

    def __init__(self, env: HintEnv, delay: float = 0.0) -> None:
        super().__init__(env)
        self.delay, self.busy, self.overlaps = delay, False, 0

    @rlmix.hookimpl
    def rlmix_generate(self, run, request):
        if self.busy:
            self.overlaps += 1
        self.busy = True
        try:
            time.sleep(self.delay * len(request.prompts) * request.n)
            return HintModel.rlmix_generate(self, run, request)
        finally:
            self.busy = False


def hint_run(tmp_path, name, module, *overrides, delay=0.0):
    env = HintEnv()
    model = SlowHintModel(env, delay)
    run = make_run({"hintenv": env, "hintmodel": model, name: module},
                   [f"out={tmp_path}", "train.prompts_per_step=4", "harness.instructions=Answer.",
                    f"{name}.metric=hintenv.correct", f"{name}.search_size=8",
                    f"{name}.selection_size=8", f"{name}.minibatch_size=2", *overrides])
    loop.configure(run)
    return run, model


def flash_threads():
    return [t for t in threading.enumerate() if t.name.startswith("flash_evolve-")]


def mutations(state):
    return [h for h in state["history"] if h["kind"] == "mutation"]


def test_claim_more_proposals_per_second_than_synchronous_gepa_and_as_good(tmp_path):
    budget, lm_s, rollout_s = 160, 0.05, 0.002
    # synchronous GEPA: one proposal after another until nothing fits in the budget
    run, _ = hint_run(tmp_path / "gepa", "gepa", rlmix_gepa, f"gepa.budget={budget}",
                      delay=rollout_s)
    run.resources["gepa.lm"] = SlowLM(lm_s)
    t0 = time.perf_counter()
    while True:
        before = run.state.get("gepa", {}).get("iteration", -1)
        update = rlmix_gepa.iterate(run)
        if update is not None:
            loop.apply_harness_update(run, update)
        if run.state["gepa"]["iteration"] == before:
            break
    sync_s = time.perf_counter() - t0
    g = run.state["gepa"]
    sync_rate = len(mutations(g)) / sync_s
    sync_score = rlmix_gepa.mean(g["scores"][g["applied"]])
    # flash_evolve: the same budget in one call, two reflection workers
    run, model = hint_run(tmp_path / "flash", "flash_evolve", fe, f"flash_evolve.budget={budget}",
                          "flash_evolve.proposals_per_step=0", delay=rollout_s)
    run.resources["flash_evolve.lm"] = SlowLM(lm_s)
    t0 = time.perf_counter()
    update = fe.evolve(run)
    flash_s = time.perf_counter() - t0
    f = run.state["flash_evolve"]
    flash_rate = len(mutations(f)) / flash_s
    flash_score = rlmix_gepa.mean(f["scores"][f["applied"]])
    assert not flash_threads()  # the budget was spent: the pipeline shut itself down
    assert update is not None and run.harness["instructions"] == "Answer." and f["finished"]
    assert g["metric_calls"] <= budget and f["metric_calls"] <= budget
    assert model.overlaps == 0
    print(f"sync GEPA {sync_rate:.1f} proposals/s ({len(mutations(g))} in {sync_s:.2f} s, "
          f"score {sync_score}); flash_evolve {flash_rate:.1f}/s ({len(mutations(f))} in "
          f"{flash_s:.2f} s, score {flash_score}); stale {f['stale']}")
    assert flash_rate > 1.3 * sync_rate
    assert flash_score >= sync_score and flash_score == 1.0
    assert set(HINTS.values()) <= set(update.components["instructions"].split())


def test_budget_is_never_overspent_with_concurrent_stages(tmp_path):
    # a budget that ends mid-pipeline, four proposals in flight, three reflection workers
    run, model = hint_run(tmp_path, "flash_evolve", fe, "flash_evolve.budget=61",
                          "flash_evolve.reflect_workers=3", "flash_evolve.max_inflight=4",
                          "flash_evolve.proposals_per_step=0", "flash_evolve.merge=false",
                          delay=0.001)
    run.resources["flash_evolve.lm"] = SlowLM(0.02)
    fe.evolve(run)
    state = run.state["flash_evolve"]
    # every rollout the engine made is charged; nothing in flight is left unaccounted
    assert model.calls == state["metric_calls"] == fe.accounted_calls(state) <= 61
    assert state["finished"] and model.overlaps == 0
    # the pipeline stopped because no proposal's worst case (2 x 2 + 8) fit any more
    assert state["metric_calls"] + fe.worst_case(run.settings("flash_evolve"), 8) > 61
    assert not flash_threads()


@pytest.mark.parametrize("policy", ["update", "discard", "patch"])
def test_each_policy_reaches_the_best_and_records_stale_proposals(tmp_path, policy):
    run, model = hint_run(tmp_path, "flash_evolve", fe, "flash_evolve.budget=200",
                          f"flash_evolve.staleness={policy}", "flash_evolve.max_inflight=4",
                          "flash_evolve.proposals_per_step=0", "flash_evolve.merge=false",
                          "flash_evolve.components=[system,instructions]",
                          "harness.system=Be kind.", delay=0.001)
    run.resources["flash_evolve.lm"] = SlowLM(0.02)
    fe.evolve(run)
    state = run.state["flash_evolve"]
    stale = [h for h in mutations(state) if h.get("staleness", "fresh") != "fresh"]
    assert stale and {h["staleness"] for h in stale} <= {policy, "update"}
    assert state["stale"][policy] >= 1 and model.calls == state["metric_calls"] <= 200
    for h in stale:
        assert h["pool_version"] > h["version"]
        if policy == "discard":  # no calls spent on the child
            assert not h["accepted"] and "child_minibatch" not in h
        elif h.get("base") is not None:  # re-based: it had to beat the newer best too
            assert h["accepted"] == (h["child_minibatch"] > max(h["base_minibatch"],
                                     h["parent_minibatch"] if h["staleness"] == "update"
                                     else float("-inf")))
    if policy == "patch":
        patched = [h for h in stale if h["staleness"] == "patch"]
        assert patched
    best = state["applied"]
    assert rlmix_gepa.mean(state["scores"][best]) == 1.0


# ---------------------------------------------------------------- shutdown, errors, resume


def test_per_step_windows_and_clean_shutdown(tmp_path):
    run, model = hint_run(tmp_path, "flash_evolve", fe, "flash_evolve.budget=400", delay=0.001)
    run.resources["flash_evolve.lm"] = SlowLM(0.01)
    done = []
    for _ in range(3):
        fe.evolve(run)  # proposals_per_step: 1
        done.append(len(mutations(run.state["flash_evolve"])))
        calls = model.calls
        time.sleep(0.05)  # between steps no worker generates (the gate is closed)
        assert model.calls == calls
    assert done[0] >= 1 and done[1] > done[0] and done[2] > done[1]
    assert len(flash_threads()) == 1 + 2 + 1  # proposer, two reflectors, evaluator
    run.step = int(run.config.train.steps)  # the run's last step: step_end shuts down
    metrics: dict = {}
    fe.rlmix_step_end(run, metrics)
    assert not flash_threads() and "pipeline" not in run.plugin_resources("flash_evolve")
    assert metrics["flash_evolve/proposals"] == len(mutations(run.state["flash_evolve"]))
    assert metrics["flash_evolve/metric_calls"] == run.state["flash_evolve"]["metric_calls"]


def test_a_worker_error_reaches_the_loop_and_stops_every_worker(tmp_path):
    run, _ = hint_run(tmp_path, "flash_evolve", fe, "flash_evolve.budget=400")

    def broken(prompt):
        raise OSError("reflection server down")

    run.resources["flash_evolve.lm"] = ScriptedLM(reply=broken)
    with pytest.raises(fe.FlashEvolveError, match="reflection server down"):
        fe.evolve(run)
    fe.close(run)
    assert not flash_threads()


def test_resume_drops_work_in_flight_and_keeps_the_accounting(tmp_path):
    a, model_a = hint_run(tmp_path / "a", "flash_evolve", fe, "flash_evolve.budget=150",
                          "flash_evolve.max_inflight=4", delay=0.001)
    a.resources["flash_evolve.lm"] = SlowLM(0.03)  # parents run while the LM thinks
    fe.evolve(a, 2)
    time.sleep(0.05)
    saved = copy.deepcopy(a.state)  # what a checkpoint holds: a snapshot, work in flight
    fe.close(a)
    snap = saved["flash_evolve"]
    assert snap["metric_calls"] == model_a.calls  # nothing ran after the window closed
    in_flight = snap["metric_calls"] - fe.accounted_calls(snap)
    assert in_flight > 0  # parents already run for proposals not yet decided
    b, model_b = hint_run(tmp_path / "b", "flash_evolve", fe, "flash_evolve.budget=150",
                          "flash_evolve.proposals_per_step=0", delay=0.001)
    b.resources["flash_evolve.lm"] = SlowLM(0.01)
    b.state.update(saved)
    fe.evolve(b)
    state = b.state["flash_evolve"]
    assert state["dropped_calls"] == in_flight  # charged, never redone for free
    assert state["metric_calls"] == snap["metric_calls"] + model_b.calls <= 150
    assert state["metric_calls"] == fe.accounted_calls(state)
    assert state["history"][:len(snap["history"])] == snap["history"]
    assert rlmix_gepa.mean(state["scores"][state["applied"]]) == 1.0
    assert not flash_threads()


def test_settings_errors_name_their_keys(tmp_path):
    with pytest.raises(rlmix.ManifestError, match="flash_evolve.staleness"):
        make_run({"flash_evolve": fe}, ["flash_evolve.staleness=rebase"])
    with pytest.raises(rlmix.ManifestError, match="flash_evolve.budget"):
        make_run({"flash_evolve": fe}, ["flash_evolve.budget=4"])  # < selection_size
    with pytest.raises(rlmix.ManifestError, match="flash_evolve.minibatch_size"):
        make_run({"flash_evolve": fe}, ["flash_evolve.minibatch_size=50"])
    with pytest.raises(rlmix.ManifestError, match="flash_evolve.reflect_workers"):
        make_run({"flash_evolve": fe}, ["flash_evolve.reflect_workers=0"])
    env = HintEnv()
    run = make_run({"hintenv": env, "hintmodel": HintModel(env), "flash_evolve": fe},
                   [f"out={tmp_path}", "flash_evolve.components=[system]"])
    with pytest.raises(rlmix.ConfigError, match="flash_evolve.components.*no component"):
        loop.configure(run)


# ---------------------------------------------------------------- the example manifest


def test_example_manifest_runs_two_steps_on_tiny_random(tmp_path):
    skip_unless_installed(EXAMPLE)
    out = tmp_path / "run"
    code = cli.main(["run", str(EXAMPLE), "model=tiny-random", "arith.eval_size=4",
                     "arith.eval_max_new_tokens=6", "sampling.max_new_tokens=6",
                     "log.progress=false", "log.plot=false", "flash_evolve.max_new_tokens=6",
                     "flash_evolve.lm.max_new_tokens=12", "flash_evolve.search_size=6",
                     "flash_evolve.selection_size=4", "flash_evolve.minibatch_size=2",
                     "train.prompts_per_step=2", "train.steps=2", "train.eval_every=0",
                     "train.checkpoint_every=1", f"out={out}"])
    assert code == 0
    assert not flash_threads()  # the last step_end shut the pipeline down
    rows = [OmegaConf.to_container(OmegaConf.create(line))
            for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["policy_version"] == 0 for r in rows)
    assert rows[-1]["flash_evolve/proposals"] >= 2
    saved = torch.load(checkpoint.latest(out / "checkpoints") / "state.pt", weights_only=False)
    state = saved["flash_evolve"]
    assert state["metric_calls"] == rows[-1]["flash_evolve/metric_calls"]
    assert state["metric_calls"] >= fe.accounted_calls(state)


def test_run_end_stops_the_pipeline_mid_run(tmp_path):
    run, _ = hint_run(tmp_path, "flash_evolve", fe, "flash_evolve.budget=400", delay=0.001)
    run.resources["flash_evolve.lm"] = SlowLM(0.01)
    fe.evolve(run)  # a step's window: the pipeline is up, the run is far from its last step
    assert flash_threads()
    run.hook.rlmix_run_end(run=run)  # what rlmix.loop.train calls when it ends, or crashes
    assert not flash_threads() and "pipeline" not in run.plugin_resources("flash_evolve")
    assert run.state["flash_evolve"]["candidates"]
