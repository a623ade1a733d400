"""Tests of AgentPRM: step splitting, Monte Carlo targets, the head's training step by hand; the
wrapper's targets against the exact success probabilities of a synthetic agent; the reward term;
settings checks; and the claim: the head trained on Monte Carlo targets ranks good steps above
bad ones on fresh trajectories, and its term separates good trajectories from bad."""

from __future__ import annotations

import pytest
import rlmix_agent_prm
import torch
from rlmix_agent_prm import (
    features,
    head_scores,
    mc_targets,
    split_steps,
    step_prefixes,
    train_head,
)

import rlmix
from rlmix.testing import make_run
from rlmix.types import Prompt, RolloutBatch

STEPS, P_GOOD = 3, 0.7
GOOD = ["search the index", "read the page", "check the answer"]
BAD = ["guess wildly", "click a random link", "skip the check"]


class AgentEnv:
    """A three-step "agent": each step is good with probability 0.7 (its text says which, in
    varied wording), a trajectory succeeds when every step is good. It can continue a prefix."""

    def __init__(self, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.generated = 0

    def _steps(self, k):
        out = []
        for _ in range(k):
            good = float(torch.rand(1, generator=self.gen)) < P_GOOD
            words = GOOD if good else BAD
            out.append(words[int(torch.randint(0, 3, (1,), generator=self.gen))])
        return out

    def continue_prefix(self, run, prompt, prefix, n):
        done = len(split_steps(prefix, "\n"))
        self.generated += n
        return ["\n".join(self._steps(STEPS - done)) for _ in range(n)]

    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        return [Prompt(messages=[{"role": "user", "content": "task"}], answer=None)
                for _ in range(int(run.config.train.prompts_per_step))]

    @rlmix.hookimpl
    def rlmix_generate(self, run, request):
        texts = ["\n".join(self._steps(STEPS)) for _ in request.prompts for _ in range(request.n)]
        n = len(texts)
        self.generated += n
        return RolloutBatch(
            group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
            tokens=torch.ones(n, 2, dtype=torch.long), attention_mask=torch.ones(n, 2),
            completion_mask=torch.tensor([[0.0, 1.0]]).repeat(n, 1),
            behavior_logp=torch.zeros(n, 2), policy_version=torch.zeros(n, dtype=torch.long),
            texts=texts, prompts=[p for p in request.prompts for _ in range(request.n)])

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        return {"success": torch.tensor([float(all(s in GOOD for s in split_steps(t, "\n"))
                                               and len(split_steps(t, "\n")) == STEPS)
                                         for t in batch.texts])}


def _run(env, overrides=()):
    run = make_run({"env": env, "agent_prm": rlmix_agent_prm},
                   ["train.prompts_per_step=4", "train.group_size=4",
                    "score.weights.agent_prm.prm=0", *overrides])
    run.plugin_resources("agent_prm")["continue"] = env.continue_prefix
    return run


def test_split_steps_and_prefixes():
    text = "a\n\nb\nc"
    assert split_steps(text, "\n") == ["a", "b", "c"]
    assert step_prefixes(text, "\n", 10) == ["a\n", "a\n\nb\n", "a\n\nb\nc"]
    assert step_prefixes(text, "\n", 2) == ["a\n", "a\n\nb\n"]


def test_mc_targets_and_head_step_by_hand():
    assert mc_targets([[1, 0, 1, 1], [0, 0], []]) == [0.75, 0.0, 0.0]
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([1.0, 0.25])
    w = train_head(torch.zeros(3), x, y, 0.5, 1)
    xb = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    torch.testing.assert_close(w, -0.5 * xb.T @ (torch.full((2,), 0.5) - y) / 2)
    w = train_head(torch.zeros(3), x, y, 2.0, 500)
    torch.testing.assert_close(head_scores(w, x), y, atol=0.02, rtol=0)


def test_wrapper_targets_match_the_exact_success_probabilities():
    env = AgentEnv(seed=1)
    run = _run(env, ["agent_prm.mc_rows=64", "agent_prm.mc_rollouts=64",
                     "agent_prm.head_epochs=0"])
    batch = run.sample(run.hook.rlmix_prompts(run=run, step=0))
    pairs = run.plugin_resources("agent_prm")["last_targets"]
    assert len(pairs) == 16 * STEPS and run.state["agent_prm"]["mc_rollouts"] == 16 * 3 * 64
    # an exact check per row: after a bad step nothing succeeds; after k good steps 0.7^(3-k)
    k = 0
    for text in batch.texts:
        steps = split_steps(text, "\n")
        ok = True
        for j, step in enumerate(steps):
            ok = ok and step in GOOD
            name, target = pairs[k]
            k += 1
            assert name == step
            expected = P_GOOD ** (STEPS - 1 - j) if ok else 0.0
            assert target == pytest.approx(expected, abs=0.2)
            if not ok:
                assert target == 0.0


def test_score_term_aggregates_the_heads_step_scores():
    env = AgentEnv()
    run = _run(env, ["agent_prm.aggregate=min"])
    w = torch.zeros(1025)
    w[:-1] = features(["search the index"], 1024)[0] * 4
    run.state["agent_prm"] = {"w": w, "rollouts": 0, "mc_rollouts": 0, "targets": 0}
    batch = env.rlmix_generate(run, rlmix.GenerationRequest(prompts=[Prompt(messages=[])], n=3))
    batch.texts = ["search the index\nguess wildly", "search the index", ""]
    prm = rlmix_agent_prm.rlmix_score(run=run, batch=batch)["prm"]
    s_good = float(head_scores(w, features(["search the index"], 1024)))
    s_bad = float(head_scores(w, features(["guess wildly"], 1024)))
    torch.testing.assert_close(prm, torch.tensor([min(s_good, s_bad), s_good, 0.0]))


@pytest.mark.parametrize("override", ["agent_prm.aggregate=max", "agent_prm.mc_rows=-1",
                                      "agent_prm.feature_dim=4", "agent_prm.head_lr=-1"])
def test_bad_settings_are_rejected_naming_the_setting(override):
    name = override.split(".")[1].split("=")[0]
    with pytest.raises(rlmix.ConfigError, match=name):
        _run(AgentEnv(), [override])


def test_claim_trained_head_ranks_good_steps_above_bad_and_good_trajectories_higher():
    env = AgentEnv(seed=3)
    run = _run(env)
    for step in range(15):  # 15 steps x 2 rows x 3 prefixes x 4 continuations = 360
        run.step = step
        run.sample(run.hook.rlmix_prompts(run=run, step=step))
    assert run.state["agent_prm"]["mc_rollouts"] == 15 * 2 * 3 * 4
    w = run.state["agent_prm"]["w"]
    good, bad = head_scores(w, features(GOOD, 1024)), head_scores(w, features(BAD, 1024))
    assert float(good.min()) > float(bad.max())  # every good step above every bad one
    # on fresh trajectories the term orders successes above failures (AUC)
    fresh = env.rlmix_generate(run, rlmix.GenerationRequest(prompts=[Prompt(messages=[])],
                                                            n=200))
    prm = rlmix_agent_prm.rlmix_score(run=run, batch=fresh)["prm"]
    success = env.rlmix_score(run, fresh)["success"] > 0
    pos, neg = prm[success], prm[~success]
    auc = float((pos[:, None] > neg[None, :]).float().mean())
    assert auc > 0.95


def test_default_continuations_come_from_the_policy_through_the_hf_sampler():
    rlmix_arith = pytest.importorskip("rlmix_arith")
    rlmix_hf = pytest.importorskip("rlmix_hf")
    run = make_run({"hf": rlmix_hf, "arith": rlmix_arith, "agent_prm": rlmix_agent_prm},
                   ["train.prompts_per_step=2", "train.group_size=2", "sampling.max_new_tokens=6",
                    "arith.eval_size=0", "agent_prm.mc_rows=1", "agent_prm.mc_rollouts=2"],
                   with_policy=True)
    with torch.no_grad():
        batch = run.sample(run.hook.rlmix_prompts(run=run, step=0))
    assert len(batch) == 4
    pairs = run.plugin_resources("agent_prm")["last_targets"]
    prefixes = step_prefixes(batch.texts[0], "\n", 4)
    assert len(pairs) == len(prefixes) >= 1
    assert run.state["agent_prm"]["mc_rollouts"] == 2 * len(prefixes)
    assert all(0.0 <= t <= 1.0 for _, t in pairs)
