"""The data that flows through the hooks: Prompt, RolloutBatch, LossTerms, Run, HarnessUpdate.

Field names here are public API (DESIGN §4, §6): third-party plugins read and write them.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    import pluggy
    from omegaconf import DictConfig

    from rlmix.policy import Policy

LOSS_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass
class Prompt:
    """One task. ``messages`` is a chat (``[{"role": ..., "content": ...}]``); ``answer`` is what
    the env's scorer checks against; ``info`` carries anything else the env wants back.
    ``tools`` (optional) are JSON-schema tool specs (``{"type": "function", "function": {...}}``,
    as ``transformers.utils.get_json_schema`` makes them) that the engine passes to the chat
    template (``apply_chat_template(messages, tools=...)``), so the model sees the tools in its
    own template's format."""

    messages: list[dict[str, str]]
    answer: Any = None
    id: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None


@dataclass
class GenerationRequest:
    """What ``rlmix_generate`` is asked for. ``temperature == 0`` means greedy."""

    prompts: list[Prompt]
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32


_ROW_LISTS = ("texts", "info", "prompts")


@dataclass
class RolloutBatch:
    """N samples. Per-token tensors are ``[N, T]`` and aligned with ``tokens`` (prompt + completion,
    prompts left-padded). ``completion_mask`` is 1 on generated tokens only (0 on prompt,
    tool-output and padding tokens). ``behavior_logp[:, t]`` is the sampler's log-prob of
    ``tokens[:, t]`` (0 off the completion)."""

    group: torch.Tensor  # [N] long: index of the prompt each sample answers
    tokens: torch.Tensor  # [N, T] long
    attention_mask: torch.Tensor  # [N, T]
    completion_mask: torch.Tensor  # [N, T] float
    behavior_logp: torch.Tensor  # [N, T] float
    policy_version: torch.Tensor  # [N] long
    texts: list[str] = field(default_factory=list)
    prompts: list[Prompt] = field(default_factory=list)  # per sample (shared objects)
    info: list[dict[str, Any]] = field(default_factory=list)
    rewards: torch.Tensor | None = None  # [N]
    reward_terms: dict[str, torch.Tensor] = field(default_factory=dict)
    advantages: torch.Tensor | None = None  # [N] or [N, T]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # plugin tensors, [N, ...]

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if not self.info:
            self.info = [{} for _ in range(n)]
        for name in ("group", "attention_mask", "completion_mask", "behavior_logp",
                     "policy_version"):
            value = getattr(self, name)
            if value.shape[0] != n:
                raise ValueError(f"RolloutBatch.{name} has {value.shape[0]} rows, tokens has {n}")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_groups(self) -> int:
        return int(self.group.max().item()) + 1 if len(self) else 0

    def select(self, index: torch.Tensor | list[int]) -> RolloutBatch:
        """Rows ``index`` as a new batch (tensors indexed, lists picked, dicts per row)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        rows = idx.tolist()
        kwargs: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                kwargs[f.name] = value[idx]
            elif isinstance(value, dict):
                kwargs[f.name] = {k: v[idx] for k, v in value.items()}
            elif isinstance(value, list):
                kwargs[f.name] = [value[i] for i in rows] if value else []
            else:
                kwargs[f.name] = value
        return RolloutBatch(**kwargs)

    @staticmethod
    def concat(batches: list[RolloutBatch], pad_token_id: int = 0) -> RolloutBatch:
        """Stack batches row-wise, left-padding per-token tensors to the widest; ``group``
        indices of later batches are shifted so groups stay distinct."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        width = max(b.tokens.shape[1] for b in batches)
        offsets = itertools.accumulate([b.num_groups for b in batches], initial=0)
        out: dict[str, Any] = {"group": torch.cat([b.group + o for b, o in zip(batches, offsets)])}

        def pad(t: torch.Tensor, value: float) -> torch.Tensor:
            missing = width - t.shape[1]
            if missing == 0:
                return t
            filler = torch.full((t.shape[0], missing, *t.shape[2:]), value, dtype=t.dtype)
            return torch.cat([filler, t], dim=1)

        out["tokens"] = torch.cat([pad(b.tokens, pad_token_id) for b in batches])
        for name in ("attention_mask", "completion_mask", "behavior_logp"):
            out[name] = torch.cat([pad(getattr(b, name), 0) for b in batches])
        out["policy_version"] = torch.cat([b.policy_version for b in batches])
        for name in _ROW_LISTS:
            out[name] = [x for b in batches for x in getattr(b, name)]
        if all(b.rewards is not None for b in batches):
            out["rewards"] = torch.cat([b.rewards for b in batches])  # type: ignore[misc]
        keys = set.intersection(*(set(b.reward_terms) for b in batches))
        out["reward_terms"] = {k: torch.cat([b.reward_terms[k] for b in batches]) for k in keys}
        def pad_aligned(t: torch.Tensor, b: RolloutBatch) -> torch.Tensor:
            # per-token advantages and extras (aligned with tokens) are left-padded like them
            aligned = t.dim() >= 2 and t.shape[1] == b.tokens.shape[1]
            return pad(t, 0) if aligned else t

        if all(b.advantages is not None for b in batches):
            out["advantages"] = torch.cat([pad_aligned(b.advantages, b)  # type: ignore[arg-type]
                                           for b in batches])
        keys = set.intersection(*(set(b.extras) for b in batches))
        out["extras"] = {k: torch.cat([pad_aligned(b.extras[k], b) for b in batches])
                         for k in keys}
        return RolloutBatch(**out)

    def token_advantages(self) -> torch.Tensor:
        """Advantages broadcast to ``[N, T]``."""
        if self.advantages is None:
            raise ValueError("batch has no advantages yet (rlmix_advantage has not run)")
        if self.advantages.dim() == 1:
            return self.advantages[:, None].expand_as(self.completion_mask)
        return self.advantages


@dataclass
class Normalizers:
    """Counts over the data of one whole optimizer step (all its minibatches), so that splitting
    the step's data into minibatches never changes the gradient."""

    tokens: float  # completion tokens in the update
    sequences: float  # sequences in the update
    norm_constant: float  # the constant of seq-mean-token-sum-norm (max new tokens by default)


@dataclass
class Minibatch:
    """One forward/backward unit; ``last`` is True on the one that closes an optimizer step."""

    batch: RolloutBatch
    normalizers: Normalizers
    epoch: int = 0
    index: int = 0
    last: bool = True


@dataclass
class LossTerms:
    """What ``rlmix_clip`` returns. ``loss`` and ``mask`` are ``[n, T]``; ``mode`` is one of
    ``LOSS_MODES``; ``extra`` is an already-normalised scalar added after aggregation. The core
    fills ``value`` (the aggregated scalar) and ``minibatch`` before calling ``rlmix_update``."""

    loss: torch.Tensor
    mask: torch.Tensor
    mode: str = "token-mean"
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: torch.Tensor | None = None
    value: torch.Tensor | None = None
    minibatch: Minibatch | None = None

    def __post_init__(self) -> None:
        if self.mode not in LOSS_MODES:
            raise ValueError(f"unknown loss aggregation mode {self.mode!r}; choose one of "
                             f"{', '.join(LOSS_MODES)}")


@dataclass
class HarnessUpdate:
    """New texts for named harness components, with the evidence that justified them."""

    components: dict[str, str]
    evidence: str = ""
    parent_version: int = 0
    source: str = ""


@dataclass
class Run:
    """The object every hook receives."""

    config: DictConfig
    pm: pluggy.PluginManager
    settings_by_plugin: dict[str, Any]
    out_dir: Path
    policy: Policy | None = None
    step: int = 0
    policy_version: int = 0
    harness: dict[str, str] = field(default_factory=dict)
    harness_version: int = 0
    state: dict[str, Any] = field(default_factory=dict)  # checkpointed plugin state
    resources: dict[str, Any] = field(default_factory=dict)  # plugin objects, not checkpointed
    rng: random.Random = field(default_factory=random.Random)
    logger: Any = None
    optimizer: torch.optim.Optimizer | None = None
    plugin_names: list[str] = field(default_factory=list)
    # the background sampler of async mode (rlmix.async_sampling), set by the loop; core-internal
    async_sampler: Any = None
    # the copy training rollouts generate with (rlmix.sampler_weights), when a plugin gives one;
    # built by the loop in prepare_model; core-internal
    sampler_weights: Any = None
    # metrics plugins report through ``log``, written with the step's metrics line
    pending_metrics: dict[str, float] = field(default_factory=dict)
    # data parallelism, set by a trainer plugin (deepspeed): this process is rank shard[0] of
    # shard[1] and trains only its share of every batch's rows (``share``, ``minibatches``)
    shard: tuple[int, int] = (0, 1)

    @property
    def hook(self) -> Any:
        return self.pm.hook

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer if self.policy is not None else None

    def log(self, name: str, value: float) -> None:
        """Report a metric for the current step: it is written with the step's line of
        ``metrics.jsonl`` (the last value logged under ``name`` in a step wins). Plugins name
        their metrics ``<plugin>/<what>``. Safe to call from the async sampler's worker."""
        self.pending_metrics[str(name)] = float(value)

    def drain_metrics(self) -> dict[str, float]:
        """The metrics logged since the last drain, cleared (the loop calls this)."""
        out = dict(self.pending_metrics)
        for k in out:
            self.pending_metrics.pop(k, None)
        return out

    def plugin_state(self, name: str) -> dict[str, Any]:
        """Plugin ``name``'s checkpointed state: the dict ``run.state[name]`` (made on first
        use). Keyed by the plugin's entry-point name, so plugins never collide on free strings;
        what it holds must pickle with ``torch.save``."""
        return self.state.setdefault(str(name), {})

    def plugin_resources(self, name: str) -> dict[str, Any]:
        """Plugin ``name``'s objects that are not checkpointed (a reference model, a thread
        pool, a published service): the dict ``run.resources[name]`` (made on first use)."""
        return self.resources.setdefault(str(name), {})

    def share(self, n: int) -> tuple[int, int]:
        """The contiguous slice ``[lo, hi)`` of ``n`` items (prompts, rows) this process takes
        under data parallelism (``shard``; the first ``n % world`` ranks take one more, as
        ``torch.tensor_split``); ``(0, n)`` in one process."""
        rank, world = self.shard
        base, extra = divmod(int(n), max(1, int(world)))
        lo = rank * base + min(rank, extra)
        return lo, lo + base + (1 if rank < extra else 0)

    def settings(self, name: str) -> Any:
        """The validated settings dataclass of plugin ``name`` (its manifest block)."""
        try:
            return self.settings_by_plugin[name]
        except KeyError:
            known = ", ".join(sorted(self.settings_by_plugin)) or "none"
            raise KeyError(f"no settings for plugin {name!r} (plugins with settings: {known})"
                           ) from None

    def sample(self, prompts: list[Prompt]) -> RolloutBatch:
        """Sampling behind one call, the seam of asynchronous sampling. Synchronously, the
        ``rlmix_sample`` owner (with its wrappers) samples ``prompts`` as
        ``rlmix_select_prompts`` chose them. With an async sampler
        attached (``train.max_staleness > 0``), the batch of step ``self.step`` that the
        background worker sampled from the prompts it got from ``rlmix_prompts`` itself
        (``prompts`` is then ignored). With a sampler copy (``rlmix.sampler_weights``), the
        owner runs on a view of the run whose ``policy.model`` is that copy, and the copy may
        then free its weights until the next rollout (``rlmix.sampler_weights.after_rollout``)."""
        if self.async_sampler is not None:
            return self.async_sampler.take(self)
        prompts = self.select_prompts(prompts)
        if self.sampler_weights is None:
            batch = self.hook.rlmix_sample(run=self, prompts=prompts)
        else:  # a low-precision (or other) sampler copy
            from rlmix.sampler_weights import after_rollout, sampling_view

            view = sampling_view(self)
            try:
                batch = view.hook.rlmix_sample(run=view, prompts=prompts)
            finally:
                after_rollout(self, self.sampler_weights)
        if batch is None:
            raise RuntimeError("no plugin returned a batch from rlmix_sample")
        return batch

    def select_prompts(self, prompts: list[Prompt]) -> list[Prompt]:
        """``rlmix_select_prompts`` of every plugin, in manifest order, each on the previous
        one's list (``None`` keeps it); the caller's list is never changed."""
        from rlmix.loop import manifest_order

        impls = getattr(self.hook, "rlmix_select_prompts", None)
        for impl in manifest_order(impls.get_hookimpls() if impls is not None else []):
            chosen = impl.function(run=self, prompts=list(prompts))
            if chosen is not None:
                prompts = list(chosen)
        return prompts

    def generate(self, prompts: list[Prompt], *, n: int = 1, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0,
                 max_new_tokens: int | None = None) -> RolloutBatch:
        """Plain generation (greedy by default) through ``rlmix_generate``, no wrappers."""
        request = GenerationRequest(
            prompts=prompts, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
            max_new_tokens=max_new_tokens or int(self.config.sampling.max_new_tokens))
        batch = self.hook.rlmix_generate(run=self, request=request)
        if batch is None:
            raise RuntimeError("no plugin returned a batch from rlmix_generate")
        return batch

    def minibatches(self, batch: RolloutBatch) -> Iterator[Minibatch]:
        """Epochs x updates x accumulation chunks, each with its update's global normalisers.
        Under data parallelism (``shard``) only this process's share of the rows (``share``);
        the trainer makes the normalisers global across processes."""
        train = self.config.train
        lo, hi = self.share(len(batch))
        n = hi - lo
        updates = max(1, int(train.updates_per_epoch))
        chunks = max(1, int(train.grad_accum))
        norm_constant = float(train.loss_norm_constant or self.config.sampling.max_new_tokens)
        gen = torch.Generator().manual_seed(int(train.seed) * 1_000_003 + self.step)
        for epoch in range(int(train.epochs)):
            order = lo + (torch.randperm(n, generator=gen) if (updates > 1 and train.shuffle)
                          else torch.arange(n))
            for u, update_rows in enumerate(torch.tensor_split(order, updates)):
                if len(update_rows) == 0:
                    continue
                cmask = batch.completion_mask[update_rows]
                normalizers = Normalizers(tokens=float(cmask.sum().clamp(min=1)),
                                          sequences=float(len(update_rows)),
                                          norm_constant=norm_constant)
                parts = [p for p in torch.tensor_split(update_rows, chunks) if len(p)]
                for i, rows in enumerate(parts):
                    yield Minibatch(batch=batch.select(rows), normalizers=normalizers,
                                    epoch=epoch, index=u * chunks + i, last=i == len(parts) - 1)


@dataclass
class StepResult:
    """What ``Episode.step`` returns after one model turn.

    ``messages``: chat messages to append to the conversation before the model's next turn,
    usually one ``{"role": "tool", "content": "<the tool's output or error>"}``; the rollout
    engine renders them with the tokenizer's chat template and masks their tokens out of the
    loss. ``done``: the episode is over (an answer was given, or the env gives up); the engine
    then appends nothing. ``info``: anything worth keeping about this turn (the tool call, its
    result, an error); the engine records it per turn in ``batch.info[i]["episode"]``."""

    messages: list[dict[str, str]] = field(default_factory=list)
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Episode:
    """One multi-turn interaction between the policy and an environment (the env interface).

    An env plugin returns a fresh instance per sample from ``rlmix_episode(run, prompt)``;
    a multi-turn rollout engine (``hf``) drives it::

        messages = episode.reset()                  # the opening chat (usually prompt.messages)
        while True:
            text = <the model's turn, generated until EOS or any of episode.stop_strings>
            result = episode.step(text)             # run the tool, check the answer, ...
            if result.done or <turn limit or token budget reached>:
                break
            <append result.messages to the context with the chat template>

    Contract for implementers:

    * ``reset()`` is called exactly once, before the first turn, and returns the opening
      messages (``[{"role": ..., "content": ...}]``). The engine templates them with
      ``add_generation_prompt`` exactly as a single-turn prompt, with the prompt's ``tools``
      (``Prompt.tools``) passed to the chat template, for the opening and for every env
      message it inserts later.
    * ``step(assistant_text)`` is called after every complete model turn, with that turn's
      decoded text (special tokens dropped). A turn cut short by the engine's token budget is
      not passed to ``step``. ``step`` must not raise on malformed model output: return the
      error as a message (the model may recover) and record it in ``info``.
    * ``stop_strings`` end a model turn early (e.g. ``("</tool>",)``) besides EOS. The turn
      keeps the whole token that completed the string, so text after it in that token is kept.
    * Keep ``step`` cheap or bounded (timeouts): the engine waits for it between turns.

    The engine, not the episode, owns the tokens: what the model generated stays token for
    token in the row, env messages are tokenised from the chat template's rendering and
    inserted between turns, so the trainer's forward sees exactly what the sampler saw."""

    #: strings that end a model turn besides the tokenizer's EOS
    stop_strings: tuple[str, ...] = ()

    def reset(self) -> list[dict[str, str]]:
        """The opening messages of the conversation."""
        raise NotImplementedError

    def step(self, assistant_text: str) -> StepResult:
        """React to one model turn: the messages to append, whether the episode is over, info."""
        raise NotImplementedError
