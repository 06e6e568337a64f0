from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from costs_app.models import CostEvent
from sessions_app.models import AgentStatus
from tests.api.conftest import assert_error

pytestmark = pytest.mark.django_db


def spend(agent, *, when=None, tokens_in=100, tokens_out=10, cost="0.0010", model="claude-opus-4-5", **extra):
    return CostEvent.objects.create(
        company_id=agent.company_id,
        agent=agent,
        model=model,
        input_tokens=tokens_in,
        output_tokens=tokens_out,
        cost_usd=Decimal(cost),
        created_at=when or timezone.now(),
        **extra,
    )


def test_daily_costs_per_utc_day_newest_first_with_money_as_strings(api, company, persistent_agent, stateless_agent):
    now = timezone.now()
    spend(persistent_agent, when=now - timedelta(days=1), tokens_in=100, cost="0.0010")
    spend(persistent_agent, when=now - timedelta(days=1), tokens_in=200, cost="0.0020", cache_read_input_tokens=7)
    spend(persistent_agent, when=now, tokens_in=400, cost="0.0040")
    spend(stateless_agent, when=now, tokens_in=9999, cost="9.9")
    response = api.get(f"/api/companies/{company.id}/costs/daily", {"agent_id": str(persistent_agent.id), "days": 30})
    assert response.status_code == 200
    body = response.json()
    assert body["agent_id"] == str(persistent_agent.id)
    assert body["days"] == 30
    days = body["daily"]
    assert [d["day"] for d in days] == [now.date().isoformat(), (now - timedelta(days=1)).date().isoformat()]
    assert days[0]["input_tokens"] == 400
    assert days[1]["input_tokens"] == 300 and days[1]["output_tokens"] == 20
    assert days[1]["cache_read_input_tokens"] == 7
    assert Decimal(days[1]["cost_usd"]) == Decimal("0.0030")
    assert isinstance(days[1]["cost_usd"], str)
    assert Decimal(body["totals"]["cost_usd"]) == Decimal("0.0070")


def test_daily_costs_of_the_whole_company_by_default(api, company, persistent_agent, stateless_agent, other_agent):
    spend(persistent_agent, cost="1")
    spend(stateless_agent, cost="2")
    spend(other_agent, cost="100")
    body = api.get(f"/api/companies/{company.id}/costs/daily").json()
    assert body["days"] == 30
    assert Decimal(body["totals"]["cost_usd"]) == Decimal(3)


def test_daily_costs_window_excludes_older_days(api, company, persistent_agent):
    spend(persistent_agent, when=timezone.now() - timedelta(days=3))
    body = api.get(f"/api/companies/{company.id}/costs/daily", {"days": 1}).json()
    assert body["daily"] == []


@pytest.mark.parametrize("days", ["0", "367", "-1", "ten", "1.5"])
def test_days_outside_1_to_366_is_400(api, company, days):
    error = assert_error(api.get(f"/api/companies/{company.id}/costs/daily", {"days": days}), 400)
    assert "days" in error["fields"]


def test_agent_filter_that_is_not_a_uuid_is_400(api, company):
    assert_error(api.get(f"/api/companies/{company.id}/costs/daily", {"agent_id": "x"}), 400)


def test_deleted_agents_spend_is_still_reported(api, company, persistent_agent):
    spend(persistent_agent, cost="1.5")
    persistent_agent.status = AgentStatus.DELETED
    persistent_agent.save()
    body = api.get(f"/api/companies/{company.id}/costs/daily", {"agent_id": str(persistent_agent.id)}).json()
    assert Decimal(body["totals"]["cost_usd"]) == Decimal("1.5")


def test_month_to_date_summary_per_agent_and_model(api, company, persistent_agent, stateless_agent, other_agent):
    spend(persistent_agent, model="claude-opus-4-5", cost="1")
    spend(persistent_agent, model="claude-opus-4-5", cost="2")
    spend(persistent_agent, model="claude-haiku-4-5", cost="0.5")
    spend(stateless_agent, model="claude-opus-4-5", cost="4")
    spend(other_agent, cost="100")
    body = api.get(f"/api/companies/{company.id}/costs/summary").json()
    rows = {(r["agent_name"], r["model"]): Decimal(r["cost_usd"]) for r in body["rows"]}
    assert rows == {
        ("Persistent", "claude-opus-4-5"): Decimal(3),
        ("Persistent", "claude-haiku-4-5"): Decimal("0.5"),
        ("Stateless", "claude-opus-4-5"): Decimal(4),
    }
    assert Decimal(body["totals"]["cost_usd"]) == Decimal("7.5")
    assert body["month"] == timezone.now().strftime("%Y-%m")


def test_summary_queries_do_not_grow_with_agents(
    api, company, persistent_agent, stateless_agent, django_assert_max_num_queries
):
    for agent in (persistent_agent, stateless_agent):
        for model in ("a", "b", "c"):
            spend(agent, model=model)
    # Company, spend, agent names, and the (empty) budget lookup: four, however many agents.
    with django_assert_max_num_queries(4):
        response = api.get(f"/api/companies/{company.id}/costs/summary")
    assert len(response.json()["rows"]) == 6


def test_the_cost_endpoints_read_the_daily_rollup_not_the_ledger(api, company, persistent_agent):
    spend(persistent_agent, cost="2")
    with CaptureQueriesContext(connection) as queries:
        daily = api.get(f"/api/companies/{company.id}/costs/daily").json()
        summary = api.get(f"/api/companies/{company.id}/costs/summary").json()
    assert Decimal(daily["totals"]["cost_usd"]) == Decimal(summary["totals"]["cost_usd"]) == Decimal(2)
    # A few rows per agent and day however many calls the ledger holds (bench/rollups.py).
    assert not [query["sql"] for query in queries if "cost_events" in query["sql"]]
    assert len([query for query in queries if "cost_days" in query["sql"]]) == 2


def test_cost_report_prints_days_and_growth_advice(persistent_agent, capsys):
    now = timezone.now()
    for index in range(12):
        spend(persistent_agent, when=now - timedelta(seconds=20 - index), tokens_in=1000 * (index + 1), cost="0.01")
    call_command("cost_report", "--agent", str(persistent_agent.id), "--days", "7")
    out = capsys.readouterr().out
    assert now.date().isoformat() in out
    assert "78000" in out  # 1000 + 2000 + ... + 12000
    assert "Input grows run after run." in out and "set rotate_after_turns to" in out


def test_cost_report_of_every_company(persistent_agent, other_agent, capsys):
    spend(persistent_agent)
    call_command("cost_report")
    out = capsys.readouterr().out
    assert "Acme" in out and "Globex" in out


@pytest.mark.parametrize(
    "args", [["--agent", "nope"], ["--agent", "00000000-0000-4000-8000-000000000000"], ["--days", "0"]]
)
def test_cost_report_refuses_bad_arguments(args):
    with pytest.raises(CommandError):
        call_command("cost_report", *args)
