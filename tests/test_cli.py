"""``rlmix plugins | config | eval``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlmix import cli

from .conftest import EXAMPLE, TINY, read_jsonl, run_cli

EXPECTED_HOOKS = {
    "hf": ("rollout", {"generate"}),
    "arith": ("envs", {"prompts", "score", "evaluate"}),
    "grpo": ("algorithms", {"advantage", "clip"}),
}


def test_plugins_lists_the_installed_plugins() -> None:
    result = run_cli("plugins")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    table = result.stdout
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("│").split("│")]
        if len(cells) == 5 and cells[1] in EXPECTED_HOOKS:
            rows[cells[1]] = cells
    assert rows.keys() == EXPECTED_HOOKS.keys(), table
    for name, (family, hooks) in EXPECTED_HOOKS.items():
        assert rows[name][0] == family
        assert rows[name][2].startswith(f"rlmix-{name} ")
        assert hooks <= {h.strip() for h in rows[name][3].split(",")}, rows[name]


def test_plugins_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for name, (family, hooks) in EXPECTED_HOOKS.items():
        row = rows[name]
        assert row["family"] == family
        assert hooks <= set(row["hooks"].split(", "))
        assert row["distribution"] == f"rlmix-{name} 0.1.0"
        assert row["description"] and "\n" not in row["description"]
    assert "clip" not in rows["arith"]["hooks"]
    assert "generate" not in rows["grpo"]["hooks"]


def test_config_prints_the_owner_table(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", str(EXAMPLE), "model=tiny-random",
                     "plugins=[hf,arith,grpo]"]) == 0
    out = capsys.readouterr().out
    owners = {}
    for line in out.splitlines():
        if line.startswith("# rlmix_"):
            hook, _, rest = line[2:].partition(" ")
            owners[hook] = rest.strip()
    assert owners["rlmix_generate"] == "owner: hf"
    assert owners["rlmix_prompts"] == "owner: arith"
    assert owners["rlmix_advantage"] == "owner: grpo"
    assert owners["rlmix_clip"] == "owner: grpo"
    assert owners["rlmix_update"] == "owner: rlmix.defaults"
    assert owners["rlmix_score"] == "all: arith"
    assert "grpo" in owners["rlmix_configure"] and "arith" in owners["rlmix_configure"]


def test_eval_prints_the_checkpoints_accuracy(tiny_run_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    logged = {r["step"]: r for r in read_jsonl(tiny_run_dir / "metrics.jsonl")}
    out = tmp_path / "eval-out"
    for target, step in ((tiny_run_dir, 4), (tiny_run_dir / "checkpoints" / "step-000002", 2)):
        code = cli.main(["eval", str(EXAMPLE), *TINY, f"out={out}",
                         "--checkpoint", str(target)])
        assert code == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["step"] == step
        assert report["checkpoint"].endswith(f"step-{step:06d}")
        # greedy evaluation of the saved weights reproduces what the run logged at that step
        assert report["eval/accuracy"] == pytest.approx(logged[step]["eval/accuracy"])
        assert report["eval/format"] == pytest.approx(logged[step]["eval/format"])
    assert not out.exists()  # evaluating writes no run folder


def test_eval_rejects_a_folder_without_checkpoint(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["eval", str(EXAMPLE), *TINY, f"out={tmp_path / 'o'}",
                     "--checkpoint", str(tmp_path)])
    assert code == 2
    assert "not a checkpoint folder" in capsys.readouterr().err


def test_eval_says_the_autocast_choice_on_stdout_and_writes_no_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from rlmix import policy

    monkeypatch.setattr(policy, "native_bf16", lambda device: False)  # as on an AVX2 CPU
    out = tmp_path / "eval-out"
    code = cli.main(["eval", str(EXAMPLE), *TINY, "policy.autocast=auto", f"out={out}"])
    said = capsys.readouterr()
    assert code == 0
    assert said.err == ""  # stderr stays for warnings and errors
    assert "policy.autocast auto -> none" in said.out
    assert json.loads(said.out.strip().splitlines()[-1])["checkpoint"] == "base model"
    assert not out.exists()  # the note did not make a run folder


def test_eval_without_checkpoint_evaluates_the_base_model(
        tiny_run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logged = {r["step"]: r for r in read_jsonl(tiny_run_dir / "metrics.jsonl")}
    out = tmp_path / "eval-out"
    code = cli.main(["eval", str(EXAMPLE), *TINY, f"out={out}"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["checkpoint"] == "base model" and report["step"] == 0
    # the untrained model: what the run logged before its first step
    assert report["eval/accuracy"] == pytest.approx(logged[0]["eval/accuracy"])
    assert not out.exists()
