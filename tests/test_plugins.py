"""Plugin loading and hook ownership: named loading in manifest order, the owner table,
wrappers, and failures that name the plugin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rlmix
from rlmix import loop, manifest
from rlmix import plugins as plugin_loading
from rlmix.errors import ManifestError, PluginError
from rlmix.testing import make_batch, make_run

from .conftest import cli_env, rlmix_cmd


def _advantage_plugin(value: float | None) -> type:
    class Advantage:
        @rlmix.hookimpl
        def rlmix_advantage(self, run, batch):  # noqa: ANN001, ANN201
            return None if value is None else torch.full((len(batch),), value)

    return Advantage


def _row(run: rlmix.Run, hook: str) -> plugin_loading.HookOwner:
    return next(r for r in plugin_loading.owner_table(run.pm) if r.hook == hook)


def test_named_loading_loads_only_listed_plugins_in_order(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.delitem(sys.modules, "rlmix_arith", raising=False)
    loaded = plugin_loading.load(["grpo", "hf"])
    assert [p.name for p in loaded] == ["grpo", "hf"]
    assert [p.family for p in loaded] == ["rlmix.algorithms", "rlmix.rollout"]
    assert loaded[0].distribution == "rlmix-grpo"
    assert loaded[0].settings_cls is not None and loaded[0].settings_cls.__name__ == "Settings"
    assert "rlmix_arith" not in sys.modules  # installed, not listed: never imported
    pm = plugin_loading.new_plugin_manager()
    plugin_loading.register(pm, loaded)
    names = [name for name, _ in pm.list_name_plugin()]
    # the core's defaults first (trylast), then the manifest's plugins in its order
    assert names[-2:] == ["grpo", "hf"]
    assert names.index("rlmix.defaults") < names.index("grpo")
    assert pm.get_plugin("arith") is None


def test_manifest_order_decides_registration_order() -> None:
    loaded = plugin_loading.load(["hf", "arith", "grpo"])
    assert [p.name for p in loaded] == ["hf", "arith", "grpo"]
    loaded = plugin_loading.load(["grpo", "arith", "hf"])
    assert [p.name for p in loaded] == ["grpo", "arith", "hf"]


def test_duplicate_plugin_is_an_error() -> None:
    with pytest.raises(ManifestError, match="more than once: grpo"):
        plugin_loading.load(["grpo", "hf", "grpo"])


def test_last_listed_implementer_owns_a_firstresult_hook() -> None:
    plugins = {"a": _advantage_plugin(1.0), "b": _advantage_plugin(2.0),
               "c": _advantage_plugin(3.0)}
    run = make_run(plugins)
    row = _row(run, "rlmix_advantage")
    assert row.kind == "firstresult"
    assert row.owner == "c"
    assert row.displaced == ["b", "a"]
    assert row.wrappers == []
    batch = make_batch()
    assert run.hook.rlmix_advantage(run=run, batch=batch).tolist() == [3.0] * len(batch)

    # the same plugins listed in another order: another owner
    run = make_run({"c": plugins["c"], "a": plugins["a"], "b": plugins["b"]})
    row = _row(run, "rlmix_advantage")
    assert (row.owner, row.displaced) == ("b", ["a", "c"])
    assert run.hook.rlmix_advantage(run=run, batch=batch).tolist() == [2.0] * len(batch)


def test_an_owner_that_declines_passes_to_the_one_it_displaced() -> None:
    run = make_run({"a": _advantage_plugin(1.0), "b": _advantage_plugin(None)})
    assert _row(run, "rlmix_advantage").owner == "b"
    batch = make_batch()
    assert run.hook.rlmix_advantage(run=run, batch=batch).tolist() == [1.0] * len(batch)


def test_a_plugin_displaces_the_core_default() -> None:
    class Trainer:
        @rlmix.hookimpl
        def rlmix_update(self, run, loss):  # noqa: ANN001, ANN201
            return {"mine": 1.0}

    run = make_run({"trainer": Trainer})
    row = _row(run, "rlmix_update")
    assert row.owner == "trainer"
    assert row.displaced == ["rlmix.defaults"]
    assert _row(make_run({"a": _advantage_plugin(1.0)}), "rlmix_update").owner == \
        "rlmix.defaults"


def _wrapper(fn: object) -> type:
    class Wrapper:
        @rlmix.hookimpl(wrapper=True)
        def rlmix_advantage(self, run, batch):  # noqa: ANN001, ANN201
            result = yield
            return fn(result)  # type: ignore[operator]

    return Wrapper


def test_wrapper_changes_the_owners_result() -> None:
    run = make_run({"a": _advantage_plugin(3.0), "shape": _wrapper(lambda r: r * 2 + 1)})
    row = _row(run, "rlmix_advantage")
    assert row.owner == "a"  # a wrapper never owns the hook
    assert row.wrappers == ["shape"]
    batch = make_batch()
    assert run.hook.rlmix_advantage(run=run, batch=batch).tolist() == [7.0] * len(batch)


def test_wrappers_compose_in_manifest_order() -> None:
    """The wrapper listed last is outermost: it sees the inner wrappers' result."""
    add = _wrapper(lambda r: r + 1)
    double = _wrapper(lambda r: r * 2)
    batch = make_batch()
    run = make_run({"a": _advantage_plugin(3.0), "add": add, "double": double})
    assert run.hook.rlmix_advantage(run=run, batch=batch)[0].item() == (3 + 1) * 2
    run = make_run({"a": _advantage_plugin(3.0), "double": double, "add": add})
    assert run.hook.rlmix_advantage(run=run, batch=batch)[0].item() == 3 * 2 + 1


def test_real_plugins_owner_table() -> None:
    cfg = manifest.read(None, ["model=tiny-random", "plugins=[hf,arith,grpo]"])
    run, loaded = loop.prepare(cfg)
    assert [p.name for p in loaded] == ["hf", "arith", "grpo"]
    owners = {r.hook: r.owner for r in plugin_loading.owner_table(run.pm)}
    assert owners["rlmix_generate"] == "hf"
    assert owners["rlmix_prompts"] == "arith"
    assert owners["rlmix_advantage"] == "grpo"
    assert owners["rlmix_clip"] == "grpo"
    assert owners["rlmix_sample"] == "rlmix.defaults"
    assert owners["rlmix_update"] == "rlmix.defaults"
    assert _row(run, "rlmix_score").implementers == ["arith"]


class FailsToConfigure:
    @rlmix.hookimpl
    def rlmix_configure(self, run):  # noqa: ANN001, ANN201
        raise RuntimeError("out of widgets")


class RejectsSettings:
    @rlmix.hookimpl
    def rlmix_configure(self, run):  # noqa: ANN001, ANN201
        raise rlmix.ConfigError("widgets must be > 0")


def test_configure_failure_names_the_plugin() -> None:
    run = make_run({"a": _advantage_plugin(1.0), "widget": FailsToConfigure})
    with pytest.raises(PluginError) as info:
        loop.configure(run)
    assert "plugin 'widget'" in str(info.value)
    assert "RuntimeError: out of widgets" in str(info.value)


def test_config_error_from_configure_names_the_plugin() -> None:
    run = make_run({"widget": RejectsSettings})
    with pytest.raises(ManifestError) as info:
        loop.configure(run)
    assert "plugin 'widget'" in str(info.value)
    assert "widgets must be > 0" in str(info.value)


BROKEN_MODULE = "rlmix_broken_for_tests"


@pytest.fixture
def broken_plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with an installed-looking distribution whose entry point ``broken`` (family
    rlmix.algorithms) points at a module that raises ImportError on import."""
    # keep stevedore from writing an entry-point cache file for this throwaway sys.path
    from stevedore import _cache

    monkeypatch.setattr(_cache._c, "_disable_caching", True, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    dist = tmp_path / "rlmix_broken-0.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlmix-broken\nVersion: 0.0.1\n")
    (dist / "entry_points.txt").write_text(f"[rlmix.algorithms]\nbroken = {BROKEN_MODULE}\n")
    (tmp_path / f"{BROKEN_MODULE}.py").write_text(
        "raise ImportError('rlmix-broken needs the package frobnicate')\n")
    return tmp_path


def test_plugin_that_fails_to_import_names_itself(broken_plugin_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(broken_plugin_path))
    info = plugin_loading.installed()["broken"]
    assert (info.family, info.distribution, info.version) == ("rlmix.algorithms",
                                                              "rlmix-broken", "0.0.1")
    with pytest.raises(PluginError) as err:
        plugin_loading.load(["hf", "broken"])
    message = str(err.value)
    assert "plugin 'broken'" in message
    assert "failed to import" in message
    assert "frobnicate" in message
    assert BROKEN_MODULE not in sys.modules


def test_plugins_command_reports_a_broken_plugin(broken_plugin_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from rlmix import cli

    monkeypatch.syspath_prepend(str(broken_plugin_path))
    assert cli.main(["plugins", "--json"]) == 1  # the listing works, and says it failed
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert "IMPORT FAILED" in rows["broken"]["description"]
    assert "frobnicate" in rows["broken"]["description"]
    assert rows["grpo"]["hooks"].startswith("advantage")


def test_cli_stops_on_a_plugin_that_fails_to_import(broken_plugin_path: Path,
                                                    tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("model: tiny-random\nplugins: [hf, arith, grpo, broken]\n")
    env = cli_env(PYTHONPATH=str(broken_plugin_path),
                  XDG_CACHE_HOME=str(broken_plugin_path / "xdg-cache"))
    result = subprocess.run(rlmix_cmd("run", str(path), f"out={tmp_path / 'out'}"),
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "plugin 'broken'" in result.stderr
    assert "ImportError: rlmix-broken needs the package frobnicate" in result.stderr


FUTURE_MODULE = "rlmix_future_for_tests"


@pytest.fixture
def future_plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with an installed-looking distribution ``rlmix-future`` (entry point ``future``,
    family rlmix.algorithms) that declares ``rlmix>=99``, which the installed core is not."""
    from stevedore import _cache

    monkeypatch.setattr(_cache._c, "_disable_caching", True, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    dist = tmp_path / "rlmix_future-0.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlmix-future\nVersion: 0.0.1\n"
                                   "Requires-Dist: rlmix>=99\n"
                                   "Requires-Dist: rlmix>=0.1; extra == 'other'\n")
    (dist / "entry_points.txt").write_text(f"[rlmix.algorithms]\nfuture = {FUTURE_MODULE}\n")
    (tmp_path / f"{FUTURE_MODULE}.py").write_text("raise AssertionError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_plugin_made_for_another_core_is_listed_with_the_reason(
        future_plugin_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata as md
    import json

    from rlmix import cli

    info = plugin_loading.installed()["future"]
    assert f"needs rlmix>=99 but the installed core is rlmix {md.version('rlmix')}" in info.problem
    assert plugin_loading.installed()["grpo"].problem == ""  # "rlmix>=0.1" is satisfied
    assert cli.main(["plugins", "--json"]) == 1  # the listing works, and says it failed
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["future"]["description"].startswith("INCOMPATIBLE: needs rlmix>=99")
    assert rows["future"]["hooks"] == "-"
    assert rows["grpo"]["hooks"].startswith("advantage")
    assert FUTURE_MODULE not in sys.modules


def test_a_manifest_naming_a_plugin_made_for_another_core_fails_with_the_reason(
        future_plugin_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rlmix import cli

    with pytest.raises(PluginError) as err:
        plugin_loading.load(["hf", "future"])
    assert ("plugin 'future' (rlmix.algorithms, rlmix-future 0.0.1) needs rlmix>=99"
            in str(err.value))
    path = tmp_path / "m.yaml"
    path.write_text("model: tiny-random\nplugins: [hf, arith, grpo, future]\n")
    assert cli.main(["run", str(path), f"out={tmp_path / 'out'}"]) == 2
    stderr = capsys.readouterr().err
    assert "plugin 'future'" in stderr and "needs rlmix>=99" in stderr
    assert "Traceback" not in stderr
    assert FUTURE_MODULE not in sys.modules
    assert not (tmp_path / "out").exists()
