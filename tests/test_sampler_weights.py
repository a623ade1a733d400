"""rlmix.sampler_weights: a plugin's sampler copy is what training rollouts generate with (the
master is what evaluation uses), it is refreshed once whenever policy_version moved, a malformed
copy is refused; and policy.lm_head_autocast runs the LM head's matmul in bf16 (TRL's
bf16=True), log-softmax in fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import rlmix
from rlmix import loop
from rlmix.policy import Policy, plain_token_logprobs, tiny_random
from rlmix.sampler_weights import REFRESH_METRIC, SamplerWeights
from rlmix.testing import make_run
from rlmix.testing.standins import FakeEnv, FakeRollout, SimpleAlgorithm

torch.set_num_threads(1)


class Recorder:
    """An engine that notes which model each call saw, then answers as FakeRollout does."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.inner = FakeRollout()

    @rlmix.hookimpl
    def rlmix_generate(self, run: Any, request: Any) -> Any:
        self.seen.append(run.policy.model)
        return self.inner.rlmix_generate(run=run, request=request)


class CountingCopy(SamplerWeights):
    refreshes = 0

    def refresh(self, master: Any) -> None:
        CountingCopy.refreshes += 1
        super().refresh(master)


class GivesCopy:
    def __init__(self, weights: Any = None) -> None:
        self.weights = weights

    @rlmix.hookimpl
    def rlmix_sampler_weights(self, run: Any, master: Any) -> Any:
        return self.weights if self.weights is not None else CountingCopy(master)


def _run(tmp_path: Path, giver: Any, recorder: Recorder) -> Any:
    run = make_run({"kit_env": FakeEnv(), "rec": recorder, "kit_algo": SimpleAlgorithm(),
                    "copy": giver},
                   ["train.prompts_per_step=2", "train.group_size=2", "sampling.max_new_tokens=4",
                    f"out={tmp_path}", "train.eval_every=0", "train.checkpoint_every=0",
                    "log.plot=false", "train.lr=0.05"], with_policy=True)
    loop.configure(run)
    loop.prepare_model(run)
    return run


def test_rollouts_use_the_copy_and_it_is_refreshed_when_the_version_moves(tmp_path: Path) -> None:
    recorder = Recorder()
    CountingCopy.refreshes = 0
    run = _run(tmp_path, GivesCopy(), recorder)
    weights = run.sampler_weights
    assert isinstance(weights, CountingCopy) and weights.version == 0
    assert weights.model is not run.policy.model
    loop.train_step(run)
    assert recorder.seen[-1] is weights.model  # the training rollout
    assert CountingCopy.refreshes == 0  # built at version 0: nothing to refresh yet
    run.generate(run.hook.rlmix_prompts(run=run, step=0))
    assert recorder.seen[-1] is run.policy.model  # evaluation-style generation: the master
    after_one = [p.detach().clone() for p in run.policy.model.parameters()]
    metrics = loop.train_step(run)  # version 1 now: one refresh before sampling
    assert CountingCopy.refreshes == 1 and weights.version == 1
    assert metrics[REFRESH_METRIC] >= 0
    for a, b in zip(weights.model.parameters(), after_one):  # the weights of version 1
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(after_one, run.policy.model.parameters()))


class ReleasingCopy(CountingCopy):
    """A copy that frees itself after each rollout when ``frees`` (and says so)."""

    def __init__(self, master: Any, frees: bool) -> None:
        super().__init__(master)
        self.frees, self.released, self.releases = frees, False, 0

    def release(self) -> bool:
        self.releases += 1
        self.released = self.frees
        return self.frees

    def refresh(self, master: Any) -> None:
        super().refresh(master)
        self.released = False


class LoadedCheck(Recorder):
    """Fails a rollout on a released copy (as a copy whose weights were freed would)."""

    @rlmix.hookimpl
    def rlmix_generate(self, run: Any, request: Any) -> Any:
        weights = run.resources.get("copy_under_test")
        assert not (weights is not None and run.policy.model is weights.model
                    and weights.released), "sampled with a released copy"
        return super().rlmix_generate(run=run, request=request)


@pytest.mark.parametrize("frees", [True, False])
def test_a_copy_that_releases_after_each_rollout_is_rebuilt_before_the_next(
        tmp_path: Path, frees: bool) -> None:
    master_stub, _ = tiny_random()
    recorder = LoadedCheck()
    copy = ReleasingCopy(master_stub, frees)
    run = _run(tmp_path, GivesCopy(copy), recorder)
    run.resources["copy_under_test"] = copy
    copy.refresh(run.policy.model)  # built from another tiny model: load the run's master
    CountingCopy.refreshes = 0
    for step in range(3):
        loop.train_step(run)
        assert recorder.seen[-1] is copy.model and copy.releases == step + 1
        # released: marked stale; kept: it holds the weights it sampled with (version step)
        assert copy.released == frees and copy.version == (-1 if frees else step)
    assert CountingCopy.refreshes == 2  # before the rollouts of steps 1 and 2
    # two rollouts at one version: a released copy is rebuilt for the second, a kept one not
    prompts = run.hook.rlmix_prompts(run=run, step=run.step)
    run.sample(prompts)
    run.sample(prompts)
    assert CountingCopy.refreshes == (4 if frees else 3)
    run.generate(run.hook.rlmix_prompts(run=run, step=0))
    assert recorder.seen[-1] is run.policy.model  # evaluation never touches the copy


def test_a_rollout_that_fails_still_releases_the_copy(tmp_path: Path) -> None:
    master_stub, _ = tiny_random()
    copy = ReleasingCopy(master_stub, True)

    class Fails:
        @rlmix.hookimpl
        def rlmix_generate(self, run: Any, request: Any) -> Any:
            raise RuntimeError("engine down")

    run = _run(tmp_path, GivesCopy(copy), Fails())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="engine down"):
        run.sample(run.hook.rlmix_prompts(run=run, step=0))
    assert copy.releases == 1 and copy.version == -1


def test_a_copy_without_refresh_is_refused(tmp_path: Path) -> None:
    class NoRefresh:
        model = None

    with pytest.raises(Exception, match=r"no 'refresh'"):
        _run(tmp_path, GivesCopy(NoRefresh()), Recorder())


def test_the_lm_head_in_the_autocast_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(40, 16, generator=g))
    hidden = torch.randn(2, 3, 16, generator=g)
    labels = torch.randint(0, 40, (2, 3), generator=g)
    fp32, _ = plain_token_logprobs(hidden, head, labels)
    bf16, _ = plain_token_logprobs(hidden, head, labels, matmul_dtype=torch.bfloat16)
    logits = torch.nn.functional.linear(hidden.bfloat16(), head.weight.bfloat16()).float()
    want = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(bf16, want)
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, fp32)
    assert (bf16 - fp32).abs().max() < 0.2
    model, tok = tiny_random()
    assert Policy(model, tok, autocast="bfloat16", lm_head_autocast=True).lm_head_dtype \
        == torch.bfloat16
    assert Policy(model, tok, autocast="none", lm_head_autocast=True).lm_head_dtype is None
    assert Policy(model, tok, autocast="bfloat16").lm_head_dtype is None
