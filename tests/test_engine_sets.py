"""The engine sets: one package, no import of the job layer, one factory."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vbatch.engine_sets
from vbatch.engine_sets.factory import open_engine_set
from vbatch.errors import ConfigError

PACKAGE = Path(vbatch.engine_sets.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
    return names


@pytest.mark.parametrize("name", sorted(p.name for p in PACKAGE.glob("*.py")))
def test_no_engine_set_module_imports_the_job_layer(name: str) -> None:
    imported = _imported_modules(PACKAGE / name)
    assert not [m for m in imported if m == "vbatch.job" or m.startswith("vbatch.job.")]


def test_the_old_engine_set_modules_are_gone() -> None:
    src = PACKAGE.parent
    for old in ("engines.py", "ray_engines.py", "ray_replica.py", "client/data_parallel.py"):
        assert not (src / old).exists(), old


def test_the_factory_builds_a_local_engine_set_when_not_asked_for_ray(
    tiny_model_dir: Path,
) -> None:
    with pytest.raises(ConfigError, match="data_parallel_size must be at least 1"):
        open_engine_set(str(tiny_model_dir), data_parallel_size=0)


def test_every_engine_set_streams_through_the_one_shared_loop() -> None:
    """RayEngines.stream reimplemented LLM._stream's loop (fill, idle ticks, wait)."""
    src = PACKAGE.parent
    for path, cls, method in (
        (src / "llm.py", "LLM", "_stream"),
        (PACKAGE / "ray.py", "RayEngines", "stream"),
    ):
        tree = ast.parse(path.read_text())
        (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        (fn,) = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == method]
        assert not [n for n in ast.walk(fn) if isinstance(n, ast.While)], (cls, method)
        calls = [
            n.func.id
            for n in ast.walk(fn)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        ]
        assert "stream_loop" in calls, (cls, method)
