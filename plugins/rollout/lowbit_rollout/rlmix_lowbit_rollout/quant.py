"""Low-precision sampler copies of a policy: a bf16 copy, or a copy whose linear layers hold int8
weights with one scale per output row. Pure torch (CPU kernels of torch itself), no plugin API.

* ``Int8Linear``: ``y = x W^T + b`` with ``W`` stored as int8 ``q`` and per-row scales ``s``
  (symmetric absmax: ``s = max|W_row| / 127``, ``q = round(W / s)``). Two kernels:
  ``weight_only`` (``torch._weight_int8pack_mm``: int8 weights, bf16 activations, fp32
  accumulation) and ``dynamic`` (fbgemm's ``quantized.linear_dynamic``: the activations are
  quantised to 8 bits per call too, with one scale per tensor, fp32 in and out), and ``w8a8``
  (SmoothQuant-smoothed weights and activations quantised per token, ``torch._int_mm``, or on a
  CPU without VNNI fbgemm's kernel on rows scaled to unit range: see ``Int8Linear.forward`` and
  ``LowbitWeights.calibrate``).
* ``PackedLinear``: a bf16 linear whose weight is held pre-packed in oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, once per refresh), so a call runs the matmul
  without re-laying the weight out first, which plain ``F.linear`` on a bf16 CPU tensor does on
  every call; the outputs are the same as ``F.linear``'s. CPU only (``prepack_ok``).
* ``LowbitWeights``: the sampler copy (``rlmix.sampler_weights.SamplerWeights``) built from the
  master model without a second fp32 copy, and ``refresh(master)``, which re-casts or
  re-quantises every weight in place. With ``free_while_training``, ``release()`` frees every
  weight it refreshes (the tensors keep their shapes over an empty storage; packed weights are
  dropped) and the next ``refresh`` re-allocates them: the core calls it after a synchronous
  rollout, so the copy holds no memory while the trainer runs.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlmix.policy import native_bf16
from rlmix.sampler_weights import SamplerWeights

PRECISIONS = ("fp32", "bf16", "int8")
KERNELS = ("weight_only", "dynamic", "w8a8")
W8A8_DECODE = ("auto", "token")  # w8a8's activation scales on decode calls (see Int8Linear)
W8A8_GEMMS = ("auto", "int_mm", "fbgemm")  # w8a8's per-token int8 GEMM (see Int8Linear)
HEADS = ("auto", "fp32", "bf16", "int8")
ATTENTIONS = ("model", "eager", "sdpa")  # the copy's attention implementation (transformers')
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP32_KERNELS = ("dynamic", "w8a8")  # kernels that take fp32 activations
_ROWS = 8192  # rows quantised at once (bounds the fp32 temporary of the LM head)


def quantize_rows(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32,
                  qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [N, K], scales [N])`` with ``weight ~= q * scales[:, None]``: symmetric, one
    scale per output row, ``|q| <= qmax``, ``|weight - q s| <= s / 2``. The scales are exact in
    ``scale_dtype`` (rounded up into it before ``q`` is computed, so no value is clipped)."""
    if not 1 <= qmax <= 127:
        raise ValueError(f"qmax is in [1, 127], not {qmax}")
    w = weight.detach()
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(w.shape[0], dtype=scale_dtype, device=w.device)
    up = 1.0 if scale_dtype == torch.float32 else 1.0 + 2.0 ** -7  # above bf16's rounding
    for start in range(0, w.shape[0], _ROWS):
        rows = w[start:start + _ROWS].float()
        s = (rows.abs().amax(1).clamp_(min=1e-8) / float(qmax) * up).to(scale_dtype).float()
        q[start:start + _ROWS] = torch.round(rows / s[:, None]).clamp_(-qmax, qmax).to(torch.int8)
        scales[start:start + _ROWS] = s
    return q, scales


def _cpu_flags() -> str:
    """/proc/cpuinfo's text ("" where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _cpu_has_vnni(flags: str) -> bool:
    """Whether a CPU with these flags multiplies u8 x s8 pairs into int32 directly (VNNI,
    AVX512 or AVX)."""
    return "avx512_vnni" in flags or "avx_vnni" in flags or "amx_int8" in flags


def _fbgemm_has_vnni(flags: str) -> bool:
    """Whether fbgemm runs its VNNI kernels on a CPU with these flags: it has them for
    AVX512-VNNI only (its ISAs are avx512_vnni, avx512 and avx2), so a CPU with AVX-VNNI alone
    gets its AVX2 kernels."""
    return "avx512_vnni" in flags


_FLAGS = _cpu_flags()  # read once, at import
_VNNI = _cpu_has_vnni(_FLAGS)
_FBGEMM_VNNI = _fbgemm_has_vnni(_FLAGS)
# Without VNNI kernels fbgemm adds pairs of u8 x s8 products in saturating int16: with 8-bit
# activations (u8 <= 255) that is exact while |q| <= 63 (255 * 63 * 2 = 32130 <= 32767), so
# w8a8 stores 7-bit weights there and keeps 8-bit activations, rather than 8-bit weights with
# 7-bit activations (``reduce_range``): SmoothQuant has already moved the hard range into the
# weights, and on SmolLM2 this halves the sampler's mismatch (BENCHMARKS.md)
_NO_VNNI_QMAX = 63


def resolve_w8a8_gemm(gemm: str) -> str:
    """The GEMM behind w8a8's per-token calls on the CPU for ``gemm: auto``: ``torch._int_mm``
    where the CPU has VNNI, else ``fbgemm``. Without VNNI torch's int8 GEMM runs a reference
    loop, 15-30x slower than the fp32 matmul at 8 rows (measured on an AVX2 EPYC,
    BENCHMARKS.md), while fbgemm's kernel beats fp32."""
    if gemm not in W8A8_GEMMS:
        raise ValueError(f"w8a8_gemm is one of {W8A8_GEMMS}, not {gemm!r}")
    return gemm if gemm != "auto" else ("int_mm" if _VNNI else "fbgemm")


def _fbgemm_pack(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """fbgemm's pre-packed int8 weight (per-row scales, zero points 0) with its fp32 bias."""
    with warnings.catch_warnings():  # torch marks quantized tensors as deprecated
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(
            q.cpu(), scales.double().cpu(), torch.zeros(len(scales), dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qw, None if bias is None else
                                                  bias.float().cpu())


def _fbgemm_pack_unscaled(q: torch.Tensor) -> Any:
    """fbgemm's pre-packed int8 weight ``q`` with one scale of 1 (zero point 0): the caller
    multiplies the output by the per-row scales. Packing per tensor skips torch's per-channel
    scale handling, which reads every row's scale on its own and took most of a w8a8 copy's
    refresh (about 200k rows on SmolLM2)."""
    with warnings.catch_warnings():  # torch marks quantized tensors as deprecated
        warnings.simplefilter("ignore")
        return torch.ops.quantized.linear_prepack(
            torch._make_per_tensor_quantized_tensor(q.cpu(), 1.0, 0), None)


def _once_per_input(cache: dict[str, Any] | None, key: str, x: torch.Tensor,
                    compute: Callable[[], Any]) -> Any:
    """``compute()``, kept in ``cache`` (a w8a8 layer group's ``shared_input``) under ``key``
    while the input is the same tensor at the same version, so the layers that read one input
    prepare it once; no cache: computed every call."""
    if cache is not None:
        hit = cache.get(key)
        if hit is not None and hit[0] is x and hit[1] == x._version:
            return hit[2]
    value = compute()
    if cache is not None:
        cache[key] = (x, x._version, value)
    return value


def _packed_kernel_ok(in_features: int) -> bool:
    """``torch._weight_int8pack_mm`` on CPU gives wrong results (or crashes) unless the inner
    dimension is a multiple of 16 (measured on torch 2.13); other shapes use the fallback."""
    return in_features % 16 == 0 and hasattr(torch, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """A frozen linear layer with int8 weights and per-output-row scales (see module doc)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kernel: str = "weight_only",
                 act_dtype: torch.dtype = torch.bfloat16, device: Any = None,
                 w8a8_gemm: str = "auto") -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"int8 kernel {kernel!r} is not one of {', '.join(KERNELS)}")
        self.in_features, self.out_features = in_features, out_features
        self.kernel = kernel
        self.act_dtype = torch.float32 if kernel in FP32_KERNELS else act_dtype
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8,
                                                    device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=self.act_dtype,
                                                  device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=self.act_dtype, device=device)
                             if bias else None)
        self.packed: Any = None  # fbgemm's prepacked weight (dynamic kernel)
        # w8a8: the SmoothQuant factor per input channel; the stored weight is W diag(smooth)
        # and the input is divided by it, so the product is unchanged (ones until calibrated)
        self.register_buffer("smooth", torch.ones(in_features, device=device)
                             if kernel == "w8a8" else None)
        self.register_buffer("inv_smooth", torch.ones(in_features, device=device)
                             if kernel == "w8a8" else None)
        self._int_mm = kernel == "w8a8" and hasattr(torch, "_int_mm")
        # w8a8 on the CPU: the per-token GEMM, torch._int_mm or fbgemm's dynamic kernel fed rows
        # divided by their own absolute maximum, so that its one scale per call is one per token
        self.w8a8_gemm = resolve_w8a8_gemm(w8a8_gemm)
        # w8a8: a dict shared by the layers that read one input (q/k/v; gate/up), holding that
        # input quantised once; set by LowbitWeights.calibrate (None: quantise per call)
        self.shared_input: dict[str, Any] | None = None
        # w8a8: decode calls (one position per row) quantise the activations with one scale for
        # the whole call, inside fbgemm's dynamic kernel (set by calibration for layers whose
        # tokens' ranges are alike; the weight is then also held packed for fbgemm)
        self.decode_per_tensor = False

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Quantise ``weight`` (``[out, in]``, any float dtype) into this layer, in place (under
        ``w8a8``, ``weight diag(smooth)``)."""
        if self.smooth is not None:
            weight = weight.detach().float() * self.smooth
        q, scales = quantize_rows(weight, self.scales.dtype, self._qmax(weight.device))
        self.scales.copy_(scales)
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)
        fbgemm_only = self.kernel == "dynamic" or self._fbgemm_tokens(q.device)
        if not fbgemm_only:
            self.qweight.copy_(q)
        else:  # every call runs fbgemm's packed copy: the int8 buffer is not kept twice
            self.qweight = torch.empty(0, dtype=torch.int8, device=q.device)
        if self.kernel == "dynamic":
            self.packed = _fbgemm_pack(q, scales, self.bias)
        elif self.kernel == "w8a8" and q.device.type == "cpu" and \
                (self.decode_per_tensor or fbgemm_only):
            self.packed = _fbgemm_pack_unscaled(q)  # w8a8 scales and adds the bias after
        else:
            self.packed = None

    def _fbgemm_tokens(self, device: torch.device) -> bool:
        """Whether this w8a8 layer's per-token calls (and so all its calls) run fbgemm."""
        return self.kernel == "w8a8" and device.type == "cpu" and self.w8a8_gemm == "fbgemm"

    def _qmax(self, device: torch.device) -> int:
        """The largest stored weight magnitude: 127, or under w8a8 on a CPU where fbgemm has no
        VNNI kernels 63, which keeps its int16 pair sums exact with 8-bit activations (see
        _NO_VNNI_QMAX)."""
        return _NO_VNNI_QMAX if self.kernel == "w8a8" and device.type == "cpu" and \
            not _FBGEMM_VNNI else 127

    def int8_weight(self) -> torch.Tensor:
        """The stored int8 values ``q`` (``[out, in]``), from the plain buffer or, where only
        fbgemm's packed copy is kept, unpacked from it."""
        if self.qweight.numel() == 0 and self.packed is not None:
            return torch.ops.quantized.linear_unpack(self.packed)[0].int_repr()
        return self.qweight

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, ``q * s`` (under ``w8a8`` with the smoothing
        undone), in fp32."""
        if self.kernel == "dynamic":
            return torch.ops.quantized.linear_unpack(self.packed)[0].dequantize()
        w = self.int8_weight().float() * self.scales.float()[:, None]
        return w * self.inv_smooth if self.smooth is not None else w

    @torch.no_grad()
    def set_smoothing(self, act_absmax: torch.Tensor,
                      weight: torch.Tensor | Sequence[torch.Tensor], alpha: float) -> None:
        """SmoothQuant's factor per input channel ``j``: ``s_j = max|X_j|^alpha /
        max|W_:j|^(1 - alpha)``, from the calibration inputs' absolute maxima ``act_absmax``
        (``[in]``) and the master ``weight`` (or the weights of every layer that reads the same
        input, which must share the factors to share one quantised input); channels never
        active keep ``s_j = 1``. Dividing the input by ``s`` and multiplying the weight's
        columns by it moves the outlier channels' range from the activations (quantised per
        token) into the weights (quantised per output row). Call ``load`` afterwards."""
        if self.smooth is None:
            raise ValueError(f"smoothing applies to the w8a8 kernel, not {self.kernel!r}")
        ws = [weight] if isinstance(weight, torch.Tensor) else list(weight)
        w = torch.stack([t.detach().float().abs().amax(0) for t in ws]).amax(0).clamp(min=1e-8)
        a = act_absmax.detach().float().to(self.smooth.device)
        s = (a.clamp(min=1e-8) ** alpha / w.to(a.device) ** (1.0 - alpha)).clamp(1e-4, 1e4)
        s = torch.where(a > 0, s, torch.ones_like(s))
        self.smooth.copy_(s)
        self.inv_smooth.copy_(1.0 / s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "dynamic" and x2.device.type == "cpu":
            y = torch.ops.quantized.linear_dynamic(x2.float().contiguous(), self.packed, True)
        elif self.kernel == "w8a8":
            y = self._w8a8(x, x2)
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

    def _smoothed_rows(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x diag(1/smooth)`` (``[rows, in]``, fp32) and each row's absolute maximum
        (``[rows, 1]``, at least 1e-8)."""
        x = x2.float() * self.inv_smooth
        return x, x.abs().amax(1, keepdim=True).clamp_(min=1e-8)

    def _quantized_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x diag(1/smooth)`` (``[rows, in]``) quantised symmetrically to int8 with one scale
        per row, i.e. per token, so a token with huge activations (e.g. the first of a prompt)
        does not set the scale of the others. Returns ``(int8 values, row scales [rows, 1])``."""
        x, row_max = self._smoothed_rows(x)
        row_scale = row_max.div_(127.0)
        return torch.round(x / row_scale), row_scale

    def _unit_rows(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x diag(1/smooth)`` with each row divided by its absolute maximum (``[rows, in]``,
        every row's largest magnitude 1), and those maxima (``[rows, 1]``)."""
        x, row_max = self._smoothed_rows(x2)
        return (x / row_max).contiguous(), row_max

    def _w8a8(self, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """int8 input x int8 weight in int32, scaled back by row scale x weight-row scale. Layers
        that read the same input tensor (q/k/v, gate/up: ``shared_input``, set at calibration,
        with shared smoothing factors) quantise it once. With ``decode_per_tensor``, a decode
        call (one position per row) instead runs fbgemm's dynamic kernel on the smoothed
        input: one activation scale for the call, computed and applied inside one kernel, where
        the per-token path is several small ops per layer. Per token on the CPU with
        ``w8a8_gemm: fbgemm``, each row of the smoothed input is divided by its absolute
        maximum before that kernel and its output row multiplied back: the kernel's one scale
        then fits every token alike, which is per-token quantisation. fbgemm's activations are
        8-bit in both paths; where fbgemm has no VNNI kernels the weights are 7-bit
        (``_NO_VNNI_QMAX``)."""
        cache = self.shared_input
        if self.packed is not None and self.decode_per_tensor and x.dim() > 2 and \
                x.shape[-2] == 1:
            xs = _once_per_input(cache, "smoothed", x,
                                 lambda: (x2.float() * self.inv_smooth).contiguous())
            y = torch.ops.quantized.linear_dynamic(xs, self.packed, False).mul_(self.scales)
            return y + self.bias if self.bias is not None else y
        if self.packed is not None and self.w8a8_gemm == "fbgemm":
            xn, row_max = _once_per_input(cache, "unit_rows", x, lambda: self._unit_rows(x2))
            y = torch.ops.quantized.linear_dynamic(xn, self.packed, False).mul_(
                row_max * self.scales)
            return y + self.bias if self.bias is not None else y

        def quantized() -> tuple[torch.Tensor, torch.Tensor]:
            xq, row_scale = self._quantized_input(x2)
            on_cpu = self._int_mm and x2.device.type == "cpu"
            return (xq.to(torch.int8) if on_cpu else xq), row_scale

        xq, row_scale = _once_per_input(cache, "per_token", x, quantized)
        if xq.dtype == torch.int8:
            try:
                acc = torch._int_mm(xq, self.qweight.t())
            except RuntimeError:  # a shape the int8 GEMM does not take: the float path
                self._int_mm = False
                acc = xq.float() @ self.qweight.t().float()
        else:  # other devices: the same arithmetic in float (exact while |sums| < 2^24)
            acc = xq @ self.qweight.t().float()
        y = acc * (row_scale * self.scales)  # int32 x fp32 is fp32: one kernel
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        gemm = f", w8a8_gemm={self.w8a8_gemm}" if self.kernel == "w8a8" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernel={self.kernel}{gemm}, bias={self.bias is not None}")


def prepack_ok(device: Any) -> bool:
    """Whether bf16 weights can be pre-packed for oneDNN on ``device``: a CPU with native bf16
    (``rlmix.policy.native_bf16``: torch sends its bf16 matmuls to oneDNN there) and a torch
    that has oneDNN's packing ops."""
    if torch.device(device).type != "cpu" or not native_bf16(device):
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


class PackedLinear(nn.Module):
    """A frozen bf16 linear layer for the CPU whose weight lives only in oneDNN's pre-packed
    layout (``packed``, an opaque tensor, not a parameter: nothing trains or saves it); ``load``
    re-casts and re-packs a master weight. Input is cast to bf16, output is bf16."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device: Any = None
                 ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed: torch.Tensor | None = None
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=torch.bfloat16, device=device),
                                  requires_grad=False) if bias else None)

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(weight.shape)} for a "
                             f"{self.in_features}->{self.out_features} layer")
        w = weight.detach().to(torch.bfloat16).contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w)
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias.detach())

    def unpacked(self) -> torch.Tensor:
        """The bf16 weight back in the ordinary layout (tests, inspection)."""
        if self.packed is None:
            raise RuntimeError("PackedLinear used before load()")
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            raise RuntimeError("PackedLinear used before load()")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, layout=onednn-packed")


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


def set_attention(model: nn.Module, implementation: str) -> None:
    """Make ``model`` (a transformers model) run ``implementation`` ("eager", "sdpa") in its
    attention layers, which read it from the model's config at every forward."""
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(implementation)
    else:  # older transformers: the config attribute is what the layers read
        model.config._attn_implementation = implementation


def _with_layer_inputs(master: nn.Module, names: set[str],
                       record: Callable[[str, torch.Tensor, torch.Tensor], None],
                       input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       keep: torch.Tensor | None) -> None:
    """One forward of ``master`` on ``input_ids`` that calls ``record(name, input, rows)`` for
    each named layer: its input tensor, and that input as ``[tokens, features]`` rows with the
    padding (``keep`` false) left out."""
    hooks = []
    for name, module in master.named_modules():
        if name not in names:
            continue

        def hook(mod: nn.Module, args: tuple, name: str = name) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            if keep is not None and len(keep) == len(x):
                x = x[keep.to(x.device)]
            record(name, args[0], x)

        hooks.append(module.register_forward_pre_hook(hook))
    try:
        master(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for h in hooks:
            h.remove()


class LowbitWeights(SamplerWeights):
    """The sampler copy of ``master`` in ``precision`` (``bf16`` or ``int8``), its LM head in
    ``lm_head``; norms, embeddings and every other parameter in the copy's compute dtype (bf16,
    or fp32 under the ``dynamic`` int8 kernel, which takes fp32 activations). Buffers (rotary
    frequencies) are copied as they are. Built without a transient fp32 copy of the model.
    With ``prepack`` (and ``prepack_ok`` on the master's device) every bf16 linear, the LM head
    included, is a ``PackedLinear``; a head tied to the input embeddings then has its own packed
    copy beside the bf16 embedding table. ``free_while_training``: ``release()`` frees the
    weights until the next ``refresh`` (see the module doc); a forward in between raises.
    ``attention`` other than ``model`` sets the copy's attention implementation (its own
    config: the master's is not touched)."""

    def __init__(self, master: nn.Module, precision: str = "bf16", lm_head: str = "auto",
                 int8_kernel: str = "weight_only", smooth_alpha: float = 0.5,
                 prepack: bool = True, free_while_training: bool = False,
                 attention: str = "model", w8a8_decode: str = "auto",
                 w8a8_max_spread: float = 4.0, w8a8_gemm: str = "auto") -> None:
        if precision not in ("bf16", "int8"):
            raise ValueError(f"a low-precision copy is bf16 or int8, not {precision!r}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention is one of {ATTENTIONS}, not {attention!r}")
        if w8a8_decode not in W8A8_DECODE:
            raise ValueError(f"w8a8_decode is one of {W8A8_DECODE}, not {w8a8_decode!r}")
        if not w8a8_max_spread >= 1.0:
            raise ValueError(f"w8a8_max_spread is a ratio of ranges, at least 1, not "
                             f"{w8a8_max_spread}")
        self.precision, self.int8_kernel = precision, int8_kernel
        self.w8a8_gemm = resolve_w8a8_gemm(w8a8_gemm)
        self.smooth_alpha = smooth_alpha
        self.w8a8_decode, self.w8a8_max_spread = w8a8_decode, float(w8a8_max_spread)
        # w8a8: each layer's token spread at calibration (see calibrate)
        self.spreads: dict[str, float] = {}
        self.calibrated = False
        self.head = resolve_head(precision, lm_head)
        self.compute_dtype = (torch.float32 if precision == "int8" and int8_kernel in FP32_KERNELS
                              else torch.bfloat16)
        self.version = -1
        self.free_while_training = bool(free_while_training)
        self.released = False
        head_module = master.get_output_embeddings() if hasattr(
            master, "get_output_embeddings") else None
        names = {id(m): n for n, m in master.named_modules()}
        head_name = names.get(id(head_module)) if head_module is not None else None
        device = next(master.parameters()).device
        self.prepack = bool(prepack) and prepack_ok(device)
        # module name -> "int8" | "packed" | "fp32" | "bf16" (the last two: a CastLinear)
        replace: dict[str, str] = {}
        for name, module in master.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            kind = self.head if name == head_name else precision
            if kind == "int8":
                replace[name] = "int8"
            elif kind == "bf16" and self.prepack:
                replace[name] = "packed"
            elif name == head_name and DTYPES[kind] != self.compute_dtype:
                replace[name] = kind
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
        clone = copy.deepcopy(master, memo)  # the config too: the copy's own from here on
        if attention != "model":
            set_attention(clone, attention)
        for name, kind in replace.items():
            old = master.get_submodule(name)
            device = old.weight.device
            bias = old.bias is not None
            if kind == "int8":
                new_module: nn.Module = Int8Linear(old.in_features, old.out_features, bias,
                                                   int8_kernel, self.compute_dtype, device,
                                                   self.w8a8_gemm)
            elif kind == "packed":
                new_module = PackedLinear(old.in_features, old.out_features, bias, device)
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
                if isinstance(target, (Int8Linear, PackedLinear)):
                    if pname == "weight":
                        self._plan.append((mname, "weight", target))
                    continue  # its bias is loaded with the weight
                dst = target._parameters.get(pname)
                if dst is None or id(dst) in seen:
                    continue
                seen.add(id(dst))
                self._plan.append((mname, pname, dst))
        self.refresh(master)
        clone.register_forward_pre_hook(self._check_loaded)
        self._calibration_hook = None
        if any(m.smooth is not None for m in self._smoothed()):
            # w8a8 calibrates on the first prompts it is run on (its first prefill)
            master_ref = weakref.ref(master)

            def calibrate_first(module: nn.Module, args: tuple, kwargs: dict) -> None:
                found = master_ref()
                ids = kwargs.get("input_ids", args[0] if args else None)
                if found is not None and isinstance(ids, torch.Tensor) and ids.dim() == 2:
                    self.calibrate(found, ids, kwargs.get("attention_mask"))

            self._calibration_hook = clone.register_forward_pre_hook(calibrate_first,
                                                                     with_kwargs=True)

    def _smoothed(self) -> list[Int8Linear]:
        return [m for m in self.model.modules() if isinstance(m, Int8Linear)
                and m.smooth is not None]

    @torch.no_grad()
    def calibrate(self, master: nn.Module, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> None:
        """Set every w8a8 layer's SmoothQuant factors (``Int8Linear.set_smoothing``, alpha
        ``smooth_alpha``) from the fp32 master's inputs to that layer on ``input_ids`` (padding
        left out), then re-quantise. Runs once, on the copy's first forward; later refreshes
        keep the factors (the weights move by a learning rate's worth per step).

        With ``w8a8_decode: auto`` (on the CPU) a second pass measures each layer's **token
        spread**: over the same tokens, the largest per-token range of the smoothed input
        (``max_j |x_tj / s_j|``) over the median one. A layer whose spread is at most
        ``w8a8_max_spread`` has tokens of alike range, so one scale for a decode call's rows
        loses little, and its decode calls take fbgemm's one-kernel per-tensor path
        (``Int8Linear.decode_per_tensor``); a layer with a few far louder tokens keeps
        per-token scales. Prefill always quantises per token: a prompt's first tokens can be
        hundreds of times louder than the rest."""
        if self._calibration_hook is not None:
            self._calibration_hook.remove()
            self._calibration_hook = None
        names = {n for n, m in self.model.named_modules()
                 if isinstance(m, Int8Linear) and m.smooth is not None}
        keep = None if attention_mask is None else attention_mask.reshape(-1).bool()
        absmax: dict[str, torch.Tensor] = {}
        readers: dict[int, list[str]] = {}  # id of an input tensor: the layers that read it
        inputs: list[torch.Tensor] = []  # held so that no id is reused during the forward

        def record(name: str, raw: torch.Tensor, x: torch.Tensor) -> None:
            inputs.append(raw)
            readers.setdefault(id(raw), []).append(name)
            a = x.float().abs().amax(0)
            absmax[name] = torch.maximum(absmax[name], a) if name in absmax else a

        _with_layer_inputs(master, names, record, input_ids, attention_mask, keep)
        groups: dict[str, list[str]] = {name: [name] for name in absmax}
        for group in readers.values():  # layers that read one tensor share factors and input
            members = sorted(set(group))
            for name in members:
                if len(members) > len(groups[name]):
                    groups[name] = members
        done: set[str] = set()
        for name, members in groups.items():
            if name in done:
                continue
            a = torch.stack([absmax[m] for m in members]).amax(0)
            weights = [master.get_submodule(m).weight for m in members]
            shared: dict[str, Any] | None = {} if len(members) > 1 else None
            for m in members:
                layer = self.model.get_submodule(m)
                layer.set_smoothing(a, weights, self.smooth_alpha)
                layer.shared_input = shared
                done.add(m)
        self.spreads = {}
        if self.w8a8_decode == "auto" and next(master.parameters()).device.type == "cpu":
            self.spreads = self._token_spreads(master, names, input_ids, attention_mask, keep)
            for name, spread in self.spreads.items():
                self.model.get_submodule(name).decode_per_tensor = spread <= self.w8a8_max_spread
        self.calibrated = True
        self.refresh(master)

    @torch.no_grad()
    def _token_spreads(self, master: nn.Module, names: set[str], input_ids: torch.Tensor,
                       attention_mask: torch.Tensor | None, keep: torch.Tensor | None
                       ) -> dict[str, float]:
        """Per w8a8 layer: max over tokens of the smoothed input's range, over its median."""
        spreads: dict[str, float] = {}

        def record(name: str, raw: torch.Tensor, x: torch.Tensor) -> None:
            ranges = (x.float() * self.model.get_submodule(name).inv_smooth).abs().amax(1)
            if len(ranges):
                spreads[name] = float(ranges.max() / ranges.median().clamp(min=1e-12))

        _with_layer_inputs(master, names, record, input_ids, attention_mask, keep)
        return spreads

    def _check_loaded(self, module: nn.Module, args: tuple) -> None:
        if self.released:
            raise RuntimeError("this sampler copy was released (free_while_training): "
                               "refresh(master) it before running it")

    def _freeable(self) -> list[torch.Tensor]:
        """The tensors ``refresh`` writes whole, whose storage ``release`` frees: every copied
        parameter and the int8 weight buffers (packed weights are dropped instead)."""
        out = []
        for _mname, _pname, target in self._plan:
            if isinstance(target, Int8Linear):
                out.append(target.qweight)
            elif not isinstance(target, PackedLinear):
                out.append(target)
        return [t for t in out if t.numel() > 0]

    def release(self) -> bool:
        """Free the copy's weights until the next ``refresh`` (``free_while_training``; else
        nothing happens). Returns whether it freed them."""
        if not self.free_while_training:
            return False
        for t in self._freeable():
            t.untyped_storage().resize_(0)
        for _mname, _pname, target in self._plan:
            if isinstance(target, PackedLinear | Int8Linear):  # load() packs them again
                target.packed = None
        self.released = True
        return True

    @torch.no_grad()
    def refresh(self, master: nn.Module) -> None:
        if self.released:  # re-allocate what release() freed; every byte is written below
            for t in self._freeable():
                t.untyped_storage().resize_(t.numel() * t.element_size())
        for mname, pname, target in self._plan:
            module = master.get_submodule(mname) if mname else master
            src = module._parameters[pname]
            if isinstance(target, (Int8Linear, PackedLinear)):
                target.load(src, module._parameters.get("bias"))
            else:
                target.copy_(src)
        self.released = False

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
            elif isinstance(m, PackedLinear):  # bf16 weights in oneDNN's layout
                total += m.in_features * m.out_features * 2
        return total
