"""CI can tell that the PostgreSQL-only tests ran: with PAPERCLIP_REQUIRE_POSTGRES=1 (the
PostgreSQL job of .ci/run) a skipped one fails the run (tests/postgres_required.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

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


def test_another_skip():
    pytest.skip("no chromium")
"""


def run_inner(tmp_path, **env) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(INNER)
    environ = {k: v for k, v in os.environ.items() if k != "PAPERCLIP_REQUIRE_POSTGRES"}
    environ["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:django", "-p", "no:cacheprovider", "-p", "tests.postgres_required"]
        + ["-o", "markers=postgres: needs PostgreSQL", "-q", "-rA", "test_inner.py"],
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
    assert "1 skipped" in done.stdout  # a skip of anything else stays a skip
    assert "this PostgreSQL test was skipped (needs PostgreSQL)" in done.stdout
    assert "this PostgreSQL test was skipped (a feature this server lacks)" in done.stdout


def test_elsewhere_a_postgres_test_skips(tmp_path):
    done = run_inner(tmp_path)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 skipped" in done.stdout
