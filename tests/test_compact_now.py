"""Compact now (`sessions_app.compact_now`) racing the rest of the world: a heartbeat that
arrives while the summary is written waits, and runs after it, losing no turn."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from paperclip.errors import RunFailure
from sessions_app.compact_now import COMPACT_TASK, session_compact
from sessions_app.heartbeat import heartbeat_execute
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus, RunTrigger, SessionStatus
from sessions_app.run_queue import claim_run, heartbeat_enqueue
from sessions_app.stores import store_for
from sessions_app.tasks import scheduled_heartbeat
from tests.admin.conftest import conversation, make_session
from tests.conftest import (
    beat,
    compacting_agent,
    context_agent,
    is_summary_request,
    on_own_connection,
    summary_text,
    user_turns,
)
from tests.fake_anthropic import Reply
from tests.live.server import wait_until


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


def three_turn_agents(company, count: int) -> list:
    agents = [context_agent(company, keep_recent_turns=1) for _ in range(count)]
    for agent in agents:
        for i in range(3):
            beat(agent, f"step {i}: " + "x" * 400)
    return agents


@pytest.mark.django_db(transaction=True)
def test_compact_now_is_refused_while_the_cap_on_runs_in_progress_is_full(settings, company, fake_anthropic):
    """Under PAPERCLIP_MAX_CONCURRENT_RUNS=1, compact now asked (on its own connection) while
    another agent's heartbeat is in progress is refused `run_cap_reached` with no request
    (before, its run was inserted `running` beside it: two in progress under a cap of 1)."""
    busy, compacted = three_turn_agents(company, 2)
    settings.PAPERCLIP_MAX_CONCURRENT_RUNS = 1
    session = AgentSession.objects.get(agent=compacted)
    refused, running = [], []

    def compact_meanwhile():
        running.append(HeartbeatRun.objects.filter(status=RunStatus.RUNNING).count())
        try:
            session_compact(session=session, now=timezone.now())
        except RunFailure as failure:
            refused.append(failure.code)
        running.append(HeartbeatRun.objects.filter(status=RunStatus.RUNNING).count())

    fake_anthropic.push(Reply(before=on_own_connection(compact_meanwhile)))
    requests = len(fake_anthropic.message_requests)

    assert beat(busy, "busy").status == RunStatus.SUCCEEDED

    assert fake_anthropic.action_errors == []
    assert (refused, running) == (["run_cap_reached"], [1, 1])
    assert len(fake_anthropic.message_requests) == requests + 1  # the heartbeat's answer only
    assert not HeartbeatRun.objects.filter(agent=compacted, task=COMPACT_TASK).exists()
    session_compact(session=session, now=timezone.now())  # a place is free again
    session.refresh_from_db()
    assert session.compaction_count == 1


@pytest.mark.usefixtures("postgres_only")
@pytest.mark.django_db(transaction=True)
def test_a_claim_counting_while_compact_nows_run_is_uncommitted_waits_for_it(settings, company, fake_anthropic):
    """The compaction's insert of its `running` run is held uncommitted by a sleeping
    trigger while another agent's run is claimed: the claim waits for the cap's lock and is
    refused (without it, it saw a free place and both ran)."""
    compacted, other = three_turn_agents(company, 2)
    settings.PAPERCLIP_MAX_CONCURRENT_RUNS = 1
    session = AgentSession.objects.get(agent=compacted)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION slow_insert() RETURNS trigger AS $$ BEGIN PERFORM pg_sleep(1); RETURN NEW; END $$ "
            "LANGUAGE plpgsql; CREATE TRIGGER slow_insert BEFORE INSERT ON heartbeat_runs "
            "FOR EACH ROW WHEN (NEW.status = 'running') EXECUTE FUNCTION slow_insert();"
        )
    outcomes = {}

    def compact():
        try:
            outcomes["compacted"] = session_compact(session=session, now=timezone.now()).messages_before
        finally:
            connection.close()

    try:
        compacting = threading.Thread(target=compact)
        compacting.start()
        wait_until(
            lambda: backend_running('INSERT INTO "heartbeat_runs"%'), 15, "the compaction's insert to be running"
        )
        queued, _ = heartbeat_enqueue(agent=other, task="go", now=timezone.now())
        outcomes["claimed"] = claim_run(run_id=queued.id, now=timezone.now())[1]
        compacting.join(30)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER slow_insert ON heartbeat_runs; DROP FUNCTION slow_insert();")
    assert outcomes == {"claimed": False, "compacted": 6}
    queued.refresh_from_db()
    assert queued.status == RunStatus.QUEUED


def backend_running(statement_like: str) -> bool:
    """Whether another connection is running a statement like `statement_like` (PostgreSQL)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND query LIKE %s "
            "AND state = 'active' AND pid <> pg_backend_pid()",
            [statement_like],
        )
        return cursor.fetchone() is not None


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        (42, "a JSON number, not an object"),
        ("turn", "a JSON string, not an object"),
        (None, "a JSON null, not an object"),
        ([1, "str", None], "a JSON array, not an object"),
        ({"role": "system", "content": "Be brief."}, "its role is not 'user' or 'assistant'"),
        ({"role": "user", "content": 7}, "its content is not a text or a list of blocks"),
    ],
    ids=["number", "string", "null", "array", "role", "content"],
)
def test_compact_now_refuses_a_history_with_an_entry_that_is_not_a_turn_before_any_call(
    company, fake_anthropic, entry, why
):
    agent = context_agent(company, keep_recent_turns=1)
    history = conversation(12)
    history.insert(3, entry)  # as a damaged or hand-edited history holds it
    session = make_session(agent, history=history, status=SessionStatus.ACTIVE)

    with pytest.raises(RunFailure) as refused:
        session_compact(session=session, now=timezone.now())

    assert (refused.value.code, refused.value.message) == (
        "history_malformed",
        f"The session's history cannot be compacted: entry 4 is not a turn ({why}).",
    )
    assert fake_anthropic.message_requests == []  # nothing paid for
    run = HeartbeatRun.objects.get(agent=agent)
    assert (run.status, run.error_code) == (RunStatus.FAILED, "history_malformed")
    session.refresh_from_db()
    assert (session.compaction_count, store_for(session).read(session)) == (0, history)


def test_compact_now_sends_blocks_it_cannot_read_as_text_as_json(company, fake_anthropic):
    agent = context_agent(company, keep_recent_turns=1)
    odd = {"role": "assistant", "content": [5, {"type": "text", "text": ["not text"]}, {"type": "compaction"}]}
    session = make_session(agent, history=[*conversation(3), odd, *conversation(2)], status=SessionStatus.ACTIVE)

    record = session_compact(session=session, now=timezone.now())

    (request,) = [body for body in fake_anthropic.message_requests if is_summary_request(body)]
    # The compaction block without content reads as an empty line.
    assert summary_text(request).endswith('[assistant]\n5\n{"type": "text", "text": ["not text"]}\n')
    assert record.messages_before == 6
