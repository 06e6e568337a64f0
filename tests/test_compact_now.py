"""Compact now (`sessions_app.compact_now`) racing the rest of the world: a heartbeat that
arrives while the summary is written waits, and runs after it, losing no turn."""

from __future__ import annotations

import pytest
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from paperclip.errors import RunFailure
from sessions_app.compact_now import session_compact
from sessions_app.heartbeat import heartbeat_execute
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus
from sessions_app.stores import store_for
from tests.conftest import beat, compacting_agent, context_agent, on_own_connection, user_turns
from tests.fake_anthropic import Reply


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_during_compact_now_waits_and_loses_no_turn(file_store, company, fake_anthropic):
    agent = context_agent(company, keep_recent_turns=1)
    for i in range(3):
        assert beat(agent, f"step {i}: " + "x" * 400).status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    racing = []
    # The heartbeat arrives while the summary is being written, as another worker would.
    fake_anthropic.push(Reply(before=on_own_connection(lambda: racing.append(beat(agent, "racing turn")))))

    record = session_compact(session=session, now=timezone.now())

    (run,) = racing
    assert run.status == RunStatus.QUEUED  # the compaction is the session's one writer
    assert heartbeat_execute(run_id=run.id).status == RunStatus.SUCCEEDED  # as dispatched after it
    session.refresh_from_db()
    assert (session.compaction_count, record.messages_before) == (1, 6)
    assert user_turns(session)[-1] == "racing turn"
    assert len(store_for(session).read(session)) == session.message_count == 6
    assert CostEvent.objects.filter(run=record.run, kind=CostKind.COMPACTION).count() == 1


@pytest.mark.django_db(transaction=True)
def test_compact_now_whose_summary_does_not_shrink_the_session_is_refused_and_paid_once(company, fake_anthropic):
    agent = context_agent(company, keep_recent_turns=1)
    for i in range(3):
        beat(agent, f"step {i}: " + "x" * 400)
    session = AgentSession.objects.get(agent=agent)
    fake_anthropic.push(Reply.message("s" * 6000))

    with pytest.raises(RunFailure) as refused:
        session_compact(session=session, now=timezone.now())

    assert refused.value.code == "compaction_not_shrinking"
    run = HeartbeatRun.objects.filter(agent=agent).latest("created_at")
    assert (run.status, run.error_code) == (RunStatus.FAILED, "compaction_not_shrinking")
    assert CostEvent.objects.filter(run=run, kind=CostKind.COMPACTION).count() == 1
    session.refresh_from_db()
    assert (session.compaction_count, session.compaction_error) == (0, "compaction_not_shrinking")


@pytest.mark.django_db(transaction=True)
def test_a_refused_summary_is_asked_for_again_when_the_operator_compacts_now(company, fake_anthropic):
    agent = compacting_agent(company)
    fake_anthropic.push(Reply.message("s" * 6000))
    assert beat(agent, "y" * 2400).error_code == "compaction_not_shrinking"
    session = AgentSession.objects.get(agent=agent)

    session_compact(session=session, now=timezone.now())  # an operator's explicit request pays again

    session.refresh_from_db()
    assert (session.compaction_count, session.compaction_error) == (1, "")
    assert beat(agent, "y" * 2400).status == RunStatus.SUCCEEDED


def test_compact_nows_time_is_the_sessions_active_time(company, fake_anthropic):
    agent = context_agent(company, keep_recent_turns=1)
    for i in range(3):
        beat(agent, f"step {i}: " + "x" * 400)
    session = AgentSession.objects.get(agent=agent)
    fake_anthropic.push(Reply.delay(0.3))
    now = timezone.now()

    record = session_compact(session=session, now=now)

    run = record.run
    assert (run.finished_at - run.started_at).total_seconds() >= 0.3
    active = session.active_seconds
    session.refresh_from_db()
    assert session.active_seconds == pytest.approx(active + (run.finished_at - run.started_at).total_seconds())
    assert session.expires_at == run.finished_at + agent.session_ttl
