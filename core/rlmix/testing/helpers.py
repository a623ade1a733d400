"""The helpers ``rlmix.testing`` re-exports (``make_batch``, ``make_run``, ``ToyPolicy``,
``toy_train``, ``skip_unless_installed``, ``load_script``, ``example_resumes``). They import torch;
``rlmix.testing`` itself, the pytest plugin every pytest run loads, imports this module only
when a test asks for one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from rlmix import manifest, ops
from rlmix.types import Minibatch, Normalizers, RolloutBatch, Run


def make_batch(n_groups: int = 2, group_size: int = 4, prompt_len: int = 3,
               completion_len: int = 5, vocab: int = 32, seed: int = 0,
               rewards: torch.Tensor | None = None) -> RolloutBatch:
    """A random batch with ragged completions (each row ends at a random length >= 1)."""
    g = torch.Generator().manual_seed(seed)
    n = n_groups * group_size
    width = prompt_len + completion_len
    tokens = torch.randint(0, vocab, (n, width), generator=g)
    lengths = torch.randint(1, completion_len + 1, (n,), generator=g)
    cmask = torch.zeros(n, width)
    for i, length in enumerate(lengths.tolist()):
        cmask[i, prompt_len:prompt_len + length] = 1.0
    attn = torch.ones(n, width, dtype=torch.long)
    attn[:, prompt_len:] = cmask[:, prompt_len:].long()
    behavior = -torch.rand(n, width, generator=g) * 3 * cmask
    if rewards is None:
        rewards = torch.randint(0, 2, (n,), generator=g).float()
    return RolloutBatch(group=torch.arange(n_groups).repeat_interleave(group_size),
                        tokens=tokens, attention_mask=attn, completion_mask=cmask,
                        behavior_logp=behavior, policy_version=torch.zeros(n, dtype=torch.long),
                        texts=[""] * n, rewards=rewards)


def make_run(plugins: dict[str, Any] | None = None, overrides: list[str] | None = None,
             model: str = "tiny-random", with_policy: bool = False) -> Run:
    """A ``Run`` with in-process plugins (``{name: module_or_object}``) registered through the
    real loading path, with no required-hook check. ``overrides`` are manifest dotlist items."""
    from rlmix import loop

    plugins = plugins or {}
    names = list(plugins)
    cfg = manifest.read(None, [f"model={model}", f"plugins=[{','.join(names)}]",
                               "log.progress=false", *(overrides or [])])
    if not names:
        cfg.plugins = []
    run, _ = loop.prepare(cfg, extra_plugins=plugins, required={}) if names else \
        _bare_run(cfg)
    if with_policy:
        loop.load_policy(run)
    return run


def load_script(path: str | Path, name: str | None = None) -> ModuleType:
    """A Python file that is not an installed module (a ``bench/`` script, a generated test
    file) imported from its path, under ``name`` (default: the file's stem). Its folder is
    first on ``sys.path`` while it loads, as when ``python path`` runs it, so it can import
    its neighbours (``bench/_common.py``)."""
    import importlib.util
    import sys

    path = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def skip_unless_installed(manifest_path: Any) -> None:
    """Skip the calling test when a plugin the manifest lists is not installed (a plugin's
    tests run alone with the core in ``nox -s isolated``; its example manifest may name others,
    such as the ``hf`` rollout engine)."""
    from omegaconf import OmegaConf

    from rlmix import plugins as plugin_loading

    wanted = list(OmegaConf.load(manifest_path).plugins)
    missing = sorted(set(wanted) - set(plugin_loading.installed()))
    if missing:
        pytest.skip(f"plugins not installed: {', '.join(missing)}")


def example_resumes(example: Any, out: Any, plugin: str, overrides: list[str] = (),
                    env: str = "arith", eval_size: int = 2, tokens: int = 4,
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run a plugin's example manifest (on the tiny model) for 1 step with a checkpoint, resume
    it to 2, and check that steps 1 and 2 are each logged once. ``env``'s evaluation and the
    samples are cut to ``eval_size`` problems and ``tokens`` new tokens. Returns the training
    rows and the last checkpoint's saved state. Skips when the manifest names a plugin that is
    not installed."""
    import json

    from omegaconf import OmegaConf

    from rlmix import checkpoint, cli

    skip_unless_installed(example)
    cfg = OmegaConf.load(example)
    assert cfg.model == "tiny-random" and plugin in cfg.plugins
    args = ["run", str(example), f"{env}.eval_size={eval_size}",
            f"{env}.eval_max_new_tokens={tokens}", f"sampling.max_new_tokens={tokens}",
            "log.progress=false", "log.plot=false", "train.prompts_per_step=2",
            "train.eval_every=0", "train.checkpoint_every=1", f"out={out}", *overrides]
    assert cli.main([*args, "train.steps=1"]) == 0
    assert cli.main([*args, "train.steps=2", "--resume"]) == 0
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    state = torch.load(checkpoint.latest(Path(out) / "checkpoints") / "state.pt",
                       weights_only=False)
    return rows, state


def harness_example_resumes(example: Any, out: Any, overrides: list[str], metric: str,
                            max_calls: float) -> list[dict[str, Any]]:
    """Run a harness plugin's example manifest on the tiny model for 2 steps, resume it to 3,
    and check what every such example must show: steps 1, 2, 3 each logged once, the weights
    never changed (``policy_version`` 0), and the plugin's call counter ``metric`` never going
    back and staying within ``max_calls``. Returns the training rows. Skips when the manifest
    names a plugin that is not installed."""
    import json

    from rlmix import cli

    skip_unless_installed(example)
    args = ["run", str(example), "model=tiny-random", "train.prompts_per_step=2",
            "train.eval_every=0", "train.checkpoint_every=1", "arith.eval_size=2",
            "sampling.max_new_tokens=4", "log.progress=false", "log.plot=false", f"out={out}",
            *overrides]
    assert cli.main([*args, "train.steps=2"]) == 0
    assert cli.main([*args, "train.steps=3", "--resume"]) == 0
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["policy_version"] == 0 for r in rows)
    calls = [r[metric] for r in rows]
    assert calls == sorted(calls) and calls[-1] <= max_calls
    return rows


def _bare_run(cfg: Any) -> tuple[Run, list[Any]]:
    from pathlib import Path

    from rlmix import plugins as plugin_loading

    core = manifest.validate_block(manifest.CoreConfig, {k: cfg[k] for k in manifest.CORE_KEYS
                                                         if k in cfg}, "", "")
    pm = plugin_loading.new_plugin_manager()
    plugin_loading.register(pm, [])
    resolved = manifest.resolved(cfg, core, {})
    return Run(config=resolved, pm=pm, settings_by_plugin={}, out_dir=Path("runs/test")), []


class ToyPolicy(torch.nn.Module):
    """A tabular policy over ``length`` independent positions of a ``vocab``-sized alphabet.

    Each "completion" is ``length`` tokens after a one-token prompt; ``logits[t]`` is position
    ``t``'s distribution. It is tiny enough that an advantage estimator and a policy loss run
    hundreds of optimisation steps in a second, and its optimum is known, so a plugin's claim
    (faster learning, robustness to outliers, no length bias, ...) can be shown on it."""

    def __init__(self, vocab: int = 6, length: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.vocab, self.length = vocab, length
        self.logits = torch.nn.Parameter(torch.zeros(length, vocab))
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def sample(self, n_prompts: int, group_size: int,
               lengths: Callable[[torch.Tensor], torch.Tensor] | None = None) -> RolloutBatch:
        n = n_prompts * group_size
        probs = torch.softmax(self.logits, -1)
        draws = torch.multinomial(probs.repeat(n, 1), 1, generator=self.generator).view(n, -1)
        tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), draws], 1)
        cmask = torch.cat([torch.zeros(n, 1), torch.ones(n, self.length)], 1)
        if lengths is not None:  # optional ragged completions: row i keeps lengths(draws)[i]
            keep = lengths(draws)
            cmask[:, 1:] = (torch.arange(self.length)[None] < keep[:, None]).float()
        logp = torch.log_softmax(self.logits, -1)
        behavior = torch.cat([torch.zeros(n, 1), logp.gather(-1, draws.T).T], 1) * cmask
        return RolloutBatch(group=torch.arange(n_prompts).repeat_interleave(group_size),
                            tokens=tokens, attention_mask=torch.ones(n, self.length + 1,
                                                                     dtype=torch.long),
                            completion_mask=cmask, behavior_logp=behavior,
                            policy_version=torch.zeros(n, dtype=torch.long), texts=[""] * n)

    def logprobs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logp_table = torch.log_softmax(self.logits, -1)
        draws = batch.tokens[:, 1:]
        logp = logp_table.gather(-1, draws.T).T
        entropy = -(logp_table.exp() * logp_table).sum(-1).expand_as(logp)
        zero = torch.zeros(len(batch), 1)
        return torch.cat([zero, logp], 1), torch.cat([zero, entropy], 1)


def toy_train(run: Run, policy: ToyPolicy, reward_fn: Callable[[RolloutBatch], torch.Tensor],
              steps: int = 200, lr: float = 0.1, n_prompts: int = 4, group_size: int = 8,
              lengths: Callable[[torch.Tensor], torch.Tensor] | None = None,
              norm_constant: float | None = None, *, epochs: int = 1,
              optimizer: str = "adam",
              advantage: Callable[[RolloutBatch], torch.Tensor] | None = None,
              update_metrics: list[dict[str, Any]] | None = None) -> list[float]:
    """Train ``policy`` with the run's ``rlmix_advantage`` (or ``advantage(batch)``) and
    ``rlmix_clip`` owners, ``epochs`` updates per batch (the ratio against the sampler's
    log-probs drifts from 1 after the first, so a clip can bind), with Adam or SGD
    (``optimizer``); returns the mean reward of every step's samples. ``update_metrics``, when
    given, receives every update's ``LossTerms.metrics``."""
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer: adam or sgd, not {optimizer!r}")
    opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)(
        policy.parameters(), lr=lr)
    history = []
    for step in range(steps):
        run.step = step
        batch = policy.sample(n_prompts, group_size, lengths)
        batch.rewards = reward_fn(batch).float()
        history.append(float(batch.rewards.mean()))
        batch.advantages = (advantage(batch) if advantage is not None
                            else run.hook.rlmix_advantage(run=run, batch=batch))
        normalizers = Normalizers(tokens=float(batch.completion_mask.sum().clamp(min=1)),
                                  sequences=float(len(batch)),
                                  norm_constant=float(norm_constant or policy.length))
        mb = Minibatch(batch=batch, normalizers=normalizers)
        for _ in range(epochs):
            logp, entropy = policy.logprobs(batch)
            terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
            if update_metrics is not None:
                update_metrics.append(dict(terms.metrics))
            loss = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, normalizers)
            if terms.extra is not None:
                loss = loss + terms.extra
            opt.zero_grad()
            loss.backward()
            opt.step()
    return history
