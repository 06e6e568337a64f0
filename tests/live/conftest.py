"""Fixtures of the live suite: the JSON test client for the in-process corpus, and a real
server (gunicorn workers and a qcluster, as in production) for the live tests."""

from __future__ import annotations

import pytest

from tests.api.conftest import Api


@pytest.fixture
def api(db):
    return Api()
