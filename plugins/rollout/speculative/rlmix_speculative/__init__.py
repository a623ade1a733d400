"""Speculative rollout: lossless speculative sampling with an adaptive (TLT), suffix
(SuffixDecoding) or previous-rollout (SPEC-RL) drafter, and a per-batch choice of the draft
length from measured acceptance and costs.

The plugin owns ``rlmix_generate`` (list it after ``hf``): the batch it returns has the layout of
``rlmix_hf``'s, and its tokens are distributed exactly as plain sampling's, so every loss works
unchanged. ``rlmix_step_end`` trains the adaptive drafter on the hidden states the step's
rollouts computed and adds ``speculative/*`` metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import rlmix
from rlmix.sampling import encode_prompts, stop_token_ids
from rlmix.types import GenerationRequest, RolloutBatch, Run
from rlmix_speculative.drafters import (
    AdaptiveDrafter,
    NgramIndex,
    PreviousRolloutDrafter,
    SuffixDrafter,
    load_drafter,
    save_drafter,
)
from rlmix_speculative.engine import (
    Draft,
    DraftContext,
    SamplingParams,
    SpecOutput,
    SpecStats,
    residual_distribution,
    speculative_sample,
    verify_block,
)
from rlmix_speculative.strategy import CostModel, expected_tokens

NAME = "speculative"
DRAFTERS = ("adaptive", "suffix", "previous_rollout", "off")
STRATEGIES = ("auto", "fixed")

__all__ = [
    "AdaptiveDrafter", "CostModel", "Draft", "DraftContext", "NgramIndex",
    "PreviousRolloutDrafter", "SamplingParams", "Settings", "SpecOutput", "SpecStats",
    "Speculator", "SuffixDrafter", "expected_tokens", "load_drafter", "residual_distribution",
    "save_drafter", "speculative_sample", "verify_block",
]


@dataclass
class Settings:
    drafter: str = "suffix"  # adaptive | suffix | previous_rollout | off
    k: int = 4  # the longest draft per verify pass
    strategy: str = "auto"  # auto: choose k (or off) per batch from measured costs; fixed: k
    # draft lengths the auto strategy chooses from; [] = 0, 1, 2, 4, ... up to k
    candidates: list[int] = field(default_factory=list)
    explore: float = 0.1  # probability of trying another candidate (auto)
    batch_size: int = 0  # prompts per generation call; 0 = all at once
    stop_at_eos: bool = True
    seed: int = 0
    # suffix
    max_match: int = 8  # longest suffix looked up
    spec_factor: float = 1.0  # draft length = min(k, ceil(spec_factor * match length))
    index_tokens: int = 200_000  # tokens the suffix index keeps (oldest half dropped past it)
    # previous_rollout
    max_prompts: int = 10_000  # prompts whose last rollouts are kept
    realign: int = 3  # tokens searched in the old rollout after the row diverged from it
    # adaptive
    window: int = 16  # positions the drafter layer attends over
    train_steps: int = 8  # drafter AdamW steps per RL step (rlmix_step_end)
    train_positions: int = 256  # positions per drafter step
    lr: float = 1.0e-3
    buffer_rows: int = 256  # newest sequences whose hidden states are kept for training
    feature_weight: float = 0.1  # weight of the smooth-L1 feature loss next to the KL
    init_from: str = ""  # a drafter file written by save_drafter, loaded at configure

    def __post_init__(self) -> None:
        rlmix.check_choices(self, drafter=DRAFTERS, strategy=STRATEGIES)
        if not 0 <= self.k <= 32:
            raise ValueError(f"k: {self.k} must be in [0, 32]")
        if any(not 0 <= c <= 32 for c in self.candidates):
            raise ValueError(f"candidates: {list(self.candidates)} must be in [0, 32]")
        if not 0.0 <= self.explore <= 1.0:
            raise ValueError(f"explore: {self.explore} must be in [0, 1]")
        for name in ("batch_size", "train_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")
        for name in ("max_match", "index_tokens", "max_prompts", "realign", "window",
                     "train_positions", "buffer_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.spec_factor <= 0:
            raise ValueError(f"spec_factor: {self.spec_factor} must be > 0")
        if self.lr <= 0:
            raise ValueError(f"lr: {self.lr} must be > 0")
        if self.feature_weight < 0:
            raise ValueError(f"feature_weight: {self.feature_weight} must be >= 0")


def default_candidates(k: int) -> list[int]:
    out, c = {0}, 1
    while c < k:
        out.add(c)
        c *= 2
    if k:
        out.add(k)
    return sorted(out)


class Speculator:
    """The plugin's per-run object (``run.plugin_resources("speculative")["speculator"]``):
    drafter, cost model,
    metrics of the calls since the last step end."""

    def __init__(self, settings: Settings, model: Any) -> None:
        self.settings = settings
        s = settings
        self.drafter: Any
        if s.drafter == "adaptive":
            self.drafter = AdaptiveDrafter(model, window=s.window, lr=s.lr,
                                           buffer_rows=s.buffer_rows,
                                           train_positions=s.train_positions,
                                           feature_weight=s.feature_weight, seed=s.seed)
            if s.init_from:
                saved = load_drafter(s.init_from, model)
                self.drafter.load_state({"config": saved.config,
                                         "layer": saved.layer.state_dict()})
        elif s.drafter == "suffix":
            self.drafter = SuffixDrafter(s.max_match, s.spec_factor, s.index_tokens)
        elif s.drafter == "previous_rollout":
            self.drafter = PreviousRolloutDrafter(s.max_prompts, s.realign)
        else:
            self.drafter = None
        candidates = list(s.candidates) or default_candidates(s.k)
        if self.drafter is None:
            candidates = [0]
        self.cost = CostModel(candidates=candidates, explore=s.explore, seed=s.seed)
        self.stats: list[SpecStats] = []
        self._state: dict[str, Any] | None = None

    # ---- checkpointed state (run.plugin_state("speculative"), i.e. run.state["speculative"])
    def state(self) -> dict[str, Any]:
        # the cost model's timings belong to this machine and this process (a resumed run may
        # land elsewhere): they stay out of the checkpoint and are measured again
        return {"drafter": self.drafter.state() if self.drafter is not None else None,
                "drafter_kind": self.settings.drafter}

    def publish(self, run: Run) -> None:
        """Write our state into ``run.plugin_state("speculative")`` (checkpointed)."""
        self._state = run.plugin_state(NAME)
        self._state.update(self.state())

    def sync(self, run: Run) -> None:
        """Adopt the checkpointed state when a restore replaced it; then publish ours."""
        current = run.plugin_state(NAME)
        if current is not self._state:
            if current.get("drafter") and current.get("drafter_kind") == self.settings.drafter:
                self.drafter.load_state(current["drafter"])
        self.publish(run)

    def choose_k(self) -> int:
        if self.drafter is None:
            return 0
        if self.settings.strategy == "fixed":
            return self.settings.k
        return self.cost.choose()

    def generate(self, model: Any, ids: torch.Tensor, attn: torch.Tensor, keys: list[str],
                 request: GenerationRequest, eos_ids: list[int], pad_id: int,
                 autocast: Any = None, k: int | None = None) -> SpecOutput:
        k = self.choose_k() if k is None else k
        sampling = SamplingParams(request.temperature, request.top_p, request.top_k)
        adaptive = isinstance(self.drafter, AdaptiveDrafter)
        out = speculative_sample(model, ids, attn, request.n, request.max_new_tokens, sampling,
                                 eos_ids, pad_id, drafter=self.drafter, k=k,
                                 autocast=autocast, keys=keys, collect_hidden=adaptive)
        if self.settings.strategy == "auto":
            self.cost.update(out.stats)
        if adaptive:
            self.drafter.add_rollouts(out.hidden)
            out.hidden = []
        self.stats.append(out.stats)
        return out

    def metrics(self) -> dict[str, float]:
        if not self.stats:
            return {}
        total = SpecStats(k=max(s.k for s in self.stats))
        for s in self.stats:
            for name in ("passes", "row_passes", "tokens", "proposed", "slots", "accepted"):
                setattr(total, name, getattr(total, name) + getattr(s, name))
            for name in ("prefill_s", "verify_s", "draft_s", "total_s"):
                setattr(total, name, getattr(total, name) + getattr(s, name))
        self.stats = []
        return total.as_metrics(NAME)


def speculator(run: Run) -> Speculator:
    spec = run.plugin_resources(NAME).get("speculator")
    if spec is None:
        raise RuntimeError("the speculative plugin was not configured (rlmix_configure)")
    spec.sync(run)
    return spec


def prompt_key(run: Run, prompt: rlmix.Prompt) -> str:
    assert run.policy is not None
    return prompt.id or run.policy.chat_text(prompt.messages)


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s: Settings = run.settings(NAME)
    if run.policy is None:
        return
    model = run.policy.model
    if not hasattr(model, "base_model") or model.get_output_embeddings() is None:
        raise rlmix.ConfigError(f"{NAME}.drafter: the policy model has no base model / LM head "
                                "to verify drafts with")
    if s.init_from and not Path(s.init_from).exists():
        raise rlmix.ConfigError(f"{NAME}.init_from: no drafter file at {s.init_from!r}")
    try:
        spec = Speculator(s, model)
    except ValueError as exc:
        raise rlmix.ConfigError(f"{NAME}.init_from: {exc}") from exc
    run.plugin_resources(NAME)["speculator"] = spec
    spec.publish(run)


@rlmix.hookimpl
def rlmix_generate(run: Run, request: GenerationRequest) -> RolloutBatch:
    assert run.policy is not None
    spec = speculator(run)
    s = spec.settings
    policy = run.policy
    tok = policy.tokenizer
    eos_ids = stop_token_ids(policy) if s.stop_at_eos else [-1]
    step = s.batch_size or len(request.prompts)
    parts = []
    for start in range(0, len(request.prompts), step):
        chunk = request.prompts[start:start + step]
        ids, attn = encode_prompts(run, chunk)
        ids, attn = ids.to(policy.device), attn.to(policy.device)
        out = spec.generate(policy.model, ids, attn, [prompt_key(run, p) for p in chunk],
                            request, eos_ids, tok.pad_token_id, autocast=policy.autocast())
        completion, cmask, logp = out.completion, out.completion_mask, out.logp
        prompt_ids = ids.repeat_interleave(request.n, 0)
        prompt_attn = attn.repeat_interleave(request.n, 0)
        width = prompt_ids.shape[1]
        texts = tok.batch_decode(completion.masked_fill(cmask == 0, tok.pad_token_id).cpu(),
                                 skip_special_tokens=True)
        rows = len(chunk) * request.n
        parts.append(RolloutBatch(
            group=torch.arange(len(chunk)).repeat_interleave(request.n),
            tokens=torch.cat([prompt_ids, completion], 1).cpu(),
            attention_mask=torch.cat([prompt_attn, cmask.long()], 1).cpu(),
            completion_mask=torch.cat([torch.zeros_like(prompt_attn, dtype=torch.float),
                                       cmask], 1).cpu(),
            behavior_logp=torch.cat([torch.zeros(rows, width), logp.cpu()], 1),
            policy_version=torch.full((rows,), run.policy_version, dtype=torch.long),
            texts=texts,
            prompts=[p for p in chunk for _ in range(request.n)],
        ))
    return parts[0] if len(parts) == 1 else RolloutBatch.concat(parts, tok.pad_token_id)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    spec = run.plugin_resources(NAME).get("speculator")
    if spec is None:
        return
    spec.sync(run)
    metrics.update(spec.metrics())
    if isinstance(spec.drafter, AdaptiveDrafter) and spec.settings.train_steps > 0:
        import time

        t0 = time.perf_counter()
        metrics.update(spec.drafter.train(spec.settings.train_steps))
        metrics[f"{NAME}/drafter_train_s"] = time.perf_counter() - t0
    spec.publish(run)


def save_run_drafter(run: Run, path: str | Path) -> Path:
    """Save the run's adaptive drafter on its own (for deployment)."""
    spec = speculator(run)
    if not isinstance(spec.drafter, AdaptiveDrafter):
        raise ValueError(f"{NAME}.drafter is {spec.settings.drafter!r}: only the adaptive "
                         "drafter has weights to save")
    return save_drafter(spec.drafter, path)
