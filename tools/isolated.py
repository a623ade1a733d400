"""Each plugin's tests with only the rlmix distributions it declares: the cheap form of
``nox -s isolated``, for a small machine.

    python tools/isolated.py --base /work/venv-base                 # every plugin
    python tools/isolated.py --base /work/venv-base plugins/envs/code plugins/harness/gepa
    python tools/isolated.py --base /work/venv-base --json out.json -- -x  # pytest args after --

What is shared and what is not. The third-party packages (torch, transformers, pytest, ...) come
from one base environment (``--base``), which must hold no rlmix distribution: each plugin's
environment is a fresh ``venv`` whose site-packages has a ``.pth`` naming the base's. The rlmix
distributions are editable wheels built once per invocation from this checkout (setuptools'
``build_editable``, no build isolation: the packages point at the checkout, as with ``pip
install -e``) and installed ``--no-deps`` into each plugin's environment: the core, the
plugin, and the repository's distributions it declares (``dependencies`` and its ``test`` extra,
followed through the libraries and plugins they declare; ``noxfile._with_local_deps``). So a
missing rlmix declaration fails (an import error, or a manifest naming a plugin that is not
installed); a missing third-party declaration does not (the full ``nox -s isolated`` and
``nox -s resolve`` check those).

Each plugin's tests run from the repository root (its pytest settings) in their own process,
``OMP_NUM_THREADS=1``; the exit status is 1 when any plugin fails. ``--keep`` leaves the
environments in ``--work`` for a rerun of one plugin by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import noxfile  # noqa: E402  (PLUGINS, LIBS, _with_local_deps: one rule for both)


def _site(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def check_base(base: Path) -> str:
    """The base's site-packages; refuses a base that holds an rlmix distribution."""
    site = _site(base / "bin" / "python")
    leaked = sorted(p.name for p in Path(site).iterdir()
                    if p.name.lower().startswith(("rlmix", "__editable___rlmix")))
    if leaked:
        raise SystemExit(f"isolated: the base {base} holds rlmix distributions "
                         f"({', '.join(leaked)}); it must share third-party packages only")
    return site


def build_wheels(folders: list[str], out: Path, python: Path) -> dict[str, Path]:
    """Folder -> its editable wheel (PEP 660 ``build_editable``: the installed package points at
    the checkout, as ``pip install -e`` does, so tests that find the repository's files from a
    module's ``__file__`` work), each built once, no build isolation."""
    out.mkdir(parents=True, exist_ok=True)
    wheels = {}
    for folder in folders:
        done = subprocess.run(
            [str(python), "-c", "import sys; from setuptools import build_meta; "
             "print(build_meta.build_editable(sys.argv[1]))", str(out)],
            cwd=ROOT / folder, capture_output=True, text=True, env={**os.environ,
                                                                    "PIP_CONSTRAINT": ""})
        if done.returncode != 0:
            raise SystemExit(f"isolated: building {folder} failed:\n{done.stderr[-2000:]}")
        wheels[folder] = out / done.stdout.strip().splitlines()[-1]
    return wheels


def run_one(plugin: str, wheels: dict[str, Path], base: Path, base_site: str, work: Path,
            pytest_args: list[str], keep: bool) -> dict[str, object]:
    started = time.perf_counter()
    env_dir = work / plugin.replace("/", "_")
    shutil.rmtree(env_dir, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    Path(_site(python), "rlmix-shared-base.pth").write_text(base_site + "\n")
    folders = [".", *noxfile._with_local_deps((plugin,))]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PIP_CONSTRAINT="", PIP_DISABLE_PIP_VERSION_CHECK="1")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                              "--no-index", "--no-compile", *[str(wheels[f]) for f in folders]],
                             capture_output=True, text=True, env=env)
    result: dict[str, object] = {"plugin": plugin,
                                 "installed": [f for f in folders if f != "."]}
    if install.returncode != 0:
        result.update(ok=False, summary="install failed", tail=install.stderr[-2000:])
        return result
    tests = ROOT / plugin / "tests"
    if not tests.exists():
        result.update(ok=True, summary="no tests", seconds=0.0)
        return result
    cpu0 = os.times()
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tests), *pytest_args], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    cpu1 = os.times()
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    result.update(ok=done.returncode in (0, 5), returncode=done.returncode,
                  summary=lines[-1] if lines else "",
                  seconds=round(time.perf_counter() - started, 1),
                  cpu_s=round((cpu1.children_user + cpu1.children_system)
                              - (cpu0.children_user + cpu0.children_system), 1))
    if not result["ok"]:
        result["tail"] = "\n".join(lines[-40:])
    if not keep:
        shutil.rmtree(env_dir, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plugins", nargs="*", help="plugin folders (default: every plugin)")
    parser.add_argument("--base", type=Path, required=True,
                        help="the environment whose third-party packages are shared")
    parser.add_argument("--work", type=Path, default=None, help="where the environments go")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the environments")
    args = parser.parse_args(argv)
    plugins = [p.rstrip("/") for p in args.plugins] or list(noxfile.PLUGINS)
    unknown = sorted(set(plugins) - set(noxfile.PLUGINS))
    if unknown:
        raise SystemExit(f"isolated: not plugin folders: {', '.join(unknown)}")
    base_site = check_base(args.base)
    work = args.work or Path(tempfile.mkdtemp(prefix="rlmix-isolated-"))
    needed = sorted({f for p in plugins for f in [".", *noxfile._with_local_deps((p,))]})
    print(f"isolated: building {len(needed)} wheels", flush=True)
    wheels = build_wheels(needed, work / "wheels", args.base / "bin" / "python")
    results = []
    for plugin in plugins:
        result = run_one(plugin, wheels, args.base, base_site, work, pytest_args, args.keep)
        results.append(result)
        mark = "pass" if result["ok"] else "FAIL"
        extra = ", ".join(str(d) for d in result["installed"])  # type: ignore[union-attr]
        print(f"{mark}  {plugin:<40} {result.get('seconds', '-')!s:>6} s  "
              f"[{extra}]  {result['summary']}", flush=True)
        if not result["ok"]:
            print("      " + str(result.get("tail", "")).replace("\n", "\n      "), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    failed = [r["plugin"] for r in results if not r["ok"]]
    print(f"isolated: {len(results) - len(failed)} of {len(results)} plugins pass"
          + (f"; failing: {', '.join(map(str, failed))}" if failed else ""))
    if not args.keep:
        shutil.rmtree(work / "wheels", ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
