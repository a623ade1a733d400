"""End to end: ``rlmix new-plugin`` writes a package that installs into a fresh environment with
the core only, passes its own tests under tox and the conformance kit, and trains.

The fresh environment: ``python -m venv``, ``pip install torch==2.13.0`` (the CPU wheel from the
machine's disk), ``pip install -e <repo root>``, the conformance kit (``libs/conformance``), then
the generated plugin. For a 2-step run the
manifest needs a rollout engine and an env; the core ships none, so the repository's ``hf`` and
``arith`` plugins are installed too (``--no-deps``: they need nothing beyond the core). tox runs
in that environment and reuses its torch and core (``RLMIX_REUSE_PATH``, see the generated
tox.ini) instead of installing them a second time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAME = "e2e_algo"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONWARNINGS="ignore")
    return env


def _run(cmd: list[str], timeout: float, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> str:
    started = time.perf_counter()
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd,
                            env=env or _env(), timeout=timeout)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out[-4000:]}"
    print(f"{time.perf_counter() - started:6.1f} s  {' '.join(map(str, cmd))[:120]}")
    return out


@pytest.mark.slow
def test_generated_plugin_installs_alone_passes_tox_and_the_kit_and_trains(
        tmp_path: Path, venv_dir: Path) -> None:
    if sys.version_info[:2] != (3, 11):
        pytest.skip("needs Python 3.11 (the torch 2.13.0 CPU wheel on this machine is cp311)")
    # 1. the package, written by the CLI of the environment that runs the tests
    _run([sys.executable, "-m", "rlmix", "new-plugin", NAME, "--family", "algorithms",
          "--hooks", "advantage,clip,step_end", "--dir", tmp_path], 60)
    plugin = tmp_path / NAME
    assert (plugin / "tox.ini").exists() and (plugin / "pyproject.toml").exists()

    # 2. a fresh environment with the core only, then the plugin
    venv = venv_dir
    _run([sys.executable, "-m", "venv", venv], 120)
    py = venv / "bin" / "python"
    pip = [py, "-m", "pip", "install", "-q", "--no-compile"]
    _run([*pip, "torch==2.13.0"], 300)
    _run([*pip, "-e", ROOT], 400)
    _run([*pip, "--no-deps", "-e", ROOT / "plugins" / "rollout" / "hf",
          "-e", ROOT / "plugins" / "envs" / "arith", "-e", ROOT / "libs" / "conformance"], 120)
    _run([*pip, "-e", plugin, "tox", "pytest"], 200)
    listed = _run([py, "-m", "rlmix", "plugins", "--json"], 120)
    names = {row["name"] for row in json.loads(listed[listed.index("["):])}
    assert names == {"hf", "arith", NAME}, names  # the core alone brings no plugin

    # 3. its own tests and the conformance kit, under tox, reusing the environment's packages
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                60).strip().splitlines()[-1]
    env = _env()
    env["RLMIX_REUSE_PATH"] = os.pathsep.join([site, str(ROOT / "core"),
                                               str(ROOT / "libs" / "conformance")])
    out = _run([venv / "bin" / "tox", "-q"], 400, cwd=plugin, env=env)
    assert "congratulations" in out or " OK " in out, out[-2000:]

    # 4. the conformance kit in the fresh environment, as a plugin author runs it
    out = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rlmix-conformance",
                NAME], 300, cwd=tmp_path)
    assert "failed" not in out, out[-3000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 12, out[-3000:]  # every check of the full kit

    # 5. a 2-step run that names it
    manifest = tmp_path / "e2e.yaml"
    manifest.write_text(f"model: tiny-random\nplugins: [hf, arith, {NAME}]\n"
                        f"train: {{steps: 2, prompts_per_step: 2, group_size: 4}}\n"
                        f"sampling: {{max_new_tokens: 8}}\n"
                        f"arith: {{eval_size: 4, eval_max_new_tokens: 4}}\n"
                        f"log: {{progress: false, plot: false}}\n"
                        f"{NAME}: {{clip_high: 0.28}}\n")
    out_dir = tmp_path / "run"
    _run([venv / "bin" / "rlmix", "run", manifest, f"out={out_dir}"], 300, cwd=tmp_path)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r[f"{NAME}/steps_seen"] for r in steps] == [1.0, 2.0]  # its step_end ran
    owners = (out_dir / "hooks.txt").read_text()
    for hook in ("rlmix_advantage", "rlmix_clip"):
        line = next(li for li in owners.splitlines() if li.startswith(hook))
        assert f"owner: {NAME}" in line, owners
    resolved = (out_dir / "manifest.yaml").read_text()
    assert "clip_high: 0.28" in resolved
