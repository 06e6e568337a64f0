"""Compaction steps racing the rest of the world: a reaper, a delete (the policy is tested in
test_context.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from sessions_app.expiry import runs_reap
from sessions_app.heartbeat import heartbeat_enqueue, heartbeat_execute
from sessions_app.models import Agent, AgentSession, HeartbeatRun, RunStatus
from sessions_app.services import session_delete
from sessions_app.stores import store_for
from tests.conftest import on_own_connection
from tests.fake_anthropic import Reply


def beat(agent, task):
    run, _ = heartbeat_enqueue(agent=agent, task=task, now=timezone.now())
    return heartbeat_execute(run_id=run.id)


@pytest.mark.django_db(transaction=True)
def test_a_run_reaped_during_its_summary_commits_nothing_and_still_bills_it(company, fake_anthropic):
    agent = Agent.objects.create(
        company=company,
        name="long-running",
        adapter_config={
            "model": "claude-opus-4-5",
            "session_mode": "persistent",
            "context_budget_tokens": 1000,
            "keep_recent_turns": 1,
        },
    )
    for i in range(3):
        assert beat(agent, f"step {i}: " + "w" * 1200).status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    history = store_for(session).read(session)
    sent = len(fake_anthropic.message_requests)

    def reaper():
        runs_reap(now=timezone.now() + timedelta(days=1))
        connection.close()

    # This turn needs a summary first; the reaper fails the run while it is written.
    fake_anthropic.push(Reply(before=reaper))
    run = beat(agent, "step 3: " + "w" * 1200)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "run_timeout")
    after = AgentSession.objects.get(pk=session.pk)
    assert (after.message_count, after.compaction_count) == (session.message_count, session.compaction_count)
    assert store_for(after).read(after) == history
    assert len(fake_anthropic.message_requests) == sent + 1  # the summary, never the answer
    summary = CostEvent.objects.get(run=run)
    assert (summary.kind, summary.call_number) == (CostKind.COMPACTION, 1)
    assert HeartbeatRun.objects.get(id=run.id).error_code == "run_timeout"


@pytest.mark.django_db(transaction=True)
def test_a_session_deleted_during_its_summary_call_fails_the_run_as_session_deleted(
    company, fake_anthropic, paperclip_home
):
    agent = Agent.objects.create(
        company=company,
        name="ctx",
        adapter_config={"session_mode": "persistent", "context_budget_tokens": 1000, "keep_recent_turns": 1},
    )
    for _ in range(3):
        beat(agent, "x" * 400)
    session = AgentSession.objects.get(agent=agent)
    fake_anthropic.push(Reply.during(on_own_connection(lambda: session_delete(session=session, now=timezone.now()))))

    run = beat(agent, "y" * 2400)

    assert fake_anthropic.action_errors == []
    assert (run.status, run.error_code) == (RunStatus.FAILED, "session_deleted")
    assert not AgentSession.objects.filter(agent=agent).exists()
    assert list(paperclip_home.rglob("*.json*")) == []  # no history file, no staged one
    assert CostEvent.objects.get(run=run).kind == CostKind.COMPACTION  # the summary was billed
    assert beat(agent, "again").status == RunStatus.SUCCEEDED
