from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from sessions_app.models import HeartbeatRun, RunStatus
from tests.live.server import wait_until

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import django, os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
django.setup()
from django.test import Client
response = Client(HTTP_HOST="localhost").get("/api/health")
print(response.status_code, response.json()["database"]["ok"])
"""


def test_health_is_503_when_no_task_cluster_was_seen(client, db):
    # No qcluster runs beside this test: heartbeats would queue and never run.
    response = client.get("/api/health")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["database"]["ok"] is True
    assert body["queue"]["broker"] in ("orm", "redis")
    assert body["queue"]["ok"] is False and body["queue"]["clusters"] == 0


def test_health_shows_stuck_work_the_oldest_queued_run_and_runs_past_their_deadline(client, persistent_agent):
    now = timezone.now()
    assert client.get("/api/health").json()["runs"] == {"oldest_queued_seconds": None, "past_deadline": 0}
    make_run(persistent_agent, status=RunStatus.QUEUED, created_at=now - timedelta(minutes=7))
    make_run(persistent_agent, status=RunStatus.QUEUED, created_at=now - timedelta(minutes=2))
    make_run(persistent_agent, status=RunStatus.RUNNING, deadline_at=now - timedelta(seconds=30))
    make_run(persistent_agent, status=RunStatus.SUCCEEDED, deadline_at=now - timedelta(hours=1))
    runs = client.get("/api/health").json()["runs"]
    assert 7 * 60 <= runs["oldest_queued_seconds"] < 8 * 60
    assert runs["past_deadline"] == 1


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
def test_health_answers_another_method_with_a_json_405(db, method):
    # CSRF checks on, as a real client meets them: they must not answer first, in HTML.
    response = Client(enforce_csrf_checks=True).generic(method, "/api/health", b"{}", content_type="application/json")
    assert response.status_code == 405
    assert response["Allow"] == "GET, HEAD"
    assert response.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.django_db(transaction=True)
def test_health_is_200_while_a_task_cluster_runs(client, settings, tmp_path):
    cluster = start_cluster(settings, tmp_path)
    try:
        response = wait_until(lambda: (r := client.get("/api/health")).status_code == 200 and r, 60, "a healthy probe")
    finally:
        cluster.terminate()
        cluster.wait(30)
    body = response.json()
    assert body["status"] == "ok"
    assert body["queue"]["ok"] is True and body["queue"]["clusters"] >= 1


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


def make_run(agent, **fields) -> HeartbeatRun:
    return HeartbeatRun.objects.create(company_id=agent.company_id, agent=agent, task="t", **fields)


def start_cluster(settings, tmp_path) -> subprocess.Popen:
    """A real `manage.py qcluster` on this test's database (ORM broker, database cache)."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        url = f"sqlite:///{db['NAME']}"
    else:
        url = f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "PAPERCLIP_HOME": str(tmp_path),
        # Cluster statistics are signed with the secret key; the probe must share it.
        "DJANGO_SECRET_KEY": settings.SECRET_KEY,
    }
    env.pop("REDIS_URL", None)
    return subprocess.Popen(
        [sys.executable, "manage.py", "qcluster"],
        cwd=ROOT,
        env=env,
        stdout=(tmp_path / "qcluster.log").open("w"),
        stderr=subprocess.STDOUT,
    )
