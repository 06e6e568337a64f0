"""CI can tell that the Redis broker's test ran: with PAPERCLIP_REQUIRE_REDIS=1 (the
PostgreSQL job of .ci/run) a `redis_only` test that skips fails the run
(tests/redis_required.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

INNER = """
def test_a_redis_test(redis_only):
    pass


def test_another_skip():
    import pytest

    pytest.skip("no chromium")
"""

# The plugin's own fixture, pointed at a port nothing listens on: no Redis there.
CONFTEST = """
import tests.redis_required

tests.redis_required.REDIS_URL = "redis://127.0.0.1:9/0"
"""


def run_inner(tmp_path, **env) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    environ = {k: v for k, v in os.environ.items() if k != "PAPERCLIP_REQUIRE_REDIS"}
    environ["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:django", "-p", "no:cacheprovider", "-p", "tests.redis_required"]
        + ["-o", "markers=redis: needs Redis", "-q", "-rA", "test_inner.py"],
        cwd=tmp_path,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_redis_test_that_skips_fails_the_postgresql_job(tmp_path):
    done = run_inner(tmp_path, PAPERCLIP_REQUIRE_REDIS="1")

    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout or "1 error" in done.stdout, done.stdout
    assert "1 skipped" in done.stdout  # a skip of anything else stays a skip
    assert "PAPERCLIP_REQUIRE_REDIS=1: this Redis test was skipped (needs Redis at redis://127.0.0.1:9/0" in done.stdout


def test_elsewhere_a_redis_test_without_redis_skips(tmp_path):
    done = run_inner(tmp_path)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 skipped" in done.stdout
    assert "needs Redis at redis://127.0.0.1:9/0" in done.stdout
