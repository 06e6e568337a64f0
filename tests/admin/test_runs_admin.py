"""The admin's run pages."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from tests.admin.conftest import make_run

pytestmark = pytest.mark.django_db


def test_the_run_page_shows_the_ticks_merged_into_it(admin_client, persistent_agent):
    run = make_run(persistent_agent, merged_ticks=4)
    page = admin_client.get(reverse("admin:sessions_app_heartbeatrun_change", args=[run.pk])).content.decode()
    assert re.search(r"Merged ticks:.*?<div class=\"readonly\">4</div>", page, re.S)


def test_run_triggers_read_as_words_an_operator_uses(admin_client, persistent_agent):
    make_run(persistent_agent, trigger="api")
    page = admin_client.get(reverse("admin:sessions_app_heartbeatrun_changelist")).content.decode()
    assert re.search(r'<td class="field-trigger">API</td>', page)
    assert ">Api<" not in page


def selected_columns(client, url: str) -> str:
    """The column lists of every SELECT the page ran."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200
    return "\n".join(query["sql"].split(" FROM ")[0] for query in queries)


@pytest.mark.parametrize("page", ["changelist", "change", "agent"])
def test_run_pages_never_read_a_parked_batch_request(admin_client, persistent_agent, page):
    from sessions_app.models import HeartbeatRun, RunStatus

    # A run parked for a batch keeps its whole request (history included) until answered.
    run = make_run(persistent_agent, status=RunStatus.SUBMITTED, delivery="batch", batch_state="parked")
    history = [{"role": "user", "content": "x" * 1000}] * 50
    HeartbeatRun.objects.filter(pk=run.pk).update(batch_request={"messages": history}, batch_answer={"message": {}})
    url = {
        "changelist": reverse("admin:sessions_app_heartbeatrun_changelist"),
        "change": reverse("admin:sessions_app_heartbeatrun_change", args=[run.pk]),
        "agent": reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk]),
    }[page]
    columns = selected_columns(admin_client, url)
    assert "batch_request" not in columns and "batch_answer" not in columns
    if page != "change":  # only the run's own page shows an approval
        assert "managed_turn" not in columns


def test_the_runs_delete_confirmation_never_reads_a_runs_whole_row(admin_client, persistent_agent):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from memory_app.models import RunToolLoop
    from sessions_app.models import HeartbeatRun

    runs = [make_run(persistent_agent, output="o" * 5000) for _ in range(3)]
    for run in runs:
        RunToolLoop.objects.create(run=run, rounds=2, tool_calls=3)
    HeartbeatRun.objects.update(batch_answer={"message": {"content": "x" * 5000}})
    selected = {"action": "delete_selected", "_selected_action": [str(run.pk) for run in runs]}
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.post(reverse("admin:sessions_app_heartbeatrun_changelist"), selected)
    page = response.content.decode()
    assert response.status_code == 200 and "Are you sure" in page
    assert "3 run tool loops" in page
    columns = "\n".join(query["sql"].split(" FROM ")[0] for query in queries)
    assert "batch_answer" not in columns and '"output"' not in columns
