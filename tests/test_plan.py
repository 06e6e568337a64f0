"""Planning a heartbeat: which session the answer goes to. Expired, ended, deleted or stale
sessions are never resumed, even when the expiry or the delete lands right after the read."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from costs_app.budgets import session_limit_reached
from costs_app.models import Budget, CostEvent, CostKind
from sessions_app.maintenance import sessions_expire, sessions_expiry_set
from sessions_app.models import Agent, AgentSession, RunStatus, SessionStatus
from sessions_app.services import session_delete, session_expire
from sessions_app.stores import STORES, store_for
from tests.conftest import beat
from tests.fake_anthropic import Reply, plain_messages, text_turn


def test_session_unused_past_its_ttl_is_not_resumed(persistent_agent, fake_anthropic):
    start = timezone.now()
    first = beat(persistent_agent, "remember 42", now=start)
    later = start + timedelta(hours=24, minutes=1)

    second = beat(persistent_agent, "what did I say?", now=later)

    assert second.status == RunStatus.SUCCEEDED
    assert second.session_id != first.session_id
    assert plain_messages(fake_anthropic.message_requests[-1]) == [text_turn("user", "what did I say?")]
    old = AgentSession.objects.get(id=first.session_id)
    assert old.status == SessionStatus.EXPIRED
    assert old.end_reason == "expired"


def test_expiry_slides_forward_with_every_use(persistent_agent, fake_anthropic):
    start = timezone.now()
    beat(persistent_agent, "one", now=start)
    beat(persistent_agent, "two", now=start + timedelta(hours=20))
    third = beat(persistent_agent, "three", now=start + timedelta(hours=40))

    session = AgentSession.objects.get(id=third.session_id)
    assert AgentSession.objects.count() == 1
    assert session.message_count == 6
    assert session.expires_at == session.last_used + timedelta(hours=24)
    assert session.last_used >= start + timedelta(hours=40)


def test_force_fresh_and_model_change_start_new_sessions(persistent_agent, fake_anthropic):
    first = beat(persistent_agent, "one")
    fresh = beat(persistent_agent, "two", force_fresh=True)
    assert fresh.session_id != first.session_id
    assert AgentSession.objects.get(id=first.session_id).end_reason == "force_fresh"

    persistent_agent.adapter_config = {**persistent_agent.adapter_config, "model": "claude-haiku-4-5"}
    persistent_agent.save()
    changed = beat(persistent_agent, "three")
    assert changed.session_id not in (first.session_id, fresh.session_id)
    assert plain_messages(fake_anthropic.message_requests[-1]) == [text_turn("user", "three")]
    assert AgentSession.objects.filter(status=SessionStatus.ACTIVE).count() == 1


def test_deleted_session_is_never_resumed(persistent_agent, fake_anthropic, django_capture_on_commit_callbacks):
    first = beat(persistent_agent, "one")
    with django_capture_on_commit_callbacks(execute=True):
        session_delete(session=AgentSession.objects.get(id=first.session_id), now=timezone.now())
    second = beat(persistent_agent, "two")
    assert second.session_id != first.session_id
    assert plain_messages(fake_anthropic.message_requests[-1]) == [text_turn("user", "two")]


def act_after_read(monkeypatch, action):
    """Run `action` once, right after the heartbeat read the session's history and before
    it takes the session for its run: the worst moment for an expiry or an operator."""
    pending = [action]
    for store in {type(s) for s in STORES.values()}:
        read = store.read

        def read_then_act(self, session, read=read):
            history = read(self, session)
            while pending:
                pending.pop()(session)
            return history

        monkeypatch.setattr(store, "read", read_then_act)


@pytest.mark.parametrize("actor", ["operator", "maintenance"])
def test_expired_session_is_never_resumed(persistent_agent, fake_anthropic, monkeypatch, actor):
    start = timezone.now()
    first = beat(persistent_agent, "remember 42", now=start)
    later = start + timedelta(hours=23)

    def expire(session):
        if actor == "operator":
            assert session_expire(session=session, now=later)
        else:
            assert sessions_expire(now=start + timedelta(hours=30)) == 1

    act_after_read(monkeypatch, expire)
    second = beat(persistent_agent, "what did I say?", now=later)

    assert second.status == RunStatus.SUCCEEDED
    assert second.session_id != first.session_id
    assert plain_messages(fake_anthropic.message_requests[-1]) == [text_turn("user", "what did I say?")]
    old = AgentSession.objects.get(id=first.session_id)
    assert old.status == SessionStatus.EXPIRED and old.message_count == 2
    assert AgentSession.objects.get(id=second.session_id).status == SessionStatus.ACTIVE


def test_session_deleted_before_it_is_taken_starts_a_fresh_one(
    persistent_agent, fake_anthropic, monkeypatch, django_capture_on_commit_callbacks
):
    first = beat(persistent_agent, "one")

    def delete(session):
        with django_capture_on_commit_callbacks(execute=True):
            session_delete(session=session, now=timezone.now())

    act_after_read(monkeypatch, delete)
    second = beat(persistent_agent, "two")

    assert (second.status, second.error_code) == (RunStatus.SUCCEEDED, "")
    assert second.session_id != first.session_id
    assert plain_messages(fake_anthropic.message_requests[-1]) == [text_turn("user", "two")]


@pytest.mark.parametrize(
    "named",
    [{}, {"model": "claude-opus-4-5"}, {"model": "claude-opus-4-5", "adapter_type": "claude-code"}],
    ids=["contract-columns", "with-model", "with-model-and-adapter"],
)
def test_a_session_inserted_by_raw_sql_is_continued(persistent_agent, fake_anthropic, named):
    """The contract's raw INSERT leaves model, adapter and message_count to their defaults."""
    history = [text_turn("user", "remember 42"), text_turn("assistant", "noted: 42")]
    columns = ", ".join(["id", "agent_id", "company_id", "history", "expires_at", *named])
    params = [uuid.uuid4().hex, persistent_agent.id.hex, persistent_agent.company_id.hex, json.dumps(history)]
    params += [timezone.now() + timedelta(hours=1), *named.values()]
    values = ", ".join(["%s"] * len(params))
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO agent_sessions ({columns}) VALUES ({values})", params)  # noqa: S608
    costs = CostEvent.objects.count()

    run = beat(persistent_agent, "what did I say?")

    assert (run.status, run.error_code) == (RunStatus.SUCCEEDED, "")
    session = AgentSession.objects.get(agent=persistent_agent)
    assert run.session_id == session.id
    assert plain_messages(fake_anthropic.message_requests[-1]) == [*history, text_turn("user", "what did I say?")]
    assert (session.model, session.adapter_type) == ("claude-opus-4-5", "claude-code")
    assert session.message_count == 4 and len(store_for(session).read(session)) == 4
    assert [m.get("seq") for m in store_for(session).read(session)[2:]] == [2, 3]
    assert CostEvent.objects.count() == costs + 1
    assert beat(persistent_agent, "and again?").session_id == session.id


def session_inserted_without_expiry(agent, *, last_used, history: list) -> uuid.UUID:
    """A session a raw INSERT made, naming when it was last used but not when it expires."""
    session_id = uuid.uuid4()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO agent_sessions (id, agent_id, company_id, history, last_used) VALUES (%s, %s, %s, %s, %s)",
            [session_id.hex, agent.id.hex, agent.company_id.hex, json.dumps(history), last_used],
        )
    return session_id


@pytest.mark.parametrize(("idle", "resumed"), [(timedelta(hours=23), True), (timedelta(hours=24, minutes=1), False)])
def test_a_session_inserted_without_expires_at_expires_its_ttl_after_its_last_use(
    persistent_agent, fake_anthropic, idle, resumed
):
    history = [text_turn("user", "remember 42"), text_turn("assistant", "noted: 42")]
    now = timezone.now()
    inserted = session_inserted_without_expiry(persistent_agent, last_used=now - idle, history=history)

    run = beat(persistent_agent, "what did I say?", now=now)

    assert (run.status, run.session_id == inserted) == (RunStatus.SUCCEEDED, resumed)
    sent = plain_messages(fake_anthropic.message_requests[-1])
    assert sent == [*(history if resumed else []), text_turn("user", "what did I say?")]
    if not resumed:  # before: a row without expires_at never expired, and was resumed
        assert AgentSession.objects.get(pk=inserted).status == SessionStatus.EXPIRED


def test_a_maintenance_pass_right_after_the_read_neither_ends_nor_shortens_the_session_taken(
    persistent_agent, fake_anthropic, monkeypatch
):
    """The pass writes the expiry of a row inserted without one, and sweeps, between the
    heartbeat's read of that row and its take: the session is resumed, and its expiry is
    the take's, a TTL from this heartbeat."""
    history = [text_turn("user", "remember 42"), text_turn("assistant", "noted: 42")]
    now = timezone.now()
    inserted = session_inserted_without_expiry(persistent_agent, last_used=now - timedelta(hours=23), history=history)

    def maintenance(session):
        assert sessions_expiry_set(now=now) == 1
        sessions_expire(now=now)

    act_after_read(monkeypatch, maintenance)
    run = beat(persistent_agent, "what did I say?", now=now)

    assert (run.status, run.session_id) == (RunStatus.SUCCEEDED, inserted)
    assert plain_messages(fake_anthropic.message_requests[-1])[:2] == history
    session = AgentSession.objects.get(pk=inserted)
    assert session.status == SessionStatus.ACTIVE and session.expires_at >= now + timedelta(hours=24)


def test_the_maintenance_pass_expires_a_session_inserted_without_expires_at_ttl_after_its_last_use(
    company, persistent_agent
):
    now = timezone.now()
    stale = session_inserted_without_expiry(persistent_agent, last_used=now - timedelta(hours=25), history=[])
    other = Agent.objects.create(
        company=company,
        name="Longer TTL",
        adapter_config={**persistent_agent.adapter_config, "session_ttl_hours": 48},
    )
    kept = session_inserted_without_expiry(other, last_used=now - timedelta(hours=25), history=[])

    assert sessions_expiry_set(now=now) == 2
    assert sessions_expire(now=now) == 1

    expired, live = AgentSession.objects.get(pk=stale), AgentSession.objects.get(pk=kept)
    assert (expired.status, expired.end_reason) == (SessionStatus.EXPIRED, "ttl")
    assert expired.ended_at == expired.expires_at == expired.last_used + timedelta(hours=24)
    assert (live.status, live.expires_at) == (SessionStatus.ACTIVE, live.last_used + timedelta(hours=48))
    assert sessions_expiry_set(now=now) == 0  # set once; a heartbeat's own expires_at is never touched


def session_spend(session: AgentSession) -> Decimal:
    return CostEvent.objects.filter(session=session).aggregate(total=Sum("cost_usd"))["total"]


def test_a_session_that_spent_its_session_limit_is_ended_with_a_handoff(company, persistent_agent, fake_anthropic):
    beat(persistent_agent, "turn 0")
    beat(persistent_agent, "turn 1")
    first = AgentSession.objects.get(agent=persistent_agent)
    # Its active time brings the session's spend to exactly the agent's limit; the
    # company allows more, and the lower limit applies.
    CostEvent.objects.create(
        company=company,
        agent=persistent_agent,
        session=first,
        kind=CostKind.SESSION_HOURS,
        cost_usd=Decimal("0.5") - session_spend(first),
    )
    Budget.objects.create(company=company, session_limit_usd=Decimal("5"))
    Budget.objects.create(company=company, agent=persistent_agent, session_limit_usd=Decimal("0.5"))
    fake_anthropic.push(Reply.message("State: two turns done."))

    run = beat(persistent_agent, "turn 2")

    assert run.status == RunStatus.SUCCEEDED, run.error
    first.refresh_from_db()
    assert (first.status, first.end_reason) == (SessionStatus.ENDED, "session_limit")
    second = AgentSession.objects.get(agent=persistent_agent, status=SessionStatus.ACTIVE)
    assert second.predecessor_id == first.id and run.session_id == second.id
    history = store_for(second).read(second)
    assert history[0]["kind"] == "handoff" and "State: two turns done." in history[0]["content"]
    assert "Handoff note" in plain_messages(fake_anthropic.message_requests[-1])[0]["content"][0]["text"]

    # The successor's spend starts from its own calls (the note's among them): it is resumed.
    assert beat(persistent_agent, "turn 3").session_id == second.id


def test_a_session_under_its_limit_is_resumed(company, persistent_agent, fake_anthropic):
    first = beat(persistent_agent, "turn 0")
    session = AgentSession.objects.get(agent=persistent_agent)
    Budget.objects.create(company=company, session_limit_usd=session_spend(session) + Decimal("0.000001"))

    assert beat(persistent_agent, "turn 1").session_id == first.session_id


def test_the_session_limit_costs_one_query(company, persistent_agent, fake_anthropic, django_assert_num_queries):
    beat(persistent_agent, "turn 0")
    session = AgentSession.objects.get(agent=persistent_agent)
    Budget.objects.create(company=company, session_limit_usd=Decimal("5"))
    Budget.objects.create(company=company, agent=persistent_agent, session_limit_usd=Decimal("3"))
    with django_assert_num_queries(1):
        assert not session_limit_reached(company_id=company.id, agent_id=persistent_agent.id, session_id=session.id)
