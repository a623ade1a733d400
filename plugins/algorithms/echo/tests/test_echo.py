"""Tests of ECHO's rollout side: answer extraction, majority vote, branch scores and widths,
pruning by hand; the wrapper's budget, cap, pruning and labels on a synthetic env; the
pseudo-label score term; settings checks; and the claim: at the same rollout budget, ECHO's
majority-vote pseudo-labels are right more often than plain test-time RL's (uniform groups, no
pruning), and what it prunes are low-confidence, mostly wrong branches."""

from __future__ import annotations

import random

import pytest
import rlmix_echo
import torch
from rlmix_echo import branch_scores, branch_widths, extract_answer, majority_vote, prune_rows

import rlmix
from rlmix.loop import score
from rlmix.testing import make_run
from rlmix.types import Prompt, RolloutBatch


class VoteEnv:
    """Prompt i has answer ``100 + i``; a completion is right with probability ``rates[i]``
    (confident: mean token log-prob about -0.4), else one of three wrong answers (about -1.2).
    ``generated`` counts completions."""

    def __init__(self, rates, seed=0):
        self.rates = rates
        self.gen = torch.Generator().manual_seed(seed)
        self.generated = 0

    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        size = int(run.config.train.prompts_per_step)
        idx = [(step * size + j) % len(self.rates) for j in range(size)]
        return [Prompt(messages=[{"role": "user", "content": f"q {i}"}], answer=100 + i)
                for i in idx]

    @rlmix.hookimpl
    def rlmix_generate(self, run, request):
        texts, logps = [], []
        for p in request.prompts:
            rate = self.rates[p.answer - 100]
            for _ in range(request.n):
                right = float(torch.rand(1, generator=self.gen)) < rate
                wrong = int(torch.randint(1, 4, (1,), generator=self.gen))
                texts.append(f"so {p.answer if right else p.answer + wrong}")
                mean = -0.4 if right else -1.2
                logps.append(mean + 0.35 * float(torch.randn(1, generator=self.gen)))
        n = len(texts)
        self.generated += n
        cmask = torch.tensor([[0.0, 1.0, 1.0]]).repeat(n, 1)
        return RolloutBatch(
            group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
            tokens=torch.ones(n, 3, dtype=torch.long), attention_mask=torch.ones(n, 3),
            completion_mask=cmask, behavior_logp=torch.tensor(logps)[:, None] * cmask,
            policy_version=torch.zeros(n, dtype=torch.long), texts=texts,
            prompts=[p for p in request.prompts for _ in range(request.n)])


def test_extract_answer_and_majority_vote():
    assert extract_answer("so 1,234 or 17", r"-?\d+") == "17"
    assert extract_answer("none", r"-?\d+") is None
    assert majority_vote(["3", "4", "3", None]) == ("3", 0.5)
    assert majority_vote(["4", "3", "3", "4"]) == ("4", 0.5)  # ties to the first seen
    assert majority_vote([None, None]) == (None, 0.0)


def test_branch_scores_and_widths_by_hand():
    ent = torch.tensor([1.0, 3.0, 2.0])
    conf = torch.tensor([1.0, 0.5, 0.5])
    scores = branch_scores(ent, conf, 1.0)  # H/mean(H) = 0.5, 1.5, 1.0
    torch.testing.assert_close(scores, torch.tensor([0.0, 0.5 * 2.5, 0.5 * 2.0]))
    assert branch_widths(scores, 9, 100) == [0, 5, 4]
    assert branch_widths(scores, 9, 4) == [1, 4, 4]  # the cap sends the rest elsewhere
    assert branch_widths(torch.zeros(3), 6, 10) == [2, 2, 2]
    assert branch_widths(scores, 20, 3) == [3, 3, 3]  # all capped: the rest is not spent


def test_prune_rows_drops_low_confidence_dissenters_of_the_confident_majority():
    answers = ["5", "5", "6", "7", "6", "5"]
    conf = torch.tensor([-0.2, -1.5, -1.4, -0.3, -1.3, -0.4])
    # quantile 0.5 of conf = -0.85; the confident rows 0, 3, 5 vote "5"; the low-confidence
    # rows 2 and 4 ("6") disagree and go, row 1 ("5") agrees and stays
    assert prune_rows(answers, conf, 0.5, 2) == [0, 1, 3, 5]
    assert prune_rows(answers, conf, 0.0, 2) == list(range(6))
    # a low-confidence majority loses to the confident rows' answer
    answers = ["6", "6", "6", "5", "5"]
    conf = torch.tensor([-1.5, -1.4, -1.6, -0.2, -0.3])
    kept = prune_rows(answers, conf, 0.6, 2)
    assert kept == [3, 4] and majority_vote([answers[i] for i in kept])[0] == "5"
    assert prune_rows(["1", "2", "3"], torch.tensor([-3.0, -2.0, -1.0]), 0.9, 2) == [1, 2]


def _run(env, echo=True, group_size=4, overrides=()):
    plugins = {"env": env, "echo": rlmix_echo} if echo else {"env": env}
    return make_run(plugins, ["train.prompts_per_step=8", f"train.group_size={group_size}",
                              *overrides])


def test_wrapper_budget_cap_pruning_and_labels():
    env = VoteEnv([0.3, 1.0, 0.5, 0.5, 1.0, 0.4, 0.6, 0.9], seed=2)
    run = _run(env, overrides=["echo.width_max=6"])
    batch = run.sample(run.hook.rlmix_prompts(run=run, step=0))
    assert env.generated == 64 == run.state["echo"]["rollouts"]  # 8 x 4 roots + 32 branches
    stats = run.pending_metrics
    assert stats["echo/max_width"] <= 6 and stats["echo/branch_rollouts"] == 32
    assert len(batch) == 64 - stats["echo/pruned"]
    terms = rlmix_echo.rlmix_score(run=run, batch=batch)["pseudo_correct"]
    for i, row in enumerate(batch.info):
        assert terms[i] == float(row["echo"]["answer"] == row["echo"]["label"])
    score(run, batch)
    assert "echo.pseudo_correct" in batch.reward_terms


def test_score_term_without_the_wrapper_labels_by_majority():
    env = VoteEnv([0.5])
    run = _run(env, echo=True)
    batch = env.rlmix_generate(run, rlmix.GenerationRequest(prompts=run.hook.rlmix_prompts(
        run=run, step=0)[:1], n=6))
    terms = rlmix_echo.rlmix_score(run=run, batch=batch)["pseudo_correct"]
    label, _ = majority_vote([extract_answer(t, r"-?\d+") for t in batch.texts])
    assert terms.tolist() == [float(extract_answer(t, r"-?\d+") == label) for t in batch.texts]


@pytest.mark.parametrize("override", ["echo.answer_regex=(", "echo.prune_quantile=1",
                                      "echo.min_keep=0", "echo.width_max=-1"])
def test_bad_settings_are_rejected_naming_the_setting(override):
    name = override.split(".")[1].split("=")[0]
    with pytest.raises(rlmix.ConfigError, match=name.split("_")[0]):
        _run(VoteEnv([0.5]), overrides=[override])


def test_claim_more_accurate_pseudo_labels_at_equal_budget_and_pruning_hits_wrong_branches():
    rates = [0.95] * 20 + [0.45] * 20 + [0.35] * 20
    random.Random(0).shuffle(rates)
    steps = 30  # 240 prompt visits
    env_t, env_e = VoteEnv(rates, seed=9), VoteEnv(rates, seed=9)
    run_t, run_e = _run(env_t, echo=False, group_size=8), _run(env_e)
    right_t = right_e = total = 0
    pruned_right = pruned = kept_right = kept = 0
    for step in range(steps):
        for run in (run_t, run_e):
            run.step = step
        plain = run_t.sample(run_t.hook.rlmix_prompts(run=run_t, step=step))
        for g in range(plain.num_groups):
            rows = (plain.group == g).nonzero().flatten().tolist()
            label, _ = majority_vote([extract_answer(plain.texts[i], r"-?\d+") for i in rows])
            right_t += label == str(plain.prompts[rows[0]].answer)
        prompts = run_e.hook.rlmix_prompts(run=run_e, step=step)
        before = env_e.generated
        batch = run_e.sample(prompts)
        total += batch.num_groups
        for g in range(batch.num_groups):
            row = int((batch.group == g).nonzero()[0])
            right_e += batch.info[row]["echo"]["label"] == str(batch.prompts[row].answer)
        gone = run_e.plugin_resources("echo").get("pruned")
        if gone is not None:
            pruned += len(gone)
            pruned_right += sum(t == f"so {p.answer}" for t, p in zip(gone.texts, gone.prompts))
        kept += len(batch)
        kept_right += sum(t == f"so {p.answer}" for t, p in zip(batch.texts, batch.prompts))
        assert env_e.generated - before == 64
    assert env_t.generated == env_e.generated == run_e.state["echo"]["rollouts"] == steps * 64
    assert right_e > right_t + 0.04 * total  # pseudo-labels right more often, same budget
    # pruning hits the low-confidence dissenters: mostly wrong branches
    assert pruned > 0.05 * kept
    assert pruned_right / pruned < 0.5 * kept_right / kept
