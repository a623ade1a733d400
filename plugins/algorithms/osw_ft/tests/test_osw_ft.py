"""OSW-FT: the weights by hand, the expert batch, w = 1 is SFT exactly, and the claim on the
privileged toy world (unsolved queries reach 0.9 in fewer steps than uniform SFT on the same
data, at equal rollouts)."""

from __future__ import annotations

import pytest
import rlmix_osw_ft
import torch
from rlmix_osw_ft import WEIGHT, query_weights

import rlmix
from rlmix import loop
from rlmix.testing import make_run
from rlmix.testing.privileged import PrivilegedToyPolicy, PrivilegedToyWorld, toy_world_run


def test_query_weights_hand_computed():
    p_hat = torch.tensor([0.0, 0.5, 1.0, 0.5])
    torch.testing.assert_close(query_weights(p_hat, "one_minus_p", False),
                               torch.tensor([1.0, 0.5, 0.0, 0.5]))
    # mean of (1, .5, 0, .5) is 0.5
    torch.testing.assert_close(query_weights(p_hat, "one_minus_p", True),
                               torch.tensor([2.0, 1.0, 0.0, 1.0]))
    assert torch.equal(query_weights(torch.ones(3), "one_minus_p", True), torch.ones(3))
    assert torch.equal(query_weights(p_hat, "uniform", True), torch.ones(4))


SOLVED, UNSOLVED = [0, 1, 2, 3], [4, 5, 6, 7]


def _world() -> PrivilegedToyWorld:
    """8 queries, 3 tokens of 6; 0-3 solved (answer logit +4: 0.77 sampled), 4-7 unsolved
    (uniform: 1/216). The expert trajectory is the answer."""
    g = torch.Generator().manual_seed(6)
    answers = torch.randint(0, 6, (8, 3), generator=g)
    init = torch.zeros(8, 3, 6).scatter_(-1, answers[..., None], 4.0)
    init[UNSOLVED] = 0.0
    info = {p: {"expert_ids": answers[p].tolist()} for p in range(8)}
    return PrivilegedToyWorld(PrivilegedToyPolicy(8, 3, 6, init=init), answers, info=info)


OVERRIDES = ["train.group_size=2", "train.prompts_per_step=8", "train.lr=20"]


def test_the_sample_wrapper_returns_expert_rows_weighted_by_one_minus_p_hat():
    world = _world()
    run = toy_world_run(world, {"osw_ft": rlmix_osw_ft}, OVERRIDES, optimizer="sgd")
    prompts = world.rlmix_prompts(run, 0)
    batch = run.sample(prompts)
    assert world.generated_rows == 16  # k = 2 inference-only rollouts per query
    assert len(batch) == 8
    torch.testing.assert_close(batch.tokens[:, 1:], world.answers)  # the expert trajectories
    assert torch.equal(batch.tokens[:, 0], torch.arange(8))  # after each query's prompt
    w = batch.extras[WEIGHT]
    assert float(w[UNSOLVED].min()) > float(w[SOLVED].max()) - 1e-6
    assert float(w.mean()) == pytest.approx(1.0)


def test_uniform_weights_are_sft_exactly():
    a, b = _world(), _world()
    run_a = toy_world_run(a, {"osw_ft": rlmix_osw_ft},
                          [*OVERRIDES, "osw_ft.weighting=uniform"], optimizer="sgd")

    class SFT:  # plain SFT on the same expert rows: the token NLL, no weight
        @rlmix.hookimpl
        def rlmix_clip(self, run, mb, logp, entropy):
            return rlmix.LossTerms(loss=-logp, mask=mb.batch.completion_mask,
                                   mode="seq-mean-token-mean")

    run_b = toy_world_run(b, {"osw_ft": rlmix_osw_ft, "sft": SFT()},
                          [*OVERRIDES, "osw_ft.weighting=uniform"], optimizer="sgd")
    for _ in range(5):
        loop.train_step(run_a)
        loop.train_step(run_b)
    assert torch.equal(a.policy.logits, b.policy.logits)


def test_osw_ft_reaches_the_target_on_unsolved_queries_sooner_than_uniform_sft():
    target, limit = 0.9, 80

    def steps_to_target(weighting):
        w = _world()
        run = toy_world_run(w, {"osw_ft": rlmix_osw_ft},
                            [*OVERRIDES, f"osw_ft.weighting={weighting}"], optimizer="sgd")
        for step in range(1, limit + 1):
            loop.train_step(run)
            if float(w.policy.answer_prob(w.answers, UNSOLVED).mean()) >= target:
                return step, w.generated_rows / step, w
        return limit + 1, w.generated_rows / limit, w

    osw, osw_rows, osw_world = steps_to_target("one_minus_p")
    sft, sft_rows, _ = steps_to_target("uniform")
    assert osw_rows == sft_rows == 16  # the same inference-only rollouts per step
    print(f"steps to {target} on unsolved queries: OSW-FT {osw}, uniform SFT {sft}")
    assert osw <= limit and osw < sft
    # the solved queries are not given up for it
    assert float(osw_world.policy.answer_prob(osw_world.answers, SOLVED).mean()) > 0.7


def test_bad_settings_fail():
    with pytest.raises(rlmix.ManifestError, match="osw_ft"):
        make_run({"osw_ft": rlmix_osw_ft}, ["osw_ft.weighting=inverse"])
