"""Tests of the fused_logprobs kernels plugin: the chunked torch path and the Triton kernels
(under TRITON_INTERPRET=1 on the CPU, see conftest.py) against the core's plain default on fresh
random inputs, float64 gradcheck of the hand-written backward, the memory bound (no tensor of
[N, V]), backend selection and settings, the hook through a run, and a 3-step training run with
and without the plugin."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import rlmix_fused_logprobs as fl
import torch
from rlmix_fused_logprobs import Settings, chunked_token_logprobs, token_logprobs
from rlmix_fused_logprobs.chunked import ChunkedTokenLogprobs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import rlmix
from rlmix.policy import plain_token_logprobs
from rlmix.testing import make_batch, make_run

TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_case(n=3, t=7, hidden=24, vocab=101, bias=True, seed=0, dtype=torch.float32,
              scale=1.0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.3)
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=g))
    head = head.to(dtype)
    h = (torch.randn(n, t, hidden, generator=g) * scale).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (n, t), generator=g)
    g_logp = torch.randn(n, t, generator=g)
    g_ent = torch.randn(n, t, generator=g)
    return head, h, labels, g_logp, g_ent


def outputs_and_grads(fn, head, h, labels, g_logp, g_ent):
    """``(logp, entropy, *grads)``: grads of ``sum(g_logp * logp + g_ent * entropy)`` with
    respect to hidden, the weight and (if any) the bias."""
    logp, ent = fn(h, head, labels)
    params = [h, head.weight] + ([head.bias] if head.bias is not None else [])
    grads = torch.autograd.grad((logp * g_logp + ent * g_ent).sum(), params)
    return (logp.detach(), ent.detach(), *grads)


def plain(temperature):
    return lambda h, head, y: plain_token_logprobs(h, head, y, temperature)


def chunked(temperature, chunk, vchunk):
    return lambda h, head, y: chunked_token_logprobs(h, head.weight, head.bias, y, temperature,
                                                     chunk, vchunk)


def assert_all_close(got, want, tol=TOL):
    for i, (a, b) in enumerate(zip(got, want)):
        name = f"output {i} (logp, entropy, d hidden, d weight, d bias)"
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        err = rel(a, b)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


# shapes: (n, t, hidden, vocab); chunk sizes that leave a partial last block in tokens and in
# the vocabulary (101 is prime), one token per row (t = 1), temperatures 1, 0.7 and 1.6
CASES = [
    # n, t, H, V, bias, temperature, chunk, vocab_chunk
    (3, 7, 24, 101, True, 1.0, 8, 0),
    (3, 7, 24, 101, False, 0.7, 5, 32),
    (4, 1, 16, 64, True, 1.6, 3, 16),
    (2, 9, 32, 257, False, 1.0, 1024, 100),
    (1, 5, 8, 33, True, 0.7, 1, 1),
]


@pytest.mark.parametrize("n,t,hdim,vocab,bias,temperature,chunk,vchunk", CASES)
def test_chunked_matches_plain_values_and_gradients(n, t, hdim, vocab, bias, temperature,
                                                    chunk, vchunk):
    head, h, y, g_logp, g_ent = make_case(n, t, hdim, vocab, bias, seed=n * 100 + t)
    want = outputs_and_grads(plain(temperature), head, h, y, g_logp, g_ent)
    got = outputs_and_grads(chunked(temperature, chunk, vchunk), head, h, y, g_logp, g_ent)
    assert_all_close(got, want)


@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_each_output_gradient_alone(which):
    # one upstream gradient at a time: a wrong sign or factor in either term shows here alone
    head, h, y, g_logp, g_ent = make_case(seed=3)
    if which == "logp":
        g_ent = torch.zeros_like(g_ent)
    else:
        g_logp = torch.zeros_like(g_logp)
    want = outputs_and_grads(plain(0.8), head, h, y, g_logp, g_ent)
    got = outputs_and_grads(chunked(0.8, 4, 20), head, h, y, g_logp, g_ent)
    assert_all_close(got, want)


def test_gradcheck_float64_with_token_and_vocab_chunks():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, 5, dtype=torch.float64, generator=g).requires_grad_(True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=g).requires_grad_(True)
    b = torch.randn(11, dtype=torch.float64, generator=g).requires_grad_(True)
    y = torch.randint(0, 11, (6,), generator=g)
    y[2] = -100  # an ignored label: logp 0, still an entropy

    def fn(h, w, b):
        return ChunkedTokenLogprobs.apply(h, w, b, y, 0.6, 4, 3)

    assert torch.autograd.gradcheck(fn, (h, w, b), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_padding_rows_stay_finite_and_masked_gradients_match():
    # left padding: pad-token labels on rows whose hidden state is zero or huge; the loss masks
    # them (zero upstream gradient). Large logits (|s| ~ 1e3) exercise the online log-sum-exp.
    head, h, y, g_logp, g_ent = make_case(n=4, t=6, seed=5)
    mask = torch.ones(4, 6)
    mask[0, :3] = 0
    mask[2, :5] = 0
    with torch.no_grad():
        h[0, :3] = 0.0
        h[2, :5] *= 300.0
    y = torch.where(mask.bool(), y, torch.full_like(y, 100))
    want = outputs_and_grads(plain(0.7), head, h, y, g_logp * mask, g_ent * mask)
    got = outputs_and_grads(chunked(0.7, 5, 32), head, h, y, g_logp * mask, g_ent * mask)
    assert_all_close(got, want)
    assert (got[2][~mask.bool()] == 0).all()  # no gradient reaches a masked position


def test_ignored_labels_give_zero_logp_and_no_logp_gradient():
    head, h, y, g_logp, g_ent = make_case(seed=6)
    ignored = torch.zeros_like(y, dtype=torch.bool)
    ignored[0, 2] = ignored[2, -1] = True
    y_ignored = torch.where(ignored, torch.full_like(y, -100), y)
    got = outputs_and_grads(chunked(1.0, 4, 30), head, h, y_ignored, g_logp, g_ent)
    # the reference: any label at those positions, with their logp gradient dropped
    want = outputs_and_grads(plain(1.0), head, h, y, g_logp * ~ignored, g_ent)
    assert (got[0][ignored] == 0).all()
    assert_all_close(got[1:], want[1:])
    torch.testing.assert_close(got[0][~ignored], want[0][~ignored], rtol=TOL, atol=1e-6)


def test_tied_weights_accumulate_both_uses():
    # the LM head shares its weight with the embedding that made the hidden states
    g = torch.Generator().manual_seed(7)
    emb = torch.nn.Embedding(61, 16)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(61, 16, generator=g) * 0.5)
    head = torch.nn.Linear(16, 61, bias=False)
    head.weight = emb.weight
    ids = torch.randint(0, 61, (3, 8), generator=g)
    labels = torch.randint(0, 61, (3, 8), generator=g)
    g_logp, g_ent = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)

    def grad_of(fn):
        emb.weight.grad = None
        hidden = torch.tanh(emb(ids))
        logp, ent = fn(hidden, head, labels)
        (logp * g_logp + ent * g_ent).sum().backward()
        return emb.weight.grad.clone()

    want = grad_of(plain(0.9))
    got = grad_of(chunked(0.9, 7, 16))
    assert rel(got, want) < TOL


def test_bf16_hidden_under_autocast():
    # the policy's forward under bf16 autocast hands over bf16 hidden states; the head's weight
    # stays fp32 (master weights); both paths compute the logits in fp32. The core calls the
    # hook and the backward outside the autocast region, and so does the reference here.
    head, h, y, g_logp, g_ent = make_case(seed=8)
    proj = torch.nn.Linear(24, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hb = proj(h.detach())
    assert hb.dtype == torch.bfloat16
    hb = hb.detach().requires_grad_(True)
    want = outputs_and_grads(plain(0.7), head, hb, y, g_logp, g_ent)
    got = outputs_and_grads(chunked(0.7, 4, 0), head, hb, y, g_logp, g_ent)
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.bfloat16
    assert_all_close(got[:2], want[:2])
    assert_all_close(got[3:], want[3:])
    assert rel(got[2].float(), want[2].float()) < 1e-2  # bf16 rounding of the same fp32 grad
    # called inside an autocast region the chunked path still runs in fp32, forward and back
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = outputs_and_grads(chunked(0.7, 4, 0), head, hb, y, g_logp, g_ent)
    for a, b in zip(inside, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any torch op produces (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk,vchunk", [(8, 0), (8, 32)])
def test_no_tensor_larger_than_one_block(chunk, vchunk):
    n, t, hdim, vocab = 4, 16, 12, 200
    head, h, y, g_logp, g_ent = make_case(n, t, hdim, vocab, seed=9)
    bound = max(chunk * (vchunk or vocab), vocab * hdim)  # one block, or the weight's gradient
    with LargestTensor() as seen:
        outputs_and_grads(chunked(0.7, chunk, vchunk), head, h, y, g_logp, g_ent)
    assert seen.largest <= bound
    with LargestTensor() as seen_plain:  # the detector sees the default's full logits
        outputs_and_grads(plain(0.7), head, h, y, g_logp, g_ent)
    assert seen_plain.largest >= n * t * vocab > bound


# ---------------------------------------------------------------- Triton (interpreter on CPU)


@pytest.fixture
def tk():
    pytest.importorskip("triton")
    from rlmix_fused_logprobs import triton_kernels

    if not triton_kernels.interpreting() and not torch.cuda.is_available():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set and there is no GPU")
    return triton_kernels


def triton_fn(tk, temperature, blocks=None):
    return lambda h, head, y: tk.triton_token_logprobs(h, head.weight, head.bias, y,
                                                       temperature, blocks)


def to_device(case, device):
    head, h, y, g_logp, g_ent = case
    head = head.to(device)
    h = h.detach().to(device).requires_grad_(True)
    return head, h, y.to(device), g_logp.to(device), g_ent.to(device)


TRITON_CASES = [
    # n, t, H, V, bias, temperature: V = 101 and H = 24 are not multiples of the 32 / 16 tiles;
    # N = 21 is not a multiple of the 16-token block
    (3, 7, 24, 101, True, 1.0),
    (3, 7, 24, 101, False, 0.7),
    (5, 1, 16, 64, True, 1.6),  # t = 1
]


@pytest.mark.parametrize("n,t,hdim,vocab,bias,temperature", TRITON_CASES)
def test_triton_matches_plain_values_and_gradients(tk, n, t, hdim, vocab, bias, temperature):
    device = "cpu" if tk.interpreting() else "cuda"
    case = to_device(make_case(n, t, hdim, vocab, bias, seed=n * 10 + t), device)
    want = outputs_and_grads(plain(temperature), *case)
    got = outputs_and_grads(triton_fn(tk, temperature), *case)
    assert_all_close(got, want)


def test_triton_padding_ignored_labels_and_tied_weights(tk):
    device = "cpu" if tk.interpreting() else "cuda"
    head, h, y, g_logp, g_ent = to_device(make_case(n=2, t=9, hidden=16, vocab=70, bias=False,
                                                    seed=11), device)
    emb = torch.nn.Embedding(70, 16).to(device)
    head.weight = emb.weight  # tied: the hidden states come from the same weight
    ids = torch.arange(18, device=device).view(2, 9) % 70
    mask = torch.ones(2, 9, device=device)
    mask[1, :4] = 0
    y = torch.where(mask.bool(), y, torch.full_like(y, 3))
    y_ignored = y.clone()
    y_ignored[0, 0] = -100

    def run(fn, labels, g_lp):
        emb.weight.grad = None
        hidden = torch.tanh(emb(ids))
        logp, ent = fn(hidden, head, labels)
        (logp * g_lp * mask + ent * g_ent * mask).sum().backward()
        return logp.detach(), ent.detach(), emb.weight.grad.clone()

    g_kept = g_logp.clone()
    g_kept[0, 0] = 0.0
    want = run(plain(0.7), y, g_kept)
    got = run(triton_fn(tk, 0.7), y_ignored, g_logp)
    assert got[0][0, 0] == 0
    assert rel(got[0].flatten()[1:], want[0].flatten()[1:]) < TOL
    assert rel(got[1], want[1]) < TOL and rel(got[2], want[2]) < TOL
    assert all(torch.isfinite(x).all() for x in got)


def test_triton_bf16_inputs(tk):
    device = "cpu" if tk.interpreting() else "cuda"
    head, h, y, g_logp, g_ent = to_device(make_case(seed=12), device)
    head = head.bfloat16()
    hb = h.detach().bfloat16().requires_grad_(True)
    want = outputs_and_grads(plain(0.7), head, hb, y, g_logp, g_ent)
    got = outputs_and_grads(triton_fn(tk, 0.7), head, hb, y, g_logp, g_ent)
    # the logits are exact products of bf16 values summed in fp32: the forward agrees to fp32
    assert rel(got[0], want[0]) < TOL and rel(got[1], want[1]) < TOL
    # the backward's dots take d logits rounded to bf16 (as on the GPU's tensor cores)
    for a, b in zip(got[2:], want[2:]):
        assert a.dtype == torch.bfloat16 and rel(a.float(), b.float()) < 2e-2
    # bf16 hidden states with an fp32 (master) weight: the dots run in fp32
    head = head.float()
    want = outputs_and_grads(plain(0.7), head, hb, y, g_logp, g_ent)
    got = outputs_and_grads(triton_fn(tk, 0.7), head, hb, y, g_logp, g_ent)
    assert_all_close(got[:2], want[:2])
    assert_all_close(got[3:], want[3:])
    assert got[2].dtype == torch.bfloat16 and rel(got[2].float(), want[2].float()) < 1e-2


def test_triton_agrees_with_chunked_on_other_tiles(tk):
    device = "cpu" if tk.interpreting() else "cuda"
    case = to_device(make_case(n=2, t=20, hidden=40, vocab=150, seed=13), device)
    a = outputs_and_grads(triton_fn(tk, 1.3, blocks=(32, 64, 32)), *case)
    b = outputs_and_grads(chunked(1.3, 16, 50), *case)
    assert_all_close(a, b)


AOT_SCRIPT = r"""
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("tk", sys.argv[1])
tk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tk)
out = []
for dtype, blocks in (("bf16", tk.GPU_BLOCKS), ("fp32", tk.GPU_BLOCKS_FP32)):
    bn, bv, bk, warps, stages = blocks
    for fn, f32 in ((tk._forward_kernel, ("logp_ptr", "ent_ptr", "lse_ptr")),
                    (tk._backward_kernel, ("lse_ptr", "ent_ptr", "glogp_ptr", "gent_ptr",
                                           "gh_ptr", "gw_ptr", "gb_ptr"))):
        consts = dict(SCALE=True, HAS_BIAS=True, EVEN_K=True, BLOCK_N=bn, BLOCK_V=bv,
                      BLOCK_K=bk, DOT_FP32=dtype == "fp32", PRECISION="tf32", EMULATE=False)
        if fn is tk._backward_kernel:
            consts.update(NEED_H=True, NEED_W=True, NEED_B=True)
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = "*fp32" if name in f32 else "*i64" if name == "y_ptr" else "*" + dtype
            else:
                sig[name] = "fp32" if name == "temperature" else "i32"
        k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": stages})
        out.append({"kernel": fn.__name__, "dtype": dtype, "shared": k.metadata.shared,
                    "wgmma": "wgmma" in k.asm["ptx"]})
print(json.dumps(out))
"""


def test_triton_kernels_compile_for_hopper_without_a_gpu(tmp_path):
    # ahead-of-time compilation for sm_90 (H100/H200) with the ptxas Triton ships: catches
    # what the interpreter cannot (types, layouts, shared memory over Hopper's 227 KiB)
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    from rlmix_fused_logprobs import triton_kernels

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT, triton_kernels.__file__],
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("this Triton build has no ptxas")
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(kernels) == 4
    for k in kernels:
        assert k["shared"] <= 227 * 1024, k
        assert k["wgmma"] or k["dtype"] == "fp32", k  # bf16 dots reach Hopper's tensor cores


# ---------------------------------------------------------------- selection, settings, hooks


def test_auto_backend_is_chunked_on_cpu_and_plain_is_the_core_default():
    head, h, y, _, _ = make_case(seed=14)
    assert fl.resolve_backend("auto", h) == "chunked"
    assert fl.resolve_backend("triton", h) == "triton"
    lp, ent = token_logprobs(h, head, y, 0.7, Settings(backend="plain"))
    lp0, ent0 = plain_token_logprobs(h, head, y, 0.7)
    assert torch.equal(lp, lp0) and torch.equal(ent, ent0)


@pytest.mark.parametrize("kwargs,message", [
    ({"backend": "cuda"}, "backend"),
    ({"fp32_precision": "bf16"}, "fp32_precision"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"vocab_chunk_size": -1}, "vocab_chunk_size"),
    ({"block_n": 16, "block_v": 48, "block_k": 16}, "powers of two"),
    ({"block_n": 64}, "powers of two"),
])
def test_settings_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Settings(**kwargs)


def test_hook_reads_settings_and_sampling_temperature(monkeypatch):
    run = make_run({"fused_logprobs": fl}, ["sampling.temperature=0.6",
                                            "fused_logprobs.chunk_size=5",
                                            "fused_logprobs.vocab_chunk_size=40"])
    calls = []
    real = fl.chunked_token_logprobs

    def spy(*args):
        calls.append(args[4:])  # temperature, chunk_size, vocab_chunk_size
        return real(*args)

    monkeypatch.setattr(fl, "chunked_token_logprobs", spy)
    head, h, y, g_logp, g_ent = make_case(seed=15)
    hook = run.hook.rlmix_token_logprobs
    got = outputs_and_grads(lambda h, head, y: hook(run=run, hidden=h, lm_head=head, labels=y),
                            head, h, y, g_logp, g_ent)
    assert calls and calls[0] == (0.6, 5, 40)
    assert_all_close(got, outputs_and_grads(plain(0.6), head, h, y, g_logp, g_ent))


def test_configure_refuses_triton_backend_without_triton(monkeypatch):
    run = make_run({"fused_logprobs": fl}, ["fused_logprobs.backend=triton"])
    monkeypatch.setattr(fl, "triton_available", lambda: False)
    with pytest.raises(rlmix.ConfigError, match="pip install"):
        fl.rlmix_configure(run)


def test_policy_logprobs_on_the_tiny_model_match_the_default():
    overrides = ["sampling.temperature=0.7", "fused_logprobs.chunk_size=6"]
    batch = make_batch(n_groups=2, group_size=3, prompt_len=4, completion_len=6, vocab=200)
    results = []
    for plugins in ({}, {"fused_logprobs": fl}):
        run = make_run(plugins, overrides if plugins else overrides[:1], with_policy=True)
        model = run.policy.model
        model.zero_grad()
        logp, ent = run.policy.logprobs(run, batch)
        mask = batch.completion_mask
        ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((logp.detach(), ent.detach(), grad))
    for a, b in zip(results[1], results[0]):
        assert rel(a, b) < TOL


def test_three_training_steps_with_and_without_the_plugin(tmp_path):
    # a run whose loss depends on the log-probs: k1 KL to the reference (beta 0.5), one-digit
    # products so some rewards are non-zero, a learning rate that moves the weights
    for plugin in ("rlmix_hf", "rlmix_arith", "rlmix_grpo"):  # absent in `nox -s isolated`
        pytest.importorskip(plugin)
    from rlmix.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base = ["run", str(Path(rlmix.__file__).parents[2] / "examples" / "grpo-arith.yaml"),
            "model=tiny-random", "policy.autocast=none", "arith.eval_size=8", "train.steps=3",
            "log.progress=false", "arith.digits=1", "arith.operators=\"*\"", "grpo.beta=0.5",
            "grpo.kl_estimator=k1", "train.lr=1e-3", "grpo.loss_mode=token-mean"]
    try:
        assert main([*base, f"out={tmp_path / 'plain'}"]) == 0
        assert main([*base, f"out={tmp_path / 'fused'}", "plugins=[hf,arith,grpo,fused_logprobs]",
                     "fused_logprobs.chunk_size=7", "fused_logprobs.vocab_chunk_size=100"]) == 0
    finally:
        torch.set_num_threads(threads)
    hooks = (tmp_path / "fused" / "hooks.txt").read_text()
    assert re.search(r"rlmix_token_logprobs\s+owner: fused_logprobs", hooks), hooks

    def steps(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [m for m in map(json.loads, lines) if "loss" in m]

    plain_steps, fused_steps = steps("plain"), steps("fused")
    assert len(plain_steps) == len(fused_steps) == 3
    assert any(abs(m["loss"]) > 1e-3 for m in plain_steps)  # the comparison is not 0 == 0
    for a, b in zip(plain_steps, fused_steps):
        assert a["reward/mean"] == b["reward/mean"]  # the same sampled tokens
        assert a["response_length/mean"] == b["response_length/mean"]
        assert abs(a["loss"] - b["loss"]) < TOL
        assert abs(a["entropy"] - b["entropy"]) < TOL
        assert abs(a["update/grad_norm"] - b["update/grad_norm"]) < 1e-4 * a["update/grad_norm"]
