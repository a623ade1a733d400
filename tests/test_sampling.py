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
