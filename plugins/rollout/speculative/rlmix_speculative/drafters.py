"""The three drafters: ``suffix`` (SuffixDecoding), ``previous_rollout`` (SPEC-RL) and
``adaptive`` (TLT's online-trained one-layer drafter).

All implement the ``Drafter`` protocol of ``rlmix_speculative.engine``: ``begin`` at the start of
a generation call, ``observe`` after the prefill and every verify pass (the real tokens fed and,
for ``adaptive``, their final hidden states), ``propose`` before a verify pass, ``end`` when the
batch is done.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from rlmix.sampling import filter_logits
from rlmix_speculative.engine import Draft, DraftContext


def _pack(drafts: list[list[int]], k: int, pad: int = 0) -> Draft:
    tokens = torch.full((len(drafts), k), pad, dtype=torch.long)
    length = torch.zeros(len(drafts), dtype=torch.long)
    for r, d in enumerate(drafts):
        d = d[:k]
        if d:
            tokens[r, :len(d)] = torch.tensor(d, dtype=torch.long)
            length[r] = len(d)
    return Draft(tokens=tokens, length=length)


# ---------------------------------------------------------------- suffix


class NgramIndex:
    """Every n-gram (``1 <= n <= max_n``) of the stored sequences, mapped to its latest
    occurrence ``(sequence, end)``: a hashed stand-in for a suffix tree, answering "the longest
    suffix of this context seen before, and what followed it"."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.seqs: list[list[int]] = []
        self.table: dict[tuple[int, ...], tuple[int, int]] = {}

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.seqs)

    def add(self, seq: list[int]) -> int:
        sid = len(self.seqs)
        self.seqs.append(list(seq))
        self.extend(sid, 0)
        return sid

    def extend(self, sid: int, start: int) -> None:
        """Index the n-grams of ``seqs[sid]`` that end at positions ``>= start``."""
        seq = self.seqs[sid]
        for end in range(max(start, 1), len(seq) + 1):
            for n in range(1, min(self.max_n, end) + 1):
                self.table[tuple(seq[end - n:end])] = (sid, end)

    def match(self, context: list[int], need_continuation: bool = True
              ) -> tuple[int, list[int]]:
        """``(match_length, continuation)`` for the longest suffix of ``context`` present."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            hit = self.table.get(tuple(context[-n:]))
            if hit is None:
                continue
            sid, end = hit
            cont = self.seqs[sid][end:]
            if cont or not need_continuation:
                return n, cont
        return 0, []


class SuffixDrafter:
    """SuffixDecoding's reading: the longest suffix of the row's context that occurred in an
    earlier prompt or output (global index, kept across calls) or earlier in this batch (a live
    index of every row's prompt and tokens so far) proposes what followed it; the draft is
    ``min(k, ceil(spec_factor * match_length))`` tokens long, so a long match speculates further."""

    wants_hidden = False

    def __init__(self, max_match: int = 8, spec_factor: float = 1.0,
                 index_tokens: int = 200_000) -> None:
        self.max_match = max_match
        self.spec_factor = spec_factor
        self.index_tokens = index_tokens
        self.history: list[list[int]] = []  # earlier outputs (and prompts), checkpointed
        self.global_index = NgramIndex(max_match)
        self.live: NgramIndex | None = None
        self.live_ids: list[int] = []

    def state(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state(self, state: dict[str, Any]) -> None:
        self.history = [list(s) for s in state.get("history", [])]
        self._rebuild()

    def _rebuild(self) -> None:
        self.global_index = NgramIndex(self.max_match)
        for s in self.history:
            self.global_index.add(s)

    def remember(self, seq: list[int]) -> None:
        if not seq:
            return
        self.history.append(list(seq))
        self.global_index.add(seq)
        total = self.global_index.tokens
        if total > self.index_tokens:  # forget the oldest half
            while self.history and total > self.index_tokens // 2:
                total -= len(self.history.pop(0))
            self._rebuild()

    def begin(self, ctx: DraftContext) -> None:
        self.live = NgramIndex(self.max_match)
        self.live_ids = [self.live.add([]) for _ in ctx.seqs]

    def observe(self, ctx: DraftContext, tokens: list[list[int]],
                hidden: list[torch.Tensor] | None) -> None:
        assert self.live is not None
        for r, seq in enumerate(ctx.seqs):
            live_seq = self.live.seqs[self.live_ids[r]]
            start = len(live_seq)
            if len(seq) > start:
                live_seq.extend(seq[start:])
                self.live.extend(self.live_ids[r], start)

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        assert self.live is not None
        drafts = []
        for r, seq in enumerate(ctx.seqs):
            if not ctx.live[r]:
                drafts.append([])
                continue
            n_live, cont_live = self.live.match(seq)
            n_glob, cont_glob = self.global_index.match(seq)
            n, cont = (n_live, cont_live) if n_live >= n_glob else (n_glob, cont_glob)
            size = min(k, math.ceil(self.spec_factor * n)) if n else 0
            drafts.append(cont[:size])
        return _pack(drafts, k)

    def end(self, ctx: DraftContext) -> None:
        seen_prompts: set[str] = set()
        for r, seq in enumerate(ctx.seqs):
            if ctx.keys[r] not in seen_prompts:  # the prompt once per group, then the outputs
                seen_prompts.add(ctx.keys[r])
                self.remember(seq[:ctx.prompt_len[r]])
            self.remember(seq[ctx.prompt_len[r]:])
        self.live = None


# ---------------------------------------------------------------- previous rollout


class PreviousRolloutDrafter:
    """SPEC-RL's reading: the draft for a row is the last rollout of the same prompt (its id, or
    its text when the id is empty) by the same group member. While the row's tokens still equal
    that rollout's prefix the draft is the rollout's next ``k`` tokens; after they diverge, the
    row's last ``realign`` tokens (then fewer, down to one) are searched in the old rollout and
    drafting resumes after the latest match (the old answer's tail often reappears)."""

    wants_hidden = False

    def __init__(self, max_prompts: int = 10_000, realign: int = 3) -> None:
        self.max_prompts = max_prompts
        self.realign = realign
        self.store: OrderedDict[str, list[list[int]]] = OrderedDict()

    def state(self) -> dict[str, Any]:
        return {"store": dict(self.store)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.store = OrderedDict(state.get("store", {}))

    def begin(self, ctx: DraftContext) -> None:
        pass

    def observe(self, ctx: DraftContext, tokens: list[list[int]],
                hidden: list[torch.Tensor] | None) -> None:
        pass

    def _previous(self, ctx: DraftContext, r: int) -> list[int] | None:
        old = self.store.get(ctx.keys[r])
        if not old:
            return None
        return old[ctx.member[r] % len(old)]

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        drafts = []
        for r, seq in enumerate(ctx.seqs):
            prev = self._previous(ctx, r) if ctx.live[r] else None
            if not prev:
                drafts.append([])
                continue
            gen = seq[ctx.prompt_len[r]:]
            m = len(gen)
            if prev[:m] == gen:
                drafts.append(prev[m:m + k])
                continue
            found = -1
            for size in range(min(self.realign, m), 0, -1):  # longest tail first
                tail = gen[-size:]
                for start in range(len(prev) - size, -1, -1):
                    if prev[start:start + size] == tail:
                        found = start + size
                        break
                if found >= 0:
                    break
            drafts.append(prev[found:found + k] if found >= 0 else [])
        return _pack(drafts, k)

    def end(self, ctx: DraftContext) -> None:
        fresh: dict[str, list[list[int]]] = {}
        for r, seq in enumerate(ctx.seqs):
            fresh.setdefault(ctx.keys[r], []).append(seq[ctx.prompt_len[r]:])
        for key, outs in fresh.items():
            self.store[key] = outs
            self.store.move_to_end(key)
        while len(self.store) > self.max_prompts:
            self.store.popitem(last=False)


# ---------------------------------------------------------------- adaptive (TLT)


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


class DraftLayer(torch.nn.Module):
    """One pre-norm transformer layer over fused inputs ``fc([h_{t-1}; e(x_t)])``; its output
    is a stand-in for the policy's final hidden state ``h_t``, read out by the policy's LM head."""

    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.heads = heads
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.norm1 = RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm2 = RMSNorm(hidden)
        self.gate_up = torch.nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = torch.nn.Linear(intermediate, hidden, bias=False)
        self.norm_out = RMSNorm(hidden)

    def forward(self, h_prev: torch.Tensor, emb: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        """``h_prev, emb [B, L, H]``; ``allowed [B, L, L]`` bool (query, key)."""
        x = self.fc(torch.cat([h_prev, emb], -1))
        b, length, size = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, length, 3, self.heads, -1).unbind(2)
        att = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None])
        x = x + self.o(att.transpose(1, 2).reshape(b, length, size))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        x = x + self.down(torch.nn.functional.silu(gate) * up)
        return self.norm_out(x)


def window_mask(valid: torch.Tensor, window: int) -> torch.Tensor:
    """Causal attention within the last ``window`` positions, over ``valid`` keys; a query
    always sees itself. ``valid [B, L]`` -> ``[B, L, L]``."""
    length = valid.shape[1]
    i = torch.arange(length, device=valid.device)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    allowed = band[None] & valid[:, None, :].bool()
    return allowed | torch.eye(length, dtype=torch.bool, device=valid.device)[None]


class AdaptiveDrafter:
    """TLT's adaptive drafter: ``DraftLayer`` over the policy's last hidden state and the next
    token's embedding, sharing the policy's frozen embedding and LM head, trained online on the
    hidden states the rollouts computed (``train``), so it follows the policy as it changes."""

    wants_hidden = True

    def __init__(self, policy_model: Any, window: int = 16, heads: int = 0,
                 intermediate: int = 0, lr: float = 1e-3, buffer_rows: int = 256,
                 train_positions: int = 256, feature_weight: float = 0.1,
                 seed: int = 0) -> None:
        cfg = policy_model.config
        hidden = int(cfg.hidden_size)
        heads = heads or max(1, hidden // 64)
        while hidden % heads:
            heads -= 1
        intermediate = intermediate or 2 * hidden
        self.config = {"hidden": hidden, "heads": heads, "intermediate": intermediate,
                       "window": window, "vocab": int(cfg.vocab_size)}
        self.window = window
        self.attach(policy_model)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layer = DraftLayer(hidden, heads, intermediate)
        norm = getattr(getattr(policy_model, "base_model", None), "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            with torch.no_grad():  # start the read-out at the policy's own final-norm scale
                self.layer.norm_out.weight.copy_(norm.weight.detach().float())
        device = self.embed.weight.device
        self.layer.to(device)
        self.optimizer = torch.optim.AdamW(self.layer.parameters(), lr=lr, weight_decay=0.0)
        self.buffer: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.buffer_rows = buffer_rows
        self.train_positions = train_positions
        self.feature_weight = feature_weight
        self.generator = torch.Generator().manual_seed(seed)
        self.train_steps_done = 0
        # per-row window during generation
        self._h: torch.Tensor | None = None
        self._tok: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None
        self._last_h: torch.Tensor | None = None

    def attach(self, policy_model: Any) -> None:
        """Share (never train) the policy's embedding and LM head."""
        self.embed = policy_model.get_input_embeddings()
        self.head = policy_model.get_output_embeddings()
        if int(self.embed.weight.shape[1]) != self.config["hidden"]:
            raise ValueError("the drafter's hidden size does not match the policy's")

    # ---- persistence
    def state(self) -> dict[str, Any]:
        return {"config": dict(self.config), "layer": self.layer.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "train_steps_done": self.train_steps_done}

    def load_state(self, state: dict[str, Any]) -> None:
        mine = {k: v for k, v in self.config.items() if k != "window"}
        theirs = {k: v for k, v in state["config"].items() if k != "window"}
        if mine != theirs:
            raise ValueError(f"drafter shape {theirs} does not fit this policy ({mine})")
        self.layer.load_state_dict(state["layer"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.train_steps_done = int(state.get("train_steps_done", 0))

    # ---- drafting
    def _features(self, h_prev: torch.Tensor, tok: torch.Tensor,
                  valid: torch.Tensor) -> torch.Tensor:
        emb = self.embed(tok).to(h_prev.dtype)
        return self.layer(h_prev, emb, window_mask(valid, self.window))

    def begin(self, ctx: DraftContext) -> None:
        rows, size = len(ctx.seqs), self.config["hidden"]
        device = self.embed.weight.device
        self._h = torch.zeros(rows, self.window, size, device=device)
        self._tok = torch.zeros(rows, self.window, dtype=torch.long, device=device)
        self._valid = torch.zeros(rows, self.window, dtype=torch.bool, device=device)
        self._last_h = torch.zeros(rows, size, device=device)
        self._started = [False] * rows

    def observe(self, ctx: DraftContext, tokens: list[list[int]],
                hidden: list[torch.Tensor] | None) -> None:
        """Append pairs ``(h_{t-1}, x_t)`` of the fed tokens to each row's window."""
        assert hidden is not None and self._h is not None
        assert self._tok is not None and self._valid is not None and self._last_h is not None
        for r, toks in enumerate(tokens):
            if not toks:
                continue
            h = hidden[r].to(self._h.device, torch.float32)
            if not self._started[r]:  # the prompt: pairs start at its second token
                prev, toks_in = h[:-1], toks[1:]
                self._started[r] = True
            else:
                prev, toks_in = torch.cat([self._last_h[r:r + 1], h[:-1]], 0), toks
            m = len(toks_in)
            if m:
                m_keep = min(m, self.window)
                self._h[r] = torch.cat([self._h[r, m_keep:], prev[-m_keep:]], 0)
                self._tok[r] = torch.cat([self._tok[r, m_keep:], torch.tensor(
                    toks_in[-m_keep:], dtype=torch.long, device=self._h.device)], 0)
                self._valid[r] = torch.cat([self._valid[r, m_keep:], torch.ones(
                    m_keep, dtype=torch.bool, device=self._h.device)], 0)
            self._last_h[r] = h[-1]

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        assert self._h is not None and self._tok is not None and self._valid is not None
        assert self._last_h is not None
        rows = len(ctx.seqs)
        device = self._h.device
        pending = torch.tensor([s[-1] for s in ctx.seqs], dtype=torch.long, device=device)
        h_seq = torch.cat([self._h, self._last_h[:, None]], 1)
        tok_seq = torch.cat([self._tok, pending[:, None]], 1)
        valid = torch.cat([self._valid, torch.ones(rows, 1, dtype=torch.bool, device=device)],
                          1)
        s = ctx.sampling
        drafts, probs = [], []
        for _ in range(k):
            f = self._features(h_seq, tok_seq, valid)[:, -1]
            logits = self.head(f.to(self.head.weight.dtype)).float()
            if s.temperature > 0:
                q = torch.softmax(filter_logits(logits, s.temperature, s.top_p, s.top_k), -1)
                d = torch.multinomial(q, 1, generator=ctx.generator).squeeze(-1)
                probs.append(q)
            else:
                d = logits.argmax(-1)
            drafts.append(d)
            h_seq = torch.cat([h_seq, f[:, None].float()], 1)
            tok_seq = torch.cat([tok_seq, d[:, None]], 1)
            valid = torch.cat([valid, torch.ones(rows, 1, dtype=torch.bool, device=device)], 1)
        tokens = torch.stack(drafts, 1)
        q_all = torch.stack(probs, 1) if probs else None
        return Draft(tokens=tokens, length=torch.full((rows,), k, dtype=torch.long,
                                                      device=device), q=q_all)

    def end(self, ctx: DraftContext) -> None:
        self._h = self._tok = self._valid = self._last_h = None

    # ---- online training
    def add_rollouts(self, rows: list[tuple[list[int], torch.Tensor]]) -> None:
        """Keep ``(tokens, hidden)`` of the newest ``buffer_rows`` sequences."""
        for toks, h in rows:
            if len(toks) >= 2:
                self.buffer.append((torch.tensor(toks, dtype=torch.long), h.float().cpu()))
        del self.buffer[:-self.buffer_rows]

    def _training_batch(self) -> tuple[torch.Tensor, ...]:
        """Sampled positions ``t`` with their windows of pairs ``(h_{s-1}, x_s)``, ``s <= t``,
        and targets ``h_t``."""
        spans = [(i, t) for i, (toks, _) in enumerate(self.buffer)
                 for t in range(1, len(toks))]
        pick = torch.randperm(len(spans), generator=self.generator)[:self.train_positions]
        w, size = self.window, self.config["hidden"]
        count = len(pick)
        h_prev = torch.zeros(count, w, size)
        tok = torch.zeros(count, w, dtype=torch.long)
        valid = torch.zeros(count, w, dtype=torch.bool)
        target = torch.zeros(count, size)
        for j, idx in enumerate(pick.tolist()):
            i, t = spans[idx]
            toks, h = self.buffer[i]
            lo = max(1, t - w + 1)
            m = t - lo + 1
            h_prev[j, w - m:] = h[lo - 1:t]
            tok[j, w - m:] = toks[lo:t + 1]
            valid[j, w - m:] = True
            target[j] = h[t]
        return h_prev, tok, valid, target

    def train(self, steps: int) -> dict[str, float]:
        """``steps`` AdamW steps on KL(p || q) (p from the policy's head on ``h_t``, q from the
        drafter's feature) plus ``feature_weight`` * smooth-L1(feature, ``h_t``)."""
        if not self.buffer or steps <= 0:
            return {}
        device = self.embed.weight.device
        self.layer.train()
        kl_sum, top1_sum = 0.0, 0.0
        for _ in range(steps):
            h_prev, tok, valid, target = (x.to(device) for x in self._training_batch())
            with torch.no_grad():
                p_logp = torch.log_softmax(self.head(target.to(self.head.weight.dtype)).float(),
                                           -1)
            f = self._features(h_prev, tok, valid)[:, -1]
            q_logp = torch.log_softmax(self.head(f.to(self.head.weight.dtype)).float(), -1)
            kl = (p_logp.exp() * (p_logp - q_logp)).sum(-1).mean()
            feat = torch.nn.functional.smooth_l1_loss(f.float(), target)
            loss = kl + self.feature_weight * feat
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.layer.parameters(), 1.0)
            self.optimizer.step()
            kl_sum += float(kl.detach())
            top1_sum += float((q_logp.argmax(-1) == p_logp.argmax(-1)).float().mean())
            self.train_steps_done += 1
        self.layer.eval()
        # the head's weight must never receive a gradient step (it is the policy's)
        return {"drafter/kl": kl_sum / steps, "drafter/top1": top1_sum / steps}


def save_drafter(drafter: AdaptiveDrafter, path: str | Path) -> Path:
    """Write the drafter's own weights and shape (not the shared embedding or head) to
    ``path`` atomically, for deployment next to its policy."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        torch.save({"format": "rlmix-speculative-drafter/1", "config": drafter.config,
                    "layer": drafter.layer.state_dict(),
                    "train_steps_done": drafter.train_steps_done}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load_drafter(path: str | Path, policy: Any) -> AdaptiveDrafter:
    """A drafter saved by ``save_drafter``, attached to ``policy`` (a ``rlmix.policy.Policy`` or
    a transformers causal LM) whose embedding and LM head it shares."""
    model = getattr(policy, "model", policy)
    data = torch.load(path, map_location="cpu", weights_only=False)
    if data.get("format") != "rlmix-speculative-drafter/1":
        raise ValueError(f"{path} is not a drafter saved by rlmix_speculative.save_drafter")
    cfg = data["config"]
    drafter = AdaptiveDrafter(model, window=int(cfg["window"]), heads=int(cfg["heads"]),
                              intermediate=int(cfg["intermediate"]))
    drafter.load_state({"config": cfg, "layer": data["layer"],
                        "train_steps_done": data.get("train_steps_done", 0)})
    return drafter
