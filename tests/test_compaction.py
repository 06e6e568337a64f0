"""Compaction steps racing the rest of the world (the policy is tested in test_context.py)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from sessions_app.heartbeat import heartbeat_enqueue, heartbeat_execute
from sessions_app.models import Agent, AgentSession, RunStatus
from sessions_app.services import session_delete
from tests.conftest import on_own_connection
from tests.fake_anthropic import Reply


def beat(agent, task):
    run, _ = heartbeat_enqueue(agent=agent, task=task, now=timezone.now())
    return heartbeat_execute(run_id=run.id)


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
