"""lowbit_rollout: the sampler copy's kind and dtype, its refresh after an optimizer step, int8
linears against fp32 ones, the mismatch metrics by hand and through a run (zero when sampler
and trainer share the precision), the async worker sampling with this copy, bad settings, and
the example manifest."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import rlmix_hf
import rlmix_lowbit_rollout as lowbit
import torch
from rlmix_lowbit_rollout import Int8Linear, LowbitWeights, mismatch_metrics, quant
from rlmix_lowbit_rollout.quant import CastLinear, PackedLinear, prepack_ok, quantize_rows

from rlmix import async_sampling, loop
from rlmix.errors import ManifestError
from rlmix.policy import tiny_random
from rlmix.sampler_weights import REFRESH_METRIC
from rlmix.testing import make_run
from rlmix.testing.standins import FakeEnv, SimpleAlgorithm
from rlmix.types import Run

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[4]
NAME = lowbit.NAME


def _scaled(model: Any, std: float = 0.3) -> Any:
    """The tiny model's weights re-drawn at a larger scale, so its outputs are not uniform."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def _run(tmp_path: Path, precision: str, *extra: str) -> Run:
    run = make_run({"kit_env": FakeEnv(), "hf": rlmix_hf, "kit_algo": SimpleAlgorithm(),
                    NAME: lowbit},
                   ["train.prompts_per_step=2", "train.group_size=3", "sampling.max_new_tokens=8",
                    f"{NAME}.precision={precision}", f"out={tmp_path}", "train.eval_every=0",
                    "train.checkpoint_every=0", "log.plot=false", "train.lr=0.01", *extra],
                   with_policy=True)
    _scaled(run.policy.model)
    loop.configure(run)
    loop.prepare_model(run)
    return run


# ---------------------------------------------------------------- the copy


def test_the_copy_has_the_chosen_kind_and_dtype() -> None:
    master, _ = tiny_random()
    bf16 = LowbitWeights(master, "bf16", prepack=False)
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    assert all(p.dtype == torch.float32 for p in master.parameters())  # the master untouched
    assert not any(p.requires_grad for p in bf16.model.parameters())
    assert bf16.model.lm_head.weight is bf16.model.model.embed_tokens.weight  # still tied

    int8 = LowbitWeights(master, "int8")
    layer = int8.model.model.layers[0]
    for lin in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(lin, Int8Linear) and lin.qweight.dtype == torch.int8
        assert lin.kernel == "weight_only" and lin.act_dtype == torch.bfloat16
    assert isinstance(int8.model.lm_head, Int8Linear)  # auto: the copy's precision
    assert int8.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert int8.model.model.norm.weight.dtype == torch.bfloat16

    head_bf16 = LowbitWeights(master, "int8", lm_head="bf16", prepack=False)
    assert type(head_bf16.model.lm_head) is torch.nn.Linear
    assert head_bf16.model.lm_head.weight.dtype == torch.bfloat16
    head_fp32 = LowbitWeights(master, "bf16", lm_head="fp32", prepack=False)
    assert isinstance(head_fp32.model.lm_head, CastLinear)
    assert head_fp32.model.lm_head.weight.dtype == torch.float32

    dynamic = LowbitWeights(master, "int8", int8_kernel="dynamic")
    assert dynamic.model.model.layers[0].mlp.up_proj.kernel == "dynamic"
    assert dynamic.model.model.norm.weight.dtype == torch.float32  # fp32 activations

    # weight bytes read per forward: an int8 copy reads about a quarter of the fp32 master's
    fp32_bytes = sum(p.numel() * 4 for p in master.parameters())
    assert bf16.weight_bytes() == pytest.approx(fp32_bytes / 2, rel=0.01)
    assert int8.weight_bytes() < 0.3 * fp32_bytes


@pytest.mark.skipif(not prepack_ok("cpu"), reason="this CPU has no native bf16 for oneDNN")
def test_prepacked_bf16_copy_computes_what_the_plain_bf16_copy_does() -> None:
    master, _ = tiny_random()
    _scaled(master)
    plain = LowbitWeights(master, "bf16", prepack=False)
    packed = LowbitWeights(master, "bf16")  # prepack is the default
    assert packed.prepack and not plain.prepack
    linears = [m for m in packed.model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == sum(isinstance(m, torch.nn.Linear) for m in master.modules())
    assert not any(type(m) is torch.nn.Linear for m in packed.model.modules())
    # the tied head gets its own packed copy; the embedding table stays a bf16 parameter
    assert isinstance(packed.model.lm_head, PackedLinear)
    assert packed.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(packed.model.lm_head.unpacked(), master.lm_head.weight.bfloat16())
    assert packed.weight_bytes() == plain.weight_bytes()
    ids = torch.randint(0, master.config.vocab_size, (3, 9), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        want = plain.model(input_ids=ids).logits
        got = packed.model(input_ids=ids).logits
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)  # the same kernel's sums
        # a refresh re-packs: the copy follows the master (biases: the single layer below)
        for p in master.parameters():
            p.add_(0.05)
        packed.refresh(master)
        plain.refresh(master)
        assert torch.equal(packed.model(input_ids=ids).logits, plain.model(input_ids=ids).logits)
    layer = PackedLinear(16, 8, True)
    with pytest.raises(RuntimeError, match="before load"):
        layer(torch.zeros(2, 16))
    ref = torch.nn.Linear(16, 8)
    layer.load(ref.weight, ref.bias)
    x = torch.randn(2, 3, 16)
    assert torch.equal(layer(x), torch.nn.functional.linear(
        x.bfloat16(), ref.weight.detach().bfloat16(), ref.bias.detach().bfloat16()))
    with pytest.raises(ValueError, match="shape"):
        layer.load(torch.zeros(16, 8))


def test_prepack_is_ignored_where_onednn_cannot_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlmix_lowbit_rollout import quant

    monkeypatch.setattr(quant, "prepack_ok", lambda device: False)
    master, _ = tiny_random()
    copy = LowbitWeights(master, "bf16")
    assert not copy.prepack
    assert not any(isinstance(m, PackedLinear) for m in copy.model.modules())
    assert copy.model.lm_head.weight is copy.model.model.embed_tokens.weight  # plain and tied
    assert not prepack_ok("meta")  # never off the CPU


def test_int8_linear_matches_the_fp32_linear_on_random_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    for kernel, inner, gemm in (("weight_only", 64, "auto"), ("weight_only", 24, "auto"),
                                ("dynamic", 64, "auto"), ("dynamic", 24, "auto"),
                                ("w8a8", 64, "int_mm"), ("w8a8", 24, "int_mm"),
                                ("w8a8", 64, "fbgemm"), ("w8a8", 24, "fbgemm")):
        ref = torch.nn.Linear(inner, 48)
        with torch.no_grad():
            ref.weight.copy_(torch.randn(48, inner, generator=g))
            ref.bias.copy_(torch.randn(48, generator=g))
        q = Int8Linear(inner, 48, True, kernel, w8a8_gemm=gemm)
        q.load(ref.weight, ref.bias)
        x = torch.randn(3, 5, inner, generator=g)  # 3-d input, as inside a transformer
        y, want = q(x).float(), ref(x).detach()
        assert y.shape == want.shape
        rel = float((y - want).norm() / want.norm())
        assert rel < 0.02, (kernel, inner, gemm, rel)
        # the quantisation itself: |W - q s| <= s / 2 per row (s exact in its own dtype)
        assert bool(((q.dequantized() - ref.weight).abs()
                     <= q.scales.float()[:, None] / 2 + 1e-6).all())
    qw, scales = quantize_rows(torch.tensor([[1.0, -0.5, 0.0], [0.0, 0.0, 0.0]]))
    assert qw.tolist() == [[127, -64, 0], [0, 0, 0]] and scales[0] == pytest.approx(1 / 127)


def _bf16_weight(layer: Any) -> torch.Tensor:
    return layer.unpacked() if isinstance(layer, PackedLinear) else layer.weight.clone()


def test_refresh_after_an_optimizer_step_makes_the_copy_match_the_master(tmp_path: Path) -> None:
    for precision in ("bf16", "int8"):
        # the copy kept loaded after each rollout, to read it here (freeing: tested below)
        run = _run(tmp_path / precision, precision, f"{NAME}.free_while_training=false")
        weights = run.sampler_weights
        assert isinstance(weights, LowbitWeights) and weights.version == 0
        before = weights.model.model.layers[0].mlp.up_proj
        before = (_bf16_weight(before) if precision == "bf16" else before.dequantized())
        loop.train_step(run)
        assert run.policy_version == 1 and weights.version == 0  # refreshed at the next rollout
        run.sample(run.hook.rlmix_prompts(run=run, step=run.step))
        assert weights.version == 1
        logged = run.drain_metrics()
        assert logged[REFRESH_METRIC] > 0
        master = run.policy.model.model.layers[0].mlp.up_proj.weight.detach()
        copied = weights.model.model.layers[0].mlp.up_proj
        if precision == "bf16":
            assert torch.equal(_bf16_weight(copied), master.bfloat16())
            assert not torch.equal(_bf16_weight(copied), before)  # it moved with the master
        else:
            err = (copied.dequantized() - master).abs()
            assert bool((err <= copied.scales.float()[:, None] / 2 + 1e-6).all())
            assert not torch.equal(copied.dequantized(), before)
        for a, b in zip(weights.model.model.norm.parameters(),
                        run.policy.model.model.norm.parameters()):
            assert torch.equal(a, b.detach().to(a.dtype))


def _outlier_layer(kernel: str, inner: int = 64, gemm: str = "auto"
                   ) -> tuple[torch.nn.Linear, Int8Linear]:
    g = torch.Generator().manual_seed(1)
    ref = torch.nn.Linear(inner, 32, bias=False)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(32, inner, generator=g))
    q = Int8Linear(inner, 32, False, kernel, w8a8_gemm=gemm)
    q.load(ref.weight)
    return ref, q


def _rel(y: torch.Tensor, want: torch.Tensor) -> float:
    return float((y - want).norm() / want.norm())


def test_w8a8_scales_each_token_on_its_own() -> None:
    """A prompt's first token can carry activations 100x the others' (the "massive
    activations" of small LMs). One scale per tensor (``dynamic``) then rounds the other tokens
    to a few levels; one scale per token (``w8a8``, through either per-token GEMM) leaves them
    as accurate as alone."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 64, generator=g)
    x[0] *= 300.0  # one loud token among six
    errors = {}
    for kernel, gemm in (("dynamic", "auto"), ("w8a8", "int_mm"), ("w8a8", "fbgemm")):
        ref, q = _outlier_layer(kernel, gemm=gemm)
        errors[kernel, gemm] = _rel(q(x)[1:].float(), ref(x)[1:].detach())  # the quiet tokens
        assert _rel(q(x)[:1].float(), ref(x)[:1].detach()) < 0.02  # and the loud one
    for gemm in ("int_mm", "fbgemm"):
        assert errors["w8a8", gemm] < 0.02, errors
        assert errors["dynamic", "auto"] > 5 * errors["w8a8", gemm], errors


def test_the_w8a8_gemm_is_fbgemm_without_vnni_and_int_mm_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``w8a8_gemm: auto``: without VNNI torch._int_mm is a reference loop (15-30x slower than
    fp32 at 8 rows on an AVX2 CPU, BENCHMARKS.md), so the per-token GEMM is fbgemm's."""
    for vnni, want in ((True, "int_mm"), (False, "fbgemm")):
        monkeypatch.setattr(quant, "_VNNI", vnni)
        assert quant.resolve_w8a8_gemm("auto") == want
        assert Int8Linear(16, 8, False, "w8a8").w8a8_gemm == want
        assert quant.resolve_w8a8_gemm("int_mm") == "int_mm"
    with pytest.raises(ValueError, match="w8a8_gemm"):
        quant.resolve_w8a8_gemm("cublas")
    # fbgemm has VNNI kernels for AVX512-VNNI only: AVX-VNNI alone keeps its int16 pair sums
    for flags, vnni, fbgemm_vnni in (("avx2 avx_vnni", True, False),
                                     ("avx512f avx512_vnni", True, True), ("avx2", False, False)):
        text = f"flags : {flags}\n"
        assert (quant._cpu_has_vnni(text), quant._fbgemm_has_vnni(text)) == (vnni, fbgemm_vnni)
    with pytest.raises(ValueError, match="w8a8_gemm"):
        LowbitWeights(_LoudTokenModel(), "int8", int8_kernel="w8a8", w8a8_gemm="cublas")


def test_without_vnni_w8a8_keeps_fbgemms_int16_pair_sums_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without VNNI kernels (fbgemm has them for AVX512-VNNI only) fbgemm adds pairs of u8
    activation x s8 weight products in saturating int16, which 8-bit activations and 8-bit
    weights can overflow; w8a8 stores weights of at most 63 in magnitude there (255 * 63 * 2
    <= 32767) and keeps 8-bit activations. The input below
    (every weight at its row's maximum, activations at the top of their range) is the worst
    case: the layer is exact up to rounding on every CPU."""
    w = torch.ones(4, 64)
    x = torch.ones(2, 64)
    x[:, 0] = -1.0  # activations span [-1, 1], so the ones quantise to u8 255
    want = float(x[0] @ w[0])
    for vnni, qmax in ((True, 127), (False, 63)):
        monkeypatch.setattr(quant, "_FBGEMM_VNNI", vnni)
        layer = Int8Linear(64, 4, False, "w8a8", w8a8_gemm="fbgemm")
        layer.load(w)
        assert int(layer.int8_weight().abs().max()) == qmax
    monkeypatch.undo()
    for gemm in ("fbgemm", "int_mm"):
        layer = Int8Linear(64, 4, False, "w8a8", w8a8_gemm=gemm)
        layer.load(w)
        assert float(layer(x)[0, 0]) == pytest.approx(want, rel=0.02)
        # fbgemm's packed copy is the only one kept where every call runs it
        assert (layer.qweight.numel() == 0) == (gemm == "fbgemm")
        assert torch.equal(layer.int8_weight().float() * layer.scales[:, None],
                           layer.dequantized())
    if not quant._FBGEMM_VNNI:  # the hardware fact behind it, on this CPU: 8-bit weights saturate
        q, scales = quantize_rows(w, qmax=127)
        packed = quant._fbgemm_pack(q, scales, None)
        got = float(torch.ops.quantized.linear_dynamic(x, packed, False)[0, 0])
        assert abs(got - want) > 0.5 * want, got
    with pytest.raises(ValueError, match="qmax"):
        quantize_rows(w, qmax=128)


def test_smoothing_moves_an_outlier_channel_into_the_weights() -> None:
    """Outlier *channels* (one input feature large in every token) defeat per-token scales too;
    SmoothQuant's factor ``s_j = max|X_j|^a / max|W_j|^(1-a)`` divides them out of the
    activations and into the weight columns, and the product is unchanged."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=g)
    x[:, 5] *= 200.0
    x[:, 40] *= 80.0
    ref, q = _outlier_layer("w8a8")
    plain = _rel(q(x).float(), ref(x).detach())
    q.set_smoothing(x.abs().amax(0), ref.weight, alpha=0.5)
    q.load(ref.weight)
    smoothed = _rel(q(x).float(), ref(x).detach())
    assert smoothed < plain / 3, (plain, smoothed)
    assert smoothed < 0.02
    s = q.smooth
    assert float(s[5]) > float(s[40]) > float(s.median())  # the loud channels get the most
    # the weight the layer multiplies by is still the master's, up to each row's half step / s
    bound = q.scales.float()[:, None] / (2 * s[None, :]) + 1e-6
    assert bool(((q.dequantized() - ref.weight).abs() <= bound).all())
    with pytest.raises(ValueError, match="w8a8"):
        _outlier_layer("dynamic")[1].set_smoothing(x.abs().amax(0), ref.weight, 0.5)


def test_w8a8_copy_calibrates_on_its_first_prompts_and_keeps_the_factors() -> None:
    master, _ = tiny_random()
    _scaled(master)
    copy = LowbitWeights(master, "int8", int8_kernel="w8a8")
    up = copy.model.model.layers[0].mlp.up_proj
    assert up.kernel == "w8a8" and not copy.calibrated
    assert torch.equal(up.smooth, torch.ones_like(up.smooth))  # ones until calibrated
    ids = torch.randint(0, master.config.vocab_size, (2, 7), generator=torch.Generator()
                        .manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: left out of the statistics
    with torch.no_grad():
        out = copy.model(input_ids=ids, attention_mask=mask).logits
        want = master(input_ids=ids, attention_mask=mask).logits
    assert copy.calibrated and not torch.equal(up.smooth, torch.ones_like(up.smooth))
    assert _rel(out[1].float(), want[1]) < 0.05
    # layers reading one input share its factors and quantise it once; o_proj reads its own
    attn = copy.model.model.layers[0].self_attn
    assert attn.q_proj.shared_input is attn.k_proj.shared_input is attn.v_proj.shared_input
    assert attn.q_proj.shared_input is not None and attn.o_proj.shared_input is None
    assert torch.equal(attn.q_proj.smooth, attn.v_proj.smooth)
    assert up.shared_input is copy.model.model.layers[0].mlp.gate_proj.shared_input
    shared = [(m, m.shared_input) for m in copy.model.modules() if isinstance(m, Int8Linear)]
    for m, _ in shared:
        m.shared_input = None
    with torch.no_grad():  # quantising once per input is the same arithmetic as per layer
        alone = copy.model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(alone, out)
    for m, cache in shared:
        m.shared_input = cache
    factors = up.smooth.clone()
    with torch.no_grad():
        for p in master.parameters():
            p.mul_(1.01)
    copy.refresh(master)  # re-quantised with the same factors
    assert torch.equal(up.smooth, factors)
    w = master.model.layers[0].mlp.up_proj.weight.detach()
    bound = up.scales.float()[:, None] / (2 * up.smooth[None, :]) + 1e-6
    assert bool(((up.dequantized() - w).abs() <= bound).all())
    with torch.no_grad():  # the second forward does not calibrate again
        copy.model(input_ids=ids[:, :3])
    assert torch.equal(up.smooth, factors)


class _LoudTokenModel(torch.nn.Module):
    """Two linears; before the second, the first position of every row is made 300x louder
    than the rest (as small LMs' first tokens are): the first reads tokens of alike range, the
    second does not."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.embed = torch.nn.Embedding(50, 64)
        self.first = torch.nn.Linear(64, 64)
        self.second = torch.nn.Linear(64, 64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> torch.Tensor:
        h = self.first(self.embed(input_ids))
        if h.shape[1] > 1:
            h = torch.cat([h[:, :1] * 300.0, h[:, 1:]], 1)
        return self.second(h)


def test_w8a8_decode_takes_one_scale_per_call_only_where_the_tokens_are_alike() -> None:
    """``w8a8_decode: auto``: calibration measures each layer's token spread (largest per-token
    range of the smoothed input over the median one); a layer at or under ``w8a8_max_spread``
    runs its decode calls (one position per row) in fbgemm's per-tensor kernel, a layer over it
    keeps per-token scales, and prefill is per token everywhere."""
    master = _LoudTokenModel()
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    copy = LowbitWeights(master, "int8", int8_kernel="w8a8", prepack=False)
    with torch.no_grad():
        prefill = copy.model(input_ids=ids)  # calibrates
    first, second = copy.model.first, copy.model.second
    assert copy.spreads["first"] <= 4.0 < 50.0 < copy.spreads["second"], copy.spreads
    assert first.decode_per_tensor and first.packed is not None
    assert not second.decode_per_tensor
    # the per-token layer holds fbgemm's packing only where fbgemm is its per-token GEMM
    assert (second.packed is not None) == (second.w8a8_gemm == "fbgemm")
    # the same copy with per-token scales everywhere computes the prefill bit for bit
    token = LowbitWeights(master, "int8", int8_kernel="w8a8", prepack=False, w8a8_decode="token")
    with torch.no_grad():
        assert torch.equal(token.model(input_ids=ids), prefill)
    assert token.spreads == {} and not token.model.first.decode_per_tensor
    # a decode call: the first layer runs fbgemm on the smoothed input; still near the master
    step = ids[:, -1:]
    x = copy.model.embed(step)
    with torch.no_grad():
        got = first(x)
        want = torch.ops.quantized.linear_dynamic(
            (x.reshape(-1, 64) * first.inv_smooth).contiguous(), first.packed,
            False).mul(first.scales).reshape(got.shape) + first.bias
        assert torch.equal(got, want)
        assert not torch.equal(got, token.model.first(x))  # another path
        assert _rel(got, master.first(x)) < 0.02
        assert _rel(copy.model(input_ids=step), master(input_ids=step)) < 0.03
    # the bound decides; at 1 (every token's range equal to the median) no layer qualifies
    tight = LowbitWeights(master, "int8", int8_kernel="w8a8", prepack=False, w8a8_max_spread=1.0)
    loose = LowbitWeights(master, "int8", int8_kernel="w8a8", prepack=False,
                          w8a8_max_spread=1e6)
    with torch.no_grad():
        tight.model(input_ids=ids)
        loose.model(input_ids=ids)
    assert not tight.model.first.decode_per_tensor
    assert loose.model.first.decode_per_tensor and loose.model.second.decode_per_tensor
    with pytest.raises(ValueError, match="w8a8_decode"):
        LowbitWeights(master, "int8", int8_kernel="w8a8", w8a8_decode="tensor")
    with pytest.raises(ValueError, match="w8a8_max_spread"):
        LowbitWeights(master, "int8", int8_kernel="w8a8", w8a8_max_spread=0.5)


def test_the_copy_can_run_its_own_attention_implementation() -> None:
    master, _ = tiny_random()
    _scaled(master)
    before = master.config._attn_implementation
    default = LowbitWeights(master, "bf16", prepack=False)
    eager = LowbitWeights(master, "bf16", prepack=False, attention="eager")
    assert default.model.config._attn_implementation == before  # "model": the master's
    assert eager.model.config._attn_implementation == "eager"
    assert eager.model.model.layers[0].self_attn.config is eager.model.config
    assert master.config._attn_implementation == before  # the master keeps its own
    ids = torch.randint(0, master.config.vocab_size, (3, 9), generator=torch.Generator()
                        .manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: the mask reaches both implementations
    with torch.no_grad():
        want = master(input_ids=ids, attention_mask=mask).logits
        a = default.model(input_ids=ids, attention_mask=mask).logits.float()
        b = eager.model(input_ids=ids, attention_mask=mask).logits.float()
    # the same function in bf16 either way: as close to each other as each is to fp32
    assert _rel(b[:, 4:], a[:, 4:]) < 0.02 and _rel(b[1:], want[1:]) < 0.03
    with pytest.raises(ValueError, match="attention"):
        LowbitWeights(master, "bf16", attention="flash")


# ---------------------------------------------------------------- free_while_training


def _freed_config(precision: str, kernel: str, prepack: bool) -> tuple[LowbitWeights, Any]:
    master, _ = tiny_random()
    _scaled(master)
    return LowbitWeights(master, precision, int8_kernel=kernel, prepack=prepack,
                         free_while_training=True), master


@pytest.mark.parametrize("precision, kernel, prepack", [
    ("bf16", "weight_only", True), ("bf16", "weight_only", False), ("int8", "weight_only", True),
    ("int8", "dynamic", True), ("int8", "w8a8", True)])
def test_a_released_copy_holds_no_weights_and_computes_the_same_after_refresh(
        precision: str, kernel: str, prepack: bool) -> None:
    copy, master = _freed_config(precision, kernel, prepack)
    ids = torch.randint(0, master.config.vocab_size, (2, 7), generator=torch.Generator()
                        .manual_seed(0))

    def held() -> int:  # bytes of every distinct storage the copy's module holds, packed too
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*copy.model.parameters(), *copy.model.buffers())}
        packed = sum(m.in_features * m.out_features * (1 if isinstance(m, Int8Linear) else 2)
                     for m in copy.model.modules()
                     if isinstance(m, Int8Linear | PackedLinear) and m.packed is not None)
        return sum(storages.values()) + packed

    with torch.no_grad():
        copy.model(input_ids=ids)  # w8a8 calibrates on its first forward (and refreshes)
        want = copy.model(input_ids=ids).logits
        want_decode = copy.model(input_ids=ids[:, :1]).logits  # one position per row
    before = held()
    assert copy.release() is True and copy.released
    freed = copy._freeable()
    assert freed and all(t.untyped_storage().nbytes() == 0 for t in freed)
    # what stays: int8 scales, w8a8 smoothing factors, biases, rotary tables: a small part
    assert held() < 0.1 * before, (held(), before)
    packed = [m for m in copy.model.modules() if isinstance(m, PackedLinear | Int8Linear)]
    assert all(getattr(m, "packed", None) is None for m in packed)
    with pytest.raises(RuntimeError, match="released"):
        copy.model(input_ids=ids)
    copy.refresh(master)
    assert not copy.released and held() == before
    with torch.no_grad():
        assert torch.equal(copy.model(input_ids=ids).logits, want)  # bit for bit
        assert torch.equal(copy.model(input_ids=ids[:, :1]).logits, want_decode)
    assert copy.release() and copy.release()  # twice in a row is harmless
    copy.refresh(master)
    with torch.no_grad():
        assert torch.equal(copy.model(input_ids=ids).logits, want)


def test_release_does_nothing_when_the_setting_is_off() -> None:
    master, _ = tiny_random()
    copy = LowbitWeights(master, "bf16")  # free_while_training defaults to False here
    assert copy.release() is False and not copy.released
    assert all(t.untyped_storage().nbytes() > 0 for t in copy._freeable())
    copy.model(input_ids=torch.zeros(1, 3, dtype=torch.long))


def test_the_run_frees_the_copy_between_rollouts_and_learns_the_same(tmp_path: Path) -> None:
    """The default (free_while_training) frees the copy after each training rollout and
    rebuilds it at the next one; the run's weights after three steps are bit-equal to a run
    that keeps the copy, since the rebuilt copy computes what the kept one does."""
    for precision in ("bf16", "int8"):
        finals = {}
        for free in (True, False):
            torch.manual_seed(0)
            run = _run(tmp_path / f"{precision}-{free}", precision,
                       f"{NAME}.free_while_training={str(free).lower()}", "train.seed=0")
            weights = run.sampler_weights
            for _ in range(3):
                metrics = loop.train_step(run)
                assert weights.released == free
                assert weights.version == (-1 if free else run.policy_version - 1)
                assert f"{NAME}/logp_diff_abs_mean" in metrics
            assert all((t.untyped_storage().nbytes() == 0) == free for t in weights._freeable())
            finals[free] = [p.detach().clone() for p in run.policy.model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(finals[True], finals[False])), precision


# ---------------------------------------------------------------- mismatch metrics


def test_mismatch_metrics_by_hand() -> None:
    train = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, 0.0, 0.0]])
    behavior = torch.tensor([[0.0, -1.5, -1.0, 0.0], [0.0, -0.5, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    m = mismatch_metrics(train, behavior, mask)  # d = +0.5, -1.0 | 0
    assert m["tokens"] == 3
    assert m["logp_diff_abs_mean"] == pytest.approx(1.5 / 3)
    assert m["logp_diff_abs_max"] == pytest.approx(1.0)
    assert m["logp_diff_mean"] == pytest.approx(-0.5 / 3)
    k3 = (math.exp(0.5) - 1 - 0.5) + (math.exp(-1.0) - 1 + 1.0)  # row 0; row 1 is 0
    assert m["kl_seq"] == pytest.approx(k3 / 2, rel=1e-6)
    assert m["kl_seq_k1"] == pytest.approx((-(0.5 - 1.0) + 0.0) / 2)
    same = mismatch_metrics(train, train, mask)
    assert all(v == 0 for k, v in same.items() if k != "tokens")
    empty = mismatch_metrics(train, behavior, torch.zeros_like(mask))
    assert empty["tokens"] == 0 and empty["kl_seq"] == 0
    # two minibatches combine to the whole batch's figures
    halves = [mismatch_metrics(train[i:i + 1], behavior[i:i + 1], mask[i:i + 1])
              for i in range(2)]
    whole = lowbit._combine(halves[0], halves[1], 1, 1)
    for k, v in m.items():
        assert whole[k] == pytest.approx(v), k


def test_mismatch_is_near_zero_with_the_fp32_sampler_and_not_with_int8(tmp_path: Path) -> None:
    seen = {}
    for precision in ("fp32", "bf16", "int8"):
        run = _run(tmp_path / precision, precision)
        assert (run.sampler_weights is None) == (precision == "fp32")
        metrics = loop.train_step(run)
        for key in ("logp_diff_abs_mean", "logp_diff_abs_max", "kl_seq", "kl_seq_k1"):
            assert f"{NAME}/{key}" in metrics
        assert metrics[f"{NAME}/tokens"] == pytest.approx(
            metrics["response_length/mean"] * 6)
        seen[precision] = metrics[f"{NAME}/logp_diff_abs_mean"]
    assert seen["fp32"] < 1e-4  # same weights, same precision: only summation order differs
    assert seen["int8"] > 1e-3 and seen["bf16"] > 1e-4
    assert seen["int8"] > seen["bf16"]


# ---------------------------------------------------------------- async, settings, example


def test_the_async_worker_samples_with_this_copy(tmp_path: Path) -> None:
    run = _run(tmp_path, "int8", "train.max_staleness=1")
    sampler = async_sampling.start(run, 1)
    try:
        assert sampler.weights is run.sampler_weights
        assert sampler.policy.model is run.sampler_weights.model
        assert sampler.policy.model is not run.policy.model
        assert isinstance(sampler.policy.model.lm_head, Int8Linear)
        m1 = loop.train_step(run)
        m2 = loop.train_step(run)
    finally:
        async_sampling.stop(run)
    assert run.sampler_weights.version >= 1  # the worker refreshed it after the first update
    assert m2[f"{NAME}/logp_diff_abs_mean"] > 1e-3 and m1["staleness/max"] <= 1


@pytest.mark.parametrize("override, match", [
    ("precision=fp16", r"lowbit_rollout\.precision"),
    ("lm_head=int4", r"lowbit_rollout\.lm_head"),
    ("int8_kernel=fbgemm", r"lowbit_rollout\.int8_kernel"),
    ("int8_kernel=dynamic", r"applies to precision int8 only"),
    ("precision=auto int8_kernel=w8a8", r"applies to precision int8 only"),
    ("smooth_alpha=1.5", r"smooth_alpha"),
    ("attention=flash", r"lowbit_rollout\.attention"),
    ("precision=int8 int8_kernel=w8a8 w8a8_decode=tensor", r"lowbit_rollout\.w8a8_decode"),
    ("precision=int8 int8_kernel=w8a8 w8a8_max_spread=0.5", r"w8a8_max_spread"),
    ("precision=int8 int8_kernel=w8a8 w8a8_gemm=cublas", r"lowbit_rollout\.w8a8_gemm"),
    ("precision=fp32 attention=eager", r"needs a low-precision copy"),
])
def test_bad_settings_fail_clearly(override: str, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        make_run({"kit_env": FakeEnv(), NAME: lowbit}, [f"{NAME}.{o}" for o in override.split()])
    with pytest.raises(ManifestError, match="needs a low-precision copy"):
        make_run({"kit_env": FakeEnv(), NAME: lowbit},
                 [f"{NAME}.precision=fp32", f"{NAME}.lm_head=int8"])


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_builds_a_bf16_copy_only_where_bf16_is_native(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        native: bool) -> None:
    import rlmix.policy

    monkeypatch.setattr(rlmix.policy, "native_bf16", lambda device: native)
    # attention eager is the demo's setting: unused (not refused) when auto picks fp32
    run = _run(tmp_path, "auto", f"{NAME}.attention=eager")
    said = capsys.readouterr()
    log = (tmp_path / "rlmix.log").read_text() if (tmp_path / "rlmix.log").exists() else ""
    assert run.plugin_resources(NAME)["precision"] == ("bf16" if native else "fp32")
    assert "precision" not in said.err  # not a warning
    if native:
        assert isinstance(run.sampler_weights, LowbitWeights)
        assert run.sampler_weights.model.model.embed_tokens.weight.dtype == torch.bfloat16
        assert "precision auto" not in said.out + log
    else:
        assert run.sampler_weights is None  # the master samples
        assert "precision auto -> fp32" in said.out and "precision auto -> fp32" in log
    metrics = loop.train_step(run)  # and the run trains, with the metrics either way
    assert f"{NAME}/logp_diff_abs_mean" in metrics


def test_explicit_bf16_is_kept_with_a_warning_where_it_is_not_native(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import rlmix.policy

    monkeypatch.setattr(rlmix.policy, "native_bf16", lambda device: False)
    run = _run(tmp_path, "bf16")
    assert isinstance(run.sampler_weights, LowbitWeights)
    assert "warning: lowbit_rollout.precision bf16" in capsys.readouterr().err
    assert lowbit.resolve_precision("int8", "cpu") == ("int8", None)  # int8 is never second-guessed
    assert lowbit.resolve_precision("fp32", "cpu") == ("fp32", None)


def test_the_example_manifest_runs(tmp_path: Path) -> None:
    from rlmix import cli
    from rlmix.testing import skip_unless_installed

    example = ROOT / "examples" / "lowbit-arith.yaml"
    skip_unless_installed(example)
    # precision bf16: the copy's path on every machine (the example's auto picks fp32 where bf16
    # is not native; test_auto_precision_... covers that choice)
    code = cli.main(["run", str(example), "model=tiny-random", "arith.eval_size=4",
                     f"{NAME}.precision=bf16",
                     "arith.eval_max_new_tokens=6", "sampling.max_new_tokens=6",
                     "train.steps=2", "train.prompts_per_step=2", "train.group_size=4",
                     "train.eval_every=0", "train.checkpoint_every=0", "log.progress=false",
                     "log.plot=false", f"out={tmp_path}"])
    assert code == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert REFRESH_METRIC in rows[1]  # refreshed after step 1's optimizer step
    for r in rows:
        assert r[f"{NAME}/logp_diff_abs_mean"] > 0
        assert "rollout_correction/ratio_mean" in r


def test_log_probs_on_a_copy_whose_head_has_no_plain_weight() -> None:
    """A rollout that scores with the policy's token log-probs on the sampler copy (the kit's
    stand-in does) meets a packed or int8 head: the reference and the fused kernel both run
    the head's own forward, and agree with the plain bf16 head's log-probs."""
    from rlmix_fused_logprobs import token_logprobs

    from rlmix.policy import plain_token_logprobs

    master, _ = tiny_random()
    _scaled(master)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 3, master.config.hidden_size, generator=g).bfloat16()
    labels = torch.randint(0, master.config.vocab_size, (2, 3), generator=g)
    plain = LowbitWeights(master, "bf16", prepack=False).model.lm_head
    want, _ = plain_token_logprobs(hidden, plain, labels)  # fp32 projection
    want_bf16, _ = plain_token_logprobs(hidden, plain, labels, matmul_dtype=torch.bfloat16)
    heads = [LowbitWeights(master, "int8").model.lm_head]
    if prepack_ok("cpu"):
        heads.append(LowbitWeights(master, "bf16").model.lm_head)
    for head in heads:
        assert not isinstance(getattr(head, "weight", None), torch.Tensor)
        for fn in (plain_token_logprobs, token_logprobs):
            logp, ent = fn(hidden, head, labels)
            assert logp.shape == labels.shape and bool(torch.isfinite(ent).all())
            if isinstance(head, PackedLinear):  # a bf16 projection, as the packed kernel does
                assert torch.equal(logp, want_bf16), fn
            else:
                assert float((logp - want).abs().max()) <= 0.05, fn
