"""Compact now (`sessions_app.compact_now`) racing the rest of the world: a heartbeat that
arrives while the summary is written waits, and runs after it, losing no turn."""

from __future__ import annotations

import pytest
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from paperclip.errors import RunFailure
from sessions_app.compact_now import session_compact
from sessions_app.heartbeat import heartbeat_execute
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus, RunTrigger
from sessions_app.stores import store_for
from sessions_app.tasks import scheduled_heartbeat
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
def test_a_scheduled_wake_during_compact_now_is_queued_not_absorbed(company, fake_anthropic):
    """A tick arriving while the compaction's summary is written is not counted on the
    compaction's run (which does no task): it queues its own run, which runs afterwards."""
    agent = context_agent(company, keep_recent_turns=1, heartbeat_task="Send the daily report.")
    for i in range(3):
        assert beat(agent, f"step {i}: " + "x" * 400).status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    ticks = []
    fake_anthropic.push(Reply(before=on_own_connection(lambda: ticks.append(scheduled_heartbeat(str(agent.id))))))

    record = session_compact(session=session, now=timezone.now())

    assert fake_anthropic.action_errors == []
    assert ticks == [RunStatus.QUEUED]
    assert HeartbeatRun.objects.get(pk=record.run_id).merged_ticks == 0
    (tick,) = HeartbeatRun.objects.filter(agent=agent, trigger=RunTrigger.SCHEDULE)
    assert (tick.status, tick.task) == (RunStatus.QUEUED, "Send the daily report.")
    assert heartbeat_execute(run_id=tick.id).status == RunStatus.SUCCEEDED  # as dispatched after it
    assert user_turns(session)[-1] == "Send the daily report."


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
