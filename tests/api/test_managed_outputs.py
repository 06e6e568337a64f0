"""The outputs API: the files an agent's Managed Agents sessions produced, listed, served
and deleted, each company's to its own keys only."""

from __future__ import annotations

import hashlib
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from sessions_app.managed_outputs import output_path
from sessions_app.models import ManagedOutput
from tests.api.conftest import agent_url, assert_error
from tests.conftest import managed_agent

pytestmark = pytest.mark.django_db


@pytest.fixture
def agent(company, settings):
    settings.PAPERCLIP_MANAGED_TOOLS = ("read",)  # the tests' keys run in authenticated mode
    return managed_agent(company, tools=["read"])


def stored_output(agent, filename: str, data: bytes, *, session_id=None, age_minutes: int = 0, **fields):
    """An output as an extraction leaves it: the file in place, then its row."""
    output = ManagedOutput(
        company_id=agent.company_id,
        agent=agent,
        session_id=session_id,
        remote_session_id="sesn_0001",
        file_id=f"file_{uuid.uuid4().hex[:12]}",
        filename=filename,
        media_type=fields.pop("media_type", "text/plain"),
        size_bytes=len(data),
        sha256=fields.pop("sha256", hashlib.sha256(data).hexdigest()),
        created_at=timezone.now() - timedelta(minutes=age_minutes),
        **fields,
    )
    if not output.skipped:
        output_path(output).parent.mkdir(parents=True, exist_ok=True)
        output_path(output).write_bytes(data)
    output.save()
    return output


def test_an_agents_outputs_are_listed_newest_first_a_page_at_a_time_and_by_session(key_api, agent):
    session_id = uuid.uuid4()
    old = stored_output(agent, "old.txt", b"old", age_minutes=10)
    new = stored_output(agent, "new.txt", b"new", session_id=session_id)

    first = key_api.get(agent_url(agent, "/outputs?limit=1")).json()
    second = key_api.get(agent_url(agent, f"/outputs?limit=1&next={first['next']}")).json()
    by_session = key_api.get(agent_url(agent, f"/outputs?session_id={session_id}")).json()
    # The id as the API shows it (its runs, its sessions, this list) finds the same.
    by_public_id = key_api.get(agent_url(agent, f"/outputs?session_id=sess_{session_id.hex}")).json()

    assert [o["id"] for o in first["outputs"] + second["outputs"]] == [new.pk, old.pk]
    assert second["next"] is None
    (listed,) = by_session["outputs"]
    assert by_public_id == by_session
    assert listed["session_id"] == f"sess_{session_id.hex}"
    assert listed["filename"] == "new.txt" and listed["stored"] is True
    assert listed["sha256"] == hashlib.sha256(b"new").hexdigest()
    for wrong in ("nope", f"sess_{session_id.hex[:-1]}"):
        refused = assert_error(key_api.get(agent_url(agent, f"/outputs?session_id={wrong}")), 400)
        assert (refused["code"], refused["fields"]) == ("invalid_parameter", {"session_id": wrong})


def test_an_output_downloads_as_the_exact_bytes_under_its_name_and_is_never_rendered(key_api, agent):
    data = bytes(range(256)) * 40
    output = stored_output(agent, "data, final.bin", data, media_type="text/html")

    response = key_api.get(agent_url(output.agent, f"/outputs/{output.pk}"))

    assert response.status_code == 200
    assert b"".join(response.streaming_content) == data
    assert response["Content-Disposition"] == 'attachment; filename="data, final.bin"'
    assert response["Content-Type"] == "application/octet-stream"


def test_another_companys_key_finds_no_output(other_key_api, agent):
    output = stored_output(agent, "secret.txt", b"secret")

    assert_error(other_key_api.get(agent_url(output.agent, f"/outputs/{output.pk}")), 404)
    assert_error(other_key_api.get(agent_url(output.agent, "/outputs")), 404)


def test_a_file_a_limit_kept_out_is_listed_but_not_served(key_api, agent):
    output = stored_output(agent, "huge.bin", b"", skipped="larger than the limit", sha256="")

    (listed,) = key_api.get(agent_url(output.agent, "/outputs")).json()["outputs"]
    assert (listed["stored"], listed["skipped"]) == (False, "larger than the limit")
    assert_error(key_api.get(agent_url(output.agent, f"/outputs/{output.pk}")), 404, "output_not_stored")


def test_a_deleted_output_loses_its_file_after_the_commit(key_api, agent, django_capture_on_commit_callbacks):
    output = stored_output(agent, "gone.txt", b"gone")
    path = output_path(output)

    with django_capture_on_commit_callbacks(execute=True):
        assert key_api.delete(agent_url(output.agent, f"/outputs/{output.pk}")).status_code == 204

    assert not ManagedOutput.objects.filter(pk=output.pk).exists()
    assert not path.exists()
    assert_error(key_api.delete(agent_url(output.agent, f"/outputs/{output.pk}")), 404)
