"""What every harness-evolution plugin needs: tasks, prompts built under a candidate harness,
and scored rollouts of those prompts.

A *task* is ``(step, i)``: the ``i``-th prompt the env returns from ``rlmix_prompts(run, step)``.
Envs build prompts from ``run.harness`` and are deterministic in ``step`` (a resumed run sees the
prompts it would have seen), so the same task rendered under two harnesses differs only by the
harness. Plugins draw their search / selection / held-out tasks from steps far beyond training
(``task_step_base``) so that they never touch the training stream.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rlmix.errors import ConfigError
from rlmix.types import Prompt, RolloutBatch, Run

Task = tuple[int, int]  # (rlmix_prompts step, index in that step's prompts)


def task_pool(run: Run, size: int, base: int) -> list[Task]:
    """``size`` tasks from steps ``base, base + 1, ...``, ``train.prompts_per_step`` per step."""
    per_step = max(1, int(run.config.train.prompts_per_step))
    return [(base + k // per_step, k % per_step) for k in range(size)]


@contextlib.contextmanager
def harness_swapped(run: Run, harness: dict[str, str]) -> Iterator[None]:
    """``run.harness`` holds ``harness`` inside the block and its own texts again after it.

    An asynchronous sampler shares ``run.harness``: it is paused for the block."""
    sampler = getattr(run, "async_sampler", None)
    with sampler.paused() if sampler is not None else contextlib.nullcontext():
        saved = dict(run.harness)
        run.harness.clear()
        run.harness.update(harness)
        try:
            yield
        finally:
            run.harness.clear()
            run.harness.update(saved)


def prompts_under(run: Run, harness: dict[str, str], steps: Sequence[int]
                  ) -> dict[int, list[Prompt]]:
    """The env's prompts for ``steps``, built with ``harness`` in place of ``run.harness``."""
    out = {}
    with harness_swapped(run, harness):
        for step in steps:
            prompts = run.hook.rlmix_prompts(run=run, step=int(step))
            if not prompts:
                raise RuntimeError(f"rlmix_prompts returned nothing for step {step}")
            out[int(step)] = list(prompts)
    return out


def task_prompts(run: Run, harness: dict[str, str], tasks: Sequence[Task]) -> list[Prompt]:
    """The prompts of ``tasks`` under ``harness``, in the order of ``tasks``."""
    rendered = prompts_under(run, harness, sorted({int(t[0]) for t in tasks}))
    return [rendered[int(step)][int(i)] for step, i in tasks]


def generate_scored(run: Run, prompts: Sequence[Prompt], temperature: float = 0.0,
                    max_new_tokens: int | None = None) -> RolloutBatch:
    """One rollout per prompt (greedy by default, so scores repeat), scored by the run's
    scorers, with the policy in eval mode and no gradients."""
    from rlmix import loop

    model = run.policy.model if run.policy is not None else None
    was_training = bool(model is not None and model.training)
    if model is not None:
        model.eval()
    try:
        with torch.no_grad():
            batch = run.generate(list(prompts), temperature=temperature,
                                 max_new_tokens=max_new_tokens or None)
    finally:
        if model is not None:
            model.train(was_training)
    loop.score(run, batch)
    return batch


def metric_values(batch: RolloutBatch, metric: str = "", owner: str = "") -> list[float]:
    """Per-row values of reward term ``metric`` (e.g. ``arith.correct``), or of the weighted
    reward when ``metric`` is empty."""
    if metric:
        if metric not in batch.reward_terms:
            raise ConfigError(f"{owner + '.' if owner else ''}metric: no reward term {metric!r}; "
                              f"the scorers return {', '.join(sorted(batch.reward_terms))}")
        return [float(v) for v in batch.reward_terms[metric]]
    if batch.rewards is None:
        raise RuntimeError("the batch has no rewards: score it first")
    return [float(v) for v in batch.rewards]


def score_tasks(run: Run, harness: dict[str, str], tasks: Sequence[Task], *,
                temperature: float = 0.0, max_new_tokens: int | None = None, metric: str = "",
                owner: str = "") -> tuple[list[float], RolloutBatch]:
    """Run ``tasks`` once each under ``harness``; the per-task metric and the scored batch."""
    batch = generate_scored(run, task_prompts(run, harness, tasks), temperature, max_new_tokens)
    return metric_values(batch, metric, owner), batch


def user_text(prompt: Prompt) -> str:
    """The last user message of a prompt (the task as the model saw it)."""
    return next((m["content"] for m in reversed(prompt.messages) if m["role"] == "user"), "")


def traces(batch: RolloutBatch, scores: Sequence[float], chars: int = 400
           ) -> list[dict[str, Any]]:
    """One record per row for a reflection prompt: ``input`` (the user message), ``output``,
    ``score``, ``terms`` (every reward term) and ``feedback`` (the env's ``info``, as JSON cut
    to ``chars``)."""
    out = []
    for i, prompt in enumerate(batch.prompts):
        terms = ", ".join(f"{k}={float(v[i]):g}" for k, v in sorted(batch.reward_terms.items()))
        info = {k: v for k, v in batch.info[i].items() if k != "episode"}
        feedback = json.dumps(info, default=str)[:chars] if info else ""
        out.append({"input": user_text(prompt), "output": batch.texts[i],
                    "score": float(scores[i]), "terms": terms, "feedback": feedback})
    return out


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def words(text: str) -> set[str]:
    """The lower-case words (runs of letters and digits) of ``text``."""
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def similarity(a: str, b: str) -> float:
    """Jaccard index of the two texts' lower-case word sets (1 = same words)."""
    wa, wb = words(a), words(b)
    return len(wa & wb) / len(wa | wb) if wa or wb else 1.0


def cut(text: str, chars: int) -> str:
    """``text`` on one line, at most ``chars`` characters (``...`` marks a cut)."""
    text = " ".join(str(text).split())
    return text if len(text) <= chars else text[:chars - 3] + "..."


_FENCED = re.compile(r"```[^\n]*\n(.*?)\n?```", re.S)


def fenced_text(reply: str) -> str:
    """A reflection model's proposal: the text inside the first ``` fence (the fence's info
    string dropped), else the whole reply without fences, stripped."""
    found = _FENCED.search(reply)
    return (found.group(1) if found else reply.replace("```", "")).strip()


def feedback_text(info: dict[str, Any], owner: str = "") -> str:
    """A row's env feedback as plain words: ``key: value`` for every leaf of ``info``, a list's
    items joined by commas; the episode transcript and ``owner``'s own record left out."""
    parts: list[str] = []

    def walk(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(str(k), v)
        elif isinstance(value, (list, tuple)):
            parts.append(f"{key}: {', '.join(str(v) for v in value)}")
        elif value is not None and value != "":
            parts.append(f"{key}: {value}")

    for k, v in info.items():
        if k not in ("episode", owner):
            walk(str(k), v)
    return "; ".join(parts)


# ---------------------------------------------------------------- for plugin authors


def reflection_lm(run: Run, owner: str) -> Any:
    """Plugin ``owner``'s reflection model (``rlmix_lm``, from its ``lm`` settings block), made
    once and kept in ``run.resources["<owner>.lm"]`` (where tests put a scripted one)."""
    from rlmix_lm import make_lm

    key = f"{owner}.lm"
    lm = run.resources.get(key)
    if lm is None:
        lm = run.resources[key] = make_lm(run, run.settings(owner).lm, owner)
    return lm


def _rendering_threads(run: Run, owner: str) -> set[int]:
    return run.resources.setdefault(f"{owner}.rendering", set())


@contextlib.contextmanager
def rendering(run: Run, owner: str) -> Iterator[bool]:
    """Marks this thread as inside ``owner``'s own rendering of prompts, so that ``owner``'s
    wrapper on ``rlmix_prompts`` lets the env's prompts through untouched meanwhile (a routing or
    retrieval wrapper re-renders prompts through ``prompts_under``, which calls the hook again).
    Yields False when the thread was already inside. Per thread: the async sampler's worker
    renders on its own thread."""
    threads = _rendering_threads(run, owner)
    me = threading.get_ident()
    if me in threads:
        yield False
        return
    threads.add(me)
    try:
        yield True
    finally:
        threads.discard(me)


def inside_rendering(run: Run, owner: str) -> bool:
    """Whether this thread is inside ``owner``'s ``rendering`` block."""
    return threading.get_ident() in _rendering_threads(run, owner)


def evolved_components(run: Run, owner: str) -> list[str]:
    """The harness components plugin ``owner`` evolves: its ``components`` setting, or every
    component of ``run.harness`` when that is empty. A named component missing from the harness
    is a ``ConfigError`` naming ``<owner>.components``."""
    names = list(run.settings(owner).components) or sorted(run.harness)
    missing = [c for c in names if c not in run.harness]
    if missing:
        raise ConfigError(
            f"{owner}.components: the harness has no component {missing[0]!r}; give its "
            f"starting text under 'harness:' in the manifest (present: "
            f"{', '.join(sorted(run.harness)) or 'none'})")
    return names


def configure_evolver(run: Run, owner: str) -> None:
    """What a harness plugin checks at configure time: it warns when there is nothing to evolve,
    and loads (or connects to) a reflection model that is not the policy now, so a bad model
    name or URL fails before the first step."""
    if not evolved_components(run, owner):
        print(f"rlmix: warning: {owner} has nothing to evolve: the manifest's 'harness:' block "
              "is empty (give the components' starting texts there)")
    if run.settings(owner).lm.source != "policy":
        reflection_lm(run, owner)


GATES = "rlmix.gates"  # where the gates plugin (or sequential_gate) publishes its gates


def split_pool(run: Run, sizes: dict[str, int], base: int) -> dict[str, list[Task]]:
    """``search``, ``selection`` and ``heldout`` tasks of the sizes asked for, from a pool of
    their total starting at step ``base``: split by the gates in ``run.resources`` when a gates
    plugin is listed (seeded, and remembered, so held-out tasks can be guarded), else in order."""
    names = ("search", "selection", "heldout")
    pool = task_pool(run, sum(int(sizes.get(k, 0)) for k in names), base)
    gates = run.resources.get(GATES)
    if gates is not None:
        split = gates.split(pool, sizes)
        return {"search": list(split.search), "selection": list(split.selection),
                "heldout": list(split.heldout)}
    out, start = {}, 0
    for k in names:
        out[k] = pool[start:start + int(sizes.get(k, 0))]
        start += int(sizes.get(k, 0))
    return out


def guard_heldout(run: Run, tasks: Sequence[Task]) -> None:
    """Refuse held-out tasks the search has seen, when a gates plugin is listed."""
    gates = run.resources.get(GATES)
    if gates is not None:
        gates.guard_heldout(tasks)
