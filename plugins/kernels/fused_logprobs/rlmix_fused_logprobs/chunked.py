"""Chunked token log-probs and entropies in plain torch, with a hand-written backward.

Only one ``[chunk, vocab_chunk]`` block of logits exists at a time, in the forward and in the
backward (which recomputes it). Per token the forward keeps three numbers: the log-partition
``lse``, the entropy ``ent`` and the label's log-prob ``logp``. With ``s = (h W^T + b) / tau``,
``p = softmax(s)``, ``logp_j = s_j - lse`` and upstream gradients ``g`` (of logp) and ``k`` (of
entropy), the gradient of the logits is

    d/dz_j = ( g [j == y] - p_j (g + k (logp_j + ent)) ) / tau

and the backward turns it into ``dh = dz W``, ``dW = dz^T h`` and ``db = sum_rows dz`` block by
block. This module imports only torch (no rlmix), so scripts can load it on their own.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, fp64 when any input is fp64 (gradcheck)."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def block_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                 temperature: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(h W^T + b) / temperature`` for one block, in the dtype of ``h`` (as the plain default:
    ``linear`` then a division, skipped at temperature 1), written into ``out`` if given."""
    if out is None:
        out = torch.empty(h.shape[0], w.shape[0], dtype=h.dtype, device=h.device)
    if b is None:
        torch.mm(h, w.t(), out=out)
    else:
        torch.addmm(b, h, w.t(), out=out)
    if temperature != 1.0:
        out.div_(temperature)
    return out


def block_stats(s: torch.Tensor, work: torch.Tensor | None = None) -> Stats:
    """Per row of one block of scaled logits: ``m = max s``, ``l = sum exp(s - m)`` and
    ``a = sum exp(s - m) (s - m)``. Overwrites ``s`` with ``s - m`` and ``work`` (a buffer of
    the same shape, allocated if not given) with ``exp(s - m)``."""
    m = s.amax(1)
    s.sub_(m[:, None])
    e = torch.exp(s, out=work) if work is not None else torch.exp(s)
    return m, e.sum(1), torch.bmm(e.unsqueeze(1), s.unsqueeze(2)).view(-1)


class Workspace:
    """Two flat buffers reused by every block of one call: fresh allocations of this size cost
    page faults on every block (on the CPU about as much as the exp itself)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> None:
        self.first = torch.empty(rows * cols, dtype=dtype, device=device)
        self.second = torch.empty(rows * cols, dtype=dtype, device=device)

    def blocks(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = rows * cols
        return self.first[:k].view(rows, cols), self.second[:k].view(rows, cols)


def merge_stats(x: Stats, y: Stats) -> Stats:
    """Combine the statistics of two disjoint vocabulary blocks (online log-sum-exp, with the
    entropy's ``a`` kept relative to the running maximum)."""
    m1, l1, a1 = x
    m2, l2, a2 = y
    m = torch.maximum(m1, m2)
    d1, d2 = m1 - m, m2 - m
    c1, c2 = torch.exp(d1), torch.exp(d2)
    return m, c1 * l1 + c2 * l2, c1 * (a1 + l1 * d1) + c2 * (a2 + l2 * d2)


def _spans(total: int, size: int) -> list[tuple[int, int]]:
    size = total if size <= 0 else size
    return [(i, min(i + size, total)) for i in range(0, total, size)]


def chunked_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    labels: torch.Tensor, temperature: float, chunk_size: int,
                    vocab_chunk_size: int = 0) -> tuple[torch.Tensor, ...]:
    """``(logp, entropy, lse)`` for ``hidden [N, H]``, ``labels [N]``; no autograd.

    Labels outside ``[0, V)`` (an ignore index such as -100) get ``logp = 0``."""
    dtype = compute_dtype(hidden, weight, bias)
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    logp = torch.empty(n, dtype=dtype, device=dev)
    ent = torch.empty_like(logp)
    lse = torch.empty_like(logp)
    vspans = _spans(vocab, vocab_chunk_size)
    work = Workspace(min(n, chunk_size), vspans[0][1], dtype, dev) if n else None
    for i0, i1 in _spans(n, chunk_size):
        assert work is not None
        h = hidden[i0:i1].to(dtype)
        y = labels[i0:i1]
        stats: Stats | None = None
        label_logit = torch.zeros(i1 - i0, dtype=dtype, device=dev)
        for v0, v1 in vspans:
            s, e = work.blocks(i1 - i0, v1 - v0)
            block_logits(h, w[v0:v1], None if b is None else b[v0:v1], temperature, out=s)
            block = block_stats(s, e)  # s is now s - m
            inside = (y >= v0) & (y < v1)
            picked = s.gather(1, (y - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(1)
            label_logit += torch.where(inside, picked + block[0], 0.0)
            stats = block if stats is None else merge_stats(stats, block)
        assert stats is not None
        m, total, a = stats
        log_l = torch.log(total)
        lse[i0:i1] = m + log_l
        ent[i0:i1] = log_l - a / total
        valid = (y >= 0) & (y < vocab)
        logp[i0:i1] = torch.where(valid, label_logit - lse[i0:i1], 0.0)
    return logp, ent, lse


def chunked_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     labels: torch.Tensor, temperature: float, chunk_size: int,
                     vocab_chunk_size: int, lse: torch.Tensor, ent: torch.Tensor,
                     grad_logp: torch.Tensor, grad_ent: torch.Tensor,
                     need: tuple[bool, bool, bool]) -> tuple[torch.Tensor | None, ...]:
    """Gradients ``(d hidden, d weight, d bias)`` (``None`` where ``need`` says so), each in
    the compute dtype; the logits are recomputed block by block."""
    need_h, need_w, need_b = need
    dtype = compute_dtype(hidden, weight, bias)
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    grad_h = torch.zeros(hidden.shape, dtype=dtype, device=dev) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=dtype, device=dev) if need_w else None
    grad_b = torch.zeros(vocab, dtype=dtype, device=dev) if need_b else None
    vspans = _spans(vocab, vocab_chunk_size)
    work = Workspace(min(n, chunk_size), vspans[0][1], dtype, dev) if n else None
    for i0, i1 in _spans(n, chunk_size):
        assert work is not None
        h = hidden[i0:i1].to(dtype)
        y = labels[i0:i1]
        valid = (y >= 0) & (y < vocab)
        g = torch.where(valid, grad_logp[i0:i1].to(dtype), 0.0)
        k = grad_ent[i0:i1].to(dtype)
        # d/dz = p * (c1 * logp + c0), plus g / tau at the label
        c1 = (-k / temperature)[:, None]
        c0 = (-(g + k * ent[i0:i1]) / temperature)[:, None]
        row_lse = lse[i0:i1, None]
        for v0, v1 in vspans:
            dz, p = work.blocks(i1 - i0, v1 - v0)
            block_logits(h, w[v0:v1], None if b is None else b[v0:v1], temperature, out=dz)
            dz.sub_(row_lse)  # log p
            torch.exp(dz, out=p)
            dz.mul_(c1).add_(c0).mul_(p)
            rows = (valid & (y >= v0) & (y < v1)).nonzero().squeeze(1)
            if len(rows):
                dz.index_put_((rows, y[rows] - v0), g[rows] / temperature, accumulate=True)
            if grad_h is not None:
                grad_h[i0:i1].addmm_(dz, w[v0:v1])
            if grad_w is not None:
                grad_w[v0:v1].addmm_(dz.t(), h)
            if grad_b is not None:
                grad_b[v0:v1] += dz.sum(0)
    return grad_h, grad_w, grad_b


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``(logp, entropy)`` of ``labels [N]`` under ``(hidden [N, H] @ weight^T + bias) / tau``,
    never holding more than one ``[chunk_size, vocab_chunk_size]`` block of logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, vocab_chunk_size):
        with torch.autocast(hidden.device.type, enabled=False):
            logp, ent, lse = chunked_forward(hidden, weight, bias, labels, temperature,
                                             chunk_size, vocab_chunk_size)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.config = (temperature, chunk_size, vocab_chunk_size)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        temperature, chunk_size, vocab_chunk_size = ctx.config
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2])
        with torch.autocast(hidden.device.type, enabled=False):
            gh, gw, gb = chunked_backward(hidden, weight, bias, labels, temperature, chunk_size,
                                          vocab_chunk_size, lse, ent, grad_logp, grad_ent, need)
        return (None if gh is None else gh.to(hidden.dtype),
                None if gw is None else gw.to(weight.dtype),
                None if gb is None else gb.to(bias.dtype), None, None, None, None)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None, labels: torch.Tensor,
                           temperature: float = 1.0, chunk_size: int = 1024,
                           vocab_chunk_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` shaped like ``labels``; ``hidden`` is ``[..., H]``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    shape = labels.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels.reshape(-1).long()
    logp, ent = ChunkedTokenLogprobs.apply(flat_h, weight, bias, flat_y, float(temperature),
                                           int(chunk_size), int(vocab_chunk_size))
    return logp.view(shape), ent.view(shape)
