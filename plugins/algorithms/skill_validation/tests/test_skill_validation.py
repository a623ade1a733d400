"""Skill validation: retrieval, prompt rendering, reward gaps and admission by hand, the sample
owner's matched halves at G completions per prompt, the evolve step, the claim (validated bank
vs admit-all with a half-helpful, half-harmful generator), and the example manifest."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import rlmix_skill_validation as sv
import torch
from omegaconf import OmegaConf
from rlmix_lm.judges import ScriptedJudge

import rlmix
from rlmix import cli, loop
from rlmix.testing import make_run, skip_unless_installed
from rlmix.types import GenerationRequest, Prompt, RolloutBatch

EXAMPLE = Path(sv.__file__).parents[4] / "examples" / "rewards" / "skill_validation-arith.yaml"

# ---------------------------------------------------------------- pure functions


def test_retrieve_by_task_similarity_then_gap():
    bank = [{"text": "a", "task": "topic t0 add", "gap": 0.1},
            {"text": "b", "task": "topic t1 add", "gap": 0.9},
            {"text": "c", "task": "topic t0 add", "gap": 0.5}]
    assert [s["text"] for s in sv.retrieve(bank, "topic t0 add", 2)] == ["c", "a"]
    assert [s["text"] for s in sv.retrieve(bank, "topic t1 add", 1)] == ["b"]
    assert sv.retrieve(bank, "x", 0) == []


def test_with_skills_appends_to_the_last_user_message_and_copies():
    p = Prompt(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
               answer=3, id="p1")
    got = sv.with_skills(p, ["one", "two"])
    assert got.messages[1]["content"] == "q\n\nSkills:\n- one\n- two"
    assert p.messages[1]["content"] == "q" and got.answer == 3 and got.id == "p1"
    assert sv.with_skills(p, []) is p


def test_reward_gaps_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    aug = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1]).bool()
    # group 0: 1.0 - 0.5; group 1: 0.5 - 0.0
    assert sv.reward_gaps(rewards, group, aug).tolist() == [0.5, 0.5]
    assert sv.reward_gaps(rewards, group, torch.zeros(8).bool()).tolist() == [0.0, 0.0]


def test_admit_threshold_all_and_bank_cap():
    bank: list = []
    assert not sv.admit(bank, {"text": "x"}, 0.0, tau=0.0)  # strictly above tau
    assert sv.admit(bank, {"text": "y"}, 0.25, tau=0.0)
    assert sv.admit(bank, {"text": "z"}, -1.0, tau=0.0, mode="all")
    assert [s["text"] for s in bank] == ["y", "z"]
    sv.admit(bank, {"text": "w"}, 0.5, tau=0.0, max_bank=2)  # drops the lowest gap
    assert [s["text"] for s in bank] == ["y", "w"]


# ---------------------------------------------------------------- a world where skills matter


class SkillWorld:
    """Env, rollout engine and scorer at once. Tasks "solve topic tN"; a completion is "1"
    (success) with probability 0.3 + 0.2 per helpful skill - 0.2 per harmful skill listed in
    its prompt (clipped to [0.05, 0.95]). ``generated`` counts completions."""

    def __init__(self, seed: int = 0, topics: int = 4) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.topics = topics
        self.generated = 0
        self.requests: list[list[str]] = []

    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        size = int(run.config.train.prompts_per_step)
        topics = [(step * size + i) % self.topics for i in range(size)]
        return [Prompt(messages=[{"role": "user", "content": f"solve topic t{t}"}], answer=1,
                       id=f"{step}-{i}") for i, t in enumerate(topics)]

    @staticmethod
    def rate(text: str) -> float:
        helpful = len(re.findall(r"^- helpful", text, re.M))
        harmful = len(re.findall(r"^- harmful", text, re.M))
        return min(0.95, max(0.05, 0.3 + 0.2 * helpful - 0.2 * harmful))

    @rlmix.hookimpl
    def rlmix_generate(self, run, request: GenerationRequest):
        texts, rows = [], []
        for p in request.prompts:
            rate = self.rate(p.messages[-1]["content"])
            self.requests.append([p.messages[-1]["content"]] * request.n)
            for _ in range(request.n):
                texts.append("1" if float(torch.rand(1, generator=self.gen)) < rate else "0")
                rows.append(p)
        n = len(texts)
        self.generated += n
        cmask = torch.tensor([[0.0, 1.0]]).repeat(n, 1)
        return RolloutBatch(
            group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
            tokens=torch.ones(n, 2, dtype=torch.long), attention_mask=torch.ones(n, 2,
                                                                                 dtype=torch.long),
            completion_mask=cmask, behavior_logp=-0.5 * cmask,
            policy_version=torch.zeros(n, dtype=torch.long), texts=texts, prompts=rows)

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        return {"correct": torch.tensor([float(t == "1") for t in batch.texts])}


def half_and_half(seed: int):
    """A candidate generator whose skills are exactly half helpful, half harmful: each pair of
    calls gives one of each, in a random order."""
    rng = random.Random(seed)
    count = {"n": 0}
    pair: list[str] = []

    def generate(prompt, texts, rewards):
        count["n"] += 1
        if not pair:
            pair.extend(rng.sample(["helpful", "harmful"], 2))
        kind = pair.pop()
        return f"{kind} skill {count['n']} for {prompt.messages[-1]['content'].split()[-1]}"

    return generate


def _run(admit: str, seed: int, steps: int, prompts: int = 4, group: int = 8,
         tau: float = 0.0):
    world = SkillWorld(seed)
    run = make_run({"world": world, "skill_validation": sv},
                   [f"skill_validation.admit={admit}", f"skill_validation.tau={tau}",
                    f"train.prompts_per_step={prompts}", f"train.group_size={group}",
                    "skill_validation.k=2"])
    run.resources["skill_validation.generator"] = half_and_half(seed)
    per_step = []
    for step in range(steps):
        run.step = step
        before = world.generated
        batch = run.sample(run.hook.rlmix_prompts(run=run, step=step))
        loop.score(run, batch)
        run.hook.rlmix_evolve(run=run, batch=batch)
        per_step.append(world.generated - before)
    bank = run.state["skill_validation"]["bank"]
    precision = sum(s["text"].startswith("helpful") for s in bank) / max(1, len(bank))
    return precision, per_step, bank, world, run


def test_sample_owner_makes_matched_halves_without_extra_rollouts():
    precision, per_step, bank, world, run = _run("all", 0, 2)
    assert per_step == [32, 32]  # G x P completions, no extra rollouts
    batch = run.sample(run.hook.rlmix_prompts(run=run, step=2))
    assert len(batch) == 32 and batch.group.tolist() == [g for g in range(4) for _ in range(8)]
    for g in range(4):
        rows = [i for i in range(32) if int(batch.group[i]) == g]
        metas = [batch.info[i]["skill_validation"] for i in rows]
        assert [m["arm"] for m in metas] == ["base"] * 4 + ["skill"] * 4
        prompts = [batch.prompts[i].messages[-1]["content"] for i in rows]
        base, skill = prompts[0], prompts[-1]
        # the same task and retrieved skills; the skill half has the candidate on top
        assert skill.startswith(base) and skill.endswith("- " + metas[0]["candidate"])
        assert len(set(prompts[:4])) == 1 and len(set(prompts[4:])) == 1


def test_evolve_stores_only_candidates_above_tau():
    run = make_run({"skill_validation": sv}, ["skill_validation.tau=0.2"])
    infos = [{"skill_validation": {"arm": arm, "candidate": cand, "task": "t", "retrieved": []}}
             for cand in ("good", "bad") for arm in ("base", "base", "skill", "skill")]
    batch = RolloutBatch(group=torch.tensor([0] * 4 + [1] * 4), tokens=torch.ones(8, 2).long(),
                         attention_mask=torch.ones(8, 2).long(),
                         completion_mask=torch.ones(8, 2), behavior_logp=torch.zeros(8, 2),
                         policy_version=torch.zeros(8).long(), texts=[""] * 8, info=infos,
                         rewards=torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
    sv.rlmix_evolve(run, batch)
    bank = run.state["skill_validation"]["bank"]
    assert [(s["text"], s["gap"]) for s in bank] == [("good", 0.5)]  # "bad": gap -0.5
    assert run.pending_metrics["skill_validation/admitted"] == 1


def test_lm_generator_through_a_scripted_model():
    world = SkillWorld(0)
    run = make_run({"world": world, "skill_validation": sv},
                   ["train.prompts_per_step=1", "train.group_size=4"])
    judge = ScriptedJudge(lambda text: "helpful: check the topic first\nmore text")
    run.resources["skill_validation.lm"] = judge
    batch = run.sample(run.hook.rlmix_prompts(run=run, step=0))
    assert judge.calls == 1 and "solve topic t0" in judge.prompts[0]
    assert batch.info[-1]["skill_validation"]["candidate"] == "helpful: check the topic first"
    assert run.pending_metrics["skill_validation/generator_calls"] == 1


def test_settings_are_checked():
    with pytest.raises(ValueError, match="admit"):
        sv.Settings(admit="some")
    with pytest.raises(ValueError, match="max_bank"):
        sv.Settings(max_bank=0)


# ---------------------------------------------------------------- the claim


def test_claim_validated_bank_is_mostly_helpful_admit_all_is_not():
    """Four seeds, 15 steps of 4 prompts x 16 (halves of 8), tau 0.15: the validated banks,
    pooled, are >= 0.8 helpful; admitting every candidate gives the generator's 0.5."""
    steps, helpful, stored = 15, 0, 0
    for seed in range(4):
        validated, v_steps, v_bank, _, _ = _run("validated", seed, steps, group=16, tau=0.15)
        admit_all, a_steps, a_bank, _, _ = _run("all", seed, steps, group=16, tau=0.15)
        assert v_steps == a_steps == [64] * steps  # G x P per step in both arms
        assert len(a_bank) == 4 * steps and len(v_bank) >= 8
        assert admit_all <= 0.5  # the generator's own rate
        assert validated > admit_all + 0.2  # every seed
        helpful += sum(s["text"].startswith("helpful") for s in v_bank)
        stored += len(v_bank)
    assert helpful / stored >= 0.8


# ---------------------------------------------------------------- the example manifest


def test_example_manifest_runs_on_tiny_random(tmp_path):
    skip_unless_installed(EXAMPLE)
    cfg = OmegaConf.load(EXAMPLE)
    assert cfg.model == "tiny-random" and "skill_validation" in cfg.plugins
    out = tmp_path / "ex"
    assert cli.main(["run", str(EXAMPLE), "train.steps=2", "arith.eval_size=2",
                     "arith.eval_max_new_tokens=4", "sampling.max_new_tokens=6",
                     "skill_validation.lm.max_new_tokens=8", "log.progress=false",
                     "log.plot=false", "train.eval_every=0", f"out={out}"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["skill_validation/generator_calls"] == 2
    assert "skill_validation/bank_size" in rows[-1]
