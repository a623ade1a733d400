"""``rlmix_generate`` with a vLLM engine in the training process (written against vLLM 0.33).

* The engine is ``vllm.LLM`` built from the policy's weights (saved once to a folder the engine
  loads), tensor parallel over ``vllm.tensor_parallel_size`` GPUs, ``logprobs_mode:
  processed_logprobs`` so the per-token log-probs it returns are those of the distribution the
  token was drawn from (temperature, top-k and top-p applied), as ``behavior_logp`` must be.
* Sampling settings map from the ``GenerationRequest`` (``n``, temperature, top-p, top-k,
  max new tokens) to ``SamplingParams`` with ``logprobs=0`` (the sampled token's log-prob only).
* After an update (``run.policy_version`` ahead of the engine's), the policy's weights are
  pushed into the running engine with ``LLM.collective_rpc`` calling ``load_weights`` on the
  model of every worker: no restart, no file.
* ``sleep_level`` > 0 (colocated with training): after generating, ``LLM.sleep`` frees the
  engine's GPU memory (level 1 keeps the weights in CPU memory, level 2 drops them) and the
  next call wakes it (weights first, then the KV cache, so a weight push needs no KV memory).

vLLM is an optional extra (``pip install rlmix-vllm[engine]``): without it, configuring the
plugin fails with that command. The pure parts (the sampling mapping and the batch assembly)
need no vLLM and are tested on the CPU; the rest is checked on a GPU by ``gpu/vllm.sh``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import rlmix
from rlmix.types import GenerationRequest, Prompt, RolloutBatch, Run

NAME = "vllm"
VLLM_PIP = "pip install 'rlmix-vllm[engine]'  (vllm>=0.33, a CUDA machine)"


@dataclass
class Settings:
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.3  # share of each GPU the engine may take (KV cache incl.)
    dtype: str = "auto"  # engine weights: auto (the model's), bfloat16, float16, float32
    max_model_len: int = 0  # 0 = the model's own
    sleep_level: int = 0  # colocated with training: 0 never sleep, 1 offload weights, 2 drop them
    enforce_eager: bool = False  # skip CUDA graph capture (faster start, slower decode)
    seed: int = -1  # engine sampling seed; -1 = train.seed
    stop_at_eos: bool = True
    in_process: bool = True  # tensor_parallel_size 1: the engine core in this process

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size: must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization: must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        rlmix.check_choices(self, dtype=("auto", "bfloat16", "float16", "float32"))
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level: choose 0, 1 or 2, got {self.sleep_level}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len: must be >= 0, got {self.max_model_len}")


# ---------------------------------------------------------------- pure pieces


def sampling_kwargs(request: GenerationRequest, stop_token_ids: list[int],
                    seed: int | None = None) -> dict[str, Any]:
    """``vllm.SamplingParams`` arguments for ``request``: ``temperature == 0`` is greedy, top-k
    0 means none (vLLM's -1), and one log-prob per step (the sampled token's)."""
    greedy = request.temperature <= 0
    kwargs: dict[str, Any] = {
        "n": int(request.n),
        "temperature": 0.0 if greedy else float(request.temperature),
        "top_p": 1.0 if greedy else float(request.top_p),
        "top_k": -1 if greedy or request.top_k <= 0 else int(request.top_k),
        "max_tokens": int(request.max_new_tokens),
        "logprobs": 0,
        "stop_token_ids": list(stop_token_ids),
        "ignore_eos": not stop_token_ids,
        "detokenize": False,
        "skip_special_tokens": True,
    }
    if seed is not None and not greedy:
        kwargs["seed"] = int(seed)
    return kwargs


def _token_logprob(entry: Any, token: int) -> float:
    """The log-prob of ``token`` in one position's entry of ``CompletionOutput.logprobs`` (a
    ``{token_id: Logprob}`` mapping; ``Logprob.logprob`` or a bare float)."""
    value = entry[token]
    return float(getattr(value, "logprob", value))


def assemble(prompt_ids: list[list[int]], outputs: list[Any], prompts: list[Prompt], n: int,
             pad_id: int, version: int) -> RolloutBatch:
    """A ``RolloutBatch`` from vLLM ``RequestOutput``s (one per prompt, ``n`` completions each):
    prompts left-padded, completions right-padded, ``behavior_logp`` from the returned
    log-probs, rows prompt-major."""
    if len(outputs) != len(prompt_ids):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompt_ids)} prompts")
    rows: list[tuple[list[int], list[int], list[float]]] = []
    for ids, out in zip(prompt_ids, outputs):
        if len(out.outputs) != n:
            raise RuntimeError(f"vLLM returned {len(out.outputs)} completions, asked for {n}")
        for comp in out.outputs:
            tokens = list(comp.token_ids)
            if comp.logprobs is None or len(comp.logprobs) < len(tokens):
                raise RuntimeError("vLLM returned no per-token log-probs (logprobs=0 not set?)")
            logps = [_token_logprob(comp.logprobs[t], tok) for t, tok in enumerate(tokens)]
            rows.append((list(ids), tokens, logps))
    width_p = max((len(r[0]) for r in rows), default=0)
    width_c = max(1, max((len(r[1]) for r in rows), default=0))
    count = len(rows)
    tokens = torch.full((count, width_p + width_c), pad_id, dtype=torch.long)
    attn = torch.zeros(count, width_p + width_c, dtype=torch.long)
    cmask = torch.zeros(count, width_p + width_c)
    logp = torch.zeros(count, width_p + width_c)
    for i, (ids, comp, lps) in enumerate(rows):
        start = width_p - len(ids)
        tokens[i, start:width_p] = torch.tensor(ids, dtype=torch.long)
        attn[i, start:width_p] = 1
        end = width_p + len(comp)
        if comp:
            tokens[i, width_p:end] = torch.tensor(comp, dtype=torch.long)
            logp[i, width_p:end] = torch.tensor(lps)
        attn[i, width_p:end] = 1
        cmask[i, width_p:end] = 1.0
    return RolloutBatch(
        group=torch.arange(len(prompt_ids)).repeat_interleave(n),
        tokens=tokens, attention_mask=attn, completion_mask=cmask, behavior_logp=logp,
        policy_version=torch.full((count,), version, dtype=torch.long),
        texts=[""] * count, prompts=[p for p in prompts for _ in range(n)])


def _load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Run inside every vLLM worker by ``collective_rpc``: copy ``weights`` into its model
    (each model's ``load_weights`` maps Hugging Face names, fuses and shards them)."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    device = next(model.parameters()).device
    loaded = model.load_weights(weights=((k, v.to(device)) for k, v in weights))
    return len(loaded) if loaded is not None else len(weights)


# ---------------------------------------------------------------- the engine


@dataclass
class Engine:
    llm: Any
    settings: Settings
    folder: Path  # where the initial weights were written for the engine to load
    version: int = 0
    asleep: bool = False
    has_weights: bool = True

    def wake(self, tags: list[str]) -> None:
        if self.asleep:
            self.llm.wake_up(tags=tags)

    def push(self, model: Any) -> None:
        """The policy's weights into the running engine, in place (no restart)."""
        weights = [(k, v.detach()) for k, v in model.state_dict().items()]
        self.llm.collective_rpc(_load_weights, args=(weights,))
        # cached prefixes hold keys/values of the old weights: never reuse them
        self.llm.reset_prefix_cache()
        self.has_weights = True

    def sleep(self) -> None:
        level = self.settings.sleep_level
        if level > 0:
            self.llm.reset_prefix_cache()
            self.llm.sleep(level=level)
            self.asleep = True
            self.has_weights = level == 1


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise rlmix.ConfigError(f"plugin 'vllm' needs vLLM ({exc}); install it with "
                                f"{VLLM_PIP}") from None
    return vllm


def stop_ids(run: Run) -> list[int]:
    assert run.policy is not None
    ids = {run.policy.tokenizer.eos_token_id}
    configured = getattr(run.policy.model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return sorted(i for i in ids if i is not None)


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    settings: Settings = run.settings(NAME)
    if isinstance(run.resources.get(NAME), Engine):
        return
    vllm = import_vllm()
    if run.policy is None:
        raise rlmix.ConfigError("plugin 'vllm' needs the policy loaded before configure")
    if settings.in_process and settings.tensor_parallel_size == 1:
        # the engine core in this process: collective_rpc calls _load_weights directly
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    folder = Path(tempfile.mkdtemp(prefix="rlmix-vllm-"))
    run.policy.model.save_pretrained(folder)
    run.policy.tokenizer.save_pretrained(folder)
    seed = settings.seed if settings.seed >= 0 else int(run.config.train.seed)
    kwargs: dict[str, Any] = {
        "model": str(folder), "tokenizer": str(folder),
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "dtype": settings.dtype, "seed": seed, "enforce_eager": settings.enforce_eager,
        "enable_sleep_mode": settings.sleep_level > 0,
        "logprobs_mode": "processed_logprobs",
    }
    if settings.max_model_len:
        kwargs["max_model_len"] = settings.max_model_len
    try:
        llm = vllm.LLM(**kwargs)
    except Exception:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    engine = Engine(llm=llm, settings=settings, folder=folder, version=run.policy_version)
    run.resources[NAME] = engine
    engine.sleep()


@rlmix.hookimpl
def rlmix_generate(run: Run, request: GenerationRequest) -> RolloutBatch:
    engine = run.resources.get(NAME)
    if not isinstance(engine, Engine):
        raise RuntimeError("plugin 'vllm' has no engine (was rlmix_configure run?)")
    assert run.policy is not None
    vllm = import_vllm()
    settings = engine.settings
    engine.wake(["weights"])
    if engine.version != run.policy_version or not engine.has_weights:
        engine.push(run.policy.model)
        engine.version = run.policy_version
    engine.wake(["kv_cache"])
    engine.asleep = False
    tok = run.policy.tokenizer
    prompt_ids = [tok(run.policy.chat_text(p.messages, getattr(p, "tools", None)),
                      add_special_tokens=False)["input_ids"] for p in request.prompts]
    # no per-request seed: the engine's (LLM(seed=...)) keeps runs reproducible, and a shared
    # per-request seed would give identical prompts identical completions
    params = vllm.SamplingParams(**sampling_kwargs(
        request, stop_ids(run) if settings.stop_at_eos else []))
    try:
        outputs = engine.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                                      params, use_tqdm=False)
    finally:
        engine.sleep()
    batch = assemble(prompt_ids, outputs, request.prompts, request.n, tok.pad_token_id,
                     run.policy_version)
    batch.texts = tok.batch_decode(
        torch.where(batch.completion_mask > 0, batch.tokens, tok.pad_token_id),
        skip_special_tokens=True)
    return batch
