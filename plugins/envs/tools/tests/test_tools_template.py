"""Tool calls in the model's own chat-template format: the tools as Python functions (JSON
schemas from their signatures), each template family's syntax (Qwen2.5, Llama 3.1, SmolLM2)
rendered through the real template (fixtures in ``templates/``: Qwen2.5's and Llama 3.1's
published templates, and the one SmolLM2-135M-Instruct's GGUF ships), a well-formed and a
malformed call parsed per syntax, tool results as ``tool`` messages through the template, the
template-format grading (format term, partial credit, the well-formed-call share), and the
SmolLM2 example manifest on the tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import rlmix_tools
from rlmix_tools import Settings, ToolEpisode, grade
from rlmix_tools.calls import (
    SYNTAXES,
    Call,
    check_arguments,
    detect_syntax,
    renders_tools,
    tool_schemas,
)

from rlmix.policy import byte_tokenizer
from rlmix.testing import make_batch, make_run
from rlmix.types import Prompt

TEMPLATES = Path(__file__).resolve().parent / "templates"
ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "envs" / "tools_smollm2.yaml"
CALL = Call("calculator", {"expression": "12 * 7"})


def tokenizer(template: str):
    tok = byte_tokenizer()
    tok.chat_template = (TEMPLATES / template).read_text()
    return tok


# ---------------------------------------------------------------- tools as functions


def test_schemas_come_from_the_functions_signatures_and_docstrings():
    calc, py = tool_schemas(["calculator", "python"])
    assert calc["type"] == "function" and calc["function"]["name"] == "calculator"
    assert calc["function"]["parameters"]["required"] == ["expression"]
    assert calc["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert "482 * 931 + 77" in calc["function"]["parameters"]["properties"]["expression"][
        "description"]
    assert py["function"]["parameters"]["required"] == ["code"]
    assert rlmix_tools.calls.calculator("2 + 3 * 4") == "14"  # the declaration runs, too
    assert check_arguments(CALL, calc) == ""
    assert "missing expression" in check_arguments(Call("calculator", {}), calc)
    assert "unknown expr" in check_arguments(Call("calculator", {"expr": "1"}), calc)
    assert "must be a string" in check_arguments(Call("calculator", {"expression": 7}), calc)


# ---------------------------------------------------------------- each template's syntax

#: fixture, detected syntax, what the rendered tools prompt must contain, where a tool result
#: goes (text around "84" after the assistant turn)
CASES = {
    "qwen": ("qwen2_5.jinja", ["# Tools", "<tools>", '"name": "calculator"',
                               "<tool_call>\n{\"name\": <function-name>"],
             ("<|im_end|>\n<|im_start|>user\n<tool_response>\n",
              "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")),
    "llama3": ("llama3_1.jinja", ["Environment: ipython", '"parameters": dictionary',
                                  '"name": "calculator"'],
               ("<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n",
                "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")),
    "smollm2": ("smollm2_135m.jinja", ["<|im_start|>system\nYou can call functions", "<tools>[",
                                       '"name": "calculator"', "<tool_call>[\n"],
                ("<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")),
}


def template_run(syntax: str):
    run = make_run({"tools": rlmix_tools}, [f"tools.syntax={syntax}", "tools.eval_size=0"])
    return run, rlmix_tools.rlmix_prompts(run, step=0)[0]


@pytest.mark.parametrize("syntax", list(CASES))
def test_the_template_renders_the_tools_prompt(syntax):
    template, expected, _ = CASES[syntax]
    tok = tokenizer(template)
    assert detect_syntax(tok) == syntax
    assert renders_tools(tok) == (syntax != "smollm2")  # SmolLM2's template ignores tools
    _, prompt = template_run(syntax)
    assert prompt.info["syntax"] == syntax
    assert (prompt.tools is None) == (syntax == "smollm2")
    text = tok.apply_chat_template(prompt.messages, tools=prompt.tools, tokenize=False,
                                   add_generation_prompt=True)
    for piece in expected:
        assert piece in text, (piece, text)
    assert f"Compute {prompt.info['task']}." in text


@pytest.mark.parametrize("syntax", ["qwen", "llama3"])
def test_the_templates_own_rendering_of_a_call_parses_back(syntax):
    """The template renders an assistant ``tool_calls`` message in its canonical form; the
    env's parser reads exactly that form back."""
    tok = tokenizer(CASES[syntax][0])
    messages = [{"role": "user", "content": "Compute 12 * 7."},
                {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                    "name": "calculator", "arguments": {"expression": "12 * 7"}}}]}]
    base = tok.apply_chat_template(messages[:1], tools=tool_schemas(["calculator"]),
                                   tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(messages, tools=tool_schemas(["calculator"]), tokenize=False)
    assert full.startswith(base)
    turn = full[len(base):].removesuffix("<|im_end|>\n").removesuffix("<|eot_id|>")
    assert SYNTAXES[syntax].parse(turn).calls == [CALL]
    assert SYNTAXES[syntax].parse(SYNTAXES[syntax].render([CALL])).calls == [CALL]


#: per syntax: malformed turns, and a non-call turn (the final answer)
MALFORMED = {
    "qwen": ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}\n'
             '</tool_call>', '<tool_call>\n{"arguments": {"expression": "1"}}\n</tool_call>',
             '<tool_call>{"name": "calculator"'],
    "llama3": ['{"name": "calculator", "parameters": {"expression": "12*7"}',
               '{"name": "calculator", "parameters": "12*7"}',
               '<|python_tag|>calculator.call(expression=open("x"))'],
    "smollm2": ['<tool_call>[{"name": "calculator", "arguments": {"expression": "1"}]'
                '</tool_call>', '<tool_call>[{"name": "calculator"}]</tool_call>',
                '<tool_call>[{"name": "calculator", "arguments": {}}]'],
}


@pytest.mark.parametrize("syntax", list(CASES))
def test_a_well_formed_and_a_malformed_call_through_the_episode(syntax):
    prompt = Prompt(messages=[{"role": "user", "content": "Compute 12 * 7."}], answer=84,
                    info={"env": "tools", "task": "12 * 7", "syntax": syntax})
    episode = ToolEpisode(prompt, Settings(), syntax)
    assert episode.stop_strings == (() if syntax == "llama3" else ("</tool_call>",))
    good = episode.step(SYNTAXES[syntax].render([CALL]))
    assert not good.done and good.messages == [{"role": "tool", "content": "84"}]
    assert good.info == {"tool": "calculator", "input": "12 * 7", "result": "84"}
    for text in MALFORMED[syntax]:
        bad = episode.step(text)
        assert not bad.done and bad.info["kind"] == "malformed", text
        assert bad.messages[0]["role"] == "tool"
        assert bad.messages[0]["content"].startswith("error: malformed tool call")
    final = episode.step("12 times 7 is 84.")
    assert final.done and final.info == {"answer": 84}


def test_llama_variants_and_several_calls():
    llama = SYNTAXES["llama3"]
    for text in ['<|python_tag|>{"name": "calculator", "parameters": {"expression": "12 * 7"}}',
                 '{"name": "calculator", "arguments": {"expression": "12 * 7"}}<|eom_id|>',
                 '<|python_tag|>calculator.call(expression="12 * 7")']:
        assert llama.parse(text).calls == [CALL], text
    two = llama.parse('{"name": "calculator", "parameters": {"expression": "1+1"}}; '
                      '{"name": "python", "parameters": {"code": "print(2)"}}')
    assert [c.name for c in two.calls] == ["calculator", "python"]
    assert not llama.parse("The answer is 84.").attempted
    qwen = SYNTAXES["qwen"]  # arguments written as a JSON string are read too
    assert qwen.parse('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": '
                      '\\"12 * 7\\"}"}</tool_call>').calls == [CALL]
    assert not SYNTAXES["smollm2"].parse("<tool_call>[]</tool_call> 84").attempted
    episode = ToolEpisode(Prompt(messages=[], answer=3), Settings(), "smollm2")
    out = episode.step('<tool_call>[{"name": "calculator", "arguments": {"expression": "1+2"}},'
                       ' {"name": "search", "arguments": {"q": "x"}}]</tool_call>')
    assert [m["content"] for m in out.messages][0] == "3"
    assert out.messages[1]["content"].startswith("error: unknown tool 'search'")
    assert [c["kind"] for c in out.info["calls"] if "kind" in c] == ["unknown_tool"]


@pytest.mark.parametrize("syntax", list(CASES))
def test_tool_results_enter_as_tool_messages_through_the_template(syntax):
    rlmix_hf = pytest.importorskip("rlmix_hf")
    template, _, (before, after) = CASES[syntax]
    tok = tokenizer(template)
    _, prompt = template_run(syntax)
    call = SYNTAXES[syntax].render([CALL])
    conversation = [*prompt.messages, {"role": "assistant", "content": call}]
    closing = "<|im_end|>" if syntax != "llama3" else ""
    inserted = rlmix_hf.continuation_text(tok, conversation[:-1],
                                          [{"role": "tool", "content": "84"}], closing,
                                          prompt.tools)
    # Llama 3.1's template writes a tool result as JSON (a string is iterable to Jinja)
    result = '"84"' if syntax == "llama3" else "84"
    assert inserted == (before.removeprefix(closing) + result + after)


@pytest.mark.parametrize("syntax", ["smollm2", "qwen", "tags"])
def test_demos_are_worked_examples_as_earlier_turns(syntax):
    fmt = "tags" if syntax == "tags" else "template"
    run = make_run({"tools": rlmix_tools}, [f"tools.call_format={fmt}", "tools.demos=2",
                                            "tools.eval_size=30", "tools.digits=1",
                                            "tools.steps=1", "tools.operators='*'"]
                   + ([f"tools.syntax={syntax}"] if syntax != "tags" else []))
    rlmix_tools.rlmix_configure(run)
    prompt = rlmix_tools.rlmix_prompts(run, step=0)[0]
    demos = run.state["tools"]["demos"]
    assert len(demos) == 2 and not set(demos) & set(run.state["tools"]["eval"])
    roles = [m["role"] for m in prompt.messages]
    assert roles == ["system"] + ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    first = prompt.messages[1:5]
    value = rlmix_tools.calculate(demos[0])
    assert first[0]["content"] == prompt.messages[-1]["content"].replace(
        prompt.info["task"], demos[0])  # asked exactly as the task is
    parsed = SYNTAXES[syntax].parse(first[1]["content"]) if syntax != "tags" else None
    assert parsed is None or parsed.calls == [Call("calculator", {"expression": demos[0]})]
    assert first[2]["content"] == str(value)
    assert first[3]["content"] == (f"<answer>{value}</answer>" if syntax == "tags"
                                   else str(value))
    if syntax != "tags":  # the worked example renders through the real template
        tok = tokenizer(CASES[syntax][0])
        text = tok.apply_chat_template(prompt.messages, tools=prompt.tools, tokenize=False,
                                       add_generation_prompt=True)
        assert first[1]["content"] in text and text.endswith("assistant\n")
        assert text.index(first[1]["content"]) < text.index(f"Compute {prompt.info['task']}.")


# ---------------------------------------------------------------- grading


def turn(text, info):
    return {"assistant": text, "end": "eos", "messages": [], "info": info}


def test_template_grading_format_partial_credit_and_well_formed_share():
    ok = {"tool": "calculator", "input": "12 * 7", "result": "84"}
    bad = {"tool": None, "error": "malformed", "kind": "malformed"}
    args = {"tool": "calculator", "input": "{}", "error": "missing", "kind": "bad_arguments"}
    runtime = {"tool": "calculator", "input": "1/0", "error": "division by zero",
               "kind": "tool_error"}
    g = grade("", [turn("c", ok), turn("It is 84.", {"answer": 84})], 84, True, "qwen")
    assert (g["correct"], g["exact"], g["format"], g["well_formed_call"]) == (1, 1, 1, 1)
    g = grade("", [turn("c", bad), turn("c", ok), turn("84", {"answer": 84})], 84, True, "qwen")
    assert (g["format"], g["well_formed_call"], g["tool_errors"]) == (0.5, 1.0, 1)
    g = grade("", [turn("c", args), turn("84", {"answer": 84})], 84, True, "qwen")
    assert (g["format"], g["well_formed_call"], g["correct"]) == (0.0, 0.0, 1.0)
    g = grade("", [turn("c", runtime), turn("9", {"answer": 9})], 84, True, "qwen")
    assert (g["format"], g["well_formed_call"], g["reason"]) == (1.0, 1.0, "wrong answer")
    # the right number in the final turn, not as its answer: partial credit, never exact
    near = [turn("c", ok), turn("84 is 12 * 7", {"answer": 7})]
    assert grade("", near, 84, True, "qwen")["correct"] == 0.0
    g = grade("", near, 84, True, "qwen", partial_credit=0.25)
    assert (g["correct"], g["exact"]) == (0.25, 0.0)
    # the answer comes from a finished final turn only: a call as the last turn is none
    g = grade("", [turn("c", ok)], 84, True, "qwen")
    assert (g["reason"], g["correct"]) == ("no final answer", 0.0)
    cut = [turn("c", ok), {"assistant": "84", "end": "budget"}]
    assert grade("", cut, 84, True, "qwen")["reason"] == "no final answer"


def test_a_tool_that_prints_the_answer_earns_nothing_in_template_format():
    """The red-team rule: only the model's own final turn is graded, so a program whose output
    is the answer (here the tool message) gives no credit when the model does not write it."""
    episode = ToolEpisode(Prompt(messages=[], answer=448819), Settings(), "qwen")
    step = episode.step('<tool_call>\n{"name": "python", "arguments": {"code": '
                        '"print(482 * 931 + 77)"}}\n</tool_call>')
    assert step.messages[0]["content"] == "448819"
    turns = [turn("call", step.info), turn("I do not know.", {"answer": None})]
    verdict = grade("", turns, 448819, True, "qwen", partial_credit=0.5)
    assert verdict["correct"] == 0.0 and verdict["well_formed_call"] == 1.0


def test_single_turn_engines_grade_the_text_and_count_unrun_calls():
    run = make_run({"tools": rlmix_tools}, ["tools.eval_size=0"])
    prompt = rlmix_tools.rlmix_prompts(run, step=0)[0]
    call = SYNTAXES["smollm2"].render([CALL])
    batch = make_batch(1, 2)
    batch.texts, batch.prompts, batch.info = [call, f"It is {prompt.answer}."], [prompt] * 2, \
        [{}, {}]
    terms = run.hook.rlmix_score(run=run, batch=batch)[0]
    assert terms["correct"].tolist() == [0.0, 1.0]
    assert terms["format"].tolist() == [1.0, 0.0]
    assert run.drain_metrics()["tools/well_formed_call"] == 0.5


# ---------------------------------------------------------------- the real SmolLM2 template


def test_the_smollm2_fixture_is_the_template_the_model_ships():
    from rlmix.policy import cache_dir

    # the folder rlmix.policy.smollm2_folder() de-quantises the GGUF into, tokenizer saved
    # with it; its template file is what AutoTokenizer loads (read directly: fast)
    shipped = cache_dir() / "models" / "smollm2-135m-instruct" / "chat_template.jinja"
    if not shipped.exists():
        pytest.skip("SmolLM2 is not cached here (rlmix.policy.smollm2_folder makes it)")
    assert shipped.read_text() == (TEMPLATES / "smollm2_135m.jinja").read_text()
    assert detect_syntax(tokenizer("smollm2_135m.jinja")) == "smollm2"


# ---------------------------------------------------------------- the example manifest


def test_smollm2_example_runs_a_step_on_the_tiny_model(tmp_path):
    pytest.importorskip("rlmix_hf")
    from rlmix import cli

    code = cli.main(["run", str(EXAMPLE), "model=tiny-random", "train.steps=1",
                     "train.prompts_per_step=2", "train.group_size=2", "tools.eval_size=1",
                     "tools.eval_max_new_tokens=16", "sampling.max_new_tokens=24",
                     "train.eval_every=0", "train.checkpoint_every=0", "log.progress=false",
                     "log.plot=false", "log.tensorboard=false", f"out={tmp_path}"])
    assert code == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in trained] == [1]
    assert all("tools/well_formed_call" in r and "reward/tools.format" in r for r in trained)
    assert "eval/well_formed_call" in rows[0] and "eval/well_formed_call" in rows[-1]
    manifest = (tmp_path / "manifest.yaml").read_text()
    assert re.search(r"call_format: template", manifest)
