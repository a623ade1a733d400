"""HGM's node choice against greedy-by-own-score on the deceptive landscape of
``rlmix.testing.landscape``, over many seeds (the claim test runs 20 through the whole plugin;
this replays the same search with the plugin's pure functions, fast enough for hundreds).

    python bench/hgm_landscape.py --seeds 200 --expansions 12 14

Prints, per rule and number of expansions, the share of seeds whose tree reaches score 1.0.
"""

from __future__ import annotations

import argparse
import random

from rlmix_hgm import best_own_score, clade_thompson

from rlmix.testing.landscape import deceptive_landscape, landscape_proposer, path_of

LEVELS = 8


def per_task(score: float) -> list[float]:
    right = round(score * LEVELS)
    return [1.0] * right + [0.0] * (LEVELS - right)


def search(seed: int, rule: str, expansions: int) -> bool:
    world = deceptive_landscape()
    propose = landscape_proposer(world, seed)
    paths, parents, scores = [()], [None], [per_task(world.score(()))]
    attempt = 0
    while len(paths) <= expansions and attempt < 5 * expansions:
        rng = random.Random(f"hgm-{seed}-{attempt}")  # the plugin's per-iteration seeding
        attempt += 1
        if rule == "own_score":
            node = best_own_score(scores, rng)
        else:
            node = clade_thompson(parents, scores, rng, rule.split("/")[1])
        reply = propose("```\n" + " ".join(paths[node]) + "\n```")
        child = path_of(reply.split("```")[1])
        if child == paths[node]:
            continue  # a leaf: no new text, no child, no metric calls
        paths.append(child)
        parents.append(node)
        scores.append(per_task(world.score(child)))
    return max(sum(s) / LEVELS for s in scores) == 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--expansions", type=int, nargs="+", default=[12, 14])
    args = ap.parse_args()
    for n in args.expansions:
        for rule in ("clade_thompson/node", "clade_thompson/task", "own_score"):
            hits = [search(s, rule, n) for s in range(args.seeds)]
            print(f"expansions {n:3d}  {rule:20s} reach 1.0: {sum(hits) / len(hits):.3f} "
                  f"({sum(hits)}/{len(hits)}; seeds 0-19: {sum(hits[:20])}/20)")


if __name__ == "__main__":
    main()
