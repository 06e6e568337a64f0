"""Agent health (sessions_app/agent_health.py): ok, late, down, failing, a pure function of
stored fields and a frozen `now`; each change across up and down alerted once, signed."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from costs_app.models import AlertDelivery, AlertEvent, AlertTarget, Budget
from sessions_app.agent_health import (
    HealthFacts,
    agent_health,
    agents_health_check,
    facts_of,
    health_transition,
    with_health_facts,
)
from sessions_app.models import Agent, AgentStatus, HeartbeatRun, RunStatus
from tests.test_alerts import SECRET, run_queued, verified
from tests.webhook_receiver import WebhookReceiver

T = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)


def facts(config: dict, *, since: datetime = T, **fields) -> HealthFacts:
    return HealthFacts(
        status=fields.pop("status", AgentStatus.ACTIVE),
        config=config,
        idle_streak=fields.pop("idle_streak", 0),
        since=since,
        failed_in_a_row=fields.pop("failed_in_a_row", 0),
        **fields,
    )


def state(config: dict, now: datetime, **fields) -> str:
    return agent_health(facts(config, **fields), now=now).state


def test_an_interval_agent_is_late_after_its_interval_and_down_after_the_grace():
    every_15 = {"heartbeat_interval_minutes": 15}
    assert state(every_15, T + timedelta(minutes=14)) == "ok"
    assert state(every_15, T + timedelta(minutes=16)) == "late"
    assert state(every_15, T + timedelta(minutes=30)) == "late"  # the grace: one interval
    assert state(every_15, T + timedelta(minutes=31)) == "down"
    graced = {**every_15, "health_grace_minutes": 60}
    assert state(graced, T + timedelta(minutes=74)) == "late"
    assert state(graced, T + timedelta(minutes=76)) == "down"


def test_the_back_off_stretches_the_expectation():
    config = {"heartbeat_interval_minutes": 15, "backoff_after_runs": 3, "backoff_max_factor": 8}
    # Three idle runs: the interval doubles (30 minutes); the grace stays one interval.
    assert state(config, T + timedelta(minutes=29), idle_streak=3) == "ok"
    assert state(config, T + timedelta(minutes=31), idle_streak=3) == "late"
    assert state(config, T + timedelta(minutes=46), idle_streak=3) == "down"
    # Five: x8 (two hours).
    assert state(config, T + timedelta(minutes=119), idle_streak=5) == "ok"


def test_a_cron_agent_expects_its_next_wake_across_a_change_of_clocks():
    # 02:30 every night in Berlin. On 29 March 2026 the clocks jump from 02:00 to 03:00:
    # that night's wake is at 03:00 CEST (01:00 UTC), and the next at 02:30 CEST (00:30 UTC).
    config = {"heartbeat_cron": "30 2 * * *", "heartbeat_timezone": "Europe/Berlin"}
    since = datetime(2026, 3, 28, 1, 30, tzinfo=UTC)  # 02:30 CET on the 28th
    health = agent_health(facts(config, since=since), now=since + timedelta(hours=1))
    assert (health.state, health.due_at, health.down_at) == (
        "ok",
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
        datetime(2026, 3, 30, 0, 30, tzinfo=UTC),
    )
    assert state(config, datetime(2026, 3, 29, 0, 59, tzinfo=UTC), since=since) == "ok"
    assert state(config, datetime(2026, 3, 29, 1, 1, tzinfo=UTC), since=since) == "late"
    assert state(config, datetime(2026, 3, 30, 0, 31, tzinfo=UTC), since=since) == "down"
    # In autumn the repeated hour: 02:30 runs once, at its first (summer-time) instance.
    autumn = datetime(2026, 10, 24, 0, 30, tzinfo=UTC)  # 02:30 CEST on the 24th
    health = agent_health(facts(config, since=autumn), now=autumn)
    assert health.due_at == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)  # 02:30 CEST
    assert health.down_at == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)  # 02:30 CET: 25 hours later


def test_a_backed_off_cron_agent_expects_every_nth_wake():
    config = {"heartbeat_cron": "0 * * * *", "backoff_after_runs": 1, "backoff_max_factor": 4}
    assert agent_health(facts(config, idle_streak=1), now=T).due_at == T + timedelta(hours=2)


def test_runs_failing_in_a_row_make_an_agent_failing_whatever_its_schedule():
    assert state({}, T, failed_in_a_row=3) == "failing"
    assert state({}, T, failed_in_a_row=2) == "ok"
    assert state({"health_failing_after_runs": 5}, T, failed_in_a_row=4) == "ok"
    assert state({"heartbeat_interval_minutes": 15}, T + timedelta(hours=9), failed_in_a_row=3) == "failing"


def test_paused_agents_and_agents_held_by_a_quota_are_not_late():
    every_15 = {"heartbeat_interval_minutes": 15}
    late = T + timedelta(hours=2)
    assert state(every_15, late) == "down"
    assert state(every_15, late, status=AgentStatus.PAUSED) == "ok"
    assert state(every_15, late, held=True) == "ok"


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (
            {"heartbeat_cron": "0 9 * * 1-5", "heartbeat_timezone": "Nowhere/Gone"},
            "invalid configuration: heartbeat_timezone must be an IANA time zone name such as 'Europe/Berlin' "
            "or 'UTC', got 'Nowhere/Gone'",
        ),
        ({"heartbeat_cron": "0 9 * *"}, "invalid configuration: heartbeat_cron must have 5 fields"),
        ({"heartbeat_interval_minutes": "often"}, "invalid configuration: heartbeat_interval_minutes must be a whole"),
        (
            {"heartbeat_interval_minutes": 15, "backoff_max_factor": "x"},
            "invalid configuration: backoff_max_factor must be a whole number in 1..1024 or null, got 'x'",
        ),
        ({"health_grace_minutes": -5}, "invalid configuration: health_grace_minutes must be a whole number"),
        ([1], "invalid configuration: not a JSON object"),
    ],
    ids=["zone-gone", "cron", "interval", "backoff", "grace", "not-an-object"],
)
def test_an_active_agent_whose_stored_configuration_no_longer_validates_is_down_saying_why(config, reason):
    health = agent_health(facts(config), now=T)
    assert (health.state, health.config_invalid) == ("down", True)
    assert health.reason.startswith(reason), health.reason
    assert health.as_json()["reason"] == health.reason
    # A paused agent is not expected to run, whatever its configuration.
    assert state(config, T, status=AgentStatus.PAUSED) == "ok"


# The facts from the database, and the transitions.


def scheduled_agent(company, **config) -> Agent:
    return Agent.objects.create(
        company=company,
        name="Watched",
        adapter_config={"model": "claude-haiku-4-5", "heartbeat_interval_minutes": 15, **config},
    )


def run(agent: Agent, status: str, at: datetime) -> HeartbeatRun:
    return HeartbeatRun.objects.create(
        company=agent.company, agent=agent, task="t", status=status, created_at=at, finished_at=at
    )


@pytest.mark.django_db
def test_the_facts_are_the_last_successful_run_and_the_failures_since(company, django_assert_num_queries):
    agent = scheduled_agent(company)
    Agent.objects.filter(pk=agent.pk).update(updated_at=T - timedelta(days=1))
    run(agent, RunStatus.FAILED, T - timedelta(hours=3))
    run(agent, RunStatus.SKIPPED, T - timedelta(hours=2))
    for minutes in (10, 20, 30):
        run(agent, RunStatus.FAILED, T - timedelta(minutes=minutes))
    scheduled_agent(company)  # one more agent: still one query
    with django_assert_num_queries(1):
        agents = list(with_health_facts(Agent.objects.order_by("created_at")))
    found = facts_of(agents[0])
    assert (found.since, found.failed_in_a_row) == (T - timedelta(hours=2), 3)
    assert agent_health(found, now=T).state == "failing"


@pytest.mark.django_db
def test_the_maintenance_pass_stores_the_health_of_every_agent_past_one_whose_configuration_is_stale(company):
    healthy = scheduled_agent(company)
    Agent.objects.filter(pk=healthy.pk).update(updated_at=T)
    stale = []
    for config in ({"heartbeat_cron": "0 9 * * *", "heartbeat_timezone": "Nowhere/Gone"}, [1]):
        agent = scheduled_agent(company)
        # As a tzdata upgrade that dropped the zone, or SQL, leaves the row.
        Agent.objects.filter(pk=agent.pk).update(adapter_config=config, updated_at=T)
        stale.append(agent)

    agents_health_check(now=T + timedelta(minutes=5))

    states = dict(Agent.objects.values_list("pk", "health_state"))
    assert (states[healthy.pk], states[stale[0].pk], states[stale[1].pk]) == ("ok", "down", "down")


@pytest.fixture
def receiver():
    server = WebhookReceiver().start()
    yield server
    server.stop()


@pytest.mark.django_db(transaction=True)
def test_each_change_across_up_and_down_is_sent_once_signed(company, receiver):
    agent = scheduled_agent(company)
    Agent.objects.filter(pk=agent.pk).update(updated_at=T)
    budget = Budget.objects.create(company=company, monthly_limit_usd=10)
    AlertTarget.objects.create(budget=budget, url=receiver.url, secret=SECRET, health_events=True)
    AlertTarget.objects.create(budget=budget, url=receiver.url + "-budget-only", secret=SECRET)

    assert agents_health_check(now=T + timedelta(minutes=20)) == 0  # late: stored, not sent
    assert Agent.objects.get(pk=agent.pk).health_state == "late"
    assert agents_health_check(now=T + timedelta(minutes=31)) == 1  # down
    assert agents_health_check(now=T + timedelta(minutes=40)) == 0  # still down: nothing more
    run(agent, RunStatus.SUCCEEDED, T + timedelta(minutes=41))
    assert agents_health_check(now=T + timedelta(minutes=42)) == 1  # up again
    run_queued()
    bodies = [verified(received) for received in receiver.requests]
    assert [(body["type"], body["state"], body["previous"]) for body in bodies] == [
        ("agent_down", "down", "late"),
        ("agent_up", "ok", "down"),
    ]
    assert {body["agent_id"] for body in bodies} == {str(agent.pk)}
    assert len(receiver.requests) == 2  # the target that did not ask got neither


@pytest.mark.django_db(transaction=True)
def test_two_maintenance_passes_at_once_send_one_alert(company):
    agent = scheduled_agent(company)
    Agent.objects.filter(pk=agent.pk).update(updated_at=T)
    budget = Budget.objects.create(company=company, monthly_limit_usd=10)
    AlertTarget.objects.create(budget=budget, url="http://127.0.0.1:9/", secret=SECRET, health_events=True)
    now = T + timedelta(hours=1)
    # Both passes read the agent as `ok`; the other one moves it first.
    read = list(with_health_facts(Agent.objects.filter(pk=agent.pk)))[0]
    health = agent_health(facts_of(read), now=now)
    other = []

    def other_pass():
        try:
            other.append(agents_health_check(now=now))
        finally:
            connection.close()

    thread = threading.Thread(target=other_pass)
    thread.start()
    thread.join(30)
    assert other == [1]
    assert health_transition(agent=read, health=health, now=now) == 0
    assert AlertEvent.objects.filter(kind="agent_down").count() == 1
    assert AlertDelivery.objects.count() == 1
