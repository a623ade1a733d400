"""Difficulty-targeted online data selection and rollout replay (DOTS): steps 1-3 in
``rlmix_select_prompts`` (a new list for the owner), the rest in an ``rlmix_sample`` wrapper.

1. A candidate pool: the step's prompts plus ``pool_factor - 1`` more batches from
   ``rlmix_prompts`` (negative step keys).
2. A small reference set of ``ref_size`` candidates is rolled out first; its measured adaptive
   difficulty (1 - success rate under the current policy), together with a memory of recently
   measured prompts, predicts every other candidate's difficulty by attention: a softmax over
   cosine similarities of prompt embeddings, divided by ``tau``.
3. The candidates whose predicted difficulty is closest to ``target`` fill the rest of the
   fresh slots; the owner samples them.
4. Rollout replay: ``replay_groups`` groups from a buffer of recent informative groups join the
   batch in place of as many fresh prompts; this step's informative groups enter the buffer.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix import sampling
from rlmix.sampling import (
    count_rollouts,
    generate,
    group_outcomes,
    pad_id,
    prompt_key,
    regroup,
    score,
)
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "dots"
KEY_OFFSET = 4_000_000


@dataclass
class Settings:
    pool_factor: int = 4  # candidate pool = pool_factor * prompts_per_step prompts
    ref_size: int = 1  # reference prompts rolled out first each step (part of the batch)
    target: float = 0.5  # the adaptive difficulty aimed at (0 = always solved, 1 = never)
    tau: float = 0.1  # attention temperature over cosine similarities
    memory: int = 512  # measured prompts kept as extra references
    embed_dim: int = 512  # hashed character-trigram embedding size
    replay_groups: int = 1  # groups per step taken from the replay buffer (not generated)
    buffer_size: int = 64  # informative groups kept for replay (most recent)
    threshold: float = 0.5  # a rollout succeeds when its reward is above this
    key: str = "text"  # prompt identity: "text" or "id"

    def __post_init__(self) -> None:
        if self.pool_factor < 1:
            raise ValueError(f"pool_factor must be >= 1, got {self.pool_factor}")
        if self.ref_size < 1:
            raise ValueError(f"ref_size must be >= 1, got {self.ref_size}")
        if not 0.0 <= self.target <= 1.0:
            raise ValueError(f"target must be in [0, 1], got {self.target}")
        if self.tau <= 0:
            raise ValueError(f"tau must be > 0, got {self.tau}")
        if self.memory < 0 or self.buffer_size < 0 or self.replay_groups < 0:
            raise ValueError("memory, buffer_size and replay_groups must be >= 0")
        if self.embed_dim < 8:
            raise ValueError(f"embed_dim must be >= 8, got {self.embed_dim}")
        if self.key not in ("text", "id"):
            raise ValueError(f"key must be 'text' or 'id', got {self.key!r}")


def embed_texts(texts: list[str], dim: int = 512) -> torch.Tensor:
    """``[n, dim]`` unit vectors: hashed character-trigram counts (a stable hash, so embeddings
    are the same in every process)."""
    import zlib

    out = torch.zeros(len(texts), dim)
    for i, text in enumerate(texts):
        padded = f"  {text.lower()} "
        for j in range(len(padded) - 2):
            out[i, zlib.crc32(padded[j:j + 3].encode()) % dim] += 1.0
    return out / out.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def attention_difficulty(query: torch.Tensor, ref: torch.Tensor, ref_difficulty: torch.Tensor,
                         tau: float) -> torch.Tensor:
    """Predicted difficulty of each query: ``sum_i softmax_i(cos(q, r_i) / tau) * d_i``.
    ``query`` ``[m, d]`` and ``ref`` ``[k, d]`` are unit vectors."""
    if ref.shape[0] == 0:
        return torch.full((query.shape[0],), 0.5)
    weights = torch.softmax(query @ ref.T / tau, dim=-1)
    return weights @ ref_difficulty.float()


def select_moderate(predicted: torch.Tensor, k: int, target: float = 0.5) -> list[int]:
    """Indices of the ``k`` predictions closest to ``target`` (ties keep order), sorted."""
    dist = (predicted - target).abs().tolist()
    order = sorted(range(len(dist)), key=lambda i: (dist[i], i))
    return sorted(order[:k])


def _state(run: Run) -> dict[str, Any]:
    return run.state.setdefault(NAME, {"rollouts": 0, "memory": [], "buffer": [],
                                       "groups": 0, "zero_adv_groups": 0, "replayed": 0})


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s: Settings = run.settings(NAME)
    p = int(run.config.train.prompts_per_step)
    if s.ref_size >= p:
        raise rlmix.ConfigError(f"dots.ref_size ({s.ref_size}) must be below "
                                f"train.prompts_per_step ({p})")
    if s.replay_groups + s.ref_size >= p:
        # defaults that run: a batch too small for both gives up replay, with a warning
        print(f"rlmix: warning: dots: replay needs train.prompts_per_step > dots.ref_size + "
              f"dots.replay_groups ({s.ref_size} + {s.replay_groups}); got {p}, so replay is "
              f"reduced to {p - 1 - s.ref_size} group(s) per step")
    _state(run)


def replay_budget(s: Settings, prompts_per_step: int) -> int:
    """Replayed groups per step: the setting, reduced so at least one fresh prompt besides the
    reference set is generated."""
    return max(0, min(s.replay_groups, prompts_per_step - 1 - s.ref_size))


def _text(prompt: Prompt) -> str:
    return "\n".join(m.get("content", "") for m in prompt.messages)


def _flat(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    g = int(group.max()) + 1
    r = rewards.double()
    hi = torch.full((g,), -math.inf, dtype=torch.float64).scatter_reduce(0, group, r, "amax")
    lo = torch.full((g,), math.inf, dtype=torch.float64).scatter_reduce(0, group, r, "amin")
    return (hi - lo) <= 1e-8


@rlmix.hookimpl
def rlmix_select_prompts(run: Run, prompts: list[Prompt]) -> list[Prompt]:
    """Before the owner samples: roll out the reference prompts, predict the others' difficulty
    and choose the moderate ones (a new list; the caller's is left alone). The wrapper reads
    the rest from ``run.plugin_resources("dots")["selection"]``."""
    s: Settings = run.settings(NAME)
    state = _state(run)
    k = int(run.config.train.group_size)
    replay = min(replay_budget(s, int(run.config.train.prompts_per_step)),
                 len(state["buffer"]))
    fresh = len(prompts) - replay
    pool = list(prompts)
    for j in range(s.pool_factor - 1):
        pool += run.hook.rlmix_prompts(run=run, step=-(KEY_OFFSET + run.step * 100 + j)) or []
    unique: dict[str, Prompt] = {}
    for p in pool:
        unique.setdefault(prompt_key(p, s.key), p)
    pool = list(unique.values())
    n_ref = min(s.ref_size, fresh - 1)
    ref_part = generate(run, pool[:n_ref], k)
    ref_ok = score(run, ref_part) > s.threshold
    wins, counts = group_outcomes(ref_ok, ref_part.group)
    measured = (1.0 - wins.float() / counts.float()).tolist()
    embeddings = embed_texts([_text(p) for p in pool], s.embed_dim)
    ref_emb = [embeddings[i] for i in range(n_ref)] + [e for e, _ in state["memory"]]
    ref_d = measured + [d for _, d in state["memory"]]
    rest = list(range(n_ref, len(pool)))
    predicted = attention_difficulty(embeddings[rest], torch.stack(ref_emb) if ref_emb else
                                     torch.zeros(0, s.embed_dim), torch.tensor(ref_d), s.tau)
    chosen = [rest[i] for i in select_moderate(predicted, fresh - n_ref, s.target)]
    selected = [pool[i] for i in chosen]  # the owner samples these
    run.plugin_resources(NAME)["selection"] = {
        "step": run.step, "prompts": selected, "replay": replay, "ref_part": ref_part,
        "ref_ok": ref_ok, "rest": rest, "predicted": predicted, "chosen": chosen}
    return selected


@rlmix.hookimpl(wrapper=True)
def rlmix_sample(run: Run, prompts: list[Prompt]
                 ) -> Generator[None, RolloutBatch, RolloutBatch]:
    owner = yield
    selection = run.plugin_resources(NAME).pop("selection", None)
    if selection is None or selection["step"] != run.step:
        # not a batch dots selected (a wrapper's extra round samples other prompts): as is
        return owner
    # a later rlmix_select_prompts may have cut the choice (a per-rank share)
    sampling.require_whole_selection(NAME, selection["prompts"], prompts)
    s: Settings = run.settings(NAME)
    state = _state(run)
    replay, ref_part, ref_ok, rest, predicted, chosen = (selection[k] for k in (
        "replay", "ref_part", "ref_ok", "rest", "predicted", "chosen"))

    owner_ok = score(run, owner) > s.threshold
    generated = len(ref_part) + len(owner)
    count_rollouts(run, NAME, generated)
    parts = [ref_part, owner]
    row_keys = [prompt_key(p, s.key) for p in ref_part.prompts + owner.prompts]
    # remember measured difficulties (this step's are the freshest references)
    wins_k: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    for key, o, p in zip(row_keys, torch.cat([ref_ok, owner_ok]).tolist(),
                         ref_part.prompts + owner.prompts):
        wins_k.setdefault(key, []).append(int(o))
        texts.setdefault(key, _text(p))
    new_emb = embed_texts(list(texts.values()), s.embed_dim)
    for emb, outcomes in zip(new_emb, wins_k.values()):
        state["memory"].append((emb, 1.0 - sum(outcomes) / len(outcomes)))
    del state["memory"][:max(0, len(state["memory"]) - s.memory)]
    batch = regroup(parts, row_keys, pad_id(run))
    rewards = score(run, batch)
    flat = _flat(rewards, batch.group)
    fresh_zero = int(flat.sum())
    # rollout replay: this step's informative groups enter the buffer; the oldest ones leave
    taken = [state["buffer"].pop(0) for _ in range(replay)]
    for g in range(batch.num_groups):
        if not bool(flat[g]):
            group_rows = batch.select((batch.group == g).nonzero().flatten())
            group_rows.group = torch.zeros(len(group_rows), dtype=torch.long)
            # kept with its reward terms: a replayed group is not scored again (score once)
            group_rows.rewards = None
            state["buffer"].append(group_rows)
    del state["buffer"][:max(0, len(state["buffer"]) - s.buffer_size)]
    if taken:
        batch = RolloutBatch.concat([batch, *taken], pad_id(run))
        flat = _flat(score(run, batch), batch.group)
    state["groups"] += len(flat)
    state["zero_adv_groups"] += int(flat.sum())
    state["replayed"] += len(taken)
    stats = {
        "dots/rollouts": float(generated), "dots/replayed_groups": float(len(taken)),
        "dots/fresh_zero_adv_groups": float(fresh_zero),
        "dots/zero_adv_groups": float(flat.sum()),
        "dots/predicted_difficulty": float(predicted[[rest.index(i) for i in chosen]].mean())
        if chosen else 0.0}
    for key, value in stats.items():  # written with the step's metrics
        run.log(key, value)
    return batch
