"""The histories a process keeps between heartbeats (PostgreSQL): the revision the database
moves with every write of a history, the next heartbeat's read that leaves a kept history
out, and the writers that must make it read the row again: an operator's edit between two
heartbeats, and one committed while the model answers."""

from __future__ import annotations

import json

import pytest
from django.db import connection

from sessions_app import history_cache
from sessions_app.models import AgentSession, RunStatus
from sessions_app.plan import LiveSessionRead
from tests.conftest import beat, on_own_connection
from tests.fake_anthropic import Reply

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def nothing_kept():
    history_cache.forget_all()
    yield
    history_cache.forget_all()


def edited(history: list) -> list:
    """`history` with its first message's text changed and every count as it was."""
    return [{**history[0], "content": "edited by the operator"}, *history[1:]]


def sent_history(fake_anthropic) -> list:
    """The messages the last request replayed, before its new task."""
    return fake_anthropic.message_requests[-1]["messages"][:-1]


def test_every_update_that_sets_the_history_moves_its_revision_and_no_other_does(postgres_only, persistent_agent):
    session = AgentSession.objects.create(agent=persistent_agent, company=persistent_agent.company)
    rows = AgentSession.objects.filter(pk=session.pk)

    rows.update(history=[{"role": "user", "content": "a"}])
    session.refresh_from_db()
    session.save()  # a save() writes every field, the history among them
    with connection.cursor() as cursor:
        cursor.execute("UPDATE agent_sessions SET history = '[]'::jsonb WHERE id = %s", [session.pk])
    rows.update(turn_count=5)

    assert rows.get().history_rev == 3


def test_a_persistent_heartbeat_keeps_the_history_it_wrote_and_the_next_one_is_not_sent_it(
    postgres_only, persistent_agent, fake_anthropic
):
    for task in ("one", "two", "three"):
        assert beat(persistent_agent, task).status == RunStatus.SUCCEEDED
    stored = AgentSession.objects.get(agent=persistent_agent)

    read = LiveSessionRead(persistent_agent.pk)
    assert read.kept is not None
    with connection.cursor() as cursor:
        cursor.execute(*read.statement())
        rows = cursor.fetchall()
    assert rows[0][-1] is None  # the history's column (the query's last) was left out by the server
    # Kept as the row holds it, to the order of each message's keys.
    assert json.dumps(read.session(rows).history) == json.dumps(stored.history)
    assert len(stored.history) == 6


def test_a_history_edited_between_two_heartbeats_is_read_from_the_row(postgres_only, persistent_agent, fake_anthropic):
    beat(persistent_agent, "one")
    beat(persistent_agent, "two")
    session = AgentSession.objects.get(agent=persistent_agent)
    # The same counts and sequence numbers: only the revision tells the two histories apart.
    AgentSession.objects.filter(pk=session.pk).update(history=edited(session.history))

    assert beat(persistent_agent, "three").status == RunStatus.SUCCEEDED

    assert sent_history(fake_anthropic)[0]["content"] == "edited by the operator"


def test_a_history_edited_while_the_model_answers_is_not_kept_as_the_commit_saw_it(
    postgres_only, persistent_agent, fake_anthropic
):
    """The commit appends to the row's history as it is then, not the one its plan read: a
    heartbeat whose row was written meanwhile keeps nothing, and the next reads the row."""
    beat(persistent_agent, "one")
    beat(persistent_agent, "two")
    session = AgentSession.objects.get(agent=persistent_agent)
    edit = on_own_connection(lambda: AgentSession.objects.filter(pk=session.pk).update(history=edited(session.history)))
    fake_anthropic.push(Reply.during(edit))

    assert beat(persistent_agent, "three").status == RunStatus.SUCCEEDED
    assert beat(persistent_agent, "four").status == RunStatus.SUCCEEDED

    assert sent_history(fake_anthropic)[0]["content"] == "edited by the operator"
    assert AgentSession.objects.get(pk=session.pk).history[0]["content"] == "edited by the operator"


def test_a_process_keeps_the_histories_of_as_many_sessions_as_it_is_told(
    postgres_only, settings, persistent_agent, other_agent, fake_anthropic
):
    settings.PAPERCLIP_HISTORY_CACHE_SESSIONS = 1
    for agent in (persistent_agent, persistent_agent, other_agent, other_agent):
        beat(agent, "go")
    assert history_cache.kept(persistent_agent.pk) is None  # the least recently used went
    assert history_cache.kept(other_agent.pk) is not None

    settings.PAPERCLIP_HISTORY_CACHE_SESSIONS = 0
    history_cache.forget_all()
    beat(other_agent, "again")
    assert history_cache.kept(other_agent.pk) is None


def test_a_value_is_kept_as_a_jsonb_column_gives_it_back(postgres_only):
    value = [{"type": "text", "text": "x", "é": 1, "zz": [1e23, 1.5, 2.0, (1, 2)], "a": {"bb": None, "c": True}}]
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::jsonb::text", [json.dumps(value)])
        (returned,) = cursor.fetchone()

    assert json.dumps(history_cache.as_stored(value)) == json.dumps(json.loads(returned))


def test_a_history_kept_longer_than_its_age_is_dropped(postgres_only, monkeypatch, persistent_agent, fake_anthropic):
    beat(persistent_agent, "one")
    beat(persistent_agent, "two")
    assert history_cache.kept(persistent_agent.pk) is not None

    with monkeypatch.context() as patched:
        patched.setattr(history_cache, "MAX_AGE_SECONDS", -1)  # every entry is older than that
        assert history_cache.kept(persistent_agent.pk) is None
    assert history_cache.kept(persistent_agent.pk) is None  # dropped, not hidden
    run = beat(persistent_agent, "three")
    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    assert len(sent_history(fake_anthropic)) == 4  # read from the row
