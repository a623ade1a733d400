"""Scaffolding: ``rlmix new-plugin`` writes a plugin package from the templates in this folder.

``plugin/*.tmpl`` are the package's files; ``hooks/<short name>.tmpl`` hold, per hook, the
pieces it adds (settings fields, their checks, configure lines, pure helpers, the hookimpl,
tests, a README line), in sections that start with ``#@ <section>``. Placeholders are
``{{key}}``.
"""

from __future__ import annotations

import ast
import keyword
import re
import textwrap
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from rlmix.errors import RlmixError

#: family -> the hooks a new plugin of that family implements unless --hooks says otherwise
FAMILY_HOOKS: dict[str, tuple[str, ...]] = {
    "algorithms": ("advantage", "clip"),
    "rollout": ("generate",),
    "envs": ("prompts", "score", "evaluate"),
    "harness": ("evolve",),
    "kernels": ("token_logprobs",),
    "trainers": ("update",),
}
#: short hook names, in the order the generated module lists them
HOOKS = ("configure", "prompts", "sample", "generate", "score", "advantage", "clip", "update",
         "evolve", "token_logprobs", "evaluate", "step_end")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_RESERVED = {"model", "plugins", "out", "name", "train", "sampling", "policy", "log", "score",
             "harness", "kit_env", "kit_rollout", "kit_algo", "kit_poison"}
_SECTIONS = ("readme", "settings", "checks", "configure", "helpers", "hook", "test")


@dataclass
class HookTemplate:
    short: str
    sections: dict[str, str] = field(default_factory=dict)


def _read(*parts: str) -> str:
    return resources.files(__name__).joinpath(*parts).read_text(encoding="utf-8")


def hook_template(short: str) -> HookTemplate:
    text = _read("hooks", f"{short}.tmpl")
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("#@ "):
            current = line[3:].strip()
            if current not in _SECTIONS:
                raise ValueError(f"hooks/{short}.tmpl: unknown section {current!r}")
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return HookTemplate(short, {k: "\n".join(v).strip("\n") for k, v in sections.items()})


def parse_hooks(text: str | None, family: str) -> list[str]:
    """``"advantage,clip"`` (short or ``rlmix_`` names) -> short names in module order."""
    if text is None:
        chosen = list(FAMILY_HOOKS[family])
    else:
        chosen = [h.strip().removeprefix("rlmix_") for h in text.split(",") if h.strip()]
        if not chosen:
            raise RlmixError("--hooks: name at least one hook, e.g. --hooks advantage,clip")
        unknown = [h for h in chosen if h not in HOOKS]
        if unknown:
            raise RlmixError(f"--hooks: unknown hook {', '.join(repr(u) for u in unknown)}; "
                             f"choose from {', '.join(HOOKS)}")
    return [h for h in HOOKS if h in chosen]


def check_family(family: str) -> str:
    short = family.removeprefix("rlmix.")
    if short not in FAMILY_HOOKS:
        raise RlmixError(f"--family: unknown family {family!r}; choose one of "
                         f"{', '.join(FAMILY_HOOKS)}")
    return short


def check_name(name: str) -> str:
    if not _NAME.match(name) or keyword.iskeyword(name):
        raise RlmixError(f"invalid plugin name {name!r}: use lowercase letters, digits and "
                         f"underscores, starting with a letter (it becomes the module "
                         f"rlmix_<name> and the manifest key <name>)")
    if name in _RESERVED:
        raise RlmixError(f"invalid plugin name {name!r}: it is a reserved manifest key; "
                         f"choose another")
    return name


def _fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    left = re.findall(r"\{\{(\w+)\}\}", text)
    if left:
        raise ValueError(f"template placeholders without a value: {sorted(set(left))}")
    return text


_TYPES = ("GenerationRequest", "HarnessUpdate", "LOSS_MODES", "LossTerms", "Minibatch",
          "Normalizers", "Prompt", "RolloutBatch", "Run")


def _imports(body: str, module: bool, module_name: str) -> str:
    """The import block the generated code uses (ruff's isort order, rlmix first-party)."""
    std = []
    if re.search(r"\brandom\.", body):
        std.append("import random")
    if re.search(r"\bmath\.", body):
        std.append("import math")
    if re.search(r"\bGenerator\[", body):
        std.append("from collections.abc import Generator")
    if module:
        std.append("from dataclasses import dataclass")
    if re.search(r"\bAny\b", body):
        std.append("from typing import Any")
    third = []
    if re.search(r"\bplugin\.", body):
        third.append(f"import {module_name} as plugin")
    if re.search(r"\bpytest\.", body):
        third.append("import pytest")
    if re.search(r"\btorch\.", body):
        third.append("import torch")
    if re.search(r"\bcheck_plugin\(", body):  # a distribution of its own: third-party to isort
        third.append("from rlmix_conformance import check_plugin")
    first = []
    if module or re.search(r"\brlmix\.[A-Za-z]", body.replace("rlmix.hookimpl", "rlmix.x")):
        first.append("import rlmix")
    from_rlmix = [m for m in ("ops", "standins") if re.search(rf"\b{m}\.", body)]
    if "ops" in from_rlmix:
        first.append("from rlmix import ops")
    testing = [n for n in ("make_batch", "make_run") if re.search(rf"\b{n}\(", body)]
    if "standins" in from_rlmix:
        testing.insert(0, "standins")
    if testing:
        first.append(f"from rlmix.testing import {', '.join(sorted(testing))}")
    types = [t for t in _TYPES if re.search(rf"\b{t}\b", body)]
    if types:
        names = sorted(types, key=lambda n: (not n.isupper(), n))  # isort: constants first
        line = f"from rlmix.types import {', '.join(names)}"
        if len(line) > 100:
            line = "from rlmix.types import (\n" + "".join(f"    {n},\n" for n in names) + ")"
        first.append(line)

    def order(lines: list[str]) -> list[str]:  # "import x" before "from x import y" (isort)
        return sorted(lines, key=lambda s: (s.startswith("from "), s.split()[1].lower()))

    blocks = [order(b) for b in (std, third, first) if b]
    return "\n\n".join("\n".join(b) for b in blocks)


def _field_lines(templates: list[HookTemplate]) -> list[str]:
    lines = []
    for t in templates:
        lines.extend(t.sections.get("settings", "").splitlines())
    return [line for line in lines if line.strip()]


def _yaml_value(text: str) -> str:
    """A Python default as YAML (``True`` -> ``true``, ``1e-6`` -> ``1.0e-6``)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        r = repr(value)
        if "e" in r and "." not in r.split("e")[0]:
            mantissa, exp = r.split("e")
            r = f"{mantissa}.0e{int(exp)}"
        return r
    if isinstance(value, str):
        return value if re.fullmatch(r"[A-Za-z][\w.+-]*", value) else repr(value)
    return text


def _manifest_block(name: str, fields: list[str]) -> str:
    if not fields:
        return f"# {name} takes no settings"
    out = [f"{name}:"]
    for line in fields:
        decl, _, comment = line.strip().partition("#")
        key, _, rest = decl.partition(":")
        entry = f"  {key.strip()}: {_yaml_value(rest.partition('=')[2].strip())}"
        out.append(f"{entry:<34}  # {comment.strip()}" if comment else entry)
    return "\n".join(out)


def render(name: str, family: str, hooks: list[str]) -> dict[str, str]:
    """``{relative path: text}`` of the plugin package."""
    module = f"rlmix_{name}"
    values = {"name": name, "module": module, "dist": f"rlmix-{name.replace('_', '-')}",
              "family": family}
    templates = [hook_template(h) for h in hooks if h != "configure"]
    all_templates = [hook_template(h) for h in hooks]
    fields = _field_lines(templates)
    checks = [t.sections["checks"] for t in templates if t.sections.get("checks")]
    helpers = [t.sections["helpers"] for t in templates if t.sections.get("helpers")]
    configure = [t.sections["configure"] for t in templates if t.sections.get("configure")]
    hook_code = [t.sections["hook"] for t in templates if t.sections.get("hook")]
    configure_body = "\n".join(configure)
    if re.search(r"\bs\.", configure_body):
        configure_body = "    s = run.settings(NAME)  # already validated against Settings\n" \
            + configure_body
    if not configure_body.strip():
        configure_body = "    run.settings(NAME)  # already validated against Settings"
    hook_names = [f"`rlmix_{h}`" for h in hooks]
    hook_list = ", ".join(hook_names[:-1]) + (" and " if len(hook_names) > 1 else "") \
        + hook_names[-1]
    intro = textwrap.fill(f"Written by `rlmix new-plugin` with the hooks {hook_list}. Each hook "
                          f"already works, so the plugin runs as it is: replace the "
                          f"starting-point logic with your method, keep each hook's contract "
                          f"(docs/hooks.md, or the docstrings of rlmix.hookspecs) and check it "
                          f"with the kit:", width=96)
    module_values = {
        **values, "intro": intro,
        "fields": "\n".join(fields) if fields else "    pass",
        "checks": "\n".join(checks) if checks else "        pass",
        "helpers": ("\n\n" + "\n\n\n".join(helpers) + "\n") if helpers else "",
        "configure": configure_body,
        "hooks": ("\n\n" + "\n\n\n".join(hook_code)) if hook_code else "",
    }
    body = _fill(_read("plugin", "module.py.tmpl").replace("{{imports}}", ""), module_values)
    module_text = _fill(_read("plugin", "module.py.tmpl"),
                        {**module_values, "imports": _imports(body, True, module)})
    tests = [t.sections["test"] for t in templates if t.sections.get("test")]
    test_body = _read("plugin", "tests.py.tmpl").replace("{{test_imports}}", "")
    test_values = {**values, "hook_tests": ("\n\n" + "\n\n\n".join(tests)) if tests else ""}
    test_body = _fill(test_body, test_values)
    test_imports = _imports(test_body, False, module)
    test_text = _fill(_read("plugin", "tests.py.tmpl"), {**test_values,
                                                         "test_imports": test_imports})
    readme_hooks = "\n".join(t.sections["readme"].replace("NAME", name)
                             for t in all_templates if t.sections.get("readme"))
    support = {"algorithms": "hf, arith", "rollout": "arith, grpo", "envs": "hf",
               "harness": "hf, arith, grpo", "kernels": "hf, arith, grpo",
               "trainers": "hf, arith, grpo"}[family]
    manifest_plugins = f"{support}, {name}" if family != "envs" else f"hf, {name}, grpo"
    readme = _fill(_read("plugin", "README.md.tmpl"), {
        **values, "hook_list": hook_list, "readme_hooks": readme_hooks,
        "manifest_plugins": manifest_plugins, "manifest_block": _manifest_block(name, fields)})
    return {
        "pyproject.toml": _fill(_read("plugin", "pyproject.toml.tmpl"), values),
        "tox.ini": _fill(_read("plugin", "tox.ini.tmpl"), values),
        "README.md": readme,
        f"{module}/__init__.py": module_text.rstrip("\n") + "\n",
        f"tests/test_{name}.py": test_text.rstrip("\n") + "\n",
    }


def new_plugin(name: str, family: str, hooks: str | None = None,
               directory: str | Path = ".") -> Path:
    """Write the package folder ``<directory>/<name>``; returns it. Errors are ``RlmixError``s
    (the CLI prints them on one line)."""
    name = check_name(name)
    family = check_family(family)
    chosen = parse_hooks(hooks, family)
    if "configure" not in chosen:
        chosen = ["configure", *chosen]
    folder = Path(directory) / name
    if folder.exists() and any(folder.iterdir()):
        raise RlmixError(f"{folder} already exists and is not empty; choose another --dir or "
                         f"name")
    files = render(name, family, chosen)
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return folder
