"""`claude-managed` agents' configuration: checked on save (the API answers 400 naming the
field), and in authenticated mode held to the tools and hosts the operator lists, again
when a run starts."""

from __future__ import annotations

import pytest

from sessions_app.adapters import AgentConfigError, validate_agent_config
from sessions_app.adapters.base import AdapterRequest
from sessions_app.adapters.claude_managed_config import agent_params, budget_cents, environment_config
from sessions_app.models import Agent, RunStatus
from tests.conftest import beat, managed_agent

pytestmark = pytest.mark.django_db


def fields_refused(config: dict) -> set[str]:
    with pytest.raises(AgentConfigError) as refused:
        validate_agent_config("claude-managed", config)
    return set(refused.value.fields)


def test_the_defaults_are_the_file_and_shell_tools_always_allowed_and_no_network():
    clean = validate_agent_config("claude-managed", {"model": "claude-sonnet-4-5"})

    assert [tool["name"] for tool in clean["tools"]] == ["bash", "edit", "read", "write", "glob", "grep"]
    assert {tool["permission"] for tool in clean["tools"]} == {"always_allow"}
    assert environment_config(clean) == {
        "type": "cloud",
        "networking": {"type": "limited", "allowed_hosts": [], "allow_package_managers": False},
    }


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"tools": ["bash", "teleport"]}, "adapter_config.tools"),
        ({"tools": [{"name": "bash", "permission": "sometimes"}]}, "adapter_config.tools"),
        ({"tools": ["bash", "bash"]}, "adapter_config.tools"),
        ({"environment": {"networking": "open"}}, "adapter_config.environment"),
        ({"environment": {"packages": {"pip": ["requests"]}}}, "adapter_config.environment"),
        ({"environment": {"networking": {"allowed_hosts": [""]}}}, "adapter_config.environment"),
        ({"max_budget_usd": 0}, "adapter_config.max_budget_usd"),
        ({"max_budget_usd": "ten"}, "adapter_config.max_budget_usd"),
        ({"context_strategy": "summarize"}, "adapter_config.context_strategy"),
        ({"max_tokens": 100}, "adapter_config.max_tokens"),
        ({"resources": "file_1"}, "adapter_config.resources"),
        ({"resources": [{"file_id": "file 1"}]}, "adapter_config.resources"),
        ({"resources": [{"file_id": "file_1", "mount_path": "data.csv"}]}, "adapter_config.resources"),
        ({"resources": [{"file_id": "file_1", "mount_path": "/mnt/../etc/passwd"}]}, "adapter_config.resources"),
        ({"resources": [{"file_id": "file_1", "mount_path": "/mnt/a\nb"}]}, "adapter_config.resources"),
        ({"resources": [{"file_id": "file_1", "mount_path": "/mnt/a\x85b"}]}, "adapter_config.resources"),
        ({"resources": [{"file_id": "file_1", "mount_path": "/mnt/a\x7fb"}]}, "adapter_config.resources"),
        ({"resources": [{"file_id": "file_1"}, {"file_id": "file_1"}]}, "adapter_config.resources"),
        ({"resources": [{"file_id": "file_1", "repo": "x"}]}, "adapter_config.resources"),
    ],
    ids=[
        "unknown-tool",
        "bad-permission",
        "tool-twice",
        "bad-networking",
        "packages-without-registries",
        "empty-host",
        "zero-budget",
        "budget-not-a-number",
        "own-summaries",
        "messages-api-setting",
        "resources-not-a-list",
        "resource-bad-file-id",
        "resource-relative-path",
        "resource-path-escapes",
        "resource-path-newline",
        "resource-path-nel",
        "resource-path-del",
        "resource-twice",
        "resource-unknown-key",
    ],
)
def test_a_bad_setting_is_refused_by_name(config, field):
    assert field in fields_refused({"model": "claude-sonnet-4-5", **config})


def test_the_remote_agent_gets_the_tools_with_their_policies_and_the_budget_is_whole_cents():
    clean = validate_agent_config(
        "claude-managed",
        {
            "model": "claude-sonnet-4-5",
            "tools": ["read", {"name": "bash", "permission": "always_ask"}],
            "environment": {
                "networking": {"allowed_hosts": ["pypi.org"], "allow_package_managers": True},
                "packages": {"pip": ["requests==2.32.3"]},
            },
            "max_budget_usd": 2.349,
        },
    )
    request = AdapterRequest(model="claude-sonnet-4-5", system="Be brief.", messages=[], config=clean)

    (toolset,) = agent_params(request)["tools"]
    assert toolset["default_config"] == {"enabled": False}
    assert [(c["name"], c["permission_policy"]["type"]) for c in toolset["configs"]] == [
        ("read", "always_allow"),
        ("bash", "always_ask"),
    ]
    assert environment_config(clean)["packages"] == {"type": "packages", "pip": ["requests==2.32.3"]}
    assert budget_cents(clean) == 234  # never above what the agent allows


def test_an_agent_saved_before_authenticated_mode_does_not_reach_the_provider(company, fake_managed, settings):
    agent = managed_agent(company)  # the default tools, the shell among them
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.PAPERCLIP_MANAGED_TOOLS = ("read",)

    run = beat(agent, "deploy")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "managed_not_allowed")
    assert "adapter_config.tools" in run.error and "'bash'" in run.error
    assert fake_managed.requests == []


def test_an_agent_mounting_a_file_the_operator_no_longer_lists_does_not_reach_the_provider(
    company, fake_managed, settings
):
    agent = managed_agent(company, tools=["read"], resources=[{"file_id": "file_0001"}])
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.PAPERCLIP_MANAGED_TOOLS = ("read",)
    settings.PAPERCLIP_MANAGED_FILES = ("file_0002",)

    run = beat(agent, "read the data")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "managed_not_allowed")
    assert "adapter_config.resources" in run.error and "'file_0001'" in run.error
    assert fake_managed.requests == []


def test_an_agent_reaching_package_registries_the_operator_no_longer_allows_does_not_reach_the_provider(
    company, fake_managed, settings
):
    registries = {"networking": {"allowed_hosts": [], "allow_package_managers": True}, "packages": {"pip": ["x"]}}
    agent = managed_agent(company, tools=["read"], environment=registries)
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.PAPERCLIP_MANAGED_TOOLS = ("read",)
    settings.PAPERCLIP_MANAGED_HOSTS = ("pypi.org",)

    run = beat(agent, "install and run")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "managed_not_allowed")
    assert "package registries" in run.error
    assert fake_managed.requests == []
    settings.PAPERCLIP_MANAGED_HOSTS = ("*",)  # the operator allows any host: registries too
    assert beat(agent, "install and run").status == RunStatus.SUCCEEDED


def test_packages_stored_without_the_registries_networking_are_checked_when_a_run_starts(
    company, fake_managed, settings
):
    """A save never keeps packages without allow_package_managers, but a row written around
    validation may: they are still installed from the registries, which need '*'."""
    agent = managed_agent(company, tools=["read"])
    environment = {"networking": {"allowed_hosts": ["pypi.org"]}, "packages": {"pip": ["x"]}}
    Agent.objects.filter(pk=agent.pk).update(adapter_config={**agent.adapter_config, "environment": environment})
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.PAPERCLIP_MANAGED_TOOLS = ("read",)
    settings.PAPERCLIP_MANAGED_HOSTS = ("pypi.org",)

    run = beat(Agent.objects.get(pk=agent.pk), "install and run")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "managed_not_allowed")
    assert "package registries" in run.error
    assert fake_managed.requests == []


def test_a_system_check_names_managed_agents_that_authenticated_mode_no_longer_allows(company, settings):
    from sessions_app.checks import check_managed_rules

    registries = {"networking": {"allowed_hosts": [], "allow_package_managers": True}, "packages": {"pip": ["x"]}}
    installing = managed_agent(company, tools=["read"], environment=registries)
    managed_agent(company, tools=["read"])
    assert check_managed_rules(None) == []  # local_trusted allows both

    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.PAPERCLIP_MANAGED_TOOLS = ("read",)

    (warning,) = check_managed_rules(None)
    assert warning.id == "paperclip.W007"
    assert str(installing.id) in warning.msg and "adapter_config.environment" in warning.msg
