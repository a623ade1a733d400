"""GPU check of the fused_logprobs plugin's Triton kernels: correctness against the plain torch
default, then time and peak memory against plain torch, the plugin's chunked torch path on
CUDA, and Liger-Kernel's fused linear cross-entropy when it imports, at Qwen-sized LM-head
shapes (hidden 4096, V = 151,936; 16k to 64k tokens).

    bash gpu/kernels.sh                  # everything below, one table at the end
    python gpu/kernels_fused_logprobs.py --dry-run       # print the planned cases (no GPU)
    python gpu/kernels_fused_logprobs.py --tokens 16384 --dtypes bf16 --skip-check

Loads only the kernel files (torch + triton, no rlmix): the GPU image need not have the
rlmix dependencies. Prints one JSON line per result, then a Markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "plugins" / "kernels" / "fused_logprobs" / "rlmix_fused_logprobs"
DTYPES = ("bf16", "fp32", "fp32-tf32")
IMPLS = ("plain", "chunked", "triton", "liger")


def load(name: str):
    """A kernel module by path (the package __init__ would import rlmix)."""
    spec = importlib.util.spec_from_file_location(f"fused_logprobs_{name}", KERNELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def plain_reference():
    """The core's default, ``rlmix.policy.plain_token_logprobs``, if rlmix imports here; else
    the same formula written out (full fp32 logits, log-softmax gather, entropy)."""
    sys.path.insert(0, str(ROOT / "core"))
    try:
        from rlmix.policy import plain_token_logprobs

        return plain_token_logprobs, "rlmix.policy"
    except Exception:  # noqa: BLE001 - omegaconf or stevedore may be absent on the GPU image
        import torch

        def plain_token_logprobs(hidden, lm_head, labels, temperature=1.0):
            weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
            with torch.autocast(hidden.device.type, enabled=False):
                logits = torch.nn.functional.linear(hidden.float(), weight.float(),
                                                    None if bias is None else bias.float())
                if temperature != 1.0:
                    logits = logits / temperature
                logz = torch.logsumexp(logits, -1)
                logp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - logz
                probs = torch.softmax(logits, -1)
                entropy = logz - (probs * logits).sum(-1)
            return logp, entropy

        return plain_token_logprobs, "local copy of the core's formula"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=DTYPES,
                   help="bf16: hidden and weight bf16; fp32: fp32 with exact (ieee) dots; "
                        "fp32-tf32: fp32 with tf32 dots in the Triton kernels")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--fp32-max-tokens", type=int, default=16384,
                   help="fp32 cases above this many tokens are skipped (no tensor cores: slow)")
    p.add_argument("--plain-max-tokens", type=int, default=16384,
                   help="plain torch above this many tokens is skipped (its logits alone are "
                        "N x V x 4 bytes: 40 GB at 64k tokens)")
    p.add_argument("--chunk-size", type=int, default=4096, help="chunked torch path on CUDA")
    p.add_argument("--blocks", default="",
                   help="Triton BLOCK_N,BLOCK_V,BLOCK_K[,warps,stages]; '' = kernel default")
    p.add_argument("--sweep", action="store_true",
                   help="also time a few other Triton tile configurations (bf16, first size)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--dry-run", action="store_true", help="print the plan; needs no GPU")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke test of this script with TRITON_INTERPRET=1 and tiny "
                        "--tokens/--hidden/--vocab (no timings worth reading)")
    return p.parse_args(argv)


SWEEP = ["64,128,64,8,3", "128,128,64,8,3", "64,256,64,8,3", "128,64,64,4,3", "64,128,32,4,4"]


def plan(args: argparse.Namespace) -> list[dict]:
    cases = []
    for dtype in args.dtypes:
        for tokens in args.tokens:
            if dtype.startswith("fp32") and tokens > args.fp32_max_tokens:
                continue
            for impl in args.impls:
                if impl == "plain" and tokens > args.plain_max_tokens:
                    continue
                if impl in ("plain", "chunked", "liger") and dtype == "fp32-tf32":
                    continue  # tf32 only changes the Triton kernels' dots
                cases.append({"dtype": dtype, "tokens": tokens, "impl": impl,
                              "blocks": args.blocks})
    if args.sweep and "bf16" in args.dtypes:
        for blocks in SWEEP:
            cases.append({"dtype": "bf16", "tokens": args.tokens[0], "impl": "triton",
                          "blocks": blocks})
    return cases


def checks(args: argparse.Namespace) -> list[dict]:
    return [
        {"tokens": 77, "hidden": 96, "vocab": 1000, "bias": True, "dtype": "fp32"},
        {"tokens": 77, "hidden": 96, "vocab": 1000, "bias": True, "dtype": "bf16"},
        {"tokens": 1000, "hidden": args.hidden, "vocab": args.vocab, "bias": False,
         "dtype": "fp32"},
        {"tokens": 1000, "hidden": args.hidden, "vocab": args.vocab, "bias": False,
         "dtype": "fp32-tf32"},
        {"tokens": 1000, "hidden": args.hidden, "vocab": args.vocab, "bias": False,
         "dtype": "bf16"},
    ]


def report(kind: str, **values: object) -> None:
    print(json.dumps({"kind": kind, **values}), flush=True)


def make_inputs(tokens: int, hidden: int, vocab: int, dtype: str, bias: bool, seed: int = 0,
                device: str = "cuda"):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    head = torch.nn.Linear(hidden, vocab, bias=bias, device=device, dtype=tdtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, device=device, generator=g) * 0.02)
        if bias:
            head.bias.copy_(torch.randn(vocab, device=device, generator=g) * 0.1)
    h = torch.randn(1, tokens, hidden, device=device, generator=g).to(tdtype)
    h.requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), device=device, generator=g)
    g_logp = torch.randn(1, tokens, device=device, generator=g)
    g_ent = torch.randn(1, tokens, device=device, generator=g)
    return head, h, labels, g_logp, g_ent


def runner(impl: str, dtype: str, args: argparse.Namespace, mods: dict, blocks: str):
    """A function ``(head, h, labels) -> (logp, entropy)`` or, for Liger, a scalar loss."""
    tau = args.temperature
    block_tuple = tuple(int(b) for b in blocks.split(",")) if blocks else None
    precision = "tf32" if dtype == "fp32-tf32" else "ieee"
    if impl == "plain":
        return lambda head, h, y: mods["plain"](h, head, y, tau)
    if impl == "chunked":
        return lambda head, h, y: mods["chunked"].chunked_token_logprobs(
            h, head.weight, head.bias, y, tau, args.chunk_size, 0)
    if impl == "triton":
        return lambda head, h, y: mods["triton"].triton_token_logprobs(
            h, head.weight, head.bias, y, tau, block_tuple, precision)
    if impl == "liger":
        loss = mods["liger"](reduction="sum")
        # cross-entropy only (no entropy output, no temperature): a reference for speed
        return lambda head, h, y: loss(head.weight, h.view(-1, h.shape[-1]), y.view(-1))
    raise ValueError(impl)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_check(case: dict, args: argparse.Namespace, mods: dict) -> None:
    import torch

    head, h, y, g_logp, g_ent = make_inputs(case["tokens"], case["hidden"], case["vocab"],
                                            case["dtype"], case["bias"], seed=1,
                                            device=args.device)
    results = {}
    for impl in ("plain", "triton"):
        fn = runner(impl, case["dtype"], args, mods, args.blocks)
        logp, ent = fn(head, h, y)
        params = [h, head.weight] + ([head.bias] if head.bias is not None else [])
        grads = torch.autograd.grad((logp * g_logp + ent * g_ent).sum(), params)
        results[impl] = (logp.detach(), ent.detach(), *grads)
        del logp, ent, grads
    names = ["logp", "entropy", "d_hidden", "d_weight", "d_bias"]
    errors = {n: rel(a, b) for n, a, b in zip(names, results["triton"], results["plain"])}
    finite = all(bool(torch.isfinite(t).all()) for t in results["triton"])
    report("check", **case, rel_err=errors, finite=finite)


def time_case(case: dict, args: argparse.Namespace, mods: dict) -> dict:
    import torch

    head, h, y, g_logp, g_ent = make_inputs(case["tokens"], args.hidden, args.vocab,
                                            case["dtype"], bias=False, device=args.device)
    cuda = args.device == "cuda"
    fn = runner(case["impl"], case["dtype"], args, mods, case["blocks"])

    def fwd():
        with torch.no_grad():
            return fn(head, h, y)

    def fwd_bwd():
        out = fn(head, h, y)
        loss = out if case["impl"] == "liger" else (out[0] * g_logp + out[1] * g_ent).sum()
        loss.backward()
        h.grad = None
        head.weight.grad = None

    result = dict(case)
    for name, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        f()  # compile / warm up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        times = []
        for _ in range(args.repeats):
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                f()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                f()
                times.append(time.perf_counter() - t0)
        result[f"{name}_s"] = min(times)
        peak = torch.cuda.max_memory_allocated() - base if cuda else float("nan")
        result[f"{name}_peak_gib"] = peak / 2**30
    flops = 2 * case["tokens"] * args.hidden * args.vocab
    result["fwd_tflops"] = flops / result["fwd_s"] / 1e12  # one logits matmul's worth
    return result


def table(rows: list[dict]) -> None:
    print("\n| dtype | tokens | implementation | blocks | fwd ms | fwd+bwd ms | peak fwd GiB | "
          "peak fwd+bwd GiB | fwd TFLOP/s (1 matmul) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['dtype']} | {r['tokens']} | {r['impl']} | {r['blocks'] or '-'} | "
                  f"{r['error'][:60]} | | | | |")
            continue
        print(f"| {r['dtype']} | {r['tokens']} | {r['impl']} | {r['blocks'] or 'default'} | "
              f"{r['fwd_s'] * 1e3:.1f} | {r['fwd_bwd_s'] * 1e3:.1f} | {r['fwd_peak_gib']:.2f} | "
              f"{r['fwd_bwd_peak_gib']:.2f} | {r['fwd_tflops']:.0f} |")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cases = plan(args)
    if args.dry_run:
        for c in ([] if args.skip_check else checks(args)):
            report("planned_check", **c)
        for c in cases:
            report("planned_timing", **c)
        print(f"{len(cases)} timing cases; no GPU used (--dry-run)")
        return 0
    if args.device == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        report("cuda", ok=False, reason="no CUDA device")
        return 1
    import triton

    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (interpreter)"
    report("device", ok=True, device=name, torch=torch.__version__, triton=triton.__version__)
    plain, source = plain_reference()
    report("plain_reference", source=source)
    mods = {"plain": plain, "chunked": load("chunked"), "triton": load("triton_kernels")}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        mods["liger"] = LigerFusedLinearCrossEntropyLoss
    except ImportError as exc:
        report("liger", ok=False, reason=str(exc))
        cases = [c for c in cases if c["impl"] != "liger"]
    if not args.skip_check:
        for case in checks(args):
            t0 = time.perf_counter()
            try:
                run_check(case, args, mods)
            except Exception as exc:  # noqa: BLE001 - report and go on to the timings
                report("check", **case, error=f"{type(exc).__name__}: {exc}"[:500])
            if args.device == "cuda":
                torch.cuda.empty_cache()
            print(f"  ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    rows = []
    for case in cases:
        try:
            row = time_case(case, args, mods)
        except torch.cuda.OutOfMemoryError:
            row = {**case, "error": "out of memory"}
        except Exception as exc:  # noqa: BLE001 - one failing case must not hide the rest
            row = {**case, "error": f"{type(exc).__name__}: {exc}"[:500]}
        if args.device == "cuda":
            torch.cuda.empty_cache()
        report("timing", **row)
        rows.append(row)
    table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
