"""Batched sampling with transformers (KV cache, left padding, temperature/top-p/top-k).

Prompts are prefilled once per distinct prompt and the KV cache is repeated for the group, so a
group of 8 completions costs one prompt forward, not eight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import rlmix

# the sampling loop and prompt helpers live in the core (rlmix.sampling) so other engines and
# plugins (speculative, agent_prm) use them without importing this plugin; re-exported here
from rlmix.sampling import (  # noqa: F401
    continuation_inputs,
    continuation_prefix,
    draw_tokens,
    encode_prompts,
    filter_logits,
    given_mask,
    input_logprobs,
    sample_tokens,
    stop_token_ids,
)
from rlmix.types import GenerationRequest, RolloutBatch, Run


@dataclass
class Settings:
    batch_size: int = 0  # prompts per generation call; 0 = all at once
    stop_at_eos: bool = True
    max_turns: int = 4  # multi-turn episodes: model turns per episode
    max_episode_tokens: int = 0  # multi-turn: cap on all tokens after the prompt; 0 = none

    def __post_init__(self) -> None:
        if self.batch_size < 0:
            raise ValueError("batch_size must be >= 0")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens < 0:
            raise ValueError(f"max_episode_tokens must be >= 0 (0 = no cap), got "
                             f"{self.max_episode_tokens}")


@rlmix.hookimpl
def rlmix_generate(run: Run, request: GenerationRequest) -> RolloutBatch:
    assert run.policy is not None
    settings = run.settings("hf")
    policy = run.policy
    tok = policy.tokenizer
    eos_ids = stop_token_ids(policy) if settings.stop_at_eos else [-1]
    step = settings.batch_size or len(request.prompts)
    parts = []
    episode_hook = getattr(run.hook, "rlmix_episode", None)
    for start in range(0, len(request.prompts), step):
        chunk = request.prompts[start:start + step]
        episodes = ([episode_hook(run=run, prompt=p) for p in chunk for _ in range(request.n)]
                    if episode_hook is not None else [])
        given = [len(continuation_prefix(p)) for p in chunk]
        if any(e is not None for e in episodes):
            if any(given):
                raise RuntimeError("hf: Prompt.info['continue_from'] (a continuation from a "
                                   "prefix) is not supported in multi-turn episodes")
            parts.append(generate_episodes(run, chunk, episodes, request, settings, eos_ids))
            continue
        parts.append(_single_turn(run, chunk, given, request, eos_ids))
    return parts[0] if len(parts) == 1 else RolloutBatch.concat(parts, tok.pad_token_id)


def _single_turn(run: Run, chunk: list[rlmix.Prompt], given: list[int],
                 request: GenerationRequest, eos_ids: list[int]) -> RolloutBatch:
    """``request.n`` completions of each prompt of ``chunk``, one prefill per prompt. A prompt
    with ``Prompt.info["continue_from"]`` (``rlmix.sampling.CONTINUE_FROM``) is continued from
    those tokens: they are appended to its prompt before the prefill, then returned as the
    first ``given[i]`` tokens of its completion (completion mask 1, behaviour log-probs from
    the prefill's forward, in the text), and at most ``max_new_tokens - given[i]`` more are
    sampled."""
    assert run.policy is not None
    policy = run.policy
    tok = policy.tokenizer
    n = request.n
    if any(given):
        ids, attn, given = continuation_inputs(run, chunk)
    else:
        ids, attn = encode_prompts(run, chunk)
    ids, attn = ids.to(policy.device), attn.to(policy.device)
    rows = len(chunk) * n
    budget = torch.tensor([max(int(request.max_new_tokens) - g, 0) for g in given]
                          ).repeat_interleave(n)
    if int(budget.max()) > 0:
        completion, cmask, logp = sample_tokens(
            policy.model, ids, attn, n, int(budget.max()), request.temperature,
            request.top_p, request.top_k, eos_ids, tok.pad_token_id,
            autocast=policy.autocast())
    else:  # every prefix already uses the whole budget
        completion = torch.zeros((rows, 0), dtype=torch.long, device=ids.device)
        cmask = torch.zeros((rows, 0), device=ids.device)
        logp = torch.zeros((rows, 0), device=ids.device)
    prompt_ids = ids.repeat_interleave(n, 0)
    prompt_attn = attn.repeat_interleave(n, 0)
    width = prompt_ids.shape[1]
    prompt_cmask = torch.zeros_like(prompt_attn, dtype=torch.float)
    prompt_logp = torch.zeros(rows, width)
    if any(given):
        # each row stops at its own budget (what its prefix leaves of max_new_tokens)
        keep = (torch.arange(completion.shape[1])[None] < budget[:, None]).to(cmask.device)
        cmask, logp = cmask * keep, logp * keep
        completion = completion.masked_fill(~keep, tok.pad_token_id)
        gm = given_mask(given, width)
        prompt_cmask = gm.repeat_interleave(n, 0).to(prompt_cmask.device)
        prompt_logp = (input_logprobs(policy.model, ids, attn, request.temperature,
                                      policy.autocast()).cpu() * gm).repeat_interleave(n, 0)
    tokens = torch.cat([prompt_ids, completion], 1).cpu()
    region = completion.masked_fill(cmask == 0, tok.pad_token_id)
    if any(given):  # the text is the whole completion, given prefix included
        region = torch.cat([prompt_ids.masked_fill(prompt_cmask == 0, tok.pad_token_id),
                            region], 1)
    texts = tok.batch_decode(region.cpu(), skip_special_tokens=True)
    return RolloutBatch(
        group=torch.arange(len(chunk)).repeat_interleave(n),
        tokens=tokens,
        attention_mask=torch.cat([prompt_attn, cmask.long()], 1).cpu(),
        completion_mask=torch.cat([prompt_cmask, cmask], 1).cpu(),
        behavior_logp=torch.cat([prompt_logp, logp.cpu()], 1),
        policy_version=torch.full((rows,), run.policy_version, dtype=torch.long),
        texts=texts,
        prompts=[p for p in chunk for _ in range(n)],
    )


# ---------------------------------------------------------------- multi-turn episodes

#: a marker rendered in place of an assistant turn to find what the chat template adds after it
_SENTINEL = "<<rlmix-turn-sentinel>>"


def continuation_text(tokenizer: Any, conversation: list[dict[str, str]],
                      env_messages: list[dict[str, str]], ended_with: str = "",
                      tools: list[dict[str, Any]] | None = None) -> str:
    """The text the chat template puts between the end of an assistant turn and the start of the
    next one when ``env_messages`` (tool results) come in between: the turn's closing tag, the
    env messages, and the next assistant header. Found by rendering the conversation with a
    sentinel as the assistant turn and taking what follows it. ``ended_with`` is the text of
    the stop token the model already emitted (its EOS), which is not inserted twice. ``tools``
    (the prompt's tool specs) are rendered as for the opening, so the template sees the same
    conversation it rendered the prompt from."""
    extra = {"tools": tools} if tools else {}
    rendered = tokenizer.apply_chat_template(
        [*conversation, {"role": "assistant", "content": _SENTINEL}, *env_messages],
        tokenize=False, add_generation_prompt=True, **extra)
    at = rendered.rfind(_SENTINEL)
    if at < 0:
        raise RuntimeError("the chat template dropped the assistant turn; multi-turn rollouts "
                           "need a template that renders assistant messages verbatim")
    tail = rendered[at + len(_SENTINEL):]
    if ended_with and tail.startswith(ended_with):
        tail = tail[len(ended_with):]
    return tail


class TurnStopper:
    """The ``stop_fn`` of one turn: stops a row when its decoded tail contains one of its stop
    strings, or when it has used its token budget for this turn."""

    def __init__(self, tokenizer: Any, stop_strings: list[tuple[str, ...]],
                 budgets: list[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.budgets = budgets
        self.generated: list[list[int]] = [[] for _ in budgets]
        self.reason = ["" for _ in budgets]
        self.window = [max((len(x) for x in strings), default=0) + 8 for strings in stop_strings]

    def __call__(self, token: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        stop = torch.zeros_like(live)
        for row in torch.nonzero(live).flatten().tolist():
            ids = self.generated[row]
            ids.append(int(token[row]))
            if self.stop_strings[row]:
                tail = self.tokenizer.decode(ids[-self.window[row]:], skip_special_tokens=False)
                if any(x in tail for x in self.stop_strings[row]):
                    self.reason[row] = "stop"
                    stop[row] = True
                    continue
            if len(ids) >= self.budgets[row]:
                self.reason[row] = "budget"
                stop[row] = True
        return stop


@dataclass
class _Row:
    """One sample's episode while it runs."""

    episode: Any
    prompt: Any
    prompt_ids: list[int]
    conversation: list[dict[str, str]]
    tokens: list[int]
    mask: list[float]
    logp: list[float]
    turns: list[dict[str, Any]]
    model_tokens: int = 0
    done: bool = False
    stop_reason: str = ""


class _SingleTurn:
    """Stands in for ``None`` from ``rlmix_episode`` in a batch where other rows are episodes:
    one turn, no stop strings."""

    stop_strings: tuple[str, ...] = ()

    def __init__(self, messages: list[dict[str, str]]) -> None:
        self.messages = messages

    def reset(self) -> list[dict[str, str]]:
        return self.messages

    def step(self, assistant_text: str) -> Any:
        from rlmix.types import StepResult

        return StepResult(done=True)


def generate_episodes(run: Run, prompts: list[rlmix.Prompt], episodes: list[Any],
                      request: GenerationRequest, settings: Settings,
                      eos_ids: list[int]) -> RolloutBatch:
    """Drive one episode per row (``len(prompts) * request.n`` rows, prompt-major) turn by turn.

    Each turn re-prefills every live row's whole context (prompt, earlier turns, env messages)
    as one left-padded batch and samples until EOS, a stop string or the row's budget. The
    model's tokens are kept as sampled; env messages are tokenised from the chat template and
    inserted with ``completion_mask`` 0 and ``behavior_logp`` 0."""
    assert run.policy is not None
    policy = run.policy
    tok = policy.tokenizer
    n = request.n
    eos_text = {i: tok.decode([i], skip_special_tokens=False) for i in eos_ids if i >= 0}
    rows: list[_Row] = []
    for index, episode in enumerate(episodes):
        prompt = prompts[index // n]
        if episode is None:
            episode = _SingleTurn(prompt.messages)
        opening = list(episode.reset())
        ids = tok(policy.chat_text(opening, getattr(prompt, "tools", None)),
                  add_special_tokens=False)["input_ids"]
        rows.append(_Row(episode, prompt, list(ids), opening, [], [], [], []))
    budget_total = int(request.max_new_tokens)
    for turn in range(settings.max_turns):
        for r in rows:
            if not r.done and _budget(r, budget_total, settings) <= 0:
                r.done, r.stop_reason = True, ("max_new_tokens" if r.model_tokens >= budget_total
                                               else "max_episode_tokens")
        live = [r for r in rows if not r.done]
        if not live:
            break
        budgets = [_budget(r, budget_total, settings) for r in live]
        contexts = [r.prompt_ids + r.tokens for r in live]
        # the first turn of a group shares one context: prefill it once, as single-turn does
        shared = turn == 0 and len(live) == len(rows) and all(
            contexts[i] == contexts[i - i % n] for i in range(len(contexts)))
        group = n if shared else 1
        unique = contexts[::group]
        width = max(len(c) for c in unique)
        ids = torch.full((len(unique), width), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(unique), width), dtype=torch.long)
        for i, c in enumerate(unique):
            ids[i, width - len(c):] = torch.tensor(c, dtype=torch.long)
            attn[i, width - len(c):] = 1
        stopper = TurnStopper(tok, [tuple(getattr(r.episode, "stop_strings", ()) or ())
                                    for r in live], budgets)
        completion, cmask, logp = sample_tokens(
            policy.model, ids.to(policy.device), attn.to(policy.device), group, max(budgets),
            request.temperature, request.top_p, request.top_k, eos_ids, tok.pad_token_id,
            autocast=policy.autocast(), stop_fn=stopper)
        completion, cmask, logp = completion.cpu(), cmask.cpu(), logp.cpu()
        for i, r in enumerate(live):
            keep = cmask[i].bool()
            new = completion[i][keep].tolist()
            r.tokens += new
            r.mask += [1.0] * len(new)
            r.logp += logp[i][keep].tolist()
            r.model_tokens += len(new)
            text = tok.decode(new, skip_special_tokens=True)
            ended = ("eos" if new and new[-1] in eos_text else stopper.reason[i] or "budget")
            if ended == "budget":  # cut short: not a complete turn, the env does not see it
                r.turns.append({"assistant": text, "end": "budget"})
                r.done, r.stop_reason = True, ("max_episode_tokens" if settings.max_episode_tokens
                                               and len(r.tokens) >= settings.max_episode_tokens
                                               else "max_new_tokens")
                continue
            try:
                result = r.episode.step(text)
            except Exception as exc:
                raise RuntimeError(f"{type(r.episode).__name__}.step raised {type(exc).__name__}: "
                                   f"{exc} (an episode reports bad model output as a message, "
                                   f"never an exception)") from exc
            r.turns.append({"assistant": text, "end": ended,
                            "messages": list(result.messages), "info": dict(result.info)})
            if result.done:
                r.done, r.stop_reason = True, "done"
                continue
            if turn + 1 >= settings.max_turns:
                r.done, r.stop_reason = True, "max_turns"
                continue
            if r.model_tokens >= budget_total:
                r.done, r.stop_reason = True, "max_new_tokens"
                continue
            closing = eos_text.get(new[-1], "") if ended == "eos" else ""
            r.conversation.append({"role": "assistant", "content": text})
            inserted = continuation_text(tok, r.conversation[:-1], list(result.messages),
                                         closing, getattr(r.prompt, "tools", None))
            r.conversation += list(result.messages)
            inserted_ids = tok(inserted, add_special_tokens=False)["input_ids"]
            if settings.max_episode_tokens and (len(r.tokens) + len(inserted_ids)
                                                >= settings.max_episode_tokens):
                r.done, r.stop_reason = True, "max_episode_tokens"
                continue
            r.tokens += inserted_ids
            r.mask += [0.0] * len(inserted_ids)
            r.logp += [0.0] * len(inserted_ids)
    for r in rows:
        if not r.done:  # the loop ran out of turns with rows still live (cannot happen)
            r.done, r.stop_reason = True, "max_turns"
    return _episode_batch(run, prompts, rows, n)


def _budget(row: _Row, budget_total: int, settings: Settings) -> int:
    """Tokens the row may still generate: what is left of ``max_new_tokens`` (model tokens over
    all turns) and of ``max_episode_tokens`` (all tokens after the prompt)."""
    budget = budget_total - row.model_tokens
    if settings.max_episode_tokens:
        budget = min(budget, settings.max_episode_tokens - len(row.tokens))
    return budget


def _episode_batch(run: Run, prompts: list[rlmix.Prompt], rows: list[_Row],
                   n: int) -> RolloutBatch:
    """Rows as one batch: prompts left-padded to a common width, completion regions (model
    turns and env messages, contiguous) right-padded."""
    tok = run.policy.tokenizer  # type: ignore[union-attr]
    pad = tok.pad_token_id
    width = max(len(r.prompt_ids) for r in rows)
    length = max(max(len(r.tokens) for r in rows), 1)
    count = len(rows)
    tokens = torch.full((count, width + length), pad, dtype=torch.long)
    attn = torch.zeros((count, width + length), dtype=torch.long)
    cmask = torch.zeros((count, width + length))
    logp = torch.zeros((count, width + length))
    texts, info = [], []
    for i, r in enumerate(rows):
        p, c = len(r.prompt_ids), len(r.tokens)
        tokens[i, width - p:width] = torch.tensor(r.prompt_ids, dtype=torch.long)
        attn[i, width - p:width + c] = 1
        if c:
            tokens[i, width:width + c] = torch.tensor(r.tokens, dtype=torch.long)
            cmask[i, width:width + c] = torch.tensor(r.mask)
            logp[i, width:width + c] = torch.tensor(r.logp)
        texts.append(tok.decode(r.tokens, skip_special_tokens=False))
        info.append({"episode": {
            "turns": r.turns, "stop_reason": r.stop_reason, "model_tokens": r.model_tokens,
            "env_tokens": c - r.model_tokens,
            "model_text": "".join(t["assistant"] for t in r.turns)}})
    return RolloutBatch(
        group=torch.arange(len(prompts)).repeat_interleave(n), tokens=tokens,
        attention_mask=attn, completion_mask=cmask, behavior_logp=logp,
        policy_version=torch.full((count,), run.policy_version, dtype=torch.long),
        texts=texts, prompts=[p for p in prompts for _ in range(n)], info=info)
