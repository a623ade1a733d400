"""rlmix.ops against hand-computed values, and the claim of DESIGN §4: splitting an optimizer
step's data into minibatches leaves the gradient unchanged, through the real training path."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import rlmix_grpo
import torch

from rlmix import ops
from rlmix.testing import make_run
from rlmix.types import LOSS_MODES, Normalizers, RolloutBatch

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])


def test_masked_sum() -> None:
    assert ops.masked_sum(VALUES, MASK).item() == 14.0  # 1 + 2 + 5 + 6
    assert ops.masked_sum(VALUES, MASK, dim=-1).tolist() == [3.0, 11.0]
    assert ops.masked_sum(VALUES, MASK, dim=0).tolist() == [1.0, 7.0, 6.0]


def test_masked_mean() -> None:
    assert ops.masked_mean(VALUES, MASK).item() == pytest.approx(3.5)
    assert ops.masked_mean(VALUES, MASK, dim=-1).tolist() == pytest.approx([1.5, 5.5])
    # an empty mask gives 0, not NaN
    empty = ops.masked_mean(VALUES, torch.zeros_like(MASK))
    assert empty.item() == 0.0
    rows = ops.masked_mean(VALUES, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), dim=-1)
    assert rows.tolist() == [0.0, 4.0]


def test_masked_var() -> None:
    # masked values 1, 2, 5, 6: mean 3.5, squared deviations 6.25 + 2.25 + 2.25 + 6.25 = 17
    assert ops.masked_var(VALUES, MASK).item() == pytest.approx(17 / 3)
    assert ops.masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(17 / 4)


GROUP_VALUES = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 20.0])
GROUPS = torch.tensor([0, 0, 1, 1, 1, 2])


def test_group_mean() -> None:
    expected = [1.5, 1.5, 17 / 3, 17 / 3, 17 / 3, 20.0]
    assert ops.group_mean(GROUP_VALUES, GROUPS).tolist() == pytest.approx(expected)
    assert ops.group_mean(GROUP_VALUES, GROUPS).dtype == torch.float32


def test_group_std() -> None:
    m1 = 17 / 3
    ss1 = (3 - m1) ** 2 + (4 - m1) ** 2 + (10 - m1) ** 2
    unbiased = [math.sqrt(0.5)] * 2 + [math.sqrt(ss1 / 2)] * 3 + [0.0]
    biased = [0.5] * 2 + [math.sqrt(ss1 / 3)] * 3 + [0.0]
    assert ops.group_std(GROUP_VALUES, GROUPS).tolist() == pytest.approx(unbiased)
    assert ops.group_std(GROUP_VALUES, GROUPS, unbiased=False).tolist() == pytest.approx(biased)


def test_group_stats_with_unordered_groups() -> None:
    values = torch.tensor([5.0, 1.0, 7.0, 3.0])
    group = torch.tensor([1, 0, 1, 0])
    assert ops.group_mean(values, group).tolist() == pytest.approx([6.0, 2.0, 6.0, 2.0])
    assert ops.group_std(values, group).tolist() == pytest.approx([math.sqrt(2)] * 4)


# aggregate_loss: row 0 has 3 tokens summing to 6, row 1 one token (6)
LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
LOSS_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])


@pytest.mark.parametrize(("mode", "expected"), [
    ("token-mean", 12 / 4),  # all token losses / tokens
    ("seq-mean-token-mean", (6 / 3 + 6 / 1) / 2),  # mean of per-sequence means
    ("seq-mean-token-sum", (6 + 6) / 2),  # mean of per-sequence sums
    ("seq-mean-token-sum-norm", (6 / 5 + 6 / 5) / 2),  # sums / norm_constant, / sequences
])
def test_aggregate_loss_modes(mode: str, expected: float) -> None:
    own = Normalizers(tokens=4, sequences=2, norm_constant=5)
    assert ops.aggregate_loss(LOSS, LOSS_MASK, mode, own).item() == pytest.approx(expected)


@pytest.mark.parametrize(("mode", "expected"), [
    ("token-mean", 12 / 10),
    ("seq-mean-token-mean", (6 / 3 + 6 / 1) / 8),
    ("seq-mean-token-sum", (6 + 6) / 8),
    ("seq-mean-token-sum-norm", (6 / 5 + 6 / 5) / 8),
])
def test_aggregate_loss_uses_the_step_normalizers(mode: str, expected: float) -> None:
    """A minibatch of a bigger step divides by the step's counts, not its own."""
    step = Normalizers(tokens=10, sequences=8, norm_constant=5)
    assert ops.aggregate_loss(LOSS, LOSS_MASK, mode, step).item() == pytest.approx(expected)


def test_aggregate_loss_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="token-mean"):
        ops.aggregate_loss(LOSS, LOSS_MASK, "sum", Normalizers(4, 2, 5))


def test_outside_band_and_rescaled_clip_hand_computed() -> None:
    ratio = torch.tensor([0.5, 0.8, 1.0, 1.2, 1.5], dtype=torch.float64)
    assert ops.outside_band(ratio, 0.8, 1.2).tolist() == [True, False, False, False, True]
    adv = torch.tensor([-2.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    logp = ratio.log().requires_grad_(True)
    loss = ops.rescaled_clip(logp.exp(), adv, 0.8, 1.2)
    # value -clip(r) A: 1.6, -0.8, -1.0, -1.2, -1.2; gradient in logp the same (r / sg(r))
    expected = torch.tensor([1.6, -0.8, -1.0, -1.2, -1.2], dtype=torch.float64)
    torch.testing.assert_close(loss.detach(), expected)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, expected)


def test_entropy_from_logits() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    z = math.exp(2) + 3  # H = log Z - sum p_i x_i = log Z - 2 e^2 / Z
    expected = [math.log(4), math.log(z) - 2 * math.exp(2) / z]
    assert ops.entropy_from_logits(logits).tolist() == pytest.approx(expected, rel=1e-5)


# -- the minibatch property, through the real path ------------------------------------------

PROMPTS = ["What is 12+34?", "Hi"]  # different lengths: the short one is left-padded
COMPLETION = 6
LENGTHS = [6, 2, 4, 1, 5, 3, 6, 2]  # ragged completions, so the four modes differ


def fixed_batch(tokenizer: object, seed: int = 0, per_token: bool = False) -> RolloutBatch:
    """Two groups of four samples: shared, left-padded prompts, ragged random completions,
    right padding, random advantages. Built by hand so it does not depend on sampling."""
    g = torch.Generator().manual_seed(seed)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in PROMPTS]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, attn = enc["input_ids"].repeat_interleave(4, 0), enc["attention_mask"].repeat_interleave(
        4, 0)
    n, width = ids.shape
    completion = torch.randint(0, 256, (n, COMPLETION), generator=g)
    cmask = (torch.arange(COMPLETION)[None] < torch.tensor(LENGTHS)[:, None]).float()
    completion = completion.masked_fill(cmask == 0, tokenizer.pad_token_id)
    tokens = torch.cat([ids, completion], 1)
    batch = RolloutBatch(
        group=torch.arange(2).repeat_interleave(4), tokens=tokens,
        attention_mask=torch.cat([attn, cmask.long()], 1),
        completion_mask=torch.cat([torch.zeros(n, width), cmask], 1),
        behavior_logp=torch.cat([torch.zeros(n, width), -torch.rand(n, COMPLETION, generator=g)
                                 * 3 * cmask], 1),
        policy_version=torch.zeros(n, dtype=torch.long), texts=[""] * n)
    if per_token:
        batch.advantages = torch.randn(n, tokens.shape[1], generator=g)
    else:
        batch.advantages = torch.randn(n, generator=g)
    return batch


def step_gradient(chunks: int, mode: str, per_token: bool = False, old_logp: str = "auto",
                  own_counts: bool = False) -> dict[str, torch.Tensor]:
    """Accumulated gradient of one optimizer step's loss, split into ``chunks`` minibatches."""
    run = make_run({"grpo": rlmix_grpo},
                   [f"train.grad_accum={chunks}", f"grpo.loss_mode={mode}",
                    f"grpo.old_logp={old_logp}", "grpo.eps_low=0.1", "grpo.eps_high=0.1",
                    "policy.device=cpu"], with_policy=True)
    assert run.policy is not None
    model = run.policy.model
    model.train()
    batch = fixed_batch(run.tokenizer, per_token=per_token)
    minibatches = list(run.minibatches(batch))
    assert len(minibatches) == chunks
    assert sum(len(mb.batch) for mb in minibatches) == len(batch)
    assert [mb.last for mb in minibatches] == [False] * (chunks - 1) + [True]
    model.zero_grad(set_to_none=True)
    for mb in minibatches:
        normalizers = mb.normalizers
        if own_counts:  # the mistake the design rules out: a minibatch's own counts
            cm = mb.batch.completion_mask
            normalizers = Normalizers(tokens=float(cm.sum()), sequences=float(len(mb.batch)),
                                      norm_constant=normalizers.norm_constant)
        logp, entropy = run.policy.logprobs(run, mb.batch)
        terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
        assert terms.mode == mode
        loss = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, normalizers)
        loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()
            if p.grad is not None}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def grad_scale(a: dict[str, torch.Tensor]) -> float:
    return max(float(v.abs().max()) for v in a.values())


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_minibatch_split_leaves_gradient_unchanged(mode: str) -> None:
    """fp32 throughout; the largest gradient entries are ~1, the measured differences between
    1, 2 and 4 chunks ~2e-7, so 1e-6 absolute holds with margin (and the wrong normaliser
    below misses it by five orders of magnitude)."""
    whole = step_gradient(1, mode)
    assert grad_scale(whole) > 1e-3  # a real gradient, not zeros
    for chunks in (2, 4):
        split = step_gradient(chunks, mode)
        assert max_diff(whole, split) < 1e-6, (mode, chunks)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_minibatch_split_with_token_advantages_and_clipping(mode: str) -> None:
    """Per-token advantages and a ratio against behaviour log-probs (clipping active)."""
    whole = step_gradient(1, mode, per_token=True, old_logp="behavior")
    assert grad_scale(whole) > 1e-4
    split = step_gradient(4, mode, per_token=True, old_logp="behavior")
    assert max_diff(whole, split) < 1e-6


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_minibatch_own_counts_would_change_the_gradient(mode: str) -> None:
    """The check above can fail: normalising by a minibatch's own counts moves the gradient
    far beyond the tolerance."""
    whole = step_gradient(1, mode)
    wrong = step_gradient(4, mode, own_counts=True)
    assert max_diff(whole, wrong) > 1e-4


def test_default_update_sees_the_same_accumulated_gradient(tmp_path: Path) -> None:
    """Through ``rlmix_update`` (the core's AdamW default): the gradient norm it measures on the
    closing minibatch is the same for 1, 2 and 4 accumulation chunks."""
    from rlmix import loop

    norms = []
    for chunks in (1, 2, 4):
        run = make_run({"grpo": rlmix_grpo}, [f"train.grad_accum={chunks}",
                                              "train.max_grad_norm=0", "policy.device=cpu",
                                              f"out={tmp_path}"], with_policy=True)
        loop.configure(run)
        assert run.policy is not None
        run.policy.model.train()
        batch = fixed_batch(run.tokenizer)
        stats: dict[str, float] = {}
        for mb in run.minibatches(batch):
            logp, entropy = run.policy.logprobs(run, mb.batch)
            terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
            terms.value = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, mb.normalizers)
            terms.minibatch = mb
            stats = run.hook.rlmix_update(run=run, loss=terms)
        assert run.policy_version == 1
        norms.append(stats["update/grad_norm"])
    assert norms[0] > 1e-3
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    assert norms[2] == pytest.approx(norms[0], rel=1e-5)
