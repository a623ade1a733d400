"""Tests of CASCADE: the LinUCB arithmetic by hand, features, case refinement and the capped
memory, the per-prompt wrapper, and the claim on a stream where for one task family the most
similar case misleads (LinUCB against nearest-case retrieval, same stream, same rollouts)."""

from __future__ import annotations

import copy
import math

import pytest
import rlmix_cascade as ca
import torch

import rlmix
from rlmix import loop
from rlmix.testing import example_resumes, make_run
from rlmix.testing.memory_worlds import CaseEnv, CaseModel, Family

EXAMPLE = ca.__file__.rsplit("/plugins/", 1)[0] + "/examples/harness/cascade-arith.yaml"

# ---------------------------------------------------------------- LinUCB by hand


def test_ucb_and_update_by_hand():
    arm = ca.new_arm(2, ridge=1.0)
    mean0, bonus0 = ca.ucb(arm, [1.0, 1.0], alpha=0.5)
    assert mean0 == 0.0 and bonus0 == pytest.approx(0.5 * math.sqrt(2.0))
    ca.update_arm(arm, [1.0, 0.0], reward=1.0)
    # A = [[2, 0], [0, 1]], b = [1, 0]: theta = [0.5, 0]
    assert torch.equal(arm["A"], torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64))
    m, b = ca.ucb(arm, [1.0, 1.0], alpha=2.0)
    assert m == pytest.approx(0.5)
    assert b == pytest.approx(2.0 * math.sqrt(0.5 + 1.0))  # x^T A^-1 x = 1/2 + 1
    ca.update_arm(arm, [1.0, 0.0], reward=0.0)
    m, _ = ca.ucb(arm, [1.0, 0.0], alpha=0.0)
    assert m == pytest.approx(1.0 / 3.0)  # ridge mean of rewards 1, 0 with prior weight 1


def test_features_and_success_rate():
    s = ca.Settings(hash_dims=4, age_scale=10.0)
    case = {"task": "sun field", "wins": 3, "shown": 4, "refined": 5}
    assert ca.success_rate(case) == pytest.approx(4 / 6)
    x = ca.pair_features("sun field barn", case, step=15, s=s)
    assert x[:4] == pytest.approx([1.0, 2 / 3, 4 / 6, math.exp(-1.0)])
    assert len(x) == 8 and sum(v * v for v in x[4:]) == pytest.approx(1.0)
    assert ca.hashed_words("", 4) == [0.0] * 4


def test_choose_nearest_and_the_bonus():
    s = ca.Settings(hash_dims=0, candidates=2, alpha=1.0)
    cases = [{"id": 0, "task": "a b c", "wins": 0, "shown": 0, "refined": 0},
             {"id": 1, "task": "a x y", "wins": 0, "shown": 0, "refined": 0},
             {"id": 2, "task": "q r s", "wins": 0, "shown": 0, "refined": 0}]
    arms = {c["id"]: ca.new_arm(4, 1.0) for c in cases}
    near = ca.Settings(hash_dims=0, candidates=2, select="nearest")
    case, cands, _ = ca.choose("a b", cases, arms, 0, near)
    assert case["id"] == 0 and [c["id"] for c in cands] == [0, 1]
    # untried arms: the bonus alone, larger for the more similar case
    case, _, x = ca.choose("a b", cases, arms, 0, s)
    assert case["id"] == 0
    # case 0 failed twice on this task: the less similar one is tried
    for _ in range(2):
        ca.update_arm(arms[0], x, 0.0)
    case, _, _ = ca.choose("a b", cases, arms, 0, s)
    assert case["id"] == 1


def test_refine_add_and_evict():
    s = ca.Settings(hash_dims=0, dedup=0.5, max_cases=2)
    state = {"cases": [], "arms": {}, "next_id": 0}
    assert ca.add_case(state, "sun field barn", "USE plough", 1.0, 0, s) == "added"
    assert ca.add_case(state, "sun field barn grain", "USE plough", 0.5, 3, s) == "refined"
    c = state["cases"][0]
    assert c["count"] == 2 and c["outcome"] == pytest.approx(0.75) and c["refined"] == 3
    assert ca.add_case(state, "sun field barn", "USE other", 1.0, 4, s) == "added"
    assert ca.add_case(state, "ship sail", "USE anchor", 1.0, 5, s) == "added"
    state["cases"][0]["shown"], state["cases"][0]["wins"] = 4, 4  # the proven case stays
    state["cases"][1]["shown"], state["cases"][1]["wins"] = 2, 0
    gone = ca.evict(state["cases"], state["arms"], 2)
    assert [g["id"] for g in gone] == [1]
    assert [c["id"] for c in state["cases"]] == [0, 2] and set(state["arms"]) == {0, 2}


# ---------------------------------------------------------------- the stream

FAMILIES = {"f0": Family("sun field grain barn", "plough"),
            "f1": Family("ship sail harbour rope", "anchor"),
            "f2": Family("river bridge tower stone gate", "mortar"),
            # f3's hard tasks read like f2's: the most similar case is f2's, and it misleads
            "f3": Family("moss cloud wall river", "lichen",
                         hard_words="river bridge tower stone")}


def stream(tmp_path, *overrides):
    env, model = CaseEnv(dict(FAMILIES)), CaseModel()
    run = make_run({"caseenv": env, "casemodel": model, "cascade": ca},
                   [f"out={tmp_path}", "train.prompts_per_step=4", "train.group_size=1",
                    "train.mode=harness-only", *overrides], with_policy=True)
    loop.configure(run)
    return run, env, model


def play(run, steps):
    """Steps through the core loop; per task: (family, easy, correct, regret) where regret is
    the best candidate's reward (asked of the world's model) minus the shown case's."""
    tasks = []
    while run.step < steps:
        prompts = run.hook.rlmix_prompts(run=run, step=run.step)
        metrics = loop.train_step(run)
        ca.rlmix_step_end(run, metrics)
        for p in prompts:
            meta = p.info["cascade"]
            got = float(CaseModel.answer(p) == f"USE {p.answer}")
            best = max([float(c["solution"] == f"USE {p.answer}") for c in meta["candidates"]]
                       + [got])
            tasks.append((p.info["family"], p.info["easy"], got, best - got))
    return tasks


def slope(cumulative, lo, hi):
    return (cumulative[hi - 1] - cumulative[lo]) / max(1, hi - 1 - lo)


def test_claim_bandit_beats_nearest_case_where_the_nearest_misleads(tmp_path):
    steps = 24  # 96 tasks, 72 of them hard
    bandit, _, model_b = stream(tmp_path / "b")
    near, _, model_n = stream(tmp_path / "n", "cascade.select=nearest")
    tasks_b, tasks_n = play(bandit, steps), play(near, steps)
    assert model_b.calls == model_n.calls == 4 * steps  # same stream, same rollouts
    for tasks in (tasks_b, tasks_n):
        assert [t[:2] for t in tasks] == [t[:2] for t in tasks_b]
    hard_b = [t for t in tasks_b if not t[1]]
    hard_n = [t for t in tasks_n if not t[1]]
    # regret against the best case among the candidates, over the hard tasks
    cum_b, cum_n, total_b, total_n = [], [], 0.0, 0.0
    for tb, tn in zip(hard_b, hard_n):
        total_b, total_n = total_b + tb[3], total_n + tn[3]
        cum_b.append(total_b)
        cum_n.append(total_n)
    third = len(cum_b) // 3
    first_b, last_b = slope(cum_b, 0, third), slope(cum_b, 2 * third, len(cum_b))
    first_n, last_n = slope(cum_n, 0, third), slope(cum_n, 2 * third, len(cum_n))
    assert last_b < 0.5 * first_b, (first_b, last_b)  # sublinear: it flattens
    assert last_n >= first_n - 1e-9 and last_n >= 0.2, (first_n, last_n)  # linear for nearest
    # accuracy overtakes nearest-case retrieval within ~20 tasks (six steps) and stays above it
    acc_b = sum(t[2] for t in tasks_b[24:]) / len(tasks_b[24:])
    acc_n = sum(t[2] for t in tasks_n[24:]) / len(tasks_n[24:])
    assert acc_b >= 0.95 and acc_n < 0.85, (acc_b, acc_n)
    f3_b = [t[2] for t in tasks_b[24:] if t[0] == "f3" and not t[1]]
    f3_n = [t[2] for t in tasks_n[24:] if t[0] == "f3" and not t[1]]
    assert sum(f3_b) / len(f3_b) >= 0.9 and sum(f3_n) == 0.0
    state = bandit.state["cascade"]
    assert len(state["cases"]) <= bandit.settings("cascade").max_cases
    print(f"cascade claim: accuracy after 24 tasks linucb {acc_b:.3f} vs nearest {acc_n:.3f}; "
          f"regret slope first/last third linucb {first_b:.3f}/{last_b:.3f}, "
          f"nearest {first_n:.3f}/{last_n:.3f}")


def test_memory_is_capped(tmp_path):
    run, _, _ = stream(tmp_path, "cascade.max_cases=3", "cascade.dedup=1.0")
    play(run, 8)
    state = run.state["cascade"]
    assert len(state["cases"]) == 3 and state["evicted"] > 0
    assert set(state["arms"]) == {c["id"] for c in state["cases"]}


def test_state_resumes_exactly(tmp_path):
    a, _, _ = stream(tmp_path / "a")
    play(a, 4)
    saved = copy.deepcopy(a.state)
    play(a, 8)
    b, _, _ = stream(tmp_path / "b")
    b.state.clear()
    b.state.update(saved)
    b.step = 4
    play(b, 8)
    sa, sb = a.state["cascade"], b.state["cascade"]
    assert sa["cases"] == sb["cases"] and sa["log"] == sb["log"]
    assert all(torch.equal(sa["arms"][k]["A"], sb["arms"][k]["A"]) for k in sa["arms"])


@pytest.mark.parametrize(("override", "key"), [
    ("cascade.select=random", "cascade.select"), ("cascade.alpha=-1", "cascade.alpha"),
    ("cascade.ridge=0", "cascade.ridge"), ("cascade.max_cases=0", "cascade.max_cases"),
    ("cascade.dedup=0", "cascade.dedup")])
def test_settings_errors_name_the_key(override, key):
    with pytest.raises(rlmix.ManifestError, match=key.replace(".", r"\.")):
        make_run({"cascade": ca}, [override])


def test_example_manifest_runs_and_resumes(tmp_path):
    rows, state = example_resumes(EXAMPLE, tmp_path / "ex", "cascade", eval_size=4)
    assert "cascade/cases" in rows[-1]
    assert state["cascade"]["steps"] == 2
