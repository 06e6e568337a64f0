"""`authenticated` mode served over plain HTTP, as `scripts/run` serves it (gunicorn and a
qcluster): calls are answered, never redirected to an HTTPS port nothing serves.

PostgreSQL only: the server processes and the test share the test database.
"""

from __future__ import annotations

import http.client
import json

import pytest

from sessions_app.api_keys import api_key_create
from sessions_app.models import Agent, Company
from tests.fake_anthropic import FakeAnthropic
from tests.live.server import HOST, LiveServer, database_url


def plain_http(port: int, method: str, path: str, *, key: str | None = None, body: dict | None = None):
    """One request over plain HTTP that follows no redirect: (status, headers, JSON body)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=60)
    headers = {"Content-Type": "application/json", "Host": "localhost"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        connection.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        response = connection.getresponse()
        raw = response.read()
        return response.status, dict(response.getheaders()), json.loads(raw) if raw else None
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_authenticated_mode_over_plain_http_answers_instead_of_redirecting(postgres_only, settings, tmp_path):
    company = Company.objects.create(name="Private network")
    agent = Agent.objects.create(
        company=company, name="Worker", adapter_type="claude-code", adapter_config={"model": "claude-haiku-4-5"}
    )
    key = api_key_create(company=company, name="script")[1]
    fake = FakeAnthropic().start()
    server = LiveServer(
        database_url=database_url(),
        secret_key=settings.SECRET_KEY,
        home=tmp_path / "server",
        anthropic_base_url=fake.base_url,
        web_workers=1,
        web_threads=2,
        q_workers=1,
        extra_env={"PAPERCLIP_DEPLOYMENT_MODE": "authenticated"},
    )
    try:
        server.start()  # waits for /api/health to answer 200: the web and its cluster are up
        company_path = f"/api/companies/{company.id}"
        status, headers, body = plain_http(server.port, "GET", company_path)
        assert status == 401, (status, headers.get("Location"))
        assert body["error"]["code"] == "not_authenticated"
        status, headers, body = plain_http(server.port, "GET", company_path, key=key)
        assert (status, body["name"]) == (200, "Private network")
        assert "Strict-Transport-Security" not in headers
        status, _, run = plain_http(
            server.port,
            "POST",
            f"{company_path}/agents/{agent.id}/heartbeat",
            key=key,
            body={"task": "hi", "wait": True},
        )
        assert (status, run["status"]) == (200, "succeeded"), run
        status, _, health = plain_http(server.port, "GET", "/api/health")
        assert (status, health["queue"]["clusters"]) == (200, 1)
    finally:
        server.stop()
        fake.stop()
