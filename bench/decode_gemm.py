"""How fast can one decode step's matrix products go on this CPU? SmolLM2-135M's shapes.

    OMP_NUM_THREADS=1 python bench/decode_gemm.py [--rows 1 8 32]

Streams 30 layers of distinct random fp32 weights (so nothing stays in cache, as in a real
decode step) through ``F.linear`` with a batch of ``rows`` token rows, and prints milliseconds
per model step for each layout: the model's own (q, k, v, o, gate, up, down), fused QKV and
gate-up matrices, weights stored transposed (``[in, out]`` viewed as ``[out, in]``), and
``mm(W, x.T)``, plus the LM head alone. This is the floor under rlmix's (and TRL's) generation
phase: the profile of a decode step puts ~80% of it in ``aten::mm``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
SEPARATE = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN),
            (INTER, HIDDEN), (HIDDEN, INTER)]
FUSED = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def layers(shapes: list[tuple[int, int]], transposed: bool = False) -> list[list[torch.Tensor]]:
    if transposed:
        return [[torch.randn(k, n).t() for n, k in shapes] for _ in range(LAYERS)]
    return [[torch.randn(n, k) for n, k in shapes] for _ in range(LAYERS)]


def ms_per_step(weights: list[list[torch.Tensor]], rows: int, mm_t: bool = False,
                repeats: int = 8) -> float:
    inputs = {HIDDEN: torch.randn(rows, HIDDEN), INTER: torch.randn(rows, INTER)}

    def step() -> None:
        for layer in weights:
            for w in layer:
                x = inputs[w.shape[1]]
                if mm_t:
                    torch.mm(w, x.t()).t()
                else:
                    F.linear(x, w)

    step()
    t = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - t) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    print(f"threads {torch.get_num_threads()}; ms per decode step ({LAYERS} layers)")
    separate = layers(SEPARATE)
    variants = {"model layout": (separate, False), "mm(W, x.T)": (separate, True),
                "fused QKV, gate-up": (layers(FUSED), False),
                "transposed storage": (layers(SEPARATE, transposed=True), False)}
    head = [[torch.randn(VOCAB, HIDDEN)]]
    print("| rows | " + " | ".join(variants) + " | LM head |")
    print("| --- " * (len(variants) + 2) + "|")
    for rows in args.rows:
        cells = [f"{ms_per_step(w, rows, mm_t):.1f}" for w, mm_t in variants.values()]
        print(f"| {rows} | " + " | ".join(cells) + f" | {ms_per_step(head, rows):.1f} |")


if __name__ == "__main__":
    main()
