"""``rlmix_configure`` runs in manifest order (it ran reversed), then ``rlmix_prepare_model``
(the trainer's phase) after every configure and, on resume, after the checkpoint's weights are
back: a reference copy taken in configure is a copy of the full model, and a plugin that wraps
the model sees the restored weights."""

from __future__ import annotations

import torch

import rlmix
from rlmix import checkpoint, loop, manifest
from rlmix.policy import frozen_copy
from rlmix.testing import make_run, standins

CALLS: list[str] = []


class Recorder:
    def __init__(self, name: str) -> None:
        self.name = name

    @rlmix.hookimpl
    def rlmix_configure(self, run):
        CALLS.append(f"configure:{self.name}")

    @rlmix.hookimpl
    def rlmix_prepare_model(self, run):
        CALLS.append(f"prepare:{self.name}")


def test_configure_runs_in_manifest_order_then_prepare_model():
    CALLS.clear()
    run = make_run({"b": Recorder("b"), "a": Recorder("a"), "c": Recorder("c")})
    loop.configure(run)
    loop.prepare_model(run)
    assert CALLS == ["configure:b", "configure:a", "configure:c",
                     "prepare:b", "prepare:a", "prepare:c"]


class Reference:
    """Takes a reference copy in configure, as grpo and kl do."""

    @rlmix.hookimpl
    def rlmix_configure(self, run):
        run.plugin_resources("reference")["model"] = frozen_copy(run.policy.model)


class Partitioner:
    """Stands in for a ZeRO-3 trainer: in rlmix_prepare_model it records the weights it wraps and
    empties every parameter, as partitioning leaves a rank with an empty shard."""

    @rlmix.hookimpl
    def rlmix_prepare_model(self, run):
        model = run.policy.model
        run.plugin_resources("partitioner")["wrapped"] = {
            k: v.detach().clone() for k, v in model.named_parameters()}
        for p in model.parameters():
            p.data = torch.empty(0)


def _manifest(out, steps=1):
    names = ",".join([*standins.STANDINS, "reference", "partitioner"])
    return manifest.read(None, [
        "model=tiny-random", f"plugins=[{names}]", f"out={out}",
        "log.progress=false", "log.plot=false", f"train.steps={steps}",
        "train.eval_every=0", "policy.threads=1"])


def test_reference_copies_are_full_and_resume_restores_before_the_model_is_wrapped(tmp_path):
    plugins = {**{k: v() for k, v in standins.STANDINS.items()}, "reference": Reference(),
               "partitioner": Partitioner()}
    base = loop.prepare(_manifest(tmp_path), extra_plugins=plugins, required={})[0]
    loop.load_policy(base)
    # a checkpoint with weights that differ from the base model's
    with torch.no_grad():
        for p in base.policy.model.parameters():
            p.add_(0.5)
    base.step = 1
    saved = {k: v.detach().clone() for k, v in base.policy.model.named_parameters()}
    checkpoint.save(base)

    run = loop.build_run(_manifest(tmp_path), extra_plugins=plugins, resume=True)
    assert run.step == 1
    reference = run.plugin_resources("reference")["model"]
    assert all(p.numel() > 0 for p in reference.parameters())  # taken before "partitioning"
    wrapped = run.plugin_resources("partitioner")["wrapped"]
    for name, value in saved.items():  # the trainer wrapped the restored weights
        torch.testing.assert_close(wrapped[name], value, rtol=0, atol=0)
    assert all(p.numel() == 0 for p in run.policy.model.parameters())


class Late:
    @rlmix.hookimpl(trylast=True)
    def rlmix_configure(self, run):
        CALLS.append("configure:late")


class Early:
    @rlmix.hookimpl(tryfirst=True)
    def rlmix_configure(self, run):
        CALLS.append("configure:early")


def test_tryfirst_and_trylast_keep_their_meaning_within_manifest_order():
    CALLS.clear()
    run = make_run({"late": Late(), "b": Recorder("b"), "early": Early(), "a": Recorder("a")})
    loop.configure(run)
    assert CALLS == ["configure:early", "configure:b", "configure:a", "configure:late"]


class BadPrepare:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    @rlmix.hookimpl
    def rlmix_prepare_model(self, run):
        raise self.exc


def test_a_prepare_model_failure_is_named_like_a_configure_failure():
    """``rlmix_prepare_model`` failures are named as ``rlmix_configure``'s are: plugin and hook
    from the exception's mark, a ConfigError stays a ManifestError."""
    import pytest

    run = make_run({"ok": Recorder("ok"), "bad": BadPrepare(ValueError("no room"))})
    with pytest.raises(rlmix.PluginError, match=r"plugin 'bad' failed in rlmix_prepare_model: "
                                                r"ValueError: no room"):
        loop.prepare_model(run)
    run = make_run({"bad": BadPrepare(rlmix.ConfigError("bad.stage: 4 is not a stage"))})
    with pytest.raises(rlmix.ManifestError, match=r"plugin 'bad' failed in "
                                                  r"rlmix_prepare_model: bad.stage: 4"):
        loop.prepare_model(run)
