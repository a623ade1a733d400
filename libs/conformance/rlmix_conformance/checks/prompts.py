"""Checks of ``rlmix_prompts``: prompts well formed, deterministic in seed and step (resume)."""

from __future__ import annotations

import io
import json

import torch

from rlmix.types import Prompt
from rlmix_conformance.kit import ConformanceFailure, Subject, check


def _prompt_key(prompts: list[Prompt]) -> list[tuple[str, str]]:
    return [(json.dumps(p.messages, sort_keys=True), repr(p.answer)) for p in prompts]


@check("rlmix_prompts", "prompts", owner_only=True)
def _prompts(s: Subject) -> None:
    """train.prompts_per_step Prompt objects whose messages are [{role, content}] strings."""
    run = s.run(["train.prompts_per_step=3"])
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    if not isinstance(prompts, list):
        raise ConformanceFailure(f"rlmix_prompts returned {type(prompts).__name__}; expected a "
                                 f"list of rlmix.Prompt")
    if len(prompts) != 3:
        raise ConformanceFailure(f"rlmix_prompts returned {len(prompts)} prompts with "
                                 f"train.prompts_per_step=3; return exactly "
                                 f"run.config.train.prompts_per_step")
    for i, p in enumerate(prompts):
        if not isinstance(p, Prompt):
            raise ConformanceFailure(f"rlmix_prompts item {i} is {type(p).__name__}; expected "
                                     f"rlmix.Prompt")
        ok = isinstance(p.messages, list) and p.messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in p.messages)
        if not ok:
            raise ConformanceFailure(f"rlmix_prompts item {i} has messages {p.messages!r}; "
                                     f"expected a non-empty list of {{'role': str, 'content': "
                                     f"str}}")


@check("rlmix_prompts", "resume", owner_only=True)
def _prompts_resume(s: Subject) -> None:
    """The same prompts in a fresh run with the same seed, and after a resume (run.rng and
    run.state restored) as in an uninterrupted run."""
    straight = s.run()
    expected = []
    for step in range(3):
        straight.step = step
        expected.append(_prompt_key(straight.hook.rlmix_prompts(run=straight, step=step)))
    first = s.run()
    first.step = 0
    if _prompt_key(first.hook.rlmix_prompts(run=first, step=0)) != expected[0]:
        raise ConformanceFailure("rlmix_prompts is not deterministic: two fresh runs with "
                                 "train.seed=0 give different prompts at step 0; derive them "
                                 "from run.rng, run.config.train.seed and the step")
    snapshot = io.BytesIO()
    torch.save(first.state, snapshot)
    snapshot.seek(0)
    resumed = s.run()
    resumed.rng.setstate(first.rng.getstate())
    resumed.state.clear()
    resumed.state.update(torch.load(snapshot, weights_only=False))
    for step in (1, 2):
        resumed.step = step
        if _prompt_key(resumed.hook.rlmix_prompts(run=resumed, step=step)) != expected[step]:
            raise ConformanceFailure(f"rlmix_prompts(step={step}) after a resume differs from "
                                     f"an uninterrupted run; a resumed run would train on other "
                                     f"prompts: derive them from the step, run.rng or run.state, "
                                     f"never from module-level state or call counts")
