"""The package's import graph has no cycle, not even one closed by an import inside a
function (issue 34.3), and any order of imports works in a fresh interpreter.

Factories live in selector modules (attention/selector.py, structured_outputs/selector.py,
quantization/selector.py) rather than beside the interface they instantiate, `config.py`
imports neither `quantization` nor torch, and `core/` imports nothing from `lora/`.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections import defaultdict

import pytest

import pagedserve

PACKAGE = pathlib.Path(pagedserve.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The package module an import names (`pagedserve.a.b.C` -> `pagedserve.a.b`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str) -> set[str]:
    """The package modules `name` imports anywhere (module level or inside a function), except
    under `if TYPE_CHECKING:`, which never runs."""
    tree = ast.parse(MODULES[name].read_text())
    type_only = {id(sub) for node in ast.walk(tree)
                 if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                 for sub in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            module = _resolve(target) if target.startswith("pagedserve") else None
            # A module importing its own package's __init__ (or itself) is not an edge.
            if module is not None and module != name and not name.startswith(module + "."):
                found.add(module)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle() -> None:
    graph = defaultdict(set, {name: _imports(name) for name in MODULES})
    assert _cycles(graph) == []


def test_the_cycle_check_can_fail() -> None:
    assert _cycles(defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})) == [["a", "b", "c"]]


@pytest.mark.parametrize(("importer", "forbidden"), [
    ("pagedserve.core", "pagedserve.lora"),
    ("pagedserve.config", "pagedserve.quantization"),
    ("pagedserve.config", "pagedserve.dtypes"),
])
def test_layering(importer: str, forbidden: str) -> None:
    offenders = {f"{name} -> {target}" for name in MODULES if name == importer or name.startswith(importer + ".")
                 for target in _imports(name) if target == forbidden or target.startswith(forbidden + ".")}
    assert not offenders


_IMPORT_ALL = """
import importlib, pkgutil, random, sys
import pagedserve
names = sorted(m.name for m in pkgutil.walk_packages(pagedserve.__path__, "pagedserve.")
               if not m.name.endswith("__main__"))
random.Random(int(sys.argv[1])).shuffle(names)
for name in names:
    importlib.import_module(name)
print(len(names))
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_every_module_imports_in_a_random_order(seed: int) -> None:
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(seed)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) >= 150
