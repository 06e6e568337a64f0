"""The admin's list of remote Managed Agents sessions ended, or still to end."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from sessions_app.models import ManagedSessionEnd

pytestmark = pytest.mark.django_db


@pytest.fixture
def ends(company):
    now = timezone.now()
    make = ManagedSessionEnd.objects.create
    return {
        "pending": make(remote_session_id="sesn_pending", action="archive", company=company),
        "failing": make(
            remote_session_id="sesn_failing",
            action="delete",
            company=company,
            attempts=3,
            last_error="overloaded (529).",
            next_attempt_at=now + timedelta(minutes=8),
        ),
        "done": make(remote_session_id="sesn_done", action="archive", company=company, attempts=1, done_at=now),
    }


def rows(page: str) -> dict[str, str]:
    """Each row's remote session id and its state cell."""
    found = re.findall(r"sesn_(\w+).*?<td class=\"field-state\">(.*?)</td>", page, re.S)
    return {name: state for name, state in found}


def test_each_end_says_in_one_column_whether_it_is_done_waiting_or_refused_and_why(admin_client, ends):
    page = admin_client.get(reverse("admin:sessions_app_managedsessionend_changelist")).content.decode()
    states = rows(page)
    assert states["pending"] == "pending"
    assert states["done"].startswith("done ")
    assert re.fullmatch(r"refused 3x, next \d{4}-\d\d-\d\d \d\d:\d\d UTC: overloaded \(529\)\.", states["failing"])


def test_a_long_error_is_cut_in_the_list_and_whole_in_its_tooltip(admin_client, company):
    error = "The connection was refused. " * 10
    ManagedSessionEnd.objects.create(
        remote_session_id="sesn_long", action="delete", company=company, attempts=1, last_error=error
    )
    page = admin_client.get(reverse("admin:sessions_app_managedsessionend_changelist")).content.decode()
    state = rows(page)["long"]
    assert state.endswith("…</span>") and error.strip() in state


@pytest.mark.parametrize(
    ("state", "shown"), [("pending", {"pending", "failing"}), ("failing", {"failing"}), ("done", {"done"})]
)
def test_the_state_filter_lists_what_it_names(admin_client, ends, state, shown):
    url = reverse("admin:sessions_app_managedsessionend_changelist")
    page = admin_client.get(url, {"state": state}).content.decode()
    assert set(rows(page)) == shown


def test_a_sessions_page_lists_its_outputs_and_each_downloads_from_the_admin(admin_client, persistent_agent):
    from tests.admin.conftest import conversation, make_session
    from tests.api.test_managed_outputs import stored_output

    session = make_session(persistent_agent, history=conversation(2), managed_session_id="sesn_with_files")
    output = stored_output(persistent_agent, "report.csv", b"a,b\n1,2\n", session_id=session.pk)
    stored_output(persistent_agent, "huge.bin", b"", session_id=session.pk, skipped="over the limit", sha256="")

    page = admin_client.get(reverse("admin:sessions_app_agentsession_change", args=[session.pk])).content.decode()
    download = reverse("admin:sessions_app_managedoutput_download", args=[output.pk])
    assert f'<a href="{download}">report.csv</a>' in page
    assert "huge.bin (not copied: over the limit)" in page

    response = admin_client.get(download)
    assert b"".join(response.streaming_content) == b"a,b\n1,2\n"
    assert response["Content-Disposition"] == 'attachment; filename="report.csv"'
    assert response["Content-Type"] == "application/octet-stream"


def test_a_lost_remote_session_is_shown_on_its_page_and_found_by_the_filter(admin_client, persistent_agent, company):
    from tests.admin.conftest import conversation, make_session
    from tests.conftest import managed_agent

    now = timezone.now()
    lost = make_session(
        persistent_agent,
        history=conversation(2),
        status="active",
        managed_session_id="sesn_lost",
        managed_lost_at=now,
        managed_problem="The service terminated the session.",
    )
    unreachable = make_session(
        managed_agent(company),
        history=conversation(2),
        status="active",
        managed_session_id="sesn_unreachable",
        managed_checked_at=now,
        managed_check_failures=3,
        managed_problem="Could not reach the Messages API.",
    )

    page = admin_client.get(reverse("admin:sessions_app_agentsession_change", args=[lost.pk])).content.decode()
    assert "active (remote session lost)" in page
    assert "The service terminated the session." in page
    page = admin_client.get(reverse("admin:sessions_app_agentsession_change", args=[unreachable.pk])).content.decode()
    assert "unreachable at the last 3 checks: Could not reach the Messages API." in page

    listing = reverse("admin:sessions_app_agentsession_changelist")
    found = admin_client.get(listing, {"remote": "lost"}).context["cl"].result_list
    assert [session.pk for session in found] == [lost.pk]
    found = admin_client.get(listing, {"remote": "unreachable"}).context["cl"].result_list
    assert [session.pk for session in found] == [unreachable.pk]


def test_the_outputs_list_reads_its_agents_names_not_their_prompts(admin_client, persistent_agent):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tests.api.test_managed_outputs import stored_output

    persistent_agent.system_prompt = "You are thorough. " * 500
    persistent_agent.save()
    stored_output(persistent_agent, "report.csv", b"a,b\n")
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(reverse("admin:sessions_app_managedoutput_changelist")).content.decode()
    assert "report.csv" in page and persistent_agent.name in page
    for query in queries:
        assert '"system_prompt"' not in query["sql"].split(" FROM ")[0], query["sql"]
