"""Compaction steps racing the rest of the world (a reaper, a delete, a failing COMMIT or
rename): a failure of either the database or the history file leaves the session whole.
The policy is tested in test_context.py."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from sessions_app.maintenance import runs_reap
from sessions_app.models import Agent, AgentSession, HeartbeatRun, RunStatus
from sessions_app.services import session_delete
from sessions_app.stores import store_for
from tests.conftest import beat, on_own_connection, user_turns
from tests.fake_anthropic import Reply


def compacting_agent(company) -> Agent:
    """Three turns of 400 characters fit its budget; a 2400-character task forces a summary."""
    agent = Agent.objects.create(
        company=company,
        name="ctx",
        adapter_config={
            "model": "claude-opus-4-5",
            "session_mode": "persistent",
            "context_budget_tokens": 1000,
            "keep_recent_turns": 1,
        },
    )
    for _ in range(3):
        assert beat(agent, "x" * 400).status == RunStatus.SUCCEEDED
    return agent


@pytest.mark.django_db(transaction=True)
def test_a_compaction_whose_commit_fails_leaves_the_old_file_and_the_next_heartbeat_compacts_again(
    file_store, company, fake_anthropic, refuse_at_commit
):
    agent = compacting_agent(company)
    session = AgentSession.objects.get(agent=agent)
    path = store_for(session).path_for(session)
    before = path.read_bytes()
    allow = refuse_at_commit("agent_sessions", when="NEW.compaction_count > OLD.compaction_count")

    failed = beat(agent, "y" * 2400)

    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "internal_error")
    assert path.read_bytes() == before
    session.refresh_from_db()
    assert (session.compaction_count, session.message_count) == (0, 6)
    allow()
    run = beat(agent, "z" * 2400)
    assert (run.status, run.error_code) == (RunStatus.SUCCEEDED, ""), run.error
    session.refresh_from_db()
    assert session.compaction_count == 1
    assert user_turns(session)[-1] == "z" * 2400


def test_a_compaction_whose_rename_fails_after_the_commit_loses_nothing(
    file_store, company, fake_anthropic, monkeypatch
):
    agent = compacting_agent(company)
    session = AgentSession.objects.get(agent=agent)
    real_replace = os.replace
    failures = []

    def replace_fails_once(*args, **kwargs):
        if not failures:
            failures.append(args)
            raise OSError(5, "Input/output error")
        return real_replace(*args, **kwargs)

    monkeypatch.setattr("sessions_app.stores.os.replace", replace_fails_once)

    run = beat(agent, "y" * 2400)

    assert (run.status, run.error_code) == (RunStatus.SUCCEEDED, ""), run.error
    assert failures, "the compaction's rename was never attempted"
    session.refresh_from_db()
    assert session.compaction_count == 1
    history = store_for(session).read(session)
    assert len(history) == session.message_count
    assert json.loads(store_for(session).path_for(session).read_text())["messages"] == history
    assert history[-2]["content"] == "y" * 2400
    assert [p.name for p in store_for(session).path_for(session).parent.iterdir()] == [f"{session.public_id}.json"]
    assert beat(agent, "again").status == RunStatus.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_a_run_reaped_during_its_summary_commits_nothing_and_still_bills_it(file_store, company, fake_anthropic):
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
    file_store, company, fake_anthropic, paperclip_home
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
