"""The benchmark code's layout (issue #34.3, #34.6; STYLE habits 22 and 24):

- scripts in benchmarks/ import the package, never each other, and never edit sys.path;
- what they import from pagedserve.bench exists (a moved helper cannot strand a script);
- every script README.md, BENCHMARKS.md or docs/ cite exists, or BENCHMARKS.md lists it as retired;
- pagedserve/bench modules import each other at the top: none dodges a cycle from inside a function.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
# Cited in BENCHMARKS.md as the source of a setting, in S-LoRA's repository, not ours.
EXTERNAL = {"exp_suite.py"}
# Imported inside a function on purpose: an optional extra (httpx), not a cycle.
LAZY_FOR_EXTRAS = {("pagedserve.bench.http", "pagedserve.bench.loadgen"),
                   ("pagedserve.bench.peer", "pagedserve.bench.loadgen")}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _imported_modules(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node, node.module))
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_never_edit_sys_path(script: Path) -> None:
    for node in ast.walk(_tree(script)):
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            pytest.fail(f"{script.name}:{node.lineno} touches sys.path: share helpers through pagedserve/bench/")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_import_the_package_not_their_neighbours(script: Path) -> None:
    neighbours = {p.stem for p in SCRIPTS}
    tree = _tree(script)
    for node, module in _imported_modules(tree):
        assert module.split(".")[0] not in neighbours, f"{script.name}:{node.lineno} imports benchmarks/{module}.py"
        if isinstance(node, ast.ImportFrom) and module.startswith("pagedserve.bench"):
            imported = importlib.import_module(module)  # bench modules import torch lazily: cheap
            missing = [a.name for a in node.names if not hasattr(imported, a.name)]
            assert not missing, f"{script.name}:{node.lineno}: {module} has no {', '.join(missing)}"


def test_cited_scripts_exist_or_are_listed_as_retired() -> None:
    benchmarks_md = (ROOT / "BENCHMARKS.md").read_text()
    retired = set(re.findall(r"^\| `(\w+\.py)` \|", benchmarks_md, re.MULTILINE))
    assert retired, "BENCHMARKS.md's table of retired scripts"
    assert not {name for name in retired if (ROOT / "benchmarks" / name).exists()}, "retired but still there"
    documents = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    for doc in documents:
        for name in set(re.findall(r"benchmarks/(\w+\.py)", doc.read_text())):
            if name not in retired | EXTERNAL:
                assert (ROOT / "benchmarks" / name).is_file(), f"{doc.name} cites benchmarks/{name}"


def test_bench_modules_import_each_other_at_the_top() -> None:
    for path in sorted((ROOT / "pagedserve" / "bench").glob("*.py")):
        importer = f"pagedserve.bench.{path.stem}"
        for func in ast.walk(_tree(path)):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node, module in _imported_modules(func):
                names = [f"{module}.{a.name}" for a in node.names] + [module]
                inner = [n for n in names if n.startswith("pagedserve.bench.")]
                if inner and not any((importer, n) in LAZY_FOR_EXTRAS for n in inner):
                    pytest.fail(f"{path.name}:{node.lineno} imports {inner[0]} inside {func.name}(): "
                                "import it at the top, or move the shared piece so no cycle needs this")
