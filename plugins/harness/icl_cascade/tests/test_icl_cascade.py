"""Tests of in-context distillation with a self-consistency cascade: answers, votes,
retrieval, demonstrations as turns and the capped bank by hand; the wrapper's rows; and the
claim on a stream of rule tasks: cascade against teacher-only and student-only (same tasks,
same student samples per task): accuracy, teacher calls and tokens."""

from __future__ import annotations

import copy

import pytest
import rlmix_icl_cascade as ic
from rlmix_lm.chat_server import ScriptedLM

import rlmix
from rlmix import loop
from rlmix.testing import example_resumes, make_run
from rlmix.testing.memory_worlds import DemoStudent, RuleEnv
from rlmix.types import Prompt

EXAMPLE = ic.__file__.rsplit("/plugins/", 1)[0] + "/examples/harness/icl_cascade-arith.yaml"

# ---------------------------------------------------------------- by hand


def test_answers_and_votes():
    s = ic.Settings()
    assert ic.extract("so 12 then 47.", s) == "47" and ic.extract("none", s) == ""
    assert ic.extract("  A  b ", ic.Settings(answer="text")) == "A b"
    assert ic.extract("x=<5>", ic.Settings(answer="regex", regex=r"<(\d+)>")) == "5"
    assert ic.majority(["3", "4", "3", "", "3"]) == ("3", 0.6)
    assert ic.majority(["4", "3", "3", "4"]) == ("4", 0.5)  # a tie goes to the first reached
    assert ic.majority(["", ""]) == ("", 0.0)


def test_retrieval_demos_and_the_capped_bank():
    state = {"next_id": 0}
    bank = []
    for task in ["Convert 1 using rule r1.", "Convert 2 using rule r2.",
                 "Convert 3 using rule r1."]:
        ic.bank_run(bank, state, task, "The answer is 9", 0, cap=8)
    got = ic.retrieve(bank, "Convert 5 using rule r1.", 2, 0.0)
    assert [d["id"] for d in got] == [2, 0]  # equal similarity: newer first
    p = Prompt(messages=[{"role": "system", "content": "sys"},
                         {"role": "user", "content": "Convert 5 using rule r1."}], answer=1)
    q = ic.with_demos(p, got)
    assert [m["role"] for m in q.messages] == ["system", "user", "assistant", "user",
                                                "assistant", "user"]
    assert q.messages[3]["content"] == "Convert 3 using rule r1."  # most similar nearest
    assert p.messages[-1]["content"] == q.messages[-1]["content"] and len(p.messages) == 2
    bank[0]["uses"] = 5
    gone = ic.bank_run(bank, state, "Convert 4 using rule r3.", "x", 1, cap=3)
    assert [d["id"] for d in gone] == [1]  # least used, then oldest
    ic.bank_run(bank, state, "Convert 4 using rule r3.", "y", 2, cap=3)  # same task: replaced
    assert [d["reply"] for d in bank if d["task"].startswith("Convert 4")] == ["y"]


# ---------------------------------------------------------------- the stream

OFFSETS = {f"r{j}": 3 * j + 1 for j in range(8)}


def rule_run(tmp_path, *overrides):
    env, student = RuleEnv(dict(OFFSETS)), DemoStudent(skill=0.9)
    run = make_run({"ruleenv": env, "student": student, "icl_cascade": ic},
                   [f"out={tmp_path}", "train.prompts_per_step=4", "train.group_size=1",
                    "train.mode=harness-only", *overrides], with_policy=True)
    teacher = run.resources["icl_cascade.lm"] = ScriptedLM(reply=env.teacher)
    loop.configure(run)
    return run, student, teacher


def play(run, steps):
    accs = []
    while run.step < steps:
        metrics = loop.train_step(run)
        ic.rlmix_step_end(run, metrics)
        accs.append(metrics["reward/ruleenv.correct"])
    return sum(accs) / len(accs), metrics


def test_claim_teacher_accuracy_at_half_the_teacher_calls(tmp_path):
    steps = 16  # 64 tasks over 8 rules
    cascade, st_c, t_c = rule_run(tmp_path / "c")
    teacher, st_t, t_t = rule_run(tmp_path / "t", "icl_cascade.mode=teacher")
    student, st_s, t_s = rule_run(tmp_path / "s", "icl_cascade.mode=student")
    acc_c, m_c = play(cascade, steps)
    acc_t, m_t = play(teacher, steps)
    acc_s, m_s = play(student, steps)
    tasks = 4 * steps
    assert st_c.calls == st_s.calls == 5 * tasks  # the same student samples per task
    assert len(t_t.prompts) == m_t["icl_cascade/teacher_calls"] == tasks  # teacher-only: 100%
    assert len(t_s.prompts) == 0  # student-only never calls the teacher
    calls = m_c["icl_cascade/teacher_calls"]
    assert len(t_c.prompts) == calls and calls <= 0.5 * tasks
    assert acc_c >= acc_t - 0.05 and acc_s <= acc_t - 0.3, (acc_c, acc_t, acc_s)
    tokens_c, tokens_t = m_c["icl_cascade/teacher_tokens"], m_t["icl_cascade/teacher_tokens"]
    assert tokens_c <= 0.5 * tokens_t
    assert m_c["icl_cascade/bank"] <= cascade.settings("icl_cascade").max_demos
    print(f"icl_cascade claim: accuracy cascade {acc_c:.3f}, teacher-only {acc_t:.3f}, "
          f"student-only {acc_s:.3f}; teacher calls {calls}/{tasks} ({calls / tasks:.0%}), "
          f"teacher tokens {tokens_c} vs {tokens_t}")


def test_rows_sources_and_masks(tmp_path):
    run, _, _ = rule_run(tmp_path)
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    batch = run.generate(prompts, n=2, temperature=0.0)
    assert len(batch) == 8 and batch.group.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # an empty bank: the student guesses, disagrees, and every task goes to the teacher
    for j in range(8):
        assert batch.info[j]["icl_cascade"]["source"] == "teacher"
        assert batch.texts[j] == f"The answer is {prompts[j // 2].answer}"
        assert float(batch.completion_mask[j].sum()) == 0.0
    assert len(run.state["icl_cascade"]["bank"]) == 4
    again = run.generate(prompts, n=1)
    srcs = [i["icl_cascade"]["source"] for i in again.info]
    # the same tasks again: with their banked demonstrations the student agrees on some
    assert srcs.count("student") >= 1
    assert all((i["icl_cascade"]["source"] == "student") == (i["icl_cascade"]["share"] >= 0.8)
               for i in again.info)
    assert [p.messages[-1]["content"] for p in prompts] == \
        [p.messages[-1]["content"] for p in again.prompts]
    assert len(again.prompts[0].messages) > len(prompts[0].messages)  # demonstrations shown
    # when training (train.mode: rl), a deferred task keeps the student's own samples
    rl, _, _ = rule_run(tmp_path / "rl", "train.mode=rl")
    kept = rl.generate(rl.hook.rlmix_prompts(run=rl, step=0), n=1)
    assert all(i["icl_cascade"]["source"] == "teacher" for i in kept.info)
    assert all(i["icl_cascade"]["teacher"] != t for i, t in zip(kept.info, kept.texts))
    assert float(kept.completion_mask.sum()) > 0


def test_bank_is_capped_and_resumes(tmp_path):
    run, _, _ = rule_run(tmp_path / "a", "icl_cascade.max_demos=3")
    play(run, 4)
    state = run.state["icl_cascade"]
    assert len(state["bank"]) == 3 and state["evicted"] > 0
    a, _, _ = rule_run(tmp_path / "b")
    play(a, 3)
    saved = copy.deepcopy(a.state)
    play(a, 6)
    b, _, _ = rule_run(tmp_path / "c")
    b.state.clear()
    b.state.update(saved)
    b.step = 3
    play(b, 6)
    assert a.state["icl_cascade"] == b.state["icl_cascade"]


@pytest.mark.parametrize(("override", "key"), [
    ("icl_cascade.mode=magic", "icl_cascade.mode"), ("icl_cascade.tau=0", "icl_cascade.tau"),
    ("icl_cascade.samples=0", "icl_cascade.samples"),
    ("icl_cascade.answer=regex", "icl_cascade.regex"),
    ("icl_cascade.teacher_rows=drop", "icl_cascade.teacher_rows")])
def test_settings_errors_name_the_key(override, key):
    with pytest.raises(rlmix.ManifestError, match=key.replace(".", r"\.")):
        make_run({"icl_cascade": ic}, [override])


def test_example_manifest_runs_and_resumes(tmp_path):
    rows, _ = example_resumes(EXAMPLE, tmp_path / "ex", "icl_cascade",
                              ["icl_cascade.lm.max_new_tokens=4"])
    assert rows[-1]["icl_cascade/teacher_calls"] >= 1
