"""django-q2 task entry points: a scheduled tick on a busy agent merges into its run."""

from __future__ import annotations

import time

import pytest
from django.db import connection
from django.utils import timezone

from sessions_app import run_queue
from sessions_app.models import Agent, HeartbeatRun, RunStatus
from sessions_app.run_queue import heartbeat_enqueue
from sessions_app.services import agents_hard_delete
from sessions_app.tasks import execute_run, scheduled_heartbeat
from tests.conftest import Actor, wait_until_blocked
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
    into and has not inserted its run yet. It waits for the first's enqueue to commit (seen
    waiting for the agent's queue lock before the first goes on) and counts itself on that
    run (kept unfinished, by a model that answers only once the second tick is done, so
    that nothing but the queue lock decides)."""
    real_merge = run_queue.tick_merge
    second = []

    def first_finds_nothing_then_the_second_arrives(**kwargs):
        found = real_merge(**kwargs)
        if not second:
            other = Actor(lambda: scheduled_heartbeat(str(persistent_agent.id)))
            second.append(other)
            other.start()
            wait_until_blocked(other)  # it cannot go on while this enqueue holds the agent's queue
        return found

    monkeypatch.setattr(run_queue, "tick_merge", first_finds_nothing_then_the_second_arrives)
    fake_anthropic.push(Reply(before=lambda: second[0].join(timeout=30)))

    first = scheduled_heartbeat(str(persistent_agent.id))

    (run,) = HeartbeatRun.objects.filter(agent=persistent_agent)
    assert first == RunStatus.SUCCEEDED
    assert second[0].result() == f"merged into run {run.id}"
    assert run.merged_ticks == 1


@pytest.mark.django_db(transaction=True)
def test_a_run_that_finishes_while_a_tick_counts_itself_on_it_is_not_counted(persistent_agent):
    """Worst moment: the tick has read the agent's running run and is about to count itself
    on it when another worker ends that run. On PostgreSQL the end commits in between: the
    count re-checks the status, so the tick is not counted on a finished run and queues a
    run of its own. On SQLite nothing can commit in between (the enqueue's IMMEDIATE
    transaction keeps every other writer out): the end waits, and the tick counts on a run
    that was still running."""
    from sessions_app.models import RunTrigger
    from sessions_app.run_queue import run_fail

    now = timezone.now()
    busy, _ = heartbeat_enqueue(agent=persistent_agent, task="busy", now=now)
    HeartbeatRun.objects.filter(id=busy.id).update(status=RunStatus.RUNNING, started_at=now)
    ender = Actor(
        lambda: run_fail(HeartbeatRun.objects.get(id=busy.id), code="run_timeout", message="reaped", now=timezone.now())
    )

    def end_the_run_before_the_count(execute, sql, params, many, context):
        if sql.lstrip().upper().startswith("UPDATE") and "merged_ticks" in sql and not ender.is_alive():
            if ender.ident is None:
                ender.start()
                if connection.vendor == "postgresql":
                    ender.result()  # committed before the count
                else:
                    wait_until_blocked(ender)  # held out by the tick's transaction
        return execute(sql, params, many, context)

    with connection.execute_wrapper(end_the_run_before_the_count):
        run, created = heartbeat_enqueue(
            agent=persistent_agent, task="tick", now=now, trigger=RunTrigger.SCHEDULE, merge=True
        )
    ender.result()

    assert ender.ident is not None, "the race was not staged"
    busy.refresh_from_db()
    assert busy.status == RunStatus.FAILED
    if connection.vendor == "postgresql":
        assert created and run.id != busy.id and run.status == RunStatus.QUEUED
        assert busy.merged_ticks == 0
    else:
        assert (created, run.id, busy.merged_ticks) == (False, busy.id, 1)


def test_a_queued_run_whose_agent_was_removed_entirely_is_skipped_not_a_failed_task(persistent_agent, fake_anthropic):
    run, _ = heartbeat_enqueue(agent=persistent_agent, task="go", now=timezone.now())
    agents_hard_delete(agents=Agent.objects.filter(pk=persistent_agent.pk), now=timezone.now())

    assert execute_run(str(run.id)) == "skipped: agent_deleted"
    assert fake_anthropic.message_requests == []
