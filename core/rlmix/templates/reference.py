"""Reference documents generated from the code: the manifest reference (``rlmix config
--schema``, from the settings dataclasses of the core and of every installed plugin) and the
hooks reference (``rlmix config --hooks``, from ``rlmix.hookspecs``).

A field's description is its ``metadata["help"]`` (or ``"description"`` / ``"doc"``), else
the comment at the end of its line in the dataclass's source, else the comment lines just above
it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import inspect
import io
import textwrap
import tokenize
import typing
from typing import Any

#: descriptions of core keys whose source line has no comment (a comment there takes precedence)
CORE_NOTES = {
    "model": "model alias (`tiny-random`, `smollm2-135m`), local folder, or Hugging Face id "
             "already on disk",
    "plugins": "entry-point names, in order; the last one implementing a single-owner hook owns "
               "it, wrappers compose in this order",
    "name": "run name (default: the manifest file's name)",
    "train": "training loop",
    "sampling": "sampling settings of training rollouts (evaluation is greedy)",
    "policy": "model precision, device and forward options",
    "log": "what the run writes besides `metrics.jsonl`",
    "score": "how reward terms are combined",
    "train.steps": "training steps",
    "train.prompts_per_step": "prompts per step (from `rlmix_prompts`)",
    "train.group_size": "completions sampled per prompt",
    "train.lr": "learning rate of the default AdamW",
    "train.weight_decay": "AdamW weight decay",
    "train.adam_beta1": "AdamW beta1",
    "train.adam_beta2": "AdamW beta2",
    "train.max_grad_norm": "gradient clipping norm; 0 = no clipping",
    "train.optimizer_in_backward": ("step each parameter inside the backward as soon as its "
                                    "gradient is ready and free it (no gradient copy of the "
                                    "model); needs `max_grad_norm: 0` and `grad_accum: 1`"),
    "train.warmup_steps": "linear learning-rate warm-up, in optimizer steps",
    "train.lr_schedule": ("after warm-up: `constant`, or `linear` decay to 0 over the run's "
                          "optimizer steps (Hugging Face's linear schedule)"),
    "train.shuffle": "shuffle rows before splitting them into optimizer steps",
    "train.seed": "seed of every random choice (prompts, sampling, minibatch order)",
    "train.keep_checkpoints": "checkpoints kept (the newest)",
    "sampling.temperature": "sampling temperature of training rollouts (> 0)",
    "sampling.top_p": "nucleus sampling; 1 = off",
    "sampling.top_k": "top-k sampling; 0 = off",
    "sampling.max_new_tokens": "completion length limit",
    "log.progress": "progress bar",
    "log.tensorboard": "TensorBoard event files (needs the `tensorboard` extra)",
    "log.plot": "PNG plots of the metrics in `plots/`",
}


def field_comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` from the dataclass's source: the comment at the end of the field's
    line, else the comment lines right above it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, tokenize.TokenError, SyntaxError, IndentationError):
        return {}
    lines = source.splitlines()

    def comment_only(tok: tokenize.TokenInfo) -> bool:
        return lines[tok.start[0] - 1].strip().startswith("#")

    above = {t.start[0]: t.string.lstrip("#").strip() for t in tokens
             if t.type == tokenize.COMMENT and comment_only(t)}
    logical: list[list[tokenize.TokenInfo]] = []
    current: list[tokenize.TokenInfo] = []
    for tok in tokens:
        current.append(tok)
        if tok.type == tokenize.NEWLINE:
            logical.append(current)
            current = []
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE)
    out: dict[str, str] = {}
    for toks in logical:
        code = [t for t in toks if t.type not in skip]
        if len(code) < 2 or code[0].type != tokenize.NAME or code[1].string != ":" \
                or code[0].start[1] == 0:
            continue
        trailing = [t.string.lstrip("#").strip() for t in toks
                    if t.type == tokenize.COMMENT and not comment_only(t)]
        text = " ".join(trailing)
        if not text:
            line, found = code[0].start[0] - 1, []
            while line in above:
                found.insert(0, above[line])
                line -= 1
            text = " ".join(found)
        if text:
            out.setdefault(code[0].string, text)
    return out


def describe_field(cls: type, f: dataclasses.Field, comments: dict[str, str],
                   path: str = "") -> str:
    for key in ("help", "description", "doc"):
        if f.metadata.get(key):
            return str(f.metadata[key])
    return comments.get(f.name) or CORE_NOTES.get(path, "")


def type_name(hint: Any) -> str:
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    text = str(hint).replace("typing.", "")
    return text


def yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        r = repr(value)
        if "e" in r and "." not in r.split("e")[0]:
            mantissa, exp = r.split("e")
            r = f"{mantissa}.0e{int(exp)}"
        return r
    if isinstance(value, str):
        return '""' if value == "" else value
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    if hasattr(value, "name") and hasattr(value, "value"):  # an Enum member
        return str(value.name)
    return str(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table(cls: type, prefix: str = "", core: bool = False) -> tuple[list[str],
                                                                            list[tuple[str, type]]]:
    """Markdown table rows of ``cls``'s fields, and its nested dataclass fields (sections)."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    nested = []
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name, Any)
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):
            nested.append((path, hint))
            continue
        default = _default(f)
        shown = "(required)" if default is dataclasses.MISSING else f"`{yaml_value(default)}`"
        desc = describe_field(cls, f, comments, path if core else "")
        rows.append(f"| `{path}` | {_cell(type_name(hint))} | {_cell(shown)} | {_cell(desc)} |")
    return rows, nested


def schema_markdown() -> str:
    """The manifest reference: the core's sections and every installed plugin's settings."""
    from rlmix import manifest
    from rlmix import plugins as plugin_loading

    lines = [
        "# Manifest reference",
        "",
        "Generated by `rlmix config --schema` from the settings dataclasses of the core "
        "(`rlmix.manifest`) and of every installed plugin (each plugin's `Settings`). "
        "Regenerate it after changing one:",
        "",
        "```",
        "rlmix config --schema > docs/manifest-reference.md",
        "```",
        "",
        "A manifest is YAML. A plugin named `a.b` reads the block at the path `a.b` (nested in "
        "YAML, `a.b.key=value` on the command line). Every key is checked against these tables "
        "before any model loads: a wrong key or type fails with the key path and the allowed "
        "keys. `rlmix config MANIFEST` prints the fully resolved manifest and the hook owners.",
        "",
        "## Core",
        "",
    ]
    rows, nested = settings_table(manifest.CoreConfig, core=True)
    lines += ["### Top level", "", *rows, ""]
    core_comments = field_comments(manifest.CoreConfig)
    for path, cls in nested:
        lines.append(f"### `{path}`")
        lines.append("")
        f = next(f for f in dataclasses.fields(manifest.CoreConfig) if f.name == path)
        desc = describe_field(manifest.CoreConfig, f, core_comments, path)
        if desc:
            lines += [desc[0].upper() + desc[1:] + ".", ""]
        sub_rows, _ = settings_table(cls, prefix=f"{path}.", core=True)
        lines += [*sub_rows, ""]
    lines += ["## Plugins", ""]
    found = plugin_loading.installed()
    if not found:
        lines += ["No rlmix plugins are installed.", ""]
    for info in sorted(found.values(), key=lambda i: (i.family, i.name)):
        lines += plugin_section(info)
    return "\n".join(lines).rstrip("\n") + "\n"


def plugin_section(info: Any) -> list[str]:
    from rlmix import plugins as plugin_loading

    head = (f"### `{info.name}`", "",
            f"{info.family}, {info.distribution} {info.version}.")
    try:
        obj = md.EntryPoint(name=info.name, value=info.value, group=info.family).load()
    except Exception as exc:  # noqa: BLE001 - the reference still lists it
        return [*head, f" It failed to import ({type(exc).__name__}: {exc}).", ""]
    desc = plugin_loading.describe(obj)
    hooks = ", ".join(f"`{h}`" for h in plugin_loading.hooks_of(obj))
    lines = [*head[:2], f"{info.family}, {info.distribution} {info.version}; hooks: "
             f"{hooks or 'none'}.", ""]
    if desc:
        lines += [desc, ""]
    cls = plugin_loading.settings_class(obj)
    if cls is None:
        return [*lines, "Takes no settings.", ""]
    try:
        rows, nested = settings_table(cls, prefix=f"{info.name}.")
    except Exception as exc:  # noqa: BLE001
        return [*lines, f"Its settings could not be read ({type(exc).__name__}: {exc}).", ""]
    lines += rows
    for path, sub in nested:
        sub_rows, _ = settings_table(sub, prefix=f"{path}.")
        lines += sub_rows[2:]
    return [*lines, ""]


#: the order hooks are called in one training step (DESIGN §2), then the rest
HOOK_ORDER = ("rlmix_configure", "rlmix_prepare_model", "rlmix_prompts",
              "rlmix_select_prompts", "rlmix_sample",
              "rlmix_generate", "rlmix_episode", "rlmix_score", "rlmix_advantage",
              "rlmix_token_logprobs", "rlmix_clip", "rlmix_update", "rlmix_evolve",
              "rlmix_evaluate", "rlmix_step_end", "rlmix_run_end")


def hooks_markdown() -> str:
    """The hooks reference, from ``rlmix.hookspecs``'s docstrings."""
    from rlmix import hookspecs

    names = [h for h in HOOK_ORDER if hasattr(hookspecs, h)]
    names += sorted(n for n in dir(hookspecs) if n.startswith("rlmix_") and n not in names)
    intro = inspect.getdoc(hookspecs) or ""
    lines = [
        "# Hooks reference",
        "",
        "Generated by `rlmix config --hooks` from the docstrings of `rlmix/hookspecs.py` "
        "(regenerate: `rlmix config --hooks > docs/hooks.md`). A plugin implements a hook by "
        "defining a function of the same name marked `@rlmix.hookimpl`; it may take any subset "
        "of the hook's arguments, by name. `rlmix_conformance` checks each hook's "
        "contract (`pytest --rlmix-conformance NAME`).",
        "",
        intro,
        "",
        "## Summary",
        "",
        "| hook | kind | required | called |",
        "| --- | --- | --- | --- |",
    ]
    for name in names:
        kind = "firstresult (one owner) + wrappers" if name in hookspecs.FIRSTRESULT_HOOKS \
            else "all implementations"
        required = hookspecs.REQUIRED_HOOKS.get(name, "")
        lines.append(f"| [`{name}`](#{name}) | {kind} | {_cell(required) or '-'} | "
                     f"{_WHEN.get(name, '')} |")
    lines.append("")
    for name in names:
        fn = getattr(hookspecs, name)
        sig = inspect.signature(fn)
        params = ", ".join(p.name if p.annotation is inspect.Parameter.empty
                           else f"{p.name}: {p.annotation}" for p in sig.parameters.values())
        ret = sig.return_annotation
        ret_text = f" -> {ret}" if ret is not inspect.Signature.empty else ""
        kind = ("**firstresult**: one owner answers (the plugin listed last among its "
                "implementers); wrappers compose around it" if name in hookspecs.FIRSTRESULT_HOOKS
                else "**all**: every implementation is called")
        lines += [f"## {name}", "", "```python", f"{name}({params}){ret_text}", "```", "",
                  kind + ".", ""]
        if name in hookspecs.REQUIRED_HOOKS:
            lines += [f"Required: a run needs {hookspecs.REQUIRED_HOOKS[name]}.", ""]
        lines += [inspect.getdoc(fn) or "", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


_WHEN = {
    "rlmix_configure": "once, after the model loads (manifest order)",
    "rlmix_prepare_model": "once, after every `rlmix_configure` (and a resume's restore)",
    "rlmix_prompts": "each step, first",
    "rlmix_select_prompts": "each step, via `Run.sample`, before `rlmix_sample`",
    "rlmix_sample": "each step, via `Run.sample`",
    "rlmix_generate": "by the default `rlmix_sample`, evaluation, `Run.generate`",
    "rlmix_episode": "by multi-turn rollout engines (`hf`), once per sample before generating",
    "rlmix_score": "each step, after sampling",
    "rlmix_advantage": "each step, after scoring",
    "rlmix_token_logprobs": "each minibatch forward (`Policy.logprobs`)",
    "rlmix_clip": "each minibatch",
    "rlmix_update": "each minibatch, after `rlmix_clip`",
    "rlmix_evolve": "each step, after the updates",
    "rlmix_evaluate": "at the start, every `train.eval_every` steps, at the end",
    "rlmix_step_end": "each step, last",
    "rlmix_run_end": "once, when `train` ends (also on an exception)",
}
