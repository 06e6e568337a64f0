"""A pytest plugin (loaded by tests/conftest.py): the PostgreSQL-only tests, and proof that
they ran.

Tests that take the `postgres_only` fixture carry the `postgres` marker (`-m postgres`
selects them). On SQLite they skip. With PAPERCLIP_REQUIRE_POSTGRES=1, which `.ci/run` sets
for its PostgreSQL job, such a test that skips fails instead: a PostgreSQL job that silently
skipped them (a wrong DATABASE_URL, a server built without a feature) would pass unnoticed.
"""

from __future__ import annotations

import os

import pytest

REQUIRE = "PAPERCLIP_REQUIRE_POSTGRES"


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if "postgres_only" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and os.environ.get(REQUIRE) == "1" and item.get_closest_marker("postgres")):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = f"{REQUIRE}=1: this PostgreSQL test was skipped ({reason}); the PostgreSQL job must run it"
