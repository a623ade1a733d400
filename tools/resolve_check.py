"""Can a user install what we publish? pip's resolver on the published combinations, in
dry-run mode with a report: nothing is installed, and no big wheel is downloaded.

    python tools/resolve_check.py                  # builds the wheels it needs into a temp folder
    python tools/resolve_check.py --dist dist      # uses the wheels of `nox -s dist`

Scenarios (each must resolve; a pin in our metadata that makes one fail is a bug):
  vllm        core + rlmix-vllm[engine], vLLM 0.33 (its own torch and transformers pins)
  deepspeed   core + rlmix-deepspeed, torch 2.15
  all-2.15    core + every helper library and plugin, torch 2.15
  all-test    core + every helper library and plugin, the test environments' constraints.txt

The local distributions come from their wheels (given by path, and as --find-links for the
plugins one plugin needs); everything else from the package index. The machine's pip
configuration is not read (PIP_CONFIG_FILE=/dev/null: a global cap such as torch<=2.14.1 would
hide what a user gets) and PIP_CONSTRAINT is dropped. Without PEP 658 metadata on the index, pip
would download every wheel to read its dependencies (torch and the CUDA libraries: GBs); pip's
``fast-deps`` reads them with HTTP range requests instead, and the check fails if pip's log
shows a download over 50 MB anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_dist  # noqa: E402

ROOT = build_dist.ROOT
SHOWN = ("torch", "transformers", "vllm", "deepspeed", "triton", "ray")
BIG_DOWNLOAD_MB = 50.0


@dataclass
class Scenario:
    name: str
    what: str
    distributions: list[str]  # local distributions to install (name or name[extra])
    constraints: list[str] = field(default_factory=list)  # requirement lines, or a file's text
    expect: dict[str, str] = field(default_factory=dict)  # name -> version prefix it must get


def scenarios(local: list[str]) -> list[Scenario]:
    plugins = [n for n in local if n != "rlmix"]  # the helper libraries (libs/) included
    test_pins = (ROOT / "constraints.txt").read_text().splitlines()
    return [
        Scenario("vllm", "core + rlmix-vllm[engine], vLLM 0.33",
                 ["rlmix", "rlmix-vllm[engine]"], ["vllm==0.33.*"], {"vllm": "0.33."}),
        Scenario("deepspeed", "core + rlmix-deepspeed, torch 2.15",
                 ["rlmix", "rlmix-deepspeed"], ["torch==2.15.*"], {"torch": "2.15."}),
        Scenario("all-2.15", "core + every library and plugin, torch 2.15",
                 ["rlmix", *plugins], ["torch==2.15.*"], {"torch": "2.15."}),
        Scenario("all-test", "core + every library and plugin, constraints.txt",
                 ["rlmix", *plugins], test_pins, {"torch": "2.13.0"}),
    ]


def _wheel(dist: Path, requirement: str) -> str:
    """``rlmix-vllm[engine]`` -> ``/…/rlmix_vllm-0.1.0-py3-none-any.whl[engine]``."""
    name, _, extra = requirement.partition("[")
    stem = name.replace("-", "_")
    wheels = sorted(dist.glob(f"{stem}-*.whl"))
    if not wheels:
        raise SystemExit(f"resolve_check: no wheel of {name} in {dist}")
    return str(wheels[-1]) + (f"[{extra}" if extra else "")


def pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def resolve(scenario: Scenario, dist: Path, work: Path) -> dict[str, object]:
    constraints = work / f"{scenario.name}-constraints.txt"
    constraints.write_text("\n".join(scenario.constraints) + "\n")
    report, log = work / f"{scenario.name}-report.json", work / f"{scenario.name}-pip.log"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
           "--use-feature=fast-deps", "--report", str(report), "--log", str(log),
           "--find-links", str(dist), "-c", str(constraints),
           *(_wheel(dist, d) for d in scenario.distributions)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=pip_env())
    seconds = time.perf_counter() - start
    result: dict[str, object] = {"scenario": scenario.name, "what": scenario.what,
                                 "seconds": round(seconds, 1), "ok": done.returncode == 0}
    big = _big_downloads(log)
    if big:
        result["ok"] = False
        result["error"] = f"pip downloaded big files: {', '.join(big)}"
    if done.returncode != 0:
        tail = [line for line in done.stderr.splitlines() if line.strip()][-12:]
        result["error"] = "\n".join(tail)
        return result
    installed = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                 for i in json.loads(report.read_text())["install"]}
    result["versions"] = {n: installed[n] for n in SHOWN if n in installed}
    result["packages"] = len(installed)
    wrong = {n: installed.get(n) for n, prefix in scenario.expect.items()
             if not (installed.get(n) or "").startswith(prefix)}
    if wrong:
        result["ok"] = False
        result["error"] = f"resolved {wrong}, expected {scenario.expect}"
    return result


def _big_downloads(log: Path) -> list[str]:
    """Files over BIG_DOWNLOAD_MB that pip's log shows it downloaded whole."""
    if not log.exists():
        return []
    big = []
    for match in re.finditer(r"Downloading (\S+) \(([\d.]+) (kB|MB|GB)\)", log.read_text()):
        size_mb = float(match[2]) * {"kB": 1e-3, "MB": 1.0, "GB": 1e3}[match[3]]
        if size_mb > BIG_DOWNLOAD_MB:
            big.append(f"{match[1]} ({match[2]} {match[3]})")
    return big


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", type=Path, help="a folder with the wheels (default: build)")
    parser.add_argument("--only", nargs="*", help="scenario names to run (default: all)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    local = list(build_dist.projects())
    with tempfile.TemporaryDirectory(prefix="rlmix-resolve-") as tmp:
        work = Path(tmp)
        dist = args.dist
        if dist is None:
            dist = work / "dist"
            start = time.perf_counter()
            build_dist.build(dist, sdists=False)
            print(f"resolve_check: built {len(local)} wheels in "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
        results = []
        for scenario in scenarios(local):
            if args.only and scenario.name not in args.only:
                continue
            result = resolve(scenario, dist.resolve(), work)
            results.append(result)
            versions = " ".join(f"{k}=={v}" for k, v in result.get("versions", {}).items())
            status = "ok  " if result["ok"] else "FAIL"
            print(f"{status} {scenario.name:<10} {scenario.what:<42} {versions}  "
                  f"({result.get('packages', '-')} packages, {result['seconds']} s)", flush=True)
            if not result["ok"]:
                print("     " + str(result.get("error", "")).replace("\n", "\n     "))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
