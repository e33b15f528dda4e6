"""The import graph of src/vbatch, read with ast: no module imports itself through others, counting
imports inside functions (which hide a cycle from import time) but not those under TYPE_CHECKING;
and the modules of the user's process and the scheduler import neither torch nor transformers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import vbatch

SRC = Path(vbatch.__file__).parent
# NOTE: the client and the job's display run in the user's process, which must start fast; the
# scheduler and its parts are tested without torch.
TORCH_FREE = (
    "vbatch.client.tokenizer",
    "vbatch.grammar_text",
    "vbatch.client.detokenizer",
    "vbatch.job.progress",
    "vbatch.engine.block_manager",
    "vbatch.engine.scheduler",
    "vbatch.engine.applier",
    "vbatch.models.families",
)


def module_names(package_dir: Path) -> dict[str, Path]:
    """Every module under `package_dir` by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that `name` imports anywhere in its body; `from p import x` counts as
    importing p.x when that is a module, else p."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    pending: list[ast.AST] = [ast.parse(path.read_text())]
    while pending:
        node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                pending.extend(child.orelse)
            elif isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names if alias.name in modules)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*parent, *([child.module] if child.module else [])])
                for alias in child.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:
                        found.add(submodule)
                    elif base in modules:
                        found.add(base)
            else:
                pending.append(child)
    found.discard(name)
    return found


def import_cycles(package_dir: Path) -> list[list[str]]:
    """Each cycle found by a depth-first walk of the import graph, as the path that closes it."""
    modules = module_names(package_dir)
    graph = {name: sorted(imported_modules(name, path, modules)) for name, path in modules.items()}
    cycles: list[list[str]] = []
    done: set[str] = set()

    def walk(name: str, stack: list[str]) -> None:
        if name in stack:
            cycles.append([*stack[stack.index(name) :], name])
            return
        if name in done:
            return
        stack.append(name)
        for target in graph[name]:
            walk(target, stack)
        stack.pop()
        done.add(name)

    for name in graph:
        walk(name, [])
    return cycles


def test_src_vbatch_has_no_import_cycle() -> None:
    cycles = import_cycles(SRC)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("from . import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
        "def f():\n    from pkg.c import thing\n"
    )
    (package / "c.py").write_text("def g():\n    import pkg.sub.a\n")
    assert import_cycles(package) == [["pkg.c", "pkg.sub.a", "pkg.sub.b", "pkg.c"]]
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
    )
    assert import_cycles(package) == []


def test_torch_free_modules_import_neither_torch_nor_transformers() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        "    heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "    assert not heavy, f'{name} imports {heavy}'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_vllms_import_forms_work_with_the_package_renamed() -> None:
    """Every name of vbatch.__all__ resolves, and the imports of a vLLM offline script (with
    `vllm` changed to `vbatch`) run, none of them pulling in torch."""
    code = (
        "import sys, vbatch\n"
        "from vbatch import PoolingParams, TextPrompt, TokensPrompt\n"
        "from vbatch import EmbeddingRequestOutput, PoolingRequestOutput\n"
        "from vbatch import ClassificationRequestOutput, ScoringRequestOutput\n"
        "from vbatch.inputs import TokensPrompt as T\n"
        "from vbatch.outputs import RequestOutput, CompletionOutput\n"
        "assert T is TokensPrompt and RequestOutput is vbatch.RequestOutput\n"
        "print('torch' in sys.modules)\n"
        "for name in vbatch.__all__:\n"
        "    getattr(vbatch, name)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "False"
