"""Build a wheel (and an sdist) of the core, every helper library and every plugin, or of the
named distributions.

    python tools/build_dist.py --out dist                      # everything (nox -s dist)
    python tools/build_dist.py --out /tmp/d --wheels-only rlmix rlmix-grpo

Wheels come from ``pip wheel --no-deps`` (one pip call for all of them); sdists from
``python -m build --sdist``. Without ``--isolation`` both build with the running interpreter's
setuptools (fast: no build environment per package); with it, in pip's isolated environments.
The projects are found anew each time (the core's pyproject.toml, every
``libs/*/pyproject.toml`` and every ``plugins/*/*/pyproject.toml``), so a folder added later is
built too.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def projects() -> dict[str, Path]:
    """Distribution name -> project folder: the core, the helper libraries, then every plugin,
    each in folder order."""
    found: dict[str, Path] = {}
    for pyproject in [ROOT / "pyproject.toml", *sorted(ROOT.glob("libs/*/pyproject.toml")),
                      *sorted(ROOT.glob("plugins/*/*/pyproject.toml"))]:
        found[tomllib.loads(pyproject.read_text())["project"]["name"]] = pyproject.parent
    return found


def _stem(folder: Path) -> str:
    """``rlmix_grpo-0.1.0``: how the wheel's and the sdist's file names of a project begin."""
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    return f"{project['name'].replace('-', '_')}-{project['version']}"


def build(out: Path, names: list[str] | None = None, sdists: bool = True,
          isolation: bool = False) -> list[Path]:
    """Build into ``out``; returns the files written. ``names``: distributions (default all)."""
    known = projects()
    unknown = sorted(set(names or []) - set(known))
    if unknown:
        raise SystemExit(f"build_dist: unknown distribution(s) {', '.join(unknown)}; "
                         f"known: {', '.join(known)}")
    folders = [known[n] for n in (names or list(known))]
    out.mkdir(parents=True, exist_ok=True)
    no_isolation = [] if isolation else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *no_isolation,
                    "--wheel-dir", str(out), *map(str, folders)], check=True)
    if sdists:
        no_isolation = [] if isolation else ["--no-isolation"]
        for folder in folders:
            subprocess.run([sys.executable, "-m", "build", "--sdist", *no_isolation,
                            "--outdir", str(out), str(folder)], check=True,
                           stdout=subprocess.DEVNULL)
    stems = {_stem(f) for f in folders}
    return sorted(p for p in out.iterdir()
                  if p.name.split("-py3", 1)[0].removesuffix(".tar.gz") in stems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="distributions to build (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "dist")
    parser.add_argument("--wheels-only", action="store_true")
    parser.add_argument("--isolation", action="store_true",
                        help="build in pip's isolated build environments")
    args = parser.parse_args(argv)
    written = build(args.out, args.names or None, sdists=not args.wheels_only,
                    isolation=args.isolation)
    wheels = sum(p.suffix == ".whl" for p in written)
    print(f"build_dist: {wheels} wheels, {len(written) - wheels} sdists in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
