"""The conformance kit (``rlmix_conformance``), ``rlmix plugins --check`` and
``pytest --rlmix-conformance`` (``rlmix new-plugin`` and the reference docs:
tests/test_new_plugin_kit.py).

Every installed plugin passes the quick check; deliberately broken plugins fail it with
messages that say what to fix.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import rlmix_conformance as conformance
import torch

import rlmix
from rlmix import cli, ops
from rlmix import plugins as plugin_loading
from rlmix.testing import standins
from rlmix.types import LossTerms, Prompt

INSTALLED = sorted(plugin_loading.installed())


# ---------------------------------------------------------------- every installed plugin


#: plugins that need an engine this machine cannot have: checked where it exists
NEEDS_ENGINE = {"vllm": "vllm"}


@pytest.mark.parametrize("name", INSTALLED)
def test_installed_plugin_passes_the_quick_check(name: str) -> None:
    import importlib.util

    engine = NEEDS_ENGINE.get(name)
    if engine and importlib.util.find_spec(engine) is None:
        pytest.skip(f"plugin '{name}' needs the '{engine}' package (and a CUDA GPU)")
    report = conformance.check_plugin(name)
    assert report.results, "no checks ran"
    assert report.ok, report.format()


def test_the_quick_check_covers_every_hook_a_plugin_implements() -> None:
    subject = conformance.Subject("all", _AllHooks)
    try:
        ids = {c.id for c in conformance.plan(subject, "quick")}
        full = {c.id for c in conformance.plan(subject, "full")}
    finally:
        subject.close()
    for hook in ("rlmix_advantage", "rlmix_clip", "rlmix_sample", "rlmix_generate",
                 "rlmix_prompts", "rlmix_score", "rlmix_evaluate", "rlmix_evolve",
                 "rlmix_update", "rlmix_token_logprobs"):
        assert any(i.startswith(hook + "/") for i in ids), hook
    assert {"plugin/settings", "plugin/configure", "plugin/step", "plugin/state"} <= ids
    assert {"plugin/resume", "rlmix_clip/split", "rlmix_update/accumulation"} <= full - ids


class _AllHooks:
    """Names every hook (the plan only looks at names and markers)."""

    for _hook in conformance.HOOKS:
        locals()[_hook] = rlmix.hookimpl(lambda run: None)
    del _hook


# ---------------------------------------------------------------- broken plugins


class WrongShapes:
    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):
        return torch.zeros(len(batch), 3)

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        return LossTerms(loss=logp[:, :5] * 0, mask=torch.ones(logp.shape[0], 5))


class NanOnEdges:
    @rlmix.hookimpl
    def rlmix_advantage(self, run, batch):  # no eps: 0 / 0 on a group that agrees
        centred = batch.rewards - ops.group_mean(batch.rewards, batch.group)
        return centred / ops.group_std(batch.rewards, batch.group)

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):  # a row's own count: 0 / 0 on an empty row
        mask = mb.batch.completion_mask
        per_row = (-(mb.batch.token_advantages() * logp) * mask).sum(-1, keepdim=True)
        per_row = per_row / mask.sum(-1, keepdim=True)
        return LossTerms(loss=per_row.expand_as(logp), mask=mask, mode="seq-mean-token-sum")


class LeakyMask:
    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):
        return LossTerms(loss=-mb.batch.token_advantages() * logp, mask=torch.ones_like(logp))


class LeakyExtra:
    """The masked loss is fine, but an entropy bonus in ``extra`` reads the prompt tokens."""

    @rlmix.hookimpl(wrapper=True)
    def rlmix_clip(self, run, mb, logp, entropy):
        terms = yield
        terms.extra = -0.01 * entropy.mean()
        return terms


class BadDefault:
    @dataclass
    class Settings:
        mode: str = "fast"

        def __post_init__(self) -> None:
            if self.mode not in ("exact", "approx"):
                raise ValueError(f"mode: {self.mode!r} is not one of exact, approx")


class NoDefault:
    @dataclass
    class Settings:
        beta: float


class NotADataclass:
    class Settings:
        beta = 0.1


class Typo:
    @rlmix.hookimpl
    def rlmix_advantages(self, run, batch):
        return batch.rewards


_calls = itertools.count()


class CountingPrompts:
    """Prompts from a module-level counter: a resumed run would see other prompts."""

    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        k = next(_calls)
        return [Prompt(messages=[{"role": "user", "content": f"task {k}-{i}"}], answer=i)
                for i in range(int(run.config.train.prompts_per_step))]


class NeverSkips:
    """An update that steps even on a NaN loss and forgets to bump the policy version."""

    @rlmix.hookimpl
    def rlmix_configure(self, run):
        run.optimizer = torch.optim.SGD(run.policy.model.parameters(), lr=0.1)

    @rlmix.hookimpl
    def rlmix_update(self, run, loss):
        loss.value.backward()
        for p in run.policy.model.parameters():
            if p.grad is not None:
                p.grad = torch.nan_to_num(p.grad, nan=1.0)
        run.optimizer.step()
        run.optimizer.zero_grad()
        return {}


def _failures(obj: object, name: str, level: str = "quick") -> dict[str, str]:
    report = conformance.check_plugin(name, obj, level)
    return {r.check: r.message for r in report.failures}


def test_wrong_shapes_are_named_with_the_expected_shape() -> None:
    failed = _failures(WrongShapes, "wrong_shapes")
    assert re.fullmatch(r"rlmix_advantage returned shape \(8, 3\); expected \(8,\) or "
                        r"\(8, (\d+)\) = \(len\(batch\),\) or batch\.tokens\.shape",
                        failed["rlmix_advantage/shape"]), failed["rlmix_advantage/shape"]
    width = re.search(r"\(8, (\d+)\) =", failed["rlmix_advantage/shape"]).group(1)
    assert failed["rlmix_clip/shape"] == (f"rlmix_clip returned loss of shape (8, 5); expected "
                                          f"(8, {width}) = mb.batch.tokens.shape")


def test_nan_on_edge_batches_names_the_case_and_the_fix() -> None:
    failed = _failures(NanOnEdges, "nan_on_edges")
    assert set(failed) == {"rlmix_advantage/edge", "rlmix_clip/edge"}, failed
    assert failed["rlmix_advantage/edge"].startswith(
        "rlmix_advantage returned NaN on a group of identical rewards (rows 0-3); guard the "
        "division by the group's std")
    clip = failed["rlmix_clip/edge"]
    assert clip.startswith("rlmix_clip gave a NaN loss on an empty completion row (row 1): the "
                           "per-token loss is NaN at row 1;"), clip
    assert "clamp counts to >= 1" in clip


def test_a_loss_that_reaches_prompt_tokens_fails_the_mask_check() -> None:
    failed = _failures(LeakyMask, "leaky_mask")
    assert list(failed) == ["rlmix_clip/mask"]
    assert re.match(r"rlmix_clip returned a mask that is nonzero at \d+ positions where "
                    r"completion_mask is 0 \(first: row 0, column 0\); prompt and padding "
                    r"tokens must not enter the loss", failed["rlmix_clip/mask"])
    failed = _failures(LeakyExtra, "leaky_extra")
    assert list(failed) == ["rlmix_clip/mask"]
    assert re.match(r"the gradient of rlmix_clip's aggregated loss w.r.t. entropy is nonzero at "
                    r"\d+ positions where completion_mask is 0 \(first: row 0, column 0\); mask "
                    r"every term of the loss, including terms added to LossTerms.extra",
                    failed["rlmix_clip/mask"])


def test_bad_settings_say_what_to_fix() -> None:
    failed = _failures(BadDefault, "bad_default")
    assert failed["plugin/settings"] == (
        "Settings() with its defaults is rejected: manifest error at 'bad_default.mode' (plugin "
        "'bad_default'): 'fast' is not one of exact, approx; make the defaults valid (they are "
        "what a manifest without a 'bad_default:' block runs with)")
    assert "plugin/configure" in failed and "plugin/step" not in failed  # skipped, not repeated
    assert _failures(NoDefault, "no_default")["plugin/settings"] == (
        "Settings field(s) beta have no default; every field needs one so the plugin runs when "
        "its manifest block is absent")
    assert _failures(NotADataclass, "not_a_dataclass") == {"plugin/settings": (
        "Settings is not a dataclass, so the core ignores it and any 'not_a_dataclass:' block "
        "is rejected; decorate it with @dataclasses.dataclass")}


def test_settings_check_rejects_a_wrong_type_and_an_unknown_key_through_the_validator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclass
    class Settings:
        beta: float = 0.1
        name: str = "x"

    class Fine:
        pass

    Fine.Settings = Settings  # type: ignore[attr-defined]
    assert "plugin/settings" not in _failures(Fine, "fine")
    # a validator that let everything through would be caught by both probes
    from rlmix import manifest

    real = manifest.validate_block

    def lenient(cls, block, prefix, owner=""):
        if isinstance(block, dict) and block:
            return cls()
        return real(cls, block, prefix, owner)

    monkeypatch.setattr(manifest, "validate_block", lenient)
    message = _failures(Fine, "fine")["plugin/settings"]
    assert message.startswith("an unknown key 'fine.kit_no_such_key' was accepted")


def test_hook_name_typos_and_resume_unsafe_prompts_fail() -> None:
    assert _failures(Typo, "typo") == {
        "plugin/registers": "rlmix_advantages is not an rlmix hook; did you mean "
                            "rlmix_advantage?"}
    message = _failures(CountingPrompts, "counting_prompts")["rlmix_prompts/resume"]
    assert message.startswith("rlmix_prompts is not deterministic: two fresh runs with "
                              "train.seed=0 give different prompts at step 0")


def test_an_update_that_steps_on_nan_and_keeps_the_version_fails() -> None:
    failed = _failures(NeverSkips, "never_skips")
    assert failed["rlmix_update/nan"].startswith("rlmix_update stepped on a NaN loss; when the "
                                                 "loss or the gradient is not finite, skip")
    assert "run.policy_version is 0; rlmix_update must increment it" in \
        failed["rlmix_update/step"]


def test_full_level_adds_split_invariance_and_resume() -> None:
    class PerMinibatchMean:  # normalises by the minibatch's own token count
        @rlmix.hookimpl
        def rlmix_clip(self, run, mb, logp, entropy):
            mask = mb.batch.completion_mask
            loss = -mb.batch.token_advantages() * logp * mask / mask.sum()
            return LossTerms(loss=loss * mb.normalizers.tokens, mask=mask)

    assert "rlmix_clip/split" not in _failures(PerMinibatchMean, "per_mb")
    failed = _failures(PerMinibatchMean, "per_mb", "full")
    assert failed["rlmix_clip/split"].startswith("splitting a minibatch in two changes the loss")


def test_stand_ins_are_consistent_and_deterministic() -> None:
    from rlmix.testing import make_run

    run = make_run(dict(standins.STANDINS), with_policy=True)
    batch = conformance.kit_batch(run)
    again = conformance.kit_batch(make_run(dict(standins.STANDINS), with_policy=True))
    assert torch.equal(batch.tokens, again.tokens)
    assert not conformance._batch_problems(batch, "kit")
    with torch.no_grad():
        logp, _ = run.policy.logprobs(run, batch)
    torch.testing.assert_close(logp * batch.completion_mask, batch.behavior_logp,
                               atol=1e-5, rtol=1e-5)
    assert len(set(batch.rewards.tolist())) > 1  # the fake env's rewards vary


# ---------------------------------------------------------------- the CLI and pytest entry


BROKEN_MODULE = '''
"""A deliberately broken plugin (NaN advantages on a group that agrees)."""
import rlmix
from rlmix import ops


@rlmix.hookimpl
def rlmix_advantage(run, batch):
    centred = batch.rewards - ops.group_mean(batch.rewards, batch.group)
    return centred / ops.group_std(batch.rewards, batch.group)
'''


def _install_broken(folder: Path) -> Path:
    """An importable module plus a dist-info that declares its entry point."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "broken_demo.py").write_text(BROKEN_MODULE)
    info = folder / "rlmix_broken_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlmix-broken-demo\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text("[rlmix.algorithms]\nbroken_demo = broken_demo\n")
    return folder


def _env_with(folder: Path) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    return env


def test_plugins_check_prints_a_table_and_exits_1_on_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(_install_broken(tmp_path)))  # entry points read sys.path
    monkeypatch.delitem(sys.modules, "broken_demo", raising=False)
    try:
        code = cli.main(["plugins", "--check", "grpo", "broken_demo"])
    finally:
        sys.modules.pop("broken_demo", None)
    out = capsys.readouterr().out
    assert code == 1, out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│").split("│")]
        if len(cells) == 6 and cells[1] in ("grpo", "broken_demo"):
            rows[cells[1]] = cells
    assert rows["grpo"][2] == "pass" and rows["broken_demo"][2] == "FAIL", out
    assert "FAIL rlmix_advantage/edge: rlmix_advantage returned NaN on a group of identical " \
           "rewards (rows 0-3)" in out
    assert out.strip().endswith("1 of 2 plugins pass; failing: broken_demo")


def test_plugins_check_json_and_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert cli.main(["plugins", "--check", "rloo", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["name"] == "rloo" and row["ok"]
    assert {c["check"] for c in row["checks"]} >= {"plugin/settings", "rlmix_advantage/edge"}
    assert cli.main(["plugins", "--check", "grpoo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlmix: error: plugins --check: no installed plugin named 'grpoo' "
                          "(did you mean 'grpo'?)") and "\n" not in err


def test_pytest_option_collects_the_kit_for_the_named_plugins(tmp_path: Path) -> None:
    folder = _install_broken(tmp_path / "site")
    work = tmp_path / "work"
    work.mkdir()
    # a test file in the folder pytest runs in: without paths on the command line, only the
    # kit's module is collected, so this never runs
    (work / "test_unrelated.py").write_text("def test_unrelated():\n    assert False\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf",
         "--rlmix-conformance", "rloo", "--rlmix-conformance", "broken_demo",
         "--rlmix-conformance-level", "quick"],
        cwd=work, capture_output=True, text=True, env=_env_with(folder), timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "test_unrelated" not in out
    assert "FAILED" in out and "test_conformance[broken_demo:rlmix_advantage/edge]" in out
    assert "rlmix_advantage returned NaN on a group of identical rewards (rows 0-3)" in out
    summary = out.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert "1 failed" in summary and passed >= 10, summary  # rloo's checks and the rest
