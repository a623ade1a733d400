"""Helpers for rollout-allocation plugins (``rlmix_sample`` wrappers and owners): prompt
identity, plain generation through ``rlmix_generate`` with the manifest's sampling settings,
scoring a candidate batch, regrouping rows by prompt, per-group outcomes, and the rollout counter
kept in ``run.state`` (so claims "at equal rollout budget" can be checked)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlmix.errors import ConfigError
from rlmix.types import GenerationRequest, Prompt, RolloutBatch, Run


def prompt_key(prompt: Prompt, key: str = "text") -> str:
    """A prompt's identity: its chat text (``key="text"``) or ``Prompt.id`` (falls back to the
    text when the prompt has no id)."""
    if key == "id" and prompt.id:
        return f"id:{prompt.id}"
    return "text:" + "\n".join(f"{m.get('role', '')}: {m.get('content', '')}"
                               for m in prompt.messages)


def generate(run: Run, prompts: list[Prompt], n: int,
             temperature: float | None = None) -> RolloutBatch:
    """``n`` completions per prompt through ``rlmix_generate`` with the manifest's sampling
    settings (``temperature`` overrides the manifest's); rows prompt-major, ``prompts`` filled."""
    smp = run.config.sampling
    request = GenerationRequest(
        prompts=list(prompts), n=n,
        temperature=float(smp.temperature if temperature is None else temperature),
        top_p=float(smp.top_p), top_k=int(smp.top_k), max_new_tokens=int(smp.max_new_tokens))
    batch = run.hook.rlmix_generate(run=run, request=request)
    if batch is None:
        raise RuntimeError("no plugin returned a batch from rlmix_generate")
    if not batch.prompts:
        batch.prompts = [p for p in prompts for _ in range(n)]
    return batch


def score(run: Run, batch: RolloutBatch) -> torch.Tensor:
    """The core's weighted reward of every row (the core scores the final batch again later;
    scorers are pure, so this is safe)."""
    from rlmix.loop import score as core_score

    core_score(run, batch)
    assert batch.rewards is not None
    return batch.rewards


def pad_id(run: Run) -> int:
    tok = run.tokenizer
    pad = getattr(tok, "pad_token_id", None) if tok is not None else None
    return int(pad) if pad is not None else 0


def regroup(parts: list[RolloutBatch], keys: list[str], pad: int = 0) -> RolloutBatch:
    """Concatenate ``parts`` and renumber ``group`` so that rows with the same key (one per row,
    in concatenation order) form one group; groups are contiguous, in first-seen order."""
    batch = RolloutBatch.concat(parts, pad) if len(parts) > 1 else parts[0]
    if len(keys) != len(batch):
        raise ValueError(f"regroup: {len(keys)} keys for {len(batch)} rows")
    ids = {k: g for g, k in enumerate(dict.fromkeys(keys))}
    group = torch.tensor([ids[k] for k in keys], dtype=torch.long)
    order = torch.argsort(group, stable=True)
    out = batch.select(order)
    out.group = group[order]
    return out


def count_rollouts(run: Run, name: str, n: int) -> None:
    """Add ``n`` generated completions to ``run.state[name]["rollouts"]`` (checkpointed)."""
    state = run.state.setdefault(name, {})
    state["rollouts"] = int(state.get("rollouts", 0)) + int(n)


def group_outcomes(success: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """``(successes, counts)`` per group, ``[G]`` each."""
    g = int(group.max()) + 1 if len(group) else 0
    counts = torch.zeros(g, dtype=torch.long).index_add_(0, group, torch.ones_like(group))
    wins = torch.zeros(g, dtype=torch.long).index_add_(0, group, success.long())
    return wins, counts


def require_whole_selection(name: str, chosen: list[Prompt], sampled: list[Prompt]) -> None:
    """Refuse a run where a plugin later in ``rlmix_select_prompts`` (a data-parallel trainer's
    per-rank share) cut the prompts the allocation plugin ``name`` chose: its budget and
    per-prompt state would each see only part of the step."""
    if [id(p) for p in chosen] != [id(p) for p in sampled]:
        raise ConfigError(
            f"plugin '{name}' chose {len(chosen)} prompts but the owner sampled "
            f"{len(sampled)} others: a plugin after it in rlmix_select_prompts changed them "
            f"(a data-parallel trainer's per-rank share: deepspeed with shard: true on several "
            f"ranks). {name} needs its whole selection sampled in one process: run one process, "
            f"or set deepspeed.shard: false")


def allocate_by_gain(gain: Callable[[int, int], float], m: int, budget: int,
                     chunk: int) -> list[int]:
    """Extra rollouts for ``m`` prompts: ``budget`` is handed out ``chunk`` at a time (the last
    one smaller), each to the prompt with the highest ``gain(i, extra_i)`` given what it has
    been handed so far (ties to the one handed the fewest, then the lower index, so equal gains
    share round-robin). The budget is always spent, even when every gain is 0."""
    extra = [0] * m
    left = budget
    while left > 0 and m > 0:
        c = min(chunk, left)
        gains = [gain(i, extra[i]) for i in range(m)]
        best = max(range(m), key=lambda i: (gains[i], -extra[i], -i))
        extra[best] += c
        left -= c
    return extra


def draw_tokens(scores: torch.Tensor, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``softmax(scores)`` (``[rows, V]``, already temperature-scaled and
    filtered, excluded tokens at ``-inf``), and its log-prob under that distribution.

    Inverse-CDF sampling: one uniform number per row against the cumulative distribution (in
    float64, so the summation error over a 50k vocabulary stays ~1e-13). The same distribution
    as ``torch.multinomial``, at about half its cost on a CPU, where multinomial draws an
    exponential variate per vocabulary entry."""
    lse = torch.logsumexp(scores, -1, keepdim=True)
    cdf = (scores - lse).exp().double().cumsum(-1)
    u = torch.rand(scores.shape[0], 1, generator=generator, dtype=torch.float64,
                   device=scores.device) * cdf[:, -1:]
    # the first index whose cumulative mass exceeds u: zero-probability tokens never qualify
    choice = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=scores.shape[-1] - 1)
    return choice, (scores.gather(-1, choice[:, None]) - lse).squeeze(-1)


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


# ---------------------------------------------------------------- a KV-cached sampling loop
# shared by rollout engines and plugins that sample from the policy (hf, speculative, agent_prm)


def encode_prompts(run: Run, prompts: list[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' chat texts (with their ``tools``, if any), tokenised as one left-padded
    batch: ``(ids, attention_mask)``."""
    assert run.policy is not None
    tok = run.policy.tokenizer
    texts = [run.policy.chat_text(p.messages, getattr(p, "tools", None)) for p in prompts]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


#: ``Prompt.info`` key: token ids a completion is to start with (a continuation from a prefix, as
#: a step-level credit method's probe asks). An engine that honours it returns them as the first
#: tokens of the completion (in ``completion_mask``, with their behaviour log-probs, in the
#: decoded text) and samples the rest within what is left of ``max_new_tokens``.
CONTINUE_FROM = "continue_from"


def continuation_prefix(prompt: Prompt) -> list[int]:
    """The token ids ``prompt`` asks its completion to start with (``[]``: none)."""
    return [int(t) for t in (prompt.info.get(CONTINUE_FROM) or [])]


def continuation_inputs(run: Run, prompts: list[Prompt]
                        ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``encode_prompts`` with each prompt's ``continuation_prefix`` appended to its chat text
    before the left padding: ``(ids, attention_mask, given)``, ``given[i]`` the number of
    prefix tokens that end row ``i``."""
    assert run.policy is not None
    tok = run.policy.tokenizer
    rows = [list(tok(run.policy.chat_text(p.messages), add_special_tokens=False)["input_ids"])
            + continuation_prefix(p) for p in prompts]
    given = [len(continuation_prefix(p)) for p in prompts]
    width = max(len(r) for r in rows)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        attn[i, width - len(r):] = 1
    return ids, attn, given


def given_mask(given: list[int], width: int) -> torch.Tensor:
    """``[P, width]`` float: 1 on the last ``given[i]`` columns of row ``i``."""
    cols = torch.arange(width)[None]
    return (cols >= width - torch.tensor(given)[:, None]).float()


@torch.no_grad()
def input_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float, autocast: Any = None) -> torch.Tensor:
    """``[P, W]``: column ``t`` holds ``log p(input_ids[:, t] | input_ids[:, :t])`` under
    ``softmax(logits / temperature)`` (unscaled when ``temperature <= 0``, as greedy decoding
    reports), the distribution the trainer's log-probs use; 0 in column 0. The behaviour
    log-probs of tokens a continuation was given rather than sampled."""
    import contextlib

    ctx = autocast if autocast is not None else contextlib.nullcontext()
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with ctx:
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=positions, use_cache=False).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], 1)


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def sample_tokens(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int,
                  max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                  eos_ids: list[int], pad_id: int, generator: torch.Generator | None = None,
                  autocast: Any = None,
                  stop_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample ``n`` completions per prompt row. Returns ``(completion [P*n, L],
    completion_mask [P*n, L], logp [P*n, L])``; rows are prompt-major. ``temperature == 0``
    is greedy (``logp`` then is the log-prob under the unscaled distribution). ``stop_fn(token,
    live)``, called after every step with the step's tokens ``[P*n]`` and the rows that were
    still generating, returns the rows to stop besides EOS (the token that stops them is kept,
    as an EOS is)."""
    import contextlib

    ctx = autocast if autocast is not None else contextlib.nullcontext()
    device = input_ids.device
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with ctx:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                    use_cache=True)
    from rlmix.policy import cache_argument

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
            choice, logp = draw_tokens(filter_logits(logits, temperature, top_p, top_k),
                                       generator)
        else:
            logprobs = torch.log_softmax(logits.float(), -1)
            choice = logprobs.argmax(-1)
            logp = logprobs.gather(-1, choice[:, None]).squeeze(-1)
        live = ~done
        tok = torch.where(live, choice, torch.full_like(choice, pad_id))
        tokens.append(tok)
        logps.append(torch.where(live, logp, torch.zeros_like(logp)))
        masks.append(live.float())
        done = done | torch.isin(choice, eos)
        if stop_fn is not None:
            done = done | (live & stop_fn(tok, live))
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
