"""Low-precision sampler copies of a policy: a bf16 copy, or a copy whose linear layers hold int8
weights with one scale per output row. Pure torch (CPU kernels of torch itself), no plugin API.

* ``Int8Linear``: ``y = x W^T + b`` with ``W`` stored as int8 ``q`` and per-row scales ``s``
  (symmetric absmax: ``s = max|W_row| / 127``, ``q = round(W / s)``). Two kernels:
  ``weight_only`` (``torch._weight_int8pack_mm``: int8 weights, bf16 activations, fp32
  accumulation) and ``dynamic`` (fbgemm's ``quantized.linear_dynamic``: the activations are
  quantised to 8 bits per call too, fp32 in and out).
* ``LowbitWeights``: the sampler copy (``rlmix.sampler_weights.SamplerWeights``) built from the
  master model without a second fp32 copy, and ``refresh(master)``, which re-casts or
  re-quantises every weight in place.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlmix.sampler_weights import SamplerWeights

PRECISIONS = ("fp32", "bf16", "int8")
KERNELS = ("weight_only", "dynamic")
HEADS = ("auto", "fp32", "bf16", "int8")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_ROWS = 8192  # rows quantised at once (bounds the fp32 temporary of the LM head)


def quantize_rows(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [N, K], scales [N])`` with ``weight ~= q * scales[:, None]``: symmetric, one
    scale per output row, ``|q| <= 127``, ``|weight - q s| <= s / 2``. The scales are exact in
    ``scale_dtype`` (rounded up into it before ``q`` is computed, so no value is clipped)."""
    w = weight.detach()
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(w.shape[0], dtype=scale_dtype, device=w.device)
    up = 1.0 if scale_dtype == torch.float32 else 1.0 + 2.0 ** -7  # above bf16's rounding
    for start in range(0, w.shape[0], _ROWS):
        rows = w[start:start + _ROWS].float()
        s = (rows.abs().amax(1).clamp_(min=1e-8) / 127.0 * up).to(scale_dtype).float()
        q[start:start + _ROWS] = torch.round(rows / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[start:start + _ROWS] = s
    return q, scales


def _packed_kernel_ok(in_features: int) -> bool:
    """``torch._weight_int8pack_mm`` on CPU gives wrong results (or crashes) unless the inner
    dimension is a multiple of 16 (measured on torch 2.13); other shapes use the fallback."""
    return in_features % 16 == 0 and hasattr(torch, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """A frozen linear layer with int8 weights and per-output-row scales (see module doc)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kernel: str = "weight_only",
                 act_dtype: torch.dtype = torch.bfloat16, device: Any = None) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"int8 kernel {kernel!r} is not one of {', '.join(KERNELS)}")
        self.in_features, self.out_features = in_features, out_features
        self.kernel = kernel
        self.act_dtype = torch.float32 if kernel == "dynamic" else act_dtype
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8,
                                                    device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=self.act_dtype,
                                                  device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=self.act_dtype, device=device)
                             if bias else None)
        self.packed: Any = None  # fbgemm's prepacked weight (dynamic kernel)

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Quantise ``weight`` (``[out, in]``, any float dtype) into this layer, in place."""
        q, scales = quantize_rows(weight, self.scales.dtype)
        self.scales.copy_(scales)
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)
        if self.kernel != "dynamic":
            self.qweight.copy_(q)
        else:  # fbgemm keeps its own packed copy: the int8 buffer is not kept twice
            self.qweight = torch.empty(0, dtype=torch.int8, device=q.device)
            with warnings.catch_warnings():  # torch marks quantized tensors as deprecated
                warnings.simplefilter("ignore")
                qw = torch._make_per_channel_quantized_tensor(
                    q.cpu(), scales.double().cpu(),
                    torch.zeros(len(scales), dtype=torch.long), 0)
                self.packed = torch.ops.quantized.linear_prepack(
                    qw, None if self.bias is None else self.bias.float().cpu())

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, ``q * s``, in fp32."""
        if self.kernel == "dynamic":
            return torch.ops.quantized.linear_unpack(self.packed)[0].dequantize()
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "dynamic" and x2.device.type == "cpu":
            y = torch.ops.quantized.linear_dynamic(x2.float().contiguous(), self.packed, True)
        elif self.kernel == "weight_only" and x2.device.type == "cpu" and \
                _packed_kernel_ok(self.in_features):
            y = torch._weight_int8pack_mm(x2.to(self.act_dtype).contiguous(), self.qweight,
                                          self.scales)
            if self.bias is not None:
                y = y + self.bias
        else:  # other devices and shapes: dequantise, then an ordinary matmul
            w = (self.qweight.to(self.act_dtype) * self.scales[:, None]).to(self.act_dtype)
            y = F.linear(x2.to(self.act_dtype), w, self.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernel={self.kernel}, bias={self.bias is not None}")


class CastLinear(nn.Module):
    """A frozen linear layer whose weight is kept in its own dtype (an fp32 or bf16 LM head in a
    copy of another precision): the input is cast to it, the output stays in it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: Any = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                               device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def resolve_head(precision: str, lm_head: str) -> str:
    """The LM head's precision for ``lm_head: auto``: the copy's own (an int8 copy gets an int8
    head: the head is a fifth of SmolLM2's weight bytes and bench/lowbit_decode.py measures it
    fastest)."""
    return precision if lm_head == "auto" else lm_head


class LowbitWeights(SamplerWeights):
    """The sampler copy of ``master`` in ``precision`` (``bf16`` or ``int8``), its LM head in
    ``lm_head``; norms, embeddings and every other parameter in the copy's compute dtype (bf16,
    or fp32 under the ``dynamic`` int8 kernel, which takes fp32 activations). Buffers (rotary
    frequencies) are copied as they are. Built without a transient fp32 copy of the model."""

    def __init__(self, master: nn.Module, precision: str = "bf16", lm_head: str = "auto",
                 int8_kernel: str = "weight_only") -> None:
        if precision not in ("bf16", "int8"):
            raise ValueError(f"a low-precision copy is bf16 or int8, not {precision!r}")
        self.precision, self.int8_kernel = precision, int8_kernel
        self.head = resolve_head(precision, lm_head)
        self.compute_dtype = (torch.float32 if precision == "int8" and int8_kernel == "dynamic"
                              else torch.bfloat16)
        self.version = -1
        head_module = master.get_output_embeddings() if hasattr(
            master, "get_output_embeddings") else None
        names = {id(m): n for n, m in master.named_modules()}
        head_name = names.get(id(head_module)) if head_module is not None else None
        replace: dict[str, str] = {}  # module name -> "int8" | "fp32" | "bf16" (a CastLinear)
        for name, module in master.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            if name == head_name:
                if self.head == "int8":
                    replace[name] = "int8"
                elif DTYPES[self.head] != self.compute_dtype:
                    replace[name] = self.head
            elif precision == "int8":
                replace[name] = "int8"
        # placeholders for the master's parameters, so deepcopy allocates nothing in fp32: an
        # empty tensor where every owner is replaced, else one of the compute dtype
        owners: dict[int, list[str]] = {}
        params: dict[int, torch.Tensor] = {}
        for mname, module in master.named_modules():
            for p in module._parameters.values():
                if p is not None:
                    owners.setdefault(id(p), []).append(mname)
                    params[id(p)] = p
        memo: dict[int, Any] = {}
        for pid, p in params.items():
            if all(m in replace for m in owners[pid]):
                new = torch.empty(0, dtype=self.compute_dtype, device=p.device)
            else:
                new = torch.empty(p.shape, device=p.device,
                                  dtype=self.compute_dtype if p.is_floating_point() else p.dtype)
            memo[pid] = nn.Parameter(new, requires_grad=False)
        clone = copy.deepcopy(master, memo)
        for name, kind in replace.items():
            old = master.get_submodule(name)
            device = old.weight.device
            bias = old.bias is not None
            if kind == "int8":
                new_module: nn.Module = Int8Linear(old.in_features, old.out_features, bias,
                                                   int8_kernel, self.compute_dtype, device)
            else:
                new_module = CastLinear(old.in_features, old.out_features, bias, DTYPES[kind],
                                        device)
            clone.set_submodule(name, new_module)
        clone.eval()
        for p in clone.parameters():
            p.requires_grad_(False)
        self.model = clone
        # what refresh copies: (module name, parameter name, target) once per target
        self._plan: list[tuple[str, str, Any]] = []
        seen: set[int] = set()
        for mname, module in master.named_modules():
            target = clone.get_submodule(mname) if mname else clone
            for pname, p in module._parameters.items():
                if p is None:
                    continue
                if isinstance(target, Int8Linear):
                    if pname == "weight":
                        self._plan.append((mname, "weight", target))
                    continue  # its bias is loaded with the weight
                dst = target._parameters.get(pname)
                if dst is None or id(dst) in seen:
                    continue
                seen.add(id(dst))
                self._plan.append((mname, pname, dst))
        self.refresh(master)

    @torch.no_grad()
    def refresh(self, master: nn.Module) -> None:
        for mname, pname, target in self._plan:
            module = master.get_submodule(mname) if mname else master
            src = module._parameters[pname]
            if isinstance(target, Int8Linear):
                target.load(src, module._parameters.get("bias"))
            else:
                target.copy_(src)

    def weight_bytes(self) -> int:
        """Bytes of weights one full forward reads: every parameter and int8 buffer, except the
        input embedding table, of which a decode step reads only one row per token."""
        emb = self.model.get_input_embeddings() if hasattr(
            self.model, "get_input_embeddings") else None
        head = self.model.get_output_embeddings() if hasattr(
            self.model, "get_output_embeddings") else None
        head_ids = {id(t) for t in head.parameters()} if head is not None else set()
        skip = {id(t) for t in emb.parameters()} - head_ids if emb is not None else set()
        total = 0
        for t in self.model.parameters():
            if id(t) not in skip:
                total += t.numel() * t.element_size()
        for m in self.model.modules():
            if isinstance(m, Int8Linear):  # int8 weights (packed or not) and their scales
                total += m.in_features * m.out_features
                total += m.scales.numel() * m.scales.element_size()
        return total
