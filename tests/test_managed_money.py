"""Money on Managed Agents, through the real SDK against the fake: the service's own list
cost beside the ledger's (a disagreement logged and shown on the run), session hours as
each run's own share of the remote measure, a budget's hold while the turn runs."""

from __future__ import annotations

import logging
import time
from decimal import Decimal

import pytest
from django.utils import timezone

from costs_app.models import Budget, CostEvent, CostKind
from costs_app.pricing import call_price, session_hour_rate, session_hours_cost
from sessions_app.metering import session_hours_bill
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus
from tests.conftest import Actor, beat, managed_agent

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "claude-sonnet-4-5"  # managed_agent's
# A turn of dollars: the service's whole cents are then well inside 1%. Each request stays
# under the model's long-context tier, so one price per token holds.
USAGE = {"input_tokens": 150_000, "output_tokens": 40_000, "cache_read_input_tokens": 40_000}
PRICED_KEYS = {
    "input": "input_tokens",
    "output": "output_tokens",
    "cache_read": "cache_read_input_tokens",
    "cache_write": "cache_creation_input_tokens",
}


def our_list_price(*, scale: Decimal = Decimal(1)) -> dict[str, Decimal]:
    """The price data's own per-token prices of the model (times `scale`), for the fake to
    price its sessions' list cost with."""
    tokens = 10_000
    prices = {}
    for kind, key in PRICED_KEYS.items():
        usage = {"input_tokens": 0, "output_tokens": 0, key: tokens}
        prices[kind] = call_price(usage=usage, model=MODEL, at=timezone.now()).cost_usd * scale / tokens
    return prices


@pytest.mark.parametrize("mode", ["persistent", "stateless"])
def test_a_list_cost_that_agrees_with_the_ledger_is_kept_beside_it_and_flags_nothing(company, fake_managed, mode):
    agent = managed_agent(company, session_mode=mode)
    fake_managed.list_price = our_list_price()
    fake_managed.script(None, [("message", "one", USAGE), ("message", "two", USAGE)])

    run = beat(agent, "work")

    assert run.status == RunStatus.SUCCEEDED, run.error
    run.refresh_from_db()
    assert run.cost_usd > 2
    report = run.runtime_report
    assert abs(Decimal(report["list_cost_turn_usd"]) - Decimal(report["ledger_cost_usd"])) <= Decimal("0.01")
    assert Decimal(report["ledger_cost_usd"]) == run.cost_usd
    assert run.warning == ""


@pytest.mark.parametrize("mode", ["persistent", "persistent, resumed", "stateless"])
def test_a_list_cost_more_than_one_percent_off_is_logged_and_shown_on_the_run(company, fake_managed, caplog, mode):
    """A resumed turn's commit is the plain turn's (one statement on PostgreSQL): the
    check is made before it, as for a turn that opened its remote session."""
    agent = managed_agent(company, session_mode=mode.split(",")[0])
    if mode == "persistent, resumed":
        fake_managed.list_price = our_list_price()
        fake_managed.script(None, [("message", "zero", USAGE)])
        assert beat(agent, "first").warning == ""
    fake_managed.list_price = our_list_price(scale=Decimal("1.02"))
    fake_managed.script(None, [("message", "one", USAGE)])

    with caplog.at_level(logging.WARNING, logger="sessions_app.managed_sessions"):
        run = beat(agent, "work")

    assert run.status == RunStatus.SUCCEEDED, run.error
    run.refresh_from_db()
    theirs = run.runtime_report["list_cost_turn_usd"]
    assert f"reported a list cost of ${theirs} for this turn; the ledger priced it at ${run.cost_usd}" in run.warning
    assert any(theirs in record.getMessage() for record in caplog.records)


def test_a_disagreement_joins_a_warning_the_run_already_has(company, fake_managed):
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("6"), warn_percent=50)
    agent = managed_agent(company, max_budget_usd=5)  # its hold passes the budget's 50% mark
    fake_managed.list_price = our_list_price(scale=Decimal(2))
    fake_managed.script(None, [("message", "one", USAGE)])

    run = beat(agent, "work")

    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    first, second = run.warning.split("; the session reported")
    assert first and second


def test_session_hours_are_each_runs_share_of_the_remote_measure(company, fake_managed):
    agent = managed_agent(company)
    fake_managed.active_seconds_per_turn = 40.0
    first = beat(agent, "one")
    fake_managed.active_seconds_per_turn = 25.5
    second = beat(agent, "two")

    assert [first.runtime_report["active_seconds"], second.runtime_report["active_seconds"]] == [40.0, 25.5]
    session = AgentSession.objects.get(agent=agent)
    (remote,) = fake_managed.sessions.values()
    assert session.unbilled_active_seconds == remote["usage"]["active_seconds"] == 65.5
    assert session_hours_bill(session_ids=[session.pk], now=timezone.now()) == 1
    (hours,) = CostEvent.objects.filter(agent=agent, kind=CostKind.SESSION_HOURS)
    assert hours.session_seconds == 66  # the row shows whole seconds; the price is of the exact time
    assert hours.cost_usd == session_hours_cost(65.5, rate=session_hour_rate())


def test_a_budgeted_turn_holds_its_cap_less_what_it_has_billed_and_releases_the_rest(company, fake_managed):
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("100"))
    agent = managed_agent(company, max_budget_usd=7.5)
    fake_managed.script(None, [("message", "one", USAGE), ("sleep", 1.0), ("message", "two", USAGE)])
    heartbeat = Actor(lambda: beat(agent, "work"))
    heartbeat.start()

    deadline = time.monotonic() + 30
    while not CostEvent.objects.filter(agent=agent, kind=CostKind.MESSAGE).exists():
        assert time.monotonic() < deadline, "the first request was never billed"
        time.sleep(0.02)
    (billed,) = CostEvent.objects.filter(agent=agent, kind=CostKind.MESSAGE)
    during = HeartbeatRun.objects.get(agent=agent)
    assert during.reserved_usd == Decimal("7.5") - billed.cost_usd  # the rest of the cap, still held

    run = heartbeat.result()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.reserved_usd == 0
    rows = CostEvent.objects.filter(run_id=run.id, kind=CostKind.MESSAGE)
    assert run.cost_usd == sum((row.cost_usd for row in rows), Decimal(0)) > billed.cost_usd
