"""partial: continuation is exact, segments keep their own behaviour log-probs and versions,
groups are never split, nothing is discarded (also across an async resume), and under
heavy-tailed lengths a step costs fewer decoding steps than waiting for the longest response."""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import rlmix_partial
import torch
from rlmix_partial import decode, left_pad
from rlmix_partial.lengths import heavy_tail_eos

from rlmix import loop
from rlmix.errors import ManifestError
from rlmix.policy import frozen_copy, tiny_random
from rlmix.testing import make_run
from rlmix.testing.standins import FakeEnv, FakeRollout, SimpleAlgorithm
from rlmix.types import Run

torch.set_num_threads(1)


def _rows(tok: Any, contents: list[str], n: int) -> list[list[int]]:
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                     add_generation_prompt=True) for c in contents]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts for _ in range(n)]


def test_a_continued_response_equals_the_one_generated_in_one_go() -> None:
    model, tok = tiny_random()
    model.eval()
    rows = _rows(tok, ["hi there", "What is 12+7?", "x"], 2)
    ids, attn = left_pad(rows, tok.pad_token_id)
    kw: dict[str, Any] = {"temperature": 0.9, "top_k": 50, "eos_ids": [],
                          "pad_id": tok.pad_token_id}
    one = decode(model, ids, attn, torch.full((6,), 12),
                 generator=torch.Generator().manual_seed(7), **kw)
    gen = torch.Generator().manual_seed(7)
    calls = []
    first = decode(model, ids, attn, torch.full((6,), 12), generator=gen,
                   stop=lambda ended: calls.append(1) or len(calls) >= 5, **kw)
    assert first.tokens.shape[1] == 5 and not bool(first.ended.any())
    # continue from the prefix, KV cache recomputed, same RNG stream and weights
    ids2, attn2 = left_pad([r + first.row(i)[0] for i, r in enumerate(rows)], tok.pad_token_id)
    rest = decode(model, ids2, attn2, torch.full((6,), 7), generator=gen, **kw)
    assert torch.equal(torch.cat([first.tokens, rest.tokens], 1), one.tokens)
    # the concatenated behaviour log-probs are the per-segment ones, and equal the one-go ones
    torch.testing.assert_close(torch.cat([first.logp, rest.logp], 1), one.logp,
                               atol=1e-5, rtol=0)
    assert bool(rest.ended.all()) and torch.equal(rest.mask.sum(1), torch.full((6,), 7.0))


def test_decode_stops_at_eos_and_budget() -> None:
    model, tok = tiny_random()
    model.eval()
    rows = _rows(tok, ["a", "bb"], 4)
    ids, attn = left_pad(rows, tok.pad_token_id)
    heavy_tail_eos(model, tok.eos_token_id, start=ids.shape[1], alpha=1.0, scale=1.5)
    seg = decode(model, ids, attn, torch.tensor([3, 30, 30, 30, 30, 30, 30, 30]),
                 temperature=1.0, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                 generator=torch.Generator().manual_seed(0))
    lengths = seg.mask.sum(1).long()
    assert lengths[0] <= 3 and bool(seg.ended.all())
    for i in range(8):
        toks, _ = seg.row(i)
        assert len(toks) == lengths[i]
        assert (toks[-1] == tok.eos_token_id) == bool(seg.eos[i])
        assert tok.eos_token_id not in toks[:-1]  # nothing after a stop token
    assert len(set(lengths.tolist())) > 2  # lengths vary


# ---------------------------------------------------------------- the plugin on a run


def _run(*overrides: str, model_hook: bool = True) -> Run:
    run = make_run({"kit_env": FakeEnv(), "partial": rlmix_partial},
                   ["train.prompts_per_step=2", "train.group_size=3",
                    "sampling.max_new_tokens=24", "train.seed=1", *overrides],
                   with_policy=True)
    assert run.policy is not None
    run.policy.model.eval()
    if model_hook:
        prompts = run.hook.rlmix_prompts(run=run, step=0)
        start = min(len(rlmix_partial._prompt_ids(run, p)) for p in prompts)
        heavy_tail_eos(run.policy.model, run.policy.tokenizer.eos_token_id, start=start,
                       alpha=1.0, scale=1.5)
    return run


def _sample(run: Run, step: int) -> Any:
    run.step = step
    prompts = run.hook.rlmix_prompts(run=run, step=step)
    with torch.no_grad():
        return run.sample(prompts)


@torch.no_grad()
def _reference_logp(model: Any, batch: Any, temperature: float) -> torch.Tensor:
    """Teacher-forced log-probs of every token under ``model`` (with its hooks)."""
    pos = (batch.attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask,
                   position_ids=pos).logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.tokens[:, 1:, None])
    return torch.cat([torch.zeros(len(batch), 1), logp.squeeze(-1)], 1)


def _check_groups(batch: Any, size: int, max_new: int) -> None:
    assert len(batch) % size == 0
    for g in range(batch.num_groups):
        rows = (batch.group == g).nonzero().squeeze(1)
        assert len(rows) == size  # a group is never split
        ids = {batch.info[i]["partial"]["group_id"] for i in rows.tolist()}
        assert len(ids) == 1
        for i in rows.tolist():  # every member is complete: stopped at EOS or at the cap
            assert batch.info[i]["partial"]["eos"] or batch.completion_mask[i].sum() == max_new


def test_segments_keep_the_log_probs_and_versions_that_generated_them() -> None:
    run = _run("partial.over_provision=2.0")
    assert run.policy is not None
    temperature = float(run.config.sampling.temperature)
    b0 = _sample(run, 0)
    _check_groups(b0, 3, 24)
    weights_v0 = frozen_copy(run.policy.model)  # hooks are copied with the model
    carried = [m for g in run.state["partial"]["pool"] for m in g["members"] if m["tokens"]
               and not m["done"]]
    assert carried, "the seed must leave unfinished responses to carry over"
    with torch.no_grad():  # an optimizer step: new weights, a new version
        for p in run.policy.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    run.policy_version = 1
    ref_models = {0: weights_v0, 1: run.policy.model}
    mixed = 0
    for step in (1, 2, 3):
        b1 = _sample(run, step)
        _check_groups(b1, 3, 24)
        versions = b1.extras["token_version"]
        cmask = b1.completion_mask > 0
        ref = {v: _reference_logp(m, b1, temperature) for v, m in ref_models.items()}
        expected = torch.where(versions == 0, ref[0], ref[1]) * cmask
        torch.testing.assert_close(b1.behavior_logp, expected, atol=2e-4, rtol=0)
        for i in range(len(b1)):
            first = int(cmask[i].nonzero()[0])  # policy_version: the first segment's version
            assert int(b1.policy_version[i]) == int(versions[i, first])
            assert bool((versions[i][~cmask[i]] == b1.policy_version[i]).all())
            if len(set(versions[i][cmask[i]].tolist())) == 2:
                mixed += 1
                # the current policy's log-probs would be wrong on the older segment
                old = (versions[i] == 0) & cmask[i]
                assert (b1.behavior_logp[i] - ref[1][i])[old].abs().max() > 1e-3
    assert mixed, "some returned sample must span both versions"
    assert int(b0.policy_version.max()) == 0


def test_nothing_is_discarded_and_a_step_ends_before_the_longest_response() -> None:
    """The paper's claim in miniature: under heavy-tailed lengths a step ends when the target
    groups are complete instead of waiting for the longest response, and every started
    group is eventually returned exactly once, in full."""
    run = _run("partial.over_provision=1.5", "sampling.max_new_tokens=64")
    assert run.policy is not None
    s = run.config.sampling
    partial_steps, sync_steps, returned = 0, 0, []
    for step in range(8):
        batch = _sample(run, step)
        _check_groups(batch, 3, 64)
        returned += sorted({i["partial"]["group_id"] for i in batch.info})
        stats = run.plugin_resources("partial")[rlmix_partial.STATS]
        partial_steps += int(stats[step]["partial/decode_steps"])
        # the synchronous schedule: this step's groups, decoded until the longest ends
        prompts = run.hook.rlmix_prompts(run=run, step=step)
        rows = [rlmix_partial._prompt_ids(run, p) for p in prompts for _ in range(3)]
        ids, attn = left_pad(rows, run.policy.tokenizer.pad_token_id)
        seg = decode(run.policy.model, ids, attn, torch.full((len(rows),), 64),
                     temperature=float(s.temperature), eos_ids=[run.policy.tokenizer.eos_token_id],
                     pad_id=run.policy.tokenizer.pad_token_id,
                     generator=torch.Generator().manual_seed(step))
        sync_steps += seg.tokens.shape[1]
    assert len(returned) == len(set(returned)) == 16  # two groups per step, none twice
    in_flight = [g["id"] for g in run.state["partial"]["pool"]]
    assert sorted(returned + in_flight) == list(range(run.state["partial"]["serial"]))
    assert partial_steps < 0.7 * sync_steps, (partial_steps, sync_steps)


def test_a_resumed_async_run_gets_back_the_groups_it_never_trained() -> None:
    run = _run("train.max_staleness=2")
    batches = [_sample(run, s) for s in range(3)]
    ahead = copy.deepcopy(run.state["partial"])  # the sampler was at step 3 when saved ...
    run.state["partial"] = ahead  # ... but the trainer's checkpoint says step 1
    again = [_sample(run, s) for s in (1, 2)]
    for old, new in zip(batches[1:], again, strict=True):
        assert [i["partial"]["group_id"] for i in old.info] == \
            [i["partial"]["group_id"] for i in new.info]
        assert torch.equal(old.tokens, new.tokens)
        assert torch.equal(old.behavior_logp, new.behavior_logp)
    assert run.plugin_resources("partial")[rlmix_partial.STATS][1]["partial/decode_steps"] == 0


def test_settings_are_checked() -> None:
    with pytest.raises(ManifestError, match=r"partial\.over_provision"):
        make_run({"kit_env": FakeEnv(), "partial": rlmix_partial},
                 ["partial.over_provision=0.5"])


def test_trains_end_to_end_in_async_mode(tmp_path: Path) -> None:
    run = make_run({"kit_env": FakeEnv(), "kit_rollout": FakeRollout(),
                    "kit_algo": SimpleAlgorithm(), "partial": rlmix_partial},
                   ["train.prompts_per_step=2", "train.group_size=3", "train.steps=4",
                    "sampling.max_new_tokens=16", "train.max_staleness=1", f"out={tmp_path}",
                    "train.eval_every=0", "train.checkpoint_every=2", "log.plot=false"],
                   with_policy=True)
    loop.configure(run)
    heavy_tail_eos(run.policy.model, run.policy.tokenizer.eos_token_id, start=40)
    loop.train(run)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert run.policy_version == 4
    for r in rows:
        assert "partial/decode_steps" in r and r["staleness/max"] >= 0
    assert not any(t.name == "rlmix-async-sampler" for t in threading.enumerate())
