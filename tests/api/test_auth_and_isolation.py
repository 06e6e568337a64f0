"""Deployment modes, API keys, and company isolation for every object type in both modes."""

from __future__ import annotations

import hashlib
import logging
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from sessions_app.api_keys import LAST_USED_RESOLUTION, api_key_authenticate, api_key_create, api_key_revoke
from sessions_app.models import Agent, AgentSession, ApiKey, HeartbeatRun
from tests.api.conftest import Api, agent_url, assert_error, make_run, make_session

pytestmark = pytest.mark.django_db


def test_api_key_is_stored_only_as_its_sha256(company):
    api_key, plaintext = api_key_create(company=company, name="ci")
    stored = ApiKey.objects.get(pk=api_key.pk)
    assert stored.key_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert plaintext not in {stored.key_hash, stored.prefix, stored.name}
    assert plaintext.startswith(stored.prefix) and len(stored.prefix) < len(plaintext) // 3


def test_local_trusted_mode_needs_no_key(api, company):
    assert api.get(f"/api/companies/{company.id}").status_code == 200


def test_authenticated_mode_refuses_calls_without_a_key(authenticated, api, company):
    response = api.get(f"/api/companies/{company.id}")
    assert_error(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize("header", ["Bearer nope", "Basic dXNlcjpwYXNz", "Bearer", "Bearer a b", "Bearer \u00e9"])
def test_authenticated_mode_refuses_bad_keys(authenticated, api, company, header):
    assert_error(api.get(f"/api/companies/{company.id}", headers={"Authorization": header}), 401)


def test_authenticated_mode_accepts_the_companys_key(key_api, company):
    assert key_api.get(f"/api/companies/{company.id}").status_code == 200


def test_revoked_key_is_refused(key_api, company, company_key):
    api_key_revoke(api_key=company_key[0], now=timezone.now())
    assert_error(key_api.get(f"/api/companies/{company.id}"), 401, "authentication_failed")


def test_health_stays_open_in_authenticated_mode(authenticated, api):
    # 503, not 401: no task cluster runs beside the tests, and the probe needs no key.
    response = api.get("/api/health")
    assert response.status_code == 503
    assert response.json()["database"]["ok"] is True


def test_schema_and_docs_stay_open_in_authenticated_mode(authenticated, api):
    assert api.get("/api/schema/").status_code == 200
    assert api.get("/api/docs/").status_code == 200


def test_keys_cannot_create_companies(key_api):
    assert_error(key_api.post("/api/companies", {"name": "New"}), 403, "permission_denied")


def test_last_used_at_is_written_at_most_once_a_minute(company, company_key, django_assert_num_queries):
    api_key, plaintext = company_key
    now = timezone.now()
    with django_assert_num_queries(2):  # lookup + update
        api_key_authenticate(plaintext=plaintext, now=now)
    with django_assert_num_queries(1):  # lookup only
        api_key_authenticate(plaintext=plaintext, now=now + timedelta(seconds=30))
    with django_assert_num_queries(2):
        api_key_authenticate(plaintext=plaintext, now=now + timedelta(minutes=2))
    api_key.refresh_from_db()
    assert api_key.last_used_at == now + timedelta(minutes=2)


@pytest.mark.parametrize("microsecond", [0, 123456])
def test_last_used_at_is_written_again_exactly_a_minute_later(company_key, microsecond, django_assert_num_queries):
    api_key, plaintext = company_key
    now = timezone.now().replace(microsecond=microsecond)
    api_key_authenticate(plaintext=plaintext, now=now)
    with django_assert_num_queries(1):
        api_key_authenticate(plaintext=plaintext, now=now + LAST_USED_RESOLUTION - timedelta(microseconds=1))
    with django_assert_num_queries(2):
        api_key_authenticate(plaintext=plaintext, now=now + LAST_USED_RESOLUTION)


def test_authenticated_key_is_the_keys_row(company, company_key):
    api_key, plaintext = company_key
    found = api_key_authenticate(plaintext=plaintext, now=timezone.now())
    assert (found.pk, found.company_id, found.key_hash) == (api_key.pk, company.id, api_key.key_hash)
    assert found.is_active and found.name == "tests" and found.prefix == api_key.prefix
    assert api_key_authenticate(plaintext=plaintext + "x", now=timezone.now()) is None


def test_key_revoked_by_another_process_is_refused_on_the_next_request(key_api, company, company_key):
    assert key_api.get(f"/api/companies/{company.id}").status_code == 200
    ApiKey.objects.filter(pk=company_key[0].pk).update(revoked_at=timezone.now())
    assert_error(key_api.get(f"/api/companies/{company.id}"), 401, "authentication_failed")


def test_keys_are_never_logged(key_api, company, company_key, caplog):
    with caplog.at_level(logging.DEBUG):
        key_api.get(f"/api/companies/{company.id}")
        key_api.get("/api/companies/not-a-uuid")
        Api("pc_wrong-key").get(f"/api/companies/{company.id}")
    assert company_key[1] not in caplog.text
    assert "pc_wrong-key" not in caplog.text


def test_create_api_key_command_prints_the_key_once(company, capsys):
    call_command("create_api_key", "--company", str(company.id), "--name", "cron")
    out = capsys.readouterr().out.strip()
    api_key = ApiKey.objects.get(company=company)
    assert api_key.name == "cron"
    assert api_key.key_hash == hashlib.sha256(out.encode()).hexdigest()


@pytest.mark.parametrize("company_id", ["nope", "00000000-0000-4000-8000-000000000000"])
def test_create_api_key_command_refuses_unknown_companies(company_id):
    with pytest.raises(CommandError):
        call_command("create_api_key", "--company", company_id)


# Isolation: the other company's objects through this company's URL (both modes), and this
# company's URLs with the other company's key (authenticated mode). Always 404, never 403.


@pytest.fixture
def foreign(other_agent):
    session = make_session(other_agent)
    run = make_run(other_agent)
    return {"agent": other_agent, "session": session, "run": run}


def foreign_requests(company, own_agent, foreign):
    """Requests that name this company in the URL but another company's object."""
    mine = f"/api/companies/{company.id}"
    theirs = foreign["agent"]
    return [
        ("get", f"{mine}/agents/{theirs.id}", None),
        ("patch", f"{mine}/agents/{theirs.id}", {"name": "stolen"}),
        ("delete", f"{mine}/agents/{theirs.id}", None),
        ("post", f"{mine}/agents/{theirs.id}/heartbeat", {"task": "hi"}),
        ("get", f"{mine}/agents/{theirs.id}/runs", None),
        ("get", f"{mine}/agents/{theirs.id}/runs/{foreign['run'].id}", None),
        ("get", f"{agent_url(own_agent)}/runs/{foreign['run'].id}", None),
        ("get", f"{mine}/agents/{theirs.id}/sessions", None),
        ("get", f"{mine}/agents/{theirs.id}/sessions/{foreign['session'].public_id}", None),
        ("get", f"{agent_url(own_agent)}/sessions/{foreign['session'].public_id}", None),
        ("delete", f"{agent_url(own_agent)}/sessions/{foreign['session'].public_id}", None),
        ("delete", f"{mine}/agents/{theirs.id}/sessions/{foreign['session'].public_id}", None),
        ("get", f"{mine}/costs/daily?agent_id={theirs.id}", None),
        ("get", f"{mine}/costs/summary?agent_id={theirs.id}", None),
    ]


def own_requests(company, agent):
    """Every endpoint of this company, to be asked with another company's key."""
    session = make_session(agent)
    run = make_run(agent)
    mine = f"/api/companies/{company.id}"
    return [
        ("get", mine, None),
        ("get", f"{mine}/agents", None),
        ("post", f"{mine}/agents", {"name": "intruder"}),
        ("get", agent_url(agent), None),
        ("patch", agent_url(agent), {"name": "stolen"}),
        ("post", agent_url(agent, "/heartbeat"), {"task": "hi"}),
        ("get", agent_url(agent, "/runs"), None),
        ("get", agent_url(agent, f"/runs/{run.id}"), None),
        ("get", agent_url(agent, "/sessions"), None),
        ("get", agent_url(agent, f"/sessions/{session.public_id}"), None),
        ("delete", agent_url(agent, f"/sessions/{session.public_id}"), None),
        ("get", f"{mine}/costs/daily", None),
        ("get", f"{mine}/costs/summary", None),
        ("delete", agent_url(agent), None),
    ]


def call(client: Api, method: str, path: str, body):
    if method in ("post", "patch"):
        return getattr(client, method)(path, body)
    return getattr(client, method)(path)


def assert_untouched(foreign):
    agent = Agent.objects.get(pk=foreign["agent"].pk)
    assert agent.name == "Foreign" and agent.status == "active"
    assert AgentSession.objects.filter(pk=foreign["session"].pk).exists()
    assert HeartbeatRun.objects.filter(agent=agent).count() == 1


def test_other_companys_objects_are_404_in_local_trusted_mode(api, company, persistent_agent, foreign):
    for method, path, body in foreign_requests(company, persistent_agent, foreign):
        assert_error(call(api, method, path, body), 404)
    assert_untouched(foreign)


def test_other_companys_objects_are_404_in_authenticated_mode(key_api, company, persistent_agent, foreign):
    for method, path, body in foreign_requests(company, persistent_agent, foreign):
        assert_error(call(key_api, method, path, body), 404)
    assert_untouched(foreign)


def test_a_key_of_another_company_gets_404_for_every_endpoint(other_key_api, company, persistent_agent):
    agents_before = Agent.objects.count()
    for method, path, body in own_requests(company, persistent_agent):
        response = call(other_key_api, method, path, body)
        assert response.status_code == 404, (method, path, response.status_code)
        assert_error(response, 404, "not_found")
    persistent_agent.refresh_from_db()
    assert persistent_agent.name == "Persistent" and persistent_agent.status == "active"
    assert persistent_agent.sessions.count() == 1
    assert Agent.objects.count() == agents_before
    assert not HeartbeatRun.objects.filter(agent=persistent_agent, task="hi").exists()


def test_heartbeat_throttle_is_per_key(settings, authenticated, company, persistent_agent, other_agent):
    settings.PAPERCLIP_HEARTBEAT_RATE = "1/min"
    first = Api(api_key_create(company=company)[1])
    second = Api(api_key_create(company=company)[1])
    assert first.post(agent_url(persistent_agent, "/heartbeat"), {"task": "a"}).status_code == 202
    assert_error(first.post(agent_url(persistent_agent, "/heartbeat"), {"task": "b"}), 429)
    assert second.post(agent_url(persistent_agent, "/heartbeat"), {"task": "c"}).status_code == 202


def test_bad_heartbeat_rate_stops_start_up_with_one_clear_line(tmp_path):
    from tests.test_configuration import run_check

    result = run_check(tmp_path, PAPERCLIP_HEARTBEAT_RATE="lots")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "paperclip: configuration error: PAPERCLIP_HEARTBEAT_RATE must look like 60/min, got 'lots'"
    ]
