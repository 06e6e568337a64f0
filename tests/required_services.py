"""A pytest plugin (loaded by tests/conftest.py): the tests that need PostgreSQL or Redis,
and proof that they ran.

Tests that take the `postgres_only` fixture carry the `postgres` marker, and those that take
`redis_only` (the URL of the Redis they may use) the `redis` marker (`-m postgres`, `-m redis`
select them). On SQLite the first skip; without a Redis on 127.0.0.1:6379 the second. Under
PAPERCLIP_REQUIRE_POSTGRES=1 and PAPERCLIP_REQUIRE_REDIS=1, which `.ci/run` sets for its
PostgreSQL job, such a test that skips fails instead: a job that silently skipped them (a
wrong DATABASE_URL, a server built without a feature, a Redis that is down: production
queues on it) would pass unnoticed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

# Database 0: the tests keep to keys named by their own clusters. bench/load.py owns db 7.
REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True)
class Requirement:
    fixture: str
    marker: str
    variable: str
    service: str


REQUIREMENTS = (
    Requirement("postgres_only", "postgres", "PAPERCLIP_REQUIRE_POSTGRES", "PostgreSQL"),
    Requirement("redis_only", "redis", "PAPERCLIP_REQUIRE_REDIS", "Redis"),
)


@pytest.fixture
def redis_only() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.skip(f"needs Redis at {REDIS_URL} ({exc.__class__.__name__}: {exc})")
    return REDIS_URL


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        for requirement in REQUIREMENTS:
            if requirement.fixture in getattr(item, "fixturenames", ()):
                item.add_marker(getattr(pytest.mark, requirement.marker))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped:
        return
    required = [r for r in REQUIREMENTS if os.environ.get(r.variable) == "1" and item.get_closest_marker(r.marker)]
    if not required:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = "; ".join(
        f"{r.variable}=1: this {r.service} test was skipped ({reason}); the job must run it" for r in required
    )
