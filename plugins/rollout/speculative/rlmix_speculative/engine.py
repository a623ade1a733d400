"""Lossless speculative sampling for a batch of rows (draft, verify in one forward, accept).

The verify pass feeds every row ``[pending, d_1 .. d_k]`` (the last sampled token, not yet in the
KV cache, and ``k`` drafted tokens) through the policy at once. Rows accept different numbers of
drafts; instead of cropping the cache per row, the rejected columns stay in the cache as *holes*:
their attention-mask entries are set to 0, so no later query attends to them, and each row's
position ids count only its real tokens. Every row therefore sees exactly the (token, position)
sequence plain decoding would have fed it.

Acceptance (Leviathan et al. 2023, Chen et al. 2023): with ``p`` the policy's sampling
distribution (temperature, top-k, top-p applied by ``rlmix.sampling.filter_logits``, exactly as
plain sampling applies them) and ``q`` the drafter's (filtered the same way), draft ``d_i`` is
accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; the first rejected position is
resampled from ``max(0, p_i - q_i)`` normalised; when every draft is accepted a bonus token is
drawn from ``p_{k+1}``. A deterministic drafter has ``q = one-hot(d_i)``: acceptance is
``p_i(d_i)`` and the residual is ``p_i`` with ``d_i`` removed. A row with fewer than ``k``
drafts samples from plain ``p`` at the first position it has no draft for. Greedy (``temperature
== 0``): a draft is accepted when it equals the policy's argmax, and the first mismatch takes
the argmax.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlmix.sampling import filter_logits


@dataclass
class Draft:
    """``tokens [B, k]`` (padding past ``length``), ``length [B]`` drafts per row, and ``q``:
    the drafter's sampling probabilities ``[B, k, V]``, or ``None`` for a deterministic drafter
    (one-hot on ``tokens``)."""

    tokens: torch.Tensor
    length: torch.Tensor
    q: torch.Tensor | None = None


@dataclass
class SamplingParams:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class DraftContext:
    """What a drafter sees of the batch being generated. ``seqs[r]`` is row ``r``'s real tokens
    (prompt without padding, then every generated token; the last one is the pending token, not
    yet verified); ``prompt_len[r]`` is its prompt length; ``keys[r]`` identifies its prompt
    (previous-rollout drafting); ``member[r]`` is its index within the prompt's group."""

    seqs: list[list[int]]
    prompt_len: list[int]
    keys: list[str]
    member: list[int]
    live: list[bool]
    sampling: SamplingParams
    generator: torch.Generator | None = None


class Drafter(Protocol):
    wants_hidden: bool

    def begin(self, ctx: DraftContext) -> None: ...

    def observe(self, ctx: DraftContext, tokens: list[list[int]],
                hidden: list[torch.Tensor] | None) -> None: ...

    def propose(self, ctx: DraftContext, k: int) -> Draft: ...

    def end(self, ctx: DraftContext) -> None: ...


@dataclass
class SpecStats:
    """Counters of one generation call. ``mean_accepted_length`` is tokens emitted per verify
    pass per live row (1 = no draft ever accepted); ``acceptance`` is accepted drafts over draft
    slots offered (``k`` per live row and pass, so a row without a draft counts as rejected)."""

    k: int = 0
    passes: int = 0
    row_passes: int = 0
    tokens: int = 0
    proposed: int = 0
    slots: int = 0
    accepted: int = 0
    prefill_s: float = 0.0
    verify_s: float = 0.0
    draft_s: float = 0.0
    total_s: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.tokens / self.row_passes if self.row_passes else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.slots if self.slots else 0.0

    def as_metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/k": float(self.k),
                f"{prefix}/mean_accepted_length": self.mean_accepted_length,
                f"{prefix}/acceptance": self.acceptance,
                f"{prefix}/verify_s": self.verify_s, f"{prefix}/draft_s": self.draft_s,
                f"{prefix}/tokens_per_s": self.tokens / self.total_s if self.total_s else 0.0}


@dataclass
class SpecOutput:
    completion: torch.Tensor  # [B, L] long, pad after the end
    completion_mask: torch.Tensor  # [B, L] float
    logp: torch.Tensor  # [B, L] float: the policy's sampling log-prob of each token
    stats: SpecStats
    # per row: real tokens (prompt + fed completion tokens) and their final hidden states
    hidden: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)`` normalised per row; rows where it is all zero (``p == q``, where a
    rejection cannot happen) fall back to ``p``."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def verify_block(logits: torch.Tensor, draft: Draft, sampling: SamplingParams,
                 generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts and draw the next token.

    ``logits [B, k+1, V]``: the policy's logits after ``pending, d_1 .. d_k`` (position ``i``
    predicts ``d_{i+1}``; position ``k`` the bonus token). Returns ``(accepted [B], next [B],
    draft_logp [B, k], next_logp [B])``: how many drafts each row keeps, the token drawn after
    them (residual or bonus), and the policy's sampling log-probs of the drafts and of ``next``."""
    b, width, _ = logits.shape
    k = width - 1
    rows = torch.arange(b, device=logits.device)
    slot = torch.arange(k, device=logits.device)[None]
    has_slot = slot < draft.length[:, None]
    tokens = draft.tokens
    if sampling.temperature > 0:
        logp = torch.log_softmax(filter_logits(logits, sampling.temperature, sampling.top_p,
                                               sampling.top_k), -1)
        p = logp.exp()
        p_d = p[:, :k].gather(-1, tokens[..., None]).squeeze(-1)
        if draft.q is not None:
            q_d = draft.q.gather(-1, tokens[..., None]).squeeze(-1).clamp(min=1e-30)
            ratio = p_d / q_d
        else:
            ratio = p_d
        u = torch.rand(b, k, generator=generator, device=logits.device)
        ok = (u < ratio) & has_slot
        accepted = ok.long().cumprod(1).sum(1)
        p_at = p[rows, accepted]
        rejected = accepted < draft.length  # the draft at `accepted` exists and was rejected
        at = accepted.clamp(max=max(k - 1, 0))
        if k == 0:
            q_at = torch.zeros_like(p_at)
        elif draft.q is not None:
            q_at = draft.q[rows, at]
        else:
            q_at = torch.nn.functional.one_hot(tokens[rows, at], p.shape[-1]).to(p.dtype)
        q_at = q_at * rejected[:, None].to(p.dtype)
        dist = residual_distribution(p_at, q_at)
        nxt = torch.multinomial(dist, 1, generator=generator).squeeze(-1)
    else:
        logp = torch.log_softmax(logits.float(), -1)
        best = logp.argmax(-1)
        ok = (tokens == best[:, :k]) & has_slot
        accepted = ok.long().cumprod(1).sum(1)
        nxt = best[rows, accepted]
    draft_logp = logp[:, :k].gather(-1, tokens[..., None]).squeeze(-1) if k else \
        logp.new_zeros(b, 0)
    next_logp = logp[rows, accepted].gather(-1, nxt[:, None]).squeeze(-1)
    return accepted, nxt, draft_logp, next_logp


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _cache_arg(model: Any) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"


@torch.no_grad()
def speculative_sample(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       n: int, max_new_tokens: int, sampling: SamplingParams,
                       eos_ids: list[int], pad_id: int, drafter: Drafter | None = None,
                       k: int = 0, generator: torch.Generator | None = None,
                       autocast: Any = None, keys: list[str] | None = None,
                       collect_hidden: bool = False) -> SpecOutput:
    """Sample ``n`` completions per prompt row with speculative decoding (``k`` drafts per
    verify pass; ``k == 0`` or no drafter is plain decoding through the same code path).
    Rows are prompt-major, as in ``rlmix.sampling.sample_tokens``."""
    t_start = time.perf_counter()
    ctx_mgr = autocast if autocast is not None else contextlib.nullcontext()
    device = input_ids.device
    base = model.base_model
    head = model.get_output_embeddings()
    cache_arg = _cache_arg(base)
    if drafter is None:
        k = 0
    want_hidden = collect_hidden or (drafter is not None and drafter.wants_hidden)
    stats = SpecStats(k=k)

    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with ctx_mgr:
        out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                   use_cache=True)
    cache = _cache_of(out)
    hidden = out.last_hidden_state
    with ctx_mgr:
        logits = head(hidden[:, -1:]).float()
    n_prompts = input_ids.shape[0]
    real = attention_mask.bool()
    prompt_tokens = [input_ids[i][real[i]].tolist() for i in range(n_prompts)]
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, 0)
        attention_mask = attention_mask.repeat_interleave(n, 0)
        positions = positions.repeat_interleave(n, 0)
    rows = n_prompts * n
    keys = keys or [str(i) for i in range(n_prompts)]
    ctx = DraftContext(seqs=[list(prompt_tokens[r // n]) for r in range(rows)],
                       prompt_len=[len(prompt_tokens[r // n]) for r in range(rows)],
                       keys=[keys[r // n] for r in range(rows)],
                       member=[r % n for r in range(rows)], live=[True] * rows,
                       sampling=sampling, generator=generator)
    hid_rows: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    if want_hidden:
        prompt_hidden = [hidden[i][real[i]].float() for i in range(n_prompts)]
        for r in range(rows):
            hid_rows[r].append(prompt_hidden[r // n])
    if drafter is not None:
        drafter.begin(ctx)
        drafter.observe(ctx, [list(s) for s in ctx.seqs],
                        [h[0] for h in hid_rows] if want_hidden else None)
    stats.prefill_s = time.perf_counter() - t_start

    eos = set(eos_ids)
    gen_tok: list[list[int]] = [[] for _ in range(rows)]
    gen_lp: list[list[float]] = [[] for _ in range(rows)]
    live = [True] * rows

    def emit(r: int, toks: list[int], lps: list[float]) -> None:
        for t, lp in zip(toks, lps, strict=True):
            gen_tok[r].append(t)
            gen_lp[r].append(lp)
            ctx.seqs[r].append(t)
            if t in eos or len(gen_tok[r]) >= max_new_tokens:
                live[r] = False
                return

    # the first token comes from the prefill's logits (nothing to draft against yet)
    empty = Draft(tokens=torch.zeros(rows, 0, dtype=torch.long, device=device),
                  length=torch.zeros(rows, dtype=torch.long, device=device))
    _, nxt, _, nlp = verify_block(logits, empty, sampling, generator)
    stats.tokens += rows
    stats.row_passes += rows  # the prefill is the first pass (nothing drafted yet)
    for r, (t, lp) in enumerate(zip(nxt.tolist(), nlp.tolist(), strict=True)):
        emit(r, [t], [lp])
    pending = nxt
    next_pos = positions[:, -1] + 1
    arange_cache: dict[int, torch.Tensor] = {}

    while any(live) and max_new_tokens > 1:
        ctx.live = list(live)
        live_t = torch.tensor(live, device=device)
        kk = k
        if kk > 0:
            t0 = time.perf_counter()
            draft = drafter.propose(ctx, kk)  # type: ignore[union-attr]
            draft.tokens = draft.tokens.to(device)
            draft.length = draft.length.to(device) * live_t
            stats.draft_s += time.perf_counter() - t0
        else:
            draft = empty
        width = kk + 1
        if width not in arange_cache:
            arange_cache[width] = torch.arange(width, device=device)
        steps = arange_cache[width]
        inp = torch.cat([pending[:, None], draft.tokens], 1)
        inp = torch.where(live_t[:, None], inp, torch.full_like(inp, pad_id))
        attention_mask = torch.cat(
            [attention_mask, live_t[:, None].expand(rows, width).to(attention_mask.dtype)], 1)
        pos = next_pos[:, None] + steps[None]
        t0 = time.perf_counter()
        with ctx_mgr:
            out = base(input_ids=inp, attention_mask=attention_mask, position_ids=pos,
                       use_cache=True, **{cache_arg: cache})
            cache = _cache_of(out)
            hidden = out.last_hidden_state
            logits = head(hidden).float()
        accepted, nxt, dlp, nlp = verify_block(logits, draft, sampling, generator)
        stats.verify_s += time.perf_counter() - t0
        # rejected columns become holes: masked for every later query
        keep = (steps[None] <= accepted[:, None]) & live_t[:, None]
        attention_mask[:, -width:] = keep.to(attention_mask.dtype)
        next_pos = next_pos + 1 + accepted
        n_live = int(live_t.sum())
        stats.passes += 1
        stats.row_passes += n_live
        stats.slots += kk * n_live
        stats.proposed += int(draft.length.sum())
        acc_l, nxt_l = accepted.tolist(), nxt.tolist()
        dtok_l = draft.tokens.tolist()
        dlp_l, nlp_l = dlp.tolist(), nlp.tolist()
        fed_tokens: list[list[int]] = [[] for _ in range(rows)]
        fed_hidden: list[torch.Tensor] = []
        pend_l = pending.tolist()
        for r in range(rows):
            if not live[r]:
                if want_hidden:
                    fed_hidden.append(hidden.new_zeros(0, hidden.shape[-1]))
                continue
            a = acc_l[r]
            stats.accepted += a
            fed_tokens[r] = [pend_l[r], *dtok_l[r][:a]]
            if want_hidden:
                h = hidden[r, :1 + a].float()
                hid_rows[r].append(h)
                fed_hidden.append(h)
            before = len(gen_tok[r])
            emit(r, [*dtok_l[r][:a], nxt_l[r]], [*dlp_l[r][:a], nlp_l[r]])
            stats.tokens += len(gen_tok[r]) - before
        if drafter is not None:
            drafter.observe(ctx, fed_tokens, fed_hidden if want_hidden else None)
        pending = nxt

    ctx.live = list(live)
    if drafter is not None:
        drafter.end(ctx)
    length = max(len(t) for t in gen_tok)
    completion = torch.full((rows, length), pad_id, dtype=torch.long)
    cmask = torch.zeros(rows, length)
    logp = torch.zeros(rows, length)
    for r in range(rows):
        m = len(gen_tok[r])
        completion[r, :m] = torch.tensor(gen_tok[r], dtype=torch.long)
        cmask[r, :m] = 1.0
        logp[r, :m] = torch.tensor(gen_lp[r])
    result = SpecOutput(completion=completion.to(device), completion_mask=cmask.to(device),
                        logp=logp.to(device), stats=stats)
    if collect_hidden:
        for r in range(rows):
            # drafts fed after an EOS inside an accepted block were never emitted: drop them
            h = torch.cat(hid_rows[r], 0)[:len(ctx.seqs[r])]
            result.hidden.append((ctx.seqs[r][:h.shape[0]], h.cpu()))
    stats.total_s = time.perf_counter() - t_start
    return result
