"""Tests of the Ray rollout plugin: how workers rebuild the manifest's plugins (pure), and (slow,
one local Ray instance on 127.0.0.1 for the module) two workers fill a batch with the manifest's
plugins running in the actors, weights reach the workers after an update, and killing a worker
mid-call still completes the batch and the step."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import rlmix_ray
import torch
from rlmix_ray import build_plugin, plugin_spec, split, worker_manifest

import rlmix
from rlmix import loop
from rlmix.testing import make_run
from rlmix.testing.standins import SimpleAlgorithm

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import ray_probe  # noqa: E402

PROMPTS, GROUP = 4, 3


# ---------------------------------------------------------------- pure pieces


def test_plugin_specs_rebuild_the_same_objects():
    assert plugin_spec("ray", rlmix_ray, {"ray": "rlmix_ray"}) == ("entry", "ray")
    spec = plugin_spec("probe", ray_probe.ProbeEnv(), {})
    assert spec == ("instance", "ray_probe", "ProbeEnv")
    assert isinstance(build_plugin(spec), ray_probe.ProbeEnv)
    assert build_plugin(plugin_spec("m", ray_probe, {})) is ray_probe
    assert build_plugin(plugin_spec("c", ray_probe.ProbeEnv, {})) is ray_probe.ProbeEnv
    # an installed name whose registered object is something else is rebuilt from the object
    assert plugin_spec("ray", ray_probe, {"ray": "rlmix_ray"}) == ("module", "ray_probe")


def test_local_classes_cannot_travel_to_workers():
    class Inline:
        pass

    with pytest.raises(rlmix.ConfigError, match="define it in an importable module"):
        plugin_spec("inline", Inline(), {})


def test_worker_manifest_keeps_only_the_worker_plugins_and_their_blocks():
    config = {"plugins": ["hf", "arith", "dapo.clip_higher", "dapo.overlong", "deepspeed", "ray"],
              "hf": {"batch_size": 2}, "deepspeed": {"stage": 3}, "ray": {"workers": 4},
              "dapo": {"clip_higher": {"eps_high": 0.3}, "overlong": {"max": 5}},
              "policy": {"threads": 0}, "log": {"progress": True}, "out": "runs/x"}
    got = worker_manifest(config, ["hf", "arith", "dapo.clip_higher"], threads=1)
    assert got["plugins"] == ["hf", "arith", "dapo.clip_higher"]
    assert "deepspeed" not in got and "ray" not in got
    assert got["dapo"] == {"clip_higher": {"eps_high": 0.3}} and got["hf"] == {"batch_size": 2}
    assert got["policy"]["threads"] == 1 and got["log"]["progress"] is False
    assert got["out"] != "runs/x"
    assert config["dapo"]["overlong"] == {"max": 5}  # the driver's manifest is untouched


def test_split_is_contiguous_and_never_empty():
    assert split(5, 2) == [(0, 3), (3, 5)]
    assert split(1, 4) == [(0, 1)]
    assert split(0, 2) == []


@pytest.mark.parametrize("override, word", [("ray.workers=0", "workers"),
                                            ("ray.timeout_s=0", "timeout_s"),
                                            ("ray.max_restarts=-1", "max_restarts")])
def test_bad_settings_fail_naming_the_setting(override, word):
    with pytest.raises(rlmix.ManifestError, match=word):
        make_run({"ray": rlmix_ray}, [override])


# ---------------------------------------------------------------- on a local Ray instance


@pytest.fixture(scope="module")
def run():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # left running by another module: ours needs its own runtime env
        ray.shutdown()
    path = os.pathsep.join([str(HERE), *(p for p in sys.path if p and os.path.isdir(p))])
    ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False,
             _node_ip_address="127.0.0.1", configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    try:
        plugins = {"probe_env": ray_probe.ProbeEnv, "probe_rollout": ray_probe.ProbeRollout,
                   "algo": SimpleAlgorithm, "ray": rlmix_ray}
        r = make_run(plugins, [f"train.prompts_per_step={PROMPTS}", f"train.group_size={GROUP}",
                               "sampling.max_new_tokens=4", "train.lr=0.05",
                               "probe_rollout.delay_s=1.0", "ray.workers=2",
                               "ray.cpus_per_worker=1", "policy.threads=1"],
                     with_policy=True)
        loop.configure(r)
        yield r
        rlmix_ray.shutdown(r)
    finally:
        ray.shutdown()


def _prompts(run):
    return run.hook.rlmix_prompts(run=run, step=run.step)


@pytest.mark.slow
def test_two_workers_fill_the_batch_with_the_manifest_plugins(run):
    prompts = _prompts(run)
    with torch.no_grad():
        batch = run.sample(prompts)
    assert len(batch) == PROMPTS * GROUP
    assert [p.id for p in batch.prompts] == [p.id for p in prompts for _ in range(GROUP)]
    assert batch.group.tolist() == [i for i in range(PROMPTS) for _ in range(GROUP)]
    pids = {info["pid"] for info in batch.info}
    actors = {info["actor"] for info in batch.info}
    # the manifest's rollout plugin ran in two actor processes, not in the driver
    assert len(pids) == 2 and os.getpid() not in pids and None not in actors
    assert batch.completion_mask.sum() == PROMPTS * GROUP * 4


@pytest.mark.slow
def test_weights_reach_the_workers_after_an_update(run):
    before = run.policy_version
    metrics = loop.train_step(run)
    assert run.policy_version == before + 1 and metrics["policy_version"] == before + 1
    driver_sum = float(sum(p.detach().double().sum() for p in run.policy.model.parameters()))
    with torch.no_grad():
        batch = run.sample(_prompts(run))
    for info in batch.info:
        assert info["version"] == run.policy_version
        assert info["weight_sum"] == pytest.approx(driver_sum, rel=0, abs=1e-9)
    assert (batch.policy_version == run.policy_version).all()


def _kill_soon(victim, after=0.4):
    import ray

    timer = threading.Timer(after, lambda: ray.kill(victim, no_restart=True))
    timer.start()
    return timer


@pytest.mark.slow
def test_a_worker_killed_mid_call_is_replaced_and_its_prompts_resampled(run):
    import ray

    pool = run.plugin_resources("ray")["pool"]
    old = ray.get([w.where.remote() for w in pool.workers])
    replaced = pool.replaced
    timer = _kill_soon(pool.workers[0])
    try:
        with torch.no_grad():
            batch = run.sample(_prompts(run))
    finally:
        timer.join()
    assert pool.replaced == replaced + 1
    new = ray.get([w.where.remote() for w in pool.workers])
    assert new[0]["pid"] != old[0]["pid"] and new[1]["pid"] == old[1]["pid"]
    assert new[0]["plugins"] == ["probe_env", "probe_rollout", "algo"]
    # nothing lost: every prompt's group is complete, the dead worker's share came from its
    # replacement, with the current weights
    assert len(batch) == PROMPTS * GROUP
    assert batch.group.tolist() == [i for i in range(PROMPTS) for _ in range(GROUP)]
    assert {info["pid"] for info in batch.info} == {new[0]["pid"], new[1]["pid"]}
    assert all(info["version"] == run.policy_version for info in batch.info)


@pytest.mark.slow
def test_a_step_completes_when_a_worker_dies_during_it(run):
    pool = run.plugin_resources("ray")["pool"]
    replaced, before = pool.replaced, run.policy_version
    timer = _kill_soon(pool.workers[1])
    try:
        metrics = loop.train_step(run)
    finally:
        timer.join()
    assert pool.replaced == replaced + 1
    assert run.policy_version == before + 1
    assert metrics["response_length/mean"] == 4.0
    # the step trained a full batch
    assert run.plugin_resources("probe_env")["scored"][-1] == PROMPTS * GROUP


@pytest.mark.slow
def test_workers_score_their_rows_once_and_the_driver_scores_none(run, tmp_path):
    """``ray.score: true``: every generated row is scored exactly once per step, in the worker
    that generated it (the scorer appends "<pid> <rows>" to a file from any process), and the
    driver's ``loop.score`` keeps those terms instead of scoring again."""
    count = tmp_path / "scored.txt"
    plugins = {"probe_env": ray_probe.ProbeEnv, "probe_rollout": ray_probe.ProbeRollout,
               "algo": SimpleAlgorithm, "ray": rlmix_ray}
    # cpus_per_worker=0: the module's run holds the instance's two CPUs with its own workers
    scoring = make_run(plugins, [f"train.prompts_per_step={PROMPTS}", f"train.group_size={GROUP}",
                                 "sampling.max_new_tokens=4", "ray.workers=2", "ray.score=true",
                                 "ray.cpus_per_worker=0", "policy.threads=1",
                                 f"probe_env.count_file={count}"], with_policy=True)
    loop.configure(scoring)
    try:
        for _ in range(2):
            count.write_text("")
            on_driver = len(scoring.plugin_resources("probe_env").get("scored", []))
            metrics = loop.train_step(scoring)
            calls = [tuple(map(int, line.split())) for line in count.read_text().splitlines()]
            assert sum(rows for _, rows in calls) == PROMPTS * GROUP  # each row once
            assert sorted(rows for _, rows in calls) == [GROUP * PROMPTS // 2] * 2  # per worker
            assert os.getpid() not in {pid for pid, _ in calls}
            assert len({pid for pid, _ in calls}) == 2
            # none on the driver
            assert len(scoring.plugin_resources("probe_env").get("scored", [])) == on_driver
            assert metrics["reward/mean"] == pytest.approx(metrics["reward/probe_env.even"])
    finally:
        rlmix_ray.shutdown(scoring)
