"""The red-team table of the code env: every hack of ``rlmix_code.redteam`` scored by the verifier
at a git revision ("before") and by the working tree ("now"), for the training reward
(``pass_rate`` > 0 or ``passed``) and for eval (``pass@1``); also "now" on the nonce path (the
same problems with their canonical solution removed, so the tests run in the sandbox).

    OMP_NUM_THREADS=1 python bench/code_redteam.py --before 49828e7

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from code_verify import _module_at  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--before", default="49828e7")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    import rlmix_code as new
    from rlmix_code.redteam import HACKS

    _module_at(args.before, "core/rlmix/sandbox.py", "rlmix_bench_old_sandbox")
    old = _module_at(args.before, "plugins/envs/code/rlmix_code/__init__.py",
                     "rlmix_bench_old_code",
                     ("from rlmix.sandbox import", "from rlmix_bench_old_sandbox import"))
    by_id = {p.task_id: p for p in new.load_problems()}
    problems = [by_id[h.task_id] for h in HACKS]
    texts = [h.completion() for h in HACKS]
    kw = {"workers": args.workers, "timeout_s": 5.0}
    old_reward = old.verify(texts, problems, **kw)
    old_eval = old.pass_at_1(texts, problems, **kw)
    now = new.verify(texts, problems, **kw)
    stripped = [dataclasses.replace(p, canonical_solution="") for p in problems]
    nonce = new.verify(texts, stripped, **kw)

    def mark(flag: bool) -> str:
        return "**forged**" if flag else "no"

    print("| hack | problem | reward before | pass@1 before | reward now | pass@1 now | "
          "now, nonce path | reason now |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for h, ob, oe, nv, nn in zip(HACKS, old_reward, old_eval, now, nonce, strict=True):
        reason = nv.reason.replace("|", "/").replace("\n", " ")[:90]
        print(f"| {h.name} | {h.task_id.split('/')[1]} | {mark(ob.pass_rate > 0)} | "
              f"{mark(oe[0])} | {mark(nv.pass_rate > 0)} | {mark(nv.all_passed)} | "
              f"{mark(nn.pass_rate > 0)} | {reason} |")
    print(f"\nforged before: reward {sum(v.pass_rate > 0 for v in old_reward)}/{len(HACKS)}, "
          f"pass@1 {sum(ok for ok, _ in old_eval)}/{len(HACKS)}; now: reward "
          f"{sum(v.pass_rate > 0 for v in now)}, pass@1 {sum(v.all_passed for v in now)}; "
          f"nonce path: {sum(v.pass_rate > 0 for v in nonce)}")


if __name__ == "__main__":
    main()
