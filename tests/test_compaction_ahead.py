"""Compaction after the commit: a heartbeat leaving its session near the budget queues the
summary for the cluster, the next heartbeat sends only its own call, and the queued summary
races the heartbeats (one arriving while it is written goes ahead on the whole history, or
waits in the queue when that would not fit the model's window; the summary commits only
from the agent's place, keeping the turns made beside it; a summary of a session that moved
on is not made)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from sessions_app.models import AgentSession, BesideState, HeartbeatRun, RunStatus, RunTrigger
from sessions_app.services import session_delete
from sessions_app.stores import store_for
from tests.conftest import (
    Actor,
    beat,
    catalogue_stored,
    context_agent,
    is_summary_request,
    on_own_connection,
    run_queued_tasks,
    user_turns,
)
from tests.fake_anthropic import CATALOGUE, Reply, plain_messages

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
def test_a_heartbeat_arriving_while_the_queued_summary_is_written_goes_ahead_and_the_summary_keeps_its_turn(
    file_store, company, fake_anthropic
):
    agent = near_the_budget(company, fake_anthropic)
    session = AgentSession.objects.get(agent=agent)
    before = store_for(session).read(session)
    racing = []
    # Another worker takes the next heartbeat while the cluster writes the summary.
    fake_anthropic.push(Reply(before=on_own_connection(lambda: racing.append(beat(agent, "racing turn")))))

    results = run_queued_tasks()

    (run,) = racing
    assert run.status == RunStatus.SUCCEEDED  # it did not wait for the summary
    (request,) = [body for body in fake_anthropic.message_requests if "racing turn" in str(body)]
    assert len(plain_messages(request)) == len(before) + 1  # on the whole history, unsummarised
    assert results[0].startswith("compacted"), results
    session.refresh_from_db()
    history = store_for(session).read(session)
    assert (session.compaction_count, history[0]["kind"], len(history)) == (1, "summary", session.message_count)
    assert user_turns(session)[-1] == "racing turn"  # the summary kept the turn made beside it
    assert session.compactions.get().messages_before == len(before) + 2
    assert sum(1 for body in fake_anthropic.message_requests if is_summary_request(body)) == 1


def union_seconds(runs) -> float:
    """The time at least one of `runs` was in progress."""
    total, end = 0.0, None
    for started, finished in sorted(runs.values_list("started_at", "finished_at")):
        if end is None or started >= end:
            total, end = total + (finished - started).total_seconds(), finished
        elif finished > end:
            total, end = total + (finished - end).total_seconds(), finished
    return total


@pytest.mark.django_db(transaction=True)
def test_a_summary_commits_only_once_the_heartbeat_beside_it_has_ended_and_claims_wait_for_it(company, fake_anthropic):
    """The worst moment for the summary: its answer arrives while a heartbeat's call is in
    flight. It waits for the agent's place, no heartbeat is claimed meanwhile (back to back
    they would keep it waiting for ever), and it commits on top of the heartbeat's turn; the
    time both were in progress is counted once."""
    agent = near_the_budget(company, fake_anthropic)
    session = AgentSession.objects.get(agent=agent)
    active_before, since = session.active_seconds, timezone.now()
    beside = Actor(lambda: beat(agent, "turn beside the summary"))

    def start_the_heartbeat_and_wait_for_its_call():
        beside.start()
        while not any("turn beside the summary" in str(body) for body in fake_anthropic.message_requests):
            time.sleep(0.01)

    # The summary's answer, then the heartbeat's, which takes a second.
    fake_anthropic.push(Reply(before=start_the_heartbeat_and_wait_for_its_call), Reply.delay(1.0))
    cluster = Actor(run_queued_tasks)
    cluster.start()
    waiting = HeartbeatRun.objects.filter(trigger=RunTrigger.COMPACTION, beside=BesideState.WAITING)
    deadline = time.monotonic() + 30
    while not waiting.exists():
        assert time.monotonic() < deadline, "the summary never waited for the place"
        time.sleep(0.01)

    held_back = beat(agent, "a heartbeat while the summary waits")

    assert held_back.status == RunStatus.QUEUED
    assert beside.result().status == RunStatus.SUCCEEDED
    results = cluster.result()
    assert results[0].startswith("compacted"), results
    held_back.refresh_from_db()
    assert held_back.status == RunStatus.SUCCEEDED  # dispatched by the summary's end
    session.refresh_from_db()
    assert session.compaction_count == 1
    assert user_turns(session)[-2:] == ["turn beside the summary", "a heartbeat while the summary waits"]
    # The held-back heartbeat was sent the summary, not the history it replaced.
    (request,) = [body for body in fake_anthropic.message_requests if "while the summary waits" in str(body)]
    assert "summary" in str(plain_messages(request)[0]).lower()
    runs = HeartbeatRun.objects.filter(session=session, created_at__gte=since)
    assert runs.count() == 3
    assert session.active_seconds - active_before == pytest.approx(union_seconds(runs), abs=1e-4)


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_that_would_not_fit_the_window_without_the_summary_waits_for_it_in_the_queue(
    company, fake_anthropic
):
    """The model's window is 1,200 tokens here: the history near its 1,000-token budget and
    a 700-token task fit only once the summary is made (and then within the budget)."""
    catalogue_stored(
        [{**entry, "max_input_tokens": 1200} if entry["id"] == "claude-opus-4-5" else entry for entry in CATALOGUE]
    )
    agent = near_the_budget(company, fake_anthropic)
    active_before, since = AgentSession.objects.get(agent=agent).active_seconds, timezone.now()
    racing = []
    big_task = "a task the window holds only beside a summary: " + "w" * 2700
    fake_anthropic.push(Reply(before=on_own_connection(lambda: racing.append(beat(agent, big_task)))))

    results = run_queued_tasks()

    (run,) = racing
    assert run.status == RunStatus.QUEUED  # back in the queue, behind the summary
    assert results[0].startswith("compacted"), results
    run.refresh_from_db()
    assert (run.status, run.quota_requeues) == (RunStatus.SUCCEEDED, 0), (run.status, run.error_code)
    bodies = fake_anthropic.message_requests
    (sent,) = [index for index, body in enumerate(bodies) if big_task in str(body)]
    assert "summary" in str(plain_messages(bodies[sent])[0]).lower()
    assert sum(1 for body in bodies[:sent] if is_summary_request(body)) == 1  # none of its own
    assert not CostEvent.objects.filter(run=run, kind=CostKind.COMPACTION).exists()
    # The attempt put back in the queue lay inside the summary's time: counted once.
    session = AgentSession.objects.get(agent=agent)
    runs = HeartbeatRun.objects.filter(session=session, created_at__gte=since)
    assert session.active_seconds - active_before == pytest.approx(union_seconds(runs), abs=1e-4)
    assert user_turns(AgentSession.objects.get(agent=agent))[-1] == big_task


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


def test_a_queued_summary_is_not_written_beside_a_heartbeat_parked_in_a_batch(company, fake_anthropic):
    """A parked heartbeat holds the agent's place until its batch answers (hours): a summary
    beside it would be paid for and then wait that out. It is refused before any call."""
    agent = near_the_budget(company, fake_anthropic)
    HeartbeatRun.objects.create(
        company=company, agent=agent, status=RunStatus.SUBMITTED, task="parked", delivery="batch"
    )

    assert run_queued_tasks() == ["skipped: session_busy"]

    assert not [body for body in fake_anthropic.message_requests if is_summary_request(body)]
    assert not HeartbeatRun.objects.filter(agent=agent, trigger=RunTrigger.COMPACTION).exists()


def test_a_summary_that_cannot_take_the_place_by_its_deadline_gives_up_and_changes_nothing(
    company, fake_anthropic, settings
):
    """A heartbeat holds the agent's place past the summary's deadline: the summary, billed,
    is not kept; its run fails `session_busy` and the session is as it was."""
    settings.PAPERCLIP_RUN_TIMEOUT_SECONDS = 1
    agent = near_the_budget(company, fake_anthropic)
    agent.adapter_config = {**agent.adapter_config, "timeout_seconds": 0.5, "max_retries": 0}
    agent.save()
    session = AgentSession.objects.get(agent=agent)
    before = store_for(session).read(session)
    now = timezone.now()
    HeartbeatRun.objects.create(
        company=company,
        agent=agent,
        status=RunStatus.RUNNING,
        task="stuck",
        started_at=now,
        deadline_at=now + timedelta(hours=1),
    )
    started = time.monotonic()

    assert run_queued_tasks() == ["skipped: session_busy"]

    assert time.monotonic() - started < 30
    ahead = HeartbeatRun.objects.get(agent=agent, trigger=RunTrigger.COMPACTION)
    assert (ahead.status, ahead.error_code, ahead.beside) == (RunStatus.FAILED, "session_busy", BesideState.WAITING)
    assert CostEvent.objects.filter(run=ahead, kind=CostKind.COMPACTION).count() == 1
    assert ahead.cost_usd == CostEvent.objects.get(run=ahead).cost_usd > 0
    session.refresh_from_db()
    assert (session.compaction_count, store_for(session).read(session)) == (0, before)
