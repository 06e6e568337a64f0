"""The console, the admin's front page: what it counts, where each figure leads, and what it
costs; and ids as the API shows them, opened from admin URLs."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from decimal import Decimal
from html import unescape

import pytest
from django.db import connection
from django.db.models import Count
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from django_q.models import Schedule

from costs_app.models import Budget
from sessions_app.models import Agent, AgentSession, HeartbeatRun, RunStatus, SessionStatus
from tests.admin.conftest import conversation, make_cost, make_run, make_session

pytestmark = pytest.mark.django_db


def troubled_agent(company, name: str) -> Agent:
    """An agent with one of everything the console counts: three failed runs in a row, a
    queued and a running run, a session expiring within the hour, a budget nearly spent
    today, and a wake the scheduler has not taken for ten minutes."""
    now = timezone.now()
    agent = Agent.objects.create(
        company=company, name=name, adapter_config={"model": "claude-opus-4-5", "session_mode": "persistent"}
    )
    make_run(agent, status=RunStatus.SUCCEEDED, created_at=now - timedelta(hours=5))
    for minutes in (30, 20, 10):
        make_run(
            agent, status=RunStatus.FAILED, error_code="model_timeout", created_at=now - timedelta(minutes=minutes)
        )
    make_run(agent, status=RunStatus.QUEUED, created_at=now - timedelta(minutes=7), started_at=None, finished_at=None)
    make_run(agent, status=RunStatus.RUNNING, deadline_at=now - timedelta(minutes=1), finished_at=None)
    make_session(agent, history=conversation(2), status=SessionStatus.ACTIVE, expires_at=now + timedelta(minutes=30))
    Budget.objects.create(company=company, agent=agent, daily_limit_usd=Decimal("1"), monthly_limit_usd=Decimal("20"))
    make_cost(agent, cost_usd=Decimal("0.9"))
    Schedule.objects.create(
        name=f"heartbeat:{agent.pk}",
        func="sessions_app.tasks.scheduled_heartbeat",
        schedule_type=Schedule.ONCE,
        next_run=now - timedelta(minutes=10),
    )
    return agent


def console_page(admin_client) -> str:
    response = admin_client.get(reverse("admin:index"))
    assert response.status_code == 200
    return response.content.decode()


def tile(page: str, tile_id: str) -> str:
    match = re.search(rf'<div class="module pc-tile" id="{tile_id}">(.*?)\n  </div>\n', page, re.S)
    assert match, tile_id
    return match.group(1)


def links(html: str) -> dict[str, str]:
    """Each link's text (tags and spacing dropped) -> its URL."""
    return {
        re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text)).strip(): unescape(href)
        for href, text in re.findall(r'<a [^>]*href="([^"]+)"[^>]*>(.*?)</a>', html, re.S)
    }


def test_the_console_costs_the_same_queries_however_many_agents(admin_client, company):
    troubled_agent(company, "first")
    console_page(admin_client)  # the session and the user are loaded once
    with CaptureQueriesContext(connection) as few:
        console_page(admin_client)
    for index in range(12):
        troubled_agent(company, f"more {index}")
    with CaptureQueriesContext(connection) as many:
        page = console_page(admin_client)
    assert len(many) == len(few), [query["sql"][:120] for query in many]
    assert "and 8 more" in tile(page, "pc-attention")  # 13 agents, 5 listed


def test_the_console_counts_what_needs_a_person_and_each_figure_leads_to_its_rows(admin_client, company):
    agent = troubled_agent(company, "Researcher")
    healthy = Agent.objects.create(company=company, name="Healthy", adapter_config={"model": "claude-opus-4-5"})
    make_run(healthy, status=RunStatus.FAILED, error_code="model_overloaded")
    make_run(healthy, status=RunStatus.SUCCEEDED)
    page = console_page(admin_client)

    runs = links(tile(page, "pc-runs"))
    assert set(runs) >= {"1 running", "1 queued", "1 past their deadline"}
    failures = links(tile(page, "pc-failures"))
    assert "model_timeout" in failures and "model_overloaded" in failures
    attention = tile(page, "pc-attention")
    assert "Researcher" in attention and "Healthy" not in attention
    assert "3 failed runs in 24 h" in attention and "wake due 10 min ago" in attention
    sessions = links(tile(page, "pc-sessions"))
    assert "1 sessions expiring within the hour" in sessions
    spend = tile(page, "pc-spend")
    assert "$0.90 of $1.00 (90%)" in spend

    # Each figure opens the list of exactly the rows it counted.
    def listed(url: str) -> str:
        response = admin_client.get(url)
        assert response.status_code == 200, url
        return response.content.decode()

    assert listed(failures["model_timeout"]).count('class="field-error_code"') == 3
    assert listed(failures["model_overloaded"]).count('class="field-error_code"') == 1
    assert listed(runs["1 queued"]).count('class="field-status"') == 1
    assert listed(runs["1 past their deadline"]).count('class="field-status"') == 1
    session = AgentSession.objects.get(agent=agent)
    assert session.public_id[:13] in listed(sessions["1 sessions expiring within the hour"])
    today = links(spend)["$0.90 today"]
    assert listed(today).count('class="field-agent_name"') == 1


def test_a_healthy_deployment_says_so(admin_client, company, persistent_agent):
    make_run(persistent_agent)
    page = console_page(admin_client)
    assert "No run failed." in page
    assert "Every agent's runs and wakes are as they should be." in page
    assert "No task cluster is running" in page  # none runs in this test
    assert "No model in use is deprecated or retiring." in page


def test_a_user_without_view_permissions_sees_no_figures(client, django_user_model, persistent_agent):
    user = django_user_model.objects.create_user("viewer", password="pw-not-used-1", is_staff=True)
    client.force_login(user)
    page = client.get(reverse("admin:index")).content.decode()
    assert 'id="pc-runs"' not in page and 'id="pc-spend"' not in page and 'id="pc-attention"' not in page


@pytest.mark.parametrize("leading", ["", "22"])
def test_an_api_session_id_in_an_admin_url_redirects_to_the_row(admin_client, persistent_agent, leading):
    # "22": the admin's unquote() reads "_22" as an escaped quote mark.
    session_id = uuid.UUID(leading + uuid.uuid4().hex[len(leading) :])
    file_session = make_session(persistent_agent, history=conversation(2), id=session_id)
    base = "/admin/sessions_app/agentsession"
    response = admin_client.get(f"{base}/{file_session.public_id}/change/")
    assert response.status_code == 302
    assert response["Location"] == f"{base}/{file_session.pk}/change/"
    assert admin_client.get(response["Location"]).status_code == 200
    assert (
        admin_client.get(f"{base}/{file_session.public_id}/delete/")["Location"] == f"{base}/{file_session.pk}/delete/"
    )
    # The session's own pages take its API id as well.
    assert admin_client.get(f"{base}/{file_session.public_id}/export/").status_code == 200


@pytest.mark.parametrize("spelling", [str, lambda pk: pk.hex, lambda pk: str(pk).upper()])
def test_any_api_id_opens_its_row_from_one_admin_url(admin_client, file_session, spelling):
    run = make_run(file_session.agent, session=file_session)
    for obj, page in (
        (run, "heartbeatrun"),
        (file_session.agent, "agent"),
        (file_session.agent.company, "company"),
    ):
        response = admin_client.get(reverse("admin:find", args=[spelling(obj.pk)]))
        assert response["Location"] == f"/admin/sessions_app/{page}/{obj.pk}/change/"
    response = admin_client.get(reverse("admin:find_form"), {"id": f" {file_session.public_id} "})
    assert response["Location"] == f"/admin/sessions_app/agentsession/{file_session.pk}/change/"


def test_an_unknown_id_is_said_so_on_the_console(admin_client, db):
    response = admin_client.get(reverse("admin:find", args=["sess_" + "0" * 32]), follow=True)
    assert "Nothing here has the id" in response.content.decode()
    response = admin_client.get(reverse("admin:find", args=["not-an-id"]), follow=True)
    assert response.status_code == 200 and "Nothing here has the id" in response.content.decode()


def test_the_root_url_leads_to_the_admin(client, db):
    response = client.get("/")
    assert response.status_code == 302 and response["Location"] == "/admin/"


def test_the_failed_runs_of_the_day_are_read_through_their_partial_index(postgres_only, persistent_agent):
    from paperclip.console import DAY

    make_run(persistent_agent, status=RunStatus.FAILED, error_code="model_timeout")
    recent = HeartbeatRun.objects.filter(status=RunStatus.FAILED, created_at__gte=timezone.now() - DAY)
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a tiny table would be scanned anyway
        plan = recent.values("error_code").annotate(runs=Count("id")).explain()
    assert "runs_failed_created_idx" in plan, plan


def test_the_console_names_held_credentials_and_agents_down(admin_client, company, persistent_agent):
    from sessions_app.models import Agent
    from sessions_app.quota import quota_hold

    now = timezone.now()
    quota_hold(
        credential="sha256:00112233aabbccdd",
        code="rate_limited",
        reason="Messages API rate limit (429)",
        until=now + timedelta(minutes=5),
        now=now,
    )
    Agent.objects.filter(pk=persistent_agent.pk).update(health_state="down", health_changed_at=now)
    page = console_page(admin_client)
    assert "Credential sha256:00112233aabbccdd: held until" in page
    assert "Messages API rate limit (429)" in page
    assert "health: down since" in page
