"""`rlmix new-plugin` writes packages whose hooks pass the conformance kit, and the generated
reference docs are current (moved from test_conformance.py when the kit became
`rlmix-conformance`)."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import rlmix_conformance as conformance

from rlmix import cli
from rlmix import plugins as plugin_loading
from rlmix.templates import reference
from rlmix.testing import load_script

from .conftest import ROOT

INSTALLED = sorted(plugin_loading.installed())


# ---------------------------------------------------------------- rlmix new-plugin


@pytest.mark.parametrize("args, message", [
    (["BadName", "--family", "algorithms"], "invalid plugin name 'BadName'"),
    (["ok_name", "--family", "algorithm"], "--family: unknown family 'algorithm'; choose one of "
                                           "algorithms, rollout, envs, harness, kernels, "
                                           "trainers"),
    (["ok_name", "--family", "algorithms", "--hooks", "advantage,klip"],
     "--hooks: unknown hook 'klip'; choose from configure, prompts"),
    (["ok_name"], "new-plugin: --family is required"),
    (["train", "--family", "algorithms"], "invalid plugin name 'train': it is a reserved "
                                          "manifest key"),
])
def test_new_plugin_rejects_bad_input_in_one_line(args: list[str], message: str,
                                                  tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["new-plugin", *args, "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlmix: error: " + message), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_new_plugin_refuses_to_overwrite(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["new-plugin", "mine", "--family", "envs", "--dir", str(tmp_path)]) == 0
    assert cli.main(["new-plugin", "mine", "--family", "envs", "--dir", str(tmp_path)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err


ALL_HOOKS = "prompts,sample,generate,score,advantage,clip,update,evolve,token_logprobs," \
            "evaluate,step_end,configure"


def _generate(tmp_path: Path, name: str, family: str, hooks: str | None = None) -> Path:
    args = ["new-plugin", name, "--family", family, "--dir", str(tmp_path)]
    assert cli.main(args + (["--hooks", hooks] if hooks else [])) == 0
    return tmp_path / name


def _import_generated(folder: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> object:
    import importlib

    monkeypatch.syspath_prepend(str(folder))
    return importlib.import_module(f"rlmix_{name}")


def test_new_plugin_writes_a_package_whose_hooks_pass_the_kit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _generate(tmp_path, "every_hook", "algorithms", ALL_HOOKS)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) \
        == ["README.md", "pyproject.toml", "rlmix_every_hook/__init__.py",
            "tests/test_every_hook.py", "tox.ini"]
    pyproject = (folder / "pyproject.toml").read_text()
    assert '[project.entry-points."rlmix.algorithms"]\nevery_hook = "rlmix_every_hook"' \
        in pyproject
    assert 'name = "rlmix-every-hook"' in pyproject
    tox = (folder / "tox.ini").read_text()
    assert "system_site_packages = true" in tox and "--rlmix-conformance every_hook" in tox
    module = _import_generated(folder, "every_hook", monkeypatch)
    hooks = {h.removeprefix("rlmix_") for h in plugin_loading.hooks_of(module)}
    assert hooks == set(ALL_HOOKS.split(","))
    assert dataclasses.is_dataclass(module.Settings)
    readme = (folder / "README.md").read_text()
    for f in dataclasses.fields(module.Settings):  # the manifest snippet has every setting
        assert f"  {f.name}: " in readme, f.name
    report = conformance.check_plugin("every_hook", module, "full")
    assert report.ok, report.format()
    assert len(report.results) >= 25


@pytest.mark.parametrize("family", ["rollout", "envs", "harness", "kernels", "trainers"])
def test_each_family_default_passes_the_quick_kit(family: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"new_{family}"
    module = _import_generated(_generate(tmp_path, name, family), name, monkeypatch)
    report = conformance.check_plugin(name, module)
    assert report.ok, report.format()


def test_generated_code_is_lint_clean_and_its_own_tests_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _generate(tmp_path, "linted", "algorithms", ALL_HOOKS)
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if Path(ruff).exists():
        lint = subprocess.run([ruff, "check", "--config", str(ROOT / "pyproject.toml"),
                               str(folder)], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout
    _import_generated(folder, "linted", monkeypatch)
    path = folder / "tests" / "test_linted.py"
    tests = load_script(path, "generated_test_linted")
    names = [n for n in dir(tests) if n.startswith("test_")]
    assert len(names) >= 9
    for name in names:
        if name != "test_conformance":  # needs the entry point: the slow test installs it
            getattr(tests, name)()


# ---------------------------------------------------------------- generated reference docs


def test_field_comments_come_from_metadata_trailing_or_preceding_comments() -> None:
    @dataclass
    class Example:
        alpha: float = 0.5  # the trailing comment
        # the line above
        # continues here
        beta: int = 3
        gamma: str = dataclasses.field(default="g", metadata={"help": "from metadata"})
        delta: bool = False

    comments = reference.field_comments(Example)
    assert comments == {"alpha": "the trailing comment", "beta": "the line above continues here"}
    rows, _ = reference.settings_table(Example, prefix="ex.")
    assert rows[2:] == [
        "| `ex.alpha` | float | `0.5` | the trailing comment |",
        "| `ex.beta` | int | `3` | the line above continues here |",
        "| `ex.gamma` | str | `g` | from metadata |",
        "| `ex.delta` | bool | `false` |  |",
    ]


def test_schema_lists_every_core_key_and_every_plugin_setting(
        capsys: pytest.CaptureFixture[str]) -> None:
    from rlmix import manifest

    assert cli.main(["config", "--schema"]) == 0
    text = capsys.readouterr().out
    for section in ("train", "sampling", "policy", "log", "score"):
        cls = type(getattr(manifest.CoreConfig(), section))
        for f in dataclasses.fields(cls):
            assert f"| `{section}.{f.name}` |" in text, (section, f.name)
    assert "| `train.epochs` | int | `1` | passes over each batch |" in text
    for name in INSTALLED:
        assert f"### `{name}`" in text, name
    import rlmix_grpo

    for f in dataclasses.fields(rlmix_grpo.Settings):
        assert re.search(rf"\| `grpo\.{f.name}` \| \w+ \| `[^`]+` \| ", text), f.name


def _sections(text: str, level: str = "### ") -> dict[str, str]:
    out, key = {}, None
    for line in text.splitlines():
        if line.startswith("## ") or line.startswith(level):
            key = line
            out[key] = ""
        elif key is not None:
            out[key] += line + "\n"
    return out


def test_docs_hooks_reference_is_generated_from_the_hookspecs() -> None:
    assert (ROOT / "docs" / "hooks.md").read_text() == reference.hooks_markdown(), \
        "docs/hooks.md is stale: rlmix config --hooks > docs/hooks.md"


def test_docs_manifest_reference_matches_the_code() -> None:
    written = _sections((ROOT / "docs" / "manifest-reference.md").read_text())
    generated = _sections(reference.schema_markdown())
    stale = [k for k, v in written.items() if k in generated and generated[k] != v]
    plugin_heads = {f"### `{n}`" for n in INSTALLED}
    missing = sorted(k for k in generated if k not in written and k in plugin_heads)
    core = [k for k in generated if k not in plugin_heads]
    assert not [k for k in core if k not in written]
    assert not stale and not missing, (
        f"docs/manifest-reference.md is stale ({', '.join(stale + missing)}): "
        f"rlmix config --schema > docs/manifest-reference.md")


def test_writing_a_plugin_doc_names_the_commands_it_teaches() -> None:
    text = (ROOT / "docs" / "writing-a-plugin.md").read_text()
    for needle in ("rlmix new-plugin", "--rlmix-conformance", "rlmix plugins --check",
                   "run.settings(", "@rlmix.hookimpl(wrapper=True)", "run.state"):
        assert needle in text, needle
    assert textwrap.dedent((ROOT / "docs" / "getting-started.md").read_text()).count(
        "rlmix run") >= 1
