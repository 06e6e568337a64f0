"""CI can tell that the PostgreSQL-only tests and the Redis broker's test ran: with
PAPERCLIP_REQUIRE_POSTGRES=1 and PAPERCLIP_REQUIRE_REDIS=1 (the PostgreSQL job of .ci/run)
such a test that skips fails the run (tests/required_services.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIABLES = ("PAPERCLIP_REQUIRE_POSTGRES", "PAPERCLIP_REQUIRE_REDIS")

INNER = """
import pytest


@pytest.fixture
def postgres_only():
    pytest.skip("needs PostgreSQL")


def test_a_postgres_test(postgres_only):
    pass


@pytest.mark.postgres
@pytest.mark.skipif(True, reason="a feature this server lacks")
def test_a_marked_postgres_test():
    pass


def test_a_redis_test(redis_only):
    pass


def test_another_skip():
    pytest.skip("no chromium")
"""

# The plugin's own fixture, pointed at a port nothing listens on: no Redis there.
CONFTEST = """
import tests.required_services

tests.required_services.REDIS_URL = "redis://127.0.0.1:9/0"
"""


def run_inner(tmp_path, **env) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    environ = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    environ["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:django", "-p", "no:cacheprovider", "-p", "tests.required_services"]
        + ["-o", "markers=postgres: needs PostgreSQL\nredis: needs Redis", "-q", "-rA", "test_inner.py"],
        cwd=tmp_path,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_postgres_test_that_skips_fails_the_postgresql_job(tmp_path):
    done = run_inner(tmp_path, PAPERCLIP_REQUIRE_POSTGRES="1")

    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 errors" in done.stdout or "2 failed" in done.stdout, done.stdout
    assert "2 skipped" in done.stdout  # the Redis test and another skip stay skips
    assert "PAPERCLIP_REQUIRE_POSTGRES=1: this PostgreSQL test was skipped (needs PostgreSQL)" in done.stdout
    assert "this PostgreSQL test was skipped (a feature this server lacks)" in done.stdout


def test_a_redis_test_that_skips_fails_the_postgresql_job(tmp_path):
    done = run_inner(tmp_path, PAPERCLIP_REQUIRE_REDIS="1")

    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout or "1 error" in done.stdout, done.stdout
    assert "3 skipped" in done.stdout  # the PostgreSQL tests and another skip stay skips
    assert "PAPERCLIP_REQUIRE_REDIS=1: this Redis test was skipped (needs Redis at redis://127.0.0.1:9/0" in done.stdout


def test_elsewhere_those_tests_skip(tmp_path):
    done = run_inner(tmp_path)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 skipped" in done.stdout
    assert "needs Redis at redis://127.0.0.1:9/0" in done.stdout
