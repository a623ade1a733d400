"""Line counts of the kernel runtime: the modules of the ``rlmix`` distribution that every run
executes (issue 22 lists them), physical lines and code lines.

    python tools/core_lines.py            # a table and the totals
    python tools/core_lines.py --json

Code lines leave out blank lines, comment-only lines and docstrings (module, class and function
docstrings, found with ``ast``); a line that holds code and a trailing comment counts. Lines are
found with ``tokenize``, so a string that spans lines counts each of its lines (it is code).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "core" / "rlmix"
#: the kernel: loop, hookspecs, manifest, plugins, types, ops, policy, defaults, checkpoint,
#: observe, cli, async sampling, plus the package's __init__, __main__ and errors, and the
#: sampler's weight copy (``sampler_weights``: built in ``loop.prepare_model`` on every run)
KERNEL = ("__init__", "__main__", "errors", "loop", "hookspecs", "manifest", "plugins", "types",
          "ops", "policy", "defaults", "checkpoint", "observe", "cli", "async_sampling",
          "sampler_weights")


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def count(path: Path) -> tuple[int, int]:
    """``(physical lines, code lines)`` of one Python file."""
    source = path.read_text()
    physical = len(source.splitlines())
    docs = _docstring_lines(ast.parse(source))
    code: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in skip:
            continue
        for line in range(tok.start[0], tok.end[0] + 1):
            if line not in docs:
                code.add(line)
    return physical, len(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = {name: count(PACKAGE / f"{name}.py") for name in KERNEL}
    physical = sum(p for p, _ in rows.values())
    code = sum(c for _, c in rows.values())
    rest = sorted(set(PACKAGE.rglob("*.py")) - {PACKAGE / f"{n}.py" for n in KERNEL})
    rest_physical = sum(count(p)[0] for p in rest)
    if args.json:
        print(json.dumps({"modules": {n: {"physical": p, "code": c} for n, (p, c) in rows.items()},
                          "physical": physical, "code": code,
                          "rest_of_core_physical": rest_physical}, indent=1))
        return 0
    print(f"{'module':<16} {'physical':>8} {'code':>6}")
    for name, (p, c) in sorted(rows.items(), key=lambda r: -r[1][1]):
        print(f"{name + '.py':<16} {p:>8} {c:>6}")
    print(f"{'kernel':<16} {physical:>8} {code:>6}")
    print(f"rest of core/rlmix (helper modules, testing kit, templates): {rest_physical} physical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
