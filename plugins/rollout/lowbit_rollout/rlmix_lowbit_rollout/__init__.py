"""Low-precision rollouts: training rollouts are sampled with a bf16 or int8 copy of the policy
while the trainer keeps its fp32 master weights, and every step logs how far the two policies
are apart on the sampled tokens.

* ``rlmix_sampler_weights`` gives the core the copy (``quant.LowbitWeights``); the core
  refreshes it after each optimizer step and samples with it (``rlmix.sampler_weights``), so
  the engine's behaviour log-probs are the low-precision sampler's. With
  ``free_while_training`` the copy frees its weights after each synchronous rollout (the core
  calls its ``release``) and the next refresh rebuilds them. In async mode
  (``train.max_staleness > 0``) the background worker samples with this copy, which stays.
* ``rlmix_clip`` (a wrapper that changes nothing) logs the mismatch between the trainer's
  log-probs and the behaviour log-probs over completion tokens (``mismatch_metrics``).

Correcting the mismatch is ``rollout_correction``'s job (TIS / MIS / AIS), unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import rlmix
import rlmix.policy
from rlmix import ops, runfolder
from rlmix.types import LossTerms, Minibatch, RolloutBatch, Run

from .quant import (
    ATTENTIONS,
    HEADS,
    KERNELS,
    PRECISIONS,
    W8A8_DECODE,
    W8A8_GEMMS,
    CastLinear,
    Int8Linear,
    LowbitWeights,
    PackedLinear,
    prepack_ok,
)

NAME = "lowbit_rollout"
TRAIN_LOGP = "rollout_correction.train_logp"  # rollout_correction's step-start trainer logp
_CLAMP = 20.0  # log-ratios clamped before exp (metrics only)

__all__ = ["CastLinear", "Int8Linear", "LowbitWeights", "PackedLinear", "Settings",
           "mismatch_metrics", "prepack_ok"]


@dataclass
class Settings:
    # sampler weights: fp32 (the master itself) | bf16 | int8 | auto (bf16 where the policy's
    # device computes bf16 natively, rlmix.policy.native_bf16; else fp32: on an AVX2-only CPU a
    # bf16 copy samples about 2x slower than the fp32 master, BENCHMARKS.md)
    precision: str = "bf16"
    # int8 linears: weight_only (int8 weights x bf16 activations, torch._weight_int8pack_mm) |
    # dynamic (int8 weights x activations quantised per call, one scale per tensor, fbgemm) |
    # w8a8 (SmoothQuant-smoothed int8 weights x activations quantised per token, torch._int_mm)
    int8_kernel: str = "weight_only"
    smooth_alpha: float = 0.5  # w8a8: SmoothQuant's migration strength (0: none, 1: all)
    # w8a8, decode calls: auto (layers whose tokens have alike ranges at calibration, spread <=
    # w8a8_max_spread, take one activation scale per call in fbgemm's one-kernel path; the
    # rest, and every prefill, per token) | token (per token always)
    w8a8_decode: str = "auto"
    # w8a8, auto: the largest token spread (a layer's largest per-token input range over the
    # median token's, at calibration) whose decode calls take one scale per call
    w8a8_max_spread: float = 4.0
    # w8a8 on the CPU, the per-token int8 GEMM: auto (torch._int_mm where the CPU has VNNI, else
    # fbgemm: without VNNI torch._int_mm is a reference loop, far slower than fp32) | int_mm |
    # fbgemm (fbgemm's kernel on rows scaled to unit range, so its one scale fits each token)
    w8a8_gemm: str = "auto"
    lm_head: str = "auto"  # the LM head: auto (the copy's precision) | fp32 | bf16 | int8
    # bf16 linears (and a bf16 head) hold their weight pre-packed for oneDNN, re-packed at each
    # refresh: no per-call re-layout of the weight. CPU with native bf16 only; ignored elsewhere
    prepack: bool = True
    # free the copy's weights after each synchronous training rollout and rebuild them at the
    # next refresh, so the copy takes no memory while the trainer runs (async mode: ignored)
    free_while_training: bool = True
    # the copy's attention: model (what the master uses) | eager (plain matmuls and softmax,
    # faster than CPU SDPA at one query token, but [rows, heads, L, L] scores in the prefill) |
    # sdpa. The master (evaluation, training) keeps its own
    attention: str = "model"
    metrics: bool = True  # log the rollout-training mismatch every step

    def __post_init__(self) -> None:
        rlmix.check_choices(self, precision=(*PRECISIONS, "auto"), int8_kernel=KERNELS,
                            lm_head=HEADS,
                            attention=ATTENTIONS, w8a8_decode=W8A8_DECODE,
                            w8a8_gemm=W8A8_GEMMS)
        if not self.w8a8_max_spread >= 1.0:
            raise ValueError(f"w8a8_max_spread: {self.w8a8_max_spread} is below 1 (a ratio of "
                             f"the largest token range to the median one)")
        if self.precision == "fp32" and self.attention != "model":
            raise ValueError(f"attention: {self.attention!r} needs a low-precision copy; "
                             f"precision fp32 samples with the master model itself")
        if self.precision == "fp32" and self.lm_head not in ("auto", "fp32"):
            raise ValueError(f"lm_head: {self.lm_head!r} needs a low-precision copy; precision "
                             f"fp32 samples with the master model itself (lm_head auto)")
        if not 0.0 <= self.smooth_alpha <= 1.0:
            raise ValueError(f"smooth_alpha: {self.smooth_alpha} is outside [0, 1]")
        if self.precision != "int8" and self.int8_kernel != "weight_only":
            raise ValueError(f"int8_kernel: {self.int8_kernel!r} applies to precision int8 only "
                             f"(precision is {self.precision!r})")


# ---------------------------------------------------------------- pure tensor math


def mismatch_metrics(train_logp: torch.Tensor, behavior_logp: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer's policy pi and the sampler's mu are apart on the sampled tokens.

    ``d = log pi - log mu`` per token (``[n, T]``; ``mask`` the completion tokens). Returns
    ``logp_diff_abs_mean`` (mean of ``|d|`` over completion tokens), ``logp_diff_abs_max``,
    ``logp_diff_mean`` (signed), ``kl_seq`` (sequence-level KL(mu || pi), the mean over
    sequences of the sum of per-token k3 estimates ``exp(d) - 1 - d``: each is unbiased for the
    token's conditional KL under mu's samples and never negative, and by the chain rule their
    sum is unbiased for the sequence KL), ``kl_seq_k1`` (the same with k1 = ``-d``: unbiased, can
    be negative) and ``tokens`` (completion tokens counted)."""
    m = mask.float()
    count = m.sum()
    if float(count) == 0:
        return {"logp_diff_abs_mean": 0.0, "logp_diff_abs_max": 0.0, "logp_diff_mean": 0.0,
                "kl_seq": 0.0, "kl_seq_k1": 0.0, "tokens": 0.0}
    d = (train_logp.float() - behavior_logp.float()) * m
    k3 = ops.kl_estimate(behavior_logp.float(), behavior_logp.float() + d.clamp(-_CLAMP, _CLAMP),
                         "k3") * m
    rows = m.sum(-1) > 0
    return {
        "logp_diff_abs_mean": float(d.abs().sum() / count),
        "logp_diff_abs_max": float(d.abs().max()),
        "logp_diff_mean": float(d.sum() / count),
        "kl_seq": float(k3.sum(-1)[rows].mean()),
        "kl_seq_k1": float((-d).sum(-1)[rows].mean()),
        "tokens": float(count),
    }


def _combine(old: dict[str, float], new: dict[str, float], rows_old: int,
             rows_new: int) -> dict[str, float]:
    """Two minibatches' metrics as one batch's (token-weighted means, max, sequence means)."""
    t0, t1 = old["tokens"], new["tokens"]
    tokens = t0 + t1
    out = {"tokens": tokens,
           "logp_diff_abs_max": max(old["logp_diff_abs_max"], new["logp_diff_abs_max"])}
    for k in ("logp_diff_abs_mean", "logp_diff_mean"):
        out[k] = (old[k] * t0 + new[k] * t1) / tokens if tokens else 0.0
    rows = rows_old + rows_new
    for k in ("kl_seq", "kl_seq_k1"):
        out[k] = (old[k] * rows_old + new[k] * rows_new) / rows if rows else 0.0
    return out


# ---------------------------------------------------------------- the hooks


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s: Settings = run.settings(NAME)
    res = run.plugin_resources(NAME)
    res.clear()
    if s.precision == "int8" and s.int8_kernel == "dynamic" and run.policy is not None and \
            run.policy.device.type != "cpu":
        raise rlmix.ConfigError(f"{NAME}.int8_kernel: dynamic is fbgemm's CPU kernel; the policy "
                                f"is on {run.policy.device.type} (use weight_only)")


def resolve_precision(precision: str, device: Any) -> tuple[str, str | None]:
    """``precision`` as the copy is built, and a line to tell the user, or None: ``auto`` is
    bf16 where ``device`` computes bf16 natively, else fp32 (no copy); an explicit bf16 on a
    device without native bf16 is kept, with a warning."""
    native = rlmix.policy.native_bf16(device)  # looked up at call time (tests replace it)
    why = rlmix.policy.without_native_bf16(device)
    if precision == "auto":
        if native:
            return "bf16", None
        return "fp32", f"rlmix: {NAME}.precision auto -> fp32 (the master samples; no copy): {why}"
    if precision == "bf16" and not native:
        return precision, (f"rlmix: warning: {NAME}.precision bf16, but {why}: this copy samples "
                           f"slower than the fp32 master here; precision: auto picks the faster "
                           f"one")
    return precision, None


@rlmix.hookimpl
def rlmix_sampler_weights(run: Run, master: Any) -> LowbitWeights | None:
    s: Settings = run.settings(NAME)
    device = next(master.parameters()).device
    precision, line = resolve_precision(s.precision, device)
    if line is not None:
        runfolder.note(run.out_dir, line)
    run.plugin_resources(NAME)["precision"] = precision
    if precision == "fp32":
        return None  # sample with the master itself (the metrics still run)
    return LowbitWeights(master, precision, s.lm_head, s.int8_kernel, s.smooth_alpha,
                         s.prepack, s.free_while_training, s.attention, s.w8a8_decode,
                         s.w8a8_max_spread, s.w8a8_gemm)


@rlmix.hookimpl(wrapper=True)
def rlmix_advantage(run: Run, batch: RolloutBatch):
    advantages = yield
    # the mismatch is measured at the weights that start this step: before its first update
    run.plugin_resources(NAME)["version"] = (run.step, run.policy_version)
    return advantages


@rlmix.hookimpl(wrapper=True)
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor):
    terms: LossTerms | None = yield
    s: Settings = run.settings(NAME)
    res = run.plugin_resources(NAME)
    batch = mb.batch
    if not s.metrics or int(mb.epoch) > 0:  # later epochs see the same rows again
        return terms
    train_logp = batch.extras.get(TRAIN_LOGP)
    fresh = res.get("version") == (run.step, run.policy_version)
    if train_logp is None and not fresh:
        return terms  # after this step's first optimizer step: the trainer moved on
    train_logp = logp.detach() if train_logp is None else train_logp.to(logp.device)
    mask = batch.completion_mask.to(logp.device)
    new = mismatch_metrics(train_logp, batch.behavior_logp.to(logp.device), mask)
    rows = int((mask.sum(-1) > 0).sum())
    acc = res.get("acc")
    if acc is not None and acc[0] == run.step:  # another minibatch of the same batch
        new, rows = _combine(acc[1], new, acc[2], rows), acc[2] + rows
    res["acc"] = (run.step, new, rows)
    for k, v in new.items():
        run.log(f"{NAME}/{k}", v)
    return terms
