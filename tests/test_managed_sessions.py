"""The end of remote Managed Agents sessions: recorded in the transaction that ends or
deletes a session here, carried out after its COMMIT through the real SDK against the
fake, and retried by the maintenance pass until the provider confirms it."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import anthropic
import pytest
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from costs_app.pricing import session_hour_rate, session_hours_cost
from sessions_app.approvals import approval_decide
from sessions_app.maintenance import maintenance_pass, runs_reap, sessions_expire
from sessions_app.managed_health import managed_health_check
from sessions_app.managed_sessions import managed_ends_process, managed_orphans_end
from sessions_app.metering import session_hours_bill
from sessions_app.models import AgentSession, HeartbeatRun, ManagedOutput, ManagedSessionEnd, RunStatus
from sessions_app.services import session_clear_history, session_delete, session_expire
from tests.api.conftest import make_run, make_session
from tests.conftest import FAKE_API_KEY, Actor, beat, managed_agent, on_own_connection, run_queued_tasks, user_turns

pytestmark = pytest.mark.django_db


def remote_session(fake_managed) -> str:
    client = anthropic.Anthropic(api_key=FAKE_API_KEY, base_url=fake_managed.base_url, max_retries=0)
    agent = client.beta.agents.create(name="remote", model="claude-sonnet-4-5")
    return client.beta.sessions.create(agent=agent.id, environment_id="env_0001").id


def unreachable_url() -> str:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_a_session_expired_by_its_ttl_is_archived_at_the_provider(
    company, fake_managed, django_capture_on_commit_callbacks
):
    agent = managed_agent(company)
    remote_id = remote_session(fake_managed)
    session = make_session(agent, managed_session_id=remote_id, last_used=timezone.now() - timedelta(days=2))

    with django_capture_on_commit_callbacks(execute=True):
        assert sessions_expire(now=timezone.now()) == 1
    assert fake_managed.sessions[remote_id]["archived_at"] is None  # not inside the expiry's transaction
    run_queued_tasks()

    assert fake_managed.sessions[remote_id]["archived_at"] is not None
    end = ManagedSessionEnd.objects.get(remote_session_id=remote_id)
    assert (end.action, end.session_id, end.attempts, end.last_error) == ("archive", session.pk, 1, "")
    assert end.done_at is not None


def test_an_operator_expiring_a_session_archives_it_once(company, fake_managed, django_capture_on_commit_callbacks):
    session = make_session(managed_agent(company), managed_session_id=remote_session(fake_managed))

    with django_capture_on_commit_callbacks(execute=True):
        assert session_expire(session=session, now=timezone.now())
        assert not session_expire(session=session, now=timezone.now())  # already ended: nothing more
    run_queued_tasks()

    assert ManagedSessionEnd.objects.filter(action="archive", done_at__isnull=False).count() == 1


def test_a_failed_remote_delete_is_kept_shown_and_retried_until_done(
    company, fake_managed, monkeypatch, client, django_capture_on_commit_callbacks
):
    remote_id = remote_session(fake_managed)
    session = make_session(managed_agent(company), managed_session_id=remote_id)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", unreachable_url())

    with django_capture_on_commit_callbacks(execute=True):
        session_delete(session=session, now=timezone.now())
    run_queued_tasks()

    assert not AgentSession.objects.filter(pk=session.pk).exists()  # ours is gone for real
    assert remote_id in fake_managed.sessions  # theirs not yet
    end = ManagedSessionEnd.objects.get(remote_session_id=remote_id)
    assert (end.action, end.attempts, end.done_at) == ("delete", 1, None)
    assert "Could not reach" in end.last_error
    assert client.get("/api/health").json()["managed_sessions"] == {
        "ends_pending": 1,
        "ends_failing": 1,
        "sessions_lost": 0,
        "sessions_unreachable": 0,
    }

    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake_managed.base_url)
    assert maintenance_pass(now=timezone.now())["managed_session_ends"] == 0  # its retry is not due yet
    assert maintenance_pass(now=end.next_attempt_at)["managed_session_ends"] == 1

    assert remote_id not in fake_managed.sessions
    assert client.get("/api/health").json()["managed_sessions"] == {
        "ends_pending": 0,
        "ends_failing": 0,
        "sessions_lost": 0,
        "sessions_unreachable": 0,
    }


def test_an_end_another_worker_claimed_is_left_to_it(company, fake_managed):
    remote_id = remote_session(fake_managed)
    end = ManagedSessionEnd.objects.create(remote_session_id=remote_id, action="archive", company=company)
    now = timezone.now()
    # Another worker's claim: the attempt it will make moves past now.
    ManagedSessionEnd.objects.filter(pk=end.pk).update(next_attempt_at=now + timedelta(minutes=5))

    assert managed_ends_process(now=now) == 0
    assert fake_managed.sessions[remote_id]["archived_at"] is None
    assert ("POST", f"/v1/sessions/{remote_id}/archive") not in fake_managed.requests


@pytest.mark.django_db(transaction=True)
def test_an_end_whose_lease_ran_out_during_its_copy_is_carried_out_once_by_the_worker_that_took_it(
    company, fake_managed
):
    """Worker A's copy outlasts its claim's lease: worker B (its own connection, a pass six
    minutes on) claims the end while A downloads a file, copies it and archives the session.
    A then finds the claim no longer its own: it sends no second archive and writes nothing
    over B's record."""
    agent = managed_agent(company)
    remote_id = remote_session(fake_managed)
    produced = fake_managed.add_file(remote_id, "notes.txt", b"notes", "text/plain")
    end = ManagedSessionEnd.objects.create(
        remote_session_id=remote_id, action="archive", company=company, agent_id=agent.pk
    )
    now = timezone.now()
    later = []
    fake_managed.before_next(
        "GET",
        f"/v1/files/{produced['id']}/content",
        on_own_connection(lambda: later.append(managed_ends_process(now=now + timedelta(minutes=6)))),
    )

    assert managed_ends_process(now=now) == 0

    assert later == [1]
    assert fake_managed.requests.count(("POST", f"/v1/sessions/{remote_id}/archive")) == 1
    end.refresh_from_db()
    assert (end.done_at, end.attempts, end.last_error) == (now + timedelta(minutes=6), 1, "")
    assert ManagedOutput.objects.filter(remote_session_id=remote_id).count() == 1


def test_a_session_the_provider_no_longer_knows_is_ended(company, fake_managed):
    ManagedSessionEnd.objects.create(remote_session_id="sesn_gone", action="delete", company=company)

    assert managed_ends_process(now=timezone.now()) == 1
    assert ManagedSessionEnd.objects.get(remote_session_id="sesn_gone").done_at is not None


def test_a_remote_session_a_dead_run_made_and_no_session_names_is_archived(company, fake_managed):
    agent = managed_agent(company)
    named = remote_session(fake_managed)
    make_session(agent, managed_session_id=named)
    orphan = remote_session(fake_managed)
    now = timezone.now()
    make_run(agent, status=RunStatus.FAILED, managed_session_id=orphan, finished_at=now)
    make_run(agent, status=RunStatus.SUCCEEDED, managed_session_id=named, finished_at=now)
    make_run(agent, status=RunStatus.RUNNING, managed_session_id=remote_session(fake_managed))  # still working

    assert managed_orphans_end(now=now) == 1
    assert managed_orphans_end(now=now) == 0  # recorded once
    assert list(ManagedSessionEnd.objects.values_list("remote_session_id", flat=True)) == [orphan]


def test_a_delete_whose_commit_fails_leaves_the_remote_session_alone(company, fake_managed, refuse_at_commit):
    """The end is written in the delete's transaction and carried out only after its COMMIT:
    a COMMIT that fails leaves our row and the remote session both as they were."""
    remote_id = remote_session(fake_managed)
    session = make_session(managed_agent(company), managed_session_id=remote_id)
    refuse_at_commit("managed_session_ends", when="1 = 1", event="INSERT")

    with pytest.raises(Exception, match="refused at commit|FOREIGN KEY"):
        session_delete(session=session, now=timezone.now())
    run_queued_tasks()
    managed_ends_process(now=timezone.now())

    assert AgentSession.objects.filter(pk=session.pk).exists()
    assert not ManagedSessionEnd.objects.exists()
    assert remote_id in fake_managed.sessions
    assert [request for request in fake_managed.requests if request[0] == "DELETE"] == []


def cleared_after_one_turn(company, fake_managed):
    """A Managed Agents agent whose session took one turn on its remote session, then had
    its history cleared (after a file was produced there); the tasks queued are not run."""
    agent = managed_agent(company)
    assert beat(agent, "remember the word heron").status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    produced = fake_managed.add_file(session.managed_session_id, "notes.txt", b"heron\n", "text/plain")
    return agent, session, produced


@pytest.mark.django_db(transaction=True)
def test_a_cleared_session_archives_its_remote_session_and_the_next_heartbeat_opens_a_new_one_with_no_note(
    company, fake_managed
):
    """The remote session holds every cleared turn: it is archived once its files are here,
    and the next heartbeat's task goes to a new one, alone (before: the same remote session
    got it, and the model remembered what the session no longer showed)."""
    agent, session, produced = cleared_after_one_turn(company, fake_managed)
    old = session.managed_session_id

    assert session_clear_history(session=session)
    assert fake_managed.sessions[old]["archived_at"] is None  # not inside the clear's transaction
    run_queued_tasks()

    session.refresh_from_db()
    assert (session.managed_session_id, session.message_count) == (None, 0)
    assert fake_managed.sessions[old]["archived_at"] is not None
    (output,) = ManagedOutput.objects.filter(remote_session_id=old)
    assert (output.filename, output.session_id) == ("notes.txt", session.pk)
    copied = fake_managed.requests.index(("GET", f"/v1/files/{produced['id']}/content"))
    assert copied < fake_managed.requests.index(("POST", f"/v1/sessions/{old}/archive"))

    after = beat(agent, "which word?")

    assert after.status == RunStatus.SUCCEEDED, after.error
    session.refresh_from_db()
    assert AgentSession.objects.get(agent=agent).pk == session.pk  # the same row goes on
    assert session.managed_session_id not in (None, old) and len(fake_managed.sessions) == 2
    assert fake_managed.user_messages[session.managed_session_id] == ["which word?"]  # no handoff note
    assert fake_managed.user_messages[old] == ["remember the word heron"]
    assert user_turns(session) == ["which word?"]


@pytest.mark.django_db(transaction=True)
def test_a_lost_session_whose_history_is_cleared_goes_on_with_a_new_remote_session_and_no_note(company, fake_managed):
    """What the health check read of the old remote session goes with it: the row is not
    retired as lost, and no handoff note carries the cleared turns (before: the next
    heartbeat ended the row `remote_lost` and opened its successor with a note)."""
    agent, session, _ = cleared_after_one_turn(company, fake_managed)
    old = session.managed_session_id
    fake_managed.terminate(old)
    assert managed_health_check(now=timezone.now()) == 1

    assert session_clear_history(session=session)
    run_queued_tasks()

    session.refresh_from_db()
    read = (session.managed_checked_at, session.managed_problem, session.managed_check_failures)
    assert (session.managed_lost_at, *read) == (None, None, None, None)
    assert beat(agent, "which word?").status == RunStatus.SUCCEEDED
    (live,) = AgentSession.objects.filter(agent=agent)
    assert live.pk == session.pk and live.end_reason == ""
    assert fake_managed.user_messages[live.managed_session_id] == ["which word?"]


@pytest.mark.django_db(transaction=True)
def test_a_cleared_sessions_remote_hours_are_billed_once_and_its_new_remote_session_counts_from_zero(
    company, fake_managed
):
    """The old remote session's active time is billed when the clear ends it, as any ended
    session's is; the new remote session's turns are measured from its own start."""
    agent = managed_agent(company)
    fake_managed.active_seconds_per_turn = 40.0
    assert beat(agent, "one").status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)

    assert session_clear_history(session=session)

    hours = CostEvent.objects.filter(agent=agent, kind=CostKind.SESSION_HOURS)
    rate = session_hour_rate()
    assert list(hours.values_list("session_id", "cost_usd")) == [(session.pk, session_hours_cost(40.0, rate=rate))]
    fake_managed.active_seconds_per_turn = 25.5
    second = beat(agent, "two")
    assert second.runtime_report["active_seconds"] == 25.5
    session.refresh_from_db()
    assert (session.active_seconds, session.unbilled_active_seconds) == (65.5, 25.5)
    assert session_hours_bill(session_ids=[session.pk], now=timezone.now()) == 1
    assert sorted(hours.values_list("cost_usd", flat=True)) == sorted(
        [session_hours_cost(40.0, rate=rate), session_hours_cost(25.5, rate=rate)]
    )


@pytest.mark.django_db(transaction=True)
def test_a_clear_while_a_turn_is_sent_to_the_old_remote_session_keeps_neither_that_turn_nor_that_session(
    company, fake_managed
):
    """The worst moment: the run has recorded the old remote session and is sending it its
    task when the clear commits (its own connection, as the fake receives the task). The
    turn belongs to the cleared conversation: its commit fails, billed, writing nothing to
    the row, and the next heartbeat opens a new remote session with no note."""
    agent = managed_agent(company)
    assert beat(agent, "remember the word heron").status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    old = session.managed_session_id
    cleared = []
    fake_managed.before_next(
        "POST",
        f"/v1/sessions/{old}/events",
        on_own_connection(lambda: cleared.append(session_clear_history(session=session))),
    )

    during = beat(agent, "which word?")

    assert cleared == [True]
    assert fake_managed.user_messages[old] == ["remember the word heron", "which word?"]
    assert (during.status, during.error_code, during.managed_session_id) == (RunStatus.FAILED, "session_conflict", old)
    assert CostEvent.objects.filter(run_id=during.id, kind=CostKind.MESSAGE).count() == 1  # its answer is billed
    session.refresh_from_db()
    assert (session.managed_session_id, session.message_count, user_turns(session)) == (None, 0, [])
    # The old remote session's time, each part once: billed by the clear up to it, and the
    # failed turn's by the provider's measure on the row, billed when the row pauses or ends.
    (hours,) = CostEvent.objects.filter(agent=agent, kind=CostKind.SESSION_HOURS)
    assert hours.cost_usd == session_hours_cost(10.0, rate=session_hour_rate())
    assert session.unbilled_active_seconds == 10.0
    assert fake_managed.sessions[old]["usage"]["active_seconds"] == 20.0
    run_queued_tasks()
    assert fake_managed.sessions[old]["archived_at"] is not None

    after = beat(agent, "which word?")

    assert after.status == RunStatus.SUCCEEDED, after.error
    session.refresh_from_db()
    assert session.managed_session_id not in (None, old) and len(fake_managed.sessions) == 2
    assert fake_managed.user_messages[session.managed_session_id] == ["which word?"]
    assert user_turns(session) == ["which word?"]


@pytest.mark.django_db(transaction=True)
def test_a_turn_approved_but_not_yet_continued_when_the_history_is_cleared_ends_with_it_and_sends_nothing(
    company, fake_managed
):
    """An operator approved the turn waiting on the old remote session, and no worker has
    taken it yet, when the history is cleared: the run still waits, so the clear ends it
    (`session_conflict`, in its transaction); the worker then finds nothing to continue, no
    confirmation reaches the archived session and the row stays unmapped (before: the worker
    sent the confirmation, paid for the rest of the turn, and its commit failed)."""
    agent = managed_agent(company, tools=["read", {"name": "bash", "permission": "always_ask"}])
    assert beat(agent, "remember the word heron").status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    old = session.managed_session_id
    fake_managed.script(
        None,
        [
            ("message", "I will look.", {"input_tokens": 300, "output_tokens": 12}),
            ("tool", "bash", {"command": "ls"}, "always_ask", "notes.txt"),
            ("message", "done", {"input_tokens": 420, "output_tokens": 8}),
        ],
    )
    waiting = beat(agent, "list the files")
    assert (waiting.status, waiting.managed_session_id) == (RunStatus.WAITING_APPROVAL, old)
    approval_decide(waiting, allow=True, now=timezone.now())  # its task is queued, not yet run

    assert session_clear_history(session=session)
    run_queued_tasks()

    run = HeartbeatRun.objects.get(pk=waiting.pk)
    assert (run.status, run.error_code) == (RunStatus.FAILED, "session_conflict")
    assert "history was cleared" in run.error
    assert [e["type"] for e in fake_managed.events[old]].count("user.tool_confirmation") == 0
    billed = CostEvent.objects.filter(run_id=run.id, kind=CostKind.MESSAGE, input_tokens__gt=0)
    assert list(billed.values_list("input_tokens", flat=True)) == [300]  # the part before the wait
    session.refresh_from_db()
    assert (session.managed_session_id, session.message_count) == (None, 0)
    assert fake_managed.sessions[old]["archived_at"] is not None

    after = beat(agent, "which word?")

    assert after.status == RunStatus.SUCCEEDED, after.error
    session.refresh_from_db()
    assert session.managed_session_id not in (None, old)
    assert fake_managed.user_messages[session.managed_session_id] == ["which word?"]


@pytest.mark.django_db(transaction=True)
def test_a_session_deleted_and_ended_at_once_while_its_turn_runs_waits_for_the_turn_and_bills_it_once(
    company, fake_managed
):
    """The operator deletes the session (the test's connection) while the heartbeat's turn
    streams on its remote session, and the end is carried out at once. The end interrupts
    the turn and waits for it: the worker reads the turn's active time and its failed
    commit bills it; the next pass copies the turn's file and deletes the remote session
    (before: the remote session was deleted under the turn, whose time nobody could read)."""
    agent = managed_agent(company)
    fake_managed.active_seconds_per_turn = 40.0
    assert beat(agent, "one").status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    remote = session.managed_session_id
    fake_managed.active_seconds_per_turn = 25.5
    usage = {"input_tokens": 100, "output_tokens": 20}
    steps = [("file", "report.txt", b"report"), ("message", "two", usage), ("sleep", 30.0), ("message", "late", usage)]
    fake_managed.script(None, steps)
    billed_before = CostEvent.objects.filter(kind=CostKind.MESSAGE).count()
    heartbeat = Actor(lambda: beat(agent, "two"))
    heartbeat.start()
    deadline = time.monotonic() + 30
    while CostEvent.objects.filter(kind=CostKind.MESSAGE).count() == billed_before:
        assert time.monotonic() < deadline, "the turn's first request was never billed"
        time.sleep(0.02)

    session_delete(session=session, now=timezone.now())
    now = timezone.now()
    carried_out = managed_ends_process(now=now)

    run = heartbeat.result()
    rate = session_hour_rate()
    hours = CostEvent.objects.filter(kind=CostKind.SESSION_HOURS)
    assert dict(fake_managed.charged_seconds) == {remote: 40.0 + 25.5}
    assert sorted(hours.values_list("cost_usd", flat=True)) == sorted(
        [session_hours_cost(40.0, rate=rate), session_hours_cost(25.5, rate=rate)]
    )
    assert (run.status, run.error_code) == (RunStatus.FAILED, "session_deleted")
    assert carried_out == 0  # the turn was still on the remote session
    interrupts = [e for e in fake_managed.events[remote] if e["type"] == "user.interrupt"]
    assert len(interrupts) == 1
    assert "late" not in str(fake_managed.events[remote])  # the turn stopped spending
    assert remote in fake_managed.sessions
    end = ManagedSessionEnd.objects.get(remote_session_id=remote)
    assert (end.attempts, end.done_at, end.next_attempt_at) == (0, None, now + timedelta(minutes=1))
    assert end.last_error == f"Waits for run {run.pk}, whose turn is still on this session."

    assert managed_ends_process(now=end.next_attempt_at) == 1
    assert remote not in fake_managed.sessions
    assert list(ManagedOutput.objects.filter(remote_session_id=remote).values_list("filename", flat=True)) == [
        "report.txt"
    ]
    maintenance_pass(now=end.next_attempt_at)
    assert hours.count() == 2  # billed once


def test_an_end_whose_run_was_reaped_goes_ahead(company, fake_managed):
    """A run still `running` on the remote session holds its end back, its turn
    interrupted once; once the reaper ends the run (past its deadline, its worker gone),
    the next attempt deletes the remote session."""
    agent = managed_agent(company)
    remote = remote_session(fake_managed)
    started = timezone.now()
    run = make_run(
        agent,
        status=RunStatus.RUNNING,
        managed_session_id=remote,
        started_at=started,
        deadline_at=started + timedelta(hours=1),
    )
    ManagedSessionEnd.objects.create(remote_session_id=remote, action="delete", company=company, agent_id=agent.pk)
    now = timezone.now()

    assert managed_ends_process(now=now) == 0
    assert managed_ends_process(now=now + timedelta(minutes=1)) == 0  # interrupted once, not at each look
    assert fake_managed.requests.count(("POST", f"/v1/sessions/{remote}/events")) == 1
    assert remote in fake_managed.sessions

    later = now + timedelta(hours=2)
    assert runs_reap(now=later) == [agent.pk]
    run.refresh_from_db()
    assert (run.status, run.error_code) == (RunStatus.FAILED, "run_timeout")
    assert managed_ends_process(now=later) == 1
    assert remote not in fake_managed.sessions
    end = ManagedSessionEnd.objects.get(remote_session_id=remote)
    assert (end.attempts, end.last_error) == (1, "")
