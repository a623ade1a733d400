"""``train.optimizer_in_backward``: each parameter stepped inside the backward, its gradient
freed at once. The same update as stepping after the backward (no clipping, one backward per
update), and never the full set of gradients alive at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rlmix
from rlmix import loop, manifest
from rlmix.defaults import IN_BACKWARD
from rlmix.errors import ConfigError
from rlmix.types import LossTerms, Run

from .conftest import EXAMPLE, TINY


class LikelihoodLoss:
    """Owns rlmix_clip (after grpo): minus the log-likelihood, so every step has a gradient
    (tiny-random's rewards are often all equal, which gives GRPO's loss none)."""

    @rlmix.hookimpl
    def rlmix_clip(self, run, mb, logp, entropy):  # noqa: ANN001, ANN201
        return LossTerms(loss=-logp, mask=mb.batch.completion_mask, mode="token-mean")


def _run(tmp_path: Path, *overrides: str) -> Run:
    cfg = manifest.read(EXAMPLE, [*TINY, f"out={tmp_path}", "plugins=[hf,arith,grpo,nll]",
                                  "train.prompts_per_step=2", "train.group_size=4",
                                  "train.lr=0.01", "train.max_grad_norm=0",
                                  "train.updates_per_epoch=2", *overrides])
    return loop.build_run(cfg, extra_plugins={"nll": LikelihoodLoss})


def _weights(run: Run) -> dict[str, torch.Tensor]:
    assert run.policy is not None
    return {k: v.detach().clone() for k, v in run.policy.model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_same_update_as_stepping_after_the_backward(tmp_path: Path, checkpointing: bool) -> None:
    # one run after the other: sampling draws from torch's global generator, which each
    # build_run seeds, so interleaving the two runs' steps would give them different samples
    ckpt = f"policy.gradient_checkpointing={str(checkpointing).lower()}"
    usual = _run(tmp_path / "usual", ckpt)
    start = _weights(usual)
    m_usual = [loop.train_step(usual) for _ in range(2)]
    inside = _run(tmp_path / "inside", "train.optimizer_in_backward=true", ckpt)
    for k, v in _weights(inside).items():
        assert torch.equal(start[k], v), k  # same seed, same initial weights
    m_inside = [loop.train_step(inside) for _ in range(2)]
    moved = 0
    for (k, a), b in zip(_weights(usual).items(), _weights(inside).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
        moved += int(not torch.equal(a, start[k]))
    assert moved > len(start) // 2  # the comparison is not between two unchanged models
    assert inside.policy_version == usual.policy_version == 4  # 2 steps x 2 updates
    for a, b in zip(m_usual, m_inside, strict=True):
        assert a["update/grad_norm"] == pytest.approx(b["update/grad_norm"], rel=1e-4)
    # the optimizer state is the usual one (checkpoints save and load it unchanged)
    s_usual, s_inside = usual.optimizer.state_dict(), inside.optimizer.state_dict()
    assert s_usual["state"].keys() == s_inside["state"].keys()
    for i, st in s_usual["state"].items():
        torch.testing.assert_close(st["exp_avg_sq"], s_inside["state"][i]["exp_avg_sq"],
                                   rtol=1e-4, atol=1e-10)


def test_gradients_never_all_alive(tmp_path: Path) -> None:
    run = _run(tmp_path, "train.optimizer_in_backward=true")
    params = [p for p in run.policy.model.parameters() if p.requires_grad]
    alive: list[int] = []
    probes = [p.register_post_accumulate_grad_hook(
        lambda _p: alive.append(sum(q.grad is not None for q in params))) for p in params]
    loop.train_step(run)
    for h in probes:
        h.remove()
    assert alive and max(alive) <= 2  # this one (and at most one whose hook runs next)
    assert all(p.grad is None for p in params)


def test_backward_outside_the_update_does_not_step(tmp_path: Path) -> None:
    run = _run(tmp_path, "train.optimizer_in_backward=true")
    before = _weights(run)
    model = run.policy.model
    ids = torch.tensor([[1, 2, 3, 4]])
    model(input_ids=ids).logits.sum().backward()
    for k, v in _weights(run).items():
        assert torch.equal(before[k], v), k
    assert any(p.grad is not None for p in model.parameters())  # gradients left as usual


def test_non_finite_loss_skips_the_step(tmp_path: Path) -> None:
    run = _run(tmp_path, "train.optimizer_in_backward=true")
    stepper = run.plugin_resources("rlmix.defaults")[IN_BACKWARD]
    before = _weights(run)
    stats = run.hook.rlmix_update(run=run, loss=_nan_loss(run))
    assert stats["update/skipped"] == 1.0 and stepper.stepped == 0
    for k, v in _weights(run).items():
        assert torch.equal(before[k], v), k


def _nan_loss(run: Run) -> LossTerms:
    p = next(run.policy.model.parameters())
    z = torch.zeros(1, 1)
    return LossTerms(loss=z, mask=z, value=p.sum() * float("nan"))


@pytest.mark.parametrize(("override", "needle"), [
    ("train.max_grad_norm=1.0", "max_grad_norm: 0"),
    ("train.grad_accum=2", "grad_accum: 1"),
])
def test_settings_it_cannot_honour_are_refused(tmp_path: Path, override: str,
                                               needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _run(tmp_path, "train.optimizer_in_backward=true", override)
