"""Peak memory and time of the chunked token log-probs (plugin ``fused_logprobs``) against the
core's plain default, on the CPU, at SmolLM2-135M's LM-head shapes (hidden 576, V = 49,152).

    python bench/logprob_kernels.py                          # 4,096 and 16,384 tokens, fp32
    python bench/logprob_kernels.py --tokens 4096 --chunk-sizes 256 1024 --repeats 3

Each case (implementation x token count) runs in a fresh subprocess. Inside it the inputs are
allocated first (hidden [N, 576], the LM head [49152, 576], labels and the upstream gradients
of both outputs); then, for each repeat, the process's peak resident set (VmHWM) is reset
through /proc/self/clear_refs, the forward runs, then the backward (random upstream gradients
on log-probs and entropies, as a policy loss gives), and the peak is read back. "peak" is the
largest resident memory above the level just before the forward, so it counts every tensor the
computation holds (logits, saved activations, gradient buffers of hidden and weight), not the
inputs. Times are wall clock, the minimum over the repeats (the machine is shared, so the
minimum is the least disturbed run); the first repeat is included, since the plain default
pays its page faults on every call anyway (glibc hands large blocks back to the system).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HIDDEN = 576
VOCAB = 49152
TEMPERATURE = 0.7


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_case(impl: str, tokens: int, chunk: int, vchunk: int, repeats: int,
             threads: int) -> dict:
    """One case, in this process: returns times (s) and peaks (bytes)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    from rlmix_fused_logprobs.chunked import chunked_token_logprobs

    from rlmix.policy import plain_token_logprobs

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05)
    hidden = torch.randn(1, tokens, HIDDEN, generator=gen).requires_grad_(True)
    labels = torch.randint(0, VOCAB, (1, tokens), generator=gen)
    g_logp = torch.randn(1, tokens, generator=gen)
    g_ent = torch.randn(1, tokens, generator=gen)

    def forward():
        if impl == "plain":
            return plain_token_logprobs(hidden, head, labels, TEMPERATURE)
        return chunked_token_logprobs(hidden, head.weight, None, labels, TEMPERATURE,
                                      chunk_size=chunk, vocab_chunk_size=vchunk)

    # warm-up on a few rows: loads the matmul and exp code paths outside the measurement
    small = hidden[:, :64].detach().requires_grad_(True)
    if impl == "plain":
        lp, en = plain_token_logprobs(small, head, labels[:, :64], TEMPERATURE)
    else:
        lp, en = chunked_token_logprobs(small, head.weight, None, labels[:, :64], TEMPERATURE,
                                        chunk_size=chunk, vocab_chunk_size=vchunk)
    (lp.sum() + en.sum()).backward()
    del lp, en, small

    fwd_t, bwd_t, cpu_t, fwd_peak, peak = [], [], [], 0, 0
    for _ in range(repeats):
        hidden.grad = None
        head.weight.grad = None
        _reset_peak()
        base = _status("VmRSS")
        c0 = time.process_time()
        t0 = time.perf_counter()
        logp, ent = forward()
        t1 = time.perf_counter()
        fwd_peak = max(fwd_peak, _status("VmHWM") - base)
        (logp * g_logp + ent * g_ent).sum().backward()
        t2 = time.perf_counter()
        cpu_t.append(time.process_time() - c0)
        peak = max(peak, _status("VmHWM") - base)
        fwd_t.append(t1 - t0)
        bwd_t.append(t2 - t1)
        del logp, ent
    return {"impl": impl, "tokens": tokens, "chunk": chunk, "vchunk": vchunk,
            "threads": torch.get_num_threads(), "fwd_s": min(fwd_t), "bwd_s": min(bwd_t),
            "total_s": min(f + b for f, b in zip(fwd_t, bwd_t)), "cpu_s": min(cpu_t),
            "fwd_peak": fwd_peak,
            "peak": peak, "all_fwd_s": fwd_t, "all_bwd_s": bwd_t}


def label(case: dict) -> str:
    if case["impl"] == "plain":
        return "plain (core default)"
    v = f", vocab chunk {case['vchunk']}" if case["vchunk"] > 0 else ""
    return f"chunked {case['chunk']}{v}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[1024],
                   help="token chunk sizes of the chunked path to measure")
    p.add_argument("--vocab-chunk", type=int, default=0, help="0 = whole vocabulary")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--skip-plain", action="store_true")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = p.parse_args(argv)
    if args.case:
        impl, tokens, chunk, vchunk = args.case.split(":")
        print(json.dumps(run_case(impl, int(tokens), int(chunk), int(vchunk), args.repeats,
                                  args.threads)))
        return 0
    results = []
    for tokens in args.tokens:
        cases = [] if args.skip_plain else [("plain", 0)]
        cases += [("chunked", c) for c in args.chunk_sizes]
        for impl, chunk in cases:
            cmd = [sys.executable, __file__, "--case",
                   f"{impl}:{tokens}:{chunk}:{args.vocab_chunk if impl != 'plain' else 0}",
                   "--repeats", str(args.repeats), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
            if out.returncode != 0:
                print(f"case {impl} {tokens} failed ({out.returncode}):\n{out.stderr[-2000:]}",
                      file=sys.stderr)
                results.append({"impl": impl, "tokens": tokens, "chunk": chunk,
                                "vchunk": 0, "failed": out.returncode})
                continue
            case = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(case)
            print(f"  done: {label(case)} at {tokens} tokens", file=sys.stderr, flush=True)
    mib = 1024 * 1024
    print(f"\nLM head {VOCAB} x {HIDDEN}, fp32, temperature {TEMPERATURE}, forward + backward "
          f"(grads of hidden and weight); times = min over {args.repeats} repeats; "
          f"cpu s = process CPU time (all threads) of forward + backward; ratios = chunked / "
          f"plain of peak MiB and of total s")
    header = (f"| {'tokens':>6} | {'implementation':<28} | {'fwd s':>6} | {'bwd s':>6} | "
              f"{'total s':>7} | {'cpu s':>6} | {'peak fwd MiB':>12} | {'peak MiB':>8} | "
              f"{'mem ratio':>9} | {'time ratio':>10} |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for tokens in args.tokens:
        rows = [r for r in results if r["tokens"] == tokens]
        plain = next((r for r in rows if r["impl"] == "plain" and "failed" not in r), None)
        for r in rows:
            if "failed" in r:
                print(f"| {tokens:>6} | {label(r):<28} | failed (exit {r['failed']})")
                continue
            mem = f"{r['peak'] / plain['peak']:.3f}" if plain else "-"
            tim = f"{r['total_s'] / plain['total_s']:.3f}" if plain else "-"
            print(f"| {tokens:>6} | {label(r):<28} | {r['fwd_s']:6.2f} | {r['bwd_s']:6.2f} | "
                  f"{r['total_s']:7.2f} | {r['cpu_s']:6.2f} | {r['fwd_peak'] / mib:12.0f} | "
                  f"{r['peak'] / mib:8.0f} | {mem:>9} | {tim:>10} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
