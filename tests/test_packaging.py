"""Package metadata and installs: no exact pins in any pyproject.toml (the test pins live in
constraints.txt), and one plugin installed from built wheels into a fresh virtualenv."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", ".nox", "dist", "build", ".git", "node_modules", "runs"}
sys.path.insert(0, str(ROOT / "tools"))
import build_dist  # noqa: E402


def pyprojects() -> list[Path]:
    """Every pyproject.toml of the repository (the core, every plugin, any added later)."""
    found = []
    for path in ROOT.rglob("pyproject.toml"):
        parts = set(path.relative_to(ROOT).parts[:-1])
        if not parts & SKIP_DIRS and not any(p.startswith("venv") for p in parts):
            found.append(path)
    return sorted(found)


def test_no_exact_pins_in_package_metadata() -> None:
    """Package metadata states ranges; an exact pin (``torch==2.13.0``) downgrades a user's
    torch or makes the resolver fail next to vLLM. Pins for our test machines go in
    constraints.txt."""
    paths = pyprojects()
    assert len(paths) >= 2 and ROOT / "pyproject.toml" in paths
    pinned = []
    for path in paths:
        project = tomllib.loads(path.read_text()).get("project", {})
        lines = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            lines.extend(extra)
        for line in lines:
            if any(spec.operator in ("==", "===") for spec in Requirement(line).specifier):
                pinned.append(f"{path.relative_to(ROOT)}: {line}")
    assert not pinned, "exact pins in package metadata (use a range; pin in constraints.txt):\n" \
        + "\n".join(pinned)


def test_every_plugin_folder_is_built_and_tested() -> None:
    """The dist build and nox find plugin and library folders by glob, so a new one is
    included; lint covers the libraries."""
    folders = {p.parent for p in ROOT.glob("plugins/*/*/pyproject.toml")}
    libs = {p.parent for p in ROOT.glob("libs/*/pyproject.toml")}
    assert {f.name for f in libs} >= {"sandbox", "harness", "lm", "conformance"}
    assert folders and set(build_dist.projects().values()) == folders | libs | {ROOT}
    noxfile = (ROOT / "noxfile.py").read_text()
    assert 'glob("plugins/*/*/pyproject.toml")' in noxfile
    assert 'glob("libs/*/pyproject.toml")' in noxfile and '"libs", "plugins"' in noxfile


def _requirement_names(project: dict, extra: str | None = None) -> set[str]:
    lines = project.get("dependencies", []) if extra is None else \
        project.get("optional-dependencies", {}).get(extra, [])
    return {Requirement(line).name for line in lines}


def test_each_distribution_declares_the_repositorys_distributions_it_imports() -> None:
    """A plugin or library that imports another of the repository's distributions
    (``rlmix_harness``, ``rlmix_gepa``) declares it: in ``dependencies`` when its package
    imports it, at least in its ``test`` extra when only its tests do (``nox -s isolated``
    installs only what is declared). The core imports none of them."""
    import re

    modules: dict[str, str] = {}
    projects = build_dist.projects()
    for name, folder in projects.items():
        for pkg in folder.glob("rlmix_*/__init__.py"):
            modules[pkg.parent.name] = name
    imported = re.compile(r"^\s*(?:from|import)\s+(rlmix_\w+)", re.M)

    def used(files: list[Path]) -> set[str]:
        return {modules[m] for f in files for m in imported.findall(f.read_text())
                if m in modules}

    missing = []
    for name, folder in projects.items():
        if folder == ROOT:
            core = used(list((ROOT / "core").rglob("*.py")))
            assert not core, f"the core imports helper libraries or plugins: {sorted(core)}"
            continue
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        run_deps = _requirement_names(project)
        test_deps = run_deps | _requirement_names(project, "test")
        own = [f for pkg in folder.glob("rlmix_*/") for f in pkg.rglob("*.py")]
        tests = list((folder / "tests").rglob("*.py"))
        for dist in sorted(used(own) - {name} - run_deps):
            missing.append(f"{folder.relative_to(ROOT)}: imports {dist} (add to dependencies)")
        for dist in sorted(used(tests) - {name} - test_deps):
            missing.append(f"{folder.relative_to(ROOT)}: its tests import {dist} (add to the "
                           f"test extra)")
    assert not missing, "\n".join(missing)


def test_the_test_pins_reach_every_session_and_ci() -> None:
    pins = {Requirement(line).name: str(Requirement(line).specifier)
            for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    assert pins["torch"] == "==2.13.0"  # the CPU build on the machines' disk
    assert 'os.environ["PIP_CONSTRAINT"] = str(CONSTRAINTS)' in (ROOT / "noxfile.py").read_text()
    assert "constraints.txt" in (ROOT / ".ci" / "run").read_text()


def test_the_pytest_plugin_and_import_rlmix_load_neither_torch_nor_transformers() -> None:
    """pytest loads ``rlmix.testing`` and ``rlmix_conformance.pytest_plugin`` (entry points
    pytest11) in every run where they are installed: they must cost nothing until a test uses a
    fixture or helper (or the kit's option is given)."""
    code = ("import json, sys, rlmix, rlmix.testing, rlmix.plugins\n"
            "import rlmix_conformance, rlmix_conformance.pytest_plugin\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "rlmix.testing.make_batch, rlmix.Run  # the helpers and types on first use\n"
            "print(json.dumps([heavy, 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [[], True]


def test_plots_without_matplotlib_end_with_the_pip_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from rlmix import observe

    (tmp_path / observe.METRICS_FILE).write_text('{"step": 1, "reward/mean": 0.5}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert observe.plot(tmp_path) == []
    assert "matplotlib is not installed; run 'pip install matplotlib'" in capsys.readouterr().err
    assert not (tmp_path / "plots").exists()


def test_tensorboard_without_the_package_is_a_config_error_with_the_pip_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rlmix import observe
    from rlmix.errors import ConfigError
    from rlmix.testing import make_run

    run = make_run(overrides=["log.tensorboard=true"])
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="run 'pip install tensorboard'"):
        observe.ObservePlugin().rlmix_configure(run)


ONE_PLUGIN_MANIFEST = """\
model: tiny-random
plugins: [hf, arith, grpo]
train: {steps: 2, prompts_per_step: 2, group_size: 2, eval_every: 0, checkpoint_every: 0}
sampling: {max_new_tokens: 4}
arith: {eval_size: 4, eval_max_new_tokens: 4}
log: {progress: false}
"""


@pytest.mark.slow
def test_fresh_venv_installs_one_algorithm_plugin_from_wheels(tmp_path: Path,
                                                             venv_dir: Path) -> None:
    """A fresh virtualenv, ``pip install --find-links dist rlmix rlmix-grpo`` (plus the env and
    rollout plugins a run needs), torch from constraints.txt: a two-step tiny-random run works,
    ``rlmix plugins`` lists exactly what was installed, and the optional extras stay out."""
    dist = tmp_path / "dist"
    names = ["rlmix", "rlmix-grpo", "rlmix-arith", "rlmix-hf"]
    build_dist.build(dist, names, sdists=False,
                     isolation=importlib.util.find_spec("setuptools") is None)
    assert len(list(dist.glob("*.whl"))) == len(names)
    venv = venv_dir
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONWARNINGS="ignore", PIP_CONSTRAINT=str(ROOT / "constraints.txt"))
    install = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-compile", "--find-links",
         str(dist), *names], capture_output=True, text=True, env=env, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    probe = subprocess.run(
        [str(bin_dir / "python"), "-c",
         "import importlib.metadata as md, importlib.util as u, json; print(json.dumps("
         "[md.version('torch')] + [m for m in ('gguf', 'accelerate', 'matplotlib', "
         "'tensorboard', 'pytest') if u.find_spec(m)]))"],
        capture_output=True, text=True, env=env, timeout=120)
    torch_version, *extras = json.loads(probe.stdout)
    assert torch_version.startswith("2.13.0"), torch_version  # the CPU build, from constraints
    assert extras == []  # the light core: no GGUF, plot, TensorBoard or test packages

    listing = subprocess.run([str(bin_dir / "rlmix"), "plugins", "--json"], capture_output=True,
                             text=True, env=env, timeout=120)
    assert listing.returncode == 0, listing.stderr
    rows = json.loads(listing.stdout)
    assert sorted(r["name"] for r in rows) == ["arith", "grpo", "hf"]

    manifest = tmp_path / "one-plugin.yaml"
    manifest.write_text(ONE_PLUGIN_MANIFEST)
    out = tmp_path / "run"
    run = subprocess.run([str(bin_dir / "rlmix"), "run", str(manifest), f"out={out}"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]  # two training steps
    # log.plot defaults to true; without matplotlib the run ends with the pip command, not a crash
    assert "plots skipped (log.plot): matplotlib is not installed; run 'pip install matplotlib'" \
        in run.stderr
