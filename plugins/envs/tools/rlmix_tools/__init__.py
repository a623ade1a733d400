"""Multi-turn tool use: generated multi-step arithmetic that a calculator or a sandboxed Python
tool makes easy, driven turn by turn through ``rlmix_episode`` (``rlmix.types.Episode``).

The tools are Python functions (``rlmix_tools.calls``); with ``call_format: template`` (the
default) their JSON schemas go to the model's chat template (``Prompt.tools``) and the model's
calls are parsed in that template's own syntax (``qwen``, ``llama3``, ``smollm2``); the final
answer is the last number of the model's last turn. With ``call_format: tags``, the tag format
(also what that format's system text tells the model)::

    <tool>calculator: 482*931 + 77</tool>      one arithmetic expression
    <tool>python:
    print(482*931 + 77)
    </tool>                                      a Python program; its stdout is the result
    <answer>448819</answer>                      the final answer, ends the episode

A tool call ends the model's turn; the result comes back as a ``tool`` message and the model
continues. Reward terms: ``correct``, ``format`` and (opt-in) ``tool_use``; ``rlmix_evaluate``
reports greedy multi-turn accuracy on a held-out set.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any

import torch

import rlmix
from rlmix.types import Episode, Prompt, RolloutBatch, Run, StepResult
from rlmix_tools.calls import (  # noqa: F401  (re-exported)
    INPUT_ARGUMENT,
    SYNTAXES,
    Call,
    Parsed,
    Syntax,
    check_arguments,
    detect_syntax,
    smollm2_system,
    tool_schemas,
)

NAME = "tools"
TOOLS = ("calculator", "python")
STOP_STRINGS = ("</tool>", "</answer>")
_TOOL_CALL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_TOOL_HEAD = re.compile(r"\s*([A-Za-z_][\w-]*)\s*(?::|\n)(.*)\Z", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")

DEFAULT_INSTRUCTIONS = ("Use a tool for every calculation, then give the final answer as "
                        "<answer>NUMBER</answer>.")
TEMPLATE_INSTRUCTIONS = ("Use a tool for every calculation, then reply with only the final "
                         "number.")
TEMPLATE_SYSTEM = "You are a helpful assistant. You call tools to calculate exactly."
CALL_FORMATS = ("template", "tags")
#: call kinds that make a call attempt not well formed (a runtime tool error does not)
NOT_WELL_FORMED = ("malformed", "unknown_tool", "bad_arguments")
MAX_CALLS_PER_TURN = 4
_NUMBERS = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w])")


@dataclass
class Settings:
    digits: int = 3  # digits of every operand, 1..6
    steps: int = 2  # operations per task, 1..4 (steps + 1 operands)
    operators: str = "+-*"  # any of + - *
    tools: list[str] = field(default_factory=lambda: list(TOOLS))  # enabled tools
    python_timeout_s: float = 5.0  # wall-clock limit of one python tool call
    python_memory_mb: int = 256  # address-space limit of one python tool call
    max_tool_chars: int = 400  # a tool result longer than this is truncated
    tool_use_term: bool = False  # also return the reward term `tool_use`
    call_format: str = "template"  # template: the chat template's own call syntax; tags: <tool>
    syntax: str = "auto"  # template call syntax: auto (from the template), qwen, llama3, smollm2
    partial_credit: float = 0.0  # `correct` for the right number in the final turn, not its answer
    demos: int = 0  # worked examples (call, tool result, answer) as earlier turns, 0..3
    eval_size: int = 50  # held-out tasks; 0 = no evaluation
    eval_seed: int = 4321
    eval_max_new_tokens: int = 256  # model tokens over all turns of an evaluation episode
    instructions: str = "auto"  # used when the harness has none; auto = the call format's default
    system: str = ""  # used when the harness has no "system"; "" = generated from `tools`

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 6:
            raise ValueError(f"digits must be 1..6, got {self.digits}")
        if not 1 <= self.steps <= 4:
            raise ValueError(f"steps must be 1..4, got {self.steps}")
        bad = set(self.operators) - set("+-*")
        if not self.operators or bad:
            raise ValueError(f"operators must be made of + - *, got {self.operators!r}")
        unknown = [t for t in self.tools if t not in TOOLS]
        if unknown or not self.tools:
            raise ValueError(f"tools must be a non-empty list of {', '.join(TOOLS)}; got "
                             f"{list(self.tools)}")
        if self.python_timeout_s <= 0:
            raise ValueError(f"python_timeout_s must be > 0, got {self.python_timeout_s}")
        if self.python_memory_mb < 32:
            raise ValueError(f"python_memory_mb must be >= 32, got {self.python_memory_mb}")
        if self.max_tool_chars < 16:
            raise ValueError(f"max_tool_chars must be >= 16, got {self.max_tool_chars}")
        if self.eval_size < 0:
            raise ValueError(f"eval_size must be >= 0, got {self.eval_size}")
        if self.eval_max_new_tokens < 1:
            raise ValueError(f"eval_max_new_tokens must be >= 1, got {self.eval_max_new_tokens}")
        if self.call_format not in CALL_FORMATS:
            raise ValueError(f"call_format must be one of {', '.join(CALL_FORMATS)}, got "
                             f"{self.call_format!r}")
        syntaxes = ("auto", "qwen", "llama3", "smollm2")
        if self.syntax not in syntaxes:
            raise ValueError(f"syntax must be one of {', '.join(syntaxes)}, got {self.syntax!r}")
        if not 0 <= self.demos <= 3:
            raise ValueError(f"demos must be 0..3, got {self.demos}")
        if not 0.0 <= self.partial_credit <= 1.0:
            raise ValueError(f"partial_credit must be in [0, 1], got {self.partial_credit}")

    def default_instructions(self) -> str:
        if self.instructions != "auto":
            return self.instructions
        return TEMPLATE_INSTRUCTIONS if self.call_format == "template" else DEFAULT_INSTRUCTIONS


# ---------------------------------------------------------------- the calculator


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is for the model."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**100


def calculate(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely: numbers, ``+ - * / // % **`` (``^`` is read as
    ``**``, ``×``/``÷`` as ``*``/``/``), unary signs and parentheses; nothing else is parsed,
    so names, calls and attributes are refused. Results beyond 1e100 are refused."""
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 1,234 -> 1234
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression.strip()!r} as arithmetic") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > 1000 or (abs(left) > 1 and right > 0
                                     and right * math.log10(abs(left)) > 100):
                raise CalculatorError("result too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except (OverflowError, ValueError) as exc:
            raise CalculatorError(str(exc)) from None
        if isinstance(value, complex):
            raise CalculatorError("complex result")
        if abs(value) >= MAX_MAGNITUDE or (isinstance(value, float) and not math.isfinite(value)):
            raise CalculatorError("result too large")
        return value
    raise CalculatorError(f"only numbers and + - * / // % ** ( ) are allowed, not "
                          f"{type(node).__name__}")


def format_number(value: int | float) -> str:
    """Integers as they are; floats with up to 12 significant digits (``3.0`` -> ``3``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)


# ---------------------------------------------------------------- tool calls


@dataclass
class ToolCall:
    name: str
    input: str


def parse_tool_call(text: str) -> ToolCall | str | None:
    """The last ``<tool>name: input</tool>`` in ``text``: a ``ToolCall``, an error message
    (``str``) when a call is malformed, or ``None`` when there is no call."""
    calls = _TOOL_CALL.findall(text)
    if not calls:
        if "<tool>" in text:
            return "malformed tool call: no closing </tool>"
        return None
    head = _TOOL_HEAD.match(calls[-1])
    if head is None:
        return ("malformed tool call: expected <tool>NAME: INPUT</tool> with NAME one of "
                f"{', '.join(TOOLS)}")
    name, body = head.group(1).lower(), head.group(2)
    if name != "python":
        return ToolCall(name, body.strip())
    lines = body.split("\n")
    lines[0] = lines[0].strip()  # "python: print(1)" has its code on the tag's line
    return ToolCall(name, textwrap.dedent("\n".join(lines)).strip("\n"))


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 15] + " ...[truncated]"


def run_tool(call: ToolCall, settings: Settings) -> tuple[str, dict[str, Any]]:
    """Execute one call; returns ``(message for the model, info)``. Never raises: an unknown
    tool, a bad expression or a failing program is reported in the message and in
    ``info["error"]``."""
    info: dict[str, Any] = {"tool": call.name, "input": call.input}
    if call.name not in settings.tools:
        info["error"] = f"unknown tool {call.name!r}"
        info["kind"] = "unknown_tool"
        return (f"error: unknown tool {call.name!r}; available: {', '.join(settings.tools)}",
                info)
    if call.name == "calculator":
        try:
            result = format_number(calculate(call.input))
        except CalculatorError as exc:
            info["error"], info["kind"] = str(exc), "tool_error"
            return f"error: {exc}", info
        info["result"] = result
        return result, info
    return _run_python(call.input, settings, info)


def _run_python(code: str, settings: Settings, info: dict[str, Any]) -> tuple[str, dict]:
    try:
        from rlmix_sandbox import run_python
    except ImportError:  # a core without the sandbox: the tool is unavailable, never unsafe
        info["error"], info["kind"] = "python tool unavailable (no rlmix_sandbox)", "tool_error"
        return "error: the python tool is unavailable", info
    if not code.strip():
        info["error"], info["kind"] = "empty program", "tool_error"
        return "error: empty program", info
    result = run_python(code, timeout_s=settings.python_timeout_s,
                        memory_mb=settings.python_memory_mb,
                        max_output_bytes=4 * settings.max_tool_chars)
    info["status"] = result.status
    if result.status == "ok":
        out = result.stdout.strip()
        info["result"] = out
        return truncate(out, settings.max_tool_chars) or "(no output: print the result)", info
    lines = [x for x in result.stderr.strip().splitlines() if x.strip()]
    detail = lines[-1] if lines else result.reason
    info["error"], info["kind"] = f"{result.status}: {detail}", "tool_error"
    return truncate(f"error ({result.status}): {detail}", settings.max_tool_chars), info


# ---------------------------------------------------------------- the episode


class ToolEpisode(Episode):
    """One task: the model calls tools until it answers.

    With the tag format the answer is ``<answer>...</answer>`` and a turn with neither a call
    nor an answer ends the episode (scored 0, ``no <answer> tag``). With the template format
    (``syntax`` one of ``rlmix_tools.calls.SYNTAXES``) a turn without a call attempt is the
    final answer. Every call's info (``tool``, ``input``, ``result`` or ``error`` and
    ``kind``) goes into the turn's ``StepResult.info`` (several calls in one turn: the first
    call's keys and ``calls``, the list of all)."""

    stop_strings = STOP_STRINGS

    def __init__(self, prompt: Prompt, settings: Settings, syntax: str = "tags") -> None:
        self.prompt = prompt
        self.settings = settings
        self.syntax = SYNTAXES[syntax]
        self.stop_strings = self.syntax.stop_strings
        self.schemas = {s["function"]["name"]: s for s in tool_schemas(list(settings.tools))} \
            if syntax != "tags" else {}

    def reset(self) -> list[dict[str, str]]:
        return list(self.prompt.messages)

    def step(self, assistant_text: str) -> StepResult:
        if self.syntax.name != "tags":
            return self._template_step(assistant_text)
        answer_at = assistant_text.rfind("</answer>")
        tool_at = assistant_text.rfind("</tool>")
        if answer_at >= 0 and answer_at > tool_at:
            return StepResult(done=True, info={"answer": parse_answer(assistant_text)})
        call = parse_tool_call(assistant_text)
        if call is None:
            return StepResult(done=True, info={"answer": None})
        if isinstance(call, str):
            return StepResult(messages=[{"role": "tool", "content": f"error: {call}"}],
                              info={"tool": None, "error": call, "kind": "malformed"})
        message, info = run_tool(call, self.settings)
        return StepResult(messages=[{"role": "tool", "content": message}], info=info)

    def _template_step(self, text: str) -> StepResult:
        parsed = self.syntax.parse(text)
        if not parsed.attempted:
            return StepResult(done=True, info={"answer": final_answer(text)})
        if parsed.error:
            return StepResult(messages=[{"role": "tool", "content": f"error: {parsed.error}"}],
                              info={"tool": None, "error": parsed.error, "kind": "malformed"})
        messages, records = [], []
        for call in parsed.calls[:MAX_CALLS_PER_TURN]:
            message, info = self._execute(call)
            messages.append({"role": "tool", "content": message})
            records.append(info)
        info = dict(records[0]) if len(records) == 1 else {**records[0], "calls": records}
        return StepResult(messages=messages, info=info)

    def _execute(self, call: Call) -> tuple[str, dict[str, Any]]:
        """Check one parsed call against its tool's schema, then run it."""
        if call.name not in self.schemas:
            info = {"tool": call.name, "input": json.dumps(call.arguments),
                    "error": f"unknown tool {call.name!r}", "kind": "unknown_tool"}
            return (f"error: unknown tool {call.name!r}; available: "
                    f"{', '.join(self.settings.tools)}", info)
        problem = check_arguments(call, self.schemas[call.name])
        if problem:
            info = {"tool": call.name, "input": json.dumps(call.arguments), "error": problem,
                    "kind": "bad_arguments"}
            return f"error: {problem}", info
        message, info = run_tool(ToolCall(call.name, call.arguments[INPUT_ARGUMENT[call.name]]),
                                 self.settings)
        return message, info


# ---------------------------------------------------------------- tasks


def make_task(rng: random.Random, digits: int, steps: int, operators: str) -> str:
    """An expression of ``steps + 1`` operands of ``digits`` digits, e.g. ``482 * 931 + 77``."""
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    parts = [str(rng.randint(lo, hi))]
    for _ in range(steps):
        parts += [rng.choice(operators), str(rng.randint(lo, hi))]
    return " ".join(parts)


def task_space(digits: int, steps: int, operators: str) -> int:
    """How many distinct tasks ``make_task`` can draw."""
    operands = 10**digits - (0 if digits == 1 else 10 ** (digits - 1))
    return operands ** (steps + 1) * len(set(operators)) ** steps


def task_set(seed: int, size: int, digits: int, steps: int, operators: str) -> list[str]:
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[str] = []
    attempts = 0
    while len(out) < size and attempts < 100 * max(size, 1):
        attempts += 1
        task = make_task(rng, digits, steps, operators)
        if task not in seen:
            seen.add(task)
            out.append(task)
    return out


def system_text(tools: list[str]) -> str:
    """The default system message: the tools and the tag format."""
    lines = ["You can use tools. To call one, write a tool call and stop; its result comes "
             "back in a tool message."]
    if "calculator" in tools:
        lines.append("<tool>calculator: 482*931 + 77</tool> evaluates one arithmetic "
                     "expression (+ - * / // % ** and parentheses).")
    if "python" in tools:
        lines.append("<tool>python:\nprint(482*931 + 77)\n</tool> runs a Python program and "
                     "returns what it prints.")
    lines.append("When you know the result, reply with <answer>NUMBER</answer>.")
    return "\n".join(lines)


def call_syntax(run: Run) -> str:
    """The run's call syntax: ``tags``, or the template syntax (``tools.syntax``, or detected
    from the policy's chat template; ``smollm2`` when there is no tokenizer)."""
    s = run.settings(NAME)
    if s.call_format == "tags":
        return "tags"
    if s.syntax != "auto":
        return s.syntax
    cache = run.state.setdefault(NAME, {})
    if "syntax" not in cache:
        cache["syntax"] = detect_syntax(run.tokenizer)
    return cache["syntax"]


def to_prompt(run: Run, task: str, settings: Settings, pid: str) -> Prompt:
    syntax = call_syntax(run)
    tools: list[dict[str, Any]] | None = None
    if syntax == "tags":
        default_system = system_text(list(settings.tools))
    elif syntax == "smollm2":  # the template renders no tools: the system message teaches them
        default_system = smollm2_system(tool_schemas(list(settings.tools)))
    else:  # the template renders the tools and teaches its own call format
        default_system, tools = TEMPLATE_SYSTEM, tool_schemas(list(settings.tools))
    system = run.harness.get("system") or settings.system or default_system
    instructions = run.harness.get("instructions", settings.default_instructions())

    def ask(t: str) -> dict[str, str]:
        return {"role": "user", "content": f"Compute {t}." + (f" {instructions}"
                                                               if instructions else "")}

    messages = [{"role": "system", "content": system}]
    for demo in _demo_tasks(run):  # worked examples first, asked the same way as the task
        messages += [ask(demo), *demo_turns(demo, syntax, settings)[1:]]
    return Prompt(messages=[*messages, ask(task)], answer=calculate(task), id=pid, tools=tools,
                  info={"env": NAME, "task": task, "syntax": syntax})


def demo_turns(task: str, syntax: str, settings: Settings) -> list[dict[str, str]]:
    """One worked example as chat turns: the question, the model's calculator call in
    ``syntax``, the tool's result, the final answer in that format's way."""
    result = format_number(calculate(task))
    call = SYNTAXES[syntax].render([Call("calculator", {"expression": task})])
    final = f"<answer>{result}</answer>" if syntax == "tags" else result
    return [{"role": "user", "content": f"Compute {task}."},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": final}]


def _demo_tasks(run: Run) -> list[str]:
    """``demos`` tasks of the env's family, never held-out ones (a stream of their own)."""
    s = run.settings(NAME)
    if not s.demos or "calculator" not in s.tools:
        return []
    cache = run.state.setdefault(NAME, {})
    if "demos" not in cache:
        held_out = set(_eval_set(run))
        candidates = task_set(s.eval_seed + 1, s.demos + len(held_out), s.digits, s.steps,
                              s.operators)
        cache["demos"] = [t for t in candidates if t not in held_out][:s.demos]
    return cache["demos"]


def _eval_set(run: Run) -> list[str]:
    s = run.settings(NAME)
    cache = run.state.setdefault(NAME, {})
    if "eval" not in cache:
        cache["eval"] = task_set(s.eval_seed, s.eval_size, s.digits, s.steps, s.operators)
    return cache["eval"]


# ---------------------------------------------------------------- scoring


def _number(raw: str) -> int | float | None:
    raw = raw.strip().replace(",", "").replace(" ", "")
    if not _NUMBER.match(raw):
        return None
    value = float(raw)
    return int(value) if value.is_integer() and "." not in raw and "e" not in raw.lower() \
        else value


def parse_answer(text: str) -> int | float | None:
    """The number in the last ``<answer>...</answer>`` (commas and spaces dropped), or None."""
    found = _ANSWER.findall(text)
    return _number(found[-1]) if found else None


def numbers_in(text: str) -> list[int | float]:
    """Every number written in ``text`` (``1,234`` is one number), in order."""
    return [v for v in (_number(m) for m in _NUMBERS.findall(text)) if v is not None]


def final_answer(text: str) -> int | float | None:
    """The final answer of a template-format turn: the number in its last ``<answer>`` tag if
    it has one, else the last number it writes."""
    if "<answer>" in text:
        return parse_answer(text)
    found = numbers_in(text)
    return found[-1] if found else None


def _same(a: int | float, b: int | float) -> bool:
    return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))


def _call_records(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for t in turns:
        info = t.get("info") or {}
        if "tool" in info:
            out += info.get("calls") or [info]
    return out


def grade(model_text: str, turns: list[dict[str, Any]], target: int | float,
          multi_turn: bool, syntax: str = "tags", partial_credit: float = 0.0
          ) -> dict[str, Any]:
    """One sample's verdict: ``correct``, ``format``, ``tool_use`` (0/1), ``well_formed_call``
    (1 when at least one call was well formed: it parsed, named a tool and fit its schema),
    ``exact`` and why. Tags: the answer is the last ``<answer>`` of the model's text and
    ``format`` is 1 for a numeric answer with no malformed call. Template syntaxes: the answer
    is the final turn's (``final_answer``; a turn cut short or a call attempt is no answer),
    ``format`` is the share of call attempts that were well formed (0 with none), and
    ``correct`` is 1 for the exact answer, ``partial_credit`` when the target is a number
    written in the final turn but not its answer."""
    calls = _call_records(turns)
    errors = [c for c in calls if c.get("error")]
    malformed = [c for c in errors if c.get("kind") in NOT_WELL_FORMED]
    well_formed = len(calls) - len(malformed)
    final = ""
    if syntax == "tags":
        answer = parse_answer(model_text)
        missing = "<answer>" not in model_text
    else:
        if multi_turn:
            last = turns[-1] if turns else {}
            final = last.get("assistant", "") if "answer" in (last.get("info") or {}) else ""
        elif not SYNTAXES[syntax].parse(model_text).attempted:
            final = model_text
        answer = final_answer(final) if final else None
        missing = not final
    if missing:
        reason = "no <answer> tag" if syntax == "tags" else "no final answer"
    elif answer is None:
        reason = "answer is not a number"
    elif _same(answer, target):
        reason = "correct"
    else:
        reason = "wrong answer"
    exact = float(reason == "correct")
    if syntax == "tags":
        fmt = float(answer is not None and not malformed)
        correct = exact
    else:
        fmt = well_formed / len(calls) if calls else 0.0
        near = not exact and any(_same(v, target) for v in numbers_in(final))
        correct = exact or (partial_credit if near else 0.0)
    return {"target": target, "answer": answer, "reason": reason, "exact": exact,
            "correct": float(correct), "format": float(fmt),
            "tool_use": float(any(not c.get("error") for c in calls)),
            "well_formed_call": float(well_formed > 0),
            "tool_calls": len(calls), "tool_errors": len(errors), "multi_turn": multi_turn,
            "syntax": syntax,
            "calls": [{k: c[k] for k in ("tool", "input", "result", "error", "kind") if k in c}
                      for c in calls]}


def grade_batch(batch: RolloutBatch, partial_credit: float = 0.0) -> list[dict[str, Any]]:
    """Grade every row: from the episode record when the engine ran turns (model text only,
    so a tool's output can never supply the answer), otherwise from the completion text (a
    call is then counted but was never run)."""
    out = []
    for text, info, prompt in zip(batch.texts, batch.info, batch.prompts):
        syntax = prompt.info.get("syntax", "tags")
        episode = info.get("episode")
        if isinstance(episode, dict) and "turns" in episode:
            out.append(grade(episode.get("model_text", ""), episode["turns"], prompt.answer,
                             True, syntax, partial_credit))
        else:
            turns = []
            if syntax != "tags":
                parsed = SYNTAXES[syntax].parse(text)
                if parsed.attempted:
                    turns = [{"assistant": text, "info": {
                        "tool": parsed.calls[0].name if parsed.calls else None,
                        "input": "", "error": parsed.error or "not run (single turn)",
                        "kind": "malformed" if parsed.error else "not_run"}}]
            out.append(grade(text, turns, prompt.answer, False, syntax, partial_credit))
    return out


# ---------------------------------------------------------------- hooks


@rlmix.hookimpl
def rlmix_configure(run: Run) -> None:
    _eval_set(run)
    call_syntax(run)


@rlmix.hookimpl
def rlmix_prompts(run: Run, step: int) -> list[Prompt]:
    s = run.settings(NAME)
    held_out = set(_eval_set(run))
    # unless the held-out set is the whole task space (tiny settings), never train on it
    avoid = len(held_out) < task_space(s.digits, s.steps, s.operators)
    # one stream per step: a resumed run sees exactly the prompts it would have seen
    rng = random.Random(f"{NAME}-{run.config.train.seed}-{step}")
    prompts: list[Prompt] = []
    while len(prompts) < int(run.config.train.prompts_per_step):
        task = make_task(rng, s.digits, s.steps, s.operators)
        if task in held_out and avoid:
            continue  # held-out tasks are never trained on
        prompts.append(to_prompt(run, task, s, f"{NAME}-{step}-{len(prompts)}"))
    return prompts


@rlmix.hookimpl
def rlmix_episode(run: Run, prompt: Prompt) -> Episode | None:
    if prompt.info.get("env") != NAME:
        return None
    return ToolEpisode(prompt, run.settings(NAME), prompt.info.get("syntax", "tags"))


@rlmix.hookimpl
def rlmix_score(run: Run, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    s = run.settings(NAME)
    verdicts = grade_batch(batch, s.partial_credit)
    for info, verdict in zip(batch.info, verdicts):
        info[NAME] = verdict
    if verdicts:  # written with the step's metrics line
        run.log(f"{NAME}/well_formed_call", sum(v["well_formed_call"] for v in verdicts)
                / len(verdicts))
        run.log(f"{NAME}/accuracy", sum(v["exact"] for v in verdicts) / len(verdicts))
    terms = {"correct": torch.tensor([v["correct"] for v in verdicts]),
             "format": torch.tensor([v["format"] for v in verdicts])}
    if s.tool_use_term:
        terms["tool_use"] = torch.tensor([v["tool_use"] for v in verdicts])
    return terms


@rlmix.hookimpl
def rlmix_evaluate(run: Run) -> dict[str, float]:
    s = run.settings(NAME)
    tasks = _eval_set(run)
    if not tasks:
        return {}
    prompts = [to_prompt(run, t, s, f"{NAME}-eval-{i}") for i, t in enumerate(tasks)]
    batch = run.generate(prompts, temperature=0.0, max_new_tokens=s.eval_max_new_tokens)
    verdicts = grade_batch(batch, s.partial_credit)
    calls = sum(v["tool_calls"] for v in verdicts)
    n = len(verdicts)
    return {"accuracy": sum(v["exact"] for v in verdicts) / n,
            "format": sum(v["format"] for v in verdicts) / n,
            "well_formed_call": sum(v["well_formed_call"] for v in verdicts) / n,
            "tool_use": sum(v["tool_use"] for v in verdicts) / n,
            "tool_calls": calls / n,
            "tool_error_rate": (sum(v["tool_errors"] for v in verdicts) / calls) if calls
            else 0.0}
