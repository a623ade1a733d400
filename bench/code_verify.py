"""Verification throughput of the code env: verdicts per second on HumanEval's 164 canonical
solutions through ``run_many``, the verifier at a git revision ("before") against the working tree
("after"), measured in one process and alternating (before, after, before, ...) so that a shared
machine's load falls on both alike.

    OMP_NUM_THREADS=1 python bench/code_verify.py --before 49828e7 --rounds 3 --workers 2

"before" is rebuilt from ``git show <rev>:<path>`` of ``core/rlmix/sandbox.py`` and
``plugins/envs/code/rlmix_code/__init__.py`` (its ``rlmix_sandbox`` import pointed at the old
sandbox). Prints one JSON line per round and a summary line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_at(rev: str, path: str, name: str, patch: tuple[str, str] | None = None):  # noqa: ANN202
    text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    if patch:
        assert patch[0] in text, f"{path}@{rev} has no {patch[0]!r}"
        text = text.replace(*patch)
    folder = Path(tempfile.mkdtemp(prefix="rlmix-bench-"))
    (folder / f"{name}.py").write_text(text)
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--before", default="49828e7", help="git revision of the old verifier")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    import rlmix_code as new_code
    import rlmix_sandbox as new_sandbox

    _module_at(args.before, "core/rlmix/sandbox.py", "rlmix_bench_old_sandbox")
    old_code = _module_at(args.before, "plugins/envs/code/rlmix_code/__init__.py",
                          "rlmix_bench_old_code",
                          ("from rlmix.sandbox import", "from rlmix_bench_old_sandbox import"))
    problems = list(new_code.load_problems())
    completions = ["```python\n" + p.prompt + p.canonical_solution + "\n```" for p in problems]
    new_sandbox.capabilities()
    sys.modules["rlmix_bench_old_sandbox"].capabilities()
    t0 = time.perf_counter()
    paths = [new_code.verification_plan(p).path for p in problems]  # recorded once, cached
    plan_s = time.perf_counter() - t0

    def old_run() -> int:
        return sum(ok for ok, _ in old_code.pass_at_1(completions, problems,
                                                       workers=args.workers))

    def new_run() -> int:
        return sum(v.all_passed for v in new_code.verify(completions, problems,
                                                         workers=args.workers))

    rates: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for name, fn in (("before", old_run), ("after", new_run)):
            t = time.perf_counter()
            passed = fn()
            dt = time.perf_counter() - t
            rates[name].append(len(problems) / dt)
            print(json.dumps({"round": r, "verifier": name, "passed": passed,
                              "seconds": round(dt, 2), "verdicts_per_s": round(len(problems) / dt,
                                                                                 2)}),
                  flush=True)
    before, after = statistics.median(rates["before"]), statistics.median(rates["after"])
    print(json.dumps({"before_verdicts_per_s": round(before, 2),
                      "after_verdicts_per_s": round(after, 2),
                      "slowdown": round(before / after, 2), "workers": args.workers,
                      "rounds": args.rounds, "plan_seconds_once": round(plan_s, 2),
                      "split": paths.count("split"), "nonce": paths.count("nonce"),
                      "isolation": list(new_sandbox.run_python("pass").isolation)}))


if __name__ == "__main__":
    main()
