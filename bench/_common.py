"""What the benches that train SmolLM2 for a time budget share (``envs_learn.py``,
``harness_real.py``): the tiny model's plumbing overrides, a clock that counts wall or CPU
seconds, and training steps until the budget is spent. Imported from the bench folder
(``python bench/x.py`` puts it first on the path; ``rlmix.testing.load_script`` does the
same)."""

from __future__ import annotations

import sys
import time
from typing import Any


def tiny_plumbing(env: str, tokens: int) -> list[str]:
    """Overrides for ``--model tiny-random`` (plumbing, not learning): short samples and
    evaluations of the env ``env``, two prompts of two rollouts a step, no bf16."""
    return ["policy.autocast=none", f"sampling.max_new_tokens={tokens}",
            f"{env}.eval_max_new_tokens={tokens}", "train.prompts_per_step=2",
            "train.group_size=2"]


class Clock:
    """What a budget counts: wall seconds, or this process's CPU seconds (``cpu``: fairer
    when the machine's load changes between two runs, each run on one thread)."""

    def __init__(self, kind: str = "wall") -> None:
        if kind not in ("wall", "cpu"):
            raise ValueError(f"clock: wall or cpu, not {kind!r}")
        self.kind = kind
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

    def wall(self) -> float:
        return time.perf_counter() - self.wall0

    def cpu(self) -> float:
        return time.process_time() - self.cpu0

    def spent(self) -> float:
        return self.cpu() if self.kind == "cpu" else self.wall()


def train_for(run: Any, budget_s: float, label: str, verbose: bool = False,
              clock: str = "wall", started: Clock | None = None,
              rewards: list[float] | None = None) -> dict[str, Any]:
    """Training steps until ``budget_s`` of the clock is spent (counted from ``started``
    when the budget is shared with earlier phases) or the manifest's ``train.steps`` is
    reached; the steps, wall and CPU seconds, and the mean reward in five blocks."""
    from rlmix import loop

    rewards = [] if rewards is None else rewards
    c = started or Clock(clock)
    while run.step < int(run.config.train.steps) and c.spent() < budget_s:
        m = loop.train_step(run)
        rewards.append(float(m["reward/mean"]))
        if verbose:
            print(f"[{label}] step {run.step}: reward {rewards[-1]:.3f} "
                  f"({m['time/step_s']:.1f} s; {c.wall():.0f} s wall, {c.cpu():.0f} s CPU)",
                  file=sys.stderr, flush=True)
    block = max(1, len(rewards) // 5)
    return {"steps": run.step, "train_wall_s": round(c.wall(), 1),
            "train_cpu_s": round(c.cpu(), 1), "clock": c.kind,
            "reward_curve": [round(sum(rewards[i:i + block]) / len(rewards[i:i + block]), 3)
                             for i in range(0, len(rewards), block)]}
