"""Live-Evo: an online experience bank and guideline bank with reinforced and decayed weights.

Live-Evo (seed 000, paragraph 112) learns from a stream: it keeps *what happened* (an Experience
Bank) apart from *how to use it* (a Meta-Guideline Bank), retrieves experiences for each task,
and keeps a weight per experience that feedback reinforces when the experience helped and decays
when it did not, so misleading or stale experiences are shown less and finally forgotten.

In rlmix:

1. **retrieval, per prompt** (a wrapper on ``rlmix_prompts``): for prompt ``i`` of step ``s``,
   ``k`` experiences are drawn without replacement with probability proportional to
   ``weight * exp(relevance * similarity(task, experience task))`` (seeded by ``seed``, ``s``,
   ``i``), and the ``guideline_k`` best guidelines by the same score; they are rendered into the
   harness component ``component`` after its own text, and the env's prompt ``i`` is rebuilt under
   that harness (``rlmix_harness.prompts_under``). ``Prompt.info["live_evo"]`` records what was
   shown;
2. **credit** (``rlmix_evolve``): a prompt's gain is its mean reward minus a baseline (``plain``:
   one greedy rollout of the same prompt without memory; ``ema``: a running mean of the stream's
   reward; ``fixed``); every experience and guideline it was shown is multiplied by
   ``reinforce`` when the gain is above ``margin`` and by ``decay`` otherwise, clipped to
   ``max_weight``; every weight is multiplied by ``forget`` per step, and entries under
   ``prune_below`` are dropped;
3. **distillation**: one new experience per prompt of the batch (task, what was done, outcome,
   lesson), by rule (the env's feedback, or the answer that worked) or by the reflection LM;
4. **guideline induction**: by rule, a lesson shared by ``min_support`` live experiences becomes a
   guideline; by LM, rules written from the heaviest experiences.

Everything lives in ``run.state["live_evo"]``, so checkpoints resume the banks exactly. The
harness itself (``run.harness``) is left as it is: the memory is added per prompt.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import (
    cut,
    feedback_text,
    generate_scored,
    inside_rendering,
    mean,
    metric_values,
    prompts_under,
    reflection_lm,
    rendering,
    similarity,
    user_text,
)
from rlmix_lm import LM, LMSettings

import rlmix
from rlmix import loop
from rlmix.types import HarnessUpdate, Prompt, RolloutBatch, Run

NAME = "live_evo"
DISTILLS = ("rule", "lm")
BASELINES = ("plain", "ema", "fixed")
_RENDERING = "live_evo.rendering"  # run.resources: threads inside our own re-rendering
_LESSON = re.compile(r"^\s*LESSON\s*:\s*(.+)$", re.I | re.M)
_RULE = re.compile(r"^\s*RULE\s*:\s*(.+)$", re.I | re.M)


@dataclass
class Settings:
    component: str = "system"  # harness component the retrieved memory is appended to
    header: str = "Experience from similar past tasks:"
    guideline_header: str = "Guidelines:"
    k: int = 2  # experiences retrieved per prompt
    guideline_k: int = 1  # guidelines shown per prompt
    relevance: float = 8.0  # score = weight * exp(relevance * similarity); 0 = weight alone
    max_experiences: int = 64  # bank size; the lightest are dropped beyond it
    max_guidelines: int = 16
    new_per_step: int = 8  # experiences distilled per step at most (one per prompt)
    distill: str = "rule"  # rule | lm
    baseline: str = "plain"  # plain (greedy rollout without memory) | ema | fixed
    baseline_value: float = 0.5  # baseline: fixed
    ema: float = 0.8  # baseline: ema, the weight of the old mean
    margin: float = 0.0  # a gain above this reinforces, anything else decays
    reinforce: float = 1.25  # weight *= reinforce when the prompt it was shown to gained
    decay: float = 0.5  # weight *= decay otherwise
    forget: float = 1.0  # every weight *= forget per step (1 = no passive forgetting)
    initial_weight: float = 1.0
    max_weight: float = 8.0
    prune_below: float = 0.25  # entries lighter than this are forgotten; 0 = never
    learn: bool = True  # false: weights never change (the ablation of the paper's update)
    dedup: float = 0.9  # a new lesson this similar (word Jaccard) to a live one merges into it
    min_support: int = 2  # rule guidelines: a lesson seen on this many tasks
    induce_every: int = 1  # guideline induction every n evolve calls; 0 = no guidelines
    success_threshold: float = 0.5  # metric >= this is a success
    metric: str = ""  # reward term for gains and outcomes, e.g. arith.correct; "" = reward
    text_chars: int = 160  # a task, answer or lesson is cut to this many characters
    max_new_tokens: int = 0  # plain-baseline rollouts; 0 = sampling.max_new_tokens
    seed: int = 0
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        rlmix.check_choices(self, distill=DISTILLS, baseline=BASELINES)
        if not self.component:
            raise ValueError("component: name the harness component the memory goes into")
        for name in ("k", "guideline_k", "new_per_step", "induce_every", "max_new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.max_experiences < 1 or self.max_guidelines < 1 or self.min_support < 1:
            raise ValueError("max_experiences: max_experiences, max_guidelines and min_support "
                             "must be >= 1")
        if self.relevance < 0:
            raise ValueError(f"relevance: must be >= 0, got {self.relevance}")
        if self.reinforce < 1.0:
            raise ValueError(f"reinforce: must be >= 1 (it multiplies a weight that helped), "
                             f"got {self.reinforce}")
        if not 0.0 < self.decay <= 1.0 or not 0.0 < self.forget <= 1.0:
            raise ValueError(f"decay: decay and forget must be in (0, 1], got {self.decay} and "
                             f"{self.forget}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema: must be in [0, 1), got {self.ema}")
        if not 0.0 <= self.prune_below < self.initial_weight <= self.max_weight:
            raise ValueError(f"initial_weight: need 0 <= prune_below < initial_weight <= "
                             f"max_weight, got {self.prune_below}, {self.initial_weight}, "
                             f"{self.max_weight}")
        if not 0.0 < self.dedup <= 1.0:
            raise ValueError(f"dedup: must be in (0, 1], got {self.dedup}")
        if self.text_chars < 16:
            raise ValueError(f"text_chars: must be >= 16, got {self.text_chars}")


# ---------------------------------------------------------------- retrieval (pure)


def _reset_state(run: Run, value: dict[str, Any]) -> dict[str, Any]:
    """``run.plugin_state(NAME)`` (checkpointed) set to ``value``, in place."""
    state = run.plugin_state(NAME)
    state.clear()
    state.update(value)
    return state


def retrieval_scores(items: Sequence[dict[str, Any]], task: str, relevance: float
                     ) -> list[float]:
    """``weight * exp(relevance * similarity(task, item's task))`` for each item."""
    return [float(it["weight"]) * math.exp(relevance * similarity(task, it["task"]))
            for it in items]


def weighted_sample(scores: Sequence[float], k: int, rng: random.Random) -> list[int]:
    """``k`` indices drawn without replacement, each draw proportional to its score among those
    left (Efraimidis-Spirakis keys ``u ** (1 / score)``); positive scores only."""
    keyed = [(rng.random() ** (1.0 / s), -i) for i, s in enumerate(scores) if s > 0]
    keyed.sort(reverse=True)
    return [-i for _, i in keyed[:k]]


def retrieve(bank: Sequence[dict[str, Any]], task: str, k: int, relevance: float,
             rng: random.Random) -> list[int]:
    """Ids of ``k`` experiences for ``task``, sampled in proportion to weight and relevance."""
    picked = weighted_sample(retrieval_scores(bank, task, relevance), k, rng)
    return [int(bank[j]["id"]) for j in picked]


def top_guidelines(bank: Sequence[dict[str, Any]], task: str, k: int, relevance: float
                   ) -> list[int]:
    """Ids of the ``k`` guidelines with the highest score for ``task`` (deterministic)."""
    scores = retrieval_scores(bank, task, relevance)
    order = sorted(range(len(bank)), key=lambda j: (-scores[j], int(bank[j]["id"])))
    return [int(bank[j]["id"]) for j in order[:k]]


def render(experiences: Sequence[dict[str, Any]], guidelines: Sequence[dict[str, Any]],
           header: str, guideline_header: str) -> str:
    lines: list[str] = []
    if guidelines:
        lines.append(guideline_header)
        lines += [f"- {g['text']}" for g in guidelines]
    if experiences:
        lines.append(header)
        lines += [f"- Task: {e['task']} | Outcome: {'solved' if e['success'] else 'failed'} | "
                  f"Lesson: {e['lesson']}" for e in experiences]
    return "\n".join(lines)


# ---------------------------------------------------------------- weights (pure)


def update_weight(weight: float, gain: float, s: Settings) -> float:
    """Reinforce (``* reinforce``, capped at ``max_weight``) when ``gain > margin``, else decay
    (``* decay``)."""
    if gain > s.margin:
        return min(s.max_weight, weight * s.reinforce)
    return weight * s.decay


def credit(bank: list[dict[str, Any]], shown: Sequence[tuple[Sequence[int], float]],
           s: Settings) -> None:
    """Apply ``update_weight`` once per showing: ``shown`` is ``[(ids shown to a prompt, that
    prompt's gain)]``. Counts ``shown`` and ``helped`` on each entry."""
    by_id = {int(e["id"]): e for e in bank}
    for ids, gain in shown:
        for i in ids:
            e = by_id.get(int(i))
            if e is None:
                continue  # pruned since it was shown
            e["shown"] += 1
            e["helped"] += int(gain > s.margin)
            if s.learn:
                e["weight"] = update_weight(float(e["weight"]), gain, s)


def forget_and_prune(bank: list[dict[str, Any]], s: Settings, cap: int
                     ) -> list[dict[str, Any]]:
    """Passive forgetting, then drop entries under ``prune_below`` and the lightest (oldest
    first among equals) beyond ``cap``; returns the dropped entries."""
    if s.learn and s.forget < 1.0:
        for e in bank:
            e["weight"] *= s.forget
    keep = [e for e in bank if not (s.learn and e["weight"] < s.prune_below)]
    if len(keep) > cap:
        ranked = sorted(keep, key=lambda e: (e["weight"], e["id"]), reverse=True)
        keep = sorted(ranked[:cap], key=lambda e: e["id"])
    kept = {e["id"] for e in keep}
    dropped = [e for e in bank if e["id"] not in kept]
    bank[:] = keep
    return dropped


# ---------------------------------------------------------------- distillation (pure)


def rule_lesson(success: bool, output: str, feedback: str, chars: int) -> str:
    """What a rule distiller can say: the env's feedback on a failure, else the answer that
    worked (or failed, when the env gave no feedback)."""
    if not success and feedback:
        return cut(feedback, chars)
    return cut(f"answering {output.strip()!r} was {'right' if success else 'wrong'}", chars)


def distill_prompt(task: str, output: str, score: float, success: bool, feedback: str) -> str:
    lines = ["You review one attempt of an AI assistant at a task, to remember for later.",
             f"Task: {task}", f"Assistant's answer: {output}",
             f"Score: {score:g} ({'success' if success else 'failure'})"]
    if feedback:
        lines.append(f"Feedback from the checker: {feedback}")
    lines.append("Write one line 'LESSON: <what to do on tasks like this one>'.")
    return "\n".join(lines)


def induce_prompt(experiences: Sequence[dict[str, Any]], limit: int) -> str:
    lines = ["Experiences of an AI assistant (task, outcome, lesson, weight = how often the "
             "lesson helped):"]
    lines += [f"- [{e['weight']:.2f}] {e['task']} | {'solved' if e['success'] else 'failed'} | "
              f"{e['lesson']}" for e in experiences]
    lines.append(f"Write at most {limit} general rules that would help on future tasks, one "
                 "per line, each as 'RULE: <rule>'. Write nothing else.")
    return "\n".join(lines)


def parse_lines(pattern: re.Pattern[str], text: str) -> list[str]:
    return [m.strip() for m in pattern.findall(text) if m.strip() and not m.strip().startswith("<")]


def rule_guidelines(experiences: Sequence[dict[str, Any]], existing: set[str], min_support: int,
                    min_weight: float) -> list[tuple[str, list[int]]]:
    """Lessons seen on ``min_support`` tasks (an experience counts the tasks merged into it)
    whose experience weighs ``>= min_weight``, not yet guidelines: ``[(lesson, [id])]``."""
    return [(e["lesson"], [int(e["id"])]) for e in experiences
            if e["seen"] >= min_support and e["weight"] >= min_weight
            and e["lesson"] not in existing]


def find_duplicate(bank: Sequence[dict[str, Any]], lesson: str, threshold: float
                   ) -> dict[str, Any] | None:
    """The live experience whose lesson ``lesson`` nearly repeats (word Jaccard >= threshold)."""
    best = max(bank, key=lambda e: similarity(e["lesson"], lesson), default=None)
    if best is not None and similarity(best["lesson"], lesson) >= threshold:
        return best
    return None


# ---------------------------------------------------------------- state


def state_of(run: Run) -> dict[str, Any]:
    state = run.plugin_state(NAME)
    if not state:
        state = _reset_state(run, {
            "experiences": [], "guidelines": [], "next_id": 0, "steps": 0, "ema": None,
            "baseline_rollouts": 0, "pruned": 0, "distill_failed": 0, "last": {}, "log": [],
            "forgotten": []})
    return state


def _new_id(state: dict[str, Any]) -> int:
    state["next_id"] += 1
    return int(state["next_id"] - 1)


def _lm(run: Run) -> LM:
    return reflection_lm(run, NAME)


# ---------------------------------------------------------------- prompts with memory


def with_memory(run: Run, step: int, prompts: list[Prompt]) -> list[Prompt]:
    """Each prompt rebuilt by the env under a harness holding its own retrieved memory; each
    carries ``info["live_evo"]``: shown experience and guideline ids, the task text and the
    prompt's messages without memory."""
    s = run.settings(NAME)
    state = state_of(run)
    # snapshots: an async sampler builds prompts while the trainer's evolve edits the banks
    exps, guides = list(state["experiences"]), list(state["guidelines"])
    by_exp = {int(e["id"]): e for e in exps}
    by_gl = {int(g["id"]): g for g in guides}
    rendered: dict[str, list[Prompt]] = {}
    out = []
    for i, p in enumerate(prompts):
        task = user_text(p)
        rng = random.Random(f"{NAME}-{s.seed}-{step}-{i}")
        shown = retrieve(exps, task, s.k, s.relevance, rng) if s.k else []
        gls = top_guidelines(guides, task, s.guideline_k, s.relevance) if s.guideline_k else []
        record = {"shown": shown, "guidelines": gls, "task": cut(task, s.text_chars),
                  "plain": [dict(m) for m in p.messages]}
        block = render([by_exp[j] for j in shown], [by_gl[j] for j in gls], s.header,
                       s.guideline_header)
        q = p
        if block:
            if block not in rendered:
                base = run.harness.get(s.component, "")
                harness = {**run.harness, s.component: f"{base}\n\n{block}".strip()}
                with rendering(run, NAME):
                    rendered[block] = prompts_under(run, harness, [step])[step]
            if i >= len(rendered[block]):
                raise RuntimeError(f"live_evo: the env returned {len(rendered[block])} prompts "
                                   f"for step {step} under a memory harness, {len(prompts)} "
                                   f"without (rlmix_prompts must be deterministic in step)")
            q = rendered[block][i]
        out.append(Prompt(messages=q.messages, answer=q.answer, id=q.id,
                          info={**q.info, NAME: record}))
    return out


# ---------------------------------------------------------------- the step


def _groups(batch: RolloutBatch) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(batch.group.tolist()):
        groups.setdefault(int(g), []).append(row)
    return groups


def baselines(run: Run, batch: RolloutBatch, groups: dict[int, list[int]],
              values: list[float]) -> dict[int, float]:
    """The baseline each prompt's mean metric is compared with (``live_evo.baseline``)."""
    s = run.settings(NAME)
    state = state_of(run)
    if s.baseline == "fixed":
        return {g: s.baseline_value for g in groups}
    if s.baseline == "ema":
        ref = state["ema"] if state["ema"] is not None else mean(values)
        return {g: float(ref) for g in groups}
    # plain: one greedy rollout of each prompt that was shown memory, without it
    need = [g for g, rows in groups.items()
            if (batch.prompts[rows[0]].info.get(NAME) or {}).get("shown")
            or (batch.prompts[rows[0]].info.get(NAME) or {}).get("guidelines")]
    if not need:
        return {}
    plain = []
    for g in need:
        p = batch.prompts[groups[g][0]]
        info = {k: v for k, v in p.info.items() if k != NAME}
        plain.append(Prompt(messages=p.info[NAME]["plain"], answer=p.answer, id=p.id, info=info))
    scored = generate_scored(run, plain, 0.0, s.max_new_tokens or None)
    state["baseline_rollouts"] += len(plain)
    return dict(zip(need, metric_values(scored, s.metric, NAME)))


def distill(run: Run, batch: RolloutBatch, groups: dict[int, list[int]], values: list[float]
            ) -> list[dict[str, Any]]:
    """One experience per prompt (at most ``new_per_step``): the best row when one succeeded,
    else the first failure; by rule or by the LM."""
    s = run.settings(NAME)
    state = state_of(run)
    picks = []
    for rows in list(groups.values())[:s.new_per_step]:
        best = max(rows, key=lambda r: (values[r], -r))
        success = values[best] >= s.success_threshold
        meta = batch.prompts[best].info.get(NAME) or {}
        task = meta.get("task") or cut(user_text(batch.prompts[best]), s.text_chars)
        picks.append((best, success, task, feedback_text(batch.info[best], NAME)))
    lessons: list[str]
    if s.distill == "lm" and picks:
        prompts = [distill_prompt(t, batch.texts[r], values[r], ok, fb) for r, ok, t, fb in picks]
        replies = _lm(run).complete_batch(prompts, s.lm.max_new_tokens, s.lm.temperature)
        lessons = [next(iter(parse_lines(_LESSON, reply)), "") for reply in replies]
    else:
        lessons = [rule_lesson(ok, batch.texts[r], fb, s.text_chars) for r, ok, _, fb in picks]
    new = []
    for (r, ok, task, _), lesson in zip(picks, lessons):
        if not lesson:
            state["distill_failed"] += 1
            continue
        lesson = cut(lesson, s.text_chars)
        twin = find_duplicate(state["experiences"] + new, lesson, s.dedup)
        if twin is not None:  # seen again: one more task for it, its weight stays as earned
            twin["seen"] += int(task != twin["task"])
            continue
        new.append({"id": _new_id(state), "task": task, "action": cut(batch.texts[r], s.text_chars),
                    "outcome": values[r], "success": ok, "lesson": lesson,
                    "weight": s.initial_weight, "shown": 0, "helped": 0, "seen": 1,
                    "born": run.step})
    return new


def induce(run: Run) -> list[dict[str, Any]]:
    """New guidelines from the live experiences (rule: shared lessons; lm: written rules)."""
    s = run.settings(NAME)
    state = state_of(run)
    existing = {g["text"] for g in state["guidelines"]}
    found: list[tuple[str, list[int]]]
    if s.distill == "lm":
        top = sorted(state["experiences"], key=lambda e: (-e["weight"], e["id"]))[:8]
        top = [e for e in top if e["weight"] >= s.initial_weight]
        if not top:
            return []
        reply = _lm(run).complete(induce_prompt(top, 3), s.lm.max_new_tokens, s.lm.temperature)
        ids = [int(e["id"]) for e in top]
        found = [(cut(r, s.text_chars), ids) for r in parse_lines(_RULE, reply)[:3]
                 if cut(r, s.text_chars) not in existing]
    else:
        found = rule_guidelines(state["experiences"], existing, s.min_support, s.initial_weight)
    by_id = {int(e["id"]): e for e in state["experiences"]}
    new = []
    for text, ids in found:
        tasks = " ".join(by_id[i]["task"] for i in ids if i in by_id)
        new.append({"id": _new_id(state), "text": text, "task": cut(tasks, 4 * s.text_chars),
                    "support": ids, "weight": s.initial_weight, "shown": 0, "helped": 0,
                    "born": run.step})
        existing.add(text)
    return new


def evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    """Credit what each prompt was shown, distil new experiences, forget, induce guidelines.
    The banks change; ``run.harness`` does not (memory is added per prompt), so no update."""
    s = run.settings(NAME)
    state = state_of(run)
    if batch.rewards is None:
        loop.score(run, batch)
    values = metric_values(batch, s.metric, NAME)
    groups = _groups(batch)
    means = {g: mean([values[r] for r in rows]) for g, rows in groups.items()}
    base = baselines(run, batch, groups, values)
    exp_credit, gl_credit, gains = [], [], []
    for g, rows in groups.items():
        meta = batch.prompts[rows[0]].info.get(NAME) or {}
        if g not in base or not (meta.get("shown") or meta.get("guidelines")):
            continue
        gain = means[g] - base[g]
        gains.append(gain)
        exp_credit.append((meta.get("shown", []), gain))
        gl_credit.append((meta.get("guidelines", []), gain))
    credit(state["experiences"], exp_credit, s)
    credit(state["guidelines"], gl_credit, s)
    state["ema"] = (mean(values) if state["ema"] is None
                    else s.ema * state["ema"] + (1 - s.ema) * mean(values))
    new = distill(run, batch, groups, values)
    state["experiences"].extend(new)
    dropped = forget_and_prune(state["experiences"], s, s.max_experiences)
    dropped_gl = forget_and_prune(state["guidelines"], s, s.max_guidelines)
    state["pruned"] += len(dropped) + len(dropped_gl)
    state["forgotten"] += [{"step": run.step, "id": e["id"], "text": e.get("lesson", e.get("text")),
                            "weight": e["weight"], "shown": e["shown"], "helped": e["helped"]}
                           for e in dropped + dropped_gl]
    del state["forgotten"][:-100]
    induced = []
    if s.induce_every and (state["steps"] + 1) % s.induce_every == 0:
        induced = induce(run)
        state["guidelines"].extend(induced)
        forget_and_prune(state["guidelines"], s, s.max_guidelines)
    state["steps"] += 1
    shown = [len((batch.prompts[rows[0]].info.get(NAME) or {}).get("shown", []))
             for rows in groups.values()]
    state["last"] = {"gain": mean(gains), "helped": mean([float(x > s.margin) for x in gains]),
                     "credited": len(gains), "shown": mean([float(x) for x in shown]),
                     "accuracy": mean(values)}
    state["log"].append({"step": run.step, "new": [e["id"] for e in new],
                         "pruned": [e["id"] for e in dropped + dropped_gl],
                         "guidelines": [g["id"] for g in induced], **state["last"]})
    del state["log"][:-50]
    return None


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    state_of(run)
    if s.distill == "lm" and s.lm.source != "policy":
        _lm(run)  # load or connect now, so a bad model or URL fails before the first step


@rlmix.hookimpl(wrapper=True)
def rlmix_prompts(run: Run, step: int) -> Generator[None, Any, Any]:
    prompts = yield
    if not prompts or inside_rendering(run, NAME):
        return prompts
    return with_memory(run, int(step), list(prompts))


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return evolve(run, batch)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.plugin_state(NAME)
    if not state:
        return
    exps = state["experiences"]
    metrics[f"{NAME}/experiences"] = len(exps)
    metrics[f"{NAME}/guidelines"] = len(state["guidelines"])
    metrics[f"{NAME}/mean_weight"] = mean([float(e["weight"]) for e in exps])
    metrics[f"{NAME}/pruned"] = state["pruned"]
    metrics[f"{NAME}/baseline_rollouts"] = state["baseline_rollouts"]
    for k, v in state["last"].items():
        metrics[f"{NAME}/{k}"] = v
