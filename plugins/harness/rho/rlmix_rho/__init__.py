"""RHO: label-free harness optimisation. It never reads a reward.

Each ``rlmix_evolve`` call is one round:

1. **Coreset** (``coreset``): from a pool of past tasks, each re-solved ``samples`` times with
   sampling, keep ``coreset_size`` tasks that are hard (lowest self-consistency: the share of
   the majority answer) and diverse (greedy max-min word distance among the hardest).
2. **Analysis**: for each coreset task, the majority answer, its share and the disagreeing
   answers (self-consistency), and the model's own check of its majority answer
   (self-validation, one LM call per task).
3. **Candidates**: the reflection LM writes ``candidates`` updates of the evolved component
   from that analysis.
4. **Tournament** (``round_robin_winner``): every candidate's samples on the coreset are shown
   pairwise to the LM, which prefers one; the candidate with the most wins is applied.

``select: random`` is the baseline: one of the same candidates at random. The budget counts
rollouts (no reward is ever computed); state is in ``run.state["rho"]``.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmix_harness import reflection_lm, split_pool, task_prompts, user_text, words
from rlmix_lm import LMSettings

import rlmix
from rlmix.manifest import check_choices
from rlmix.types import HarnessUpdate, RolloutBatch, Run

NAME = "rho"
SELECTS = ("tournament", "random")


@dataclass
class Settings:
    component: str = "instructions"  # the harness component updated
    pool_size: int = 16  # past tasks the coreset is drawn from
    coreset_size: int = 4  # hard and diverse tasks re-solved and analysed
    samples: int = 4  # samples per task (self-consistency)
    candidates: int = 4  # updates proposed per round
    select: str = "tournament"  # tournament | random (baseline)
    temperature: float = 1.0  # sampling for self-consistency
    max_new_tokens: int = 0  # rollouts; 0 = sampling.max_new_tokens
    rounds: int = 1  # rounds in the run (each is one rlmix_evolve call)
    task_step_base: int = 2_000_000  # tasks are rlmix_prompts(run, task_step_base + k)
    seed: int = 0  # the random baseline's draw
    lm: LMSettings = field(default_factory=LMSettings)

    def __post_init__(self) -> None:
        check_choices(self, select=SELECTS)
        if min(self.pool_size, self.coreset_size, self.samples, self.candidates) < 1:
            raise ValueError("pool_size: pool_size, coreset_size, samples and candidates must "
                             "be >= 1")
        if self.coreset_size > self.pool_size:
            raise ValueError("coreset_size: must be <= pool_size")
        if self.temperature <= 0:
            raise ValueError("temperature: self-consistency needs sampling (> 0)")


# ---------------------------------------------------------------- pure parts


def answer_of(text: str) -> str:
    """The answer a completion settles on: its last non-empty line, whitespace folded."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return " ".join(lines[-1].split()) if lines else ""


def consistency(answers: Sequence[str]) -> tuple[str, float]:
    """The majority answer and its share."""
    if not answers:
        return "", 0.0
    top, n = Counter(answers).most_common(1)[0]
    return top, n / len(answers)


def distance(a: str, b: str) -> float:
    wa, wb = words(a), words(b)
    return 1.0 - (len(wa & wb) / len(wa | wb) if wa or wb else 1.0)


def coreset(texts: Sequence[str], shares: Sequence[float], k: int) -> list[int]:
    """``k`` hard and diverse tasks: from the ``2k`` least self-consistent (ties: order), the
    hardest first, then greedily the one farthest (max-min word distance) from those chosen."""
    order = sorted(range(len(texts)), key=lambda i: (shares[i], i))[:2 * k]
    chosen = order[:1]
    while len(chosen) < min(k, len(order)):
        rest = [i for i in order if i not in chosen]
        chosen.append(max(rest, key=lambda i: (min(distance(texts[i], texts[j])
                                                   for j in chosen), -shares[i], -i)))
    return chosen


def round_robin_winner(n: int, prefer: Any) -> tuple[int, list[int]]:
    """Every pair ``(i, j)`` played once through ``prefer(i, j) -> i or j``; the most wins
    (ties: the earlier candidate), and the win counts."""
    wins = [0] * n
    for i in range(n):
        for j in range(i + 1, n):
            wins[prefer(i, j)] += 1
    return max(range(n), key=lambda c: (wins[c], -c)), wins


_FENCE = re.compile(r"```[^\n]*\n(.*?)\n?```", re.S)


def parse_candidates(reply: str) -> list[str]:
    return [t.strip() for t in _FENCE.findall(reply) if t.strip()]


def analysis_text(rows: list[dict[str, Any]]) -> str:
    lines = []
    for k, r in enumerate(rows, 1):
        lines += [f"## Task {k}: {r['task']}",
                  f"Majority answer: {r['majority']} (share {r['share']:.2f})",
                  f"Other answers: {', '.join(r['others']) or 'none'}",
                  f"Self-check: {r['check']}"]
    return "\n".join(lines)


def candidates_prompt(component: str, text: str, analysis: str, k: int) -> str:
    return "\n".join([
        "You are improving the instructions given to an AI assistant, with no answer key.",
        f'The part called "{component}" currently reads:', "```", text, "```",
        "On these hard tasks the assistant's sampled answers disagree:", analysis,
        f"Write {k} different improved versions, each between its own ``` lines."])


def preference_prompt(task_rows: list[str], a: list[list[str]], b: list[list[str]]) -> str:
    lines = ["Two versions of an assistant answered the same tasks several times each.",
             "Which version's answers do you trust more? Answer A or B."]
    for t, (xa, xb) in enumerate(zip(a, b)):
        lines += [f"## Task: {task_rows[t]}", f"A: {' | '.join(xa)}", f"B: {' | '.join(xb)}"]
    return "\n".join(lines)


# ---------------------------------------------------------------- the round


def _sample(run: Run, state: dict[str, Any], text: str, tasks: list[Any]) -> list[list[str]]:
    s = run.settings(NAME)
    prompts = task_prompts(run, {**run.harness, s.component: text}, tasks)
    model = run.policy.model if run.policy is not None else None
    if model is not None:
        model.eval()
    batch = run.generate(prompts, n=s.samples, temperature=s.temperature,
                         max_new_tokens=s.max_new_tokens or None)
    state["rollouts"] += len(batch)
    return [[answer_of(t) for t in batch.texts[i * s.samples:(i + 1) * s.samples]]
            for i in range(len(tasks))]


def one_round(run: Run, state: dict[str, Any]) -> dict[str, Any]:
    s = run.settings(NAME)
    lm = reflection_lm(run, NAME)
    current = run.harness[s.component]
    pool = [tuple(t) for t in state["pool"]]
    answers = _sample(run, state, current, pool)
    texts = [user_text(p) for p in task_prompts(run, {**run.harness, s.component: ""}, pool)]
    stats = [consistency(a) for a in answers]
    chosen = coreset(texts, [sh for _, sh in stats], s.coreset_size)
    rows = []
    for i in chosen:
        majority, share = stats[i]
        check = lm.complete(f"Task: {texts[i]}\nProposed answer: {majority}\nIs this answer "
                            "right? Say yes or no and why, in one line.", 32, 0.0)
        rows.append({"task": texts[i], "majority": majority, "share": share,
                     "others": sorted(set(answers[i]) - {majority}), "check": check.strip()})
    reply = lm.complete(candidates_prompt(s.component, current, analysis_text(rows),
                                          s.candidates), s.lm.max_new_tokens, s.lm.temperature)
    cands = parse_candidates(reply)[:s.candidates] or [current]
    record: dict[str, Any] = {"coreset": [list(pool[i]) for i in chosen], "candidates": cands}
    if s.select == "random":
        pick = random.Random(f"rho-{s.seed}-{state['round']}").randrange(len(cands))
        record["winner"] = pick
        return record
    core = [pool[i] for i in chosen]
    shown = [_sample(run, state, c, core) for c in cands]

    def prefer(i: int, j: int) -> int:
        reply = lm.complete(preference_prompt([texts[k] for k in chosen], shown[i], shown[j]),
                            8, 0.0)
        state["judgements"] += 1
        return j if re.search(r"\bB\b", reply) and not re.search(r"\bA\b", reply) else i

    record["winner"], record["wins"] = round_robin_winner(len(cands), prefer)
    return record


def init_state(run: Run) -> dict[str, Any]:
    s = run.settings(NAME)
    if s.component not in run.harness:
        from rlmix.errors import ConfigError

        raise ConfigError(f"{NAME}.component: the harness has no component {s.component!r}")
    pool = split_pool(run, {"search": s.pool_size}, s.task_step_base)["search"]
    state = run.state[NAME] = {"pool": [list(t) for t in pool], "round": 0, "rollouts": 0,
                               "judgements": 0, "history": []}
    return state


def iterate(run: Run) -> HarnessUpdate | None:
    s = run.settings(NAME)
    if NAME not in run.state and _nothing_to_evolve(run):
        return None
    state = run.state.get(NAME) or init_state(run)
    if state["round"] >= s.rounds:
        return None
    record = one_round(run, state)
    state["history"].append(record)
    state["round"] += 1
    text = record["candidates"][record["winner"]]
    if text == run.harness[s.component]:
        return None
    return HarnessUpdate(
        components={s.component: text},
        evidence=(f"round {state['round']}: candidate {record['winner']} of "
                  f"{len(record['candidates'])} by {s.select}"
                  + (f" (wins {record['wins']})" if "wins" in record else "")
                  + f"; {state['rollouts']} rollouts, no reward read"),
        parent_version=run.harness_version, source=NAME)


def _nothing_to_evolve(run: Run) -> bool:
    """True (with a warning at configure) when the harness lacks the component: nothing to do."""
    return run.settings(NAME).component not in run.harness


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    s = run.settings(NAME)
    if _nothing_to_evolve(run):
        print(f"rlmix: warning: {NAME} has nothing to evolve: the harness has no component "
              f"{s.component!r} (give its starting text under 'harness:')")
        return
    if s.lm.source != "policy":
        reflection_lm(run, NAME)


@rlmix.hookimpl
def rlmix_evolve(run: Run, batch: RolloutBatch) -> HarnessUpdate | None:
    return iterate(run)


@rlmix.hookimpl
def rlmix_step_end(run: Run, metrics: dict[str, Any]) -> None:
    state = run.state.get(NAME)
    if not state:
        return
    run.log("rho/rounds", state["round"])
    run.log("rho/rollouts", state["rollouts"])
    run.log("rho/judgements", state["judgements"])

