"""`claude-managed` agents through the API: created, woken, their sessions read back,
expired and deleted, against the Managed Agents fake through the real SDK."""

from __future__ import annotations

import pytest

from tests.api.conftest import assert_error

pytestmark = pytest.mark.django_db


def test_an_api_key_gets_only_the_tools_and_hosts_the_operator_lists(key_api, company, settings):
    settings.PAPERCLIP_MANAGED_TOOLS = ("read", "grep")
    settings.PAPERCLIP_MANAGED_HOSTS = ("pypi.org",)
    url = f"/api/companies/{company.id}/agents"

    def refused(config: dict) -> dict:
        body = {
            "name": "remote",
            "adapter_type": "claude-managed",
            "adapter_config": {"model": "claude-sonnet-4-5", **config},
        }
        return assert_error(key_api.post(url, body), 400)["fields"]

    assert "adapter_config.tools" in refused({})  # the default tools include the shell
    assert "adapter_config.tools" in refused({"tools": ["read", "bash"]})
    assert "adapter_config.environment" in refused(
        {"tools": ["read"], "environment": {"networking": {"allowed_hosts": ["evil.example"]}}}
    )
    assert "adapter_config.environment" in refused({"tools": ["read"], "environment": {"networking": "unrestricted"}})
    # The package registries are hosts too, and what is installed from them runs there.
    registries = {"networking": {"allowed_hosts": [], "allow_package_managers": True}, "packages": {"pip": ["x"]}}
    assert "package registries" in refused({"tools": ["read"], "environment": registries})["adapter_config.environment"]
    allowed = {"tools": ["read", "grep"], "environment": {"networking": {"allowed_hosts": ["pypi.org"]}}}
    body = {
        "name": "remote",
        "adapter_type": "claude-managed",
        "adapter_config": {"model": "claude-sonnet-4-5", **allowed},
    }
    assert key_api.post(url, body).status_code == 201


def test_an_api_key_mounts_only_the_files_the_operator_lists(key_api, company, settings):
    settings.PAPERCLIP_MANAGED_TOOLS = ("read",)
    settings.PAPERCLIP_MANAGED_FILES = ("file_allowed",)
    url = f"/api/companies/{company.id}/agents"

    def created(resources: list) -> object:
        config = {"model": "claude-sonnet-4-5", "tools": ["read"], "resources": resources}
        return key_api.post(url, {"name": "remote", "adapter_type": "claude-managed", "adapter_config": config})

    refused = assert_error(created([{"file_id": "file_allowed"}, {"file_id": "file_secret"}]), 400)
    assert "'file_secret'" in refused["fields"]["adapter_config.resources"]
    assert created([{"file_id": "file_allowed", "mount_path": "/mnt/data/in.csv"}]).status_code == 201


@pytest.mark.parametrize("hosts", [5, True, "pypi.org"], ids=["a-number", "a-boolean", "a-string"])
def test_an_api_key_sending_hosts_that_are_not_a_list_is_told_the_shape_expected(key_api, company, settings, hosts):
    settings.PAPERCLIP_MANAGED_TOOLS = ("read",)
    settings.PAPERCLIP_MANAGED_HOSTS = ("pypi.org",)
    config = {"model": "claude-sonnet-4-5", "tools": ["read"], "environment": {"networking": {"allowed_hosts": hosts}}}

    response = key_api.post(
        f"/api/companies/{company.id}/agents",
        {"name": "remote", "adapter_type": "claude-managed", "adapter_config": config},
    )

    # Not the operator's host list read letter by letter: what the setting must be.
    problem = assert_error(response, 400)["fields"]["adapter_config.environment"]
    assert "networking must be 'unrestricted' or {'allowed_hosts': [host, ...]" in problem
