"""ELPO (Error-Localized Policy Optimization): for a failed trajectory, a binary search over its
step prefixes finds the first irrecoverable step (a prefix is recoverable when a continuation
sampled from it can still succeed); the advantage is attributed by that step (scaled down on
the recoverable prefix, up on the critical step and its suffix), and the critical step's tokens
get a wider clip range.

A wrapper on the advantage owner (``grpo``) runs the searches and returns per-token advantages;
the owner of ``rlmix_clip`` here is the PPO surrogate with per-token bounds. Continuations are
asked of the rollout engine with ``Prompt.info["continue_from"]`` (the prefix's token ids);
an engine that ignores it is detected and reported. Probe rollouts are counted in
``run.state["elpo"]["rollouts"]``."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

import rlmix
from rlmix import distill, ops, sampling
from rlmix.types import LOSS_MODES, LossTerms, Minibatch, Prompt, RolloutBatch, Run

NAME = "elpo"
CRITICAL = "elpo.critical"  # batch.extras: 1.0 on the critical step's tokens


@dataclass
class Settings:
    success_threshold: float = 1.0  # reward >= this: success
    continuations: int = 2  # rollouts per probe; a prefix is recoverable if one succeeds
    max_searches: int = 4  # failed trajectories searched per step; 0 = all
    prefix_scale: float = 0.5  # advantage scale before the critical step
    critical_scale: float = 1.5  # on the critical step and after it
    eps_low: float = 0.2
    eps_high: float = 0.2
    critical_eps_low: float = 0.3  # the wider clip on the critical step's tokens
    critical_eps_high: float = 0.4
    step_delimiter: str = "\n"  # a step ends at a token containing it; "" = one token a step
    loss_mode: str = "seq-mean-token-mean"
    old_logp: str = "auto"

    def __post_init__(self) -> None:
        rlmix.check_choices(self, loss_mode=LOSS_MODES, old_logp=ops.OLD_LOGP_CHOICES)
        if self.continuations < 1 or self.max_searches < 0:
            raise ValueError("continuations must be >= 1 and max_searches >= 0")
        if self.prefix_scale < 0 or self.critical_scale < 0:
            raise ValueError("prefix_scale and critical_scale must be >= 0")
        for low in (self.eps_low, self.critical_eps_low):
            if not 0 <= low < 1:
                raise ValueError("eps_low and critical_eps_low must be in [0, 1)")
        if self.eps_high < 0 or self.critical_eps_high < 0:
            raise ValueError("eps_high and critical_eps_high must be >= 0")


def first_irrecoverable(recoverable: Callable[[int], bool], steps: int) -> tuple[int, int]:
    """``(critical step, probes)`` by binary search. ``recoverable(j)``: whether the prefix of
    the first ``j`` steps can still succeed; the empty prefix is taken as recoverable and the
    whole failed trajectory as not, so with a monotone oracle the result is the step whose
    inclusion first makes the prefix irrecoverable, in at most ``ceil(log2 steps)`` probes."""
    lo, hi, probes = 0, steps, 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        probes += 1
        if recoverable(mid):
            lo = mid
        else:
            hi = mid
    return hi - 1, probes


def linear_scan(recoverable: Callable[[int], bool], steps: int) -> tuple[int, int]:
    """The same answer by scanning prefixes 1, 2, ...: up to ``steps`` probes."""
    for j in range(1, steps + 1):
        if not recoverable(j):
            return j - 1, j
    return steps - 1, steps


def token_steps(batch: RolloutBatch, tokenizer: object | None, delimiter: str) -> torch.Tensor:
    """``[N, T]`` step index of every completion token (-1 elsewhere): a step ends after a
    token whose text contains ``delimiter``; with no delimiter (or no tokenizer) every token is
    a step."""
    mask = batch.completion_mask > 0
    steps = torch.full(batch.tokens.shape, -1, dtype=torch.long)
    for i in range(len(batch)):
        current = 0
        for col in mask[i].nonzero().flatten().tolist():
            steps[i, col] = current
            if not delimiter or tokenizer is None:
                current += 1
            elif delimiter in tokenizer.decode([int(batch.tokens[i, col])]):
                current += 1
    return steps


def localized_advantage(advantages: torch.Tensor, steps: torch.Tensor, critical: torch.Tensor,
                        prefix_scale: float, critical_scale: float) -> torch.Tensor:
    """Per-token advantages: rows with a critical step (``critical >= 0``) are scaled by
    ``prefix_scale`` before it and ``critical_scale`` from it on; other rows unchanged."""
    searched = (critical >= 0)[:, None]
    before = steps < critical[:, None]
    scale = torch.where(before, torch.tensor(prefix_scale), torch.tensor(critical_scale))
    return torch.where(searched, advantages * scale, advantages)


def localized_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        critical: torch.Tensor, s: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's surrogate (``rlmix.ops.clipped_surrogate``) with the wider bounds on the
    ``critical`` tokens."""
    crit = critical > 0
    low = torch.where(crit, torch.tensor(s.critical_eps_low), torch.tensor(s.eps_low))
    high = torch.where(crit, torch.tensor(s.critical_eps_high), torch.tensor(s.eps_high))
    return ops.clipped_surrogate(logp, old_logp, advantages, low.to(logp.device),
                                 high.to(logp.device))


def probe(run: Run, prompt: Prompt, prefix: list[int], s: Settings) -> bool:
    """Whether one of ``s.continuations`` continuations from ``prefix`` succeeds."""
    cont = Prompt(messages=prompt.messages, answer=prompt.answer, id=prompt.id,
                  info={**prompt.info, "continue_from": list(prefix)})
    batch = sampling.generate(run, [cont], s.continuations)
    state = run.state.setdefault(NAME, {})
    state["rollouts"] = state.get("rollouts", 0) + len(batch)
    first = distill.first_completion_column(batch)
    if prefix and batch.tokens[:, first:first + len(prefix)].tolist() != [prefix] * len(batch):
        raise RuntimeError("elpo: the rollout engine ignored Prompt.info['continue_from']; ELPO "
                           "needs an engine that continues a completion from given tokens")
    return bool((sampling.score(run, batch) >= s.success_threshold).any())


def search_failures(run: Run, batch: RolloutBatch, s: Settings, steps: torch.Tensor
                    ) -> torch.Tensor:
    """The critical step of each searched failed row (-1 for the others)."""
    assert batch.rewards is not None
    critical = torch.full((len(batch),), -1, dtype=torch.long)
    failed = (batch.rewards < s.success_threshold).nonzero().flatten().tolist()
    for row in failed[:s.max_searches] if s.max_searches else failed:
        count = int(steps[row].max()) + 1
        if count < 1:
            continue
        cols = (batch.completion_mask[row] > 0).nonzero().flatten()
        tokens = batch.tokens[row]

        def recoverable(j: int, row: int = row, cols: torch.Tensor = cols,
                        tokens: torch.Tensor = tokens) -> bool:
            keep = cols[steps[row, cols] < j]
            return probe(run, batch.prompts[row], tokens[keep].tolist(), s)

        critical[row] = first_irrecoverable(recoverable, count)[0]
    return critical


@rlmix.hookimpl(wrapper=True)
def rlmix_advantage(run: Run, batch: RolloutBatch
                    ) -> Generator[None, torch.Tensor | None, torch.Tensor | None]:
    advantages = yield
    if advantages is None:
        return None
    s = run.settings(NAME)
    steps = token_steps(batch, run.tokenizer, s.step_delimiter)
    critical = search_failures(run, batch, s, steps)
    token_adv = (advantages[:, None].expand_as(batch.completion_mask).clone()
                 if advantages.dim() == 1 else advantages)
    batch.extras[CRITICAL] = ((steps == critical[:, None]) & (critical[:, None] >= 0)).float()
    run.log(f"{NAME}/searched", float((critical >= 0).sum()))
    return localized_advantage(token_adv, steps, critical, s.prefix_scale, s.critical_scale)


@rlmix.hookimpl
def rlmix_clip(run: Run, mb: Minibatch, logp: torch.Tensor, entropy: torch.Tensor
               ) -> LossTerms:
    s = run.settings(NAME)
    batch = mb.batch
    mask = batch.completion_mask.to(logp.device)
    old = ops.old_logprobs(run, batch, logp, s.old_logp)
    critical = batch.extras.get(CRITICAL, torch.zeros_like(batch.completion_mask))
    loss, clipped = localized_surrogate(logp, old, batch.token_advantages().to(logp.device),
                                        critical.to(logp.device), s)
    return LossTerms(loss=loss, mask=mask, mode=s.loss_mode, metrics={
        "clip/fraction": float(ops.masked_mean(clipped.float(), mask))})
