"""Full-vocabulary logits of a batch's completion tokens, under its own prompts or under others.

``rlmix_clip`` receives the sampled tokens' log-probs only. A loss that compares whole next-token
distributions (on-policy self-distillation: the same weights under a privileged prompt as the
teacher of the student's own completions) needs the logits. This module is that seam:

* ``completion_logits(run, batch, messages=None)``: ``[n, T - first, V]`` logits through the
  ``rlmix_completion_logits`` hook, with the caller's gradient mode (the student).
* ``teacher_logits(run, batch, messages)``: the same under other prompt messages, no gradient.
* ``policy_completion_logits``: the core's default for the hook, on the run's ``Policy``.
* ``forced_completions(run, batch, rows, completions)``: rows that are not sampled (an expert
  trajectory, an oracle answer) after existing rows' prompts, for SFT-like and anchor terms.

``first`` is ``first_completion_column(batch)``, the first column any row's completion occupies
(the same cut ``Policy.logprobs`` makes); ``completion_region(batch)`` is the completion mask
from there on, aligned with the logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlmix.types import RolloutBatch as RolloutBatchType

if TYPE_CHECKING:  # pragma: no cover
    from rlmix.types import RolloutBatch, Run

Messages = list[dict[str, str]]


def first_completion_column(batch: RolloutBatch) -> int:
    """The first column where any row has a completion token (at least 1: column 0 has no
    prediction); ``batch.tokens.shape[1]`` when no row has one."""
    cols = batch.completion_mask.sum(0).nonzero()
    if len(cols) == 0:
        return int(batch.tokens.shape[1])
    return max(int(cols[0]), 1)


def completion_region(batch: RolloutBatch) -> torch.Tensor:
    """``completion_mask[:, first:]``: the mask aligned with ``completion_logits``."""
    return batch.completion_mask[:, first_completion_column(batch):]


def completion_logits(run: Run, batch: RolloutBatch,
                      messages: list[Messages] | None = None) -> torch.Tensor:
    """``[n, T - first, V]`` logits predicting ``batch.tokens[:, first:]`` (see the hook
    ``rlmix_completion_logits``), after each row's own prompt or after ``messages[i]``.
    Gradient as the caller's mode: the student's forward."""
    if messages is not None and len(messages) != len(batch):
        raise ValueError(f"completion_logits: {len(messages)} message lists for "
                         f"{len(batch)} rows")
    logits = run.hook.rlmix_completion_logits(run=run, batch=batch, messages=messages)
    if logits is None:
        raise RuntimeError("no plugin returned logits from rlmix_completion_logits")
    width = batch.tokens.shape[1] - first_completion_column(batch)
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (len(batch), width):
        raise RuntimeError(f"rlmix_completion_logits returned shape {tuple(logits.shape)}, "
                           f"expected ({len(batch)}, {width}, V)")
    return logits


def teacher_logits(run: Run, batch: RolloutBatch, messages: list[Messages]) -> torch.Tensor:
    """The batch's completion tokens scored after ``messages`` (one chat per row) by the same
    weights, without gradient: a privileged teacher on the student's own tokens."""
    with torch.no_grad():
        return completion_logits(run, batch, messages).detach()


def _prompt_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def policy_completion_logits(run: Run, batch: RolloutBatch,
                             messages: list[Messages] | None = None,
                             model: Any = None) -> torch.Tensor:
    """The default of ``rlmix_completion_logits``: one forward of ``model`` (the policy's by
    default). Under ``messages`` each row becomes ``template(messages[i])`` + the row's tokens
    from column ``first`` on (completion and any env-inserted turns), left-padded; the logits
    at the positions predicting those tokens come back aligned with the original columns."""
    policy = run.policy
    if policy is None:
        raise RuntimeError("rlmix_completion_logits: the run has no policy")
    model = policy.model if model is None else model
    device = policy.device
    tokens = batch.tokens.to(device)
    attn = batch.attention_mask.to(device).long()
    first = first_completion_column(batch)
    n, width = tokens.shape
    if messages is not None:
        prefixes = [_prompt_ids(policy.tokenizer, policy.chat_text(m)) for m in messages]
        longest = max(len(p) for p in prefixes)
        pad_id = int(policy.tokenizer.pad_token_id or 0)
        rows, masks = [], []
        for i, prefix in enumerate(prefixes):
            fill = longest - len(prefix)
            rows.append(torch.cat([torch.full((fill,), pad_id, dtype=torch.long, device=device),
                                   torch.tensor(prefix, dtype=torch.long, device=device),
                                   tokens[i, first:]]))
            masks.append(torch.cat([torch.zeros(fill, dtype=torch.long, device=device),
                                    torch.ones(len(prefix), dtype=torch.long, device=device),
                                    attn[i, first:]]))
        tokens, attn, first = torch.stack(rows), torch.stack(masks), longest
        width = tokens.shape[1]
    if width - first <= 0:
        vocab = model.get_output_embeddings().weight.shape[0]
        return torch.zeros(n, 0, vocab, device=device)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    with policy.autocast():
        hidden = model.base_model(input_ids=tokens[:, :-1], attention_mask=attn[:, :-1],
                                  position_ids=position_ids[:, :-1],
                                  use_cache=False).last_hidden_state[:, first - 1:]
    head = model.get_output_embeddings()
    with torch.autocast(hidden.device.type, enabled=False):
        bias = getattr(head, "bias", None)
        return torch.nn.functional.linear(hidden.float(), head.weight.float(),
                                          None if bias is None else bias.float())


def forced_completions(run: Run, batch: RolloutBatch, rows: list[int],
                       completions: list[list[int]]) -> RolloutBatch:
    """New rows that are not sampled: row ``rows[j]``'s prompt columns (``:first``) followed by
    the token ids ``completions[j]`` (an expert trajectory, an oracle answer), right-padded.
    ``behavior_logp`` is the current policy's (no gradient), ``policy_version`` the current
    one, so a ratio taken against it starts at 1; ``prompts`` and ``info`` come from the source
    rows, ``group`` is ``0..len(rows) - 1``."""
    from rlmix.sampling import pad_id

    first = first_completion_column(batch)
    width = max(len(c) for c in completions)
    pad = pad_id(run)
    index = torch.tensor(rows, dtype=torch.long)
    tail = torch.tensor([list(c) + [pad] * (width - len(c)) for c in completions],
                        dtype=torch.long)
    filled = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    n = len(rows)
    out = RolloutBatchType(
        group=torch.arange(n), tokens=torch.cat([batch.tokens[index, :first], tail], 1),
        attention_mask=torch.cat([batch.attention_mask[index, :first],
                                  filled.to(batch.attention_mask.dtype)], 1),
        completion_mask=torch.cat([torch.zeros(n, first), filled.float()], 1),
        behavior_logp=torch.zeros(n, first + width),
        policy_version=torch.full((n,), int(run.policy_version), dtype=torch.long),
        texts=[_decode(run, c) for c in completions],
        prompts=[batch.prompts[r] for r in rows] if batch.prompts else [],
        info=[dict(batch.info[r]) for r in rows])
    if run.policy is not None:
        with torch.no_grad():
            out.behavior_logp = run.policy.logprobs(run, out)[0].detach().cpu().float() \
                * out.completion_mask
    return out


def _decode(run: Run, ids: list[int]) -> str:
    """What a scorer reads in ``batch.texts``: the decoded completion (the ids, joined, where
    the run has no tokenizer, as in the toy worlds)."""
    tok = run.tokenizer
    if tok is None:
        return " ".join(map(str, ids))
    return str(tok.decode(list(ids), skip_special_tokens=True))


def stop_token(run: Run, batch: RolloutBatch) -> int | None:
    """The token the rollout engine ended completions with: the most frequent last completion
    token of the rows that stopped before the widest one (a chat model's end-of-turn, which is
    not always ``tokenizer.eos_token_id``); the tokenizer's EOS when no row stopped early."""
    lengths = batch.completion_mask.sum(-1)
    ends: dict[int, int] = {}
    for i in (lengths < lengths.max()).nonzero().flatten().tolist():
        cols = (batch.completion_mask[i] > 0).nonzero().flatten()
        if len(cols):
            last = int(batch.tokens[i, cols[-1]])
            ends[last] = ends.get(last, 0) + 1
    if ends:
        return max(ends, key=ends.__getitem__)
    tok = run.tokenizer
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None
    return int(eos) if eos is not None else None
