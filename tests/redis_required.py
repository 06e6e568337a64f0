"""A pytest plugin (loaded by tests/conftest.py): the tests of the Redis broker, and proof
that they ran.

Tests that take the `redis_only` fixture (the URL of the Redis they may use) carry the
`redis` marker (`-m redis` selects them). Without a Redis on 127.0.0.1:6379 they skip. With
PAPERCLIP_REQUIRE_REDIS=1, which `.ci/run` sets for its PostgreSQL job, such a test that
skips fails instead: production queues on Redis, and a job that silently skipped its only
test of that would pass unnoticed.
"""

from __future__ import annotations

import os

import pytest

REQUIRE = "PAPERCLIP_REQUIRE_REDIS"
# Database 0: the tests keep to keys named by their own clusters. bench/load.py owns db 7.
REDIS_URL = "redis://127.0.0.1:6379/0"


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
        if "redis_only" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and os.environ.get(REQUIRE) == "1" and item.get_closest_marker("redis")):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = f"{REQUIRE}=1: this Redis test was skipped ({reason}); the job must run it"
