from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import django, os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
django.setup()
from django.test import Client
response = Client(HTTP_HOST="localhost").get("/api/health")
print(response.status_code, response.json()["database"]["ok"])
"""


def test_health_reports_database_and_queue(client, db):
    response = client.get("/api/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["database"]["ok"] is True
    assert body["queue"]["broker"] in ("orm", "redis")


def test_health_is_503_when_the_database_is_unreachable(tmp_path):
    # A real PostgreSQL URL on a port where nothing listens.
    env = {**os.environ, "PAPERCLIP_HOME": str(tmp_path), "DATABASE_URL": "postgres://postgres@127.0.0.1:9/none"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.split() == ["503", "False"], result.stderr


@pytest.mark.django_db
def test_admin_login_page_is_styled(client):
    response = client.get("/admin/login/")
    assert response.status_code == 200
    assert b"admin/css/base" in response.content
