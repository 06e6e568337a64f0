"""The daily rollup (cost_days) equals the ledger summed per UTC day, company, agent, model
and kind, whatever wrote, moved or removed the ledger's rows, and however many did at once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import defaultdict
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.db.migrations.executor import MigrationExecutor

from costs_app.ledger import cost_event_record, run_calls_join_session, session_hours_record
from costs_app.models import CostDay, CostEvent, CostKind
from costs_app.reports import daily_costs, month_to_date
from sessions_app.metering import session_hours_bill
from sessions_app.models import Agent, AgentSession, HeartbeatRun, SessionStatus
from tests.conftest import ROOT, Actor, database_environment, wait_until_blocked

pytestmark = pytest.mark.django_db

SUMMED = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_creation_5m_input_tokens",
    "cache_creation_1h_input_tokens",
    "cache_read_input_tokens",
    "session_seconds",
    "cost_usd",
)
NOW = datetime(2026, 11, 15, 12, 0, tzinfo=UTC)
USAGE = {
    "input_tokens": 1200,
    "output_tokens": 300,
    "cache_read_input_tokens": 5000,
    "cache_creation": {"ephemeral_5m_input_tokens": 700, "ephemeral_1h_input_tokens": 90},
    "cache_creation_input_tokens": 790,
}


def ledger_by_day() -> dict:
    """The ledger grouped in Python, from its rows as the ORM reads them: the UTC day of
    each row's created_at, and the sums the rollup keeps."""
    totals: dict = defaultdict(lambda: {**dict.fromkeys(SUMMED, 0), "cost_usd": Decimal(0), "events": 0})
    for event in CostEvent.objects.all():
        key = (event.created_at.astimezone(UTC).date(), event.company_id, event.agent_id, event.model, event.kind)
        for column in SUMMED:
            totals[key][column] += getattr(event, column)
        totals[key]["events"] += 1
    return dict(totals)


def rollup() -> dict:
    return {
        (row.day, row.company_id, row.agent_id, row.model, row.kind): {
            **{column: getattr(row, column) for column in SUMMED},
            "events": row.events,
        }
        for row in CostDay.objects.all()
    }


def assert_rollup_is_the_ledger() -> None:
    expected = ledger_by_day()
    assert expected, "the test wrote no ledger rows"
    assert rollup() == expected


def call(agent, *, at=NOW, model="claude-opus-4-5", usage=USAGE, **fields) -> CostEvent:
    return cost_event_record(usage=usage, model=model, company_id=agent.company_id, agent_id=agent.id, at=at, **fields)


def test_every_kind_of_ledger_row_is_in_its_days_total(stateless_agent, persistent_agent, other_agent):
    session = AgentSession.objects.create(agent=persistent_agent, company=persistent_agent.company)
    call(stateless_agent)
    call(stateless_agent, usage={"input_tokens": 7, "output_tokens": 1})
    call(stateless_agent, model="claude-haiku-4-5")
    call(stateless_agent, kind=CostKind.COMPACTION)
    call(persistent_agent, session_id=session.id, kind=CostKind.COUNT_TOKENS, usage={"input_tokens": 12})
    call(other_agent, model="claude-haiku-4-5")
    session_hours_record(
        company_id=persistent_agent.company_id,
        agent_id=persistent_agent.id,
        session_id=session.id,
        seconds=1800,
        cost=Decimal("0.04"),
        at=NOW,
    )

    assert_rollup_is_the_ledger()
    # One total per key: the two message calls on opus share one.
    assert CostDay.objects.count() == 6
    assert CostDay.objects.get(agent_id=stateless_agent.id, model="claude-opus-4-5", kind="message").events == 2


def zone(hours: int) -> timezone:
    return timezone(timedelta(hours=hours))


@pytest.mark.parametrize(
    ("at", "day"),
    [
        (datetime(2026, 11, 14, 23, 59, 59, 999_999, tzinfo=UTC), "2026-11-14"),
        (datetime(2026, 11, 15, 0, 0, tzinfo=UTC), "2026-11-15"),
        # Given in another zone: its UTC day, not the local one.
        (datetime(2026, 11, 15, 8, 30, tzinfo=zone(+14)), "2026-11-14"),
        (datetime(2026, 11, 14, 19, 0, tzinfo=zone(-5)), "2026-11-15"),
    ],
)
def test_a_row_counts_on_its_utc_day(stateless_agent, at, day):
    call(stateless_agent, at=at)
    assert [row.day.isoformat() for row in CostDay.objects.all()] == [day]
    assert_rollup_is_the_ledger()


@pytest.mark.parametrize("session_zone", ["Pacific/Kiritimati", "America/Los_Angeles"])
def test_the_day_is_utc_whatever_the_connections_time_zone(postgres_only, stateless_agent, session_zone):
    # A connection in another zone (psql, a monitoring job): the rollup still keys on UTC days.
    late = datetime(2026, 11, 14, 23, 30, tzinfo=UTC)
    with connection.cursor() as cursor:
        cursor.execute(f"SET TIME ZONE '{session_zone}'")
        try:
            call(stateless_agent, at=late)
            cursor.execute(
                "INSERT INTO cost_events (kind, company_id, agent_id, model, input_tokens, output_tokens, "
                "cache_creation_input_tokens, cache_creation_5m_input_tokens, cache_creation_1h_input_tokens, "
                "cache_read_input_tokens, session_seconds, cost_usd, unpriced, price_source, delivery) "
                "VALUES ('message', %s, %s, 'claude-opus-4-5', 5, 1, 0, 0, 0, 0, 0, 0.5, false, '', 'direct')",
                [stateless_agent.company_id, stateless_agent.id],
            )
        finally:
            cursor.execute("SET TIME ZONE 'UTC'")
    [late_day, today] = CostDay.objects.order_by("day")
    assert late_day.day.isoformat() == "2026-11-14" and late_day.events == 1
    # The database's default created_at (now()) on the UTC day it is now.
    assert today.day == datetime.now(UTC).date() and today.cost_usd == Decimal("0.5")
    assert_rollup_is_the_ledger()


def test_reports_read_the_rollup_on_the_same_utc_days_as_the_ledger(stateless_agent, persistent_agent):
    # Window edges: the first day of a 2-day window, the day before it, a month's first instant.
    now = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    call(stateless_agent, at=datetime(2026, 11, 29, 23, 59, 59, tzinfo=UTC))  # outside both
    call(stateless_agent, at=datetime(2026, 11, 30, 0, 0, tzinfo=UTC))  # in the window, last month
    call(stateless_agent, at=datetime(2026, 12, 1, 0, 0, tzinfo=UTC))
    call(persistent_agent, at=datetime(2026, 12, 1, 9, 59, tzinfo=UTC), model="claude-haiku-4-5")

    days = daily_costs(company_id=stateless_agent.company_id, now=now, days=2)
    assert [(row["day"].isoformat(), row["events"]) for row in days] == [("2026-12-01", 2), ("2026-11-30", 1)]
    mine = daily_costs(company_id=stateless_agent.company_id, now=now, days=2, agent_id=stateless_agent.id)
    assert [(row["day"].isoformat(), row["events"]) for row in mine] == [("2026-12-01", 1), ("2026-11-30", 1)]
    expected = CostEvent.objects.get(agent_id=stateless_agent.id, created_at=datetime(2026, 12, 1, tzinfo=UTC))
    assert mine[0]["cost_usd"] == expected.cost_usd and mine[0]["input_tokens"] == expected.input_tokens
    month = month_to_date(company_id=stateless_agent.company_id, now=now)
    assert {(row["agent_id"], row["model"], row["events"]) for row in month} == {
        (stateless_agent.id, "claude-opus-4-5", 1),
        (persistent_agent.id, "claude-haiku-4-5", 1),
    }


def test_a_run_joining_its_session_moves_no_total(persistent_agent):
    run = HeartbeatRun.objects.create(company=persistent_agent.company, agent=persistent_agent, task="t")
    for number in (1, 2):
        call(persistent_agent, run_id=run.id, call_number=number)
    before = rollup()
    session = AgentSession.objects.create(agent=persistent_agent, company=persistent_agent.company)

    assert run_calls_join_session(run_id=run.id, session_id=session.id) == 2

    assert rollup() == before
    assert_rollup_is_the_ledger()


def test_an_updated_row_moves_between_totals_and_an_emptied_total_is_removed(stateless_agent, persistent_agent):
    first = call(stateless_agent)
    call(stateless_agent)
    moved = call(persistent_agent, at=NOW - timedelta(days=1))

    CostEvent.objects.filter(pk=first.pk).update(cost_usd=Decimal("1.2345678901"), output_tokens=1)
    assert_rollup_is_the_ledger()
    # Another day, agent and model at once: its old total had only it, so it is gone.
    CostEvent.objects.filter(pk=moved.pk).update(
        created_at=NOW + timedelta(days=1), agent_id=stateless_agent.id, model="claude-haiku-4-5"
    )
    assert_rollup_is_the_ledger()
    assert not CostDay.objects.filter(agent_id=persistent_agent.id).exists()
    first.delete()
    assert_rollup_is_the_ledger()


def test_deleting_and_bulk_writing_many_rows(stateless_agent, persistent_agent):
    rows = [
        CostEvent(
            company_id=agent.company_id,
            agent_id=agent.id,
            model=model,
            input_tokens=i,
            output_tokens=2 * i,
            cost_usd=Decimal(i) / 7,
            created_at=NOW - timedelta(hours=5 * i),
        )
        for i in range(60)
        for agent in (stateless_agent, persistent_agent)
        for model in ("claude-opus-4-5", "claude-haiku-4-5")
    ]
    CostEvent.objects.bulk_create(rows)
    assert_rollup_is_the_ledger()
    CostEvent.objects.filter(agent_id=persistent_agent.id, created_at__lt=NOW - timedelta(days=3)).delete()
    assert_rollup_is_the_ledger()
    CostEvent.objects.all().delete()
    assert not CostDay.objects.exists()


def test_a_ledger_write_rolled_back_leaves_no_total(stateless_agent):
    call(stateless_agent)
    before = rollup()
    with pytest.raises(RuntimeError), transaction.atomic():
        call(stateless_agent)
        call(stateless_agent, model="claude-haiku-4-5")
        raise RuntimeError("the caller's transaction fails after billing")
    assert rollup() == before
    assert_rollup_is_the_ledger()


def test_a_refused_duplicate_of_a_call_adds_nothing(stateless_agent):
    run = HeartbeatRun.objects.create(company=stateless_agent.company, agent=stateless_agent, task="t")
    call(stateless_agent, run_id=run.id, call_number=1)
    call(stateless_agent, run_id=run.id, call_number=1)
    assert CostDay.objects.get().events == 1
    assert_rollup_is_the_ledger()


@pytest.mark.django_db(transaction=True)
def test_the_migration_sums_the_ledger_it_finds(stateless_agent, persistent_agent):
    executor = MigrationExecutor(connection)
    # Back to the migration before the rollup's: cost_days and its triggers gone.
    [before] = [
        parent
        for parent in executor.loader.graph.node_map[("costs_app", "0014_daily_rollup")].parents
        if parent.key[0] == "costs_app"
    ]
    executor.migrate([before.key])
    try:
        # Rows written before the rollup existed: no trigger saw them.
        with connection.cursor() as cursor:
            for agent, at, cost in (
                (stateless_agent, "2026-11-14 23:59:59", "0.25"),
                (stateless_agent, "2026-11-15 00:00:00", "0.5"),
                (stateless_agent, "2026-11-15 09:00:00", "0.125"),
                (persistent_agent, "2026-11-15 09:00:00", "4"),
            ):
                cursor.execute(
                    "INSERT INTO cost_events (kind, company_id, agent_id, model, input_tokens, output_tokens, "
                    "cache_creation_input_tokens, cache_creation_5m_input_tokens, cache_creation_1h_input_tokens, "
                    "cache_read_input_tokens, session_seconds, cost_usd, unpriced, price_source, delivery, "
                    "created_at) VALUES ('message', %s, %s, 'claude-opus-4-5', 10, 2, 3, 2, 1, 40, 0, %s, "
                    "false, '', 'direct', %s)",
                    [
                        stateless_agent.company_id.hex if connection.vendor == "sqlite" else stateless_agent.company_id,
                        agent.id.hex if connection.vendor == "sqlite" else agent.id,
                        cost,
                        f"{at}+00:00",
                    ],
                )
    finally:
        MigrationExecutor(connection).migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())
    assert_rollup_is_the_ledger()
    assert CostDay.objects.count() == 3
    # And the triggers now keep it.
    call(stateless_agent)
    assert_rollup_is_the_ledger()


# Concurrent writers: each on its own connection (threads) or in its own process, all at once.


def writers(*actions) -> list:
    """Run `actions` at once, each in an Actor (its own connection), started together."""
    start = threading.Barrier(len(actions))

    def started(action):
        def run():
            start.wait(timeout=30)
            return action()

        return run

    actors = [Actor(started(action)) for action in actions]
    for actor in actors:
        actor.start()
    return [actor.result(timeout=120) for actor in actors]


@pytest.mark.django_db(transaction=True)
def test_a_writer_of_a_total_another_holds_waits_and_adds_to_it(stateless_agent):
    call(stateless_agent)
    with transaction.atomic():
        call(stateless_agent)  # its total locked until this commits
        second = Actor(lambda: call(stateless_agent))
        second.start()
        wait_until_blocked(second)
        call(stateless_agent, model="claude-haiku-4-5")
    second.result()
    assert CostDay.objects.get(model="claude-opus-4-5").events == 3
    assert_rollup_is_the_ledger()


@pytest.mark.django_db(transaction=True)
def test_a_writer_waiting_on_a_total_whose_writer_rolls_back_adds_only_its_own(stateless_agent):
    with pytest.raises(RuntimeError), transaction.atomic():
        call(stateless_agent)  # the total's first row: inserted, then rolled back
        second = Actor(lambda: call(stateless_agent))
        second.start()
        wait_until_blocked(second)
        raise RuntimeError("rolled back while the other writer waits")
    second.result()
    assert CostDay.objects.get().events == 1
    assert_rollup_is_the_ledger()


@pytest.mark.django_db(transaction=True)
def test_concurrent_ledger_writes_on_every_path_keep_the_rollup_exact(postgres_only, settings, company):
    settings.PAPERCLIP_SESSION_HOUR_USD = Decimal("0.08")
    agents = [Agent.objects.create(company=company, name=f"a{i}") for i in range(3)]
    # Ended ones: an agent has one live session at most, and ended sessions' time is billed too.
    sessions = [
        AgentSession.objects.create(agent=agent, company=company, status=SessionStatus.ENDED)
        for agent in agents
        for _ in range(4)
    ]
    runs = [HeartbeatRun.objects.create(company=company, agent=agent, task="t") for agent in agents for _ in range(4)]
    day_edge = datetime(2026, 11, 14, 23, 59, 59, 999_999, tzinfo=UTC)

    def billing(run):
        # A run's calls as they return (one statement each), half on each side of midnight.
        agent = next(a for a in agents if a.id == run.agent_id)
        for number in range(1, 41):
            at = day_edge + timedelta(microseconds=number % 2)
            call(
                agent,
                run_id=run.id,
                call_number=number,
                at=at,
                model=("claude-opus-4-5", "claude-haiku-4-5")[number % 2],
            )
            if number % 10 == 0:
                call(agent, run_id=run.id, call_number=number, at=at)  # a retried write, refused

    def joining(run):
        # The run's calls billed before its session existed, then given it in the session's commit.
        agent = next(a for a in agents if a.id == run.agent_id)
        for number in range(1, 21):
            call(agent, run_id=run.id, call_number=number)
        session = AgentSession.objects.create(agent=agent, company=company, status=SessionStatus.ENDED)
        with transaction.atomic():
            run_calls_join_session(run_id=run.id, session_id=session.id)

    def metering(session_ids):
        # Each session's active time billed in one transaction (metering.session_hours_bill).
        for _ in range(10):
            AgentSession.objects.filter(id__in=session_ids).update(unbilled_active_seconds=900)
            session_hours_bill(session_ids=session_ids, now=NOW)

    def bulk(order):
        # One statement writing many totals (every agent, both days), in either order.
        for _ in range(10):
            CostEvent.objects.bulk_create(
                [
                    CostEvent(
                        company=company, agent=agent, model="bulk", cost_usd=Decimal("0.0000000001"), created_at=at
                    )
                    for agent in agents[::order]
                    for at in (day_edge, day_edge + timedelta(microseconds=1))[::order]
                ]
            )

    def pruning():
        for _ in range(10):
            CostEvent.objects.filter(model="bulk", created_at__gt=day_edge).delete()

    by_agent = sorted(sessions, key=lambda s: s.agent_id)
    writers(
        *(lambda run=run: billing(run) for run in runs[:6]),
        *(lambda run=run: joining(run) for run in runs[6:]),
        lambda: metering([s.id for s in by_agent[:6]]),
        lambda: metering([s.id for s in by_agent[6:]]),
        lambda: bulk(1),
        lambda: bulk(-1),
        pruning,
    )

    assert_rollup_is_the_ledger()
    assert CostEvent.objects.filter(kind=CostKind.SESSION_HOURS).count() == 120
    assert CostEvent.objects.filter(run_id__in=[run.id for run in runs[:6]]).count() == 6 * 40
    assert CostEvent.objects.filter(session_id__isnull=False, kind=CostKind.MESSAGE).count() == 6 * 20


WRITER = """
import sys, uuid
from datetime import UTC, datetime, timedelta
import django
django.setup()
from costs_app.ledger import cost_event_record
company_id, agent_id, rows = uuid.UUID(sys.argv[1]), uuid.UUID(sys.argv[2]), int(sys.argv[3])
edge = datetime(2026, 11, 14, 23, 59, 59, 999_999, tzinfo=UTC)
for i in range(rows):
    cost_event_record(
        usage={"input_tokens": 1000 + i, "output_tokens": i, "cache_read_input_tokens": 3 * i},
        model="claude-opus-4-5", company_id=company_id, agent_id=agent_id, at=edge + timedelta(microseconds=i % 2),
    )
"""


@pytest.mark.django_db(transaction=True)
def test_ledger_writers_in_processes_of_their_own_keep_the_rollup_exact(postgres_only, settings, stateless_agent):
    environment = {**os.environ, **database_environment(settings), "DJANGO_SETTINGS_MODULE": "paperclip.settings"}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(stateless_agent.company_id), str(stateless_agent.id), "150"],
            cwd=ROOT,
            env=environment,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    for worker in workers:
        _, errors = worker.communicate(timeout=120)
        assert worker.returncode == 0, errors.decode()[-2000:]

    assert CostEvent.objects.count() == 600
    assert sorted(row.events for row in CostDay.objects.all()) == [300, 300]
    assert_rollup_is_the_ledger()
