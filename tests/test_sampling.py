"""rlmix.sampling: the helpers rollout-allocation plugins share."""

from __future__ import annotations

import torch

from rlmix.sampling import count_rollouts, group_outcomes, prompt_key, regroup
from rlmix.testing import make_batch, make_run
from rlmix.types import Prompt


def test_prompt_key_by_text_or_id() -> None:
    a = Prompt(messages=[{"role": "user", "content": "1+1"}], id="p1")
    b = Prompt(messages=[{"role": "user", "content": "1+1"}], id="p2")
    assert prompt_key(a) == prompt_key(b)  # same text
    assert prompt_key(a, "id") != prompt_key(b, "id")
    no_id = Prompt(messages=[{"role": "user", "content": "1+1"}])
    assert prompt_key(no_id, "id") == prompt_key(no_id)  # falls back to the text


def test_regroup_makes_rows_with_one_key_one_contiguous_group() -> None:
    a = make_batch(n_groups=1, group_size=2, seed=1)
    b = make_batch(n_groups=2, group_size=2, seed=2)
    keys = ["x", "y", "y", "x", "z", "x"]  # a's rows, then b's
    out = regroup([a, b], keys)
    assert out.group.tolist() == [0, 0, 0, 1, 1, 2]
    # the stable order keeps first-seen rows first inside a group: x rows are a0, b1, b3
    both = torch.cat([a.tokens[:, -1], b.tokens[:, -1]])
    assert out.tokens[:3, -1].tolist() == both[[0, 3, 5]].tolist()


def test_group_outcomes_and_rollout_counter() -> None:
    wins, counts = group_outcomes(torch.tensor([1, 0, 1, 1, 0]), torch.tensor([0, 0, 1, 1, 2]))
    assert wins.tolist() == [1, 2, 0] and counts.tolist() == [2, 2, 1]
    run = make_run()
    count_rollouts(run, "method", 8)
    count_rollouts(run, "method", 4)
    assert run.state["method"]["rollouts"] == 12


def test_draw_tokens_matches_the_distribution_and_its_log_probs():
    from rlmix.sampling import draw_tokens

    scores = torch.tensor([[2.0, 1.0, float("-inf"), 0.0, -1.0]]).repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    choice, logp = draw_tokens(scores, gen)
    probs = torch.softmax(scores[0], -1)
    counts = torch.bincount(choice, minlength=5).double()
    assert counts[2] == 0  # an excluded token is never drawn
    expected = probs.double() * len(choice)
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001
    torch.testing.assert_close(logp, torch.log(probs)[choice])
    # seeded: the same generator state draws the same tokens
    again, _ = draw_tokens(scores, torch.Generator().manual_seed(0))
    assert torch.equal(again, choice)


def test_draw_tokens_is_not_uniform():
    from rlmix.sampling import draw_tokens

    scores = torch.tensor([[5.0, 0.0]]).repeat(2000, 1)
    choice, _ = draw_tokens(scores, torch.Generator().manual_seed(1))
    assert 0.98 < float((choice == 0).float().mean()) < 1.0
