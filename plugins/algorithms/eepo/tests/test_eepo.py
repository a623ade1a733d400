"""Tests of EEPO: the group split, the unlearning loss and step by hand, the exact restore (on
the toy policy and on the tiny random model through the hf engine), settings checks, and the
claim: at the same number of rollouts, more distinct responses per group than GRPO's sampler,
with the weights bit-identical afterwards."""

from __future__ import annotations

import math

import pytest
import rlmix_eepo
import torch
from rlmix_eepo import restored, split_group, unlearning_loss, unlearning_step

import rlmix
from rlmix.testing import ToyPolicy, make_run
from rlmix.testing.allocation import ToyPolicyEnv as ToyEnv
from rlmix.types import Prompt


class ToyAdapter:
    """What EEPO needs of ``run.policy``: ``model`` (its parameters) and ``logprobs``."""

    tokenizer = None

    def __init__(self, toy):
        self.model = toy

    def logprobs(self, run, batch):
        return self.model.logprobs(batch)


def _peaked(seed=0):
    pol = ToyPolicy(vocab=6, length=4, seed=seed)
    with torch.no_grad():
        pol.logits[:, 0] = 3.0  # one dominant response: p(token 0) = 0.8 at every position
    return pol


def _run(env, eepo=True, overrides=()):
    plugins = {"env": env, "eepo": rlmix_eepo} if eepo else {"env": env}
    run = make_run(plugins, ["train.prompts_per_step=4", "train.group_size=8", *overrides])
    run.policy = ToyAdapter(env.policy)
    return run


def test_split_group():
    assert split_group(8, 0.5) == (4, 4)
    assert split_group(5, 0.5) == (2, 3)
    assert split_group(2, 0.9) == (1, 1)
    assert split_group(4, 0.1) == (1, 3)


def test_unlearning_loss_and_confidence_by_hand():
    logp = torch.tensor([[0.0, -1.0, -3.0], [0.0, -2.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    loss, conf = unlearning_loss(logp, mask)
    assert float(loss) == pytest.approx(((-1 - 3) / 2 + -2) / 2)
    assert conf == pytest.approx(math.exp(-6 / 3))


def test_unlearning_step_is_sgd_on_the_loss_and_lowers_the_sampled_responses():
    pol = _peaked()
    batch = ToyEnv(pol, None).rlmix_generate(make_run(), rlmix.GenerationRequest(
        prompts=[Prompt(messages=[])], n=16))
    logp, _ = pol.logprobs(batch)
    loss, _ = unlearning_loss(logp, batch.completion_mask)
    (grad,) = torch.autograd.grad(loss, [pol.logits])
    before = pol.logits.detach().clone()
    norm = unlearning_step([pol.logits], unlearning_loss(pol.logprobs(batch)[0],
                                                         batch.completion_mask)[0], 0.5)
    torch.testing.assert_close(pol.logits.detach(), before - 0.5 * grad)
    assert norm == pytest.approx(float(grad.norm()))
    after, _ = unlearning_loss(pol.logprobs(batch)[0], batch.completion_mask)
    assert float(after.detach()) < float(loss.detach())  # the sampled responses became less likely
    pol2 = _peaked()
    unlearning_step([pol2.logits], unlearning_loss(pol2.logprobs(batch)[0],
                                                   batch.completion_mask)[0], 0.5, 1e-3)
    assert float((pol2.logits.detach() - before).norm()) == pytest.approx(0.5 * 1e-3, rel=1e-4)


def test_restored_undoes_values_and_gradients_bit_for_bit():
    pol = _peaked()
    pol.logits.grad = torch.full_like(pol.logits, 0.25)
    grad_ref = pol.logits.grad
    before = pol.logits.detach().clone()
    with restored([pol.logits]):
        with torch.no_grad():
            pol.logits.mul_(1.0001).add_(1e-7)
        pol.logits.grad = None
        assert not torch.equal(pol.logits.detach(), before)
    assert torch.equal(pol.logits.detach(), before) and pol.logits.grad is grad_ref


def test_sampler_budget_stages_and_exact_restore_on_the_toy():
    env = ToyEnv(_peaked(), None)
    run = _run(env, overrides=["eepo.unlearn_lr=5.0"])
    before = env.policy.logits.detach().clone()
    batch = run.sample(run.hook.rlmix_prompts(run=run, step=0))
    assert torch.equal(env.policy.logits.detach(), before)  # bit-identical
    assert len(batch) == 32 == env.generated == run.state["eepo"]["rollouts"]
    assert torch.bincount(batch.group).tolist() == [8, 8, 8, 8]
    # the second half was sampled from the unlearned policy: its tokens are less likely
    # under the restored weights than the first half's, on average
    logp = batch.behavior_logp.sum(-1)
    stats = run.pending_metrics
    assert stats["eepo/unlearn_lr"] == pytest.approx(5.0 * stats["eepo/confidence"])
    first = torch.cat([logp[batch.group == g][:4] for g in range(4)])
    second = torch.cat([logp[batch.group == g][4:] for g in range(4)])
    own_first = env.policy.logprobs(batch)[0].sum(-1).detach()
    assert second.mean() != first.mean() and own_first.shape == logp.shape


def test_exact_restore_on_the_tiny_model_through_the_hf_engine():
    rlmix_arith = pytest.importorskip("rlmix_arith")
    rlmix_hf = pytest.importorskip("rlmix_hf")
    run = make_run({"hf": rlmix_hf, "arith": rlmix_arith, "eepo": rlmix_eepo},
                   ["train.prompts_per_step=2", "train.group_size=4",
                    "sampling.max_new_tokens=6", "eepo.unlearn_lr=10.0",
                    "eepo.max_grad_norm=0", "arith.eval_size=0"], with_policy=True)
    model = run.policy.model
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # as the core's loop samples
        batch = run.sample(run.hook.rlmix_prompts(run=run, step=0))
    assert len(batch) == 8 and run.state["eepo"]["rollouts"] == 8
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert run.pending_metrics["eepo/grad_norm"] > 0


@pytest.mark.parametrize("override", ["eepo.first_fraction=1.0", "eepo.unlearn_lr=-1",
                                      "eepo.max_grad_norm=-1"])
def test_bad_settings_are_rejected_naming_the_setting(override):
    with pytest.raises(rlmix.ConfigError, match=override.split(".")[1].split("=")[0]):
        _run(ToyEnv(_peaked(), None), overrides=[override])


def _distinct(batch):
    return [len({batch.texts[i] for i in (batch.group == g).nonzero().flatten().tolist()})
            for g in range(batch.num_groups)]


def test_claim_more_distinct_responses_per_group_at_equal_budget_weights_unchanged():
    results = {}
    for name, eepo in (("grpo", False), ("eepo", True)):
        env = ToyEnv(_peaked(), None, seed=4)
        # the toy's unlearning gradient is ~0.1 in norm: a visible step needs a large SGD size
        run = _run(env, eepo=eepo, overrides=["eepo.unlearn_lr=300", "eepo.max_grad_norm=0"]
                   if eepo else [])
        before = env.policy.logits.detach().clone()
        distinct = []
        for step in range(40):
            run.step = step
            with torch.no_grad():
                distinct += _distinct(run.sample(run.hook.rlmix_prompts(run=run, step=step)))
        assert torch.equal(env.policy.logits.detach(), before)
        results[name] = (env.generated, sum(distinct) / len(distinct))
    assert results["grpo"][0] == results["eepo"][0] == 40 * 32  # equal rollout budget
    assert results["eepo"][1] > results["grpo"][1] + 0.5
