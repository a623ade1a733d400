"""The two ways a harness evolves, end to end on the tiny model from the example manifests in
examples/harness/: harness-only (no log-prob forward, no backward, weights unchanged; each step
one GEPA iteration, resumable) and joint (GRPO every step, ACE every ``train.evolve_every``
steps); and the manifest settings of the modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import rlmix
from rlmix import checkpoint, cli, loop, manifest
from rlmix.policy import Policy, tiny_random
from rlmix.testing import skip_unless_installed

from .conftest import ROOT, read_jsonl

EXAMPLES = ROOT / "examples" / "harness"
GEPA = EXAMPLES / "gepa-arith.yaml"
ACE = EXAMPLES / "grpo-ace-arith.yaml"
TINY = ["model=tiny-random", "arith.eval_size=4", "arith.eval_max_new_tokens=6",
        "sampling.max_new_tokens=6", "log.progress=false", "log.plot=false"]


def needs(path: Path) -> None:
    skip_unless_installed(path)


def state_of(out: Path) -> dict:
    last = checkpoint.latest(out / "checkpoints")
    assert last is not None
    return torch.load(last / "state.pt", weights_only=False)


def test_harness_only_gepa_never_touches_the_weights_and_resumes(tmp_path, monkeypatch):
    needs(GEPA)

    def no_forward(*args, **kwargs):
        raise AssertionError("harness-only ran a training forward")

    monkeypatch.setattr(Policy, "logprobs", no_forward)
    out = tmp_path / "gepa"
    args = ["run", str(GEPA), *TINY, "gepa.max_new_tokens=6", "gepa.lm.max_new_tokens=12",
            "gepa.search_size=6", "gepa.selection_size=4", "gepa.minibatch_size=2",
            "gepa.budget=1000", "train.prompts_per_step=2", "train.checkpoint_every=1",
            "train.eval_every=0", f"out={out}"]
    assert cli.main([*args, "train.steps=2"]) == 0
    assert state_of(out)["gepa"]["iteration"] == 2
    assert cli.main([*args, "train.steps=4", "--resume"]) == 0
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["policy_version"] == 0 and r["loss"] == 0 for r in rows)
    calls = [r["gepa/metric_calls"] for r in rows]
    # seed on 4 selection tasks, then parent + child on a minibatch of 2 per iteration (the
    # tiny model never scores, so no child is accepted and none is scored in full)
    assert calls == [4 + 4, 4 + 8, 4 + 12, 4 + 16]
    state = state_of(out)["gepa"]
    assert state["iteration"] == 4 and len(state["history"]) == 4
    # the weights are exactly the starting ones
    model, _ = tiny_random()
    saved = checkpoint.latest(out / "checkpoints")
    checkpoint.load_weights(model, saved)
    start, _ = tiny_random()
    for (name, a), b in zip(model.state_dict().items(), start.state_dict().values()):
        assert torch.equal(a, b), name


def test_joint_grpo_and_ace_evolve_every_k_steps(tmp_path):
    needs(ACE)
    out = tmp_path / "ace"
    code = cli.main(["run", str(ACE), *TINY, "ace.max_new_tokens=6", "ace.lm.max_new_tokens=12",
                     "ace.check_size=2", "train.steps=4", "train.prompts_per_step=2",
                     "train.group_size=4", "train.eval_every=0", "train.checkpoint_every=0",
                     f"out={out}"])
    assert code == 0
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]  # RL every step
    assert all(r["ace/bullets"] >= 1 for r in rows)
    ace = state_of(out)["ace"]
    assert ace["steps"] == 2 and [e["step"] for e in ace["log"]] == [1, 3]  # evolve_every: 2
    # the starting bullet is rendered into the system prompt the env builds prompts from
    resolved = OmegaConf.load(out / "manifest.yaml")
    assert resolved.train.mode == "rl" and resolved.train.evolve_every == 2


class Rewriter:
    """An evolve plugin that appends the step to the instructions every time it is called."""

    calls: list[int] = []

    @rlmix.hookimpl
    def rlmix_evolve(self, run, batch):
        Rewriter.calls.append(run.step)
        return rlmix.HarnessUpdate(components={"instructions": f"v{run.step}"}, source="rw",
                                   parent_version=run.harness_version)


def test_evolve_every_and_versions_are_written(tmp_path):
    import rlmix_arith
    import rlmix_grpo
    import rlmix_hf

    Rewriter.calls = []
    run = loop.build_run(manifest.read(None, [
        "model=tiny-random", "plugins=[hf,arith,grpo,rw]", "train.evolve_every=3",
        "train.prompts_per_step=1", "train.group_size=2", "sampling.max_new_tokens=4",
        "arith.eval_size=0", f"out={tmp_path}", "harness.instructions=start"]),
        extra_plugins={"hf": rlmix_hf, "arith": rlmix_arith, "grpo": rlmix_grpo,
                       "rw": Rewriter()})
    for _ in range(7):
        loop.train_step(run)
    assert Rewriter.calls == [2, 5]
    assert run.harness["instructions"] == "v5" and run.harness_version == 2
    prompts = run.hook.rlmix_prompts(run=run, step=run.step)
    assert prompts[0].messages[-1]["content"].endswith("v5")
    versions = sorted((tmp_path / "harness").glob("v*.json"))
    assert [p.name for p in versions] == ["v0001.json", "v0002.json"]
    assert not list((tmp_path / "harness").glob("*.tmp"))


@pytest.mark.parametrize("override, match", [("train.mode=frozen", "train.mode"),
                                             ("train.evolve_every=0", "train.evolve_every")])
def test_mode_settings_are_checked(override, match):
    cfg = manifest.read(None, ["plugins=[hf]", override])
    with pytest.raises(rlmix.ManifestError, match=match):
        manifest.validate_core(cfg)


def test_routing_and_retrieval_wrappers_run_under_the_async_sampler(tmp_path):
    """A wrapper on rlmix_prompts that renders prompts under other harnesses (auto_harness's
    routing, live_evo's retrieval) runs inside the async worker, which already holds the
    sampler's pause lock: the lock must be re-entrant, or the run deadlocks."""
    import subprocess
    import sys

    from .conftest import cli_env

    runs = {
        "auto_harness": (EXAMPLES / "auto_harness-stream.yaml",
                         ["auto_harness.max_new_tokens=4", "auto_harness.lm.max_new_tokens=8",
                          "stream.eval_size=0"]),
        "live_evo": (EXAMPLES / "live_evo-arith.yaml",
                     ["live_evo.max_new_tokens=4", "arith.eval_size=0"]),
    }
    for name, (path, extra) in runs.items():
        needs(path)
        out = tmp_path / name
        args = [sys.executable, "-m", "rlmix", "run", str(path), "model=tiny-random",
                "train.steps=3", "train.prompts_per_step=2", "sampling.max_new_tokens=4",
                "train.max_staleness=1", "train.eval_every=0", "train.checkpoint_every=0",
                "log.progress=false", "log.plot=false", f"out={out}", *extra]
        try:
            done = subprocess.run(args, env=cli_env(), capture_output=True, text=True,
                                  timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} under train.max_staleness=1 did not finish in 180 s (deadlock)")
        assert done.returncode == 0, done.stderr[-2000:]
        rows = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
        assert [r["step"] for r in rows] == [1, 2, 3]
