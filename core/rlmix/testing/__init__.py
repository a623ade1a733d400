"""Fixtures and helpers for testing rlmix plugins (a pytest plugin, entry point ``pytest11``).

Fixtures: ``tiny_model`` (a random Llama and byte tokenizer, built in-process), ``tiny_batch``
(a small ``RolloutBatch``), ``fake_run`` (a factory of ``Run`` objects with chosen plugins),
``toy_policy`` (a tabular policy on which an advantage and a loss run hundreds of steps in
seconds).

``rlmix.testing.conformance`` is the conformance kit (``check_plugin(name)``: the contract of
every hook a plugin implements); ``rlmix.testing.standins`` holds the stand-in plugins it
registers before the plugin under test (a fake env, a fake rollout, a simple algorithm).
``pytest --rlmix-conformance NAME`` runs the kit on an installed plugin as pytest items.
"""

from __future__ import annotations

from collections.abc import Callable
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
              norm_constant: float | None = None) -> list[float]:
    """Train ``policy`` with the run's ``rlmix_advantage`` and ``rlmix_clip`` owners; returns the
    mean reward of every step's samples."""
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    history = []
    for step in range(steps):
        run.step = step
        batch = policy.sample(n_prompts, group_size, lengths)
        batch.rewards = reward_fn(batch).float()
        history.append(float(batch.rewards.mean()))
        batch.advantages = run.hook.rlmix_advantage(run=run, batch=batch)
        logp, entropy = policy.logprobs(batch)
        normalizers = Normalizers(tokens=float(batch.completion_mask.sum().clamp(min=1)),
                                  sequences=float(len(batch)),
                                  norm_constant=float(norm_constant or policy.length))
        mb = Minibatch(batch=batch, normalizers=normalizers)
        terms = run.hook.rlmix_clip(run=run, mb=mb, logp=logp, entropy=entropy)
        loss = ops.aggregate_loss(terms.loss, terms.mask, terms.mode, normalizers)
        if terms.extra is not None:
            loss = loss + terms.extra
        opt.zero_grad()
        loss.backward()
        opt.step()
    return history


@pytest.fixture
def tiny_model() -> tuple[Any, Any]:
    """``(model, tokenizer)``: a random two-layer Llama and a byte-level tokenizer."""
    from rlmix.policy import tiny_random

    return tiny_random()


@pytest.fixture
def tiny_batch() -> RolloutBatch:
    """Two groups of four samples, ragged completions, binary rewards."""
    return make_batch()


@pytest.fixture
def fake_run() -> Callable[..., Run]:
    """Factory: ``fake_run({"grpo": rlmix_grpo}, ["grpo.beta=0.1"])`` -> ``Run``."""
    return make_run


@pytest.fixture
def toy_policy() -> ToyPolicy:
    """A fresh ``ToyPolicy(vocab=6, length=4)``; train it with ``rlmix.testing.toy_train``."""
    return ToyPolicy()


# ---------------------------------------------------------------- pytest --rlmix-conformance NAME


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rlmix", "rlmix plugin conformance")
    group.addoption("--rlmix-conformance", action="append", default=[], metavar="NAME",
                    help="run the rlmix conformance kit against the installed plugin NAME "
                         "(repeat for several)")
    group.addoption("--rlmix-conformance-level", choices=("quick", "full"), default="full",
                    help="quick: the checks of 'rlmix plugins --check'; full (default): also "
                         "seeded re-runs, minibatch splits, accumulation and a resume")


def pytest_configure(config: pytest.Config) -> None:
    """With ``--rlmix-conformance``, collect the kit's parametrized test module (its file name
    does not start with ``test_``; pytest collects a file named on the command line whatever its
    name). Without other paths on the command line, it is the only thing collected."""
    if not config.getoption("rlmix_conformance", default=None):
        return
    from pathlib import Path

    suite = str(Path(__file__).with_name("conformance_suite.py"))
    source = getattr(config, "args_source", None)
    explicit = source is not None and source == pytest.Config.ArgsSource.ARGS
    if explicit:
        if suite not in config.args:
            config.args.append(suite)
    else:
        config.args = [suite]
