"""The health check of remote Managed Agents sessions, through the real SDK against the
fake: a lost session marked, shown and replaced by the next heartbeat with a handoff note
from the mirrored history; an unreachable one counted, never marked lost; a session in use
never marked, whatever moment a run takes it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from sessions_app.maintenance import maintenance_pass
from sessions_app.managed_health import BATCH, GIVE_UP_AFTER, managed_health_check, managed_health_state
from sessions_app.models import AgentSession, PinnedFact, RunStatus, SessionStatus
from tests.api.conftest import make_run, make_session
from tests.conftest import beat, managed_agent, on_own_connection, run_queued_tasks, user_turns
from tests.test_managed_sessions import remote_session, unreachable_url

pytestmark = pytest.mark.django_db(transaction=True)


def reads_of(fake_managed, remote_id: str) -> int:
    return fake_managed.requests.count(("GET", f"/v1/sessions/{remote_id}?beta=true")) + fake_managed.requests.count(
        ("GET", f"/v1/sessions/{remote_id}")
    )


def test_a_terminated_session_is_marked_shown_and_the_next_heartbeat_starts_afresh_with_a_handoff_note(
    company, fake_managed, client
):
    agent = managed_agent(company)
    PinnedFact.objects.create(agent=agent, text="The client is Acme Ltd.")
    assert beat(agent, "remember the word heron").status == RunStatus.SUCCEEDED
    lost = AgentSession.objects.get(agent=agent)
    fake_managed.terminate(lost.managed_session_id)

    assert maintenance_pass(now=timezone.now())["managed_health"] == 1

    lost.refresh_from_db()
    assert lost.status == SessionStatus.ACTIVE and lost.managed_lost_at is not None
    assert lost.managed_problem == "The service terminated the session."
    assert client.get("/api/health").json()["managed_sessions"]["sessions_lost"] == 1

    after = beat(agent, "which word?")
    run_queued_tasks()

    assert after.status == RunStatus.SUCCEEDED, after.error
    lost.refresh_from_db()
    assert (lost.status, lost.end_reason) == (SessionStatus.ENDED, "remote_lost")
    successor = AgentSession.objects.get(agent=agent, status=SessionStatus.ACTIVE)
    assert successor.predecessor_id == lost.pk
    assert successor.managed_session_id not in (None, lost.managed_session_id)
    [sent] = fake_managed.user_messages[successor.managed_session_id]
    assert sent.startswith("[Handoff note: your previous session ended at the service")
    assert "remember the word heron" in sent and "- The client is Acme Ltd." in sent
    assert sent.endswith("which word?")
    # The note opens the new session's history, as a rotation's does; the task is its own turn.
    assert user_turns(successor)[1:] == ["which word?"]
    assert "remember the word heron" in user_turns(successor)[0]
    assert fake_managed.sessions[lost.managed_session_id]["archived_at"] is not None
    assert client.get("/api/health").json()["managed_sessions"]["sessions_lost"] == 0


def test_a_session_the_provider_no_longer_knows_is_lost(company, fake_managed):
    remote_id = remote_session(fake_managed)
    session = make_session(managed_agent(company), managed_session_id=remote_id)
    del fake_managed.sessions[remote_id]

    assert managed_health_check(now=timezone.now()) == 1

    session.refresh_from_db()
    assert session.managed_lost_at is not None
    assert session.managed_problem == "The service no longer knows the session."


def test_an_unreachable_provider_is_counted_shown_and_never_taken_for_a_loss(
    company, fake_managed, monkeypatch, client, settings
):
    session = make_session(managed_agent(company), managed_session_id=remote_session(fake_managed))
    monkeypatch.setenv("ANTHROPIC_BASE_URL", unreachable_url())
    now = timezone.now()
    every = timedelta(seconds=settings.PAPERCLIP_MANAGED_HEALTH_INTERVAL_SECONDS)

    assert managed_health_check(now=now) == 0
    assert managed_health_check(now=now + every / 2) == 0  # not due again yet: not read
    assert managed_health_check(now=now + every) == 0

    session.refresh_from_db()
    assert (session.managed_lost_at, session.managed_check_failures) == (None, 2)
    assert "Could not reach" in session.managed_problem
    assert client.get("/api/health").json()["managed_sessions"]["sessions_unreachable"] == 1

    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake_managed.base_url)
    assert managed_health_check(now=now + 2 * every) == 0
    session.refresh_from_db()
    assert (session.managed_problem, session.managed_check_failures) == (None, None)
    assert managed_health_state() == {"sessions_lost": 0, "sessions_unreachable": 0}


def test_a_pass_stops_reading_when_the_provider_is_down_and_the_rest_wait_their_turn(
    company, fake_managed, monkeypatch
):
    sessions = [
        make_session(managed_agent(company), managed_session_id=remote_session(fake_managed))
        for _ in range(GIVE_UP_AFTER + 2)
    ]
    monkeypatch.setenv("ANTHROPIC_BASE_URL", unreachable_url())

    assert managed_health_check(now=timezone.now()) == 0

    read = AgentSession.objects.filter(pk__in=[s.pk for s in sessions], managed_check_failures=1)
    assert read.count() == GIVE_UP_AFTER
    assert AgentSession.objects.filter(pk__in=[s.pk for s in sessions], managed_checked_at__isnull=True).count() == 2


def test_a_session_a_run_takes_while_its_status_is_read_is_never_marked(company, fake_managed):
    agent = managed_agent(company)
    remote_id = remote_session(fake_managed)
    session = make_session(agent, managed_session_id=remote_id)
    fake_managed.terminate(remote_id)
    # The worst moment: after the check chose the session, while the provider answers.
    fake_managed.before_next(
        "GET",
        f"/v1/sessions/{remote_id}",
        on_own_connection(lambda: make_run(agent, status=RunStatus.RUNNING, session=session)),
    )

    assert managed_health_check(now=timezone.now()) == 0

    session.refresh_from_db()
    assert (session.managed_lost_at, session.managed_checked_at) == (None, None)  # its run reads the status itself


def test_a_session_moved_to_a_new_remote_session_while_the_old_is_read_is_never_marked(company, fake_managed):
    agent = managed_agent(company)
    old, new = remote_session(fake_managed), remote_session(fake_managed)
    session = make_session(agent, managed_session_id=old)
    fake_managed.terminate(old)
    fake_managed.before_next(
        "GET",
        f"/v1/sessions/{old}",
        on_own_connection(lambda: AgentSession.objects.filter(pk=session.pk).update(managed_session_id=new)),
    )

    assert managed_health_check(now=timezone.now()) == 0

    session.refresh_from_db()
    assert (session.managed_session_id, session.managed_lost_at) == (new, None)


def test_sessions_in_use_ended_or_of_other_runtimes_are_never_read(company, fake_managed, persistent_agent):
    agent = managed_agent(company)
    in_use = make_session(agent, managed_session_id=remote_session(fake_managed))
    make_run(agent, status=RunStatus.RUNNING, session=in_use)
    ended_remote = remote_session(fake_managed)
    make_session(managed_agent(company), managed_session_id=ended_remote, status=SessionStatus.ENDED)
    make_session(persistent_agent)
    before = len(fake_managed.requests)

    assert managed_health_check(now=timezone.now()) == 0

    assert fake_managed.requests[before:] == []


def test_a_pass_reads_a_bounded_batch_least_recently_checked_first(company, fake_managed, settings):
    now = timezone.now()
    every = timedelta(seconds=settings.PAPERCLIP_MANAGED_HEALTH_INTERVAL_SECONDS)
    remote_ids = [remote_session(fake_managed) for _ in range(BATCH + 2)]
    sessions = [
        make_session(managed_agent(company), managed_session_id=remote_id, managed_checked_at=now - every)
        for remote_id in remote_ids
    ]
    stalest = sessions[-1]
    AgentSession.objects.filter(pk=stalest.pk).update(managed_checked_at=now - 3 * every)
    never = make_session(managed_agent(company), managed_session_id=remote_session(fake_managed))
    before = len(fake_managed.requests)

    with CaptureQueriesContext(connection) as queries:
        managed_health_check(now=now)

    assert len(fake_managed.requests) - before == BATCH
    assert len(queries) == 1 + BATCH  # the batch's one read, then one update per reading
    checked = set(AgentSession.objects.filter(managed_checked_at=now).values_list("pk", flat=True))
    assert {never.pk, stalest.pk} <= checked and len(checked) == BATCH
