"""AgentPRM: process-reward targets from Monte Carlo continuations, a small reward head trained on
them, and its score as a reward term.

* ``rlmix_sample`` wrapper: for ``mc_rows`` rows of the step's batch, every step prefix (the
  completion cut after each ``step_separator``, at most ``max_steps``) is continued
  ``mc_rollouts`` times; a prefix's target is the share of its continuations that succeed (the
  core's reward above ``threshold``). The head (logistic regression on hashed character-trigram
  features of the step text, in ``run.state["agent_prm"]``) takes ``head_epochs`` SGD passes over
  the new (step, target) pairs.
* ``rlmix_score``: the term ``prm``, the head's score of a row's steps, aggregated by
  ``aggregate`` (mean, min or last).

Continuations need an engine that can resume a partial completion. By default the plugin samples
them from ``run.policy`` with the core's sampling loop (``rlmix.sampling.sample_tokens``); an env or
engine can put its own function in ``run.plugin_resources("agent_prm")["continue"]``:
``fn(run, prompt, prefix_text, n) -> list[str]`` (the continuation texts).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

import rlmix
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "agent_prm"
AGGREGATES = ("min", "mean", "last")


@dataclass
class Settings:
    step_separator: str = "\n"  # a completion's steps are separated by this
    max_steps: int = 4  # prefixes continued per row at most (the first ones)
    mc_rows: int = 2  # rows per training step whose prefixes get Monte Carlo targets
    mc_rollouts: int = 4  # continuations per prefix
    threshold: float = 0.5  # a continuation succeeds when its reward is above this
    feature_dim: int = 1024  # hashed trigram features of a step
    head_lr: float = 1.0  # SGD step size of the head
    head_epochs: int = 20  # passes over each step's new targets
    aggregate: str = "min"  # how step scores make a row's reward: min | mean | last

    def __post_init__(self) -> None:
        if not self.step_separator:
            raise ValueError("step_separator must not be empty")
        if self.max_steps < 1 or self.mc_rollouts < 1 or self.head_epochs < 0:
            raise ValueError("max_steps and mc_rollouts must be >= 1, head_epochs >= 0")
        if self.mc_rows < 0:
            raise ValueError(f"mc_rows must be >= 0, got {self.mc_rows}")
        if self.feature_dim < 8:
            raise ValueError(f"feature_dim must be >= 8, got {self.feature_dim}")
        if self.head_lr < 0:
            raise ValueError(f"head_lr must be >= 0, got {self.head_lr}")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {', '.join(AGGREGATES)}, got "
                             f"{self.aggregate!r}")


def split_steps(text: str, sep: str) -> list[str]:
    """The non-empty steps of a completion (separator stripped)."""
    return [s for s in text.split(sep) if s.strip()]


def step_prefixes(text: str, sep: str, max_steps: int) -> list[str]:
    """The completion cut after each of its first ``max_steps`` steps (separator kept, so a
    continuation starts a new step); the last prefix of a row with no more steps is the whole
    text."""
    parts = text.split(sep)
    out, acc = [], ""
    for i, part in enumerate(parts):
        acc += part + (sep if i < len(parts) - 1 else "")
        if part.strip():
            out.append(acc)
        if len(out) == max_steps:
            break
    return out


def mc_targets(successes: list[list[float]]) -> list[float]:
    """Each prefix's target: the mean success of its continuations."""
    return [sum(s) / len(s) if s else 0.0 for s in successes]


def features(texts: list[str], dim: int) -> torch.Tensor:
    """``[n, dim]``: hashed character-trigram counts, unit length (a stable hash)."""
    out = torch.zeros(len(texts), dim)
    for i, text in enumerate(texts):
        padded = f"  {text.lower()} "
        for j in range(len(padded) - 2):
            out[i, zlib.crc32(padded[j:j + 3].encode()) % dim] += 1.0
    return out / out.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def head_scores(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The head's score in (0, 1) of each feature row (``w``: ``[dim + 1]``, last = bias)."""
    return torch.sigmoid(x @ w[:-1] + w[-1])


def train_head(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, lr: float,
               epochs: int) -> torch.Tensor:
    """Full-batch gradient descent on the cross-entropy against soft targets ``y`` in [0, 1]."""
    w = w.clone()
    xb = torch.cat([x, torch.ones(len(x), 1)], 1)
    for _ in range(epochs):
        p = torch.sigmoid(xb @ w)
        w -= lr * xb.T @ (p - y.float()) / max(len(y), 1)
    return w


def aggregate_scores(scores: torch.Tensor, how: str) -> float:
    if len(scores) == 0:
        return 0.0
    if how == "min":
        return float(scores.min())
    if how == "last":
        return float(scores[-1])
    return float(scores.mean())


def _state(run: Run, dim: int) -> dict[str, Any]:
    state = run.state.setdefault(NAME, {"rollouts": 0, "mc_rollouts": 0, "targets": 0})
    if state.get("w") is None or state["w"].shape[0] != dim + 1:
        state["w"] = torch.zeros(dim + 1)
    return state


def _policy_continue(run: Run, prompt: Prompt, prefix: str, n: int) -> list[str]:
    """``n`` continuations of ``prefix`` sampled from the policy (the hf engine's sampler)."""
    from rlmix.sampling import sample_tokens, stop_token_ids

    policy = run.policy
    if policy is None:
        raise RuntimeError("agent_prm: no policy to continue prefixes with; put a function in "
                           "run.plugin_resources('agent_prm')['continue']")
    tok = policy.tokenizer
    enc = tok([policy.chat_text(prompt.messages) + prefix], return_tensors="pt",
              add_special_tokens=False)
    smp = run.config.sampling
    comp, mask, _ = sample_tokens(
        policy.model, enc["input_ids"].to(policy.device), enc["attention_mask"].to(policy.device),
        n, int(smp.max_new_tokens), float(smp.temperature), float(smp.top_p), int(smp.top_k),
        stop_token_ids(policy), int(tok.pad_token_id or 0), autocast=policy.autocast())
    return [tok.decode(row[m.bool()].tolist(), skip_special_tokens=True)
            for row, m in zip(comp.cpu(), mask.cpu())]


def _success(run: Run, prompt: Prompt, texts: list[str], threshold: float) -> list[float]:
    """Score full completions with every scorer (only texts and prompts are meaningful)."""
    from rlmix.loop import score

    n = len(texts)
    stub = RolloutBatch(group=torch.zeros(n, dtype=torch.long),
                        tokens=torch.zeros(n, 1, dtype=torch.long),
                        attention_mask=torch.ones(n, 1, dtype=torch.long),
                        completion_mask=torch.zeros(n, 1), behavior_logp=torch.zeros(n, 1),
                        policy_version=torch.zeros(n, dtype=torch.long), texts=list(texts),
                        prompts=[prompt] * n)
    score(run, stub)
    assert stub.rewards is not None
    rewards = stub.rewards
    own = stub.reward_terms.get(f"{NAME}.prm")
    if own is not None:  # success is the task's reward, not the head's own opinion
        from omegaconf import OmegaConf

        from rlmix.loop import _flatten

        weights = _flatten(OmegaConf.to_container(run.config.score.weights) or {})
        rewards = rewards - float(weights.get(f"{NAME}.prm", 1.0)) * own
    return (rewards > threshold).float().tolist()


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    _state(run, run.settings(NAME).feature_dim)


@rlmix.hookimpl(wrapper=True)
def rlmix_sample(run: Run, prompts: list[Prompt]
                 ) -> Generator[None, RolloutBatch, RolloutBatch]:
    batch = yield
    s: Settings = run.settings(NAME)
    state = _state(run, s.feature_dim)
    state["rollouts"] += len(batch)
    cont: Callable[..., list[str]] = run.plugin_resources(NAME).get("continue", _policy_continue)
    rows = []  # the first row of each group, then the next ones, up to mc_rows
    for i in sorted(range(len(batch)), key=lambda i: (sum(
            1 for j in range(i) if batch.group[j] == batch.group[i]), i)):
        if len(rows) >= s.mc_rows:
            break
        rows.append(i)
    rows.sort()
    steps, successes = [], []
    spent = 0
    for i in rows:
        prompt, text = batch.prompts[i], batch.texts[i]
        for prefix in step_prefixes(text, s.step_separator, s.max_steps):
            tails = cont(run, prompt, prefix, s.mc_rollouts)
            spent += len(tails)
            successes.append(_success(run, prompt, [prefix + t for t in tails], s.threshold))
            steps.append(split_steps(prefix, s.step_separator)[-1])
    targets = mc_targets(successes)
    if steps:
        state["w"] = train_head(state["w"], features(steps, s.feature_dim),
                                torch.tensor(targets), s.head_lr, s.head_epochs)
    state["mc_rollouts"] += spent
    state["targets"] += len(targets)
    run.plugin_resources(NAME)["last_targets"] = list(zip(steps, targets))
    stats = {
        "agent_prm/mc_rollouts": float(spent), "agent_prm/targets": float(len(targets)),
        "agent_prm/target_mean": sum(targets) / len(targets) if targets else 0.0}
    for key, value in stats.items():  # written with the step's metrics
        run.log(key, value)
    return batch


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    s: Settings = run.settings(NAME)
    w = _state(run, s.feature_dim)["w"]
    out = []
    for text in batch.texts:
        steps = split_steps(text, s.step_separator)[: max(s.max_steps, 1) * 4]
        sc = head_scores(w, features(steps, s.feature_dim)) if steps else torch.zeros(0)
        out.append(aggregate_scores(sc, s.aggregate))
    return {"prm": torch.tensor(out)}
