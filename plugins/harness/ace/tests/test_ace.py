"""Tests of ACE: bullet ids, delta operations and their deterministic merge, counters, pruning,
de-duplication, citations, the reflector / curator round on a toy env, the flip gate, and the
paper's claim in miniature: incremental delta updates keep what earlier steps learnt, where
rewriting the context from the latest lessons loses it (context collapse)."""

from __future__ import annotations

import re

import pytest
import rlmix_ace
import torch
from rlmix_ace import (
    apply_operations,
    bullet_id,
    deduplicate,
    new_playbook,
    parse_citations,
    parse_lessons,
    parse_operations,
    parse_tags,
    prune,
    render,
    similarity,
    update_counters,
)
from rlmix_lm.chat_server import ScriptedLM

import rlmix
from rlmix import loop
from rlmix.testing import make_run
from rlmix.types import Prompt, RolloutBatch

# ---------------------------------------------------------------- playbook pieces


def test_bullet_ids_are_letters_only_and_unique():
    ids = [bullet_id(n) for n in range(800)]
    assert ids[:3] == ["b-a", "b-b", "b-c"] and ids[25] == "b-z" and ids[26] == "b-ba"
    assert len(set(ids)) == 800
    assert not any(ch.isdigit() for i in ids for ch in i)


def test_parse_operations_citations_tags_lessons():
    text = ("Here you go:\nADD: Carry the one.\n- UPDATE b-c: Check signs first.\n"
            "REMOVE b-a\nUPDATE: no id\nADD:\nremove b-b because\nnonsense")
    assert parse_operations(text) == [
        {"op": "ADD", "text": "Carry the one."},
        {"op": "UPDATE", "id": "b-c", "text": "Check signs first."},
        {"op": "REMOVE", "id": "b-a"},
        {"op": "REMOVE", "id": "b-b"},
    ]
    assert parse_citations("[b-c] [b-a] then [b-c] and [x-1]") == ["b-c", "b-a"]
    assert parse_tags("b-a: helpful\nb-b -> HARMFUL\nb-a: neutral") == {"b-a": "neutral",
                                                                       "b-b": "harmful"}
    assert parse_lessons("ok\nLESSON: add tens\nlesson: keep short\nLESSON: <a short tip>\n"
                         ) == ["add tens", "keep short"]


def test_delta_merge_is_deterministic_and_never_a_rewrite():
    book = new_playbook(["Add the ones digit first.", "Write only the number."])
    ops = [{"op": "ADD", "text": "Carry when the sum passes nine."},
           {"op": "ADD", "text": "add the ones digit first"},  # near-duplicate of b-a
           {"op": "UPDATE", "id": "b-z", "text": "unknown id"},
           {"op": "UPDATE", "id": "b-b", "text": "Reply with the number alone."},
           {"op": "REMOVE", "id": "b-a"},
           {"op": "ADD", "text": "one op too many"}]
    log = apply_operations(book, ops, max_ops=3, max_bullets=10, threshold=0.8)
    assert [e["result"] for e in log] == [
        "added", "skipped: near-duplicate of b-a", "skipped: no bullet b-z", "updated",
        "removed", "skipped: max_ops reached"]
    assert [(b["id"], b["text"]) for b in book["bullets"]] == [
        ("b-b", "Reply with the number alone."), ("b-c", "Carry when the sum passes nine.")]
    again = new_playbook(["Add the ones digit first.", "Write only the number."])
    apply_operations(again, ops, max_ops=3, max_bullets=10, threshold=0.8)
    assert again == book
    # a full playbook refuses ADDs; ids are never reused after a removal
    full = new_playbook(["x one", "y two"])
    log = apply_operations(full, [{"op": "REMOVE", "id": "b-a"}, {"op": "ADD", "text": "z"},
                                  {"op": "ADD", "text": "w"}], 5, 2, 0.8)
    assert [e["result"] for e in log] == ["removed", "added", "skipped: playbook full"]
    assert [b["id"] for b in full["bullets"]] == ["b-b", "b-c"]


def test_counters_prune_and_dedup():
    book = new_playbook(["alpha tip", "beta tip", "gamma tip"])
    update_counters(book, [("b-a", "helpful"), ("b-b", "harmful"), ("b-b", "harmful"),
                           ("b-b", "harmful"), ("b-c", "neutral"), ("b-q", "helpful")])
    counts = {b["id"]: (b["helpful"], b["harmful"]) for b in book["bullets"]}
    assert counts == {"b-a": (1, 0), "b-b": (0, 3), "b-c": (0, 0)}
    assert prune(book, 0) == []
    assert prune(book, 3) == ["b-b"]
    book = new_playbook(["Carry the one when needed.", "Other advice entirely.",
                         "carry the one, when needed!"])
    update_counters(book, [("b-a", "helpful"), ("b-c", "helpful"), ("b-c", "harmful")])
    assert deduplicate(book, 0.8) == [("b-c", "b-a")]
    assert [(b["id"], b["helpful"], b["harmful"]) for b in book["bullets"]] == [
        ("b-a", 2, 1), ("b-b", 0, 0)]


def test_similarity_bounds():
    assert similarity("Carry the one.", "carry THE one") == 1.0
    assert similarity("add tens first", "never use commas") == 0.0
    # one changed word: 6 of 8 words shared; difflib's character ratio calls it nearly equal
    a, b = "for such topics use the word alpha", "for such topics use the word beta"
    assert similarity(a, b) == pytest.approx(6 / 8)
    assert similarity(a, b, "difflib") > 0.85


def test_render_keeps_the_preamble():
    book = new_playbook(["tip one"])
    text = render(book, "Playbook:", "You are careful.")
    assert text == "You are careful.\nPlaybook:\n[b-a] tip one"
    assert render(new_playbook(), "Playbook:", "You are careful.") == "You are careful."


# ---------------------------------------------------------------- a toy env

HINTS = {"t0": "alpha", "t1": "beta", "t2": "gamma", "t3": "delta"}


class ToyEnv:
    """Topic ``t{(step+i) % k}``; the toy model is right when the topic's hint word is in the
    system prompt, and cites the bullets that hold it. Feedback names the missing word."""

    topics = 4

    @rlmix.hookimpl
    def rlmix_prompts(self, run, step):
        out = []
        for i in range(int(run.config.train.prompts_per_step)):
            topic = f"t{(step + i) % self.topics}"
            messages = [{"role": "user", "content": f"Question {step}.{i} on topic {topic}."}]
            if run.harness.get("system"):
                messages.insert(0, {"role": "system", "content": run.harness["system"]})
            out.append(Prompt(messages=messages, answer=topic))
        return out

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        correct = []
        for info, text, prompt in zip(batch.info, batch.texts, batch.prompts):
            ok = text.endswith(f"ANSWER {prompt.answer}")
            correct.append(float(ok))
            info["toy"] = {} if ok else {"hint": f"use the word {HINTS[prompt.answer]}"}
        return {"correct": torch.tensor(correct)}


class ToyModel:
    @rlmix.hookimpl
    def rlmix_generate(self, run, request):
        texts = []
        for p in request.prompts:
            topic = re.search(r"topic (t\d)", p.messages[-1]["content"]).group(1)
            system = p.messages[0]["content"] if p.messages[0]["role"] == "system" else ""
            cites = [f"[{m}]" for m, line in re.findall(r"\[(b-[a-z]+)\] (.*)", system)
                     if HINTS[topic] in line.split()]
            texts.append(" ".join([*cites, f"ANSWER {topic}" if cites else "no idea"]))
        n = len(texts) * request.n
        texts = [t for t in texts for _ in range(request.n)]
        return RolloutBatch(group=torch.arange(len(request.prompts)).repeat_interleave(request.n),
                            tokens=torch.zeros(n, 2, dtype=torch.long),
                            attention_mask=torch.ones(n, 2, dtype=torch.long),
                            completion_mask=torch.tensor([[0.0, 1.0]] * n),
                            behavior_logp=torch.zeros(n, 2),
                            policy_version=torch.zeros(n, dtype=torch.long), texts=texts,
                            prompts=[p for p in request.prompts for _ in range(request.n)])


def scripted_reply(prompt: str) -> str:
    """Reflector: tags cited bullets by the outcome and turns feedback into a lesson. Curator:
    one ADD per new lesson."""
    if prompt.startswith("You review"):
        lines = []
        tag = "helpful" if "(success)" in prompt else "harmful"
        lines += [f"{bid}: {tag}" for bid in re.findall(r"^\[(b-[a-z]+)\]", prompt, re.M)]
        word = re.search(r"use the word (\w+)", prompt)
        if word:
            lines.append(f"LESSON: for such topics use the word {word.group(1)}")
        return "\n".join(lines)
    lessons = re.findall(r"^- (.+)$", prompt, re.M)
    return "\n".join(f"ADD: {x}" for x in lessons)


def toy_run(tmp_path, *overrides, gates=False):
    plugins = {"toyenv": ToyEnv(), "toymodel": ToyModel()}
    if gates:
        # not a dependency of ace: skipped when installed alone (nox -s isolated)
        plugins["gates"] = pytest.importorskip("rlmix_gates")
    plugins["ace"] = rlmix_ace
    run = make_run(plugins, [f"out={tmp_path}", "train.prompts_per_step=4",
                             "train.group_size=2", "harness.system=You are careful.",
                             "ace.reflect_samples=4", *overrides])
    loop.configure(run)
    run.resources["ace.lm"] = ScriptedLM(reply=scripted_reply)
    return run


def one_step(run):
    prompts = run.hook.rlmix_prompts(run=run, step=run.step)
    batch = run.sample(prompts)
    loop.score(run, batch)
    for update in run.hook.rlmix_evolve(run=run, batch=batch):
        if update is not None:
            loop.apply_harness_update(run, update)
    run.step += 1
    return float(batch.rewards.mean())


def test_round_adds_lessons_cites_tags_and_renders(tmp_path):
    run = toy_run(tmp_path)
    assert one_step(run) == 0.0
    book = run.state["ace"]["book"]
    words = sorted(w for b in book["bullets"] for w in HINTS.values() if w in b["text"])
    assert words == sorted(HINTS.values())
    assert run.harness["system"].startswith("You are careful.\nPlaybook.")
    assert run.harness_version == 1
    assert one_step(run) == 1.0  # every topic now finds its bullet
    # the cited bullets were tagged helpful by the reflector
    assert sum(b["helpful"] for b in run.state["ace"]["book"]["bullets"]) > 0
    record = (tmp_path / "harness" / "v0001.json").read_text()
    assert "ADD" in record and '"source": "ace"' in record


def test_reward_tagging_when_the_lm_tags_nothing(tmp_path):
    run = toy_run(tmp_path, "ace.tagging=reward", "ace.initial=[use alpha here,use gamma now]")
    run.resources["ace.lm"] = ScriptedLM(["nothing useful"])
    assert "[b-a] use alpha here" in run.harness["system"]
    one_step(run)
    counts = {b["id"]: (b["helpful"], b["harmful"]) for b in run.state["ace"]["book"]["bullets"]}
    # topics t0 (alpha) and t2 (gamma) succeed and cite their bullet, twice per group of 2
    assert counts == {"b-a": (2, 0), "b-b": (2, 0)}


def test_claim_delta_updates_keep_knowledge_that_rewrites_lose(tmp_path):
    """One new topic per step. Rewriting the context from the latest lessons (the collapse ACE
    avoids) forgets the earlier topics; the delta-updated playbook keeps every one."""
    run = toy_run(tmp_path)
    rewrite_system = "You are careful."
    for step in range(4):
        prompts = [Prompt(messages=[{"role": "system", "content": run.harness["system"]},
                                    {"role": "user", "content": f"Question {step}.0 on topic "
                                                                f"t{step}."}],
                          answer=f"t{step}")] * 2
        batch = run.sample(prompts)
        loop.score(run, batch)
        for update in run.hook.rlmix_evolve(run=run, batch=batch):
            if update is not None:
                loop.apply_harness_update(run, update)
        run.step += 1
        lessons = run.state["ace"]["log"][-1]["lessons"]
        if lessons:  # the baseline: the whole context rewritten from this step's lessons
            rewrite_system = "You are careful.\nPlaybook.\n" + "\n".join(
                f"[{bullet_id(k)}] {x}" for k, x in enumerate(lessons))
    assert len(run.state["ace"]["book"]["bullets"]) == 4
    assert _accuracy(run, run.harness["system"]) == 1.0
    assert _accuracy(run, rewrite_system) == 0.25


def _accuracy(run, system):
    prompts = [Prompt(messages=[{"role": "system", "content": system},
                                {"role": "user", "content": f"Question 0.0 on topic t{k}."}],
                      answer=f"t{k}") for k in range(4)]
    batch = run.generate(prompts)
    loop.score(run, batch)
    return float(batch.rewards.mean())


def test_flip_gate_undoes_a_harmful_edit(tmp_path):
    run = toy_run(tmp_path, "ace.initial=[use alpha here]", "ace.check_size=4", gates=True)

    def vandal(prompt: str) -> str:  # the curator removes the bullet that works
        if prompt.startswith("You review"):
            return "LESSON: be bold"
        return "REMOVE b-a\nADD: be bold"

    run.resources["ace.lm"] = ScriptedLM(reply=vandal)
    before = run.harness["system"]
    one_step(run)
    assert run.harness["system"] == before and run.harness_version == 0
    assert run.state["ace"]["rejected"] == 1
    assert [b["text"] for b in run.state["ace"]["book"]["bullets"]] == ["use alpha here"]
    assert "pass->fail" in run.state["ace"]["log"][-1]["gate"]


def test_settings_errors():
    with pytest.raises(rlmix.ManifestError, match="ace.tagging"):
        make_run({"ace": rlmix_ace}, ["ace.tagging=vibes"])
    with pytest.raises(rlmix.ManifestError, match="ace.dedup_threshold"):
        make_run({"ace": rlmix_ace}, ["ace.dedup_threshold=0"])
