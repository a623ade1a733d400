"""Second attempts at two null claims of issue 27, on toys where the papers' mechanisms should
matter more than on the ones asserted in the plugins' tests (exploratory, not asserted).

    OMP_NUM_THREADS=1 python bench/credit_nulls.py elpo          # about 3 minutes
    OMP_NUM_THREADS=1 python bench/credit_nulls.py aepo          # about 2 minutes
    OMP_NUM_THREADS=1 python bench/credit_nulls.py aepo-noisy    # about 2 minutes

``elpo``: a shared-parameter doom world. Logits at completion position ``t`` of prompt ``p``
are ``bias + W[type(p, t)]`` (two types, shared across prompts and positions); 8 prompts of 32
steps, 8 of them "trap" steps where token 3 is fatal (an irrecoverable step), elsewhere token 3
is harmless; success 0.03 at the start. GRPO, ELPO as shipped, and ELPO whose probe
continuations are also trained on (``tree``: each continuation's suffix with the local
advantage ``r - mean(r of its siblings and the failed original)``, the prefix masked), 4
prompts x 8 rollouts a step, AdamW lr 0.05; printed: rollouts (probes counted) until the
exact success reaches 0.9, per seed.

``aepo``: the tests' several-good-answers toy (``ToyPolicy`` 4 x 6, three equally good
tokens) with 4 or 8 epochs per batch (the ratio against the sampler's log-probs, so the clip
can bind); PPO, AEPO, AEPO without the advantage shaping, and a one-sided variant (the rescue
only on positive advantages, as clip-higher); printed per seed: the last 20 steps' reward,
the table's entropy at step 200 and the mean clip fraction.

``aepo-noisy`` (a third attempt): the same toy, but each rollout is paid 1 with probability
equal to its share of good tokens (a noisy verifier), so advantages do not vanish once the bad
tokens are gone and the clip keeps acting on the good ones; 6 tokens with 3 good, and 32 with
16 good (token 0 favoured at the start in both); 4 epochs per batch under Adam. Printed per
seed: the table's probability mass on good tokens and its entropy at step 200, and the mean
clip fraction.
"""

from __future__ import annotations

import sys
from dataclasses import fields

import rlmix_aepo
import rlmix_elpo
import rlmix_grpo
import torch

import rlmix
from rlmix import loop, sampling
from rlmix.testing import ToyPolicy, make_run, toy_train
from rlmix.testing.privileged import (
    PrivilegedToyPolicy,
    PrivilegedToyWorld,
    prompt_index,
    toy_world_run,
)
from rlmix.types import Prompt, RolloutBatch

FATAL = 3


class FeaturePolicy(PrivilegedToyPolicy):
    """``logits[p, t] = bias + w[types[p, t]]``."""

    def __init__(self, types: torch.Tensor, init_w: torch.Tensor, seed: int = 0) -> None:
        super().__init__(types.shape[0], types.shape[1], init_w.shape[1], seed=seed)
        self.types = types
        self.w = torch.nn.Parameter(init_w.clone())
        self.bias = torch.nn.Parameter(torch.zeros(init_w.shape[1]))

    def table(self, indices, messages):  # noqa: ANN001, ANN201
        return self.bias + self.w[self.types[torch.tensor(indices)]]


class TrapWorld(PrivilegedToyWorld):
    def correct(self, batch: RolloutBatch) -> torch.Tensor:
        idx = torch.tensor([prompt_index(p) for p in batch.prompts])
        trap = self.policy.types[idx] == 0
        return (~((batch.tokens[:, 1:] == FATAL) & trap).any(-1)).float()

    def success(self) -> float:
        with torch.no_grad():
            pol = self.policy
            fatal = torch.softmax(pol.table(list(range(pol.n_prompts)), None), -1)[..., FATAL]
            safe = torch.where(pol.types == 0, 1 - fatal, torch.ones_like(fatal))
            return float(safe.prod(-1).mean())


def trap_world(seed: int, prompts: int = 8, length: int = 32, traps: int = 8) -> TrapWorld:
    g = torch.Generator().manual_seed(100 + seed)
    types = torch.ones(prompts, length, dtype=torch.long)
    for p in range(prompts):
        types[p, torch.randperm(length, generator=g)[:traps]] = 0
    w = torch.zeros(2, 4)
    w[0, FATAL] = 0.5
    return TrapWorld(FeaturePolicy(types, w, seed=seed), torch.zeros(prompts, length).long())


# ELPO with its probe continuations trained on: the shipped probe, keeping its batch
def _probe_keeping(run, prompt, prefix, s):  # noqa: ANN001, ANN202
    cont = Prompt(messages=prompt.messages, answer=prompt.answer, id=prompt.id,
                  info={**prompt.info, "continue_from": list(prefix)})
    batch = sampling.generate(run, [cont], s.continuations)
    state = run.state.setdefault("elpo", {})
    state["rollouts"] = state.get("rollouts", 0) + len(batch)
    rewards = sampling.score(run, batch)
    state.setdefault("probes", []).append((batch, len(prefix)))
    return bool((rewards >= s.success_threshold).any())


@rlmix.hookimpl(wrapper=True)
def _tree_advantage(run, batch):  # noqa: ANN001, ANN202
    advantages = yield
    s = run.settings("elpo")
    run.state.setdefault("elpo", {})["probes"] = []
    steps = rlmix_elpo.token_steps(batch, None, "")
    critical = rlmix_elpo.search_failures(run, batch, s, steps)
    tok = rlmix_elpo.localized_advantage(advantages[:, None].expand_as(steps).clone(), steps,
                                         critical, s.prefix_scale, s.critical_scale)
    batch.extras[rlmix_elpo.CRITICAL] = ((steps == critical[:, None])
                                         & (critical[:, None] >= 0)).float()
    extra, extra_adv = [], []
    for probe, plen in run.state["elpo"]["probes"]:
        local = probe.rewards - torch.cat([probe.rewards, torch.zeros(1)]).mean()
        probe.completion_mask[:, 1:1 + plen] = 0
        probe.extras[rlmix_elpo.CRITICAL] = torch.zeros_like(probe.completion_mask)
        extra.append(probe)
        extra_adv.append(local[:, None] * probe.completion_mask)
    if extra:
        merged = RolloutBatch.concat([batch, *extra])
        for f in fields(batch):
            setattr(batch, f.name, getattr(merged, f.name))
        tok = torch.cat([tok, *extra_adv])
    return tok


def elpo_run(variant: str, overrides: list[str], seed: int, budget: int = 2500
             ) -> int | None:
    shipped = (rlmix_elpo.probe, rlmix_elpo.rlmix_advantage)
    if variant == "tree":
        rlmix_elpo.probe, rlmix_elpo.rlmix_advantage = _probe_keeping, _tree_advantage
    try:
        torch.manual_seed(seed)
        world = trap_world(seed)
        plugins = {"grpo": rlmix_grpo, **({} if variant == "grpo" else {"elpo": rlmix_elpo})}
        extra = [] if variant == "grpo" else ["elpo.step_delimiter=''", *overrides]
        run = toy_world_run(world, plugins, ["train.lr=0.05", *extra])
        while world.generated_rows < budget:
            loop.train_step(run)
            if world.success() >= 0.9:
                return world.generated_rows
        return None
    finally:
        rlmix_elpo.probe, rlmix_elpo.rlmix_advantage = shipped


def elpo_main() -> None:
    settings = {"a": ["elpo.prefix_scale=0.5", "elpo.critical_scale=1.5",
                      "elpo.max_searches=1", "elpo.continuations=1"],
                "b": ["elpo.prefix_scale=0", "elpo.critical_scale=1",
                      "elpo.max_searches=2", "elpo.continuations=2"]}
    cases = [("grpo", "grpo", [])] + [(f"{v} {k}", v, o) for v in ("elpo", "tree")
                                       for k, o in settings.items()]
    for name, variant, overrides in cases:
        print(f"{name:8s} rollouts to 0.9:", [elpo_run(variant, overrides, s) for s in range(4)],
              flush=True)


def aepo_run(plugins: dict, overrides: list[str], epochs: int, lr: float, seed: int,
             steps: int = 200, vocab: int = 6, good: int = 3, noisy: bool = False
             ) -> tuple[float, float, float]:
    """Returns (the last 20 steps' mean reward, or under ``noisy`` the table's probability
    mass on good tokens at the end; the table's mean entropy at the end; the mean clip
    fraction)."""
    run = make_run(plugins, [f"train.epochs={epochs}", *overrides])
    toy = ToyPolicy(vocab=vocab, length=4, seed=seed)
    start = torch.cat([torch.tensor([3.0]), torch.zeros(good - 1), torch.ones(vocab - good)])
    with torch.no_grad():
        toy.logits.copy_(start.repeat(4, 1)
                         + 0.1 * torch.arange(4.0)[:, None] * torch.eye(vocab)[0])
    coin = torch.Generator().manual_seed(1000 + seed)

    def reward(b: RolloutBatch) -> torch.Tensor:
        share = (b.tokens[:, 1:] < good).float().mean(-1)
        return (torch.rand(share.shape, generator=coin) < share).float() if noisy else share

    updates: list[dict] = []
    rewards = toy_train(run, toy, reward, steps=steps, lr=lr, epochs=epochs, norm_constant=4.0,
                        update_metrics=updates)
    with torch.no_grad():
        table = torch.log_softmax(toy.logits, -1)
        entropy_end = float(-(table.exp() * table).sum(-1).mean())
        good_mass = float(table.exp()[:, :good].sum(-1).mean())
    clip = [u["clip/fraction"] for u in updates]
    return (good_mass if noisy else sum(rewards[-20:]) / 20), entropy_end, sum(clip) / len(clip)


def aepo_main() -> None:
    ppo, aepo = {"grpo": rlmix_grpo}, {"grpo": rlmix_grpo, "aepo": rlmix_aepo}
    one = ["aepo.rescue=positive"]
    cases = [("ppo", ppo, []), ("aepo", aepo, []), ("aepo alpha 0", aepo, ["aepo.alpha=0"]),
             ("one-sided", aepo, one), ("one-sided alpha 0", aepo, [*one, "aepo.alpha=0"])]
    for epochs, lr in ((4, 0.1), (8, 0.3)):
        print(f"epochs {epochs}, Adam lr {lr}: (reward, entropy at 200, clip fraction)")
        for name, plugins, overrides in cases:
            out = [aepo_run(plugins, overrides, epochs, lr, s) for s in range(3)]
            print(f"  {name:18s}", "  ".join(f"{r:.3f} {h:.3f} {c:.4f}" for r, h, c in out),
                  flush=True)


def aepo_noisy_main() -> None:
    ppo, aepo = {"grpo": rlmix_grpo}, {"grpo": rlmix_grpo, "aepo": rlmix_aepo}
    cases = [("ppo", ppo, []), ("aepo", aepo, []), ("aepo alpha 0", aepo, ["aepo.alpha=0"])]
    for vocab, good, lr in ((6, 3, 0.1), (32, 16, 0.3)):
        print(f"{vocab} tokens, {good} good, 4 epochs, Adam lr {lr}: (good mass, entropy at "
              f"200, clip fraction)")
        for name, plugins, overrides in cases:
            out = [aepo_run(plugins, overrides, 4, lr, s, vocab=vocab, good=good, noisy=True)
                   for s in range(3)]
            print(f"  {name:14s}", "  ".join(f"{r:.3f} {h:.3f} {c:.4f}" for r, h, c in out),
                  flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"elpo": elpo_main, "aepo": aepo_main, "aepo-noisy": aepo_noisy_main}[
        sys.argv[1] if len(sys.argv) > 1 else "elpo"]()
