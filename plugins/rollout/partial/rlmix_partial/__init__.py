"""Partial rollouts (APRIL, CoPRIS): over-provision groups, end the step as soon as the target
number of groups is complete, and carry unfinished responses over to the next step, where they
continue from their prefix (KV cache recomputed). Each token keeps the behaviour log-prob and the
policy version of the weights that generated it, so importance ratios stay exact; a group is
returned (and trained) only once all its members are complete.

Owns ``rlmix_sample``; ``rlmix_generate`` (evaluation) stays with the rollout engine (``hf``).
The per-token versions go to ``batch.extras["token_version"]`` (``[N, T]`` long; off the
completion it holds the row's ``policy_version``); ``batch.policy_version`` is the version of
each sample's first segment.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.policy import cache_argument
from rlmix.sampling import draw_tokens, filter_logits
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "partial"
TOKEN_VERSION = "token_version"
STATS = "stats"  # run.plugin_resources("partial"): per-step stats the sampler made


@dataclass
class Settings:
    over_provision: float = 1.5  # groups in flight = ceil(over_provision * prompts_per_step)
    stop_at_eos: bool = True  # False: every response runs to sampling.max_new_tokens
    oldest_first: bool = True  # return the oldest complete groups first (least stale)

    def __post_init__(self) -> None:
        if not self.over_provision >= 1.0:
            raise ValueError(f"over_provision: must be >= 1.0 (1.0 = no over-provisioning), "
                             f"got {self.over_provision}")


# ---------------------------------------------------------------- generation that can stop


@dataclass
class Segment:
    """What one ``decode`` call generated per row: ``tokens``/``logp`` ``[R, L]`` (valid where
    ``mask``), ``eos`` (the row sampled a stop token) and ``ended`` (EOS or its budget used)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    logp: torch.Tensor
    eos: torch.Tensor
    ended: torch.Tensor

    def row(self, i: int) -> tuple[list[int], list[float]]:
        keep = self.mask[i] > 0
        return self.tokens[i][keep].tolist(), self.logp[i][keep].tolist()


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as a left-padded ``[R, W]`` batch and its attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            attn[i, width - len(r):] = 1
    return ids, attn


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def decode(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
           budget: torch.Tensor, *, temperature: float, top_p: float = 1.0, top_k: int = 0,
           eos_ids: list[int], pad_id: int, generator: torch.Generator | None = None,
           autocast: Any = None,
           stop: Callable[[torch.Tensor], bool] | None = None) -> Segment:
    """Sample a continuation of every row of ``input_ids`` (left-padded prompt + the row's
    tokens so far; the KV cache is computed afresh from it) until each row samples a stop token
    or has generated ``budget[i]`` tokens, or until ``stop(ended)`` returns True after a token
    (the rows not ended then are unfinished: continue them later from their new prefix).

    A row that ends leaves the batch (its KV cache rows are dropped), so a long tail costs
    only its own rows. Each token draws once per live row, in row order, from ``generator``:
    continuing the unfinished rows later with the same generator and weights gives exactly the
    tokens one uninterrupted call would have."""
    ctx = autocast if autocast is not None else contextlib.nullcontext()
    device = input_ids.device
    rows = input_ids.shape[0]
    budget = budget.to(device)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    ended = budget <= 0
    eos_hit = torch.zeros(rows, dtype=torch.bool, device=device)
    count = torch.zeros(rows, dtype=torch.long, device=device)
    stop_ids = torch.tensor(eos_ids or [-1], device=device)
    tokens, logps, masks = [], [], []
    active = (~ended).nonzero().squeeze(1)  # rows still in the batch, in row order
    if len(active) == 0:
        empty = torch.zeros(rows, 0)
        return Segment(empty.long(), empty, empty, eos_hit, ended)
    attention_mask, positions = attention_mask[active], positions[active]
    with ctx:
        out = model(input_ids=input_ids[active], attention_mask=attention_mask,
                    position_ids=positions, use_cache=True)
    cache_arg = cache_argument(model)
    cache = _cache_of(out)
    logits = out.logits[:, -1, :]
    next_pos = positions[:, -1:] + 1
    while True:
        choice, chosen_logp = draw_tokens(filter_logits(logits, temperature, top_p, top_k),
                                          generator)
        tok = torch.full((rows,), pad_id, dtype=torch.long, device=device)
        tok[active] = choice
        lp = torch.zeros(rows, device=device)
        lp[active] = chosen_logp.float()
        live = torch.zeros(rows, dtype=torch.bool, device=device)
        live[active] = True
        tokens.append(tok)
        logps.append(lp)
        masks.append(live.float())
        count = count + live.long()
        hit = live & torch.isin(tok, stop_ids)
        eos_hit = eos_hit | hit
        ended = ended | hit | (count >= budget)
        if bool(ended.all()) or (stop is not None and stop(ended)):
            break
        still = ~ended[active]  # positions within the current batch that stay
        if not bool(still.all()):
            keep = still.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            active, choice = active[keep], choice[keep]
            attention_mask, next_pos = attention_mask[keep], next_pos[keep]
        attention_mask = torch.cat(
            [attention_mask, torch.ones(len(active), 1, dtype=attention_mask.dtype,
                                        device=device)], 1)
        with ctx:
            out = model(input_ids=choice[:, None], attention_mask=attention_mask,
                        position_ids=next_pos, use_cache=True, **{cache_arg: cache})
        cache = _cache_of(out)
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    return Segment(torch.stack(tokens, 1), torch.stack(masks, 1), torch.stack(logps, 1),
                   eos_hit, ended)


# ---------------------------------------------------------------- the pool of groups in flight


def new_state() -> dict[str, Any]:
    """The plugin's checkpointed state: groups in flight (``pool``), prompts pulled but not
    started (``queue``), the next step whose prompts are not pulled yet, and the groups returned
    per step (kept a few steps so a resumed async run can give back those never trained)."""
    return {"pool": [], "queue": [], "next_stream_step": 0, "returned": {}, "serial": 0}


def start_group(state: dict[str, Any], prompt: Prompt, prompt_ids: list[int], size: int,
                step: int) -> dict[str, Any]:
    group = {"id": state["serial"], "prompt": prompt, "prompt_ids": prompt_ids, "born": step,
             "members": [{"tokens": [], "logp": [], "version": [], "done": False,
                          "eos": False, "segments": 0} for _ in range(size)]}
    state["serial"] += 1
    state["pool"].append(group)
    return group


def group_complete(group: dict[str, Any]) -> bool:
    return all(m["done"] for m in group["members"])


def advance(model: Any, pool: list[dict[str, Any]], target: int, version: int,
            max_new_tokens: int, *, temperature: float, top_p: float, top_k: int,
            eos_ids: list[int], pad_id: int, generator: torch.Generator | None = None,
            autocast: Any = None, device: Any = "cpu") -> int:
    """Continue every unfinished member of ``pool`` in one batched call until ``target``
    groups are complete (or every member is), recording each new token's log-prob and
    ``version``. Returns the number of decoding steps."""
    already = sum(group_complete(g) for g in pool)
    live = [(g, m) for g in pool for m in g["members"] if not m["done"]]
    if already >= target or not live:
        return 0
    group_of = torch.tensor([pool.index(g) for g, _ in live])
    ids, attn = left_pad([g["prompt_ids"] + m["tokens"] for g, m in live], pad_id)
    budget = torch.tensor([max_new_tokens - len(m["tokens"]) for _, m in live])
    incomplete = torch.zeros(len(pool), dtype=torch.long).index_add_(
        0, group_of, torch.ones(len(live), dtype=torch.long))

    def enough(ended: torch.Tensor) -> bool:
        open_rows = torch.zeros(len(pool), dtype=torch.long).index_add_(
            0, group_of, (~ended.cpu()).long())
        newly = int(((incomplete > 0) & (open_rows == 0)).sum())
        return already + newly >= target

    seg = decode(model, ids.to(device), attn.to(device), budget, temperature=temperature,
                 top_p=top_p, top_k=top_k, eos_ids=eos_ids, pad_id=pad_id, generator=generator,
                 autocast=autocast, stop=enough)
    for i, (_, m) in enumerate(live):
        toks, logps = seg.row(i)
        if toks:
            m["tokens"] += toks
            m["logp"] += logps
            m["version"] += [version] * len(toks)
            m["segments"] += 1
        m["eos"] = bool(seg.eos[i])
        m["done"] = bool(seg.ended[i])
    return int(seg.tokens.shape[1])


def to_batch(groups: list[dict[str, Any]], pad_id: int, tokenizer: Any) -> RolloutBatch:
    """Complete groups as a ``RolloutBatch`` (prompt-major rows, prompts left-padded), with the
    per-token behaviour log-probs and ``extras["token_version"]``."""
    rows = [(gi, g, m) for gi, g in enumerate(groups) for m in g["members"]]
    width_p = max(len(g["prompt_ids"]) for g in groups)
    width_c = max(max(len(m["tokens"]) for m in g["members"]) for g in groups)
    n, width = len(rows), width_p + width_c
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.long)
    cmask = torch.zeros(n, width)
    logp = torch.zeros(n, width)
    first = torch.zeros(n, dtype=torch.long)
    versions = torch.zeros(n, width, dtype=torch.long)
    texts, infos = [], []
    for i, (_, g, m) in enumerate(rows):
        p, c = g["prompt_ids"], m["tokens"]
        tokens[i, width_p - len(p):width_p] = torch.tensor(p, dtype=torch.long)
        attn[i, width_p - len(p):width_p] = 1
        first[i] = m["version"][0] if m["version"] else 0
        versions[i] = first[i]
        if c:
            tokens[i, width_p:width_p + len(c)] = torch.tensor(c, dtype=torch.long)
            attn[i, width_p:width_p + len(c)] = 1
            cmask[i, width_p:width_p + len(c)] = 1.0
            logp[i, width_p:width_p + len(c)] = torch.tensor(m["logp"])
            versions[i, width_p:width_p + len(c)] = torch.tensor(m["version"])
        texts.append(tokenizer.decode(c, skip_special_tokens=True) if c else "")
        infos.append({"partial": {"segments": m["segments"], "group_id": g["id"],
                                  "born_step": g["born"],
                                  "versions": sorted(set(m["version"])), "eos": m["eos"]}})
    return RolloutBatch(group=torch.tensor([gi for gi, _, _ in rows]), tokens=tokens,
                        attention_mask=attn, completion_mask=cmask, behavior_logp=logp,
                        policy_version=first, texts=texts,
                        prompts=[g["prompt"] for _, g, _ in rows], info=infos,
                        extras={TOKEN_VERSION: versions})


# ---------------------------------------------------------------- hooks


def _state(run: Run) -> dict[str, Any]:
    state = run.plugin_state(NAME)
    if "pool" not in state:
        state.update(new_state())
    return state


def _stop_ids(run: Run) -> list[int]:
    assert run.policy is not None
    ids = {run.policy.tokenizer.eos_token_id}
    configured = getattr(run.policy.model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return sorted(i for i in ids if i is not None)


def _prompt_ids(run: Run, prompt: Prompt) -> list[int]:
    assert run.policy is not None
    text = run.policy.chat_text(prompt.messages, getattr(prompt, "tools", None))
    return list(run.policy.tokenizer(text, add_special_tokens=False)["input_ids"])


@rlmix.hookimpl
def rlmix_sample(run: Run, prompts: list[Prompt]) -> RolloutBatch:
    """``len(prompts)`` complete groups of ``train.group_size``, drawn from the groups in
    flight: carried-over ones continue, new ones start from the prompt stream (this step's
    prompts, then later steps' through ``rlmix_prompts``), and decoding stops as soon as
    enough groups are complete."""
    assert run.policy is not None
    s = run.settings(NAME)
    state = _state(run)
    step = run.step
    target = len(prompts)
    size = int(run.config.train.group_size)
    sampling = run.config.sampling
    # a resumed async run: give back the groups returned for steps that were never trained
    returned = state["returned"]
    for key in sorted(k for k in returned if k >= step):
        state["pool"] = returned.pop(key) + state["pool"]
    state["pool"].sort(key=lambda g: g["id"])
    if step >= state["next_stream_step"]:
        state["queue"].extend(prompts)
        state["next_stream_step"] = step + 1
    capacity = max(target, math.ceil(s.over_provision * target))
    while len(state["pool"]) < capacity:
        if not state["queue"]:
            more = run.hook.rlmix_prompts(run=run, step=state["next_stream_step"])
            state["next_stream_step"] += 1
            if not more:
                break
            state["queue"].extend(more)
        prompt = state["queue"].pop(0)
        start_group(state, prompt, _prompt_ids(run, prompt), size, step)
    seed = int(run.config.train.seed) * 1_000_003 + step * 7919 + 17
    generator = torch.Generator(device=run.policy.device).manual_seed(seed)
    pad_id = run.policy.tokenizer.pad_token_id
    decode_steps = advance(
        run.policy.model, state["pool"], target, run.policy_version,
        int(sampling.max_new_tokens), temperature=float(sampling.temperature),
        top_p=float(sampling.top_p), top_k=int(sampling.top_k),
        eos_ids=_stop_ids(run) if s.stop_at_eos else [], pad_id=pad_id, generator=generator,
        autocast=run.policy.autocast(), device=run.policy.device)
    complete = [g for g in state["pool"] if group_complete(g)]
    if not s.oldest_first:
        complete.sort(key=lambda g: -g["id"])
    chosen = complete[:target]
    ids = {g["id"] for g in chosen}
    state["pool"] = [g for g in state["pool"] if g["id"] not in ids]
    returned[step] = chosen
    keep_from = step - int(run.config.train.max_staleness) - 2
    for key in [k for k in returned if k < keep_from]:
        del returned[key]
    batch = to_batch(chosen, pad_id, run.policy.tokenizer)
    carried = [m for g in state["pool"] for m in g["members"] if m["tokens"]]
    run.plugin_resources(NAME).setdefault(STATS, {})[step] = {
        "partial/decode_steps": float(decode_steps),
        "partial/groups_in_flight": float(len(state["pool"])),
        "partial/carried_tokens": float(sum(len(m["tokens"]) for m in carried)),
        "partial/continued_samples": float(sum(i["partial"]["segments"] > 1
                                               for i in batch.info)),
        "partial/mixed_version_samples": float(sum(len(i["partial"]["versions"]) > 1
                                                   for i in batch.info)),
    }
    return batch


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    stats = run.plugin_resources(NAME).get(STATS, {})  # the async worker adds to it from its thread
    metrics.update(stats.pop(run.step - 1, {}))
    for key in list(stats):
        if key < run.step - 1:
            stats.pop(key, None)
