"""A Managed Agents turn whose worker dies: the reaper hands it to the next worker, which
continues the same turn from the remote session's events, never sending the task twice and
never billing a request twice (real SDK against the fake, a real worker process killed)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from sessions_app.adapters.claude_code import client_for
from sessions_app.heartbeat import heartbeat_execute
from sessions_app.maintenance import maintenance_pass, runs_reap
from sessions_app.metering import session_hours_bill
from sessions_app.models import AgentSession, HeartbeatRun, ManagedSessionEnd, RunStatus
from sessions_app.services import session_clear_history, session_delete, session_expire
from sessions_app.stores import store_for
from tests.conftest import beat, managed_agent, run_queued_tasks, worker_heartbeat

pytestmark = pytest.mark.django_db(transaction=True)

FIRST = {"input_tokens": 700, "output_tokens": 30}
SECOND = {"input_tokens": 900, "output_tokens": 40}


def killed_after_first_request(agent, settings, task: str) -> HeartbeatRun:
    """Start the heartbeat in a worker process, SIGKILL it once its first request is billed."""
    billed = CostEvent.objects.filter(agent_id=agent.id, kind=CostKind.MESSAGE)
    before = billed.count()
    worker = worker_heartbeat(agent, task, settings)
    deadline = time.monotonic() + 60
    while billed.count() == before:
        assert worker.poll() is None and time.monotonic() < deadline, "the worker ended before it was killed"
        time.sleep(0.02)
    worker.kill()
    worker.wait(timeout=10)
    return HeartbeatRun.objects.filter(agent=agent).latest("created_at")


@pytest.mark.parametrize("mode", ["persistent", "stateless"])
def test_a_turn_whose_worker_was_killed_is_finished_by_the_next_without_resending_it(
    company, fake_managed, settings, mode
):
    agent = managed_agent(company, session_mode=mode)
    fake_managed.script(None, [("message", "part one", FIRST), ("sleep", 1.5), ("message", "part two", SECOND)])

    run = killed_after_first_request(agent, settings, "the long task")
    assert run.status == RunStatus.RUNNING

    assert runs_reap(now=run.deadline_at + timedelta(seconds=1)) == []  # resumed, not failed
    run.refresh_from_db()
    assert run.status == RunStatus.RESUMING
    run_queued_tasks()

    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    assert run.output == "part one\n\npart two"
    (remote_id,) = fake_managed.user_messages
    assert fake_managed.user_messages[remote_id] == ["the long task"]  # sent once
    rows = CostEvent.objects.filter(run_id=run.id, kind=CostKind.MESSAGE).order_by("call_number")
    assert [(r.call_number, r.input_tokens, r.output_tokens) for r in rows] == [(1, 700, 30), (2, 900, 40)]
    spans = [e["id"] for e in fake_managed.events[remote_id] if e["type"] == "span.model_request_end"]
    assert [r.message_id for r in rows] == spans
    if mode == "persistent":
        session = AgentSession.objects.get(agent=agent)
        assert session.managed_session_id == remote_id
        assert [m["content"] for m in store_for(session).read(session) if m["role"] == "user"] == ["the long task"]


def test_a_task_that_never_reached_the_session_is_sent_once_by_the_next_worker(company, fake_managed):
    """The worker died after recording where the turn starts and before its task arrived."""
    agent = managed_agent(company)
    fake_managed.fail_next(500, times=10, path_prefix="/v1/sessions/")  # the task's send fails for good
    first = heartbeat_execute(run_id=_queued(agent, "a task").id)
    assert first.status == RunStatus.FAILED  # this worker gave up: nothing was sent
    remote_id = first.managed_session_id
    assert fake_managed.user_messages.get(remote_id, []) == []
    fake_managed.recover()

    # As if the worker had died instead: the run still running, its turn recorded, and
    # none of the failure's doing (the end of the session it made).
    ManagedSessionEnd.objects.all().delete()
    HeartbeatRun.objects.filter(pk=first.pk).update(
        status=RunStatus.RUNNING, deadline_at=first.finished_at, finished_at=None, error_code="", error=""
    )
    assert runs_reap(now=first.finished_at + timedelta(seconds=1)) == []
    run_queued_tasks()

    first.refresh_from_db()
    assert first.status == RunStatus.SUCCEEDED, (first.error_code, first.error)
    assert fake_managed.user_messages[first.managed_session_id] == ["a task"]


def test_a_run_resumed_too_often_fails_as_any_overdue_run_and_its_remote_turn_is_stopped(company, fake_managed):
    agent = managed_agent(company)
    beat(agent, "first")  # the remote session exists
    remote_id = AgentSession.objects.get(agent=agent).managed_session_id
    # Its turn still works at the provider, as after a worker that died a third time.
    fake_managed.script(None, [("sleep", 30), ("message", "never", FIRST)])
    client_for({}).beta.sessions.events.send(
        remote_id, events=[{"type": "user.message", "content": [{"type": "text", "text": "a task"}]}]
    )
    run = _queued(agent, "a task")
    now = run.created_at
    HeartbeatRun.objects.filter(pk=run.pk).update(
        status=RunStatus.RUNNING,
        started_at=now,
        deadline_at=now,
        managed_session_id=remote_id,
        managed_turn={"cursor": "", "resume": 3, "opening": []},
    )

    assert runs_reap(now=now + timedelta(seconds=1)) == [agent.id]
    run.refresh_from_db()
    assert (run.status, run.error_code) == (RunStatus.FAILED, "run_timeout")
    assert [e["type"] for e in fake_managed.events[remote_id]].count("user.interrupt") == 1
    deadline = time.monotonic() + 10
    while fake_managed.sessions[remote_id]["status"] != "idle":
        assert time.monotonic() < deadline, "the remote turn went on"
        time.sleep(0.02)
    assert not any(e["type"] == "agent.message" and "never" in str(e) for e in fake_managed.events[remote_id])


def _queued(agent, task: str) -> HeartbeatRun:
    from django.utils import timezone

    from sessions_app.run_queue import heartbeat_enqueue

    run, _ = heartbeat_enqueue(agent=agent, task=task, now=timezone.now())
    return run


def _expire(session):
    assert session_expire(session=session, now=timezone.now())


def _delete(session):
    session_delete(session=session, now=timezone.now())


def _clear(session):
    assert session_clear_history(session=session)


SESSION_ENDS = {
    "expired": (_expire, "session_ended", "session was expired"),
    "deleted": (_delete, "session_deleted", "session was deleted"),
    "cleared": (_clear, "session_conflict", "history was cleared"),
}


@pytest.mark.parametrize("end", list(SESSION_ENDS))
def test_a_resumed_turn_whose_session_ended_before_the_next_worker_fails_with_what_ended_it(
    company, fake_managed, settings, end
):
    """The operator ends the session while the turn is `resuming` (no worker holds it, and
    unlike a turn waiting for an approval it is not ended with the session): the next worker
    finds no live session to take and continues the turn anyway, and its commit refuses to
    name the ended remote session. Its failure says what ended it, and the remote time of
    both turns is billed once (before: every cause failed `session_conflict`, "history was
    cleared")."""
    act, code, said = SESSION_ENDS[end]
    agent = managed_agent(company)
    fake_managed.active_seconds_per_turn = 30.0
    assert beat(agent, "look around").status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    remote_id = session.managed_session_id
    fake_managed.script(None, [("message", "part one", FIRST), ("sleep", 1.5), ("message", "part two", SECOND)])
    run = killed_after_first_request(agent, settings, "the long task")
    assert runs_reap(now=run.deadline_at + timedelta(seconds=1)) == []
    assert HeartbeatRun.objects.get(pk=run.pk).status == RunStatus.RESUMING

    remote = fake_managed.sessions[remote_id]  # kept after the fake deletes the session

    act(session)
    run_queued_tasks()

    run.refresh_from_db()
    assert (run.status, run.error_code) == (RunStatus.FAILED, code), run.error
    assert said in run.error
    assert fake_managed.user_messages[remote_id] == ["look around", "the long task"]  # nothing sent again
    rows = CostEvent.objects.filter(run_id=run.id, kind=CostKind.MESSAGE).order_by("call_number")
    assert [(r.input_tokens, r.output_tokens) for r in rows] == [(700, 30), (900, 40)]
    maintenance_pass(now=timezone.now())
    run_queued_tasks()
    # A cleared row is still live: the failed turn's time waits on it for its pause or end.
    session_hours_bill(session_ids=[session.pk], now=timezone.now())
    remote_seconds = remote["usage"]["active_seconds"]
    assert remote_seconds == 60.0
    hours = CostEvent.objects.filter(agent=agent, kind=CostKind.SESSION_HOURS)
    assert sum(hours.values_list("session_seconds", flat=True)) == remote_seconds
    assert not AgentSession.objects.filter(unbilled_active_seconds__gt=0).exists()
    assert AgentSession.objects.filter(agent=agent, managed_session_id=remote_id).count() == (end == "expired")
