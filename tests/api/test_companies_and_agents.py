from __future__ import annotations

import base64
import json
import uuid

import pytest
from django_q.models import Schedule

from sessions_app.models import Agent, AgentStatus, Company
from tests.api.conftest import agent_url, assert_error, make_run, make_session
from tests.conftest import agent_on_unknown_model, catalogue_stored

pytestmark = pytest.mark.django_db

AGENT_BODY = {
    "name": "Researcher",
    "system_prompt": "You are a careful researcher.",
    "adapter_type": "claude-code",
    "adapter_config": {"model": "claude-opus-4-5", "session_mode": "persistent", "session_ttl_hours": 24},
}


def test_create_company_answers_201_with_the_company(api):
    response = api.post("/api/companies", {"name": "Acme"})
    assert response.status_code == 201
    body = response.json()
    assert body["name"] == "Acme"
    assert Company.objects.get(pk=body["id"]).name == "Acme"
    assert set(body) == {"id", "name", "created_at"}


def test_get_company(api, company):
    response = api.get(f"/api/companies/{company.id}")
    assert response.status_code == 200
    assert response.json()["id"] == str(company.id)


def test_company_without_name_is_400_naming_the_field(api):
    error = assert_error(api.post("/api/companies", {}), 400, "invalid")
    assert "name" in error["fields"]


def test_unknown_company_is_404(api):
    assert_error(api.get("/api/companies/00000000-0000-4000-8000-000000000000"), 404, "not_found")


def test_create_agent_answers_201_with_defaults_filled_in(api, company):
    response = api.post(f"/api/companies/{company.id}/agents", AGENT_BODY)
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["company_id"] == str(company.id)
    assert body["status"] == "active"
    assert body["adapter_config"]["session_mode"] == "persistent"
    assert body["adapter_config"]["session_ttl_hours"] == 24
    assert Agent.objects.get(pk=body["id"]).company_id == company.id


def test_create_agent_with_an_interval_creates_its_schedule(api, company):
    body = {**AGENT_BODY, "adapter_config": {**AGENT_BODY["adapter_config"], "heartbeat_interval_minutes": 15}}
    response = api.post(f"/api/companies/{company.id}/agents", body)
    assert response.status_code == 201
    assert Schedule.objects.filter(name=f"heartbeat:{response.json()['id']}", minutes=15).exists()


def test_invalid_adapter_config_is_400_naming_the_field(api, company):
    body = {**AGENT_BODY, "adapter_config": {"session_mode": "persistent", "session_ttl_hours": -1}}
    error = assert_error(api.post(f"/api/companies/{company.id}/agents", body), 400, "invalid")
    assert "adapter_config.session_ttl_hours" in error["fields"]
    assert not Agent.objects.exists()


def test_unknown_adapter_type_is_400_naming_the_field(api, company):
    error = assert_error(api.post(f"/api/companies/{company.id}/agents", {**AGENT_BODY, "adapter_type": "x"}), 400)
    assert "adapter_type" in error["fields"]


def test_adapter_config_must_be_an_object(api, company):
    error = assert_error(api.post(f"/api/companies/{company.id}/agents", {**AGENT_BODY, "adapter_config": []}), 400)
    assert "adapter_config" in error["fields"]


def test_agent_name_of_the_wrong_type_is_400(api, company):
    error = assert_error(api.post(f"/api/companies/{company.id}/agents", {**AGENT_BODY, "name": 12}), 400)
    assert "name" in error["fields"]


def test_unknown_agent_field_is_400(api, company):
    error = assert_error(api.post(f"/api/companies/{company.id}/agents", {**AGENT_BODY, "colour": "red"}), 400)
    assert "colour" in error["fields"]


def test_list_agents_hides_deleted_agents_and_other_companies(api, stateless_agent, persistent_agent, other_agent):
    Agent.objects.filter(pk=stateless_agent.pk).update(status=AgentStatus.DELETED)
    response = api.get(f"/api/companies/{persistent_agent.company_id}/agents")
    assert response.status_code == 200
    body = response.json()
    assert [a["id"] for a in body["agents"]] == [str(persistent_agent.id)]
    assert body["next"] is None


def test_list_agents_pages_with_a_cursor(api, company):
    for index in range(5):
        Agent.objects.create(company=company, name=f"agent {index}")
    first = api.get(f"/api/companies/{company.id}/agents", {"limit": 2}).json()
    second = api.get(f"/api/companies/{company.id}/agents", {"limit": 2, "next": first["next"]}).json()
    third = api.get(f"/api/companies/{company.id}/agents", {"limit": 2, "next": second["next"]}).json()
    names = [a["name"] for page in (first, second, third) for a in page["agents"]]
    assert names == [f"agent {i}" for i in range(5)]
    assert third["next"] is None


@pytest.mark.parametrize("name", ["a\x00b", "\ud800"], ids=["nul", "lone-surrogate"])
def test_a_cursor_naming_text_the_database_refuses_is_400(api, company, name):
    # The cursor is opaque base64, so the query-string check never sees what it holds.
    Agent.objects.create(company=company, name="agent")
    cursor = base64.urlsafe_b64encode(json.dumps([name, str(uuid.uuid4())]).encode()).decode()
    response = api.get(f"/api/companies/{company.id}/agents", {"next": cursor})
    assert assert_error(response, 400, "invalid_cursor")["fields"] == {"next": "invalid"}


def test_agent_list_queries_do_not_grow_with_agents(api, company, django_assert_max_num_queries):
    for index in range(30):
        Agent.objects.create(company=company, name=f"agent {index}")
    # The company, the agents with their health's facts, the credentials held now.
    with django_assert_max_num_queries(3):
        response = api.get(f"/api/companies/{company.id}/agents", {"limit": 200})
    assert len(response.json()["agents"]) == 30


def test_get_agent(api, persistent_agent):
    response = api.get(agent_url(persistent_agent))
    assert response.status_code == 200
    assert response.json()["name"] == "Persistent"


def test_patch_agent_changes_fields_and_syncs_its_schedule(api, persistent_agent):
    config = {**persistent_agent.adapter_config, "heartbeat_interval_minutes": 5}
    response = api.patch(agent_url(persistent_agent), {"name": "Renamed", "adapter_config": config})
    assert response.status_code == 200, response.json()
    persistent_agent.refresh_from_db()
    assert persistent_agent.name == "Renamed"
    assert Schedule.objects.filter(name=f"heartbeat:{persistent_agent.id}", minutes=5).exists()


def test_patch_agent_with_bad_config_is_400_and_changes_nothing(api, persistent_agent):
    response = api.patch(agent_url(persistent_agent), {"adapter_config": {"session_ttl_hours": "soon"}})
    error = assert_error(response, 400, "invalid")
    assert "adapter_config.session_ttl_hours" in error["fields"]
    persistent_agent.refresh_from_db()
    assert persistent_agent.adapter_config["session_ttl_hours"] == 24


def test_patch_merges_adapter_config_and_keeps_the_keys_it_does_not_name(api, persistent_agent):
    persistent_agent.adapter_config = {
        **persistent_agent.adapter_config,
        "memory": True,
        "work_check": {"url": "https://tracker.internal/work", "timeout_seconds": 30},
    }
    persistent_agent.save()
    patch = {"session_ttl_hours": 48, "work_check": {"timeout_seconds": 10}}

    response = api.patch(agent_url(persistent_agent), {"adapter_config": patch})

    assert response.status_code == 200, response.json()
    persistent_agent.refresh_from_db()
    config = persistent_agent.adapter_config
    assert (config["session_mode"], config["memory"], config["session_ttl_hours"]) == ("persistent", True, 48)
    assert config["work_check"] == {"url": "https://tracker.internal/work", "timeout_seconds": 10}  # merged
    assert response.json()["adapter_config"] == config


def test_patch_removes_an_adapter_config_key_set_to_null(api, persistent_agent):
    persistent_agent.adapter_config = {**persistent_agent.adapter_config, "memory": True}
    persistent_agent.save()

    response = api.patch(agent_url(persistent_agent), {"adapter_config": {"memory": None, "session_ttl_hours": None}})

    assert response.status_code == 200, response.json()
    persistent_agent.refresh_from_db()
    assert "memory" not in persistent_agent.adapter_config
    assert persistent_agent.adapter_config["session_ttl_hours"] == 24  # removed: its default again
    assert persistent_agent.is_persistent


def test_patch_validates_the_merged_configuration(api, persistent_agent):
    persistent_agent.adapter_config = {**persistent_agent.adapter_config, "heartbeat_cron": "0 9 * * *"}
    persistent_agent.save()
    before = persistent_agent.adapter_config

    response = api.patch(agent_url(persistent_agent), {"adapter_config": {"heartbeat_interval_minutes": 15}})

    error = assert_error(response, 400, "invalid")
    assert list(error["fields"]) == ["adapter_config.heartbeat_cron"]  # both, once merged
    persistent_agent.refresh_from_db()
    assert persistent_agent.adapter_config == before


def test_patch_naming_the_agents_own_adapter_type_with_spaces_still_merges(api, persistent_agent):
    # The type is stored trimmed, so " claude-code " is no change of type.
    body = {"adapter_type": " claude-code ", "adapter_config": {"session_ttl_hours": 48}}

    response = api.patch(agent_url(persistent_agent), body)

    assert response.status_code == 200, response.json()
    persistent_agent.refresh_from_db()
    config = persistent_agent.adapter_config
    assert (persistent_agent.adapter_type, config["session_ttl_hours"]) == ("claude-code", 48)
    assert (config["session_mode"], config["model"]) == ("persistent", "claude-opus-4-5")


def test_patch_changing_the_adapter_type_replaces_the_configuration(api, persistent_agent, commands):
    body = {"adapter_type": "process", "adapter_config": {"command": "reporter"}}

    response = api.patch(agent_url(persistent_agent), body)

    assert response.status_code == 200, response.json()
    persistent_agent.refresh_from_db()
    assert persistent_agent.adapter_type == "process"
    assert persistent_agent.adapter_config["command"] == "reporter"
    assert persistent_agent.adapter_config.get("model") != "claude-opus-4-5" and not persistent_agent.is_persistent


def test_patch_changing_only_the_adapter_type_gives_the_new_type_its_defaults(api, persistent_agent):
    response = api.patch(agent_url(persistent_agent), {"adapter_type": "claude-managed"})

    # Not a 400 naming the old type's keys, which the caller never sent.
    assert response.status_code == 200, response.json()
    persistent_agent.refresh_from_db()
    assert persistent_agent.adapter_type == "claude-managed"
    assert "max_tokens" not in persistent_agent.adapter_config and not persistent_agent.is_persistent
    assert [tool["name"] for tool in persistent_agent.adapter_config["tools"]][:2] == ["bash", "edit"]
    # A type that cannot run without settings of its own says which.
    error = assert_error(api.patch(agent_url(persistent_agent), {"adapter_type": "process"}), 400, "invalid")
    assert list(error["fields"]) == ["adapter_config.command"]


def test_put_replaces_the_agent_and_its_whole_adapter_config(api, persistent_agent):
    persistent_agent.adapter_config = {**persistent_agent.adapter_config, "memory": True}
    persistent_agent.save()
    api.patch(agent_url(persistent_agent), {"status": "paused"})

    response = api.put(agent_url(persistent_agent), {"name": "Fresh", "adapter_config": {"model": "claude-opus-4-5"}})

    assert response.status_code == 200, response.json()
    persistent_agent.refresh_from_db()
    assert (persistent_agent.name, persistent_agent.system_prompt) == ("Fresh", "")
    assert "memory" not in persistent_agent.adapter_config and not persistent_agent.is_persistent
    assert persistent_agent.status == AgentStatus.PAUSED  # a pause is an action, not configuration
    error = assert_error(api.put(agent_url(persistent_agent), {"adapter_config": {}}), 400, "invalid")
    assert list(error["fields"]) == ["name"]


def test_patch_status_pauses_and_resumes_the_agent(api, persistent_agent):
    assert api.patch(agent_url(persistent_agent), {"status": "paused"}).json()["status"] == "paused"
    persistent_agent.refresh_from_db()
    assert persistent_agent.status == AgentStatus.PAUSED
    assert api.patch(agent_url(persistent_agent), {"status": "active"}).json()["status"] == "active"


def test_patch_status_cannot_delete(api, persistent_agent):
    assert_error(api.patch(agent_url(persistent_agent), {"status": "deleted"}), 400)


def test_delete_agent_is_204_then_404_and_keeps_its_runs(api, persistent_agent):
    make_session(persistent_agent)
    run = make_run(persistent_agent)
    response = api.delete(agent_url(persistent_agent))
    assert response.status_code == 204
    assert_error(api.get(agent_url(persistent_agent)), 404)
    assert_error(api.delete(agent_url(persistent_agent)), 404)
    assert_error(api.get(agent_url(persistent_agent, "/sessions")), 404)
    persistent_agent.refresh_from_db()
    assert persistent_agent.status == AgentStatus.DELETED
    assert not persistent_agent.sessions.exists()
    run.refresh_from_db()


def test_put_is_405_where_nothing_is_replaced(api, persistent_agent):
    assert_error(api.put(f"/api/companies/{persistent_agent.company_id}", {"name": "x"}), 405, "method_not_allowed")


def test_get_on_the_companies_collection_is_405(api):
    assert_error(api.get("/api/companies"), 405)


def test_an_agent_on_a_model_the_catalogue_does_not_have_is_400_naming_the_field(api, company):
    catalogue_stored()
    body = {**AGENT_BODY, "adapter_config": {**AGENT_BODY["adapter_config"], "model": "claude-opus-5-6"}}

    error = assert_error(api.post(f"/api/companies/{company.id}/agents", body), 400, "invalid")

    assert set(error["fields"]) == {"adapter_config.model"}
    assert "'claude-opus-5-5'" in error["fields"]["adapter_config.model"]  # a close match
    assert not Agent.objects.exists()


def test_the_agent_object_says_what_the_catalogue_says_of_its_model(api, company):
    catalogue_stored()
    created = api.post(f"/api/companies/{company.id}/agents", AGENT_BODY).json()  # claude-opus-4-5: deprecated

    info = api.get(f"/api/companies/{company.id}/agents/{created['id']}").json()["model_info"]

    assert info["model"] == "claude-opus-4-5" and info["lifecycle"] == "deprecated"
    assert (info["deprecated_at"], info["retires_at"]) == ("2026-11-01T00:00:00Z", "2027-02-01T00:00:00Z")
    assert (info["max_input_tokens"], info["max_tokens"]) == (200_000, 64_000)
    assert "retires on 2027-02-01" in info["warning"]
    listed = api.get(f"/api/companies/{company.id}/agents").json()["agents"][0]["model_info"]
    assert listed == info
    current = {**AGENT_BODY["adapter_config"], "model": "claude-sonnet-5-5"}
    patched = api.patch(f"/api/companies/{company.id}/agents/{created['id']}", {"adapter_config": current}).json()
    assert (patched["model_info"]["lifecycle"], patched["model_info"]["warning"]) == ("active", "")


def test_an_agent_whose_model_left_the_catalogue_can_still_be_paused(api, company):
    agent = agent_on_unknown_model(company, "claude-legacy-1")
    response = api.patch(agent_url(agent, ""), {"status": "paused"})
    assert response.status_code == 200, response.json()
    assert response.json()["model_info"]["lifecycle"] == "unknown"


def test_a_heartbeat_of_an_agent_on_a_retired_model_is_409_model_retired(api, company, fake_anthropic):
    agent = Agent.objects.create(company=company, name="old", adapter_config={"model": "claude-opus-4-1"})
    catalogue_stored()

    error = assert_error(api.post(agent_url(agent, "/heartbeat"), {"task": "go"}), 409, "model_retired")

    assert "claude-opus-4-1" in error["message"]
    assert fake_anthropic.message_requests == []


def test_the_agent_object_shows_its_health_and_the_quota_holding_its_key(api, company, monkeypatch):
    from datetime import timedelta

    from django.utils import timezone

    from sessions_app.adapters.rate_limits import credential_fingerprint
    from sessions_app.models import HeartbeatRun, RunStatus
    from sessions_app.quota import quota_hold

    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-api-shown-never")
    agent = Agent.objects.create(
        company=company, name="Quiet", adapter_config={"model": "claude-haiku-4-5", "heartbeat_interval_minutes": 5}
    )
    for _ in range(3):
        HeartbeatRun.objects.create(company=company, agent=agent, task="t", status=RunStatus.FAILED)
    body = api.get(agent_url(agent)).json()
    assert body["health"]["state"] == "failing" and body["quota"] is None
    now = timezone.now()
    until = now + timedelta(minutes=10)
    quota_hold(
        credential=credential_fingerprint("sk-ant-api-shown-never"),
        code="rate_limited",
        reason="429",
        until=until,
        now=now,
    )
    listed = api.get(f"/api/companies/{company.id}/agents").json()["agents"][0]
    assert listed["quota"]["held_until"] == until.isoformat()
    assert listed["quota"]["status"].startswith("held until ")
    assert "sk-ant-api-shown-never" not in str(listed)
    health = api.get("/api/health").json()
    assert [held["credential"] for held in health["credentials_held"]] == [listed["quota"]["credential"]]
