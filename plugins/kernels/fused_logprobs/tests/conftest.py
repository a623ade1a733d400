"""Run the Triton kernels on the CPU: Triton reads TRITON_INTERPRET when a kernel is decorated,
so it must be set before ``rlmix_fused_logprobs.triton_kernels`` is first imported (which only
these tests and the ``triton`` backend do). Left alone where a CUDA device is present."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
