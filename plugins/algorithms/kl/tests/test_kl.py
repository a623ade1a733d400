"""Tests of the KL plugin: the estimators against their formulas, the frozen reference, KL == 0
at the start and > 0 after a change of weights, the loss-side wrapper (value, gradient, metric,
composition with an owner), the reward-side term, edge cases, settings, and parity with verl's
``kl_penalty`` and TRL's GRPO KL term when they are installed."""

from __future__ import annotations

import types

import pytest
import rlmix_kl
import torch
from rlmix_kl import kl_estimate, sequence_penalty

import rlmix
from rlmix import ops
from rlmix.testing import make_batch, make_run
from rlmix.types import LossTerms, Minibatch, Normalizers


def _norm(mask):
    return Normalizers(tokens=float(mask.sum().clamp(min=1)), sequences=float(mask.shape[0]),
                       norm_constant=float(mask.shape[1]))


def _minibatch(batch):
    return Minibatch(batch=batch, normalizers=_norm(batch.completion_mask))


def _perturb(model, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


class Owner:
    """A stand-in rlmix_clip owner: loss -A * logp, with a metric of its own."""

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        adv = mb.batch.token_advantages().to(logp.device)
        return LossTerms(loss=-adv * logp, mask=mb.batch.completion_mask,
                         mode="seq-mean-token-mean", metrics={"owner": 1.0})


def _configured_run(overrides=(), owner=True):
    plugins = {"owner": Owner, "kl": rlmix_kl} if owner else {"kl": rlmix_kl}
    run = make_run(plugins, list(overrides), with_policy=True)
    rlmix_kl.rlmix_configure(run)
    return run


# ---------------------------------------------------------------- estimators


def test_estimators_match_their_formulas_hand_computed():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    # log_r = ref - logp = (-0.5, 1.0, 0.0)
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"),
                               torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"),
                               torch.tensor([0.125, 0.5, 0.0], dtype=torch.float64))
    e = torch.tensor([-0.5, 1.0], dtype=torch.float64)
    torch.testing.assert_close(kl_estimate(logp, ref, "k3")[:2], e.exp() - 1 - e)
    assert float(kl_estimate(logp, ref, "k3")[2]) == 0.0


def test_k1_and_k3_are_unbiased_and_k2_k3_nonnegative():
    g = torch.Generator().manual_seed(2)
    logp = torch.log_softmax(torch.randn(40, generator=g, dtype=torch.float64), 0)
    ref = torch.log_softmax(torch.randn(40, generator=g, dtype=torch.float64), 0)
    p = logp.exp()
    kl = float((p * (logp - ref)).sum())
    for est in ("k1", "k3"):
        assert float((p * kl_estimate(logp, ref, est)).sum()) == pytest.approx(kl, rel=1e-9)
    assert (kl_estimate(logp, ref, "k2") >= 0).all() and (kl_estimate(logp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="estimator"):
        kl_estimate(logp, ref, "k4")


def test_sequence_penalty_sums_masked_tokens_and_ignores_masked_garbage():
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.0, -50.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0], [0.0, -0.5, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # k1 = logp - ref: row 0: 0.5 + (-1.0); row 1: only -0.5 (the masked -50 is ignored)
    pen = sequence_penalty(logp, ref, mask, beta=0.2, estimator="k1")
    torch.testing.assert_close(pen, torch.tensor([-0.2 * -0.5, -0.2 * -0.5, 0.0]))


# ---------------------------------------------------------------- the reference


def test_reference_is_a_frozen_copy_made_once_and_not_checkpoint_state():
    run = _configured_run()
    ref = run.plugin_resources("kl")["reference"]
    assert ref is not run.policy.model and not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    for a, b in zip(ref.parameters(), run.policy.model.parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    _perturb(run.policy.model)
    rlmix_kl.rlmix_configure(run)  # configuring again keeps the initial copy
    assert run.plugin_resources("kl")["reference"] is ref
    assert not torch.equal(next(ref.parameters()), next(run.policy.model.parameters()))
    assert "kl" not in run.state and "kl.reference" not in run.state


def test_without_configure_it_fails_loudly():
    run = make_run({"owner": Owner, "kl": rlmix_kl})
    batch = make_batch(vocab=200)
    batch.advantages = torch.zeros(len(batch))
    logp = torch.zeros(batch.tokens.shape)
    with pytest.raises(RuntimeError, match="reference"):
        run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=logp)


# ---------------------------------------------------------------- loss placement


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_loss_wrapper_kl_is_zero_at_start_and_positive_after_a_weight_change(estimator):
    run = _configured_run([f"kl.estimator={estimator}", "kl.beta=0.1"])
    batch = make_batch(vocab=200)
    batch.advantages = batch.rewards - ops.group_mean(batch.rewards, batch.group)
    mask = batch.completion_mask
    logp, entropy = run.policy.logprobs(run, batch)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=entropy)
    assert abs(terms.metrics["kl"]) < 1e-7 and terms.metrics["owner"] == 1.0
    torch.testing.assert_close(terms.loss * mask, -batch.token_advantages() * logp * mask)

    _perturb(run.policy.model)
    logp, entropy = run.policy.logprobs(run, batch)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=entropy)
    with torch.no_grad():
        ref_logp, _ = run.policy.logprobs(run, batch, model=run.plugin_resources("kl")["reference"])
    kl = kl_estimate(logp.detach(), ref_logp, estimator) * mask
    assert float(kl.abs().sum()) > 1e-2
    if estimator != "k1":
        assert (kl >= 0).all() and terms.metrics["kl"] > 0
    torch.testing.assert_close(terms.loss.detach() * mask,
                               (-batch.token_advantages() * logp.detach() + 0.1 * kl) * mask)
    assert terms.metrics["kl"] == pytest.approx(float(kl.sum() / mask.sum()), rel=1e-5)
    # the gradient reaches the policy's weights, never the reference's
    ops.aggregate_loss(terms.loss, terms.mask, terms.mode, _norm(mask)).backward()
    assert all(p.grad is None for p in run.plugin_resources("kl")["reference"].parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0
               for p in run.policy.model.parameters())


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_loss_side_gradient_wrt_logp(estimator):
    run = _configured_run([f"kl.estimator={estimator}", "kl.beta=0.5"])
    batch = make_batch(vocab=200)
    batch.advantages = torch.zeros(len(batch))  # the owner contributes nothing: KL alone
    mask = batch.completion_mask
    with torch.no_grad():
        ref_logp, _ = run.policy.logprobs(run, batch, model=run.plugin_resources("kl")["reference"])
    g = torch.Generator().manual_seed(1)
    logp = (ref_logp + 0.5 * torch.randn(ref_logp.shape, generator=g) * mask).requires_grad_(True)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp,
                                entropy=torch.zeros_like(logp))
    (terms.loss * terms.mask).sum().backward()
    d = (logp - ref_logp).detach()
    expected = {"k1": torch.ones_like(d), "k2": d, "k3": 1 - torch.exp(-d)}[estimator]
    torch.testing.assert_close(logp.grad, 0.5 * expected * mask)
    # the KL pulls logp back toward the reference: descent lowers |logp - ref| for k2 and k3
    if estimator != "k1":
        assert ((logp.grad * d)[mask > 0] > 0).all()


def test_loss_wrapper_handles_single_token_and_fully_masked_rows():
    run = _configured_run(["kl.beta=1.0"])
    batch = make_batch(vocab=200)
    batch.completion_mask[0] = 0
    batch.completion_mask[1] = 0
    batch.completion_mask[1, 4] = 1
    batch.advantages = torch.zeros(len(batch))
    _perturb(run.policy.model)
    logp, entropy = run.policy.logprobs(run, batch)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=entropy)
    value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, _norm(batch.completion_mask))
    value.backward()
    assert torch.isfinite(terms.loss).all() and torch.isfinite(value)
    assert (terms.loss[0] == 0).all()
    assert float(terms.loss.detach()[1, 4]) > 0 and (terms.loss[1, :4] == 0).all()


def test_reward_placement_leaves_the_loss_alone():
    run = _configured_run(["kl.placement=reward", "kl.beta=1.0"])
    batch = make_batch(vocab=200)
    batch.advantages = torch.ones(len(batch))
    _perturb(run.policy.model)
    logp, entropy = run.policy.logprobs(run, batch)
    terms = run.hook.rlmix_clip(run=run, mb=_minibatch(batch), logp=logp, entropy=entropy)
    torch.testing.assert_close(terms.loss, -logp)
    assert "kl" not in terms.metrics


# ---------------------------------------------------------------- reward placement


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reward_term_is_zero_at_start_and_minus_beta_sum_kl_after(estimator):
    from rlmix import loop

    run = _configured_run(["kl.placement=reward", "kl.beta=0.2", f"kl.estimator={estimator}"],
                          owner=False)
    batch = make_batch(vocab=200)
    assert float(rlmix_kl.rlmix_score(run, batch)["penalty"].abs().max()) < 1e-6

    _perturb(run.policy.model)
    with torch.no_grad():
        logp, _ = run.policy.logprobs(run, batch)
        ref_logp, _ = run.policy.logprobs(run, batch, model=run.plugin_resources("kl")["reference"])
    mask = batch.completion_mask
    expected = -0.2 * (kl_estimate(logp, ref_logp, estimator) * mask).sum(-1)
    assert float(expected.abs().min()) > 0
    loop.score(run, batch)  # through the core: named kl.penalty, summed into the rewards
    torch.testing.assert_close(batch.reward_terms["kl.penalty"], expected)
    torch.testing.assert_close(batch.rewards, expected)
    if estimator != "k1":
        assert (expected < 0).all()


def test_reward_term_can_use_the_behaviour_logprobs():
    run = _configured_run(["kl.placement=reward", "kl.beta=0.5", "kl.estimator=k1",
                           "kl.policy_logp=behavior"], owner=False)
    batch = make_batch(vocab=200)
    with torch.no_grad():
        ref_logp, _ = run.policy.logprobs(run, batch, model=run.plugin_resources("kl")["reference"])
    expected = -0.5 * ((batch.behavior_logp - ref_logp) * batch.completion_mask).sum(-1)
    torch.testing.assert_close(rlmix_kl.rlmix_score(run, batch)["penalty"], expected)


def test_loss_placement_returns_no_reward_term():
    run = _configured_run(owner=False)
    assert rlmix_kl.rlmix_score(run, make_batch(vocab=200)) is None


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("override", ["kl.beta=-0.1", "kl.estimator=k4", "kl.placement=both",
                                      "kl.policy_logp=old", "kl.coef=0.1"])
def test_bad_settings_fail_before_any_model_loads(override):
    with pytest.raises(rlmix.ManifestError, match="kl"):
        make_run({"kl": rlmix_kl}, [override])


def test_settings_defaults():
    s = rlmix_kl.Settings()
    assert (s.beta, s.estimator, s.placement, s.policy_logp) == (0.001, "k3", "loss",
                                                                  "recompute")


# ---------------------------------------------------------------- parity


def _parity_logps(seed=0, spread=0.8):
    g = torch.Generator().manual_seed(seed)
    logp = -4 * torch.rand(6, 10, generator=g)
    ref = logp + spread * torch.randn(6, 10, generator=g)
    return logp, ref


@pytest.mark.parity
def test_parity_with_verl_kl_penalty():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    logp, ref = _parity_logps()
    ours_k3 = kl_estimate(logp, ref, "k3")
    assert float(ours_k3.max()) < 10  # inside verl's clamp of low_var_kl to [-10, 10]
    for ours_name, verl_names in (("k1", ("kl", "k1")), ("k2", ("mse", "k2")),
                                  ("k3", ("low_var_kl", "k3"))):
        for name in verl_names:
            torch.testing.assert_close(kl_estimate(logp, ref, ours_name),
                                       core_algos.kl_penalty(logp, ref, name),
                                       atol=1e-6, rtol=1e-5)
    # outside that range verl clamps k3 at 10 and rlmix does not (documented difference)
    far = torch.tensor([[0.0]]), torch.tensor([[3.0]])  # k3 = e^3 - 1 - 3 = 16.1
    assert float(core_algos.kl_penalty(*far, "low_var_kl")) == pytest.approx(10.0)
    assert float(kl_estimate(*far, "k3")) == pytest.approx(16.0855, abs=1e-3)


@pytest.mark.parity
def test_parity_with_verl_kl_in_reward():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    logp, ref = _parity_logps(seed=1, spread=0.5)
    mask = torch.ones_like(logp)
    mask[2, 5:] = 0
    scores = torch.zeros_like(logp)
    # verl's compute_rewards: token_level_scores - beta * (old_log_prob - ref_log_prob), i.e. a
    # k1 penalty per token; summed over a sequence it is rlmix's reward-side term
    theirs = core_algos.compute_rewards(scores, logp, ref, 0.3)
    torch.testing.assert_close(sequence_penalty(logp, ref, mask, 0.3, "k1"),
                               (theirs * mask).sum(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parity
def test_parity_with_trl_grpo_kl_term_in_the_loss():
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from rlmix.testing.peers import trl_grpo_trainer

    beta = 0.3
    logp, ref = _parity_logps(seed=2, spread=0.5)
    n, t = logp.shape
    mask = (torch.arange(t)[None] < torch.tensor([10, 3, 7, 1, 10, 5])[:, None]).float()
    trainer, _ = trl_grpo_trainer(None, "grpo", 4, num_generations=2,
                                  per_device_train_batch_size=2, use_bias_correction_kl=False)
    # built with beta 0 (a beta > 0 makes TRL load a reference from the model's hub id, which an
    # in-process model has not); the loss code reads self.beta and the reference log-probs we pass
    trainer.beta = beta
    theirs_logp = logp.clone().requires_grad_(True)

    def fixed_logps(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        return theirs_logp, torch.zeros_like(theirs_logp), None  # TRL's loss code on our inputs

    trainer._get_per_token_logps_and_entropies = types.MethodType(fixed_logps, trainer)
    inputs = {"prompt_ids": torch.zeros(n, 2, dtype=torch.long),
              "prompt_mask": torch.ones(n, 2, dtype=torch.long),
              "completion_ids": torch.zeros(n, t, dtype=torch.long),
              "completion_mask": mask.long(), "advantages": torch.zeros(n),
              "old_per_token_logps": logp.clone(), "ref_per_token_logps": ref}
    # advantages 0: beta * k3 alone. TRL 1.16 defaults to use_bias_correction_kl=True, which
    # multiplies k3 by the (differentiable) ratio: same value on-policy, another gradient; rlmix's
    # term is TRL's with that correction off
    theirs = trainer._compute_loss(trainer.model, inputs)
    theirs.backward()
    ours_logp = logp.clone().requires_grad_(True)
    ours = ops.aggregate_loss(beta * kl_estimate(ours_logp, ref, "k3"), mask,
                              "seq-mean-token-mean", _norm(mask))
    ours.backward()
    assert float(ours) > 0
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, atol=1e-5, rtol=1e-5)
