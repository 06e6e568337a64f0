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
from sessions_app.maintenance import maintenance_pass
from sessions_app.metering import session_hours_bill
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus
from sessions_app.services import agent_delete, session_delete, session_expire
from tests.conftest import Actor, beat, managed_agent, on_own_connection, run_queued_tasks

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


ENDERS = {
    "session deleted": (lambda session, now: session_delete(session=session, now=now), "session_deleted"),
    "agent deleted": (lambda session, now: agent_delete(agent=session.agent, now=now), "agent_deleted"),
    "session expired": (lambda session, now: session_expire(session=session, now=now), "session_ended"),
}


@pytest.mark.parametrize("moment", ["as its task arrives", "as its time is read"])
@pytest.mark.parametrize("ender", list(ENDERS))
def test_a_session_ended_while_a_turn_runs_has_every_remote_second_billed_once(company, fake_managed, ender, moment):
    """An operator ends the session (its own connection) while the heartbeat's turn is on
    its remote session: as the fake receives the task, or once the turn is over there and
    the worker reads the session's total. The end bills the row's time up to it; the turn's
    own time, measured by the provider after the end, has no live row to go to and is billed
    once all the same, to the agent's company (before: a deleted row's turn was never billed)."""
    agent = managed_agent(company)
    fake_managed.active_seconds_per_turn = 40.0
    assert beat(agent, "one").status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    remote = session.managed_session_id
    fake_managed.active_seconds_per_turn = 25.5
    end, code = ENDERS[ender]
    ended = []
    end_now = on_own_connection(lambda: ended.append(end(session, timezone.now())))
    if moment == "as its task arrives":
        fake_managed.before_next("POST", f"/v1/sessions/{remote}/events", end_now)
    else:  # the stream was opened before the task went: the next read of the session is its total
        fake_managed.before_next(
            "POST",
            f"/v1/sessions/{remote}/events",
            lambda: fake_managed.before_next("GET", f"/v1/sessions/{remote}", end_now),
        )

    during = beat(agent, "two")

    assert len(ended) == 1
    assert (during.status, during.error_code, during.runtime_report) == (RunStatus.FAILED, code, None)
    assert fake_managed.sessions[remote]["usage"]["active_seconds"] == 40.0 + 25.5
    maintenance_pass(now=timezone.now())  # what a later step bills (an ended row's time)
    run_queued_tasks()
    rate = session_hour_rate()
    hours = CostEvent.objects.filter(kind=CostKind.SESSION_HOURS)
    assert sorted(hours.values_list("cost_usd", flat=True)) == sorted(
        [session_hours_cost(40.0, rate=rate), session_hours_cost(25.5, rate=rate)]
    )
    assert set(hours.values_list("company_id", "agent_id")) == {(company.pk, agent.pk)}
    assert not AgentSession.objects.filter(unbilled_active_seconds__gt=0).exists()


def test_a_first_turn_whose_session_row_is_never_made_has_its_remote_time_billed_once(company, fake_managed):
    """The agent is deleted (its own connection) as the fake receives its first task: the
    commit that would make the session row fails `agent_deleted`, and the turn's time, which
    no row will ever hold, is billed at once (before: nobody billed it)."""
    agent = managed_agent(company)
    fake_managed.active_seconds_per_turn = 25.5
    fake_managed.before_next(
        "POST", "/v1/sessions/", on_own_connection(lambda: agent_delete(agent=agent, now=timezone.now()))
    )

    run = beat(agent, "one")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "agent_deleted")
    assert not AgentSession.objects.exists()
    (remote,) = fake_managed.sessions.values()
    assert remote["usage"]["active_seconds"] == 25.5
    (hours,) = CostEvent.objects.filter(kind=CostKind.SESSION_HOURS)
    assert (hours.company_id, hours.agent_id, hours.session_id) == (company.pk, agent.pk, None)
    assert hours.cost_usd == session_hours_cost(25.5, rate=session_hour_rate())


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
    # The row is written before the hold shrinks by it, never after: a budget read between
    # the two counts the request twice, never not at all.
    during = HeartbeatRun.objects.get(agent=agent)
    assert during.reserved_usd + billed.cost_usd >= Decimal("7.5")
    while during.reserved_usd == Decimal("7.5"):
        assert time.monotonic() < deadline, "the hold never shrank by the request billed"
        time.sleep(0.02)
        during.refresh_from_db()
    assert during.reserved_usd == Decimal("7.5") - billed.cost_usd  # the rest of the cap, still held

    run = heartbeat.result()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.reserved_usd == 0
    rows = CostEvent.objects.filter(run_id=run.id, kind=CostKind.MESSAGE)
    assert run.cost_usd == sum((row.cost_usd for row in rows), Decimal(0)) > billed.cost_usd
