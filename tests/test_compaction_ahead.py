"""Compaction after the commit: a heartbeat leaving its session near the budget queues the
summary for the cluster, the next heartbeat sends only its own call, and the queued summary
races the heartbeats (one arriving while it is written waits and loses no turn; a summary
of a session that moved on is not made)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus, RunTrigger
from sessions_app.services import session_delete
from sessions_app.stores import store_for
from tests.conftest import (
    beat,
    context_agent,
    is_summary_request,
    on_own_connection,
    run_queued_tasks,
    user_turns,
)
from tests.fake_anthropic import Reply, plain_messages

BUDGET = 1000


def near_the_budget(company, fake):
    """An agent beaten until a commit queued its summary; none was made in band."""
    agent = context_agent(company, context_budget_tokens=BUDGET, keep_recent_turns=1)
    for i in range(10):
        assert beat(agent, f"step {i}: " + "x" * 400).status == RunStatus.SUCCEEDED
        if queued_compactions():
            break
    assert queued_compactions(), "no commit queued a summary"
    assert not [body for body in fake.message_requests if is_summary_request(body)]
    return agent


def queued_compactions() -> list:
    from django_q.models import OrmQ

    return [task for task in OrmQ.objects.all() if task.func() == "sessions_app.tasks.compact_ahead"]


def test_a_commit_near_the_budget_queues_the_summary_and_the_next_heartbeat_sends_only_its_call(
    company, fake_anthropic
):
    agent = near_the_budget(company, fake_anthropic)
    session = AgentSession.objects.get(agent=agent)
    turns_before = user_turns(session)

    (result,) = run_queued_tasks()  # what the cluster does after the commit

    assert result.startswith("compacted"), result
    session.refresh_from_db()
    assert session.compaction_count == 1
    compaction = session.compactions.get()
    run = compaction.run
    assert (run.trigger, run.status) == (RunTrigger.COMPACTION, RunStatus.SUCCEEDED)
    assert CostEvent.objects.filter(run=run, kind=CostKind.COMPACTION).count() == 1
    fake_anthropic.reset_log()

    after = beat(agent, "the next turn")

    assert after.status == RunStatus.SUCCEEDED
    (request,) = fake_anthropic.message_requests  # no summary waited on
    assert not is_summary_request(request)
    assert "summary" in str(plain_messages(request)[0]).lower()
    assert user_turns(session)[-1] == "the next turn"
    assert [t for t in user_turns(session) if t in turns_before][-1] == turns_before[-1]  # the tail kept


def test_a_queued_summary_of_a_session_that_moved_on_is_not_made(company, fake_anthropic):
    """The cluster was late: the next heartbeat did not fit and summarised in band. The
    queued summary then names a session that has changed, and is not paid for again."""
    agent = near_the_budget(company, fake_anthropic)
    assert beat(agent, "a turn after the commit that queued it: " + "z" * 400).status == RunStatus.SUCCEEDED
    assert AgentSession.objects.get(agent=agent).compaction_count == 1

    assert run_queued_tasks() == ["skipped: the session changed or ended since"]

    assert AgentSession.objects.get(agent=agent).compaction_count == 1
    assert sum(1 for body in fake_anthropic.message_requests if is_summary_request(body)) == 1


def test_a_queued_summary_of_a_session_deleted_since_its_commit_is_not_made(company, fake_anthropic):
    """The commit hands its own counts to the queue without reading the row again; a
    deletion after it is the task's to see."""
    agent = near_the_budget(company, fake_anthropic)
    session_delete(session=AgentSession.objects.get(agent=agent), now=timezone.now())

    assert run_queued_tasks() == ["skipped: the session changed or ended since"]

    assert not HeartbeatRun.objects.filter(agent=agent, trigger=RunTrigger.COMPACTION).exists()
    assert not [body for body in fake_anthropic.message_requests if is_summary_request(body)]


def test_sixty_heartbeats_with_the_cluster_between_them_never_wait_on_a_summary(company, fake_anthropic):
    agent = context_agent(company, context_budget_tokens=BUDGET, keep_recent_turns=2)
    tasks = [f"step {i}: continue the migration of module {i % 7}, " + "y" * 200 for i in range(60)]

    for task in tasks:
        assert beat(agent, task).status == RunStatus.SUCCEEDED
        run_queued_tasks()

    session = AgentSession.objects.get(agent=agent)
    assert session.compaction_count >= 3
    heartbeats = HeartbeatRun.objects.filter(agent=agent).exclude(trigger=RunTrigger.COMPACTION)
    assert heartbeats.count() == 60
    # Every summary was made by a compaction's own run, none inside a heartbeat.
    summaries = CostEvent.objects.filter(kind=CostKind.COMPACTION)
    assert summaries.count() == session.compaction_count
    assert not summaries.filter(run__in=heartbeats).exists()
    assert [t for t in user_turns(session) if t.startswith("step")][-1] == tasks[-1]
    record = [m for c in session.compactions.order_by("created_at") for m in c.archived_messages]
    record += store_for(session).read(session)
    assert [m["content"] for m in record if m.get("role") == "user" and m.get("kind") is None] == tasks


def test_a_failing_queued_summary_changes_nothing_and_the_next_heartbeat_still_fits(company, fake_anthropic):
    agent = near_the_budget(company, fake_anthropic)
    session = AgentSession.objects.get(agent=agent)
    before = store_for(session).read(session)
    fake_anthropic.push(Reply.error(400, "summary refused"))

    (result,) = run_queued_tasks()

    assert result == "failed: compaction_model_bad_request"
    session.refresh_from_db()
    assert (session.compaction_count, store_for(session).read(session)) == (0, before)
    failed = HeartbeatRun.objects.get(agent=agent, trigger=RunTrigger.COMPACTION)
    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "compaction_model_bad_request")
    assert beat(agent, "the next turn").status == RunStatus.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_arriving_while_the_queued_summary_is_written_waits_and_loses_no_turn(
    file_store, company, fake_anthropic
):
    agent = near_the_budget(company, fake_anthropic)
    racing = []
    # Another worker takes the next heartbeat while the cluster writes the summary.
    fake_anthropic.push(Reply(before=on_own_connection(lambda: racing.append(beat(agent, "racing turn")))))

    results = run_queued_tasks()

    (run,) = racing
    assert run.status == RunStatus.QUEUED  # the compaction is the session's one writer
    assert results[0].startswith("compacted"), results
    # The compaction's end dispatched the waiting heartbeat; the worker above ran it.
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, (run.status, run.error_code, results)
    session = AgentSession.objects.get(agent=agent)
    assert session.compaction_count == 1
    assert user_turns(session)[-1] == "racing turn"
    assert len(store_for(session).read(session)) == session.message_count


def test_a_heartbeat_committing_between_the_queued_summarys_check_and_its_run_costs_no_second_summary(
    company, fake_anthropic, monkeypatch
):
    """The worst moment: the task found the session as the commit left it, then another
    worker's heartbeat compacted it in band and committed before the compaction's run was
    inserted. Once its run is the session's one writer, the task sees the change and ends
    the run without a model call."""
    import sessions_app.compact_now as compact_now

    agent = near_the_budget(company, fake_anthropic)
    racing, summaries_by_then = [], []
    real_compaction_run = compact_now.compaction_run

    def after_a_racing_heartbeat(*args, **kwargs):
        if not racing:
            racing.append(beat(agent, "a turn that commits in the gap: " + "z" * 400))
            summaries_by_then.append(sum(1 for body in fake_anthropic.message_requests if is_summary_request(body)))
        return real_compaction_run(*args, **kwargs)

    monkeypatch.setattr(compact_now, "compaction_run", after_a_racing_heartbeat)

    results = run_queued_tasks()

    (heartbeat,) = racing
    assert heartbeat.status == RunStatus.SUCCEEDED
    assert summaries_by_then == [1]  # the racing heartbeat summarised in band
    assert results == ["skipped: the session changed since the commit that asked for its summary"]
    assert sum(1 for body in fake_anthropic.message_requests if is_summary_request(body)) == 1
    ahead = HeartbeatRun.objects.get(agent=agent, trigger=RunTrigger.COMPACTION)
    assert (ahead.status, ahead.cost_usd or 0, ahead.reserved_usd or 0) == (RunStatus.SKIPPED, 0, 0)
    assert not CostEvent.objects.filter(run=ahead).exists()
    assert CostEvent.objects.filter(kind=CostKind.COMPACTION).count() == 1
    session = AgentSession.objects.get(agent=agent)
    assert session.compaction_count == 1
    assert user_turns(session)[-1].startswith("a turn that commits in the gap")
