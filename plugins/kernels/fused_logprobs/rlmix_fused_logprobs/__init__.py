"""Token log-probs and entropies without ``[N, T, V]`` logits: a chunked torch path (any
device) and Triton kernels over vocabulary tiles with an online log-sum-exp (GPU)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

import rlmix
from rlmix.policy import plain_token_logprobs
from rlmix.types import Run

from .chunked import ChunkedTokenLogprobs, chunked_token_logprobs

__all__ = ["BACKENDS", "ChunkedTokenLogprobs", "Settings", "chunked_token_logprobs",
           "resolve_backend", "token_logprobs", "triton_available"]

NAME = "fused_logprobs"
BACKENDS = ("auto", "chunked", "triton", "plain")
PRECISIONS = ("ieee", "tf32")


@dataclass
class Settings:
    backend: str = "auto"  # auto | chunked | triton | plain
    chunk_size: int = 1024  # tokens per block of logits (chunked path)
    vocab_chunk_size: int = 0  # vocabulary columns per block (chunked path); 0 = all
    block_n: int = 0  # Triton tile: tokens; 0 = the kernel's default (64 on a GPU)
    block_v: int = 0  # Triton tile: vocabulary columns; 0 = default (128)
    block_k: int = 0  # Triton tile: hidden slice per dot; 0 = default (64)
    fp32_precision: str = "ieee"  # Triton fp32 dots: ieee (exact) | tf32 (tensor cores)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, backend=BACKENDS, fp32_precision=PRECISIONS)
        if self.chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        if self.vocab_chunk_size < 0:
            raise ValueError("vocab_chunk_size must be >= 0 (0 = the whole vocabulary)")
        blocks = (self.block_n, self.block_v, self.block_k)
        if any(blocks) and not all(b >= 16 and b & (b - 1) == 0 for b in blocks):
            raise ValueError("block_n, block_v, block_k: set all three to powers of two >= 16 "
                             "(or all to 0 for the defaults)")

    @property
    def blocks(self) -> tuple[int, int, int] | None:
        return (self.block_n, self.block_v, self.block_k) if self.block_n else None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, hidden: torch.Tensor) -> str:
    """``auto`` is Triton when ``hidden`` is on a CUDA device and triton imports, else chunked."""
    if backend != "auto":
        return backend
    return "triton" if hidden.is_cuda and triton_available() else "chunked"


def token_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor,
                   temperature: float = 1.0, settings: Settings | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` of ``labels [n, t]`` under ``lm_head(hidden [n, t, H]) /
    temperature``, fp32, with gradients to ``hidden`` and the head's weight and bias."""
    s = settings or Settings()
    backend = resolve_backend(s.backend, hidden)
    weight = getattr(lm_head, "weight", None)
    if backend == "plain" or not isinstance(weight, torch.Tensor):
        # no plain weight to chunk over (a sampler copy's packed or int8 head): its own forward
        return plain_token_logprobs(hidden, lm_head, labels, temperature)
    bias = getattr(lm_head, "bias", None)
    if backend == "triton":
        from .triton_kernels import triton_token_logprobs

        return triton_token_logprobs(hidden, weight, bias, labels, temperature, s.blocks,
                                     s.fp32_precision)
    return chunked_token_logprobs(hidden, weight, bias, labels, temperature, s.chunk_size,
                                  s.vocab_chunk_size)


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    if s.backend == "triton" and not triton_available():
        raise rlmix.ConfigError("fused_logprobs: backend 'triton' needs Triton: "
                                "pip install 'rlmix-fused-logprobs[triton]'")


@rlmix.hookimpl
def rlmix_token_logprobs(run: Run, hidden: torch.Tensor, lm_head: torch.nn.Module,
                         labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return token_logprobs(hidden, lm_head, labels, float(run.config.sampling.temperature),
                          run.settings(NAME))
