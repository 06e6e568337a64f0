"""django-q2 task entry points: a scheduled tick on a busy agent merges into its run."""

from __future__ import annotations

import time

from django.utils import timezone

from sessions_app.heartbeat import heartbeat_enqueue
from sessions_app.models import HeartbeatRun, RunStatus
from sessions_app.tasks import scheduled_heartbeat


def test_ticks_on_an_agent_with_a_queued_run_are_counted_on_it_not_queued_again(persistent_agent, fake_anthropic):
    waiting, _ = heartbeat_enqueue(agent=persistent_agent, task="waiting", now=timezone.now())

    assert scheduled_heartbeat(str(persistent_agent.id)) == f"merged into run {waiting.id}"
    assert scheduled_heartbeat(str(persistent_agent.id)) == f"merged into run {waiting.id}"

    assert list(HeartbeatRun.objects.filter(agent=persistent_agent).values_list("id", "merged_ticks")) == [
        (waiting.id, 2)
    ]
    assert fake_anthropic.message_requests == []


def test_a_tick_on_an_agent_with_a_running_run_is_counted_on_it_without_waiting(persistent_agent, fake_anthropic):
    now = timezone.now()
    busy, _ = heartbeat_enqueue(agent=persistent_agent, task="busy", now=now)
    HeartbeatRun.objects.filter(id=busy.id).update(status=RunStatus.RUNNING, started_at=now)

    started = time.monotonic()
    assert scheduled_heartbeat(str(persistent_agent.id)) == f"merged into run {busy.id}"
    assert time.monotonic() - started < 5  # the cluster worker is not held while the agent is busy

    assert list(HeartbeatRun.objects.filter(agent=persistent_agent).values_list("id", "merged_ticks")) == [(busy.id, 1)]
    assert fake_anthropic.message_requests == []


def test_a_tick_on_an_idle_agent_runs_with_nothing_merged(persistent_agent, fake_anthropic):
    assert scheduled_heartbeat(str(persistent_agent.id)) == RunStatus.SUCCEEDED
    (run,) = HeartbeatRun.objects.filter(agent=persistent_agent)
    assert run.merged_ticks == 0


def test_a_tick_held_by_the_cap_on_runs_in_progress_stays_queued_without_waiting(
    settings, persistent_agent, stateless_agent, fake_anthropic
):
    settings.PAPERCLIP_MAX_CONCURRENT_RUNS = 1
    now = timezone.now()
    other, _ = heartbeat_enqueue(agent=stateless_agent, task="busy", now=now)
    HeartbeatRun.objects.filter(id=other.id).update(status=RunStatus.RUNNING, started_at=now)

    started = time.monotonic()
    assert scheduled_heartbeat(str(persistent_agent.id)) == RunStatus.QUEUED
    assert time.monotonic() - started < 5  # the cluster worker is not held while the cap is full
    assert fake_anthropic.message_requests == []
