"""API fixtures: a JSON client, the authenticated mode, keys, and sessions with history."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from sessions_app.api_keys import api_key_create
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus


class Api:
    """Django's test client speaking JSON, with an optional bearer key."""

    def __init__(self, key: str | None = None) -> None:
        self.client = Client()
        self.key = key

    def headers(self, extra: dict | None) -> dict:
        headers = dict(extra or {})
        if self.key:
            headers.setdefault("Authorization", f"Bearer {self.key}")
        return headers

    def get(self, path: str, params: dict | None = None, headers: dict | None = None):
        return self.client.get(path, params or {}, headers=self.headers(headers))

    def post(self, path: str, body=None, *, raw: bytes | str | None = None, headers: dict | None = None):
        data = raw if raw is not None else json.dumps(body if body is not None else {})
        return self.client.post(path, data, content_type="application/json", headers=self.headers(headers))

    def patch(self, path: str, body=None, *, raw: bytes | str | None = None, headers: dict | None = None):
        data = raw if raw is not None else json.dumps(body if body is not None else {})
        return self.client.patch(path, data, content_type="application/json", headers=self.headers(headers))

    def delete(self, path: str, headers: dict | None = None):
        return self.client.delete(path, headers=self.headers(headers))

    def put(self, path: str, body=None):
        return self.client.put(path, json.dumps(body or {}), content_type="application/json", headers=self.headers({}))


@pytest.fixture
def api(db):
    return Api()


@pytest.fixture
def authenticated(settings):
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"


@pytest.fixture
def company_key(company):
    return api_key_create(company=company, name="tests")


@pytest.fixture
def other_key(other_company):
    return api_key_create(company=other_company, name="other tests")


@pytest.fixture
def key_api(authenticated, company_key):
    """Authenticated mode, with a key of `company`."""
    return Api(company_key[1])


@pytest.fixture
def other_key_api(authenticated, other_key):
    """Authenticated mode, with a key of `other_company`."""
    return Api(other_key[1])


def make_session(agent, *, messages: int = 2, status: str = "active", last_used=None, **fields) -> AgentSession:
    """A session whose history lives in the database column (the store a raw INSERT uses)."""
    now = timezone.now()
    history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}", "at": now.isoformat()}
        for i in range(messages)
    ]
    return AgentSession.objects.create(
        agent=agent,
        company_id=agent.company_id,
        history=history,
        message_count=messages,
        status=status,
        store="database",
        last_used=last_used or now,
        expires_at=(last_used or now) + timedelta(hours=24),
        **fields,
    )


def make_run(agent, *, status: str = RunStatus.SUCCEEDED, created_at=None, **fields) -> HeartbeatRun:
    return HeartbeatRun.objects.create(
        agent=agent,
        company_id=agent.company_id,
        task=fields.pop("task", "say hi"),
        status=status,
        created_at=created_at or timezone.now(),
        **fields,
    )


def agent_url(agent, suffix: str = "") -> str:
    return f"/api/companies/{agent.company_id}/agents/{agent.id}{suffix}"


def assert_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.content[:500])
    assert response["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) <= {"code", "message", "fields"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error
