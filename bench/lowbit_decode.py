"""Decode speed of the sampler copies of lowbit_rollout against their weight-bandwidth floors.

    OMP_NUM_THREADS=1 nice -n 10 python bench/lowbit_decode.py [--model smollm2-135m]
        [--rows 1 8] [--tokens 128] [--variants fp32 bf16 int8-dynamic int8-w8a8 ...]
    python bench/lowbit_decode.py --model tiny-random --tokens 8     # plumbing only

For each sampler copy (``fp32``: the master itself; ``bf16``: plain ``F.linear`` on bf16 weights;
``bf16-packed``: every bf16 linear pre-packed for oneDNN, ``lowbit_rollout.prepack``, the default;
``int8``: weight-only int8 linears and an int8 LM head; ``int8-bf16head``: the same with a bf16 LM
head, ``int8-packedhead`` with a pre-packed one; ``int8-dynamic``: fbgemm's dynamic int8 linears;
``int8-w8a8``: SmoothQuant-smoothed int8 linears with activations quantised per token, calibrated
by the warm-up's prefill, whose decode calls take one activation scale per call in the layers whose
tokens have alike ranges (``lowbit_rollout.w8a8_decode: auto``, the default); ``int8-w8a8-token``:
per-token scales in every call; ``int8-w8a8-bf16head`` / ``-packedhead``: the same, bf16 head; a
name ending in ``-eager``: that copy with eager attention, ``lowbit_rollout.attention: eager``),
the engine's own decode loop (``rlmix.sampling.sample_tokens``, KV cache, temperature 1, no early
stop) samples ``tokens`` new tokens for ``rows`` rows sharing one prompt (a GRPO group). Decode
time = time(``tokens``) - time(1 token), which removes the prefill; tokens/s = rows x (tokens - 1)
/ decode time. The floor of a decode step is the weight bytes it must read (every weight but the
input embedding table; ``LowbitWeights.weight_bytes``) over the memory bandwidth measured in the
same run (a 256 MiB tensor copy, read + write). Prints tokens/s, the ratio to fp32, ms per step
against the floor, and the copy's refresh time (re-casting or re-quantising every weight from the
fp32 master, as after an optimizer step; timed after the warm-up, by which w8a8 has calibrated).
The compute floor of a step of ``r`` rows is ``r`` times the copy's time per token in one forward
over 4 x 128 positions (``seconds_per_token_in_bulk``: the same arithmetic at full width, weights
read once): at 8 rows on one core it is above the bandwidth floor for every copy here, so the last
column divides by the larger of the two floors. Wall and CPU (process) time are both reported (on a
shared machine CPU time is the steadier measure: it leaves out the time the process waited for a
core); the variants take turns within each rows setting, and the machine's load average is printed
before and after.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "rollout" / "lowbit_rollout"))  # uninstalled checkouts

VARIANTS = {  # name: (precision, lm_head, int8_kernel, prepack); "-eager": eager attention
    "fp32": ("fp32", "auto", "weight_only", False),
    "fp32-eager": ("fp32", "auto", "weight_only", False),
    "bf16": ("bf16", "auto", "weight_only", False),
    "bf16-packed": ("bf16", "auto", "weight_only", True),
    "bf16-packed-eager": ("bf16", "auto", "weight_only", True),
    "int8": ("int8", "auto", "weight_only", False),
    "int8-bf16head": ("int8", "bf16", "weight_only", False),
    "int8-packedhead": ("int8", "bf16", "weight_only", True),
    "int8-dynamic": ("int8", "auto", "dynamic", False),
    "int8-w8a8": ("int8", "auto", "w8a8", False),
    "int8-w8a8-eager": ("int8", "auto", "w8a8", False),
    "int8-w8a8-token": ("int8", "auto", "w8a8", False),
    "int8-w8a8-intmm": ("int8", "auto", "w8a8", False),  # per-token GEMM torch._int_mm
    "int8-w8a8-fbgemm": ("int8", "auto", "w8a8", False),  # per-token GEMM fbgemm
    "int8-w8a8-fp32head": ("int8", "fp32", "w8a8", False),
    "int8-w8a8-bf16head": ("int8", "bf16", "w8a8", False),
    "int8-w8a8-packedhead": ("int8", "bf16", "w8a8", True),
}


def bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes per second of a large tensor copy (read + write), far past the caches."""
    src = torch.empty(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times)


def seconds_per_token_in_bulk(model: Any, vocab: int, rows: int = 4, length: int = 128,
                              reps: int = 3) -> float:
    """The copy's seconds per token when it runs ``rows x length`` positions in one forward (no
    cache): its arithmetic at full width, where the weights are read once for all positions.
    A decode step of ``r`` rows does the same arithmetic for ``r`` tokens, so ``r`` times this
    is a floor on the step that bandwidth does not set (the compute floor)."""
    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids[:, :8], use_cache=False)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        times.append(time.perf_counter() - t)
    return statistics.median(times) / ids.numel()


def fp32_weight_bytes(model: Any) -> int:
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    skip = {id(p) for p in emb.parameters()} - {id(p) for p in head.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def w8a8_gemm(variant: str) -> str:
    """The w8a8 per-token GEMM a variant forces (``-intmm``, ``-fbgemm``), else ``auto``."""
    return {"intmm": "int_mm", "fbgemm": "fbgemm"}.get(variant.rsplit("-", 1)[-1], "auto")


def decode_time(model: Any, ids: torch.Tensor, attn: torch.Tensor, rows: int, tokens: int,
                pad: int, seed: int) -> tuple[float, float]:
    """Wall and CPU seconds of ``sample_tokens`` for ``tokens`` new tokens."""
    from rlmix.sampling import sample_tokens

    gen = torch.Generator().manual_seed(seed)
    w, c = time.perf_counter(), time.process_time()
    sample_tokens(model, ids, attn, rows, tokens, 1.0, 1.0, 0, [-1], pad, generator=gen)
    return time.perf_counter() - w, time.process_time() - c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--reps", type=int, default=1, help="timed runs per cell (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from rlmix_lowbit_rollout import LowbitWeights

    from rlmix.policy import load_model

    load_before = os.getloadavg()
    t_start, c_start = time.perf_counter(), time.process_time()
    master, tok = load_model(args.model, "float32")
    master.eval()
    for p in master.parameters():
        p.requires_grad_(False)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 47+38? Reply with "
                                     "only the final number."}], tokenize=False,
                                   add_generation_prompt=True)
    enc = tok([text], return_tensors="pt", add_special_tokens=False)
    ids, attn = enc["input_ids"], enc["attention_mask"]
    bw = bandwidth()
    copies: dict[str, tuple[Any, int, float]] = {}  # name: (model, weight bytes, refresh s)
    built: dict[str, Any] = {}  # name: its LowbitWeights
    for name in args.variants:
        precision, head, kernel, prepack = VARIANTS[name]
        attention = "eager" if name.endswith("-eager") else "model"
        if precision == "fp32":
            model = master
            if attention != "model":  # a second fp32 model, so the master keeps its own
                from rlmix_lowbit_rollout.quant import set_attention

                model = copy.deepcopy(master)
                set_attention(model, attention)
            copies[name] = (model, fp32_weight_bytes(master), 0.0)
            continue
        weights = LowbitWeights(master, precision, head, kernel, prepack=prepack,
                                attention=attention,
                                w8a8_decode="token" if name.endswith("-token") else "auto",
                                w8a8_gemm=w8a8_gemm(name))
        copies[name] = (weights.model, weights.weight_bytes(), 0.0)
        built[name] = weights
    results: list[dict[str, Any]] = []
    steps = args.tokens - 1
    with torch.no_grad():
        for model, _, _ in copies.values():  # warm-up (w8a8 calibrates on this prefill)
            decode_time(model, ids, attn, 1, min(4, args.tokens), tok.pad_token_id, 0)
        for name, weights in built.items():  # after calibration: what a step's refresh costs
            t = time.perf_counter()
            weights.refresh(master)
            model, weight_bytes, _ = copies[name]
            copies[name] = (model, weight_bytes, time.perf_counter() - t)
        bulk = {name: seconds_per_token_in_bulk(model, len(tok)) for name, (model, _, _) in
                copies.items()}  # after calibration too
        for rows in args.rows:
            walls: dict[str, list[float]] = {n: [] for n in copies}
            cpus: dict[str, list[float]] = {n: [] for n in copies}
            names = list(copies)
            for rep in range(args.reps):
                # round robin, a different variant first each time: load changes fall on all
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    model = copies[name][0]
                    w1, c1 = decode_time(model, ids, attn, rows, 1, tok.pad_token_id, rep)
                    wn, cn = decode_time(model, ids, attn, rows, args.tokens, tok.pad_token_id,
                                         rep)
                    walls[name].append(wn - w1)
                    cpus[name].append(cn - c1)
                    print(f"  {name} rows {rows}: {1e3 * (wn - w1) / steps:.1f} ms/step wall, "
                          f"{1e3 * (cn - c1) / steps:.1f} CPU", file=sys.stderr, flush=True)
            for name, (_, weight_bytes, refresh_s) in copies.items():
                wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
                floor_step = weight_bytes / bw
                compute_step = rows * bulk[name]
                roof = max(floor_step, compute_step)
                results.append({
                    "variant": name, "rows": rows, "tokens": args.tokens,
                    "weight_mb": weight_bytes / 1e6, "decode_s": wall, "decode_cpu_s": cpu,
                    "tokens_per_s": rows * steps / wall, "tokens_per_cpu_s": rows * steps / cpu,
                    "ms_per_step": 1e3 * wall / steps, "cpu_ms_per_step": 1e3 * cpu / steps,
                    "floor_ms_per_step": 1e3 * floor_step,
                    "over_floor": (wall / steps) / floor_step,
                    "cpu_over_floor": (cpu / steps) / floor_step, "refresh_s": refresh_s,
                    "compute_floor_ms_per_step": 1e3 * compute_step,
                    "over_roofline": (wall / steps) / roof})
    load_after = os.getloadavg()
    print(format_table(results, args, bw, load_before, load_after,
                       time.perf_counter() - t_start, time.process_time() - c_start))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def format_table(results: list[dict[str, Any]], args: argparse.Namespace, bw: float,
                 load_before: tuple[float, ...], load_after: tuple[float, ...], wall: float,
                 cpu: float) -> str:
    base = {r["rows"]: r for r in results if r["variant"] == "fp32"}
    from rlmix.policy import cpu_capability, native_bf16

    lines = [f"model {args.model}, {args.tokens} new tokens, {torch.get_num_threads()} "
             f"thread(s); CPU {cpu_capability()}, "
             f"{'native' if native_bf16('cpu') else 'emulated'} bf16; copy bandwidth "
             f"{bw / 1e9:.1f} GB/s; load average "
             f"{load_before[0]:.2f} before, {load_after[0]:.2f} after; bench wall "
             f"{wall:.0f} s, CPU {cpu:.0f} s",
             "| sampler | rows | weight MB / step | floor ms / step | wall ms / step | tok/s | "
             "x fp32 | x floor | CPU ms / step | tok / CPU s | x fp32 (CPU) | x floor (CPU) | "
             "refresh s | compute floor ms / step | x max(floors) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- |"]
    for r in results:
        b = base.get(r["rows"])
        ratio = r["tokens_per_s"] / b["tokens_per_s"] if b else float("nan")
        cpu_ratio = r["tokens_per_cpu_s"] / b["tokens_per_cpu_s"] if b else float("nan")
        lines.append(f"| {r['variant']} | {r['rows']} | {r['weight_mb']:.0f} | "
                     f"{r['floor_ms_per_step']:.1f} | {r['ms_per_step']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {ratio:.2f} | {r['over_floor']:.2f} | "
                     f"{r['cpu_ms_per_step']:.1f} | {r['tokens_per_cpu_s']:.1f} | "
                     f"{cpu_ratio:.2f} | {r['cpu_over_floor']:.2f} | {r['refresh_s']:.2f} | "
                     f"{r['compute_floor_ms_per_step']:.1f} | {r['over_roofline']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
