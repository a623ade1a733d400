"""Tests of the stream env: the schedule (phases, mixes, stay / cycle, reserved steps), tasks
and their answers, determinism in seed and step, the held-out split, prompts built from the
harness, scoring and feedback, the per-step accuracy per kind, evaluation per kind through the
prompt hook, settings errors, and a 2-step run of the example manifest with tiny-random."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import rlmix_stream
import torch
from rlmix_stream import (
    Phase,
    eval_tasks,
    kinds_at,
    make_task,
    parse_answer,
    phase_index,
    schedule_kinds,
)

import rlmix
from rlmix import cli, loop
from rlmix.testing import make_batch, make_run, skip_unless_installed

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "envs" / "stream.yaml"
SCHEDULE = "stream.schedule=[{kind: add, steps: 2}, {kind: sub, steps: 3}, {kind: word, steps: 1}]"


def stream_run(*overrides, plugins=None):
    run = make_run(plugins or {"stream": rlmix_stream},
                   [SCHEDULE, "train.prompts_per_step=4", *overrides])
    rlmix_stream.rlmix_configure(run)
    return run


# ---------------------------------------------------------------- schedule


def test_phase_index_follows_the_schedule_then_stays_or_cycles():
    sched = [Phase("add", 2), Phase("sub", 3), Phase("word", 1)]
    assert [phase_index(sched, s) for s in range(6)] == [0, 0, 1, 1, 1, 2]
    assert [phase_index(sched, s, "stay") for s in (6, 7, 100)] == [2, 2, 2]
    assert [phase_index(sched, s, "cycle") for s in (6, 7, 8, 11, 12)] == [0, 0, 1, 2, 0]


def test_prompts_take_the_kind_of_their_phase():
    run = stream_run()
    kinds = [{p.info["kind"] for p in rlmix_stream.prompts_at(run, s)} for s in range(8)]
    assert kinds == [{"add"}] * 2 + [{"sub"}] * 3 + [{"word"}] * 3  # stays in the last phase
    run = stream_run("stream.after=cycle")
    assert {p.info["kind"] for p in rlmix_stream.prompts_at(run, 6)} == {"add"}


def test_a_mixed_phase_draws_each_kind_and_reserved_steps_mix_all():
    run = stream_run("stream.schedule=[{kind: add, steps: 1}, {kind: 'sub+word', steps: 40}]")
    s = run.settings("stream")
    assert schedule_kinds(s.schedule) == ["add", "sub", "word"]
    assert kinds_at(s, 3) == ["sub", "word"]
    seen = [p.info["kind"] for st in range(1, 21) for p in rlmix_stream.prompts_at(run, st)]
    assert set(seen) == {"sub", "word"} and 25 <= seen.count("sub") <= 55
    reserved = [p.info["kind"] for st in range(s.reserved_step_base, s.reserved_step_base + 20)
                for p in rlmix_stream.prompts_at(run, st)]
    assert set(reserved) == {"add", "sub", "word"}


# ---------------------------------------------------------------- tasks


def test_tasks_have_the_right_answers():
    rng = random.Random(0)
    for _ in range(200):
        q, a = make_task(rng, "add", 2, 20)
        x, y = map(int, re.fullmatch(r"What is (\d+)\+(\d+)\?", q).groups())
        assert a == x + y and 10 <= x <= 99 and 10 <= y <= 99
        q, a = make_task(rng, "sub", 3, 20)
        x, y = map(int, re.fullmatch(r"What is (\d+)-(\d+)\?", q).groups())
        assert a == x - y >= 0 and 100 <= y <= x <= 999
        q, a = make_task(rng, "word", 2, 20)
        nums = [int(n) for n in re.findall(r"\d+", q)]
        assert len(nums) == 2 and a >= 0
        if "finds" in q or "together" in q:
            assert a == sum(nums)
        elif "away" in q:
            assert a == nums[0] - nums[1]
        else:
            assert "bags" in q and a == nums[0] * nums[1]
    with pytest.raises(ValueError, match="unknown task kind 'mul'"):
        make_task(rng, "mul", 2, 20)


def test_prompts_are_deterministic_in_seed_and_step_and_built_from_the_harness():
    a = stream_run("harness.instructions=Just the number.", "harness.system=Be exact.")
    b = stream_run("harness.instructions=Just the number.", "harness.system=Be exact.")
    c = stream_run("train.seed=7")
    pa, pb, pc = (rlmix_stream.prompts_at(r, 3) for r in (a, b, c))
    assert [p.messages for p in pa] == [p.messages for p in pb]
    assert [p.answer for p in pa] == [p.answer for p in pb]
    assert [p.messages[-1]["content"] for p in pa] != [p.messages[-1]["content"] for p in pc]
    assert pa[0].messages[0] == {"role": "system", "content": "Be exact."}
    assert pa[0].messages[-1]["content"].endswith(" Just the number.")
    assert [p.id for p in pa] == [f"stream-3-{i}" for i in range(4)]
    # no harness: the env's own instructions, no system message
    assert pc[0].messages[-1]["content"].endswith("Reply with only the final number.")
    assert len(pc[0].messages) == 1


def test_held_out_tasks_cover_every_kind_and_are_never_trained_on():
    run = stream_run("stream.digits=1", "stream.eval_size=40")
    s = run.settings("stream")
    tasks = eval_tasks(s)
    assert len(tasks) == 40 and len({q for _, q, _ in tasks}) == 40
    assert [k for k, _, _ in tasks[:6]] == ["add", "sub", "word"] * 2
    held = {q for _, q, _ in tasks}
    # one-digit sums: a small space, so collisions would be common without the check
    for st in range(30):
        for p in rlmix_stream.prompts_at(run, st):
            assert p.messages[-1]["content"].rsplit("?", 1)[0] + "?" not in held


# ---------------------------------------------------------------- scoring


def test_parse_answer():
    assert parse_answer("The answer is 42.") == 42
    assert parse_answer("1,204") == 1204
    assert parse_answer("-3 then 7") == 7
    assert parse_answer("none") is None


def test_scoring_feedback_and_step_accuracy_per_kind():
    run = stream_run("stream.schedule=[{kind: 'add+word', steps: 5}]", "train.prompts_per_step=6")
    prompts = rlmix_stream.prompts_at(run, 0)
    kinds = [p.info["kind"] for p in prompts]
    assert set(kinds) == {"add", "word"}
    right = {i for i, k in enumerate(kinds) if k == "add"}
    texts = [str(p.answer) if i in right else f"It is {p.answer + 1}"
             for i, p in enumerate(prompts)]
    batch = make_batch(n_groups=6, group_size=1)
    batch.prompts, batch.texts = prompts, texts
    batch.info = [{} for _ in texts]
    loop.score(run, batch)
    assert batch.reward_terms["stream.correct"].tolist() == [float(i in right) for i in range(6)]
    assert batch.reward_terms["stream.format"].tolist() == [float(i in right) for i in range(6)]
    word = next(i for i, k in enumerate(kinds) if k == "word")
    assert batch.info[word]["stream"] == {"kind": "word", "answer": prompts[word].answer,
                                          "parsed": prompts[word].answer + 1}
    # a second scoring of the same step (a harness plugin re-running the tasks) is not counted
    batch2 = make_batch(n_groups=6, group_size=1)
    batch2.prompts, batch2.texts = prompts, ["0"] * 6
    batch2.info = [{} for _ in range(6)]
    loop.score(run, batch2)
    metrics = run.drain_metrics()  # what scoring logged for the step
    run.step = 1
    rlmix_stream.rlmix_step_end(run, metrics)
    assert metrics["stream/accuracy/add"] == 1.0 and metrics["stream/accuracy/word"] == 0.0
    assert metrics["stream/accuracy"] == pytest.approx(len(right) / 6)
    assert metrics["stream/phase"] == 0


# ---------------------------------------------------------------- evaluation


class EchoAnswer:
    """A rollout engine that answers add tasks right and everything else wrong."""

    @rlmix.hookimpl
    def rlmix_generate(self, run, request):
        batch = make_batch(n_groups=len(request.prompts), group_size=1)
        batch.prompts = list(request.prompts)
        batch.texts = [str(p.answer if p.info["kind"] == "add" else -1) for p in request.prompts]
        return batch


class Wrapper:
    """Marks every prompt it sees, to show evaluation goes through rlmix_prompts."""

    seen: list[int] = []

    @rlmix.hookimpl(wrapper=True)
    def rlmix_prompts(self, run, step):
        prompts = yield
        Wrapper.seen.append(step)
        return prompts


def test_evaluate_reports_accuracy_per_kind_through_the_prompt_hook():
    Wrapper.seen = []
    run = stream_run("stream.eval_size=9", "train.prompts_per_step=4",
                     plugins={"stream": rlmix_stream, "echo": EchoAnswer(), "wrap": Wrapper()})
    out = rlmix_stream.rlmix_evaluate(run)
    assert out["accuracy/add"] == 1.0 and out["accuracy/sub"] == 0.0
    assert out["accuracy/word"] == 0.0 and out["accuracy"] == pytest.approx(3 / 9)
    base = run.settings("stream").eval_step_base
    assert Wrapper.seen == [base, base + 1, base + 2]  # 9 tasks, 4 per step
    assert rlmix_stream.rlmix_evaluate(stream_run("stream.eval_size=0")) == {}


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(("override", "match"), [
    ("stream.schedule=[{kind: mul, steps: 2}]", r"stream.schedule.*kind 'mul'"),
    ("stream.schedule=[{kind: add, steps: 0}]", r"stream.schedule.*>= 1 step"),
    ("stream.schedule=[]", r"stream.schedule.*at least one phase"),
    ("stream.after=loop", r"stream.after.*'loop' is not allowed"),
    ("stream.digits=0", r"stream.digits"),
    ("stream.eval_step_base=2000000", r"stream.eval_step_base"),
    ("stream.schedule=[{kind: add, stepz: 2}]", r"stepz.*unknown key"),
])
def test_bad_settings_name_the_key(override, match):
    with pytest.raises(rlmix.ManifestError, match=match):
        make_run({"stream": rlmix_stream}, [override])


# ---------------------------------------------------------------- end to end


def test_example_manifest_runs_two_steps_with_tiny_random(tmp_path):
    skip_unless_installed(EXAMPLE)
    out = tmp_path / "run"
    code = cli.main(["run", str(EXAMPLE), "model=tiny-random", "train.steps=2",
                     "train.prompts_per_step=2", "train.group_size=2",
                     "sampling.max_new_tokens=4", "stream.eval_size=3",
                     "stream.eval_max_new_tokens=4", "train.eval_every=0",
                     "train.checkpoint_every=0", "log.progress=false", "log.plot=false",
                     f"out={out}"])
    assert code == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("stream/accuracy/add" in r and r["stream/phase"] == 0 for r in steps)
    assert "eval/accuracy/word" in rows[0] and "eval/accuracy/word" in rows[-1]
    assert torch.isfinite(torch.tensor([r["loss"] for r in steps])).all()
