"""Tests of speculative rollout: the acceptance rule's math, losslessness (chi-square over the
exact sequence distribution of a small-vocabulary model, at temperature 1 and 0.7, with dense and
one-hot drafters; a broken residual fails the same test), greedy token identity with
``rlmix_hf``, the drafters, the cost model, the hooks, checkpoint and deployment round trips, and
the TLT claim in miniature (the adaptive drafter's accepted length rises with training, drops when
the policy moves, and recovers)."""

from __future__ import annotations

import itertools

import pytest
import rlmix_hf
import rlmix_speculative as spec
import torch
from rlmix_speculative import (
    AdaptiveDrafter,
    CostModel,
    Draft,
    NgramIndex,
    PreviousRolloutDrafter,
    SamplingParams,
    SpecStats,
    SuffixDrafter,
    engine,
    expected_tokens,
    load_drafter,
    residual_distribution,
    save_drafter,
    speculative_sample,
    verify_block,
)

import rlmix
from rlmix import checkpoint
from rlmix.policy import tiny_random
from rlmix.sampling import filter_logits, sample_tokens
from rlmix.testing import make_run
from rlmix.types import GenerationRequest, Prompt

PROMPTS = ["hello", "a much longer prompt, padded least", "mid length", "x"]


def sharpen(model, std=0.3, seed=1):
    """Larger random weights: the default init gives near-uniform logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def model_tok():
    model, tok = tiny_random()
    return sharpen(model), tok


def encode(tok, texts):
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


# ---------------------------------------------------------------- the acceptance rule


def test_residual_is_normalised_positive_part_and_falls_back_to_p():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.5, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    r = residual_distribution(p, q)
    torch.testing.assert_close(r[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(r[1], p[1])  # p == q: nothing to resample, p itself
    one_hot = torch.nn.functional.one_hot(torch.tensor([1]), 4).float()
    torch.testing.assert_close(residual_distribution(p[:1], one_hot),
                               torch.tensor([[0.5, 0.0, 0.2, 0.0]]) / 0.7)


@pytest.mark.parametrize("one_hot", [False, True])
def test_one_step_output_is_exactly_p(one_hot):
    """The marginal of a verify step (accept d ~ q with min(1, p/q), else residual) is p:
    analytically, and by Monte Carlo over 200k rows with a filtered p (top-k + temperature)."""
    g = torch.Generator().manual_seed(0)
    vocab = 6
    logits = 2 * torch.randn(1, 2, vocab, generator=g)
    sampling = SamplingParams(temperature=0.7, top_p=1.0, top_k=4)
    p = torch.softmax(filter_logits(logits[0, 0], 0.7, 1.0, 4), -1)
    if one_hot:
        q = torch.nn.functional.one_hot(torch.tensor(2), vocab).float()
    else:
        q = torch.softmax(torch.randn(vocab, generator=g), -1)
    accept = torch.minimum(q, p)  # q(x) min(1, p(x)/q(x))
    analytic = accept + (1 - accept.sum()) * residual_distribution(p[None], q[None])[0]
    torch.testing.assert_close(analytic, p)

    rows = 200_000
    drafts = torch.multinomial(q.expand(rows, vocab), 1, replacement=True, generator=g)
    draft = Draft(tokens=drafts, length=torch.ones(rows, dtype=torch.long),
                  q=None if one_hot else q.expand(rows, 1, vocab))
    accepted, nxt, _, _ = verify_block(logits.expand(rows, 2, vocab), draft, sampling, g)
    first = torch.where(accepted == 1, drafts[:, 0], nxt)
    freq = torch.bincount(first, minlength=vocab).float() / rows
    assert (freq - p).abs().max() < 0.005
    assert float(freq[p == 0].sum()) == 0.0  # top-k's excluded tokens never come out
    if one_hot:  # acceptance rate is p(d)
        assert abs(float(accepted.float().mean()) - float(p[2])) < 0.005


def test_greedy_accepts_exactly_the_argmax_prefix():
    logits = torch.full((3, 4, 5), -5.0)
    best = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0], [4, 3, 2, 1]])
    logits.scatter_(-1, best[..., None], 5.0)
    drafts = torch.tensor([[1, 2, 0], [0, 0, 0], [1, 3, 2]])
    draft = Draft(tokens=drafts, length=torch.tensor([3, 2, 3]))
    accepted, nxt, _, _ = verify_block(logits, draft, SamplingParams(0.0))
    # row 0: 1, 2 match, 0 != 3; row 1: its two drafts match, no third; row 2: 1 != 4
    assert accepted.tolist() == [2, 2, 0]
    assert nxt.tolist() == [3, 0, 4]


# ---------------------------------------------------------------- lossless: chi-square


class DenseTestDrafter:
    """Drafts from a fixed random table q(. | last token), deliberately unlike p, and offers a
    random number (0..k) of drafts per row so the no-draft path is exercised too."""

    wants_hidden = False

    def __init__(self, vocab, seed=0, one_hot=False):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.softmax(1.5 * torch.randn(vocab, vocab, generator=g), -1)
        self.one_hot = one_hot
        self.g = g

    def begin(self, ctx):
        pass

    def observe(self, ctx, tokens, hidden):
        pass

    def end(self, ctx):
        pass

    def propose(self, ctx, k):
        s = ctx.sampling
        last = torch.tensor([seq[-1] for seq in ctx.seqs])
        toks, qs = [], []
        for _ in range(k):
            q = torch.softmax(filter_logits(self.table[last].log(), s.temperature, s.top_p,
                                            s.top_k), -1)
            d = torch.multinomial(q, 1, generator=self.g).squeeze(-1)
            toks.append(d)
            qs.append(q)
            last = d
        length = torch.randint(0, k + 1, (len(ctx.seqs),), generator=self.g)
        return Draft(tokens=torch.stack(toks, 1), length=length,
                     q=None if self.one_hot else torch.stack(qs, 1))


VOCAB, LENGTH, SAMPLES = 6, 3, 12_000


@pytest.fixture(scope="module")
def small_vocab_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=64, tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return sharpen(model, std=0.5, seed=3)


def exact_sequence_probs(model, prompt, sampling):
    """P(sequence) of every VOCAB**LENGTH completion under plain sampling's distribution."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=LENGTH)))
    tokens = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[:, prompt.shape[1] - 1:-1]
    logp = torch.log_softmax(filter_logits(logits, sampling.temperature, sampling.top_p,
                                           sampling.top_k), -1)
    return seqs, logp.gather(-1, seqs[..., None]).squeeze(-1).sum(-1).exp()


def chi_square_pvalue(samples, seqs, probs):
    codes = (samples * (VOCAB ** torch.arange(LENGTH - 1, -1, -1))).sum(-1)
    seq_codes = (seqs * (VOCAB ** torch.arange(LENGTH - 1, -1, -1))).sum(-1)
    counts = torch.zeros(VOCAB ** LENGTH).index_add_(0, codes, torch.ones(len(codes)))
    observed, expected = counts[seq_codes], probs.double() * len(samples)
    assert float(observed[probs == 0].sum()) == 0, "a sequence of probability 0 was sampled"
    big = expected >= 5  # pool the rare sequences into one bin
    obs = torch.cat([observed[big].double(), observed[~big].sum()[None].double()])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return 1 - float(torch.distributions.Chi2(torch.tensor(float(dof))).cdf(torch.tensor(stat)))


def spec_samples(model, sampling, drafter, k, seed):
    prompt = torch.tensor([[1, 4]])
    g = torch.Generator().manual_seed(seed)
    out = speculative_sample(model, prompt, torch.ones_like(prompt), SAMPLES, LENGTH, sampling,
                             [-1], 0, drafter=drafter, k=k, generator=g)
    assert out.completion.shape == (SAMPLES, LENGTH) and bool(out.completion_mask.all())
    return prompt, out


CASES = [  # (temperature, top_p, top_k, one-hot drafts, k)
    (1.0, 1.0, 0, False, 2),
    (0.7, 1.0, 0, False, 2),
    (1.0, 1.0, 0, True, 2),
    (0.7, 0.9, 4, False, 1),
]


@pytest.mark.parametrize("temperature,top_p,top_k,one_hot,k", CASES)
def test_speculative_sequences_follow_plain_sampling(small_vocab_model, temperature, top_p,
                                                     top_k, one_hot, k):
    sampling = SamplingParams(temperature, top_p, top_k)
    drafter = DenseTestDrafter(VOCAB, seed=1, one_hot=one_hot)
    prompt, out = spec_samples(small_vocab_model, sampling, drafter, k, seed=2)
    assert out.stats.accepted > 0 and out.stats.accepted < out.stats.proposed  # both paths ran
    seqs, probs = exact_sequence_probs(small_vocab_model, prompt, sampling)
    assert chi_square_pvalue(out.completion, seqs, probs) > 1e-3
    # the behaviour log-probs are the policy's sampling log-probs of the whole sequence
    index = {tuple(s): i for i, s in enumerate(seqs.tolist())}
    seq_logp = out.logp.sum(-1)
    expect = probs.log()[[index[tuple(s)] for s in out.completion[:200].tolist()]]
    torch.testing.assert_close(seq_logp[:200], expect, atol=1e-4, rtol=0)


def test_plain_sampling_passes_the_same_test(small_vocab_model):
    """Guards the test itself: rlmix_hf's plain sampler fits the enumerated distribution."""
    sampling = SamplingParams(0.7)
    prompt = torch.tensor([[1, 4]])
    torch.manual_seed(5)
    completion, _, _ = sample_tokens(small_vocab_model, prompt, torch.ones_like(prompt), SAMPLES,
                                     LENGTH, 0.7, 1.0, 0, [-1], 0)
    seqs, probs = exact_sequence_probs(small_vocab_model, prompt, sampling)
    assert chi_square_pvalue(completion, seqs, probs) > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_broken_residual_fails_the_chi_square(small_vocab_model, monkeypatch, temperature):
    """Resampling a rejection from p instead of max(0, p - q) biases the output toward
    tokens the drafter under-proposes: the same test must catch it."""
    monkeypatch.setattr(engine, "residual_distribution", lambda p, q: p)
    sampling = SamplingParams(temperature)
    prompt, out = spec_samples(small_vocab_model, sampling, DenseTestDrafter(VOCAB, seed=1),
                               2, seed=2)
    seqs, probs = exact_sequence_probs(small_vocab_model, prompt, sampling)
    assert chi_square_pvalue(out.completion, seqs, probs) < 1e-6


def test_always_accepting_fails_the_chi_square(small_vocab_model, monkeypatch):
    real = engine.verify_block

    def accept_all(logits, draft, sampling, generator=None):
        # q(d) = 1e-9 makes p / q huge: every offered draft is accepted
        tiny_q = torch.nn.functional.one_hot(draft.tokens, logits.shape[-1]).float() * 1e-9
        return real(logits, Draft(draft.tokens, draft.length, tiny_q), sampling, generator)

    monkeypatch.setattr(engine, "verify_block", accept_all)
    sampling = SamplingParams(1.0)
    prompt, out = spec_samples(small_vocab_model, sampling, DenseTestDrafter(VOCAB, seed=1),
                               2, seed=2)
    seqs, probs = exact_sequence_probs(small_vocab_model, prompt, sampling)
    assert chi_square_pvalue(out.completion, seqs, probs) < 1e-6


# ---------------------------------------------------------------- greedy identity


def test_greedy_is_token_identical_to_plain_greedy(model_tok):
    model, tok = model_tok
    ids, attn = encode(tok, PROMPTS)
    eos = [tok.eos_token_id]
    ref, ref_mask, ref_logp = sample_tokens(model, ids, attn, 2, 24, 0.0, 1.0, 0, eos,
                                            tok.pad_token_id)
    assert len({tuple(r) for r in ref.tolist()}) == len(PROMPTS)
    drafters = {"suffix": SuffixDrafter(), "previous_rollout": PreviousRolloutDrafter(),
                "adaptive": AdaptiveDrafter(model, window=8)}
    for name, drafter in drafters.items():
        for _ in range(2):  # the second call drafts from the first's outputs
            out = speculative_sample(model, ids, attn, 2, 24, SamplingParams(0.0), eos,
                                     tok.pad_token_id, drafter=drafter, k=4)
            assert torch.equal(out.completion, ref), name
            assert torch.equal(out.completion_mask, ref_mask), name
            torch.testing.assert_close(out.logp, ref_logp, atol=1e-4, rtol=0)
        if name != "adaptive":  # the model-free drafters must have sped the repeat up
            assert out.stats.mean_accepted_length > 2.0, name


def test_eos_inside_an_accepted_block_ends_the_row(model_tok):
    model, tok = model_tok
    ids, attn = encode(tok, PROMPTS[:2])
    ref, mask, _ = sample_tokens(model, ids, attn, 1, 12, 0.0, 1.0, 0, [-1], tok.pad_token_id)
    stop = int(ref[0, 4])  # pretend the 5th greedy token of row 0 is an EOS
    expect, expect_mask, _ = sample_tokens(model, ids, attn, 1, 12, 0.0, 1.0, 0, [stop],
                                           tok.pad_token_id)
    drafter = PreviousRolloutDrafter()
    speculative_sample(model, ids, attn, 1, 12, SamplingParams(0.0), [-1], tok.pad_token_id,
                       drafter=drafter, k=6, keys=["a", "b"])
    out = speculative_sample(model, ids, attn, 1, 12, SamplingParams(0.0), [stop],
                             tok.pad_token_id, drafter=drafter, k=6, keys=["a", "b"])
    assert out.stats.accepted > 0
    width = expect.shape[1]
    assert torch.equal(out.completion[:, :width], expect)
    assert torch.equal(out.completion_mask[:, :width], expect_mask)


# ---------------------------------------------------------------- drafters


def test_ngram_index_finds_the_longest_suffix_and_its_continuation():
    index = NgramIndex(max_n=4)
    index.add([1, 2, 3, 4, 5])
    index.add([9, 2, 3, 7])
    assert index.match([0, 2, 3]) == (2, [7])  # latest occurrence of (2, 3)
    assert index.match([1, 2, 3]) == (3, [4, 5])  # the longer match wins
    assert index.match([8]) == (0, [])


def test_suffix_drafts_longer_after_longer_matches():
    drafter = SuffixDrafter(max_match=8, spec_factor=1.0)
    drafter.remember(list(range(10, 30)))
    ctx = engine.DraftContext(seqs=[[5, 10], [10, 11, 12, 13, 14]], prompt_len=[1, 1],
                              keys=["a", "b"], member=[0, 0], live=[True, True],
                              sampling=SamplingParams(0.0))
    drafter.begin(ctx)
    drafter.observe(ctx, ctx.seqs, None)
    draft = drafter.propose(ctx, 8)
    assert draft.length.tolist() == [1, 5]  # match lengths 1 and 5
    assert draft.tokens[1, :5].tolist() == [15, 16, 17, 18, 19]


def test_previous_rollout_drafts_the_same_prompts_last_output():
    drafter = PreviousRolloutDrafter(realign=2)
    ctx = engine.DraftContext(seqs=[[7, 1, 2], [8, 1]], prompt_len=[1, 1], keys=["p", "q"],
                              member=[0, 0], live=[True, True], sampling=SamplingParams(1.0))
    drafter.end(engine.DraftContext(seqs=[[7, 1, 2, 3, 4, 5], [8, 9, 9]], prompt_len=[1, 1],
                                    keys=["p", "q"], member=[0, 0], live=[False, False],
                                    sampling=SamplingParams(1.0)))
    draft = drafter.propose(ctx, 2)
    assert draft.tokens[0].tolist() == [3, 4] and draft.length.tolist() == [2, 0]
    ctx.seqs[0] = [7, 1, 6, 3]  # diverged, then the old tail's "3" reappears: realign
    assert drafter.propose(ctx, 2).tokens[0].tolist() == [4, 5]


# ---------------------------------------------------------------- cost model


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_cost_model_turns_speculation_off_when_it_does_not_pay():
    cost = CostModel(candidates=[0, 1, 2, 4], explore=0.0)
    assert cost.choose() == 0  # plain is measured first
    cost.update(SpecStats(k=0, passes=10, row_passes=10, verify_s=1.0))
    assert cost.choose() == 4  # then the longest draft
    # low acceptance, expensive verify: plain wins
    cost.update(SpecStats(k=4, passes=10, row_passes=10, slots=40, accepted=2, verify_s=2.0,
                          draft_s=1.0))
    assert cost.choose() == 0
    fast = CostModel(candidates=[0, 1, 2, 4], explore=0.0)
    fast.update(SpecStats(k=0, passes=10, row_passes=10, verify_s=1.0))
    # high acceptance and a nearly free verify (memory-bound decoding): the longest draft wins
    fast.update(SpecStats(k=4, passes=10, row_passes=10, slots=40, accepted=36, verify_s=1.1,
                          draft_s=0.1))
    assert fast.choose() == 4


# ---------------------------------------------------------------- hooks, checkpoints, deploy


def make_spec_run(overrides=(), tmp_path=None):
    extra = [f"out={tmp_path}"] if tmp_path is not None else []
    run = make_run({"hf": rlmix_hf, "speculative": spec},
                   ["train.group_size=2", "sampling.max_new_tokens=12", *extra, *overrides],
                   with_policy=True)
    sharpen(run.policy.model)
    from rlmix import loop

    loop.configure(run)
    return run


def test_generate_hook_matches_hf_layout_and_greedy_tokens():
    run = make_spec_run(["speculative.drafter=suffix"])
    prompts = [Prompt(messages=[{"role": "user", "content": t}], id=t) for t in PROMPTS]
    request = GenerationRequest(prompts=prompts, n=2, temperature=0.0, max_new_tokens=12)
    ours = [spec.rlmix_generate(run=run, request=request) for _ in range(2)][-1]
    theirs = rlmix_hf.rlmix_generate(run=run, request=request)
    for name in ("group", "tokens", "attention_mask", "completion_mask", "policy_version"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    torch.testing.assert_close(ours.behavior_logp, theirs.behavior_logp, atol=1e-4, rtol=0)
    assert ours.texts == theirs.texts
    metrics = {}
    spec.rlmix_step_end(run=run, metrics=metrics)
    assert metrics["speculative/mean_accepted_length"] >= 1.0


def test_settings_are_validated():
    for bad in ("speculative.drafter=eagle", "speculative.k=-1", "speculative.explore=2"):
        with pytest.raises(rlmix.ManifestError, match="speculative"):
            make_run({"hf": rlmix_hf, "speculative": spec}, [bad])
    with pytest.raises(rlmix.ManifestError, match="init_from"):
        make_spec_run(["speculative.drafter=adaptive", "speculative.init_from=/nonexistent"])


def test_drafter_state_survives_a_checkpoint_and_deploys_alone(tmp_path):
    run = make_spec_run(["speculative.drafter=adaptive", "speculative.train_steps=3",
                         "train.steps=1"], tmp_path)
    prompts = [Prompt(messages=[{"role": "user", "content": t}], id=t) for t in PROMPTS]
    run.generate(prompts, n=2, temperature=1.0)
    spec.rlmix_step_end(run=run, metrics={})
    drafter = run.plugin_resources("speculative")["speculator"].drafter
    assert drafter.train_steps_done == 3
    saved = {k: v.clone() for k, v in drafter.layer.state_dict().items()}
    folder = checkpoint.save(run)
    with torch.no_grad():
        for p in drafter.layer.parameters():
            p.add_(1.0)
    checkpoint.restore(run, folder)
    run.generate(prompts[:1], n=1)  # the plugin adopts the restored state on its next call
    for k, v in drafter.layer.state_dict().items():
        torch.testing.assert_close(v, saved[k])
    assert drafter.train_steps_done == 3
    # deployment: the drafter alone, attached to a policy, drafts the same tokens
    path = spec.save_run_drafter(run, tmp_path / "drafter.pt")
    loaded = load_drafter(path, run.policy)
    assert loaded.embed is run.policy.model.get_input_embeddings()
    for k, v in loaded.layer.state_dict().items():
        torch.testing.assert_close(v, saved[k])
    other = save_drafter(loaded, tmp_path / "again.pt")
    assert other.exists()


# ---------------------------------------------------------------- the TLT claim in miniature


def accepted_length(model, tok, drafter, prompts, seed):
    ids, attn = encode(tok, prompts)
    out = speculative_sample(model, ids, attn, 4, 24, SamplingParams(0.0), [-1],
                             tok.pad_token_id, drafter=drafter, k=4,
                             generator=torch.Generator().manual_seed(seed),
                             collect_hidden=True)
    drafter.add_rollouts(out.hidden)
    return out.stats.mean_accepted_length


@pytest.mark.slow
def test_adaptive_drafter_follows_a_moving_policy():
    """Mean accepted length rises as the drafter trains on the rollouts' hidden states, drops
    when the policy's weights move, and recovers with more online training."""
    model, tok = tiny_random()
    sharpen(model)
    prompts = [f"question {i}: what is {i * 7}?" for i in range(8)]
    drafter = AdaptiveDrafter(model, window=8, lr=3e-3, train_positions=256, seed=0)
    curve = []
    for r in range(5):
        curve.append(accepted_length(model, tok, drafter, prompts, r))
        drafter.train(20)
    trained = accepted_length(model, tok, drafter, prompts, 9)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # the policy moves (as an RL update would move it, only more)
        for name, p in model.named_parameters():
            if "layers" in name and p.dim() == 2:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    moved = accepted_length(model, tok, drafter, prompts, 10)
    for r in range(5):
        drafter.train(20)
        curve.append(accepted_length(model, tok, drafter, prompts, 11 + r))
    recovered = curve[-1]
    assert curve[0] < 1.2  # an untrained drafter is almost never right
    assert trained > curve[0] + 0.5
    assert moved < trained - 0.4
    assert recovered > moved + 0.4


def test_a_training_step_with_speculative_rollouts(tmp_path):
    """hf + arith + grpo + speculative (adaptive): the loop runs, the drafter trains at step end
    and the metrics carry the speculation figures."""
    from rlmix import loop

    # not dependencies of speculative: skipped when installed alone (nox -s isolated)
    rlmix_arith = pytest.importorskip("rlmix_arith")
    rlmix_grpo = pytest.importorskip("rlmix_grpo")

    run = make_run({"hf": rlmix_hf, "arith": rlmix_arith, "grpo": rlmix_grpo,
                    "speculative": spec},
                   ["train.group_size=2", "train.prompts_per_step=2",
                    "sampling.max_new_tokens=8", f"out={tmp_path}",
                    "speculative.drafter=adaptive", "speculative.train_steps=2"],
                   with_policy=True)
    loop.configure(run)
    owner = run.pm.hook.rlmix_generate.get_hookimpls()[-1].plugin_name
    assert owner == "speculative"
    metrics = loop.train_step(run)
    run.hook.rlmix_step_end(run=run, metrics=metrics)
    assert metrics["speculative/mean_accepted_length"] >= 1.0
    assert "drafter/kl" in metrics
    assert run.plugin_resources("speculative")["speculator"].drafter.train_steps_done == 2
    assert run.state["speculative"]["drafter"]["train_steps_done"] == 2
