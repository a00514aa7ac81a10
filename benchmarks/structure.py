#!/usr/bin/env python
"""The package's structure against the targets docs/architecture.md names: modules over 400
lines, functions over 60 lines, functions that take more than four parameters positionally, the
topologies tested by name outside psgrad/roles/, and engine files that name the simulation.

    python benchmarks/structure.py [--root psgrad]

Reads the source only (nothing is imported or run). Each list is printed with its count; an empty
list prints "none".
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

MODULE_LINES = 400
FUNCTION_LINES = 60
POSITIONAL = 4


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _positional(node: ast.FunctionDef) -> list[str]:
    names = [a.arg for a in node.args.posonlyargs + node.args.args]
    return [n for n in names if n not in ("self", "cls")]


def measure(root: Path) -> dict[str, list[str]]:
    """Each target's offenders, as printable lines."""
    found: dict[str, list[str]] = {
        f"modules over {MODULE_LINES} lines": [],
        f"functions over {FUNCTION_LINES} lines": [],
        f"functions with more than {POSITIONAL} positional parameters": [],
        "topologies tested by name outside roles/": [],
        "engine/ and backprop.py lines that name the simulation": [],
    }
    keys = list(found)
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(root.parent)
        if (lines := len(text.splitlines())) > MODULE_LINES:
            found[keys[0]].append(f"{lines:5d}  {where}")
        for node in _functions(ast.parse(text)):
            if (length := node.end_lineno - node.lineno + 1) > FUNCTION_LINES:
                found[keys[1]].append(f"{length:5d}  {where}:{node.lineno} {node.name}")
            if len(params := _positional(node)) > POSITIONAL and not node.name == "forward":
                found[keys[2]].append(f"{len(params):5d}  {where}:{node.lineno} {node.name}")
        if "roles" not in path.parts:
            for number, line in enumerate(text.splitlines(), 1):
                if re.search(r"topology\s*[!=]=", line):
                    found[keys[3]].append(f"       {where}:{number}: {line.strip()}")
        if "engine" in path.parts or path.name == "backprop.py":
            for number, line in enumerate(text.splitlines(), 1):
                if re.search(r"simulat|stacked", line, re.IGNORECASE):
                    found[keys[4]].append(f"       {where}:{number}: {line.strip()}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "psgrad"))
    args = parser.parse_args()
    for title, rows in measure(Path(args.root)).items():
        print(f"{title}: {len(rows) or 'none'}")
        for row in rows:
            print(row)


if __name__ == "__main__":
    main()
