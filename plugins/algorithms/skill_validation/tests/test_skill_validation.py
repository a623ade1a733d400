"""Skill validation: retrieval, prompt rendering, reward gaps and admission by hand, the sample
owner's matched halves at G completions per prompt, the evolve step, the claim (validated bank
vs admit-all with a half-helpful, half-harmful generator), and the example manifest."""

from __future__ import annotations

import json
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


METHODS = ["split", "guess", "reverse", "sort"]


def good_method(topic: int) -> str:
    """The one method that works on topic ``topic`` (the others rarely do)."""
    return METHODS[(topic * 3 + 1) % len(METHODS)]


class SkillWorld:
    """Env, rollout engine and scorer at once. Tasks "solve topic tN". A completion tries one
    method and says so ("tried sort: ok"); the topic's good method succeeds with probability
    0.8, any other with 0.1. The engine follows the skills in its prompt: when skills "use M on
    tN" for its topic are listed, it takes the last one listed with probability 0.8 (the
    latest instruction wins), else it picks a method uniformly. ``generated`` counts
    completions."""

    def __init__(self, seed: int = 0, topics: int = 4) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.topics = topics
        self.generated = 0

    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        size = int(run.config.train.prompts_per_step)
        topics = [(step * size + i) % self.topics for i in range(size)]
        return [Prompt(messages=[{"role": "user", "content": f"solve topic t{t}"}], answer=t,
                       id=f"{step}-{i}") for i, t in enumerate(topics)]

    def _draw(self) -> float:
        return float(torch.rand(1, generator=self.gen))

    def attempt(self, prompt) -> str:
        topic = int(prompt.answer)
        told = re.findall(rf"^- use (\w+) on t{topic}\b", prompt.messages[-1]["content"], re.M)
        if told and self._draw() < 0.8:
            method = told[-1]
        else:
            method = METHODS[int(self._draw() * len(METHODS)) % len(METHODS)]
        ok = self._draw() < (0.8 if method == good_method(topic) else 0.1)
        return f"tried {method}: {'ok' if ok else 'fail'}"

    @rlmix.hookimpl
    def rlmix_generate(self, run, request: GenerationRequest):
        rows = [p for p in request.prompts for _ in range(request.n)]
        texts = [self.attempt(p) for p in rows]
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
        return {"correct": torch.tensor([float(t.endswith(": ok")) for t in batch.texts])}


def helpful(skill: str) -> bool:
    topic, method = re.search(r"t(\d+)", skill), re.search(r"use (\w+)", skill)
    return bool(topic and method) and method.group(1) == good_method(int(topic.group(1)))


def careless_inducer():
    """A candidate generator induced from the base half: it reads the base attempts and writes
    "use M on tN" for the method of the best-scored attempt. Every other call it misreads the
    attempt and names the next method in the list instead (a defect of the generator, as a
    model's induced skills are of mixed utility): about half its candidates are harmful.
    ``calls`` records (helpful, base texts) per call."""
    calls: list[tuple[bool, list[str]]] = []

    def generate(prompt, texts, rewards):
        topic = int(prompt.answer)
        best = max(range(len(texts)), key=lambda i: (rewards[i], -i))
        method = re.match(r"tried (\w+)", texts[best]).group(1)
        if len(calls) % 2 == 1:  # the misreading
            method = METHODS[(METHODS.index(method) + 1) % len(METHODS)]
        skill = f"use {method} on t{topic}"
        calls.append((helpful(skill), list(texts)))
        return skill

    generate.calls = calls
    return generate


def _run(admit: str, seed: int, steps: int, prompts: int = 4, group: int = 8,
         tau: float = 0.0):
    world = SkillWorld(seed)
    run = make_run({"world": world, "skill_validation": sv},
                   [f"skill_validation.admit={admit}", f"skill_validation.tau={tau}",
                    f"train.prompts_per_step={prompts}", f"train.group_size={group}",
                    "skill_validation.k=2"])
    run.plugin_resources("skill_validation")["generator"] = generator = careless_inducer()
    per_step = []
    for step in range(steps):
        run.step = step
        before = world.generated
        batch = run.sample(run.hook.rlmix_prompts(run=run, step=step))
        loop.score(run, batch)
        run.hook.rlmix_evolve(run=run, batch=batch)
        per_step.append(world.generated - before)
    bank = run.state["skill_validation"]["bank"]
    precision = sum(helpful(s["text"]) for s in bank) / max(1, len(bank))
    run.resources["generator_helpful"] = (sum(h for h, _ in generator.calls) /
                                          max(1, len(generator.calls)))
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


def test_the_inducer_reads_the_base_half():
    gen = careless_inducer()
    prompt = Prompt(messages=[{"role": "user", "content": "solve topic t1"}], answer=1)
    texts = ["tried split: fail", "tried sort: ok", "tried guess: ok"]
    assert gen(prompt, texts, [0.0, 1.0, 1.0]) == "use sort on t1"  # the best attempt
    assert gen(prompt, texts, [0.0, 1.0, 1.0]) == "use split on t1"  # misread: the next one
    assert gen(prompt, texts, [1.0, 0.0, 0.0]) == "use split on t1"
    assert [h for h, _ in gen.calls] == [good_method(1) == m for m in ("sort", "split",
                                                                         "split")]


def test_claim_validated_bank_is_mostly_helpful_admit_all_is_not():
    """Four seeds, 15 steps of 4 prompts x 16 (halves of 8), tau 0.15, the careless inducer
    (about half its candidates harmful): the validated banks, pooled, are >= 0.8 helpful;
    admit-all stores exactly what the generator wrote, pooled <= 0.5 helpful."""
    steps = 15
    v_helpful = v_stored = a_helpful = a_stored = 0
    for seed in range(4):
        validated, v_steps, v_bank, _, _ = _run("validated", seed, steps, group=16, tau=0.15)
        admit_all, a_steps, a_bank, _, a_run = _run("all", seed, steps, group=16, tau=0.15)
        assert v_steps == a_steps == [64] * steps  # G x P per step in both arms
        assert len(a_bank) == 4 * steps and len(v_bank) >= 4
        # admit-all keeps the generator's own rate, about half helpful on every seed
        assert admit_all == pytest.approx(a_run.resources["generator_helpful"])
        assert 0.3 <= admit_all <= 0.6
        assert validated > admit_all + 0.25  # every seed
        v_helpful += sum(helpful(s["text"]) for s in v_bank)
        v_stored += len(v_bank)
        a_helpful += sum(helpful(s["text"]) for s in a_bank)
        a_stored += len(a_bank)
    assert v_helpful / v_stored >= 0.8
    assert a_helpful / a_stored <= 0.5


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
