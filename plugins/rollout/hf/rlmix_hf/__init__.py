"""Batched sampling with transformers (KV cache, left padding, temperature/top-p/top-k).

Prompts are prefilled once per distinct prompt and the KV cache is repeated for the group, so a
group of 8 completions costs one prompt forward, not eight.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.types import GenerationRequest, RolloutBatch, Run


@dataclass
class Settings:
    batch_size: int = 0  # prompts per generation call; 0 = all at once
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 0:
            raise ValueError("batch_size must be >= 0")


def filter_logits(logits: torch.Tensor, temperature: float, top_p: float,
                  top_k: int) -> torch.Tensor:
    """The sampling distribution's logits: temperature, then top-k, then top-p (nucleus);
    excluded tokens get -inf."""
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def encode_prompts(run: Run, prompts: list[rlmix.Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    assert run.policy is not None
    tok = run.policy.tokenizer
    texts = [run.policy.chat_text(p.messages) for p in prompts]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def cache_argument(model: Any) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.x); take whichever it has."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def sample_tokens(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int,
                  max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                  eos_ids: list[int], pad_id: int, generator: torch.Generator | None = None,
                  autocast: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample ``n`` completions per prompt row. Returns ``(completion [P*n, L],
    completion_mask [P*n, L], logp [P*n, L])``; rows are prompt-major. ``temperature == 0``
    is greedy (``logp`` then is the log-prob under the unscaled distribution)."""
    import contextlib

    ctx = autocast if autocast is not None else contextlib.nullcontext()
    device = input_ids.device
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with ctx:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                    use_cache=True)
    cache_arg = cache_argument(model)
    cache = _cache_of(out)
    logits = out.logits[:, -1, :]
    if n > 1:  # one prefill per distinct prompt, then the cache is shared by the group
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, 0)
        attention_mask = attention_mask.repeat_interleave(n, 0)
        positions = positions.repeat_interleave(n, 0)
    rows = logits.shape[0]
    next_pos = positions[:, -1:] + 1
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    eos = torch.tensor(eos_ids, device=device)
    tokens, logps, masks = [], [], []
    for _ in range(max_new_tokens):
        if temperature > 0:
            scores = filter_logits(logits, temperature, top_p, top_k)
            logprobs = torch.log_softmax(scores, -1)
            choice = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
        else:
            logprobs = torch.log_softmax(logits.float(), -1)
            choice = logprobs.argmax(-1)
        live = ~done
        tok = torch.where(live, choice, torch.full_like(choice, pad_id))
        tokens.append(tok)
        logps.append(torch.where(live, logprobs.gather(-1, choice[:, None]).squeeze(-1),
                                 torch.zeros_like(choice, dtype=torch.float)))
        masks.append(live.float())
        done = done | torch.isin(choice, eos)
        if bool(done.all()):
            break
        attention_mask = torch.cat([attention_mask, live[:, None].to(attention_mask.dtype)], 1)
        with ctx:
            out = model(input_ids=tok[:, None], attention_mask=attention_mask,
                        position_ids=next_pos, use_cache=True, **{cache_arg: cache})
        cache = _cache_of(out)
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    return torch.stack(tokens, 1), torch.stack(masks, 1), torch.stack(logps, 1)


def stop_token_ids(policy: Any) -> list[int]:
    """The tokenizer's EOS plus any the model's generation config names."""
    ids = {policy.tokenizer.eos_token_id}
    configured = getattr(policy.model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return sorted(i for i in ids if i is not None)


@rlmix.hookimpl
def rlmix_generate(run: Run, request: GenerationRequest) -> RolloutBatch:
    assert run.policy is not None
    settings = run.settings("hf")
    policy = run.policy
    tok = policy.tokenizer
    eos_ids = stop_token_ids(policy) if settings.stop_at_eos else [-1]
    step = settings.batch_size or len(request.prompts)
    parts = []
    for start in range(0, len(request.prompts), step):
        chunk = request.prompts[start:start + step]
        ids, attn = encode_prompts(run, chunk)
        ids, attn = ids.to(policy.device), attn.to(policy.device)
        completion, cmask, logp = sample_tokens(
            policy.model, ids, attn, request.n, request.max_new_tokens, request.temperature,
            request.top_p, request.top_k, eos_ids, tok.pad_token_id, autocast=policy.autocast())
        prompt_ids = ids.repeat_interleave(request.n, 0)
        prompt_attn = attn.repeat_interleave(request.n, 0)
        width = prompt_ids.shape[1]
        tokens = torch.cat([prompt_ids, completion], 1).cpu()
        texts = tok.batch_decode(completion.masked_fill(cmask == 0, tok.pad_token_id).cpu(),
                                 skip_special_tokens=True)
        rows = len(chunk) * request.n
        parts.append(RolloutBatch(
            group=torch.arange(len(chunk)).repeat_interleave(request.n),
            tokens=tokens,
            attention_mask=torch.cat([prompt_attn, cmask.long()], 1).cpu(),
            completion_mask=torch.cat([torch.zeros_like(prompt_attn, dtype=torch.float),
                                       cmask], 1).cpu(),
            behavior_logp=torch.cat([torch.zeros(rows, width), logp.cpu()], 1),
            policy_version=torch.full((rows,), run.policy_version, dtype=torch.long),
            texts=texts,
            prompts=[p for p in chunk for _ in range(request.n)],
        ))
    return parts[0] if len(parts) == 1 else RolloutBatch.concat(parts, tok.pad_token_id)
