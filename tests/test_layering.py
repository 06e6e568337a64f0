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
