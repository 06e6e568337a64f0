"""Fixtures of the live suite: the JSON test client for the in-process corpus, and a real
server (gunicorn workers and a qcluster, as in production) for the live tests."""

from __future__ import annotations

from tests.api.conftest import api  # noqa: F401 (the API tests' JSON client fixture, shared)
