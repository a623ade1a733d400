"""Tests of the hf rollout engine: the sampling filters, greedy parity with transformers'
``generate``, behaviour log-probs against a fresh full forward (which checks the KV-cache repeat
and the positions), EOS handling, seeding, and ``rlmix_generate`` through a run."""

from __future__ import annotations

import pytest
import rlmix_hf
import torch
from rlmix_hf import filter_logits, sample_tokens

import rlmix
from rlmix.policy import tiny_random
from rlmix.testing import make_run
from rlmix.types import GenerationRequest, Prompt

PROMPTS = ["hello", "a much longer prompt, padded least", "mid length", "x"]


def sharpen(model, std=0.3, seed=1):
    """Re-draw the weight matrices with a larger scale: the default init gives near-uniform
    logits (greedy repeats one token, ties are close), which would make parity checks weak."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def model_tok():
    model, tok = tiny_random()
    return sharpen(model).eval(), tok


def encode(tok, texts):
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def full_forward_logits(model, ids, attn, completion, cmask):
    """Logits predicting each completion token, from one forward over prompt + completion."""
    tokens = torch.cat([ids, completion], 1)
    mask = torch.cat([attn, cmask.long()], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits
    width = ids.shape[1]
    return logits[:, width - 1:-1].float()


# ---------------------------------------------------------------- filter_logits


def test_temperature_divides_the_logits():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    for t in (0.5, 1.0, 2.0):
        torch.testing.assert_close(filter_logits(logits, t, 1.0, 0), logits / t)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    for k in (1, 3, 17):
        out = filter_logits(logits, 1.0, 1.0, k)
        kept = torch.isfinite(out)
        assert (kept.sum(-1) == k).all()
        top = torch.topk(logits, k, -1).indices
        assert kept.gather(-1, top).all()
        torch.testing.assert_close(out[kept], logits[kept])
    for k in (0, 40, 100):  # disabled, or at least the vocabulary: nothing is dropped
        assert torch.isfinite(filter_logits(logits, 1.0, 1.0, k)).all()


def test_top_p_hand_computed_and_after_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # T = 1: probs 0.644, 0.237, 0.087, 0.032; the first reaches no 0.7, the first two do
    assert torch.isfinite(filter_logits(logits, 1.0, 0.7, 0)).tolist() == [[True, True,
                                                                            False, False]]
    # T = 0.5: probs 0.867, 0.117, ...; the top token alone reaches 0.7
    assert torch.isfinite(filter_logits(logits, 0.5, 0.7, 0)).tolist() == [[True, False,
                                                                            False, False]]
    # p = 0.9 at T = 1 needs three tokens (0.644 + 0.237 = 0.881 < 0.9)
    assert torch.isfinite(filter_logits(logits, 1.0, 0.9, 0)).sum() == 3


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    g = torch.Generator().manual_seed(2)
    logits = 2 * torch.randn(6, 50, generator=g)
    for p in (0.05, 0.3, 0.6, 0.9, 0.99):
        kept = torch.isfinite(filter_logits(logits, 1.0, p, 0))
        for row in range(logits.shape[0]):
            probs = torch.softmax(logits[row], -1)
            order = torch.argsort(probs, descending=True)
            mass, size = 0.0, 0
            while mass < p:
                mass += float(probs[order[size]])
                size += 1
            assert set(torch.nonzero(kept[row]).flatten().tolist()) == set(
                order[:size].tolist())
            assert bool(kept[row, logits[row].argmax()])


def test_top_p_always_keeps_the_argmax():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    out = filter_logits(logits, 1.0, 1e-6, 0)
    assert (torch.isfinite(out).sum(-1) == 1).all()
    assert torch.equal(out.argmax(-1), logits.argmax(-1))


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -5.0]])
    # top-k 2 leaves two near-equal tokens (0.52, 0.48): p = 0.6 then keeps both, whereas on
    # the full distribution the first two tokens hold only 0.35 + 0.32 < 0.7
    out = filter_logits(logits, 1.0, 0.6, 2)
    assert torch.isfinite(out).tolist() == [[True, True, False, False, False]]


# ---------------------------------------------------------------- sample_tokens


def test_greedy_matches_transformers_generate(model_tok):
    model, tok = model_tok
    ids, attn = encode(tok, PROMPTS)
    assert len(set(attn.sum(-1).tolist())) == len(PROMPTS)  # left padding of every length
    eos = [tok.eos_token_id]
    completion, cmask, logp = sample_tokens(model, ids, attn, 1, 16, 0.0, 1.0, 0, eos,
                                            tok.pad_token_id)
    reference = model.generate(input_ids=ids, attention_mask=attn, do_sample=False,
                               max_new_tokens=16, eos_token_id=eos,
                               pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    width = reference.shape[1]
    assert torch.equal(completion[:, :width], reference)
    assert (completion[:, width:] == tok.pad_token_id).all()
    assert len({tuple(r) for r in completion.tolist()}) == len(PROMPTS)  # not a degenerate case
    # greedy log-probs are those of the unscaled distribution
    ref = torch.log_softmax(full_forward_logits(model, ids, attn, completion, cmask), -1)
    torch.testing.assert_close(logp * cmask, ref.gather(-1, completion[..., None])[..., 0]
                               * cmask, atol=1e-4, rtol=0)


def test_rows_are_prompt_major_with_n_per_prompt(model_tok):
    model, tok = model_tok
    ids, attn = encode(tok, PROMPTS)
    n, length = 3, 6
    single, _, _ = sample_tokens(model, ids, attn, 1, length, 0.0, 1.0, 0, [-1],
                                 tok.pad_token_id)
    grouped, cmask, logp = sample_tokens(model, ids, attn, n, length, 0.0, 1.0, 0, [-1],
                                         tok.pad_token_id)
    assert grouped.shape == cmask.shape == logp.shape == (len(PROMPTS) * n, length)
    assert torch.equal(grouped, single.repeat_interleave(n, 0))
    assert (cmask == 1).all()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0),
                                                       (1.3, 20, 0.9)])
def test_behaviour_logp_equals_a_fresh_full_forward(model_tok, temperature, top_k, top_p):
    """Proves the one-prefill KV-cache repeat and the position ids are right: every sampled
    token's recorded log-prob equals the one a single forward over prompt + completion gives."""
    model, tok = model_tok
    ids, attn = encode(tok, PROMPTS)
    n = 3
    g = torch.Generator().manual_seed(0)
    completion, cmask, logp = sample_tokens(model, ids, attn, n, 12, temperature, top_p,
                                            top_k, [tok.eos_token_id], tok.pad_token_id,
                                            generator=g)
    logits = full_forward_logits(model, ids.repeat_interleave(n, 0),
                                 attn.repeat_interleave(n, 0), completion, cmask)
    if top_k == 0 and top_p == 1.0:
        expected = torch.log_softmax(logits / temperature, -1)
    else:
        expected = torch.log_softmax(filter_logits(logits, temperature, top_p, top_k), -1)
    expected = expected.gather(-1, completion[..., None])[..., 0]
    live = cmask.bool()
    torch.testing.assert_close(logp[live], expected[live], atol=1e-4, rtol=0)
    assert torch.isfinite(logp).all() and (logp[~live] == 0).all()
    # the group's completions differ: each row sampled on its own after the shared prefill
    assert len({tuple(r) for r in completion[:n].tolist()}) > 1


def test_rows_stop_at_eos(model_tok):
    model, tok = model_tok
    ids, attn = encode(tok, PROMPTS)
    eos = list(range(0, len(tok), 4))  # a quarter of the vocabulary ends a row
    pad = tok.pad_token_id
    length = 20
    completion, cmask, logp = sample_tokens(model, ids, attn, 4, length, 1.0, 1.0, 0, eos, pad,
                                            generator=torch.Generator().manual_seed(4))
    is_eos = torch.isin(completion, torch.tensor(eos)) & cmask.bool()
    stops = []
    for row in range(len(completion)):
        hits = torch.nonzero(is_eos[row]).flatten()
        end = int(hits[0]) + 1 if len(hits) else completion.shape[1]
        stops.append(end)
        assert len(hits) <= 1  # nothing is sampled after the first EOS
        assert (cmask[row, :end] == 1).all()  # EOS itself is masked in
        assert (cmask[row, end:] == 0).all()
        assert (completion[row, end:] == pad).all()
        assert (logp[row, end:] == 0).all()
    assert min(stops) < max(stops)  # rows ended at different steps
    if all(is_eos.any(-1)):  # generation stops as soon as every row is done
        assert completion.shape[1] == max(stops) < length


def test_seeded_sampling_is_reproducible(model_tok):
    model, tok = model_tok
    ids, attn = encode(tok, PROMPTS)

    def draw(seed):
        return sample_tokens(model, ids, attn, 2, 10, 1.0, 0.95, 50, [tok.eos_token_id],
                             tok.pad_token_id, generator=torch.Generator().manual_seed(seed))

    first, again, other = draw(11), draw(11), draw(12)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])


# ---------------------------------------------------------------- rlmix_generate through a run


def hf_run(*overrides):
    run = make_run({"hf": rlmix_hf}, ["sampling.temperature=0.9", *overrides], with_policy=True)
    sharpen(run.policy.model)
    run.policy.model.eval()
    return run


def chat_prompts():
    return [Prompt(messages=[{"role": "user", "content": text}], answer=i, id=f"p{i}")
            for i, text in enumerate(PROMPTS[:3])]


def test_generate_returns_a_consistent_batch():
    run = hf_run()
    run.policy_version = 7
    prompts = chat_prompts()
    n, new = 2, 8
    torch.manual_seed(0)
    batch = run.hook.rlmix_generate(run=run, request=GenerationRequest(
        prompts=prompts, n=n, temperature=0.9, max_new_tokens=new))
    tok = run.tokenizer
    ids, attn = encode(tok, [run.policy.chat_text(p.messages) for p in prompts])
    width = ids.shape[1]
    assert isinstance(batch, rlmix.RolloutBatch) and len(batch) == len(prompts) * n
    assert batch.group.tolist() == [0, 0, 1, 1, 2, 2]
    assert [p.id for p in batch.prompts] == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert batch.policy_version.tolist() == [7] * len(batch)
    assert batch.tokens.shape == batch.attention_mask.shape == batch.completion_mask.shape \
        == batch.behavior_logp.shape
    assert width < batch.tokens.shape[1] <= width + new
    assert torch.equal(batch.tokens[:, :width], ids.repeat_interleave(n, 0))
    assert torch.equal(batch.attention_mask[:, :width], attn.repeat_interleave(n, 0))
    assert (batch.completion_mask[:, :width] == 0).all()
    assert (batch.behavior_logp[:, :width] == 0).all()
    comp = batch.completion_mask[:, width:]
    assert torch.equal(batch.attention_mask[:, width:], comp.long())
    assert (batch.behavior_logp[:, width:][comp == 0] == 0).all()
    for row in range(len(batch)):
        kept = batch.tokens[row, width:][comp[row].bool()]
        assert batch.texts[row] == tok.decode(kept, skip_special_tokens=True)
    # the recorded behaviour log-probs are what the trainer's forward computes for the same
    # tokens at the sampling temperature (the core's Policy.logprobs, through the kernels hook)
    with torch.no_grad():
        logp, _ = run.policy.logprobs(run, batch)
    live = batch.completion_mask.bool()
    torch.testing.assert_close(batch.behavior_logp[live], logp[live], atol=1e-4, rtol=0)


def test_generate_in_chunks_matches_one_call():
    prompts = chat_prompts()
    request = GenerationRequest(prompts=prompts, n=2, temperature=0.0, max_new_tokens=6)
    whole_run = hf_run()
    whole = whole_run.hook.rlmix_generate(run=whole_run, request=request)
    chunked_run = hf_run("hf.batch_size=1")
    chunked = chunked_run.hook.rlmix_generate(run=chunked_run, request=request)
    assert chunked.group.tolist() == whole.group.tolist() == [0, 0, 1, 1, 2, 2]
    assert chunked.texts == whole.texts
    torch.testing.assert_close(chunked.completion_mask.sum(-1), whole.completion_mask.sum(-1))


def _continued(prompts, prefixes):
    return [Prompt(messages=p.messages, answer=p.answer, id=p.id,
                   info={**p.info, **({"continue_from": c} if c else {})})
            for p, c in zip(prompts, prefixes, strict=True)]


def _completion(batch, row):
    return batch.tokens[row][batch.completion_mask[row].bool()].tolist()


def test_a_greedy_continuation_from_a_prefix_of_greedy_output_reproduces_it():
    run = hf_run()
    prompts = chat_prompts()
    full = run.generate(prompts, max_new_tokens=8)
    # prefixes of 3, 0 and 7 tokens (never a whole completion that ended at EOS)
    prefixes = [_completion(full, i)[:min(k, len(_completion(full, i)) - 1)]
                for i, k in enumerate([3, 0, 7])]
    cont = run.generate(_continued(prompts, prefixes), max_new_tokens=8)
    for i in range(len(prompts)):
        # the prefix comes back as the completion's first tokens, the rest is greedy, and the
        # whole stays within max_new_tokens (the prefix counts)
        assert _completion(cont, i) == _completion(full, i)
        assert cont.texts[i] == full.texts[i]
        assert cont.behavior_logp[i][cont.completion_mask[i].bool()].tolist() == \
            pytest.approx(full.behavior_logp[i][full.completion_mask[i].bool()].tolist(),
                          abs=1e-4)


def test_a_sampled_continuation_keeps_its_prefix_and_the_trainer_log_probs():
    run = hf_run()
    prompts = chat_prompts()
    prefixes = [[40, 41, 42], [], [43]]
    torch.manual_seed(0)
    batch = run.hook.rlmix_generate(run=run, request=GenerationRequest(
        prompts=_continued(prompts, prefixes), n=2, temperature=0.9, max_new_tokens=5))
    for row in range(len(batch)):
        tokens = _completion(batch, row)
        prefix = prefixes[row // 2]
        assert tokens[:len(prefix)] == prefix and len(prefix) < len(tokens) <= 5
    # contiguous completion regions: prompt columns, then the given and sampled tokens
    first = batch.completion_mask.argmax(-1)
    for row in range(len(batch)):
        assert (batch.completion_mask[row, first[row]:].diff() <= 0).all()
    with torch.no_grad():
        logp, _ = run.policy.logprobs(run, batch)
    live = batch.completion_mask.bool()
    torch.testing.assert_close(batch.behavior_logp[live], logp[live], atol=1e-4, rtol=0)
    assert (batch.behavior_logp[~live] == 0).all()
    # a prefix as long as the budget: nothing is sampled after it
    whole = run.generate(_continued(prompts[:1], [[40, 41, 42]]), max_new_tokens=3)
    assert _completion(whole, 0) == [40, 41, 42]


def test_stop_at_eos_off_generates_every_token(monkeypatch):
    run = hf_run("hf.stop_at_eos=false")
    monkeypatch.setattr(rlmix_hf, "stop_token_ids", lambda policy: list(range(len(policy
                                                                                   .tokenizer))))
    batch = run.generate(chat_prompts(), max_new_tokens=5)
    assert (batch.completion_mask.sum(-1) == 5).all()
    run = hf_run()  # with stop_at_eos, every token being EOS ends every row after one token
    batch = run.generate(chat_prompts(), max_new_tokens=5)
    assert (batch.completion_mask.sum(-1) == 1).all()


def test_bad_settings_fail():
    with pytest.raises(rlmix.ManifestError, match="hf"):
        make_run({"hf": rlmix_hf}, ["hf.batch_size=-1"])
    with pytest.raises(rlmix.ManifestError, match="hf"):
        make_run({"hf": rlmix_hf}, ["hf.beam=2"])
