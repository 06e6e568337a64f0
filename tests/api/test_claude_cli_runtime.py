"""An agent with `runtime: "cli"` created and woken through the API; its session read back
through the API and the admin (one real Claude Code run against the fake)."""

from __future__ import annotations

import pytest
from django.urls import reverse

from sessions_app.models import Agent, AgentSession
from tests.api.conftest import agent_url, assert_error
from tests.fake_anthropic import Reply

pytestmark = pytest.mark.django_db

SCRIPT = "<script>alert(1)</script>"


def test_a_cli_agent_acts_and_its_session_reads_back_in_the_api_and_the_admin(
    api, company, fake_anthropic, admin_client
):
    body = {
        "name": "Coder",
        "adapter_type": "claude-code",
        "adapter_config": {"runtime": "cli", "session_mode": "persistent", "timeout_seconds": 60},
    }
    created = api.post(f"/api/companies/{company.id}/agents", body)
    assert created.status_code == 201, created.content
    agent = Agent.objects.get(id=created.json()["id"])
    fake_anthropic.push(
        Reply.tool_use("Bash", {"command": f"echo '{SCRIPT}' > page.html && cat page.html", "description": "x"}),
        Reply.message("Done."),
    )

    run = api.post(agent_url(agent, "/heartbeat"), {"task": "make a page", "wait": True}).json()

    assert (run["status"], run["output"]) == ("succeeded", "Done."), run
    assert run["runtime_report"]["num_turns"] == 2
    assert [call["name"] for call in run["runtime_report"]["tool_calls"]] == ["Bash"]
    session = AgentSession.objects.get(agent=agent)
    detail = api.get(agent_url(agent, f"/sessions/{session.public_id}")).json()
    assert detail["message_count"] == 2 == len(detail["history"])
    assert detail["cli_session_id"] == session.cli_session_id
    user, assistant = detail["history"]
    assert user["content"] == "make a page"
    assert [block["type"] for block in assistant["content"]] == ["tool_use", "tool_result", "text"]
    assert SCRIPT in assistant["content"][1]["content"]

    page = admin_client.get(reverse("admin:sessions_app_agentsession_change", args=[session.pk])).content.decode()
    assert "tool call: Bash" in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert SCRIPT not in page
    agent_page = admin_client.get(reverse("admin:sessions_app_agent_change", args=[agent.pk])).content.decode()
    assert "Workspace files" in agent_page
    assert '<td>page.html</td><td style="text-align:right">26</td>' in agent_page


def test_bad_cli_configuration_is_a_400_naming_the_field(api, company):
    body = {"name": "Coder", "adapter_type": "claude-code", "adapter_config": {"runtime": "cli", "max_turns": "many"}}
    error = assert_error(api.post(f"/api/companies/{company.id}/agents", body), 400)
    assert "max_turns" in str(error)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({}, "adapter_config.allowed_tools"),  # the default tools include the shell
        ({"allowed_tools": ["Read", "Bash"]}, "adapter_config.allowed_tools"),
        ({"allowed_tools": ["Read"], "permission_mode": "bypassPermissions"}, "adapter_config.permission_mode"),
        ({"allowed_tools": ["Read"], "workspace": "/"}, "adapter_config.workspace"),
    ],
    ids=["default-tools", "unlisted-shell", "bypass-permissions", "own-workspace"],
)
def test_in_authenticated_mode_a_key_gets_only_the_tools_the_operator_lists(key_api, company, settings, config, field):
    settings.PAPERCLIP_CLI_TOOLS = ("Read", "Glob", "Grep")
    body = {"name": "coder", "adapter_type": "claude-code", "adapter_config": {"runtime": "cli", **config}}

    error = assert_error(key_api.post(f"/api/companies/{company.id}/agents", body), 400)

    assert field in error["fields"], error
    assert not Agent.objects.filter(name="coder").exists()


def test_in_authenticated_mode_listed_tools_are_accepted(key_api, company, settings):
    settings.PAPERCLIP_CLI_TOOLS = ("Read", "Glob", "Grep")
    config = {"runtime": "cli", "allowed_tools": ["Read", "Grep"]}
    body = {"name": "reader", "adapter_type": "claude-code", "adapter_config": config}

    response = key_api.post(f"/api/companies/{company.id}/agents", body)

    assert response.status_code == 201, response.content
