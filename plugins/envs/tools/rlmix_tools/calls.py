"""Tools declared as Python functions, and tool calls in a chat template's own syntax.

The tools are plain functions with type hints and a Google-style docstring; their JSON schemas
come from ``transformers.utils.get_json_schema`` (what ``apply_chat_template(tools=[f])`` does
with a function), so the model sees them the way its chat template renders tools.

A :class:`Syntax` is one template family's tool-call format: how a call looks in the model's
text, how to parse it back, and which strings end the model's turn after a call.

* ``qwen`` (Qwen2.5 and other Hermes-style templates): one ``<tool_call>`` block per call,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
* ``llama3`` (Llama 3.1 / 3.2): the whole turn is one JSON object
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``; the
  ``<|python_tag|>name.call(key="value")`` form of built-in tools is read too.
* ``smollm2``: SmolLM2's tool-use format (its model card's system prompt, which its shipped
  chat template does not render: the env writes it into the system message), a JSON list in
  one block, ``<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>``.
* ``tags``: rlmix's own ``<tool>NAME: INPUT</tool>`` (``tools.call_format: tags``).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------- the tools, as functions


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: The arithmetic to evaluate, for example "482 * 931 + 77" (numbers,
            + - * / // % ** and parentheses).
    """
    from rlmix_tools import calculate, format_number

    return format_number(calculate(expression))


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it prints.

    Args:
        code: The program; it must print the result.
    """
    from rlmix_tools import Settings, ToolCall, run_tool

    return run_tool(ToolCall("python", code), Settings())[0]


FUNCTIONS = {"calculator": calculator, "python": python}
#: the argument of each tool that carries its input
INPUT_ARGUMENT = {"calculator": "expression", "python": "code"}


def tool_schemas(names: list[str]) -> list[dict[str, Any]]:
    """The JSON schemas of the named tools, from their signatures and docstrings."""
    from transformers.utils import get_json_schema

    return [get_json_schema(FUNCTIONS[name]) for name in names]


# ---------------------------------------------------------------- parsed calls


@dataclass
class Call:
    """One call as the model wrote it: a tool name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class Parsed:
    """What one model turn holds: ``attempted`` (it tried to call a tool), the ``calls`` that
    parsed, and ``error`` when the attempt was malformed (then ``calls`` is empty)."""

    attempted: bool = False
    calls: list[Call] = field(default_factory=list)
    error: str = ""


def check_arguments(call: Call, schema: dict[str, Any]) -> str:
    """``""`` when ``call.arguments`` fit the tool's JSON schema (every required argument,
    nothing else, JSON types as declared), else why not."""
    params = schema["function"].get("parameters", {})
    props = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in call.arguments]
    extra = [k for k in call.arguments if k not in props]
    if missing or extra:
        return (f"{call.name} takes {', '.join(props) or 'no arguments'}"
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; unknown {', '.join(extra)}" if extra else ""))
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
             "object": dict, "array": list}
    for key, value in call.arguments.items():
        want = types.get(props[key].get("type", ""))
        if want is not None and (not isinstance(value, want) or (
                want is not bool and isinstance(value, bool))):
            return f"argument {key!r} of {call.name} must be a {props[key]['type']}"
    return ""


def _call_of(obj: Any, keys: tuple[str, ...]) -> Call | str:
    if not isinstance(obj, dict):
        return "a tool call is a JSON object"
    name = obj.get("name")
    args_key = next((k for k in keys if k in obj), None)
    if not isinstance(name, str) or not name:
        return 'a tool call needs a "name"'
    if args_key is None:
        return f'a tool call needs {" or ".join(repr(k) for k in keys)}'
    args = obj[args_key]
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return f"the {args_key} of {name} are not a JSON object"
    if not isinstance(args, dict):
        return f"the {args_key} of {name} are not a JSON object"
    return Call(name, args)


def _json(text: str) -> Any:
    """``text`` as JSON, or ``ValueError`` (trailing text after the value is an error)."""
    return json.loads(text.strip())


# ---------------------------------------------------------------- the syntaxes


class Syntax:
    """A tool-call syntax: ``parse(text)``, ``render(call)`` (the canonical form, for prompts
    and tests) and ``stop_strings`` (the engine ends the model's turn on them)."""

    name = ""
    stop_strings: tuple[str, ...] = ()

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def render(self, calls: list[Call]) -> str:
        raise NotImplementedError


_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class QwenSyntax(Syntax):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call."""

    name = "qwen"
    stop_strings = ("</tool_call>",)

    def parse(self, text: str) -> Parsed:
        if "<tool_call>" not in text:
            return Parsed()
        blocks = _BLOCK.findall(text)
        if not blocks:
            return Parsed(True, error="malformed tool call: no closing </tool_call>")
        calls = []
        for body in blocks:
            try:
                call = _call_of(_json(body), ("arguments", "parameters"))
            except ValueError:
                return Parsed(True, error="malformed tool call: the <tool_call> block is not "
                                          'one JSON object {"name": ..., "arguments": {...}}')
            if isinstance(call, str):
                return Parsed(True, error=f"malformed tool call: {call}")
            calls.append(call)
        return Parsed(True, calls)

    def render(self, calls: list[Call]) -> str:
        return "\n".join("<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments})
                         + "\n</tool_call>" for c in calls)


class SmolLM2Syntax(Syntax):
    """``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``: one block holding a
    JSON list (a single object is read as a list of one; ``[]`` is "no call")."""

    name = "smollm2"
    stop_strings = ("</tool_call>",)

    def parse(self, text: str) -> Parsed:
        if "<tool_call>" not in text:
            return Parsed()
        blocks = _BLOCK.findall(text)
        if not blocks:
            return Parsed(True, error="malformed tool call: no closing </tool_call>")
        try:
            value = _json(blocks[-1])
        except ValueError:
            return Parsed(True, error="malformed tool call: the <tool_call> block is not a JSON "
                                      'list [{"name": ..., "arguments": {...}}]')
        items = value if isinstance(value, list) else [value]
        if not items:
            return Parsed()  # "[]": the model says no call is needed
        calls = []
        for item in items:
            call = _call_of(item, ("arguments", "parameters"))
            if isinstance(call, str):
                return Parsed(True, error=f"malformed tool call: {call}")
            calls.append(call)
        return Parsed(True, calls)

    def render(self, calls: list[Call]) -> str:
        body = ",\n".join(json.dumps({"name": c.name, "arguments": c.arguments}) for c in calls)
        return f"<tool_call>[\n{body}\n]</tool_call>"


_PYTHON_TAG = "<|python_tag|>"
_BUILTIN = re.compile(r"^([A-Za-z_]\w*)\.call\(")


class Llama3Syntax(Syntax):
    """Llama 3.1/3.2: the turn is ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is read
    too), optionally after ``<|python_tag|>`` (a special token the engine's decode drops); calls
    separated by ``;`` are read as several; ``<|python_tag|>name.call(key="value")`` (the
    built-in tool form) is read with ``ast`` (literal values only). The turn ends at the
    template's end of turn (``<|eot_id|>`` / ``<|eom_id|>``), so there is no stop string."""

    name = "llama3"
    stop_strings = ()

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        tagged = body.startswith(_PYTHON_TAG)
        if tagged:
            body = body[len(_PYTHON_TAG):].strip()
        for end in ("<|eom_id|>", "<|eot_id|>"):
            body = body.removesuffix(end).strip()
        if _BUILTIN.match(body):
            return self._builtin(body)
        if not (body.startswith("{") or (tagged and body)):
            return Parsed()
        calls = []
        for part in [p for p in body.split(";") if p.strip()] if ";" in body else [body]:
            try:
                call = _call_of(_json(part), ("parameters", "arguments"))
            except ValueError:
                return Parsed(True, error='malformed tool call: expected one JSON object '
                                          '{"name": ..., "parameters": {...}}')
            if isinstance(call, str):
                return Parsed(True, error=f"malformed tool call: {call}")
            calls.append(call)
        return Parsed(True, calls)

    @staticmethod
    def _builtin(body: str) -> Parsed:
        try:
            node = ast.parse(body, mode="eval").body
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and not node.args):
                raise ValueError
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        except (SyntaxError, ValueError):
            return Parsed(True, error='malformed tool call: expected name.call(key="value")')
        return Parsed(True, [Call(node.func.value.id, args)])

    def render(self, calls: list[Call]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


class TagSyntax(Syntax):
    """rlmix's tag protocol, ``<tool>NAME: INPUT</tool>`` (the env's own parser reads it)."""

    name = "tags"
    stop_strings = ("</tool>", "</answer>")

    def render(self, calls: list[Call]) -> str:
        return "".join(f"<tool>{c.name}: {c.arguments[INPUT_ARGUMENT[c.name]]}</tool>"
                       for c in calls)


SYNTAXES: dict[str, Syntax] = {s.name: s for s in (QwenSyntax(), Llama3Syntax(),
                                                    SmolLM2Syntax(), TagSyntax())}


# ---------------------------------------------------------------- the template


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` list (some ignore it)."""
    probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    try:
        plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(probe, tools=tool_schemas(["calculator"]),
                                                   tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        return False
    return plain != with_tools


def detect_syntax(tokenizer: Any) -> str:
    """The call syntax of a tokenizer's chat template: ``qwen`` when it renders tools and
    teaches ``<tool_call>`` blocks, ``llama3`` when it teaches a bare JSON object with
    ``"parameters"`` (or knows ``<|python_tag|>``/``ipython``), ``smollm2`` when it renders no
    tools at all (SmolLM2's own template: the env writes the tools into the system message).
    Another template that renders tools gets ``qwen``, the most common convention."""
    if tokenizer is None or not renders_tools(tokenizer):
        return "smollm2"
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    template = str(template or "")
    if "<tool_call>" in template:
        return "qwen"
    if "python_tag" in template or "ipython" in template or '"parameters"' in template:
        return "llama3"
    return "qwen"


def smollm2_system(schemas: list[dict[str, Any]]) -> str:
    """The system message that teaches SmolLM2's tool format (its template renders no tools):
    the tools as JSON inside ``<tools></tools>`` and calls as a JSON list inside
    ``<tool_call></tool_call>``, the structure of SmolLM2's documented tool prompt."""
    example = SYNTAXES["smollm2"].render([Call("func_name", {"argument": "value"})])
    listed = [{k: v for k, v in s["function"].items() if k != "return"} for s in schemas]
    return ("You can call functions to answer the question. These are the functions you "
            "can call:\n<tools>" + json.dumps(listed) + "</tools>\n"
            "To call functions, reply with only a list of calls in this format:\n"
            f"{example}\nThe result comes back in a tool message. When you have the result, "
            "reply with the final answer.")
