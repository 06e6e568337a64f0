"""Budgets, the compaction archive and the growth signal through the API."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.db import connection

from costs_app.models import Budget, CostEvent
from sessions_app.models import Agent, AgentSession, AgentStatus
from sessions_app.services import agent_pause
from tests.api.conftest import Api
from tests.conftest import Actor, WriteGate, agent_on_unknown_model, beat, wait_until_blocked


def test_company_budget_is_read_set_and_reported_with_its_use(client, company, persistent_agent):
    url = f"/api/companies/{company.id}/budget"
    assert client.get(url).json() == {"budget": None, "use": []}
    CostEvent.objects.create(company=company, agent=persistent_agent, model="m", cost_usd=Decimal("2.5"))

    response = client.put(url, {"monthly_limit_usd": "10", "warn_percent": 20}, content_type="application/json")

    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["budget"]["monthly_limit_usd"] == "10.00"
    (use,) = body["use"]
    assert (use["scope"], use["period"], use["limit"], use["spent"], use["reserved"]) == (
        "company",
        "month",
        "10.00",
        "2.50",
        "0.00",
    )
    assert (use["warning"], use["exceeded"], use["daily_rate_usd"]) == (True, False, "2.50")
    summary = client.get(f"/api/companies/{company.id}/costs/summary").json()
    assert summary["budgets"][0]["period"] == "month"


def test_a_run_cap_is_a_count_and_a_limit_below_a_cent_keeps_its_digits(client, company, persistent_agent):
    url = f"/api/companies/{company.id}/agents/{persistent_agent.id}/budget"
    CostEvent.objects.create(company=company, agent=persistent_agent, model="m", cost_usd=Decimal("0.0002500000"))

    body = client.put(url, {"daily_run_limit": 50, "daily_limit_usd": "0.005"}, content_type="application/json").json()

    assert (body["budget"]["daily_run_limit"], body["budget"]["daily_limit_usd"]) == (50, "0.005")
    uses = {use["period"]: use for use in body["use"]}
    assert (uses["day_runs"]["limit"], uses["day_runs"]["spent"], uses["day_runs"]["reserved"]) == (50, 0, 0)
    assert (uses["day"]["limit"], uses["day"]["spent"]) == ("0.005", "0.00025")


def test_budget_validation_names_the_field(client, company):
    response = client.put(
        f"/api/companies/{company.id}/budget", {"monthly_limit_usd": "-1"}, content_type="application/json"
    )
    assert response.status_code == 400
    assert "monthly_limit_usd" in response.json()["error"]["fields"]


SET = {"monthly_limit_usd": "10.00", "daily_limit_usd": "3.00", "daily_run_limit": 5, "warn_percent": 80}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        # Only null removes a limit: a blank string is a mistake, not "none".
        ({"monthly_limit_usd": ""}, "monthly_limit_usd"),
        ({"daily_limit_usd": "   "}, "daily_limit_usd"),
        ({"session_limit_usd": ""}, "session_limit_usd"),
        ({"daily_limit_usd": True}, "daily_limit_usd"),
        ({"monthly_limit_usd": 1.0000001}, "monthly_limit_usd"),  # more places than a limit keeps
        ({"warn_percent": "50"}, "warn_percent"),
        ({"alert_percent": 90.0}, "alert_percent"),
        ({"daily_run_limit": 7.0}, "daily_run_limit"),
        ({"daily_run_limit": True}, "daily_run_limit"),
        ({"monthly_limt_usd": "1.00"}, "monthly_limt_usd"),
        ({"updated_at": "2026-01-01T00:00:00Z"}, "updated_at"),
    ],
)
def test_a_budget_put_is_strict_and_a_refused_one_changes_nothing(client, company, body, field):
    url = f"/api/companies/{company.id}/budget"
    assert client.put(url, SET, content_type="application/json").status_code == 200

    response = client.put(url, body, content_type="application/json")

    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert (error["code"], list(error["fields"])) == ("invalid", [field])
    budget = client.get(url).json()["budget"]
    assert {name: budget[name] for name in SET} == SET


def test_money_may_be_sent_as_a_json_number_and_is_answered_as_a_decimal_string(client, company):
    url = f"/api/companies/{company.id}/budget"

    response = client.put(url, {"monthly_limit_usd": 12.5, "lifetime_limit_usd": 5}, content_type="application/json")

    assert response.status_code == 200, response.json()
    budget = response.json()["budget"]
    assert (budget["monthly_limit_usd"], budget["lifetime_limit_usd"]) == ("12.50", "5.00")


def test_null_removes_a_limit(client, company):
    url = f"/api/companies/{company.id}/budget"
    assert client.put(url, SET, content_type="application/json").status_code == 200

    response = client.put(url, {"monthly_limit_usd": None, "daily_run_limit": None}, content_type="application/json")

    assert response.status_code == 200, response.json()
    budget = response.json()["budget"]
    assert (budget["monthly_limit_usd"], budget["daily_run_limit"], budget["daily_limit_usd"]) == (None, None, "3.00")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("scope", ["company", "agent"])
def test_two_first_puts_of_a_budget_at_once_both_set_the_one_budget(company, persistent_agent, scope):
    agent = persistent_agent if scope == "agent" else None
    url = f"/api/companies/{company.id}" + (f"/agents/{agent.id}" if agent else "") + "/budget"

    # The first is held at its insert, after it found no budget (and so no row to lock).
    with WriteGate("budgets", event="INSERT", when="NEW.monthly_limit_usd IS NOT NULL") as gate:
        first = Actor(lambda: Api().put(url, {"monthly_limit_usd": "1"}))
        first.start()
        gate.wait_entered()
        second = Actor(lambda: Api().put(url, {"daily_limit_usd": "2"}))
        second.start()
        if connection.vendor == "postgresql":
            # Nothing holds the second: it creates the budget while the first waits to insert
            # its own, which the unique constraint then refuses.
            assert second.result().status_code == 200
        else:
            # SQLite's IMMEDIATE transaction makes the second wait for the first's.
            wait_until_blocked(second)
        gate.open()
        responses = [first.result(), second.result()]

    assert [response.status_code for response in responses] == [200, 200], [r.content[:300] for r in responses]
    budget = Budget.objects.get()
    assert (budget.agent_id, budget.monthly_limit_usd, budget.daily_limit_usd) == (
        agent.id if agent else None,
        Decimal("1"),
        Decimal("2"),
    )


def test_raising_an_agent_budget_resumes_the_agent(client, company, persistent_agent):
    Budget.objects.create(company=company, agent=persistent_agent, lifetime_limit_usd=Decimal("1"))
    CostEvent.objects.create(company=company, agent=persistent_agent, model="m", cost_usd=Decimal("1"))
    agent_pause(agent=persistent_agent, reason="budget")
    url = f"/api/companies/{company.id}/agents/{persistent_agent.id}/budget"
    assert client.get(url).json()["use"][0]["exceeded"] is True

    assert client.put(url, {"lifetime_limit_usd": "5"}, content_type="application/json").status_code == 200

    persistent_agent.refresh_from_db()
    assert persistent_agent.status == AgentStatus.ACTIVE
    assert client.delete(url).status_code == 204
    assert not Budget.objects.filter(agent=persistent_agent).exists()


def test_budgets_of_another_company_are_404(client, company, other_company, other_agent):
    assert client.get(f"/api/companies/{company.id}/agents/{other_agent.id}/budget").status_code == 404


def test_session_archive_lists_compactions_and_their_turns(client, company, fake_anthropic):
    agent = Agent.objects.create(
        company=company,
        name="compacting",
        adapter_config={"session_mode": "persistent", "context_budget_tokens": 1000, "keep_recent_turns": 1},
    )
    for i in range(8):
        beat(agent, f"step {i} " + "x" * 500)
    session = AgentSession.objects.get(agent=agent)
    assert session.compaction_count > 0
    url = f"/api/companies/{company.id}/agents/{agent.id}/sessions/{session.public_id}/archive"

    summary = client.get(url).json()
    full = client.get(url + "?messages=true").json()

    assert summary["compaction_count"] == session.compaction_count == len(summary["compactions"])
    assert "archived_messages" not in summary["compactions"][0]
    assert full["compactions"][0]["archived_messages"][0]["seq"] == 0
    assert summary["compactions"][0]["tokens_before"] > summary["compactions"][0]["tokens_after"]


def test_growth_endpoint_flags_accumulating_history(client, company, fake_anthropic):
    agent = Agent.objects.create(
        company=company,
        name="growing",
        # A 200,000-token window: the growth would fill a tenth of it within 50 runs.
        adapter_config={
            "model": "claude-opus-4-5",
            "session_mode": "persistent",
            "context_strategy": "none",
            "prompt_caching": False,
        },
    )
    for i in range(10):
        beat(agent, f"step {i} " + "detail " * 400)
    body = client.get(f"/api/companies/{company.id}/agents/{agent.id}/growth").json()
    assert body["growing"] is True and body["slope_tokens_per_run"] * 50 >= body["ceiling_tokens"] / 10
    assert body["advice"].startswith("context_strategy is none")
    assert re.search(r"or set rotate_after_turns to \d+\.$", body["advice"])


def test_out_of_range_limits_are_400_not_500(client, company):
    response = client.put(
        f"/api/companies/{company.id}/budget", {"daily_run_limit": 32995542159}, content_type="application/json"
    )
    assert response.status_code == 400
    assert "daily_run_limit" in response.json()["error"]["fields"]


@pytest.mark.parametrize("number", ["1e-400", "1E400", "-2.5e999"])
def test_a_json_number_no_double_holds_is_400_and_no_limit_is_stored(client, company, number):
    # Read as a float, 1e-400 is 0.0: the limit would have become a zero limit, refusing every run.
    response = client.put(
        f"/api/companies/{company.id}/budget",
        f'{{"monthly_limit_usd": {number}}}'.encode(),
        content_type="application/json",
    )

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "number_out_of_range"
    assert number in error["message"]
    assert not Budget.objects.filter(company=company).exists()


def test_a_tiny_limit_sent_as_a_json_number_that_a_double_holds_is_kept(client, company):
    response = client.put(
        f"/api/companies/{company.id}/budget", b'{"monthly_limit_usd": 1e-6}', content_type="application/json"
    )

    assert response.status_code == 200, response.json()
    assert Budget.objects.get(company=company).monthly_limit_usd == Decimal("0.000001")


def test_a_heartbeat_of_a_budgeted_agent_on_an_unpriced_model_is_409(client, company):
    agent = agent_on_unknown_model(company, "claude-future-9")
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("5"))

    response = client.post(
        f"/api/companies/{company.id}/agents/{agent.id}/heartbeat", {"task": "go"}, content_type="application/json"
    )

    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "model_unpriced"
    assert "claude-future-9" in error["message"]


def test_session_archive_pages_every_compaction_and_never_reads_a_history(client, company, persistent_agent):
    from datetime import timedelta

    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from sessions_app.models import SessionCompaction
    from tests.admin.conftest import conversation, make_session

    predecessor = make_session(persistent_agent, history=conversation(40), store="database")
    session = make_session(persistent_agent, history=conversation(2), store="database", predecessor=predecessor)
    start = timezone.now() - timedelta(days=1)
    SessionCompaction.objects.bulk_create(
        SessionCompaction(session=session, kind="summarize", created_at=start + timedelta(minutes=n), summary=f"s{n}")
        for n in range(25)
    )
    url = f"/api/companies/{company.id}/agents/{persistent_agent.id}/sessions/{session.public_id}/archive"

    summaries, cursor, pages = [], None, 0
    with CaptureQueriesContext(connection) as queries:
        while True:
            body = client.get(url, {"limit": 10, **({"next": cursor} if cursor else {})}).json()
            summaries += [compaction["summary"] for compaction in body["compactions"]]
            pages, cursor = pages + 1, body["next"]
            if cursor is None:
                break
    assert summaries == [f"s{n}" for n in range(25)] and pages == 3
    assert body["predecessor_id"] == predecessor.public_id
    assert not [query for query in queries if '"agent_sessions"."history"' in query["sql"]]
