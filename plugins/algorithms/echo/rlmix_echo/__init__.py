"""ECHO (Entropy Confidence Hybrid GRPO), its rollout side: test-time RL from majority-vote
pseudo-labels, with branching controlled by entropy and confidence and pruning of
low-confidence branches.

* ``rlmix_sample`` wrapper: the owner samples ``group_size`` roots per prompt; the branch
  budget goes to the prompts whose samples are uncertain (high local entropy, low group
  confidence), capped per prompt at ``width_max`` so a few high-entropy prompts cannot take it
  all (rollout collapse); then low-confidence rows that disagree with the majority of the
  confident rows are pruned (dropped, their votes not counted); the pseudo-label of each group
  is the majority answer of what is left.
* ``rlmix_score``: the term ``pseudo_correct`` (1 when a row's answer is its group's pseudo-label;
  computed on the spot when the wrapper did not run).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass

import torch

import rlmix
from rlmix.sampling import count_rollouts, generate, pad_id, prompt_key, regroup
from rlmix.types import Prompt, RolloutBatch, Run

NAME = "echo"


@dataclass
class Settings:
    answer_regex: str = r"-?\d+(?:\.\d+)?"  # the answer is the last match in a completion
    branch_budget: int = 0  # extra rollouts per step; 0 = prompts_per_step * group_size
    width_max: int = 0  # extra rollouts one prompt may take; 0 = 2 * group_size
    entropy_weight: float = 1.0  # how much local entropy (vs. low confidence) drives branching
    prune: bool = True
    prune_quantile: float = 0.25  # a dissenting row below this confidence quantile is pruned
    min_keep: int = 2  # rows every group keeps at least

    def __post_init__(self) -> None:
        try:
            re.compile(self.answer_regex)
        except re.error as exc:
            raise ValueError(f"answer_regex is not a regular expression: {exc}") from None
        if self.branch_budget < 0 or self.width_max < 0:
            raise ValueError("branch_budget and width_max must be >= 0")
        if self.entropy_weight < 0:
            raise ValueError(f"entropy_weight must be >= 0, got {self.entropy_weight}")
        if not 0.0 <= self.prune_quantile < 1.0:
            raise ValueError(f"prune_quantile must be in [0, 1), got {self.prune_quantile}")
        if self.min_keep < 1:
            raise ValueError(f"min_keep must be >= 1, got {self.min_keep}")


def extract_answer(text: str, pattern: str) -> str | None:
    found = re.findall(pattern, text.replace(",", ""))
    return found[-1] if found else None


def majority_vote(answers: list[str | None]) -> tuple[str | None, float]:
    """``(label, confidence)``: the most common non-empty answer (ties to the first seen) and
    its share of all votes (0 when nobody answered)."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None, 0.0
    best = max(votes.values())
    label = next(a for a in answers if a is not None and votes[a] == best)
    return label, best / len(answers)


def branch_scores(entropy: torch.Tensor, confidence: torch.Tensor,
                  entropy_weight: float = 1.0) -> torch.Tensor:
    """How much each prompt wants more branches: ``(1 - confidence) * (1 + w * H / mean(H))``;
    zero for a prompt whose samples all agree."""
    rel = entropy / entropy.mean().clamp(min=1e-8)
    return (1.0 - confidence).clamp(min=0) * (1.0 + entropy_weight * rel)


def branch_widths(scores: torch.Tensor, budget: int, width_max: int) -> list[int]:
    """Split ``budget`` extra rollouts in proportion to ``scores`` (largest remainders), none
    above ``width_max``; with no score anywhere the budget is split evenly. What no prompt can
    take (all at the cap) stays unspent."""
    m = len(scores)
    widths = [0] * m
    left = budget
    w = scores.double().clamp(min=0)
    while left > 0:
        room = torch.tensor([x < width_max for x in widths])
        if not bool(room.any()):
            break
        ww = torch.where(room, w, torch.zeros_like(w))
        if float(ww.sum()) <= 0:
            ww = room.double()
        share = ww / ww.sum() * left
        add = [min(int(x), width_max - c) for x, c in zip(share.floor().tolist(), widths)]
        if sum(add) == 0:
            frac = (share - share.floor()).tolist()
            order = sorted((i for i in range(m) if room[i]), key=lambda i: (-frac[i], i))
            add = [0] * m
            for i in order[:left]:
                add[i] = 1
        widths = [c + a for c, a in zip(widths, add)]
        left -= sum(add)
    return widths


def prune_rows(answers: list[str | None], confidence: torch.Tensor, quantile: float,
               min_keep: int) -> list[int]:
    """Rows of one group to keep. The confident rows (confidence above the group's
    ``quantile``) vote first; a low-confidence row is pruned when it disagrees with their
    majority. The most confident pruned rows are kept back so at least ``min_keep`` remain."""
    n = len(answers)
    if quantile <= 0 or n <= min_keep:
        return list(range(n))
    cut = float(torch.quantile(confidence.float(), quantile))
    confident = [i for i in range(n) if float(confidence[i]) > cut]
    label, _ = majority_vote([answers[i] for i in confident])
    keep = [i for i in range(n) if float(confidence[i]) > cut or
            (label is not None and answers[i] == label)]
    if len(keep) < min_keep:
        rest = sorted((i for i in range(n) if i not in keep), key=lambda i: -float(confidence[i]))
        keep += rest[:min_keep - len(keep)]
    return sorted(keep)


def row_confidence(batch: RolloutBatch) -> torch.Tensor:
    """Per row: the mean sampled-token log-prob (higher = more confident)."""
    mask = batch.completion_mask
    return (batch.behavior_logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def _label_batch(batch: RolloutBatch, pattern: str) -> None:
    for g in range(batch.num_groups):
        rows = (batch.group == g).nonzero().flatten().tolist()
        answers = [extract_answer(batch.texts[i], pattern) for i in rows]
        label, conf = majority_vote(answers)
        for i, a in zip(rows, answers):
            batch.info[i]["echo"] = {"answer": a, "label": label, "confidence": conf}


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    run.state.setdefault(NAME, {"rollouts": 0, "pruned": 0})


@rlmix.hookimpl(wrapper=True)
def rlmix_sample(run: Run, prompts: list[Prompt]
                 ) -> Generator[None, RolloutBatch, RolloutBatch]:
    first = yield
    s: Settings = run.settings(NAME)
    state = run.state.setdefault(NAME, {"rollouts": 0, "pruned": 0})
    k = int(run.config.train.group_size)
    keys = [prompt_key(p) + f"#{g}" for p, g in zip(first.prompts, first.group.tolist())]
    order = list(dict.fromkeys(keys))
    by_key = dict(zip(keys, first.prompts))
    conf_rows = row_confidence(first)
    ent, conf = [], []
    for q in order:
        rows = [i for i, kk in enumerate(keys) if kk == q]
        ent.append(-float(conf_rows[rows].mean()))
        conf.append(majority_vote([extract_answer(first.texts[i], s.answer_regex)
                                   for i in rows])[1])
    budget = s.branch_budget or len(order) * k
    widths = branch_widths(branch_scores(torch.tensor(ent), torch.tensor(conf),
                                         s.entropy_weight), budget, s.width_max or 2 * k)
    parts, row_keys = [first], list(keys)
    for q, w in zip(order, widths):
        if w > 0:
            part = generate(run, [by_key[q]], w)
            parts.append(part)
            row_keys += [q] * len(part)
    generated = sum(len(p) for p in parts)
    count_rollouts(run, NAME, generated)
    batch = regroup(parts, row_keys, pad_id(run))
    keep: list[int] = []
    confidence = row_confidence(batch)
    for g in range(batch.num_groups):
        rows = (batch.group == g).nonzero().flatten().tolist()
        answers = [extract_answer(batch.texts[i], s.answer_regex) for i in rows]
        kept = (prune_rows(answers, confidence[rows], s.prune_quantile, s.min_keep)
                if s.prune else list(range(len(rows))))
        keep += [rows[j] for j in kept]
    pruned = len(batch) - len(keep)
    if pruned:  # the pruned rows stay inspectable until the next step
        kept_set = set(keep)
        run.plugin_resources(NAME)["pruned"] = batch.select(
            [i for i in range(len(batch)) if i not in kept_set])
        batch = batch.select(keep)
    else:
        run.plugin_resources(NAME).pop("pruned", None)
    _label_batch(batch, s.answer_regex)
    state["pruned"] += pruned
    stats = {
        "echo/rollouts": float(generated), "echo/pruned": float(pruned),
        "echo/branch_rollouts": float(sum(widths)), "echo/max_width": float(max(widths)),
        "echo/group_confidence": sum(conf) / max(len(conf), 1)}
    for key, value in stats.items():  # written with the step's metrics
        run.log(key, value)
    return batch


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    s: Settings = run.settings(NAME)
    if not all("echo" in row for row in batch.info):
        _label_batch(batch, s.answer_regex)
    return {"pseudo_correct": torch.tensor([
        float(row["echo"]["answer"] is not None and row["echo"]["answer"] == row["echo"]["label"])
        for row in batch.info])}
