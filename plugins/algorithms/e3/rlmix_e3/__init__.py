"""E3 (efficient exploration): a rollout budget allocated by difficulty, and a sampling
temperature adjusted every step to hold the policy's entropy at a target.

An ``rlmix_sample`` owner (it replaces the core's default sampler, because it chooses both how
many completions each prompt gets and the temperature): the step's budget
``prompts_per_step * budget_per_prompt`` is split across prompts by their estimated difficulty
(1 - the posterior mean success rate, from ``run.state["e3"]``), at least ``min_rollouts`` and at
most ``max_rollouts`` each; after sampling, the temperature moves by ``temp_lr * (target -
entropy)``, where ``entropy`` is the mean per-token entropy of the step's samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.sampling import count_rollouts, generate, pad_id, prompt_key, regroup, score
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "e3"


@dataclass
class Settings:
    budget_per_prompt: int = 0  # rollouts per step / prompts_per_step; 0 = group_size
    min_rollouts: int = 2  # every prompt gets at least this many
    max_rollouts: int = 0  # and at most this many; 0 = 2 * budget_per_prompt
    threshold: float = 0.5  # a rollout succeeds when its reward is above this
    prior_a: float = 1.0  # Beta prior of a prompt's success rate
    prior_b: float = 1.0
    key: str = "text"  # prompt identity: "text" or "id"
    allocate: bool = True  # false: group_size each (only the temperature control)
    target_entropy: float = 0.0  # nats per token; 0 = the first step's measured entropy
    temp_lr: float = 0.5  # temperature change per nat of entropy error
    temp_min: float = 0.3
    temp_max: float = 2.0

    def __post_init__(self) -> None:
        if self.budget_per_prompt < 0 or self.max_rollouts < 0:
            raise ValueError("budget_per_prompt and max_rollouts must be >= 0")
        if self.min_rollouts < 1:
            raise ValueError(f"min_rollouts must be >= 1, got {self.min_rollouts}")
        if self.prior_a <= 0 or self.prior_b <= 0:
            raise ValueError("prior_a and prior_b must be > 0")
        if self.key not in ("text", "id"):
            raise ValueError(f"key must be 'text' or 'id', got {self.key!r}")
        if self.target_entropy < 0 or self.temp_lr < 0:
            raise ValueError("target_entropy and temp_lr must be >= 0")
        if not 0 < self.temp_min <= self.temp_max:
            raise ValueError(f"temp_min/temp_max: need 0 < temp_min <= temp_max, got "
                             f"{self.temp_min}, {self.temp_max}")


def difficulty_allocation(difficulty: torch.Tensor, budget: int, min_n: int,
                          max_n: int) -> list[int]:
    """Rollouts per prompt: ``min_n`` each, the rest of ``budget`` in proportion to
    ``difficulty`` (largest remainders, ties to the earlier prompt), none above ``max_n``. With
    no difficulty at all the rest is split evenly."""
    m = len(difficulty)
    if m * min_n > budget:
        raise ValueError(f"budget {budget} cannot give {m} prompts {min_n} rollouts each")
    counts = [min_n] * m
    rest = budget - m * min_n
    w = difficulty.double().clamp(min=0)
    while rest > 0:
        room = torch.tensor([c < max_n for c in counts])
        if not bool(room.any()):
            break
        ww = torch.where(room, w, torch.zeros_like(w))
        if float(ww.sum()) <= 0:
            ww = room.double()
        share = ww / ww.sum() * rest
        add = [min(int(x), max_n - c) for x, c in zip(share.floor().tolist(), counts)]
        if sum(add) == 0:  # hand out single rollouts by largest remainder
            frac = (share - share.floor()).tolist()
            order = sorted((i for i in range(m) if room[i]), key=lambda i: (-frac[i], i))
            add = [0] * m
            for i in order[:rest]:
                add[i] = 1
        counts = [c + a for c, a in zip(counts, add)]
        rest -= sum(add)
    return counts


def entropy_temperature_step(temperature: float, entropy: float, target: float, lr: float,
                             low: float, high: float) -> float:
    """The next temperature: ``clip(T + lr * (target - entropy), low, high)``: raise it when the
    samples are less random than the target, lower it when they are more."""
    return min(high, max(low, temperature + lr * (target - entropy)))


def sample_entropy(batch: RolloutBatch) -> float:
    """Mean per-token entropy of the sampling distribution, estimated from the sampled tokens'
    log-probs (``-E[log p]`` over completion tokens)."""
    mask = batch.completion_mask
    return float(-(batch.behavior_logp * mask).sum() / mask.sum().clamp(min=1))


def _state(run: Run) -> dict[str, Any]:
    s: Settings = run.settings(NAME)
    state = run.state.setdefault(NAME, {"rollouts": 0, "posterior": {}, "temperature": None,
                                        "target": None, "entropy": []})
    if state["temperature"] is None:  # start from the manifest's temperature
        state["temperature"] = min(s.temp_max, max(s.temp_min,
                                                   float(run.config.sampling.temperature)))
    return state


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s: Settings = run.settings(NAME)
    _state(run)
    per = s.budget_per_prompt or int(run.config.train.group_size)
    if per < s.min_rollouts:
        raise rlmix.ConfigError(f"e3.min_rollouts ({s.min_rollouts}) is above the budget per "
                                f"prompt ({per})")


@rlmix.hookimpl
def rlmix_sample(run: Run, prompts: list[Prompt]) -> RolloutBatch:
    s: Settings = run.settings(NAME)
    state = _state(run)
    per = s.budget_per_prompt or int(run.config.train.group_size)
    keys = [prompt_key(p, s.key) for p in prompts]
    post = [state["posterior"].get(k, (s.prior_a, s.prior_b)) for k in keys]
    difficulty = torch.tensor([b / (a + b) for a, b in post])
    if s.allocate:
        counts = difficulty_allocation(difficulty, per * len(prompts), s.min_rollouts,
                                       s.max_rollouts or 2 * per)
    else:
        counts = [per] * len(prompts)
    temperature = float(state["temperature"])
    parts, row_keys = [], []
    for n in sorted(set(counts)):  # one generation call per distinct count
        chosen = [i for i, c in enumerate(counts) if c == n]
        part = generate(run, [prompts[i] for i in chosen], n, temperature=temperature)
        parts.append(part)
        row_keys += [f"{chosen[g]}" for g in part.group.tolist()]
    batch = regroup(parts, row_keys, pad_id(run))
    generated = len(batch)
    count_rollouts(run, NAME, generated)
    ok = score(run, batch) > s.threshold
    for g in range(batch.num_groups):
        rows = (batch.group == g).nonzero().flatten()
        k = prompt_key(batch.prompts[int(rows[0])], s.key)
        a, b = state["posterior"].get(k, (s.prior_a, s.prior_b))
        wins = int(ok[rows].sum())
        state["posterior"][k] = (a + wins, b + len(rows) - wins)
    entropy = sample_entropy(batch)
    if state["target"] is None:
        state["target"] = s.target_entropy or entropy
    state["temperature"] = entropy_temperature_step(temperature, entropy, state["target"],
                                                    s.temp_lr, s.temp_min, s.temp_max)
    state["entropy"].append(entropy)
    del state["entropy"][:-1000]
    stats = {
        "e3/rollouts": float(generated), "e3/temperature": temperature,
        "e3/next_temperature": float(state["temperature"]), "e3/entropy": entropy,
        "e3/target_entropy": float(state["target"]),
        "e3/max_rollouts_per_prompt": float(max(counts)),
        "e3/min_rollouts_per_prompt": float(min(counts))}
    for key, value in stats.items():  # written with the step's metrics
        run.log(key, value)
    return batch
