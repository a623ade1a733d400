"""Type-I error and power of the sequential gate by simulation (the README's table).

    python bench/sequential_gate.py --runs 2000 --horizon 200

Each run draws paired pass/fail scores (before ~ Bernoulli(p0), after ~ Bernoulli(p1)) one task
at a time until the gate decides or ``horizon`` pairs were used. Under H0 (p1 <= p0) the
accept rate must stay below alpha; under a better candidate, the fewer pairs used the better.
"""

from __future__ import annotations

import argparse
import random

from rlmix_sequential_gate import Settings, sequential_test

SCENARIOS = [("H0", 0.5, 0.5), ("H0", 0.7, 0.6), ("H0", 0.2, 0.2),
             ("H1", 0.5, 0.6), ("H1", 0.3, 0.6), ("H1", 0.3, 0.85)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--horizon", type=int, default=200)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print("| bet | scenario | p_before | p_after | accept rate | mean pairs used |")
    print("| --- | --- | --- | --- | --- | --- |")
    for bet in ("agrapa", "ons", "fixed"):
        settings = Settings(alpha=args.alpha, bet=bet, max_samples=args.horizon)
        for kind, p0, p1 in SCENARIOS:
            rng = random.Random(f"{args.seed}-{bet}-{p0}-{p1}")
            accepted = used = 0
            for _ in range(args.runs):
                def pair(rng=rng, p0=p0, p1=p1):
                    return float(rng.random() < p0), float(rng.random() < p1)

                d = sequential_test(pair, settings)
                accepted += d.passed
                used += d.samples
            print(f"| {bet} | {kind} | {p0} | {p1} | {accepted / args.runs:.4f} | "
                  f"{used / args.runs:.1f} |")


if __name__ == "__main__":
    main()
