"""Work checks and the back-off through the API: 400s naming the field, skipped runs listed
and filtered, and the agent's idle streak and back-off factor."""

from __future__ import annotations

import sys

import pytest

from sessions_app.models import Agent, RunStatus
from tests.api.conftest import agent_url, assert_error
from tests.conftest import beat

pytestmark = pytest.mark.django_db

BODY = {"name": "Triage", "adapter_type": "claude-code", "adapter_config": {"model": "claude-opus-4-5"}}


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"work_check": {"url": "file:///etc/passwd"}}, "adapter_config.work_check.url"),
        ({"work_check": {"command": "not-listed"}}, "adapter_config.work_check.command"),
        ({"work_check": {"url": "http://h/x", "timeout_seconds": "10"}}, "adapter_config.work_check.timeout_seconds"),
        ({"work_check": []}, "adapter_config.work_check"),
        ({"nothing_to_do_marker": "  "}, "adapter_config.nothing_to_do_marker"),
        ({"backoff_after_runs": -1}, "adapter_config.backoff_after_runs"),
        ({"backoff_max_factor": 0}, "adapter_config.backoff_max_factor"),
    ],
)
def test_a_bad_work_setting_is_a_400_naming_the_field(api, company, config, field):
    body = {**BODY, "adapter_config": {**BODY["adapter_config"], **config}}
    error = assert_error(api.post(f"/api/companies/{company.id}/agents", body), 400)
    assert field in error["fields"], error
    assert not Agent.objects.filter(name="Triage").exists()


def test_an_authenticated_key_cannot_save_a_raw_check_command(key_api, company):
    body = {**BODY, "adapter_config": {**BODY["adapter_config"], "work_check": {"command": ["sh", "-c", "env"]}}}
    error = assert_error(key_api.post(f"/api/companies/{company.id}/agents", body), 400)
    assert "adapter_config.work_check.command" in error["fields"]


def test_a_skipped_run_is_listed_filtered_and_counted_on_the_agent(api, stateless_agent, fake_anthropic, tmp_path):
    script = tmp_path / "none.py"
    script.write_text("import sys\nsys.exit(1)\n")
    stateless_agent.adapter_config = {
        **stateless_agent.adapter_config,
        "work_check": {"command": [sys.executable, str(script)]},
        "heartbeat_interval_minutes": 60,
        "backoff_after_runs": 1,
    }
    stateless_agent.save()

    response = api.post(agent_url(stateless_agent, "/heartbeat"), {"task": "anything?", "wait": True})
    assert response.status_code == 200, response.json()
    assert response.json()["status"] == "skipped"
    assert response.json()["cost_usd"] is None and response.json()["usage"]["input_tokens"] is None
    beat(stateless_agent)

    listed = api.get(agent_url(stateless_agent, "/runs"), {"status": "skipped"}).json()["runs"]
    assert [run["status"] for run in listed] == [RunStatus.SKIPPED] * 2
    assert api.get(agent_url(stateless_agent, "/runs"), {"status": "succeeded"}).json()["runs"] == []
    agent = api.get(agent_url(stateless_agent)).json()
    assert (agent["idle_streak"], agent["backoff_factor"]) == (2, 4)
    assert fake_anthropic.requests == []
