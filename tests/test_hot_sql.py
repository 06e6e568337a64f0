"""The hot path's single statements against a second actor at their worst moment: a
stateless run's one-statement commit (`agent_not_deleted_locked`) while an agent's deletion
is open, uncommitted, on another connection (PostgreSQL: SQLite runs one writer at a time)."""

from __future__ import annotations

import threading

import pytest
from django.db import transaction
from django.utils import timezone

from costs_app.models import CostEvent
from sessions_app.models import Agent, AgentStatus, HeartbeatRun, RunStatus
from sessions_app.services import agent_delete
from tests.conftest import Actor, beat, wait_until_blocked
from tests.fake_anthropic import Reply


@pytest.mark.django_db(transaction=True)
def test_a_stateless_commit_waits_for_an_open_deletion_of_its_agent_and_then_fails_agent_deleted(
    postgres_only, stateless_agent, fake_anthropic
):
    locked, release = threading.Event(), threading.Event()

    def delete_and_hold() -> None:
        # The deletion has written the agent's row and not committed when the answer arrives.
        with transaction.atomic():
            agent_delete(agent=Agent.objects.get(pk=stateless_agent.pk), now=timezone.now())
            locked.set()
            assert release.wait(30), "the test never released the deletion"

    deletion = Actor(delete_and_hold)
    fake_anthropic.push(Reply.during(lambda: (deletion.start(), locked.wait(30))))
    heartbeat = Actor(lambda: beat(stateless_agent, "one"))
    heartbeat.start()

    wait_until_blocked(heartbeat)  # its commit's UPDATE waits for the deletion's row lock
    assert HeartbeatRun.objects.get(agent=stateless_agent).status == RunStatus.RUNNING
    release.set()
    deletion.result()
    run = heartbeat.result()

    assert (run.status, run.error_code) == (RunStatus.FAILED, "agent_deleted")
    assert Agent.objects.get(pk=stateless_agent.pk).status == AgentStatus.DELETED
    assert CostEvent.objects.get(run=run).kind == "message"  # the answered call stays billed
