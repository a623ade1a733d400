"""bench/lowbit_learn.py: its plumbing mode (tiny model, 2 steps, in process) runs a sampler
config through ``rlmix run`` of the demo manifest and stores the evaluations and the mismatch;
the report compares with fp32 and marks a collapsed run (an integration test of the script,
not a learning claim)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlmix.testing import load_script, skip_unless_installed

from .conftest import ROOT

BENCH = ROOT / "bench" / "lowbit_learn.py"


def _bench():
    return load_script(BENCH)


def test_plumbing_mode_runs_a_sampler_config(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    skip_unless_installed(ROOT / "examples" / "lowbit-arith.yaml")  # the same plugins
    bench = _bench()
    argv = ["--model", "tiny-random", "--steps", "2", "--seeds", "0", "--configs", "int8-tis",
            "--in-process", "--target", "0.0", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    assert "| int8-tis | 1 |" in capsys.readouterr().out
    result = json.loads((tmp_path / "results" / "int8-tis-s0.json").read_text())
    assert [e["step"] for e in result["evals"]] == [0, 2]
    assert result["train_s"] > 0 and 0.0 <= result["accuracy"] <= 1.0
    assert result["logp_diff_abs_mean"] > 0 and result["refresh_s_mean"] > 0
    assert "lowbit_rollout.precision=int8" in result["command"]
    assert "rollout_correction.mode=tis" in result["command"]
    assert bench.main([*argv, "--report"]) == 0  # stored results are read back, not rerun


def test_the_report_compares_with_fp32_and_marks_a_collapse() -> None:
    bench = _bench()

    def result(config: str, seed: int, accs: list[float]) -> dict:
        evals = [{"step": 10 * i, "accuracy": a, "train_s": 100.0 * i}
                 for i, a in enumerate(accs)]
        return {"config": config, "seed": seed, "evals": evals, "accuracy": accs[-1],
                "start_accuracy": accs[0], "train_s": 400.0 if config == "fp32" else 200.0,
                "sample_s_mean": 1.0, "logp_diff_abs_mean": 0.01, "kl_seq_mean": 0.001}

    table = bench.report([result("fp32", 0, [0.3, 0.5, 0.7]), result("fp32", 1, [0.3, 0.5, 0.5]),
                          result("int8", 0, [0.3, 0.6, 0.65]), result("int8", 1, [0.3, 0.2, 0.1])],
                         ["fp32", "int8"], target=0.5)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "0.600 +/- 0.100" in rows["fp32"] and "| +0.0 |" in rows["fp32"]
    assert "0.10 COLLAPSED" in rows["int8"] and "| -22.5 |" in rows["int8"]
    assert "| 0.50 |" in rows["int8"]  # half fp32's training time
    assert "100, not reached" in rows["int8"] and "100, 100" in rows["fp32"]


def _mismatch_bench():
    return load_script(ROOT / "bench" / "lowbit_mismatch.py")


def test_mismatch_bench_is_zero_against_itself_and_prints_every_copy(
        capsys: pytest.CaptureFixture[str]) -> None:
    skip_unless_installed(ROOT / "examples" / "lowbit-arith.yaml")
    bench = _mismatch_bench()
    from rlmix.policy import load_model

    master, tok = load_model("tiny-random", "float32")
    prompts = [tok.apply_chat_template([{"role": "user", "content": "What is 12+34?"}],
                                       tokenize=False, add_generation_prompt=True)] * 2
    same = bench.mismatch(master, master, tok, prompts, tokens=3, seed=0)
    # the decode loop against one forward: only the summation order differs
    assert same["mean"] < 1e-4 and same["rescored_mean"] == 0.0 and same["argmax_agree"] == 1.0
    assert bench.main(["--model", "tiny-random", "--tokens", "3", "--prompts", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0][2:] for r in rows[2:]] == list(bench.VARIANTS)
    means = [float(r.split(" | ")[1]) for r in rows[2:]]
    assert all(m < 1.0 for m in means) and max(means) > 0.0  # close to fp32, not equal


def test_decode_bench_times_every_copy_and_its_refresh_after_calibration(
        tmp_path: Path) -> None:
    """bench/lowbit_decode.py in its plumbing mode: a row per copy and rows setting with its
    refresh time, both floors, and the ratio to the larger one. (That the refresh is timed after
    the warm-up, once w8a8 has calibrated, is in the script's order of work; this test does not
    see it.)"""
    skip_unless_installed(ROOT / "examples" / "lowbit-arith.yaml")
    bench = load_script(ROOT / "bench" / "lowbit_decode.py")
    variants = ["fp32", "bf16-packed-eager", "int8-w8a8", "int8-w8a8-token"]
    out = tmp_path / "decode.json"
    assert bench.main(["--model", "tiny-random", "--tokens", "4", "--rows", "2", "--variants",
                       *variants, "--json", str(out)]) == 0
    results = {r["variant"]: r for r in json.loads(out.read_text())}
    assert list(results) == variants
    assert results["fp32"]["refresh_s"] == 0.0
    for name in variants[1:]:
        r = results[name]
        assert r["refresh_s"] > 0 and r["tokens_per_s"] > 0 and r["floor_ms_per_step"] > 0
        assert r["compute_floor_ms_per_step"] > 0
        assert r["over_roofline"] <= r["over_floor"]  # divided by the larger floor
    assert results["int8-w8a8"]["weight_mb"] < 0.6 * results["bf16-packed-eager"]["weight_mb"]
