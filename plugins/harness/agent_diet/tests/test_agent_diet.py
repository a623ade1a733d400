"""Tests of AgentDiet: each reduction rule by hand, the episode wrapper's token accounting, the
LM path, and the claim on the tools env with a scripted agent that repeats its calls (reduced
against unreduced, the same tasks and agent: input tokens per episode and final answers)."""

from __future__ import annotations

import pytest
import rlmix_agent_diet as ad
from rlmix_lm.chat_server import ScriptedLM

import rlmix
from rlmix import loop
from rlmix.testing import example_resumes, make_run
from rlmix.testing.memory_worlds import ScriptedAgentEngine, checking_tool_agent
from rlmix.types import StepResult

EXAMPLE = ad.__file__.rsplit("/plugins/", 1)[0] + "/examples/harness/agent_diet-tools.yaml"

# ---------------------------------------------------------------- rules by hand


def test_collapse_repeats_and_blank_lines():
    text = "start\nwork\nwork\nwork\n\n\nwork\nend"
    assert ad.collapse_repeats(text) == "start\nwork (repeated 4 times)\nend"
    assert ad.collapse_repeats("a\na\nb", min_repeats=3) == "a\na\nb"
    assert ad.collapse_repeats("a\n\na", drop_blank=False) == "a\n\na"


def test_reduce_output_rules():
    s = ad.Settings(min_chars=5)
    seen = set()
    assert ad.reduce_output("  \n", seen, s) == (ad.NO_OUTPUT, ["empty"])
    out, fired = ad.reduce_output("x\nx\nx\nresult: 5", seen, s)
    assert out == "x (repeated 3 times)\nresult: 5" and fired == ["repeats"]
    assert ad.reduce_output("x\nx\nx\nresult: 6", seen, s)[1] == ["repeats"]  # not a duplicate
    # the same output up to whitespace is a duplicate
    assert ad.reduce_output("x\nx  \nx\nresult:   5", seen, s) == (ad.SAME, ["duplicates"])
    assert ad.reduce_output("42", seen, s) == ("42", [])
    assert ad.reduce_output("42", seen, s) == ("42", [])  # shorter than min_chars: kept
    only = ad.Settings(rules=["duplicates"], min_chars=0)
    assert ad.reduce_output("", set(), only) == ("", [])


def test_expire_keeps_the_latest_answer_of_a_repeated_call():
    convo = [{"role": "user", "content": "go"},
             {"role": "assistant", "content": "<tool>read: a</tool>"},
             {"role": "tool", "content": "a = 1"},
             {"role": "assistant", "content": "<tool>write: a 2</tool>"},
             {"role": "tool", "content": "ok"},
             {"role": "assistant", "content": "<tool> read:  a </tool>"},
             {"role": "tool", "content": "a = 2"},
             {"role": "assistant", "content": "<tool>read: a</tool>"},
             {"role": "tool", "content": ad.SAME}]
    out = ad.expire(convo)
    assert out[2]["content"] == ad.EXPIRED and out[6]["content"] == "a = 2"
    assert out[4]["content"] == "ok" and out[8]["content"] == ad.SAME
    assert convo[2]["content"] == "a = 1"  # the input is not changed


class Echo:
    """An env episode that answers every call with a fixed output."""

    stop_strings = ("</tool>",)

    def __init__(self, outputs):
        self.outputs = list(outputs)

    def reset(self):
        return [{"role": "user", "content": "go"}]

    def step(self, text):
        return StepResult(messages=[{"role": "tool", "content": self.outputs.pop(0)}],
                          info={"tool": "x"})


def test_episode_wrapper_counts_tokens_and_uses_the_lm():
    totals = {}
    ep = ad.DietEpisode(Echo(["w\nw\nw\nw\nresult: 1", "w\nw\nw\nw\nresult: 1", ""]),
                        ad.Settings(min_chars=5), totals=totals)
    assert ep.stop_strings == ("</tool>",) and ep.reset()[0]["content"] == "go"
    first = ep.step("<tool>x</tool>")
    assert first.messages[0]["content"] == "w (repeated 4 times)\nresult: 1"
    assert first.info["agent_diet"] == {"raw": 6, "kept": 6, "rules": ["repeats"]}
    assert first.info["tool"] == "x"
    second = ep.step("<tool>x</tool>")
    assert second.messages[0]["content"] == ad.SAME
    assert ep.step("<tool>y</tool>").messages[0]["content"] == ad.NO_OUTPUT
    assert totals["raw"] == 12 and totals["turns"] == 3 and totals["rule_duplicates"] == 1
    lm = ScriptedLM(replies=["result: 7", "a reply longer than the output " * 20])
    ep = ad.DietEpisode(Echo(["chatter " * 60 + "result: 7", "other " * 60]),
                        ad.Settings(lm_reduce=True, lm_min_chars=100), lm=lm)
    assert ep.step("<tool>x</tool>").messages[0]["content"] == "result: 7"
    assert ep.step("<tool>x</tool>").messages[0]["content"].startswith("other")  # longer: kept


# ---------------------------------------------------------------- the claim on the tools env


class Recorder:
    def __init__(self):
        self.batches = []

    @rlmix.hookimpl
    def rlmix_score(self, run, batch):
        self.batches.append(batch)
        return {}


def tools_run(tmp_path, diet):
    rlmix_tools = pytest.importorskip("rlmix_tools")  # alone with the core (nox -s isolated)

    engine, rec = ScriptedAgentEngine(checking_tool_agent(checks=3)), Recorder()
    plugins = {"tools": rlmix_tools, "agent": engine, "recorder": rec}
    if diet:
        plugins["agent_diet"] = ad
    run = make_run(plugins, [f"out={tmp_path}", "train.prompts_per_step=4", "train.group_size=1",
                             "train.mode=harness-only", "tools.tools=[python]",
                             "tools.max_tool_chars=2000", "tools.digits=2", "tools.eval_size=0",
                             "tools.call_format=tags"],  # the scripted agent writes tags
                   with_policy=True)
    engine.tokenizer = run.tokenizer  # count real (byte-level) tokens
    loop.configure(run)
    metrics = loop.train_step(run)
    if diet:
        ad.rlmix_step_end(run, metrics)
    return rec.batches[0], engine, metrics


def test_claim_input_tokens_fall_and_answers_stay(tmp_path):
    reduced, engine_r, metrics = tools_run(tmp_path / "r", diet=True)
    full, engine_f, metrics_f = tools_run(tmp_path / "f", diet=False)
    assert engine_r.calls == engine_f.calls == 4 * 4  # same tasks, same 4 calls per episode
    assert [p.answer for p in reduced.prompts] == [p.answer for p in full.prompts]
    savings = []
    for r, f in zip(reduced.info, full.info):
        assert r["episode"]["final"] == f["episode"]["final"]  # the same final answer, per task
        savings.append(1 - r["episode"]["input_tokens"] / f["episode"]["input_tokens"])
    assert metrics["reward/tools.correct"] == metrics_f["reward/tools.correct"] == 1.0
    assert min(savings) >= 0.40, savings
    assert metrics["agent_diet/saved_fraction"] > 0.5
    assert metrics["agent_diet/rule_duplicates"] == 8 and metrics["agent_diet/rule_repeats"] == 4
    mean_r = sum(x["episode"]["input_tokens"] for x in reduced.info) / 4
    mean_f = sum(x["episode"]["input_tokens"] for x in full.info) / 4
    print(f"agent_diet claim: input tokens per episode {mean_r:.0f} reduced vs {mean_f:.0f} "
          f"unreduced (-{1 - mean_r / mean_f:.1%}; min per task -{min(savings):.1%}); "
          f"env tokens kept {metrics['agent_diet/env_tokens_kept']} of "
          f"{metrics['agent_diet/env_tokens_raw']}; answers equal on 4/4")


def test_a_reduction_that_drops_the_result_changes_the_answer(tmp_path):
    # the test can fail: a rule that also dropped the first result would change the answers
    agent = checking_tool_agent(checks=2)
    convo = [{"role": "user", "content": "Compute 2 + 3. Answer."},
             {"role": "assistant", "content": agent([{"role": "user", "content":
                                                      "Compute 2 + 3. Answer."}])},
             {"role": "tool", "content": "evaluating\nresult: 5"},
             {"role": "assistant", "content": "<tool>python:\nx</tool>"},
             {"role": "tool", "content": ad.SAME}]
    assert agent(convo) == "<answer>5</answer>"
    convo[2]["content"] = ad.NO_OUTPUT
    assert agent(convo) == "<answer>0</answer>"


@pytest.mark.parametrize(("override", "key"), [
    ("agent_diet.rules=[magic]", "agent_diet.rules"),
    ("agent_diet.min_repeats=1", "agent_diet.min_repeats"),
    ("agent_diet.lm.source=cloud", "agent_diet.lm")])
def test_settings_errors_name_the_key(override, key):
    with pytest.raises(rlmix.ManifestError, match=key.replace(".", r"\.")):
        make_run({"agent_diet": ad}, [override])


def test_example_manifest_runs_and_resumes(tmp_path):
    rows, _ = example_resumes(EXAMPLE, tmp_path / "ex", "agent_diet", env="tools", tokens=8)
    assert "agent_diet/env_tokens_raw" in rows[-1]
