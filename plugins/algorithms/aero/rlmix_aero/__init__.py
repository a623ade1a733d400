"""AERO (Adaptive Efficient Rollout Optimization): a Beta posterior per prompt over its success
rate, prompt screening and adaptive rollout allocation at a fixed rollout budget, and selective
rejection of the rollouts that carry no group-relative signal.

It runs in ``rlmix_select_prompts`` and an ``rlmix_sample`` wrapper (see README, "Our
reading"):

1. before the owner samples (``rlmix_select_prompts``, which returns a new list): draw a
   candidate pool (the step's prompts plus extra prompts from ``rlmix_prompts`` under negative
   keys), rank it by the posterior probability that a group of ``train.group_size`` rollouts comes
   out all-same, and hand the owner the best ``slots``;
2. after: score the owner's batch, then spend the rest of the step's budget
   (``prompts_per_step * group_size`` rollouts in all) on rescuing all-same groups in chunks, or
   on new prompts from the pool, through ``rlmix_generate``;
3. update every prompt's posterior, then drop groups that are still all-same (and, optionally,
   down-sample the failures of low-success groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix import sampling
from rlmix.types import GenerationRequest, Prompt, RolloutBatch, Run

NAME = "aero"
KEYS = ("text", "id")


@dataclass
class Settings:
    threshold: float = 0.5  # a rollout succeeds when its reward is above this
    prior_a: float = 1.0  # Beta prior pseudo-successes
    prior_b: float = 1.0  # Beta prior pseudo-failures
    key: str = "text"  # prompt identity: its chat text, or Prompt.id (falls back to the text)
    pool_factor: int = 2  # candidate pool = pool_factor * prompts_per_step prompts
    rescue_fraction: float = 0.25  # share of the step's budget held back from the owner's call
    rescue_chunk: int = 2  # extra rollouts per rescue of an all-same group
    min_break: float = 0.1  # rescue only while P(next chunk breaks the tie) >= this
    reject_above: float = 0.5  # a new pool prompt is skipped when P(all-same) is above this
    drop_dead: bool = True  # drop groups still all-same after the budget is spent
    prune_k: float = 0.0  # >0: low-success groups keep max(1, ceil(k * successes)) failures
    forget: float = 1.0  # per-step decay of a pooled prompt's evidence toward the prior

    def __post_init__(self) -> None:
        if self.key not in KEYS:
            raise ValueError(f"key: {self.key!r} is not allowed; choose one of {', '.join(KEYS)}")
        if self.prior_a <= 0 or self.prior_b <= 0:
            raise ValueError("prior_a and prior_b must be > 0")
        if self.pool_factor < 1:
            raise ValueError("pool_factor must be >= 1")
        if not 0.0 <= self.rescue_fraction < 1.0:
            raise ValueError("rescue_fraction must be in [0, 1)")
        if self.rescue_chunk < 1:
            raise ValueError("rescue_chunk must be >= 1")
        if not 0.0 <= self.min_break <= 1.0 or not 0.0 <= self.reject_above <= 1.0:
            raise ValueError("min_break and reject_above must be in [0, 1]")
        if self.prune_k < 0:
            raise ValueError("prune_k must be >= 0")
        if not 0.0 < self.forget <= 1.0:
            raise ValueError("forget must be in (0, 1]")


# ---------------------------------------------------------------- Beta-binomial math


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def all_same_probability(a: float, b: float, n: int) -> float:
    """Posterior-predictive probability that ``n`` new rollouts all succeed or all fail, under
    ``p ~ Beta(a, b)``: ``B(a+n, b)/B(a, b) + B(a, b+n)/B(a, b)`` (1 for ``n <= 1``)."""
    if n <= 1:
        return 1.0
    base = _log_beta(a, b)
    return min(1.0, math.exp(_log_beta(a + n, b) - base) + math.exp(_log_beta(a, b + n) - base))


def break_probability(a: float, b: float, c: int, all_correct: bool) -> float:
    """Probability that ``c`` more rollouts hold at least one outcome unlike an all-same group's:
    a failure for an all-correct group (``1 - B(a+c, b)/B(a, b)``), a success for an all-wrong
    one (``1 - B(a, b+c)/B(a, b)``)."""
    if c <= 0:
        return 0.0
    base = _log_beta(a, b)
    same = _log_beta(a + c, b) if all_correct else _log_beta(a, b + c)
    return max(0.0, 1.0 - math.exp(same - base))


def select_prompts(posteriors: list[tuple[float, float]], slots: int, n: int) -> list[int]:
    """Indices of the ``slots`` candidates least likely to give an all-same group of ``n``
    rollouts (ties keep pool order, so with no evidence the first candidates win)."""
    order = sorted(range(len(posteriors)),
                   key=lambda i: (all_same_probability(*posteriors[i], n), i))
    return sorted(order[:slots])


def next_allocation(groups: list[tuple[float, float, int, int]],
                    candidates: list[tuple[float, float]], remaining: int, group_size: int,
                    chunk: int, min_break: float, reject_above: float,
                    ) -> tuple[str, int, int] | None:
    """The next use of ``remaining`` rollouts: ``("rescue", group, c)``, ``("new", candidate,
    n)`` or ``("extend", group, remaining)``; ``None`` when nothing can take them.

    ``groups`` are ``(a, b, successes, count)`` with the posterior already holding this step's
    draws; ``candidates`` are the unused pool prompts' posteriors. The all-same group whose next
    chunk is likeliest to break the tie is rescued while that probability is at least
    ``min_break``; otherwise the unused candidate least likely to be all-same starts a new group
    (if that probability is at most ``reject_above`` and at least two rollouts remain);
    otherwise the smallest group takes what is left."""
    if remaining <= 0:
        return None
    c = min(chunk, remaining)
    best: tuple[float, int] | None = None
    for i, (a, b, s, n) in enumerate(groups):
        if 0 < s < n:
            continue
        p = break_probability(a, b, c, all_correct=s == n)
        if p >= min_break and (best is None or p > best[0]):
            best = (p, i)
    if best is not None:
        return ("rescue", best[1], c)
    if remaining >= 2 and candidates:
        n_new = min(group_size, remaining)
        dead = [all_same_probability(a, b, n_new) for a, b in candidates]
        j = min(range(len(dead)), key=lambda k: (dead[k], k))
        if dead[j] <= reject_above:
            return ("new", j, n_new)
    if not groups:
        return None
    smallest = min(range(len(groups)), key=lambda k: (groups[k][3], k))
    return ("extend", smallest, remaining)


def group_outcomes(success: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """``(successes, counts)`` per group, ``[G]`` each."""
    g = int(group.max()) + 1 if len(group) else 0
    counts = torch.zeros(g, dtype=torch.long).index_add_(0, group, torch.ones_like(group))
    wins = torch.zeros(g, dtype=torch.long).index_add_(0, group, success.long())
    return wins, counts


def dead_groups(success: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Boolean ``[G]``: groups whose outcomes are all success or all failure."""
    wins, counts = group_outcomes(success, group)
    return (counts > 0) & ((wins == 0) | (wins == counts))


def flat_groups(rewards: torch.Tensor, group: torch.Tensor, tol: float = 1e-8) -> torch.Tensor:
    """Boolean ``[G]``: groups whose rewards all agree (their group-relative advantage is 0)."""
    g = int(group.max()) + 1 if len(group) else 0
    r = rewards.to(torch.float64)
    hi = torch.full((g,), -math.inf, dtype=torch.float64).scatter_reduce(0, group, r, "amax")
    lo = torch.full((g,), math.inf, dtype=torch.float64).scatter_reduce(0, group, r, "amin")
    return (hi - lo) <= tol


def prune_rows(success: torch.Tensor, group: torch.Tensor, k: float,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Rows kept by selective rejection inside low-success groups: a mixed group whose success
    rate is below 1/2 keeps all its successes and ``max(1, ceil(k * successes))`` of its
    failures (chosen at random); every other row is kept. ``k <= 0`` keeps everything."""
    keep = torch.ones(len(success), dtype=torch.bool)
    if k <= 0 or len(success) == 0:
        return keep
    wins, counts = group_outcomes(success, group)
    for g in range(len(counts)):
        c, n = int(wins[g]), int(counts[g])
        if c == 0 or 2 * c >= n:
            continue
        failures = ((group == g) & ~success).nonzero().flatten()
        m = max(1, math.ceil(k * c))
        if m >= len(failures):
            continue
        drop = failures[torch.randperm(len(failures), generator=generator)[m:]]
        keep[drop] = False
    return keep


# ---------------------------------------------------------------- state


def prompt_key(prompt: Prompt, key: str) -> str:
    if key == "id" and prompt.id:
        return f"id:{prompt.id}"
    return "text:" + "\n".join(f"{m.get('role', '')}: {m.get('content', '')}"
                               for m in prompt.messages)


def _state(run: Run) -> dict[str, Any]:
    return run.state.setdefault(NAME, {"posterior": {}, "steps": 0, "rollouts": 0,
                                       "dead_groups": 0, "groups": 0})


def _posterior(state: dict[str, Any], key: str, s: Settings) -> tuple[float, float]:
    a, b = state["posterior"].get(key, (s.prior_a, s.prior_b))
    return float(a), float(b)


def pool_keys(step: int, pool_factor: int) -> list[int]:
    """The ``rlmix_prompts`` step keys of the extra candidates of training step ``step``:
    ``-1 - step * (pool_factor - 1) - j``. All negative, so never a real step, and distinct
    across steps, so each step sees fresh extras."""
    extra = pool_factor - 1
    return [-1 - step * extra - j for j in range(extra)]


# ---------------------------------------------------------------- the hooks


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    _state(run)


def _generate(run: Run, prompt: Prompt, n: int) -> RolloutBatch:
    smp = run.config.sampling
    request = GenerationRequest(prompts=[prompt], n=n, temperature=float(smp.temperature),
                                top_p=float(smp.top_p), top_k=int(smp.top_k),
                                max_new_tokens=int(smp.max_new_tokens))
    part = run.hook.rlmix_generate(run=run, request=request)
    if part is None:
        raise RuntimeError("aero: no plugin returned a batch from rlmix_generate")
    if not part.prompts:
        part.prompts = [prompt] * len(part)
    return part


def _score(run: Run, batch: RolloutBatch, threshold: float) -> torch.Tensor:
    from rlmix.loop import score  # the core's weighted sum; it scores again later, idempotently

    score(run, batch)
    assert batch.rewards is not None
    return batch.rewards > threshold


@rlmix.hookimpl
def rlmix_select_prompts(run: Run, prompts: list[Prompt]) -> list[Prompt]:
    """Before the owner samples: the prompts it generates for, chosen from a candidate pool by
    their posteriors (a new list; the caller's is left alone). What the wrapper needs after the
    owner's batch is kept in ``run.plugin_resources("aero")["selection"]``."""
    s: Settings = run.settings(NAME)
    state = _state(run)
    group_size = int(run.config.train.group_size)
    budget = len(prompts) * group_size
    pool = list(prompts)
    for key in pool_keys(run.step, s.pool_factor):
        pool.extend(run.hook.rlmix_prompts(run=run, step=key) or [])
    unique: dict[str, Prompt] = {}  # one candidate per prompt identity, in pool order
    for p in pool:
        unique.setdefault(prompt_key(p, s.key), p)
    keys, pool = list(unique), list(unique.values())
    if s.forget < 1.0:
        for k in set(keys):
            if k in state["posterior"]:
                a, b = state["posterior"][k]
                state["posterior"][k] = (s.prior_a + s.forget * (a - s.prior_a),
                                         s.prior_b + s.forget * (b - s.prior_b))
    held_back = math.ceil(s.rescue_fraction * budget / group_size) if len(prompts) > 1 else 0
    slots = max(1, len(prompts) - held_back)
    chosen = select_prompts([_posterior(state, k, s) for k in keys], slots, group_size)
    selected = [pool[i] for i in chosen]  # the owner samples these
    run.plugin_resources(NAME)["selection"] = {
        "step": run.step, "prompts": selected, "budget": budget, "keys": keys, "pool": pool,
        "chosen": chosen}
    return selected


@rlmix.hookimpl(wrapper=True)
def rlmix_sample(run: Run, prompts: list[Prompt]):
    owner = yield
    selection = run.plugin_resources(NAME).pop("selection", None)
    if selection is None or selection["step"] != run.step:
        # not a batch aero selected (a wrapper's extra round samples other prompts): as is
        return owner
    # a later rlmix_select_prompts may have cut the choice (a per-rank share)
    sampling.require_whole_selection(NAME, selection["prompts"], prompts)
    s: Settings = run.settings(NAME)
    state = _state(run)
    group_size = int(run.config.train.group_size)
    budget, keys, pool, chosen = (selection[k] for k in ("budget", "keys", "pool", "chosen"))

    parts = [owner]
    row_keys = [prompt_key(p, s.key) for p in (owner.prompts or
                                               [prompts[g] for g in owner.group.tolist()])]
    successes = [_score(run, owner, s.threshold)]
    wins: dict[str, int] = {}
    count: dict[str, int] = {}
    by_key = {keys[i]: pool[i] for i in chosen}
    for k, ok in zip(row_keys, successes[0].tolist()):
        wins[k] = wins.get(k, 0) + int(ok)
        count[k] = count.get(k, 0) + 1
    for k, p in zip(row_keys, owner.prompts):
        by_key.setdefault(k, p)
    unused = [i for i, k in enumerate(keys) if k not in count and k not in by_key]
    remaining = budget - len(owner)
    owner_rollouts, rescued, added = len(owner), 0, 0
    while remaining > 0:
        order = list(count)
        groups = []
        for k in order:
            a, b = _posterior(state, k, s)
            groups.append((a + wins[k], b + count[k] - wins[k], wins[k], count[k]))
        cands = [_posterior(state, keys[i], s) for i in unused]
        action = next_allocation(groups, cands, remaining, group_size, s.rescue_chunk,
                                 s.min_break, s.reject_above)
        if action is None:
            break
        kind, index, n = action
        if kind == "new":
            i = unused.pop(index)
            k, prompt = keys[i], pool[i]
            by_key[k] = prompt
            added += n
        else:
            k = order[index]
            prompt = by_key[k]
            rescued += n
        part = _generate(run, prompt, n)
        ok = _score(run, part, s.threshold)
        parts.append(part)
        successes.append(ok)
        row_keys.extend([k] * len(part))
        wins[k] = wins.get(k, 0) + int(ok.sum())
        count[k] = count.get(k, 0) + len(part)
        remaining -= len(part)

    # the posterior takes every outcome of this step
    for k in count:
        a, b = _posterior(state, k, s)
        state["posterior"][k] = (a + wins[k], b + count[k] - wins[k])

    pad = run.tokenizer.pad_token_id if run.tokenizer is not None else 0
    batch = RolloutBatch.concat(parts, pad) if len(parts) > 1 else owner
    success = torch.cat(successes)
    ids = {k: g for g, k in enumerate(dict.fromkeys(row_keys))}
    group = torch.tensor([ids[k] for k in row_keys], dtype=torch.long)
    order_rows = torch.argsort(group, stable=True)  # groups contiguous, prompt-major
    batch = batch.select(order_rows)
    batch.group = group[order_rows]
    success = success[order_rows]

    dead = dead_groups(success, batch.group)
    generated = len(batch)
    wasted = int(dead[batch.group].sum())
    keep = torch.ones(len(batch), dtype=torch.bool)
    assert batch.rewards is not None
    flat = flat_groups(batch.rewards, batch.group)  # exactly zero advantage under any scale
    if s.drop_dead and not bool(flat.all()):
        keep &= ~flat[batch.group]
    if s.prune_k > 0:
        gen = torch.Generator().manual_seed(int(run.config.train.seed) * 7919 + run.step)
        keep &= prune_rows(success, batch.group, s.prune_k, gen)
    if not bool(keep.all()):
        batch = batch.select(keep.nonzero().flatten())
        _, batch.group = torch.unique(batch.group, return_inverse=True)

    state["steps"] += 1
    state["rollouts"] += generated
    state["groups"] += len(dead)
    state["dead_groups"] += int(dead.sum())
    stats = {
        "aero/rollouts": float(generated),
        "aero/owner_rollouts": float(owner_rollouts),
        "aero/rescue_rollouts": float(rescued),
        "aero/new_prompt_rollouts": float(added),
        "aero/groups": float(len(dead)),
        "aero/dead_groups": float(dead.sum()),
        "aero/wasted_fraction": wasted / max(generated, 1),
        "aero/dropped_samples": float(generated - len(batch)),
        "aero/prompts_tracked": float(len(state["posterior"])),
    }
    for key, value in stats.items():  # written with the step's metrics
        run.log(key, value)
    # which prompts this step chose (not a metric; tests and debugging read it)
    run.plugin_resources(NAME)["selected"] = [keys[i] for i in chosen]
    return batch
