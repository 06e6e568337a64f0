"""django-q2 task entry points: a scheduled tick on a busy agent merges into its run."""

from __future__ import annotations

import threading
import time

import pytest
from django.utils import timezone

from sessions_app import run_queue
from sessions_app.models import HeartbeatRun, RunStatus
from sessions_app.run_queue import heartbeat_enqueue
from sessions_app.tasks import scheduled_heartbeat
from tests.conftest import on_own_connection
from tests.fake_anthropic import Reply


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


@pytest.mark.django_db(transaction=True)
def test_two_ticks_of_an_idle_agent_at_once_queue_one_run(persistent_agent, fake_anthropic, monkeypatch):
    """The second tick arrives at the worst moment: the first has found nothing to merge
    into and has not inserted its run yet. It waits for the first's enqueue to commit and
    counts itself on that run (kept unfinished, by a model that answers only once the
    second tick is done, so that nothing but the queue lock decides)."""
    real_merge = run_queue.tick_merge
    second = []

    def first_finds_nothing_then_the_second_arrives(**kwargs):
        found = real_merge(**kwargs)
        if not second:
            other = threading.Thread(
                target=on_own_connection(lambda: second.append(scheduled_heartbeat(str(persistent_agent.id))))
            )
            second.append(other)
            other.start()
            other.join(timeout=1)  # it cannot finish while this enqueue holds the agent's queue
        return found

    monkeypatch.setattr(run_queue, "tick_merge", first_finds_nothing_then_the_second_arrives)
    fake_anthropic.push(Reply(before=lambda: second[0].join(timeout=30)))

    first = scheduled_heartbeat(str(persistent_agent.id))

    (run,) = HeartbeatRun.objects.filter(agent=persistent_agent)
    assert first == RunStatus.SUCCEEDED
    assert second[1] == f"merged into run {run.id}"
    assert run.merged_ticks == 1
