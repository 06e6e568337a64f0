"""One writer per agent, proven with real threads and connections on PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.utils import timezone

from costs_app.models import CostEvent
from sessions_app.heartbeat import heartbeat_enqueue, heartbeat_wait
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus
from sessions_app.stores import store_for
from tests.fake_anthropic import Reply

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("postgres_only"),
]


def test_concurrent_heartbeats_lose_no_turn_and_never_interleave(persistent_agent, fake_anthropic):
    # Each answer takes a moment, so the threads really overlap.
    fake_anthropic.push(*[Reply.delay(0.05) for _ in range(12)])
    tasks = [f"task {i}" for i in range(12)]
    errors = []

    def fire(task):
        try:
            run, _ = heartbeat_enqueue(agent=persistent_agent, task=task, now=timezone.now())
            heartbeat_wait(run_id=run.id, timeout_seconds=60)
        except Exception as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=fire, args=(task,)) for task in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert errors == []
    assert set(HeartbeatRun.objects.values_list("status", flat=True)) == {RunStatus.SUCCEEDED}
    session = AgentSession.objects.get()
    history = store_for(session).read(session)
    assert len(history) == 24 == session.message_count
    assert [m["role"] for m in history] == ["user", "assistant"] * 12
    assert sorted(m["content"] for m in history if m["role"] == "user") == sorted(tasks)
    # Never interleaved: each answer directly follows its own task, from the same run.
    for user, assistant in zip(history[::2], history[1::2], strict=True):
        assert user["run_id"] == assistant["run_id"]
    # Request k saw exactly the 2k-1 messages that existed when it ran.
    assert sorted(len(body["messages"]) for body in fake_anthropic.message_requests) == list(range(1, 24, 2))
    assert CostEvent.objects.count() == 12
