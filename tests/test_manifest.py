"""Bad manifests fail before any model loads, with one clear message naming the plugin, the key
path and the allowed choices; the CLI prints it without a traceback and exits with 2."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlmix import cli, manifest
from rlmix.errors import ManifestError
from rlmix.plugins import LoadedPlugin

from .conftest import cli_env, rlmix_cmd

BASE = "model: tiny-random\nplugins: [hf, arith, grpo]\nlog: {progress: false}\n"


@dataclass
class Case:
    command: str  # run | config
    yaml: str | None  # None: the manifest file does not exist
    overrides: list[str] = field(default_factory=list)
    expected: list[str] = field(default_factory=list)
    subprocess: bool = True  # also run as its own process (each costs a torch import)


CASES: dict[str, Case] = {
    "unknown-plugin-key": Case("run", BASE + "grpo: {eps_lo: 0.1}\n", [], [
        "'grpo.eps_lo'", "plugin 'grpo'", "unknown key", "eps_low", "eps_high", "scale"]),
    "wrong-type": Case("config", BASE + "grpo: {eps_low: abc}\n", [], [
        "'grpo.eps_low'", "plugin 'grpo'", "'abc'", "float"]),
    "wrong-type-override": Case("run", BASE, ["grpo.eps_low=abc"], [
        "'grpo.eps_low'", "plugin 'grpo'", "'abc'", "float"], subprocess=False),
    "bad-choice": Case("run", BASE + "grpo: {scale: grop}\n", [], [
        "'grpo.scale'", "plugin 'grpo'", "'grop'", "group, batch, none"]),
    "bad-dtype": Case("config", BASE + "policy: {dtype: int8}\n", [], [
        "'policy.dtype'", "'int8'", "float32, bfloat16, float16"]),
    "unknown-plugin": Case("run", BASE, ["plugins=[hf,arith,grpoo]"], [
        "'grpoo'", "installed plugins", "hf", "arith", "grpo", "pip install rlmix-grpoo"]),
    "no-owner": Case("run", "model: tiny-random\nplugins: [hf, arith]\n", [], [
        "'rlmix_advantage'", "'rlmix_clip'", "no owner", "grpo", "algorithm"]),
    "unknown-top-level-key": Case("config", BASE + "trian: {steps: 3}\n", [], [
        "'trian'", "unknown key", "train", "sampling", "grpo"]),
    "unlisted-plugin-block": Case("run", "model: tiny-random\nplugins: [hf, arith]\n"
                                  "grpo: {eps_low: 0.1}\n", [], [
        "'grpo'", "not listed in 'plugins'"]),
    "unknown-core-key": Case("run", BASE, ["train.stpes=3"], [
        "'train.stpes'", "unknown key", "steps", "group_size"]),
    "core-wrong-type": Case("config", BASE + "train: {steps: many}\n", [], [
        "'train.steps'", "'many'", "int"], subprocess=False),
    "malformed-override": Case("config", BASE, ["train.steps"], [
        "'train.steps'", "not key=value"]),
    "missing-manifest": Case("run", None, [], ["manifest not found", "absent.yaml"]),
}


def _args(case: Case, folder: Path) -> list[str]:
    """The command line of ``case``, with its manifest written into ``folder``."""
    path = folder / ("absent.yaml" if case.yaml is None else "m.yaml")
    if case.yaml is not None:
        path.write_text(case.yaml)
    args = [case.command, str(path), *case.overrides]
    if case.command == "run":
        args.append(f"out={folder / 'out'}")
    return args


def _check_message(name: str, stderr: str) -> None:
    errors = [line for line in stderr.splitlines() if line.strip()]
    assert len(errors) == 1, stderr  # one message, nothing else
    message = errors[0]
    assert message.startswith("rlmix: error: ")
    for text in CASES[name].expected:
        assert text in message, (text, message)


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory: pytest.TempPathFactory
                ) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case as its own ``rlmix`` process, all started together (they are import-bound)."""
    root = tmp_path_factory.mktemp("manifests")
    procs = {}
    for name, case in CASES.items():
        if not case.subprocess:
            continue
        folder = root / name
        folder.mkdir()
        args = _args(case, folder)
        procs[name] = (args, subprocess.Popen(rlmix_cmd(*args), cwd=folder, env=cli_env(),
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
    results = {}
    for name, (args, proc) in procs.items():
        out, err = proc.communicate(timeout=180)
        results[name] = subprocess.CompletedProcess(args, proc.returncode, out, err)
    return results


@pytest.mark.slow  # a CLI process per case, each importing torch
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.subprocess])
def test_cli_reports_bad_manifest(name: str,
                                  cli_results: dict[str, subprocess.CompletedProcess[str]]
                                  ) -> None:
    result = cli_results[name]
    assert "Traceback" not in result.stderr + result.stdout
    assert result.returncode == 2, result.stderr
    _check_message(name, result.stderr)


@pytest.mark.parametrize("name", list(CASES))
def test_main_reports_bad_manifest(name: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The same cases through ``rlmix.cli.main`` in this process: an exception that escaped
    ``main`` would fail the test here too."""
    assert cli.main(_args(CASES[name], tmp_path)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    _check_message(name, captured.err)


def test_bad_manifest_creates_no_run_folder(tmp_path: Path) -> None:
    """The error comes before anything is written (or a model is loaded)."""
    path = tmp_path / "m.yaml"
    path.write_text(BASE + "grpo: {scale: grop}\n")
    result = subprocess.run(rlmix_cmd("run", str(path), f"out={tmp_path / 'out'}"),
                            capture_output=True, text=True, env=cli_env(), timeout=120)
    assert result.returncode == 2
    assert not (tmp_path / "out").exists()


def test_config_applies_dotlist_overrides(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(BASE + "train: {steps: 3, group_size: 4}\ngrpo: {eps_high: 0.28}\n")
    result = subprocess.run(rlmix_cmd("config", str(path), "train.steps=7",
                                      "grpo.eps_high=0.3", "sampling.temperature=0.7"),
                            capture_output=True, text=True, env=cli_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "  steps: 7\n" in result.stdout
    cfg = OmegaConf.create(result.stdout)  # the owner table is printed as YAML comments
    assert cfg.train.steps == 7
    assert cfg.train.group_size == 4  # from the file, untouched by the overrides
    assert cfg.grpo.eps_high == pytest.approx(0.3)
    assert cfg.sampling.temperature == pytest.approx(0.7)
    # resolved: defaults of the core and of every listed plugin are filled in
    assert cfg.grpo.scale == "group"
    assert cfg.arith.digits == 2
    assert "batch_size" in cfg.hf
    assert cfg.train.lr == pytest.approx(1e-5)
    assert cfg.name == "m"


# -- the library functions directly -------------------------------------------------------


def test_read_applies_overrides_and_names_the_run(tmp_path: Path) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text(BASE + "train: {steps: 3}\n")
    cfg = manifest.read(path, ["train.steps=9", "grpo.beta=0.1"])
    assert cfg.train.steps == 9
    assert cfg.grpo.beta == pytest.approx(0.1)
    assert cfg.name == "demo"
    assert list(cfg.plugins) == ["hf", "arith", "grpo"]


def test_read_errors(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="manifest not found"):
        manifest.read(tmp_path / "nope.yaml")
    with pytest.raises(ManifestError, match="not key=value"):
        manifest.read(None, ["train.steps"])
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ManifestError, match="mapping"):
        manifest.read(listing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: {steps: 3\n")
    with pytest.raises(ManifestError, match="not valid YAML"):
        manifest.read(broken)


def test_validate_core() -> None:
    core = manifest.validate_core(manifest.read(None, ["plugins=[hf]", "train.grad_accum=4"]))
    assert core.train.grad_accum == 4
    assert core.train.steps == manifest.TrainConfig().steps
    with pytest.raises(ManifestError) as info:
        manifest.validate_core(manifest.read(None, ["plugins=[hf]", "train.stpes=3"]))
    assert "'train.stpes'" in str(info.value) and "steps" in str(info.value)
    with pytest.raises(ManifestError, match="'policy.autocast'.*bfloat16"):
        manifest.validate_core(manifest.read(None, ["plugins=[hf]", "policy.autocast=fp8"]))
    with pytest.raises(ManifestError, match="no plugins listed"):
        manifest.validate_core(manifest.read(None, ["model=tiny-random"]))


@dataclass
class ClipSettings:
    eps_low: float = 0.2
    eps_high: float = 0.28
    mode: str = "a"

    def __post_init__(self) -> None:
        if self.mode not in ("a", "b"):
            raise ValueError(f"mode: {self.mode!r} is not allowed; choose one of a, b")


def _plugins() -> list[LoadedPlugin]:
    return [LoadedPlugin("dapo.clip_higher", "inline", object(), ClipSettings),
            LoadedPlugin("plain", "inline", object(), None)]


def test_validate_plugin_blocks_nested_names() -> None:
    cfg = OmegaConf.create({"plugins": ["dapo.clip_higher", "plain"],
                            "dapo": {"clip_higher": {"eps_high": 0.3}}})
    settings = manifest.validate_plugin_blocks(cfg, _plugins(), set())
    assert isinstance(settings["dapo.clip_higher"], ClipSettings)
    assert settings["dapo.clip_higher"].eps_high == pytest.approx(0.3)
    assert settings["dapo.clip_higher"].eps_low == pytest.approx(0.2)
    assert "plain" not in settings  # no Settings class, no settings


@pytest.mark.parametrize(("block", "expected"), [
    ({"dapo": {"clip_higher": {"eps_hi": 0.3}}},
     ["'dapo.clip_higher.eps_hi'", "plugin 'dapo.clip_higher'", "eps_high, eps_low, mode"]),
    ({"dapo": {"clip_lower": {}}}, ["'dapo.clip_lower'", "unknown key", "clip_higher"]),
    ({"dapo": {"clip_higher": {"eps_low": "wide"}}},
     ["'dapo.clip_higher.eps_low'", "'wide'", "float"]),
    ({"dapo": {"clip_higher": {"mode": "c"}}},
     ["'dapo.clip_higher.mode'", "plugin 'dapo.clip_higher'", "choose one of a, b"]),
    ({"plain": {"x": 1}}, ["'plain.x'", "plugin 'plain'", "takes no settings"]),
    ({"grpo": {"beta": 0.1}}, ["'grpo'", "not listed in 'plugins'"]),
    ({"extra": 1}, ["'extra'", "allowed top-level keys", "dapo", "train"]),
])
def test_validate_plugin_blocks_errors(block: dict, expected: list[str]) -> None:
    cfg = OmegaConf.create({"plugins": ["dapo.clip_higher", "plain"], **block})
    with pytest.raises(ManifestError) as info:
        manifest.validate_plugin_blocks(cfg, _plugins(), {"grpo"})
    for text in expected:
        assert text in str(info.value), (text, str(info.value))
