"""The OPSD family's math against hand-computed values, its hooks on the tiny-random model, and
its settings checks."""

from __future__ import annotations

import math

import pytest
import rlmix_opsd.opsa as opsa
import rlmix_opsd.plain as plain
import rlmix_opsd.pw as pw
import rlmix_opsd.rp as rp
import torch
from rlmix_opsd import base, hdpo

import rlmix
from rlmix import distill
from rlmix.testing import make_run
from rlmix.types import Minibatch, Normalizers, Prompt, RolloutBatch

# ---------------------------------------------------------------- forward KL and its clip


def test_forward_kl_hand_computed_and_its_gradient():
    teacher = torch.log(torch.tensor([[0.5, 0.5]]))
    student = torch.log(torch.tensor([[0.25, 0.75]])).requires_grad_(True)
    kl = base.forward_kl(teacher, student)
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert float(kl.detach()[0]) == pytest.approx(expected, rel=1e-6)
    kl.sum().backward()
    # d KL / d student logits = p_student - p_teacher
    torch.testing.assert_close(student.grad, torch.tensor([[-0.25, 0.25]]))
    assert float(base.forward_kl(teacher, teacher)[0]) == pytest.approx(0.0, abs=1e-7)


def test_forward_kl_on_the_teachers_top_k_renormalises_both():
    teacher = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    student = torch.log(torch.tensor([0.2, 0.2, 0.6]))
    # top 2 of the teacher: tokens 0 and 1; renormalised teacher (2/3, 1/3), student (1/2, 1/2)
    expected = (2 / 3) * math.log((2 / 3) / 0.5) + (1 / 3) * math.log((1 / 3) / 0.5)
    assert float(base.forward_kl(teacher, student, top_k=2)) == pytest.approx(expected, rel=1e-6)
    full = sum(t * math.log(t / s) for t, s in ((0.6, 0.2), (0.3, 0.2), (0.1, 0.6)))
    assert float(base.forward_kl(teacher, student, top_k=0)) == pytest.approx(full, rel=1e-6)
    assert float(base.forward_kl(teacher, student, top_k=3)) == pytest.approx(full, rel=1e-6)


def test_clip_token_loss_caps_the_value_and_rescales_the_gradient():
    loss = torch.tensor([0.5, 4.0], requires_grad=True)
    clipped = base.clip_token_loss(loss, 2.0)
    torch.testing.assert_close(clipped.detach(), torch.tensor([0.5, 2.0]))
    clipped.sum().backward()
    torch.testing.assert_close(loss.grad, torch.tensor([1.0, 0.5]))
    assert base.clip_token_loss(loss, 0.0) is loss


def test_to_columns_left_pads_with_zeros():
    out = base.to_columns(torch.tensor([[1.0, 2.0]]), 4)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 1.0, 2.0]]))


# ---------------------------------------------------------------- weights


def test_position_weights_hand_computed():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    w = base.position_weights(mask, 1.0)
    # row 0: (1/4, 2/4, 3/4, 1) sum 2.5 -> x 4 / 2.5; row 1: (1/2, 1) sum 1.5 -> x 2 / 1.5
    torch.testing.assert_close(w, torch.tensor([[0.4, 0.8, 1.2, 1.6], [2 / 3, 4 / 3, 0, 0]]))
    w2 = base.position_weights(mask[:1], 2.0)
    raw = torch.tensor([1 / 16, 4 / 16, 9 / 16, 1.0])
    torch.testing.assert_close(w2[0], raw * 4 / raw.sum())
    assert torch.equal(base.position_weights(mask, 0.0), mask)  # exactly 1 on every token


def test_mean_one_normalises_per_row_and_falls_back_to_uniform():
    scores = torch.tensor([[3.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(base.mean_one(scores, mask),
                               torch.tensor([[2.25, 0.75, 0.0], [1.0, 1.0, 0.0]]))


def test_pivot_weights_follow_the_views_divergence():
    # token 0: the views agree (score 0); token 1: they differ by KL k -> all the weight
    same = torch.log(torch.tensor([0.5, 0.5]))
    ref = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1]]]))
    noref = torch.stack([same, same])[None]
    w = rp.pivot_weights(ref, noref, torch.ones(1, 2))
    torch.testing.assert_close(w, torch.tensor([[0.0, 2.0]]))
    k = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert float(base.forward_kl(ref, noref)[0, 1]) == pytest.approx(k, rel=1e-6)
    nll = rp.anchor_nll(ref, noref)  # the reference view picks token 0 at both positions
    torch.testing.assert_close(nll, torch.full((1, 2), math.log(2.0)))


def test_flip_rate_and_success_hand_computed():
    teacher_success = torch.tensor([1.0, 0.0, 0.5])  # per prompt
    failed = torch.tensor([1, 1, 2])  # two failed rollouts on prompt 1, one on prompt 2
    flip, success = opsa.flip_and_success(failed, teacher_success)
    assert flip == pytest.approx((0 + 0 + 0.5) / 3)
    assert success == pytest.approx(0.5)
    assert opsa.flip_and_success(torch.tensor([], dtype=torch.long), teacher_success)[0] == 0


def test_cliff_groups_are_those_where_every_rollout_failed():
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert hdpo.cliff_groups(rewards, group, 1.0) == [0, 2, 3]
    assert hdpo.cliff_groups(rewards, group, 0.5) == [0, 2]


# ---------------------------------------------------------------- privileged prompts


def test_privileged_messages_append_to_the_last_user_message_only():
    prompt = Prompt(messages=[{"role": "system", "content": "s"},
                              {"role": "user", "content": "2+2?"}], answer=4,
                    info={"reference": "two and two"})
    out = base.privileged_messages(prompt, " Answer: {answer}; see {reference}.")
    assert out[-1]["content"] == "2+2? Answer: 4; see two and two."
    assert out[0] == {"role": "system", "content": "s"}
    assert prompt.messages[-1]["content"] == "2+2?"  # unchanged
    no_reference = Prompt(messages=[{"role": "user", "content": "q"}], answer=5)
    assert base.render("{reference}", no_reference) == "5"  # falls back to the answer
    with pytest.raises(ValueError, match="hint"):
        base.privileged_messages(prompt, "{hint}")
    bare = Prompt(messages=[{"role": "system", "content": "s"}], answer=1)
    assert base.privileged_messages(bare, "\n\nA: {answer}")[-1] == {"role": "user",
                                                                     "content": "A: 1"}


# ---------------------------------------------------------------- hooks on tiny-random


def _model_batch(run, texts: list[str], completion: list[int]) -> RolloutBatch:
    tok = run.policy.tokenizer
    prompts = [Prompt(messages=[{"role": "user", "content": t}], answer=7, id=str(i))
               for i, t in enumerate(texts)]
    ids = [tok(run.policy.chat_text(p.messages), add_special_tokens=False)["input_ids"]
           for p in prompts]
    width = max(len(i) for i in ids)
    tokens = torch.tensor([[0] * (width - len(i)) + i + completion for i in ids])
    attn = torch.tensor([[0] * (width - len(i)) + [1] * (len(i) + len(completion))
                         for i in ids])
    cmask = torch.zeros(tokens.shape)
    cmask[:, width:] = 1.0
    n = len(texts)
    return RolloutBatch(group=torch.arange(n), tokens=tokens, attention_mask=attn,
                        completion_mask=cmask, behavior_logp=torch.zeros(tokens.shape),
                        policy_version=torch.zeros(n, dtype=torch.long), prompts=prompts)


def _mb(batch):
    return Minibatch(batch=batch, normalizers=Normalizers(
        tokens=float(batch.completion_mask.sum()), sequences=float(len(batch)),
        norm_constant=4.0))


def _clip(run, batch):
    logp, entropy = run.policy.logprobs(run, batch)
    return run.hook.rlmix_clip(run=run, mb=_mb(batch), logp=logp, entropy=entropy)


def test_opsd_hook_on_the_tiny_model_matches_the_pure_functions():
    run = make_run({"opsd": plain}, with_policy=True)
    batch = _model_batch(run, ["What is 3+4?", "Hi"], [55, 56, 57])
    terms = _clip(run, batch)
    assert terms.mode == "token-mean" and "opsd/kl" in terms.metrics
    teacher = distill.teacher_logits(run, batch, [base.privileged_messages(
        p, base.DEFAULT_TEMPLATE) for p in batch.prompts])
    student = distill.completion_logits(run, batch).detach()
    expected = base.to_columns(base.clip_token_loss(base.forward_kl(teacher, student), 10.0),
                               batch.tokens.shape[1]) * batch.completion_mask
    torch.testing.assert_close(terms.loss.detach(), expected, atol=1e-5, rtol=1e-5)
    assert float((terms.loss.detach() * terms.mask).sum()) > 0
    (terms.loss * terms.mask).sum().backward()
    assert run.policy.model.get_input_embeddings().weight.grad.abs().sum() > 0
    # an empty template makes the teacher the student: the loss vanishes
    run = make_run({"opsd": plain}, ["opsd.template=''"], with_policy=True)
    assert float(_clip(run, batch).loss.abs().max()) < 1e-4


def test_pw_with_gamma_zero_gives_the_opsd_loss_on_the_tiny_model():
    run = make_run({"opsd.pw": pw}, ["opsd.pw.gamma=0"], with_policy=True)
    batch = _model_batch(run, ["What is 3+4?", "Hi"], [55, 56, 57])
    same = _clip(run, batch).loss.detach()
    opsd_run = make_run({"opsd": plain}, with_policy=True)
    torch.testing.assert_close(same, _clip(opsd_run, batch).loss.detach())
    run = make_run({"opsd.pw": pw}, ["opsd.pw.gamma=1"], with_policy=True)
    weighted = _clip(run, batch).loss.detach()
    weights = base.position_weights(batch.completion_mask, 1.0)
    torch.testing.assert_close(weighted, same * weights, atol=1e-6, rtol=1e-5)


def test_rp_hook_on_the_tiny_model_runs_and_backpropagates():
    run = make_run({"opsd.rp": rp}, ["opsd.rp.template='\n\nA reference solution: seven'"],
                   with_policy=True)
    batch = _model_batch(run, ["What is 3+4?"], [55, 56, 57])
    terms = _clip(run, batch)
    assert float((terms.loss.detach() * terms.mask).sum()) > 0
    (terms.loss * terms.mask).sum().backward()


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("plugin, override", [
    ("opsd", "opsd.top_k=-1"), ("opsd", "opsd.kl_clip=-1"), ("opsd", "opsd.loss_mode=sum"),
    ("opsd.pw", "opsd.pw.gamma=-1"), ("opsd.rp", "opsd.rp.anchor=-0.1"),
    ("opsd.opsa", "opsd.opsa.select_by=best"), ("opsd.opsa", "opsd.opsa.contexts=[]"),
    ("opsd.opsa", "opsd.opsa.probe_n=0"), ("opsd.hdpo", "opsd.hdpo.lam=-1"),
])
def test_bad_settings_fail_before_any_model_loads(plugin, override):
    module = {"opsd": plain, "opsd.pw": pw, "opsd.rp": rp, "opsd.opsa": opsa,
              "opsd.hdpo": hdpo}[plugin]
    with pytest.raises(rlmix.ManifestError, match=plugin.replace(".", r"\.")):
        make_run({plugin: module}, [override])
