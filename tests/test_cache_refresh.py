"""Keep-warm end to end (`sessions_app.keep_warm`, `sessions_app.cache_refresh`): after a
heartbeat of a scheduled persistent agent, the maintenance pass sends the refreshes the
arithmetic chose, through the real SDK to the fake Messages API whose prompt cache keeps
its lifetimes on a simulated clock; each is billed as `cache_refresh`, never stored in the
history, never counted as the session's use."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone
from django.utils.module_loading import import_string
from django_q.brokers import get_broker
from django_q.models import Schedule
from django_q.signing import SignedPackage

from costs_app.models import CostEvent, CostKind
from costs_app.pricing import price_table
from sessions_app.cache_refresh import TASK, cache_refreshes_queue, session_cache_refresh
from sessions_app.heartbeat import heartbeat_execute
from sessions_app.keep_warm import keep_warm_decide, keep_warm_report, prefix_tokens_of
from sessions_app.models import Agent, AgentSession, HeartbeatRun, RunStatus, RunTrigger
from sessions_app.run_queue import heartbeat_enqueue
from sessions_app.schedules import agent_schedule_sync, schedule_name
from sessions_app.stores import store_for
from tests.api.conftest import Api, agent_url
from tests.conftest import dequeued
from tests.fake_anthropic import Reply

PROMPT = "You keep the team's release notes. " * 400  # a prefix worth keeping


@pytest.fixture
def clocked(fake_anthropic):
    """The fake with a simulated clock (seconds since the test's start) and that start."""
    clock = [0.0]
    fake_anthropic.clock = lambda: clock[0]
    return fake_anthropic, clock, timezone.now()


def scheduled_agent(company, *, minutes: int, start, **config) -> Agent:
    agent = Agent.objects.create(
        company=company,
        name=f"every {minutes} min",
        system_prompt=PROMPT,
        adapter_type="claude-code",
        adapter_config={
            "model": "claude-opus-4-5",
            "session_mode": "persistent",
            "heartbeat_interval_minutes": minutes,
            **config,
        },
    )
    agent_schedule_sync(agent=agent, now=start)
    Schedule.objects.filter(name=schedule_name(agent.pk)).update(next_run=start + timedelta(minutes=minutes))
    return agent


def wake(agent, *, at, clock, start, task="Write today's notes.") -> HeartbeatRun:
    clock[0] = (at - start).total_seconds()
    run, _ = heartbeat_enqueue(agent=agent, task=task, now=at, trigger=RunTrigger.SCHEDULE)
    run = heartbeat_execute(run_id=run.id, now=at)
    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    return run


def queued_refreshes() -> list[str]:
    """The refreshes the maintenance pass handed to the cluster (dequeued)."""
    broker = get_broker()
    sessions = []
    for ack_id, payload in dequeued(broker):
        task = SignedPackage.loads(payload)
        assert import_string(task["func"]).__module__ == "sessions_app.tasks" and task["func"] == TASK
        sessions.extend(task["args"])
        broker.acknowledge(ack_id)
    return sessions


def maintain_until(*, minutes: int, clock, start) -> list[str]:
    """A maintenance pass every simulated minute up to the wake, each refresh it queues
    sent at that minute; what the refreshes returned."""
    results = []
    for minute in range(1, minutes):
        now = start + timedelta(minutes=minute)
        clock[0] = minute * 60.0
        cache_refreshes_queue(now=now)
        results.extend(session_cache_refresh(session_id=sid, now=now) for sid in queued_refreshes())
    return results


def refresh_rows(agent):
    return CostEvent.objects.filter(agent_id=agent.id, kind=CostKind.CACHE_REFRESH).order_by("created_at")


def test_a_two_hourly_agent_is_kept_warm_and_its_wake_reads_the_prefix_instead_of_writing_it(company, clocked):
    fake, clock, start = clocked
    agent = scheduled_agent(company, minutes=120, start=start, cache_ttl="1h")
    first = wake(agent, at=start, clock=clock, start=start)
    session = AgentSession.objects.get(agent=agent)
    history_before = store_for(session).read(session)
    expires_before = session.expires_at
    decision = session.keep_warm
    assert (decision["refresh"], decision["refreshes"], decision["ttl"]) == (True, 2, "1h")
    # Due a refresh's spacing (the lifetime less its margin) after the commit's end.
    assert timedelta(minutes=55) < session.cache_refresh_at - start < timedelta(minutes=55, seconds=10)

    results = maintain_until(minutes=120, clock=clock, start=start)

    assert [r.split(":")[0] for r in results] == ["refreshed", "refreshed"]
    rows = list(refresh_rows(agent))
    # Each found by the first pass after it fell due, a minute's passes apart.
    assert [int((row.created_at - start).total_seconds() // 60) for row in rows] == [56, 112]
    refreshes = [body for body in fake.message_requests if body.get("max_tokens") == 1]
    assert len(refreshes) == 2
    prefix = usage_of(first).cache_creation_input_tokens  # what the heartbeat cached
    # The first reads what the heartbeat cached, still alive (the fake sizes the replayed
    # task, a string now, a few tokens smaller than the marked block it was sent as), and
    # writes the last answer; the second reads both.
    assert prefix - 10 <= rows[0].cache_read_input_tokens <= prefix
    assert rows[1].cache_read_input_tokens == rows[0].cache_read_input_tokens + rows[0].cache_creation_input_tokens
    for row in rows:
        assert row.session_id == session.pk and row.run.trigger == RunTrigger.CACHE_REFRESH
        assert row.run.status == RunStatus.SUCCEEDED and row.run.cost_usd == row.cost_usd
    # Nothing of the refreshes reached the session: history, turns, use and expiry.
    session.refresh_from_db()
    assert store_for(session).read(session) == history_before
    assert (session.message_count, session.last_used, session.expires_at) == (2, first.finished_at, expires_before)
    assert session.keep_warm["refresh"] is False and session.cache_refresh_at is None

    second = wake(agent, at=start + timedelta(minutes=120), clock=clock, start=start)
    usage = usage_of(second)
    # Everything before the new task was read: the refresh had written the last answer.
    assert usage.cache_read_input_tokens > prefix
    assert usage.cache_creation_input_tokens < fake.tokens("Write today's notes.") + 20
    # What the refreshes saved, from the ledger: that read, which would have been a 1-hour
    # write, at the write price less the read price, less what the refreshes cost.
    rates = price_table(model="claude-opus-4-5", at=start).rates()
    spent = sum(row.cost_usd for row in rows)
    report = keep_warm_report(AgentSession.objects.get(pk=session.pk), at=start)
    expected = usage.cache_read_input_tokens * (rates.cache_write_1h - rates.cache_read) / 1_000_000 - spent
    assert (report["refreshes_sent"], Decimal(report["refreshes_saved_usd"])) == (2, expected)
    assert expected > 0


def usage_of(run: HeartbeatRun) -> CostEvent:
    return CostEvent.objects.get(run=run, kind=CostKind.MESSAGE)


def test_the_same_agent_with_keep_warm_off_writes_its_whole_prefix_again(company, clocked):
    fake, clock, start = clocked
    agent = scheduled_agent(company, minutes=120, start=start, cache_ttl="1h", cache_keep_warm="off")
    first = wake(agent, at=start, clock=clock, start=start)
    assert AgentSession.objects.get(agent=agent).keep_warm is None
    assert maintain_until(minutes=120, clock=clock, start=start) == []
    second = wake(agent, at=start + timedelta(minutes=120), clock=clock, start=start)
    assert usage_of(second).cache_read_input_tokens == 0
    assert usage_of(second).cache_creation_input_tokens > usage_of(first).cache_creation_input_tokens


CADENCES = [5, 10, 15, 30, 45, 61, 90, 120]


@pytest.mark.parametrize("ttl", ["5m", "1h"])
@pytest.mark.parametrize("minutes", CADENCES)
def test_refreshes_are_sent_exactly_when_the_arithmetic_says_they_pay(company, clocked, ttl, minutes):
    fake, clock, start = clocked
    agent = scheduled_agent(company, minutes=minutes, start=start, cache_ttl=ttl)
    first = wake(agent, at=start, clock=clock, start=start)
    rates = price_table(model="claude-opus-4-5", at=start).rates()
    expected = keep_warm_decide(
        prefix_tokens=prefix_tokens_of(usage_dict(usage_of(first))),
        ttl=ttl,
        gap=timedelta(minutes=minutes),
        rates=rates,
    )
    maintain_until(minutes=minutes, clock=clock, start=start)
    sent = refresh_rows(agent).count()
    # Sent when the arithmetic says they pay, never otherwise; at most as many as it counted
    # (a pass finds each a little after it fell due, so the later ones may not be needed).
    assert (sent > 0) == expected.refresh
    assert sent <= expected.refreshes
    assert all(row.cache_read_input_tokens > 0 for row in refresh_rows(agent))  # never sent to a cold cache
    second = wake(agent, at=start + timedelta(minutes=minutes), clock=clock, start=start)
    kept = expected.refresh or expected.refreshes == 0
    assert (usage_of(second).cache_read_input_tokens > 0) == kept


def usage_dict(event: CostEvent) -> dict:
    return {
        "input_tokens": event.input_tokens,
        "cache_read_input_tokens": event.cache_read_input_tokens,
        "cache_creation_input_tokens": event.cache_creation_input_tokens,
    }


def test_a_failed_refresh_fails_its_own_run_only_and_the_next_wake_succeeds(company, clocked):
    fake, clock, start = clocked
    agent = scheduled_agent(company, minutes=120, start=start, cache_ttl="1h")
    wake(agent, at=start, clock=clock, start=start)
    fake.outage = Reply.error(500, "overloaded")
    results = maintain_until(minutes=120, clock=clock, start=start)
    fake.outage = None
    assert results and all(r.startswith("failed:") for r in results[:1])
    failed = HeartbeatRun.objects.get(agent=agent, trigger=RunTrigger.CACHE_REFRESH)
    assert failed.status == RunStatus.FAILED and failed.session_id is None
    session = AgentSession.objects.get(agent=agent)
    assert session.message_count == 2 and session.cache_refresh_at is None  # no refresh after a failure
    wake(agent, at=start + timedelta(minutes=120), clock=clock, start=start)
    assert AgentSession.objects.get(agent=agent).message_count == 4


def test_a_refresh_while_a_heartbeat_runs_is_skipped_and_sends_nothing(company, clocked):
    fake, clock, start = clocked
    agent = scheduled_agent(company, minutes=120, start=start, cache_ttl="1h")
    wake(agent, at=start, clock=clock, start=start)
    session = AgentSession.objects.get(agent=agent)
    run, _ = heartbeat_enqueue(agent=agent, task="Another task.", now=start + timedelta(minutes=50))
    HeartbeatRun.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, started_at=start)
    sent = len(fake.message_requests)
    assert session_cache_refresh(session_id=session.pk, now=start + timedelta(minutes=55)) == "skipped: session_busy"
    assert len(fake.message_requests) == sent and not refresh_rows(agent).exists()


def test_two_maintenance_passes_hand_a_due_refresh_to_the_cluster_once(company, clocked):
    fake, clock, start = clocked
    agent = scheduled_agent(company, minutes=120, start=start, cache_ttl="1h")
    wake(agent, at=start, clock=clock, start=start)
    due = start + timedelta(minutes=56)
    assert (cache_refreshes_queue(now=due), cache_refreshes_queue(now=due)) == (1, 0)
    assert len(queued_refreshes()) == 1


def test_a_two_hourly_agent_caches_for_an_hour_when_kept_warm_and_not_at_all_without(company, clocked):
    """With no lifetime fixed, an agent waking two hours apart used to cache nothing (every
    write expired unread); kept warm, the 1-hour cache pays, and it is chosen."""
    fake, clock, start = clocked
    for keep_warm, cached in (("auto", True), ("off", False)):
        agent = scheduled_agent(company, minutes=120, start=start, cache_keep_warm=keep_warm)
        for n in range(4):  # enough wakes, two hours apart, for the gap to be measured
            at = start + timedelta(minutes=120 * n)
            wake(agent, at=at, clock=clock, start=start, task=f"Notes for day {n}.")
            Schedule.objects.filter(name=schedule_name(agent.pk)).update(next_run=at + timedelta(minutes=120))
        last = fake.message_requests[-1]
        assert ("'ttl': '1h'" in str(last)) == cached, keep_warm


def test_the_session_api_and_the_agent_page_show_the_decision_and_the_refreshes_sent(company, clocked, admin_client):
    fake, clock, start = clocked
    agent = scheduled_agent(company, minutes=120, start=start, cache_ttl="1h")
    wake(agent, at=start, clock=clock, start=start)
    session = AgentSession.objects.get(agent=agent)
    minute = start + timedelta(minutes=56)
    clock[0] = 56 * 60.0
    cache_refreshes_queue(now=minute)
    (queued,) = queued_refreshes()
    session_cache_refresh(session_id=queued, now=minute)
    spent = refresh_rows(agent).get().cost_usd

    shown = Api().get(agent_url(agent, f"/sessions/{session.public_id}")).json()["keep_warm"]
    assert (shown["refresh"], shown["ttl"], shown["refreshes_sent"]) == (True, "1h", 1)
    assert Decimal(shown["refreshes_sent_usd"]) == spent and shown["next_refresh_at"] is not None
    page = admin_client.get(reverse("admin:sessions_app_agent_change", args=[agent.pk])).content.decode()
    assert "refresh before the next wake" in page and f"sent so far 1 (${spent:.4f}, from the ledger)" in page
