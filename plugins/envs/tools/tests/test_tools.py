"""Tests of the tools env: the calculator, tool-call parsing, the episode (every broken call is a
message, never an exception), the Python tool through the sandbox, grading, prompts, and
(with ``rlmix-hf``) multi-turn rollouts: a scripted policy that calls the calculator shows the
token layout with the tool result masked out, solves what a no-tool policy cannot, and the
example manifest trains 2 steps on ``tiny-random``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import rlmix_tools
import torch
from rlmix_tools import (
    CalculatorError,
    Settings,
    ToolCall,
    ToolEpisode,
    calculate,
    grade,
    parse_answer,
    parse_tool_call,
    run_tool,
    task_space,
)

import rlmix
from rlmix.testing import make_run
from rlmix.types import Prompt, RolloutBatch

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "envs" / "tools.yaml"
TEMPLATES = Path(__file__).resolve().parent / "templates"


# ---------------------------------------------------------------- the calculator


@pytest.mark.parametrize("expression, value", [
    ("12*(3+4)", 84), ("482 * 931 + 77", 448819), ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20),
    ("10 - 2 - 3", 5), ("2^10", 1024), ("2**3**2", 512), ("-7 // 2", -4), ("7 % 3", 1),
    ("1,234 + 1", 1235), ("3 × 4", 12), ("9 / 4", 2.25), ("-(5)", -5), (" 42 ", 42),
])
def test_calculator_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('echo hi')", "not Call"), ("x + 1", "not Name"),
    ("(1).real", "not Attribute"), ("lambda: 1", "not Lambda"), ("[1, 2]", "not List"),
    ("'a' * 3", "not Constant"), ("True + 1", "not Constant"), ("1 / 0", "division by zero"),
    ("10 ** 1000", "too large"), ("9 ** 9 ** 9", "too large"), ("2 +", "cannot parse"),
    ("", "empty"), ("1+" * 150 + "1", "longer than"), ("(-8) ** 0.5", "complex"),
])
def test_calculator_refuses_everything_but_arithmetic(expression, message):
    with pytest.raises(CalculatorError, match=re.escape(message)):
        calculate(expression)


def test_number_formatting():
    assert rlmix_tools.format_number(12 / 4) == "3"
    assert rlmix_tools.format_number(1 / 3) == "0.333333333333"
    assert rlmix_tools.format_number(10**30) == str(10**30)


# ---------------------------------------------------------------- parsing and the episode


def test_parse_tool_call_forms():
    assert parse_tool_call("so <tool>calculator: 12*(3+4)</tool>") == ToolCall("calculator",
                                                                               "12*(3+4)")
    code = parse_tool_call("<tool>python:\nx = 3\nif x:\n    print(x * 2)\n</tool>")
    assert code == ToolCall("python", "x = 3\nif x:\n    print(x * 2)")
    assert parse_tool_call("<tool>python: print(1)</tool>") == ToolCall("python", "print(1)")
    assert parse_tool_call("<tool>Calculator:1+1</tool>") == ToolCall("calculator", "1+1")
    assert parse_tool_call("no call here") is None
    assert "no closing" in parse_tool_call("<tool>calculator: 1+1")
    assert "malformed" in parse_tool_call("<tool>1+1</tool>")


def episode(**settings):
    prompt = Prompt(messages=[{"role": "user", "content": "Compute 2 + 2."}], answer=4,
                    info={"env": "tools", "task": "2 + 2"})
    return ToolEpisode(prompt, Settings(**settings))


def test_episode_runs_the_calculator_and_ends_on_an_answer():
    ep = episode()
    assert ep.reset() == [{"role": "user", "content": "Compute 2 + 2."}]
    assert set(ep.stop_strings) == {"</tool>", "</answer>"}
    out = ep.step("Let me check. <tool>calculator: 482 * 931 + 77</tool>")
    assert not out.done
    assert out.messages == [{"role": "tool", "content": "448819"}]
    assert out.info == {"tool": "calculator", "input": "482 * 931 + 77", "result": "448819"}
    out = ep.step("<answer>448819</answer>")
    assert out.done and out.messages == [] and out.info == {"answer": 448819}


@pytest.mark.parametrize("text, kind, says", [
    ("<tool>search: weather</tool>", "unknown_tool", "unknown tool 'search'"),
    ("<tool>12*7</tool>", "malformed", "malformed tool call"),
    ("<tool>calculator: 1/0</tool>", "tool_error", "division by zero"),
    ("<tool>calculator: import os</tool>", "tool_error", "cannot parse"),
    ("<tool>calculator: open('x')</tool>", "tool_error", "not Call"),
])
def test_broken_calls_come_back_as_error_messages(text, kind, says):
    out = episode().step(text)
    assert not out.done
    assert out.messages[0]["role"] == "tool" and out.messages[0]["content"].startswith("error")
    assert says in out.messages[0]["content"]
    assert out.info["kind"] == kind and says in out.info["error"]


def test_disabled_tool_is_unknown():
    out = episode(tools=["calculator"]).step("<tool>python: print(1)</tool>")
    assert out.info["kind"] == "unknown_tool" and "available: calculator" in \
        out.messages[0]["content"]


def test_no_call_and_no_answer_ends_the_episode():
    out = episode().step("I think it is about four.")
    assert out.done and out.info == {"answer": None}


def test_python_tool_runs_in_the_sandbox():
    ep = episode(python_timeout_s=1.0, max_tool_chars=40)
    out = ep.step("<tool>python:\nprint(123 * 456)\n</tool>")
    assert out.messages[0]["content"] == "56088" and out.info["status"] == "ok"
    out = ep.step("<tool>python: raise ValueError('nope')</tool>")
    assert out.info["kind"] == "tool_error"
    assert "ValueError: nope" in out.messages[0]["content"]
    out = ep.step("<tool>python: x = 1</tool>")
    assert out.messages[0]["content"] == "(no output: print the result)"
    out = ep.step("<tool>python: print('y' * 500)</tool>")
    assert out.messages[0]["content"].endswith("...[truncated]")
    assert len(out.messages[0]["content"]) == 40
    out = ep.step("<tool>python:\nwhile True:\n    pass\n</tool>")
    assert out.info["status"] == "timeout" and "timeout" in out.messages[0]["content"]


def test_python_tool_without_a_sandbox_is_an_error_not_a_crash(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "rlmix_sandbox", None)  # import fails
    message, info = run_tool(ToolCall("python", "print(1)"), Settings())
    assert message.startswith("error") and "unavailable" in info["error"]


# ---------------------------------------------------------------- grading


def turn(text, info):
    return {"assistant": text, "end": "stop", "messages": [], "info": info}


def test_answer_parsing():
    assert parse_answer("<answer>448819</answer>") == 448819
    assert parse_answer("<answer> 448,819 </answer>") == 448819
    assert parse_answer("<answer>-12</answer> then <answer>13</answer>") == 13
    assert parse_answer("<answer>2.5</answer>") == 2.5
    assert parse_answer("<answer>forty</answer>") is None
    assert parse_answer("448819") is None


def test_grade_hand_made_transcripts():
    call = {"tool": "calculator", "input": "2+2", "result": "4"}
    good = grade("<tool>calculator: 2+2</tool><answer>4</answer>",
                 [turn("", call), turn("", {"answer": 4})], 4, True)
    assert (good["correct"], good["format"], good["tool_use"], good["reason"]) == (
        1.0, 1.0, 1.0, "correct")
    assert good["calls"] == [call] and good["tool_calls"] == 1 and good["tool_errors"] == 0
    wrong = grade("<answer>5</answer>", [], 4, True)
    assert (wrong["correct"], wrong["format"], wrong["tool_use"], wrong["reason"]) == (
        0.0, 1.0, 0.0, "wrong answer")
    none = grade("it is 4", [], 4, True)
    assert (none["correct"], none["format"], none["reason"]) == (0.0, 0.0, "no <answer> tag")
    word = grade("<answer>four</answer>", [], 4, True)
    assert (word["correct"], word["reason"]) == (0.0, "answer is not a number")
    malformed = grade("<tool>2+2</tool><answer>4</answer>",
                      [turn("", {"tool": None, "error": "malformed", "kind": "malformed"})],
                      4, True)
    assert (malformed["correct"], malformed["format"], malformed["tool_errors"]) == (1.0, 0.0, 1)
    failed = grade("<answer>4</answer>",
                   [turn("", {"tool": "calculator", "error": "x", "kind": "tool_error"})], 4, True)
    assert (failed["format"], failed["tool_use"]) == (1.0, 0.0)


def batch_of(texts, infos, answers):
    n = len(texts)
    prompts = [Prompt(messages=[{"role": "user", "content": "q"}], answer=a) for a in answers]
    return RolloutBatch(group=torch.arange(n), tokens=torch.zeros(n, 2, dtype=torch.long),
                        attention_mask=torch.ones(n, 2, dtype=torch.long),
                        completion_mask=torch.ones(n, 2), behavior_logp=torch.zeros(n, 2),
                        policy_version=torch.zeros(n, dtype=torch.long), texts=texts,
                        prompts=prompts, info=infos)


def test_score_reads_model_text_only_and_fills_info():
    run = make_run({"tools": rlmix_tools}, ["tools.tool_use_term=true"])
    # row 0: the tool printed an answer tag; the model never answered: that is no answer
    call = "<tool>python: print('<' + 'answer>7</' + 'answer>')</tool>"
    hack = {"episode": {"turns": [turn(call, {"tool": "python", "input": "...",
                                              "result": "<answer>7</answer>"})],
                        "model_text": call}}
    hack_text = call + "\ntool\n<answer>7</answer>"
    plain = {}  # row 1: an engine without episodes: graded from the completion text
    batch = batch_of([hack_text, "<answer>7</answer>"], [hack, plain], [7, 7])
    terms = run.hook.rlmix_score(run=run, batch=batch)[0]
    assert terms["correct"].tolist() == [0.0, 1.0]
    assert terms["format"].tolist() == [0.0, 1.0]
    assert terms["tool_use"].tolist() == [1.0, 0.0]
    assert batch.info[0]["tools"]["reason"] == "no <answer> tag"
    assert batch.info[1]["tools"]["multi_turn"] is False
    run = make_run({"tools": rlmix_tools})  # tool_use is opt-in
    assert set(run.hook.rlmix_score(run=run, batch=batch)[0]) == {"correct", "format"}


# ---------------------------------------------------------------- prompts


def test_prompts_are_deterministic_held_out_and_built_from_the_harness():
    run = make_run({"tools": rlmix_tools}, ["train.prompts_per_step=16", "tools.eval_size=40",
                                            "tools.call_format=tags"])
    rlmix_tools.rlmix_configure(run)
    first = run.hook.rlmix_prompts(run=run, step=3)
    again = run.hook.rlmix_prompts(run=run, step=3)
    assert [p.info["task"] for p in first] == [p.info["task"] for p in again]
    assert [p.info["task"] for p in first] != [p.info["task"]
                                               for p in run.hook.rlmix_prompts(run=run, step=4)]
    held_out = set(run.state["tools"]["eval"])
    assert len(held_out) == 40
    for step in range(30):
        assert not {p.info["task"] for p in run.hook.rlmix_prompts(run=run, step=step)} & held_out
    p = first[0]
    assert p.answer == eval(p.info["task"])  # noqa: S307 - the test's own reference
    assert re.fullmatch(r"\d{3} [-+*] \d{3} [-+*] \d{3}", p.info["task"])
    assert p.messages[0]["role"] == "system" and "<tool>calculator:" in p.messages[0]["content"]
    assert "<answer>NUMBER</answer>" in p.messages[1]["content"]
    assert p.info["env"] == "tools" and p.id == "tools-3-0"
    run.harness.update({"system": "SYS", "instructions": "Be brief."})
    p = run.hook.rlmix_prompts(run=run, step=3)[0]
    assert p.messages == [{"role": "system", "content": "SYS"},
                          {"role": "user", "content": f"Compute {p.info['task']}. Be brief."}]


def test_small_task_space_does_not_loop():
    assert task_space(1, 1, "+") == 100
    run = make_run({"tools": rlmix_tools}, ["tools.digits=1", "tools.steps=1",
                                            "tools.operators=+", "tools.eval_size=500"])
    rlmix_tools.rlmix_configure(run)
    assert len(run.state["tools"]["eval"]) == 100
    assert len(run.hook.rlmix_prompts(run=run, step=0)) == run.config.train.prompts_per_step


def test_episode_hook_only_for_its_own_prompts():
    run = make_run({"tools": rlmix_tools})
    mine = run.hook.rlmix_prompts(run=run, step=0)[0]
    assert isinstance(run.hook.rlmix_episode(run=run, prompt=mine), ToolEpisode)
    other = Prompt(messages=[{"role": "user", "content": "hi"}])
    assert run.hook.rlmix_episode(run=run, prompt=other) is None


@pytest.mark.parametrize("override, name", [
    ("tools.digits=0", "digits"), ("tools.steps=5", "steps"), ("tools.operators=/", "operators"),
    ("tools.tools=[calculator,search]", "tools"), ("tools.python_timeout_s=0",
                                                   "python_timeout_s"),
    ("tools.max_tool_chars=3", "max_tool_chars"), ("tools.eval_size=-1", "eval_size"),
    ("tools.colour=1", "colour"), ("tools.call_format=xml", "call_format"),
    ("tools.syntax=mistral", "syntax"), ("tools.partial_credit=2", "partial_credit"),
    ("tools.demos=4", "demos"),
])
def test_bad_settings_name_the_setting(override, name):
    with pytest.raises(rlmix.ManifestError, match=name):
        make_run({"tools": rlmix_tools}, [override])


# ---------------------------------------------------------------- multi-turn through rlmix-hf


rlmix_hf = pytest.importorskip("rlmix_hf")


#: per call syntax: how the scripted policy calls the calculator, where the chat template puts
#: the tool's result, and how it answers
FORMATS = {
    "tags": (lambda task: f"I will use the calculator. <tool>calculator: {task}</tool>",
             r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", lambda v: f"<answer>{v}</answer>"),
    "smollm2": (lambda task: '<tool_call>[{"name": "calculator", "arguments": {"expression": "'
                + task + '"}}]</tool_call>', r"<\|im_start\|>tool\n(.*?)<\|im_end\|>",
                lambda v: f"The answer is {v}."),
    "qwen": (lambda task: '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
             + task + '"}}\n</tool_call>', r"<tool_response>\n(.*?)\n</tool_response>",
             lambda v: f"The answer is {v}."),
}


def scripted(tok, uses_tool=True, syntax="tags"):
    """A stand-in for ``rlmix_hf.sample_tokens``: a policy that reads the task from its context
    and either calls the calculator, then answers with the tool's result (``uses_tool``), or
    answers at once with a mental estimate (operands rounded to one significant digit), in
    ``syntax``'s format. It honours EOS and ``stop_fn`` like the real sampler; log-probs are
    -0.5 per token."""
    call_text, result_pattern, answer_text = FORMATS[syntax]

    def estimate(task):
        rounded = re.sub(r"\d+", lambda m: str(round(int(m.group()), 1 - len(m.group()))),
                         task)
        return calculate(rounded)

    def fake(model, ids, attn, n, max_new_tokens, temperature, top_p, top_k, eos_ids, pad_id,
             generator=None, autocast=None, stop_fn=None):
        wanted = []
        for row in range(ids.shape[0]):
            context = tok.decode(ids[row][attn[row].bool()])
            task = re.findall(r"Compute (.+?)\.", context)[-1]
            results = re.findall(result_pattern, context, re.S)
            if uses_tool and not results:
                text = call_text(task)
            elif uses_tool:
                text = answer_text(results[-1])
            else:
                text = answer_text(format(estimate(task)))
            wanted += [tok(text, add_special_tokens=False)["input_ids"]] * n
        rows = len(wanted)
        done = torch.zeros(rows, dtype=torch.bool)
        toks, masks = [], []
        for t in range(max_new_tokens):
            live = ~done
            choice = torch.tensor([w[t] if t < len(w) else eos_ids[0] for w in wanted])
            choice = torch.where(live, choice, torch.full_like(choice, pad_id))
            toks.append(choice)
            masks.append(live.float())
            done = done | torch.isin(choice, torch.tensor(eos_ids))
            if stop_fn is not None:
                done = done | (live & stop_fn(choice, live))
            if bool(done.all()):
                break
        mask = torch.stack(masks, 1)
        return torch.stack(toks, 1), mask, -0.5 * mask

    return fake


def tools_run(*overrides, template=None):
    """A run with the tiny policy; ``template`` replaces its chat template (a fixture file)."""
    run = make_run({"hf": rlmix_hf, "tools": rlmix_tools},
                   ["train.prompts_per_step=3", "tools.eval_size=6", *overrides],
                   with_policy=True)
    if template is not None:
        run.tokenizer.chat_template = (TEMPLATES / template).read_text()
    return run


def spans(mask_row, attn_row):
    """(value, start, end) runs of the completion mask over the attended completion region."""
    out, start = [], None
    cols = [i for i in range(len(mask_row)) if attn_row[i]]
    for i in cols:
        v = int(mask_row[i])
        if start is None or v != out[-1][0]:
            out.append([v, i, i + 1])
            start = i
        else:
            out[-1][2] = i + 1
    return [tuple(s) for s in out]


#: (syntax, run overrides, chat template fixture, what the template puts around a tool result)
LAYOUTS = {
    "tags": ("tags", ["tools.call_format=tags"], None,
             ("<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")),
    "smollm2": ("smollm2", [], "smollm2_135m.jinja",
                ("<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")),
    "qwen": ("qwen", [], "qwen2_5.jinja",
             ("<|im_end|>\n<|im_start|>user\n<tool_response>\n",
              "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scripted_tool_use_masks_the_tool_result(monkeypatch, layout):
    """Every row: the model's call (mask 1), the env span the chat template renders around the
    tool result (mask 0, behaviour log-prob 0), the model's answer (mask 1)."""
    syntax, overrides, template, (before, after) = LAYOUTS[layout]
    run = tools_run(*overrides, template=template)
    rlmix_tools.rlmix_configure(run)
    assert rlmix_tools.call_syntax(run) == syntax
    tok = run.tokenizer
    monkeypatch.setattr(rlmix_hf, "sample_tokens", scripted(tok, syntax=syntax))
    call_text, _, answer_text = FORMATS[syntax]
    prompts = run.hook.rlmix_prompts(run=run, step=0)
    batch = run.generate(prompts, n=2, temperature=1.0, max_new_tokens=200)
    width = int(batch.completion_mask.sum(0).nonzero()[0])
    # the engine rendered Prompt.tools through the template (Qwen's tools section)
    opening = tok.decode(batch.tokens[0, :width][batch.attention_mask[0, :width].bool()])
    if syntax != "tags":
        assert '"calculator"' in opening and ("# Tools" in opening) == (syntax == "qwen")
    for row in range(len(batch)):
        task = batch.prompts[row].info["task"]
        result = str(calculate(task))
        runs = spans(batch.completion_mask[row, width:].tolist(),
                     batch.attention_mask[row, width:].tolist())
        # model turn (the call), env span (turn end + tool message + next header), model turn
        assert [v for v, _, _ in runs] == [1, 0, 1]
        (_, a0, a1), (_, t0, t1), (_, b0, b1) = runs
        region = batch.tokens[row, width:]
        assert tok.decode(region[a0:a1]) == call_text(task)
        assert tok.decode(region[t0:t1]) == f"{before}{result}{after}"
        # tags: the turn stops at </answer>; template: the final turn ends with the EOS
        assert tok.decode(region[b0:b1]) == answer_text(result) + (
            "" if syntax == "tags" else "<|im_end|>")
        # behaviour log-probs only on model tokens
        assert (batch.behavior_logp[row, width:][t0:t1] == 0).all()
        assert (batch.behavior_logp[row, width:][a0:a1] == -0.5).all()
    terms = run.hook.rlmix_score(run=run, batch=batch)[0]
    assert terms["correct"].tolist() == [1.0] * len(batch)
    assert terms["format"].tolist() == [1.0] * len(batch)
    assert batch.info[0]["tools"]["calls"][0]["result"] == str(calculate(
        batch.prompts[0].info["task"]))
    assert run.drain_metrics()["tools/well_formed_call"] == 1.0


@pytest.mark.parametrize("layout", ["tags", "qwen"])
def test_claim_in_miniature_the_calculator_solves_what_estimates_cannot(monkeypatch, layout):
    """Products of 3-digit numbers: a policy that calls the calculator answers every held-out
    task; the same policy answering from a one-significant-digit estimate answers none."""
    syntax, overrides, template, _ = LAYOUTS[layout]
    run = tools_run("tools.operators='*'", *overrides, template=template)
    rlmix_tools.rlmix_configure(run)
    monkeypatch.setattr(rlmix_hf, "sample_tokens", scripted(run.tokenizer, True, syntax))
    with_tool = rlmix_tools.rlmix_evaluate(run)
    monkeypatch.setattr(rlmix_hf, "sample_tokens", scripted(run.tokenizer, False, syntax))
    without = rlmix_tools.rlmix_evaluate(run)
    assert with_tool["accuracy"] == 1.0 and with_tool["tool_use"] == 1.0
    assert with_tool["tool_calls"] == 1.0 and with_tool["tool_error_rate"] == 0.0
    assert with_tool["well_formed_call"] == 1.0 and without["well_formed_call"] == 0.0
    assert without["accuracy"] == 0.0 and without["tool_calls"] == 0.0
    # tags: the answer tag is the format; template: a format term needs a well-formed call
    assert without["format"] == (1.0 if syntax == "tags" else 0.0)


def _run_example(tmp_path, *extra, example=EXAMPLE):
    from rlmix import cli

    code = cli.main(["run", str(example), "model=tiny-random", "train.steps=2",
                     "train.prompts_per_step=2", "train.group_size=2", "tools.eval_size=2",
                     "tools.eval_max_new_tokens=24", "sampling.max_new_tokens=40",
                     "train.eval_every=0", "train.checkpoint_every=0", "log.progress=false",
                     "log.plot=false", "log.tensorboard=false", f"out={tmp_path}", *extra])
    assert code == 0
    import json

    return [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_example_manifest_trains_two_steps_on_the_tiny_model(tmp_path):
    rows = _run_example(tmp_path)
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    assert all("reward/tools.correct" in r for r in rows if "reward/mean" in r)
    assert "eval/accuracy" in rows[0] and "eval/tool_calls" in rows[-1]


def test_example_manifest_with_a_scripted_tool_user(tmp_path, monkeypatch):
    """The example end to end with the scripted calculator policy: every sample is right, and
    the batches the trainer saw carry the tool result with completion_mask 0."""
    seen = []
    original = rlmix_hf.generate_episodes

    def record(*args, **kwargs):
        batch = original(*args, **kwargs)
        seen.append(batch)
        return batch

    from rlmix.policy import byte_tokenizer

    monkeypatch.setattr(rlmix_hf, "sample_tokens", scripted(byte_tokenizer(), syntax="smollm2"))
    monkeypatch.setattr(rlmix_hf, "generate_episodes", record)
    rows = _run_example(tmp_path, "sampling.max_new_tokens=200", "tools.eval_max_new_tokens=200")
    trained = [r for r in rows if "reward/mean" in r]
    assert [r["reward/tools.correct"] for r in trained] == [1.0, 1.0]
    assert [r["tools/well_formed_call"] for r in trained] == [1.0, 1.0]
    assert rows[-1]["eval/accuracy"] == 1.0 and rows[-1]["eval/well_formed_call"] == 1.0
    masked_tool_tokens = 0
    tok = byte_tokenizer()
    for batch in seen:
        width = int(batch.completion_mask.sum(0).nonzero()[0])
        for row in range(len(batch)):
            env = batch.attention_mask[row].bool() & (batch.completion_mask[row] == 0)
            env[:width] = False  # the completion region only
            text = tok.decode(batch.tokens[row][env])
            result = str(calculate(batch.prompts[row].info["task"]))
            assert f"<|im_start|>tool\n{result}<|im_end|>" in text
            masked_tool_tokens += int(env.sum())
    assert masked_tool_tokens > 0
