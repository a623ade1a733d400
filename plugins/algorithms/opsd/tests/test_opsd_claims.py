"""The claims of OPSD, HDPO, PW-OPSD, RP-OPSD and OPSA on the privileged toy world
(``rlmix.testing.privileged``): each method and its baseline run in the same test, on the same
world, with the same rollouts (asserted), through ``rlmix.loop.train_step``.

The toy: ``P`` prompts, completions of ``L`` tokens out of ``V``, reward 1 for the exact answer.
A view (a marker in the prompt text) adds a fixed logit shift to the shared table, so the
teacher is the student's own weights under a privileged prompt."""

from __future__ import annotations

import math

import pytest
import rlmix_opsd.hdpo as hdpo
import rlmix_opsd.opsa as opsa
import rlmix_opsd.plain as plain
import rlmix_opsd.pw as pw
import rlmix_opsd.rp as rp
import torch
from rlmix_opsd import base

from rlmix import loop
from rlmix.testing.privileged import PrivilegedToyPolicy, PrivilegedToyWorld, toy_world_run

ANSWER_MARKER = "A correct final answer is:"  # in base.DEFAULT_TEMPLATE
REFERENCE_MARKER = "A reference solution:"  # in rp.Settings.template


def _grpo():
    """The GRPO baseline, skipped where rlmix-grpo is not installed (nox -s isolated)."""
    return pytest.importorskip("rlmix_grpo")



def _one_hot(answers: torch.Tensor, vocab: int, value: float) -> torch.Tensor:
    out = torch.zeros(*answers.shape, vocab)
    return out.scatter_(-1, answers[..., None], value)


def _train(world, plugins, overrides, steps, optimizer="adamw", scorer=True):
    run = toy_world_run(world, plugins, overrides, scorer=scorer, optimizer=optimizer)
    for _ in range(steps):
        loop.train_step(run)
    return run


def _pass_at(p: torch.Tensor, k: int) -> torch.Tensor:
    return 1 - (1 - p) ** k


# ---------------------------------------------------------------- HDPO (and plain OPSD)

SOLVABLE, CLIFF = [0, 1, 2, 3], [4, 5, 6, 7]


def _cliff_world(seed: int = 0) -> PrivilegedToyWorld:
    """8 prompts, 3 tokens of 6. Prompts 0-3 are solvable (answer logit +1.5: a sampled
    answer 1 time in 10), 4-7 are cliffs (answer logit -4: 5e-8, never sampled). The answer
    view adds +6 to the answer's logit."""
    g = torch.Generator().manual_seed(1)
    answers = torch.randint(0, 6, (8, 3), generator=g)
    init = _one_hot(answers, 6, 1.5)
    init[CLIFF] = _one_hot(answers[CLIFF], 6, -4.0)
    policy = PrivilegedToyPolicy(8, 3, 6, init=init,
                                 views={ANSWER_MARKER: _one_hot(answers, 6, 6.0)}, seed=seed)
    return PrivilegedToyWorld(policy, answers)


def test_hdpo_lifts_cliff_prompts_that_grpo_cannot_touch_at_equal_rollouts():
    steps = 60
    world = _cliff_world()
    _train(world, {"grpo": _grpo(), "opsd.hdpo": hdpo}, ["opsd.hdpo.lam=1.0"], steps)
    hdpo_rows = world.generated_rows
    assert hdpo_rows > 32 * steps  # the privileged rollouts are counted in the budget

    baseline = _cliff_world()
    start = baseline.policy.logits.detach().clone()
    grpo_steps = math.ceil(hdpo_rows / 32)  # GRPO gets the same rollouts, as more steps
    _train(baseline, {"grpo": _grpo()}, [], grpo_steps)
    assert baseline.generated_rows >= hdpo_rows

    # GRPO: every cliff group's advantage is 0, so their logits never moved (bit for bit)
    assert torch.equal(baseline.policy.logits.detach()[CLIFF], start[CLIFF])
    grpo_pass8 = _pass_at(baseline.policy.answer_prob(baseline.answers, CLIFF), 8).mean()
    hdpo_pass8 = _pass_at(world.policy.answer_prob(world.answers, CLIFF), 8).mean()
    print(f"cliff pass@8: HDPO {hdpo_pass8:.3f}, GRPO {grpo_pass8:.2e}")
    assert grpo_pass8 < 1e-5
    assert hdpo_pass8 > 0.5
    greedy_h = world.policy.greedy_correct(world.answers, SOLVABLE).mean()
    greedy_g = baseline.policy.greedy_correct(baseline.answers, SOLVABLE).mean()
    print(f"solvable greedy accuracy: HDPO {greedy_h:.3f}, GRPO {greedy_g:.3f}")
    assert abs(float(greedy_h - greedy_g)) <= 0.02


def test_hdpo_with_lambda_zero_is_grpo_bit_for_bit():
    a, b = _cliff_world(), _cliff_world()
    _train(a, {"grpo": _grpo(), "opsd.hdpo": hdpo}, ["opsd.hdpo.lam=0"], 6)
    _train(b, {"grpo": _grpo()}, [], 6)
    assert a.generated_rows == b.generated_rows
    assert torch.equal(a.policy.logits, b.policy.logits)


def test_opsd_alone_lifts_cliff_prompts_without_any_reward():
    world = _cliff_world()
    world.subset = CLIFF
    _train(world, {"opsd": plain}, [], 40, scorer=False)
    baseline = _cliff_world()
    baseline.subset = CLIFF
    _train(baseline, {"grpo": _grpo()}, [], 40)
    assert world.generated_rows == baseline.generated_rows
    opsd_acc = float(world.policy.answer_prob(world.answers, CLIFF).mean())
    grpo_acc = float(baseline.policy.answer_prob(baseline.answers, CLIFF).mean())
    print(f"cliff sampled accuracy: OPSD {opsd_acc:.3f}, GRPO {grpo_acc:.2e}")
    assert opsd_acc > 0.5 > grpo_acc


# ---------------------------------------------------------------- PW-OPSD


def _late_reliable_world() -> PrivilegedToyWorld:
    """4 prompts, 4 tokens of 6. The student already knows the first two tokens (answer logit
    +2.5) and not the last two (uniform). The teacher's view is unreliable early (+1 on a
    wrong token at positions 0-1) and reliable late (+3 on the answer at positions 2-3)."""
    g = torch.Generator().manual_seed(2)
    answers = torch.randint(0, 6, (4, 4), generator=g)
    wrong = (answers + 1) % 6
    init = torch.zeros(4, 4, 6)
    init[:, :2] = _one_hot(answers[:, :2], 6, 2.5)
    shift = torch.zeros(4, 4, 6)
    shift[:, :2] = _one_hot(wrong[:, :2], 6, 1.0)
    shift[:, 2:] = _one_hot(answers[:, 2:], 6, 3.0)
    policy = PrivilegedToyPolicy(4, 4, 6, init=init, views={ANSWER_MARKER: shift})
    return PrivilegedToyWorld(policy, answers)


def test_pw_beats_uniform_opsd_when_the_teacher_is_reliable_late():
    # SGD (see toy_world_run): Adam would normalise a constant per-token weight away
    steps = 15
    overrides = ["train.lr=10"]
    world = _late_reliable_world()
    _train(world, {"opsd.pw": pw}, [*overrides, "opsd.pw.gamma=2.0"], steps, "sgd", False)
    baseline = _late_reliable_world()
    _train(baseline, {"opsd": plain}, overrides, steps, "sgd", False)
    assert world.generated_rows == baseline.generated_rows
    acc_pw = float(world.policy.answer_prob(world.answers).mean())
    acc_opsd = float(baseline.policy.answer_prob(baseline.answers).mean())
    print(f"sampled accuracy after {steps} steps: PW-OPSD {acc_pw:.3f}, OPSD {acc_opsd:.3f}")
    assert acc_pw > 0.3 > acc_opsd
    assert acc_pw > 2 * acc_opsd


def test_pw_with_gamma_zero_is_opsd_exactly():
    a, b = _late_reliable_world(), _late_reliable_world()
    _train(a, {"opsd.pw": pw}, ["opsd.pw.gamma=0"], 5, "sgd", False)
    _train(b, {"opsd": plain}, [], 5, "sgd", False)
    assert torch.equal(a.policy.logits, b.policy.logits)


# ---------------------------------------------------------------- RP-OPSD

PIVOTS = [1, 4]


def _pivot_world() -> PrivilegedToyWorld:
    """4 prompts, 6 tokens of 6. The student is already right on the surface tokens (answer
    logit +5) and lost on the two pivots (positions 1 and 4, uniform). The reference
    solution's view adds +4 on the answer at the pivots and only +0.1 elsewhere."""
    g = torch.Generator().manual_seed(3)
    answers = torch.randint(0, 6, (4, 6), generator=g)
    init = _one_hot(answers, 6, 5.0)
    init[:, PIVOTS] = 0.0
    shift = _one_hot(answers, 6, 0.1)
    shift[:, PIVOTS] = _one_hot(answers[:, PIVOTS], 6, 4.0)
    policy = PrivilegedToyPolicy(4, 6, 6, init=init, views={REFERENCE_MARKER: shift})
    info = {p: {"reference": " ".join(map(str, answers[p].tolist()))} for p in range(4)}
    return PrivilegedToyWorld(policy, answers, info=info)


def test_rp_puts_most_weight_on_pivots_and_reaches_the_target_sooner():
    world = _pivot_world()
    batch = world.rlmix_generate(toy_world_run(world, {}), _request(world, 8))
    ref = world.policy.table([int(p.id) for p in batch.prompts],
                             [base.privileged_messages(p, rp.Settings().template)
                              for p in batch.prompts]).detach()
    noref = world.policy.table([int(p.id) for p in batch.prompts],
                               [p.messages for p in batch.prompts]).detach()
    weights = rp.pivot_weights(ref, noref, batch.completion_mask[:, 1:])
    share = float(weights[:, PIVOTS].sum() / weights.sum())
    print(f"share of the loss weight on pivots: {share:.3f}")
    assert share >= 0.7

    target, limit = 0.8, 40
    overrides = ["train.lr=10"]  # SGD, as for PW

    def steps_to_target(plugins, extra):
        w = _pivot_world()
        run = toy_world_run(w, plugins, [*overrides, *extra], scorer=False, optimizer="sgd")
        for step in range(1, limit + 1):
            loop.train_step(run)
            if float(w.policy.answer_prob(w.answers).mean()) >= target:
                return step, w.generated_rows / step
        return limit + 1, w.generated_rows / limit

    rp_steps, rp_rows = steps_to_target({"opsd.rp": rp}, [])
    # the baseline distils from the same reference view, with uniform weights
    opsd_steps, opsd_rows = steps_to_target({"opsd": plain},
                                            [f"opsd.template={rp.Settings().template!r}"])
    assert rp_rows == opsd_rows  # the same rollouts per step
    print(f"steps to sampled accuracy {target}: RP-OPSD {rp_steps}, OPSD {opsd_steps}")
    assert rp_steps <= limit
    assert rp_steps < opsd_steps


def _request(world, n):
    from rlmix.types import GenerationRequest

    return GenerationRequest(prompts=[world.prompt(p) for p in range(world.policy.n_prompts)],
                             n=n)


# ---------------------------------------------------------------- OPSA

EASY, HARD = [0, 1, 2, 3, 4, 5], [6, 7]


def _safety_world(seed: int = 0) -> PrivilegedToyWorld:
    """8 prompts, 2 tokens of 6: six already mostly solved (answer logit +3.3: 70%), two hard
    (answer logit -1: 0.5%). Context A adds +4 on the answer of the easy prompts only (the
    higher overall teacher success), context B +4 on the hard ones only (the higher flip
    rate: most failed rollouts are on the hard prompts)."""
    g = torch.Generator().manual_seed(4)
    answers = torch.randint(0, 6, (8, 2), generator=g)
    init = _one_hot(answers, 6, 3.3)
    init[HARD] = _one_hot(answers[HARD], 6, -1.0)
    context_a = _one_hot(answers, 6, 4.0)
    context_a[HARD] = 0.0
    context_b = _one_hot(answers, 6, 4.0)
    context_b[EASY] = 0.0
    policy = PrivilegedToyPolicy(8, 2, 6, init=init, seed=seed,
                                 views={"Context A": context_a, "Context B": context_b})
    return PrivilegedToyWorld(policy, answers)


def test_opsa_picks_the_context_with_the_higher_flip_rate_and_lifts_failed_prompts_more():
    steps = 30
    contexts = "['\\n\\nContext A: think about safety.','\\n\\nContext B: think about harm.']"
    common = ["train.prompts_per_step=8", f"opsd.opsa.contexts={contexts}",
              "opsd.opsa.probe_n=8"]
    world = _safety_world()
    run = _train(world, {"opsd.opsa": opsa}, common, steps)
    state = run.state["opsd.opsa"]
    baseline = _safety_world()
    base_run = _train(baseline, {"opsd.opsa": opsa}, [*common, "opsd.opsa.select_by=success"],
                      steps)
    base_state = base_run.state["opsd.opsa"]
    assert world.generated_rows == baseline.generated_rows  # probes included, both sides
    assert state["rollouts"] == base_state["rollouts"] > 0
    print(f"flip rates A, B: {state['flip']}; teacher success A, B: {state['success']}")
    assert state["success"][0] > state["success"][1]  # A: higher overall success
    assert state["flip"][1] > state["flip"][0]  # B: higher flip rate
    assert state["choice"] == 1 and base_state["choice"] == 0
    hard = float(world.policy.answer_prob(world.answers, HARD).mean())
    hard_base = float(baseline.policy.answer_prob(baseline.answers, HARD).mean())
    print(f"hard prompts' sampled accuracy: OPSA (B) {hard:.3f}, by success (A) "
          f"{hard_base:.3f}")
    assert hard > 0.5 > hard_base
