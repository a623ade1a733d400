"""RolloutBatch.concat: rows stacked, per-token tensors left-padded to the widest batch."""

from __future__ import annotations

import torch

from rlmix.testing import make_batch
from rlmix.types import RolloutBatch


def test_concat_left_pads_per_token_tensors_and_extras() -> None:
    a = make_batch(n_groups=1, group_size=2, prompt_len=2, completion_len=3)
    b = make_batch(n_groups=2, group_size=2, prompt_len=2, completion_len=5)
    a.extras["token_version"] = torch.ones_like(a.tokens)
    a.extras["row_score"] = torch.arange(len(a), dtype=torch.float32)
    b.extras["token_version"] = torch.full_like(b.tokens, 2)
    b.extras["row_score"] = torch.arange(len(b), dtype=torch.float32) + 10
    both = RolloutBatch.concat([a, b])
    width = b.tokens.shape[1]
    assert both.tokens.shape == (len(a) + len(b), width)
    missing = width - a.tokens.shape[1]
    # the shorter batch is padded on the left, so its last columns line up with the others'
    assert torch.equal(both.tokens[: len(a), missing:], a.tokens)
    assert torch.equal(both.completion_mask[: len(a), :missing],
                       torch.zeros(len(a), missing))
    tv = both.extras["token_version"]
    assert tv.shape == both.tokens.shape
    assert torch.equal(tv[: len(a), :missing], torch.zeros(len(a), missing, dtype=tv.dtype))
    assert torch.equal(tv[: len(a), missing:], a.extras["token_version"])
    assert torch.equal(tv[len(a):], b.extras["token_version"])
    # per-row extras are stacked as they are
    assert both.extras["row_score"].tolist() == [0.0, 1.0, 10.0, 11.0, 12.0, 13.0]
    # groups of the second batch are shifted so they stay distinct
    assert both.group.tolist() == [0, 0, 1, 1, 2, 2]
