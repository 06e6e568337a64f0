"""Compaction commits against the history file: a summary's new history is published only
after its COMMIT, so a failure of either leaves the session whole."""

from __future__ import annotations

import json
import os

import pytest
from django.utils import timezone

from sessions_app.heartbeat import heartbeat_enqueue, heartbeat_execute
from sessions_app.models import Agent, AgentSession, HistoryStore, RunStatus
from sessions_app.stores import store_for


@pytest.fixture(autouse=True)
def file_store(settings):
    settings.PAPERCLIP_SESSION_STORE = HistoryStore.FILE


def beat(agent, task):
    run, _ = heartbeat_enqueue(agent=agent, task=task, now=timezone.now())
    return heartbeat_execute(run_id=run.id)


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


def user_turns(session) -> list:
    session.refresh_from_db()
    return [m["content"] for m in store_for(session).read(session) if m["role"] == "user"]


@pytest.mark.django_db(transaction=True)
def test_a_compaction_whose_commit_fails_leaves_the_old_file_and_the_next_heartbeat_compacts_again(
    company, fake_anthropic, refuse_at_commit
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


def test_a_compaction_whose_rename_fails_after_the_commit_loses_nothing(company, fake_anthropic, monkeypatch):
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
