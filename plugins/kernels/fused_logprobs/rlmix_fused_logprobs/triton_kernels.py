"""Triton kernels: token log-probs and entropies over vocabulary tiles, with an online
log-sum-exp, and a backward that recomputes each logits tile.

Forward, one program per block of ``BLOCK_N`` tokens: it walks the vocabulary in tiles of
``BLOCK_V``; each tile's logits ``[BLOCK_N, BLOCK_V]`` are built in registers by ``tl.dot`` over
``BLOCK_K`` slices of the hidden size, scaled by ``1 / temperature``, and folded into three
running statistics per token: the maximum ``m``, ``l = sum exp(s - m)`` and
``a = sum exp(s - m) (s - m)`` (rescaled when ``m`` grows), plus the label's logit. At the end
``lse = m + log l``, ``entropy = log l - a / l``, ``logp = s_y - lse``. Nothing of size V is
written.

Backward, one program per (token block, vocabulary tile): it recomputes the tile's logits,
forms ``dz = (g [j == y] - p (g + k (logp + entropy))) / temperature`` from the saved ``lse``
and ``entropy`` and the upstream gradients ``g`` (log-probs) and ``k`` (entropies), and adds
``dz W_tile`` into ``d hidden`` and ``dz^T h_block`` into ``d W`` with fp32 atomics (as the
Cut Cross-Entropy kernels do), ``BLOCK_K`` columns at a time.

This module imports only torch and triton (no rlmix), so GPU scripts can load it on their own.
``TRITON_INTERPRET=1`` must be set before it is imported for the kernels to run on CPU tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

#: (BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages) on a GPU, for 16-bit inputs and for fp32
#: dots (half the K slice: fp32 tiles take twice the shared memory; with BLOCK_K 64 the tf32
#: backward would need 240 KiB, over Hopper's 227); overridable per call. A test compiles both
#: for sm_90 without a GPU (shared memory fits, bf16 dots become wgmma); untuned: the timings
#: and any better tiles are for gpu/kernels.sh --sweep on the GPU.
GPU_BLOCKS = (64, 128, 64, 8, 3)
GPU_BLOCKS_FP32 = (64, 128, 32, 8, 3)
#: small tiles for the CPU interpreter (tl.dot needs every side >= 16)
INTERPRET_BLOCKS = (16, 32, 16, 1, 1)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # Triton before 3.4 had no knobs
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """``a @ b + acc`` with fp32 accumulation. ``DOT_FP32``: both operands in fp32 (``PRECISION``
    ieee or tf32). Else both are the same 16-bit type and go to the tensor cores as they are;
    ``EMULATE`` (the CPU interpreter, whose numpy matmul cannot take bf16) upcasts them first,
    which gives the same products (a product of two 16-bit floats is exact in fp32)."""
    if DOT_FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    elif EMULATE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, col_ok, H, stride_h, stride_w, temperature,
                 SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """``(h[rows] W[cols]^T + b[cols]) / temperature`` as fp32 ``[BLOCK_N, BLOCK_V]``.

    ``rows`` and ``cols`` are already clamped into range (the padding rows and columns repeat
    the last real one, so the loads need no row or column mask; callers drop them)."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * stride_h + offs_k[None, :]
    w_ptrs = w_ptr + cols[:, None] * stride_w + offs_k[None, :]
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            hb = tl.load(h_ptrs)
            wb = tl.load(w_ptrs)
        else:
            k_ok = (k0 + offs_k) < H
            hb = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            wb = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        acc = _dot(hb, tl.trans(wb), acc, DOT_FP32, PRECISION, EMULATE)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    if SCALE:
        acc = acc / temperature
    return acc


@triton.jit
def _forward_kernel(h_ptr, w_ptr, b_ptr, y_ptr, logp_ptr, ent_ptr, lse_ptr, N, V, H,
                    stride_h, stride_w, temperature, SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
                    EMULATE: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    rows_in = tl.minimum(rows, N - 1)
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    # a finite start for m keeps l * (m - m_new) at 0 (not 0 * -inf) on the first tile
    m = tl.full([BLOCK_N], -1.0e30, dtype=tl.float32)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    a = tl.zeros([BLOCK_N], dtype=tl.float32)
    label_logit = tl.zeros([BLOCK_N], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_ok = cols < V
        s = _logits_tile(h_ptr, w_ptr, b_ptr, rows_in, tl.minimum(cols, V - 1), col_ok, H,
                         stride_h, stride_w, temperature, SCALE, HAS_BIAS, EVEN_K, BLOCK_N,
                         BLOCK_V, BLOCK_K, DOT_FP32, PRECISION, EMULATE)
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        delta = m - m_new
        alpha = tl.exp(delta)
        shifted = s - m_new[:, None]
        e = tl.exp(shifted)  # 0 on the padding columns
        a = alpha * (a + total * delta) + tl.sum(e * tl.where(col_ok[None, :], shifted, 0.0), 1)
        total = alpha * total + tl.sum(e, 1)
        m = m_new
        label_logit += tl.sum(tl.where(cols[None, :] == y[:, None], s, 0.0), 1)
    log_l = tl.log(total)
    lse = m + log_l
    valid = (y >= 0) & (y < V)
    tl.store(logp_ptr + rows, tl.where(valid, label_logit - lse, 0.0), mask=row_ok)
    tl.store(ent_ptr + rows, log_l - a / total, mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)


@triton.jit
def _backward_kernel(h_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr,
                     gh_ptr, gw_ptr, gb_ptr, N, V, H, stride_h, stride_w, temperature,
                     SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     NEED_H: tl.constexpr,
                     NEED_W: tl.constexpr, NEED_B: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                     PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    cols = (pid_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    col_ok = cols < V
    rows_in = tl.minimum(rows, N - 1)
    cols_in = tl.minimum(cols, V - 1)
    s = _logits_tile(h_ptr, w_ptr, b_ptr, rows_in, cols_in, col_ok, H, stride_h, stride_w,
                     temperature, SCALE, HAS_BIAS, EVEN_K, BLOCK_N, BLOCK_V, BLOCK_K,
                     DOT_FP32, PRECISION, EMULATE)
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(glogp_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    k = tl.load(gent_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    g = tl.where((y >= 0) & (y < V), g, 0.0)
    logp = s - lse[:, None]
    p = tl.exp(logp)
    dz = tl.where(cols[None, :] == y[:, None], g[:, None], 0.0)
    dz -= p * (g[:, None] + k[:, None] * (logp + ent[:, None]))
    if SCALE:
        dz = dz / temperature
    dz = tl.where(row_ok[:, None] & col_ok[None, :], dz, 0.0)
    if NEED_B:
        tl.atomic_add(gb_ptr + cols, tl.sum(dz, 0), mask=col_ok)
    if DOT_FP32:
        dz_dot = dz
    else:
        dz_dot = dz.to(w_ptr.dtype.element_ty)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols_in[:, None] * stride_w + offs_k[None, :]
    h_ptrs = h_ptr + rows_in[:, None] * stride_h + offs_k[None, :]
    gh_ptrs = gh_ptr + rows_in[:, None] * H + offs_k[None, :]
    gw_ptrs = gw_ptr + cols_in[:, None] * H + offs_k[None, :]
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + offs_k) < H
        if NEED_H:
            if EVEN_K:
                wb = tl.load(w_ptrs)
            else:
                wb = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            part = _dot(dz_dot, wb, tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32), DOT_FP32,
                        PRECISION, EMULATE)
            tl.atomic_add(gh_ptrs, part, mask=row_ok[:, None] & k_ok[None, :])
        if NEED_W:
            if EVEN_K:
                hb = tl.load(h_ptrs)
            else:
                hb = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            part_w = _dot(tl.trans(dz_dot), hb, tl.zeros([BLOCK_V, BLOCK_K], dtype=tl.float32),
                          DOT_FP32, PRECISION, EMULATE)
            tl.atomic_add(gw_ptrs, part_w, mask=col_ok[:, None] & k_ok[None, :])
        w_ptrs += BLOCK_K
        h_ptrs += BLOCK_K
        gh_ptrs += BLOCK_K
        gw_ptrs += BLOCK_K


def _launch_config(blocks: tuple[int, ...] | None,
                   dot_fp32: bool) -> tuple[int, int, int, int, int]:
    default = INTERPRET_BLOCKS if interpreting() else GPU_BLOCKS_FP32 if dot_fp32 else GPU_BLOCKS
    if blocks:
        b = tuple(int(x) for x in blocks)
        if len(b) == 3:
            b = (*b, default[3], default[4])
        if len(b) != 5 or any(x < 16 or x & (x - 1) for x in b[:3]):
            raise ValueError(f"blocks {blocks}: (BLOCK_N, BLOCK_V, BLOCK_K[, warps, stages]) "
                             "with powers of two >= 16")
        return b  # type: ignore[return-value]
    return default


def _dot_mode(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """True: the dots run in fp32 (inputs upcast in registers). False: both inputs are the same
    16-bit type and the dots take them as they are, accumulating in fp32."""
    low = (torch.bfloat16, torch.float16)
    return not (hidden.dtype == weight.dtype and hidden.dtype in low)


class TritonTokenLogprobs(torch.autograd.Function):
    """``(logp, entropy)`` of ``labels [N]`` under ``(hidden [N, H] @ weight^T + bias) / tau``
    with the Triton kernels above; saves only ``lse`` and the entropy per token."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, blocks, precision):
        hidden = hidden.contiguous()
        weight = weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        labels = labels.contiguous()
        n, hdim = hidden.shape
        vocab = weight.shape[0]
        dot_fp32 = _dot_mode(hidden, weight)
        bn, bv, bk, warps, stages = _launch_config(blocks, dot_fp32)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        if n:
            _forward_kernel[(triton.cdiv(n, bn),)](
                hidden, weight, logp if bias is None else bias, labels, logp, ent, lse,
                n, vocab, hdim, hidden.stride(0), weight.stride(0), float(temperature),
                SCALE=temperature != 1.0, HAS_BIAS=bias is not None, EVEN_K=hdim % bk == 0,
                BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, DOT_FP32=dot_fp32, PRECISION=precision,
                EMULATE=interpreting(), num_warps=warps, num_stages=stages)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.config = (temperature, (bn, bv, bk, warps, stages), precision, dot_fp32)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        temperature, (bn, bv, bk, warps, stages), precision, dot_fp32 = ctx.config
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        n, hdim = hidden.shape
        vocab = weight.shape[0]
        dev = hidden.device
        f32 = torch.float32
        gh = torch.zeros(n, hdim, dtype=f32, device=dev) if need_h else None
        gw = torch.zeros(vocab, hdim, dtype=f32, device=dev) if need_w else None
        gb = torch.zeros(vocab, dtype=f32, device=dev) if need_b else None
        if n and (need_h or need_w or need_b):
            dummy = lse
            _backward_kernel[(triton.cdiv(n, bn), triton.cdiv(vocab, bv))](
                hidden, weight, dummy if bias is None else bias, labels, lse, ent,
                grad_logp.contiguous(), grad_ent.contiguous(), dummy if gh is None else gh,
                dummy if gw is None else gw, dummy if gb is None else gb, n, vocab, hdim,
                hidden.stride(0), weight.stride(0), float(temperature),
                SCALE=temperature != 1.0, HAS_BIAS=bias is not None, EVEN_K=hdim % bk == 0,
                NEED_H=need_h,
                NEED_W=need_w, NEED_B=need_b, BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk,
                DOT_FP32=dot_fp32, PRECISION=precision, EMULATE=interpreting(),
                num_warps=warps, num_stages=stages)
        return (None if gh is None else gh.to(hidden.dtype),
                None if gw is None else gw.to(weight.dtype),
                None if gb is None else gb.to(bias.dtype), None, None, None, None)


def triton_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None, labels: torch.Tensor,
                          temperature: float = 1.0, blocks: tuple[int, ...] | None = None,
                          precision: str = "ieee") -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` shaped like ``labels``, fp32; ``hidden`` is ``[..., H]``.

    ``blocks`` = ``(BLOCK_N, BLOCK_V, BLOCK_K[, num_warps, num_stages])`` (powers of two,
    each >= 16); ``precision`` is Triton's ``input_precision`` for fp32 dots (``ieee`` exact,
    ``tf32`` faster on tensor cores)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not hidden.is_cuda and not interpreting():
        raise RuntimeError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set "
                           "before triton is imported, to run them on the CPU)")
    shape = labels.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels.reshape(-1).long()
    with torch.autocast(hidden.device.type, enabled=False):
        logp, ent = TritonTokenLogprobs.apply(flat_h, weight, bias, flat_y, float(temperature),
                                              None if blocks is None else tuple(blocks),
                                              precision)
    return logp.view(shape), ent.view(shape)
