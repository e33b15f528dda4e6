"""docs/architecture.md stays true: its module table names every module of src/vbatch and no other,
and each file and name its "Life of a row" gives exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import vbatch

SRC = Path(vbatch.__file__).parent
DOC = SRC.parents[1] / "docs" / "architecture.md"


def section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def defined_names() -> set[str]:
    """Every function and class of src/vbatch by name, and every method as Class.method."""
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                names.add(node.name)
                names.update(
                    f"{node.name}.{item.name}"
                    for item in node.body
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                )
    return names


def _defines_public_names(path: Path) -> bool:
    return any(
        isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_")
        for node in ast.parse(path.read_text()).body
    )


def test_the_module_table_lists_every_module() -> None:
    listed = set(
        re.findall(r"^\| `vbatch/([\w/]+\.py)` \|", section("Modules, one line each"), re.M)
    )
    modules = {str(path.relative_to(SRC)) for path in SRC.rglob("*.py")}
    # NOTE: a package's __init__.py needs a row only when it defines something of its own.
    required = {
        name
        for name in modules
        if not name.endswith("__init__.py") or _defines_public_names(SRC / name)
    }
    assert sorted(listed - modules) == [], "rows for modules that do not exist"
    assert sorted(required - listed) == [], "modules without a row"


def test_each_step_of_the_life_of_a_row_names_what_exists() -> None:
    steps = re.findall(r"^\d+\. (.*(?:\n   .*)*)", section("Life of a row"), re.M)
    assert len(steps) >= 10
    names = defined_names()
    for step in steps:
        tokens = re.findall(r"`([^`]+)`", step)
        assert any(token.endswith(".py") for token in tokens), f"no file named in: {step}"
        for token in tokens:
            if token.endswith(".py"):
                assert (SRC / token).is_file(), token
            elif not token.startswith("-"):
                assert token in names, f"{token} (in: {step[:60]}...)"
