"""Imports run one way: costs_app decides about money and never drives agents (it returns
a verdict, sessions_app acts on it), every ledger row goes through costs_app.ledger, and
the adapters know no model."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def sources(package: str) -> list[Path]:
    return [path for path in (ROOT / package).rglob("*.py") if "migrations" not in path.parts]


def test_costs_app_never_imports_the_sessions_services_or_engine():
    forbidden = ("sessions_app.services", "sessions_app.heartbeat", "sessions_app.maintenance")
    offenders = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sources("costs_app")
        for name in imported_modules(path)
        if name.startswith(forbidden)
    }
    assert offenders == set()


def test_adapters_import_no_model():
    offenders = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sources("sessions_app/adapters")
        for name in imported_modules(path)
        if name.startswith(("sessions_app.models", "costs_app.models"))
    }
    assert offenders == set()


# A CostEvent built (not the class statement) or created through its manager.
LEDGER_WRITE = re.compile(r"(?<!class )\bCostEvent\(|CostEvent\.objects\.(create|bulk_create|get_or_create)")


def test_only_the_ledger_writes_cost_events():
    writers = {
        str(path.relative_to(ROOT))
        for package in ("sessions_app", "costs_app")
        for path in sources(package)
        if LEDGER_WRITE.search(path.read_text())
    }
    assert writers == {"costs_app/ledger.py"}


FIRST_PARTY = ("sessions_app", "costs_app", "memory_app", "paperclip")


def runtime_imports(path: Path) -> set[str]:
    """The modules a file imports when it runs (at its top or inside a function); imports
    under `if TYPE_CHECKING:` are for annotations only and never execute."""
    names = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return names


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle of the graph once (depth-first; a back edge closes one)."""
    cycles, state = [], {}

    def walk(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycles.append([*path[path.index(imported) :], imported])
            elif imported not in state:
                walk(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    return cycles


def test_no_module_of_ours_imports_one_that_imports_it_back():
    paths = {module_name(path): path for package in FIRST_PARTY for path in sources(package)}
    graph = {name: {m for m in runtime_imports(path) if m in paths and m != name} for name, path in paths.items()}

    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
