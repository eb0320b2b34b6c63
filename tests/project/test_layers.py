"""The layer order of docs/architecture.md holds, and no modules import each other in a circle.

The layers are import-linter contracts in pyproject.toml ([tool.importlinter]); this runs them. The
circle check covers every import, type-only ones (under `if TYPE_CHECKING:`) included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

from tests.support.paths import ROOT

PACKAGES = ("configs", "ops", "engine", "deployments", "testing", "tools", "bench")


def test_the_layer_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(module: str) -> None:
        nonlocal counter
        work = [(module, iter(sorted(graph.find_modules_directly_imported_by(module))))]
        index[module] = low[module] = counter
        counter += 1
        stack.append(module)
        on_stack.add(module)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
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

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_circles_type_only_imports_included():
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    # A package's __init__ importing its own submodules is not a circle between modules.
    for module in list(graph.modules):
        for imported in list(graph.find_modules_directly_imported_by(module)):
            if imported.startswith(module + "."):
                graph.remove_import(importer=module, imported=imported)
    assert _cycles(graph) == []


def test_the_engine_core_reaches_decoding_through_its_contract_only():
    """The step machinery outside `engine.core.decoding` (scheduler, batch, sampling, stop rule, the engine)
    knows a paradigm through the interface every strategy implements (`decoding.base`); only the engine's
    setup asks the registry (the package itself: `strategy_for`) which strategy a checkpoint decodes with.
    No module there imports a paradigm's own modules."""
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph("engine", exclude_type_checking_imports=False, cache_dir=None)
    reached = {(module, imported) for module in graph.modules
               if module.startswith("engine.core.") and not module.startswith("engine.core.decoding")
               for imported in graph.find_modules_directly_imported_by(module)
               if imported == "engine.core.decoding" or imported.startswith("engine.core.decoding.")}
    assert {imported for _, imported in reached} <= {"engine.core.decoding.base", "engine.core.decoding"}, reached
    assert {module for module, imported in reached if imported == "engine.core.decoding"} == \
        {"engine.core.model_settings"}, reached


def test_the_circle_check_finds_a_circle():
    graph = grimp.ImportGraph()
    for a, b in (("x.a", "x.b"), ("x.b", "x.c"), ("x.c", "x.a"), ("x.c", "x.d")):
        graph.add_import(importer=a, imported=b)
    assert _cycles(graph) == [["x.a", "x.b", "x.c"]]
