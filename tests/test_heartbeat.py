"""Heartbeats through the real SDK against the fake Messages API."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from sessions_app.heartbeat import HeartbeatRefused, heartbeat_enqueue, heartbeat_execute, heartbeat_wait
from sessions_app.maintenance import runs_reap, sessions_expire
from sessions_app.models import Agent, AgentSession, AgentStatus, HeartbeatRun, RunStatus, SessionStatus
from sessions_app.services import agent_delete, agent_pause, session_delete, session_expire
from sessions_app.stores import STORES, store_for
from tests.conftest import beat, on_own_connection, refuse_writes, snapshot, terminate_backend_running
from tests.fake_anthropic import Reply, plain_messages, plain_system, text_turn


def test_stateless_request_carries_system_prompt_and_one_user_message(stateless_agent, fake_anthropic):
    run = beat(stateless_agent, "What is 2+2?")
    beat(stateless_agent, "And 3+3?")

    assert run.status == RunStatus.SUCCEEDED, run.error
    first, second = fake_anthropic.message_requests
    assert plain_system(first) == "You are terse."
    assert first["model"] == "claude-opus-4-5"
    assert first["messages"] == [{"role": "user", "content": "What is 2+2?"}]
    assert second["messages"] == [{"role": "user", "content": "And 3+3?"}]
    # The system prompt is the cacheable prefix of a stateless agent.
    assert first["system"][0]["cache_control"] == {"type": "ephemeral"}
    assert run.session_id is None
    assert not AgentSession.objects.exists()
    assert run.output.startswith("answer 1")


def test_persistent_request_k_carries_2k_minus_1_alternating_messages_verbatim(persistent_agent, fake_anthropic):
    for k in range(1, 6):
        run = beat(persistent_agent, f"task {k}")
        assert run.status == RunStatus.SUCCEEDED, run.error

    requests = fake_anthropic.message_requests
    for k, body in enumerate(requests, start=1):
        messages = plain_messages(body)
        assert len(messages) == 2 * k - 1
        assert [m["role"] for m in messages] == ["user", "assistant"] * (k - 1) + ["user"]
        assert messages[-1] == text_turn("user", f"task {k}")
        if k > 1:
            # Every earlier request's messages come back verbatim, then its answer.
            previous = plain_messages(requests[k - 2])
            assert messages[: len(previous)] == previous
            assert messages[len(previous)] == text_turn("assistant", f"answer {k - 1}: task {k - 1}")
    session = AgentSession.objects.get()
    assert session.message_count == 10
    assert run.session_id == session.id


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


@pytest.mark.parametrize("store", ["file", "database"])
def test_history_round_trips_through_each_store(settings, persistent_agent, fake_anthropic, store):
    settings.PAPERCLIP_SESSION_STORE = store
    beat(persistent_agent, "one")
    run = beat(persistent_agent, "two")
    session = AgentSession.objects.get(id=run.session_id)
    assert session.store == store
    history = store_for(session).read(session)
    assert [m["content"] for m in history if m["role"] == "user"] == ["one", "two"]
    if store == "file":
        path = store_for(session).path_for(session)
        assert path == settings.PAPERCLIP_HOME / "sessions" / str(persistent_agent.id) / f"{session.public_id}.json"
        assert json.loads(path.read_text())["messages"] == history
        assert session.history == []
    else:
        assert session.history == history


def test_crash_between_write_and_rename_leaves_the_old_file_whole(settings, persistent_agent, fake_anthropic):
    settings.PAPERCLIP_SESSION_STORE = "file"
    run = beat(persistent_agent, "one")
    session = AgentSession.objects.get(id=run.session_id)
    store = store_for(session)
    before = store.path_for(session).read_bytes()

    store.stage(session, [{"role": "user", "content": "half-written"}])  # staged file written
    # ...the process dies here: no COMMIT, no rename.

    assert store.path_for(session).read_bytes() == before
    assert [m["content"] for m in store.read(AgentSession.objects.get(pk=session.pk))][0] == "one"


def test_corrupt_history_file_fails_the_heartbeat_clearly_without_calling_the_model(
    settings, persistent_agent, fake_anthropic
):
    settings.PAPERCLIP_SESSION_STORE = "file"
    run = beat(persistent_agent, "one")
    session = AgentSession.objects.get(id=run.session_id)
    store_for(session).path_for(session).write_text("{not json")
    fake_anthropic.reset_log()

    failed = beat(persistent_agent, "two")

    assert failed.status == RunStatus.FAILED
    assert failed.error_code == "history_corrupt"
    assert session.public_id in failed.error
    assert fake_anthropic.message_requests == []


def test_missing_history_file_is_an_error_not_an_empty_history(settings, persistent_agent, fake_anthropic):
    settings.PAPERCLIP_SESSION_STORE = "file"
    run = beat(persistent_agent, "one")
    session = AgentSession.objects.get(id=run.session_id)
    store_for(session).path_for(session).unlink()

    failed = beat(persistent_agent, "two")

    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "history_missing")
    assert len(fake_anthropic.message_requests) == 1


def test_same_idempotency_key_returns_the_same_run_and_calls_the_model_once(persistent_agent, fake_anthropic):
    first = beat(persistent_agent, "once", idempotency_key="k-1")
    again, created = heartbeat_enqueue(agent=persistent_agent, task="once", now=timezone.now(), idempotency_key="k-1")
    assert not created
    assert again.id == first.id
    assert heartbeat_execute(run_id=again.id).status == RunStatus.SUCCEEDED
    assert len(fake_anthropic.message_requests) == 1
    with pytest.raises(HeartbeatRefused) as refused:
        heartbeat_enqueue(agent=persistent_agent, task="other", now=timezone.now(), idempotency_key="k-1")
    assert refused.value.code == "idempotency_key_reused"


def test_rate_limit_is_retried_by_the_sdk_then_succeeds(persistent_agent, fake_anthropic):
    fake_anthropic.push(Reply.error(429, "slow down", retry_after_ms=10), Reply.error(529, "overloaded", 10))
    run = beat(persistent_agent, "hello")
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert len(fake_anthropic.message_requests) == 3
    assert CostEvent.objects.count() == 1


@pytest.mark.parametrize(
    ("replies", "code"),
    [
        ([Reply.error(400, "bad request")], "model_bad_request"),
        ([Reply.error(500, "boom", 1)] * 3, "model_server_error"),
        ([Reply.error(529, "overloaded", 1)] * 3, "model_overloaded"),
        ([Reply.malformed()], "model_malformed_response"),
    ],
)
def test_permanent_failure_leaves_history_and_ledger_untouched(persistent_agent, fake_anthropic, replies, code):
    ok = beat(persistent_agent, "first")
    session = AgentSession.objects.get(id=ok.session_id)
    history_before = store_for(session).read(session)
    fake_anthropic.push(*replies)

    failed = beat(persistent_agent, "second")

    assert failed.status == RunStatus.FAILED
    assert failed.error_code == code
    assert failed.finished_at is not None
    session.refresh_from_db()
    assert store_for(session).read(session) == history_before
    assert session.message_count == 2
    assert CostEvent.objects.count() == 1
    # ...and the next heartbeat resumes from the intact history.
    assert beat(persistent_agent, "third").status == RunStatus.SUCCEEDED
    assert len(fake_anthropic.message_requests[-1]["messages"]) == 3


def test_cost_rows_match_the_usage_to_the_micro_dollar(persistent_agent, fake_anthropic):
    usage = {
        "input_tokens": 1234,
        "output_tokens": 567,
        "cache_creation_input_tokens": 3000,
        "cache_creation": {"ephemeral_5m_input_tokens": 2000, "ephemeral_1h_input_tokens": 1000},
        "cache_read_input_tokens": 45678,
    }
    fake_anthropic.push(Reply.message("priced", usage=usage, message_id="msg_priced"))

    run = beat(persistent_agent, "price me")

    event = CostEvent.objects.get()
    # claude-opus-4-5: $5 in, $25 out, $6.25 5-minute write, $10 1-hour write, $0.50 read per MTok.
    expected = (
        Decimal(1234) * 5 + Decimal(567) * 25 + Decimal(2000) * Decimal("6.25") + Decimal(1000) * 10
    ) / 1_000_000 + Decimal(45678) * Decimal("0.5") / 1_000_000
    assert event.cost_usd == expected
    assert (event.input_tokens, event.output_tokens) == (1234, 567)
    assert (event.cache_creation_5m_input_tokens, event.cache_creation_1h_input_tokens) == (2000, 1000)
    assert event.cache_read_input_tokens == 45678
    assert event.message_id == "msg_priced"
    assert event.raw_usage == usage
    assert (event.session_id, event.run_id) == (run.session_id, run.id)
    assert run.cost_usd == expected
    assert run.cache_read_input_tokens == 45678
    assert AgentSession.objects.get().total_cost_usd == expected


def test_iterations_beyond_the_top_level_are_billed(stateless_agent, fake_anthropic):
    usage = {
        "input_tokens": 23000,
        "output_tokens": 1000,
        "iterations": [
            {"type": "compaction", "input_tokens": 180000, "output_tokens": 3500},
            {"type": "message", "input_tokens": 23000, "output_tokens": 1000},
        ],
    }
    fake_anthropic.push(Reply.message("compacted", usage=usage))
    beat(stateless_agent, "long")
    event = CostEvent.objects.get()
    assert (event.input_tokens, event.output_tokens) == (203000, 4500)
    assert event.cost_usd == (Decimal(203000) * 5 + Decimal(4500) * 25) / 1_000_000


def test_a_call_without_usage_writes_no_cost_row(stateless_agent, fake_anthropic):
    fake_anthropic.push(Reply.no_usage())
    run = beat(stateless_agent, "free?")
    assert run.status == RunStatus.SUCCEEDED
    assert not CostEvent.objects.exists()


def test_unknown_model_is_recorded_unpriced_not_refused(company, fake_anthropic):
    agent = Agent.objects.create(company=company, name="new", adapter_config={"model": "claude-future-9"})
    run = beat(agent, "hi")
    assert run.status == RunStatus.SUCCEEDED
    event = CostEvent.objects.get()
    assert event.unpriced and event.cost_usd == 0 and event.input_tokens > 0


def test_paused_and_deleted_agents_are_refused_without_a_model_call(persistent_agent, fake_anthropic):
    agent_pause(agent=persistent_agent)
    with pytest.raises(HeartbeatRefused) as refused:
        heartbeat_enqueue(agent=persistent_agent, task="x", now=timezone.now())
    assert refused.value.code == "agent_paused"

    persistent_agent.status = AgentStatus.ACTIVE
    persistent_agent.save()
    run, _ = heartbeat_enqueue(agent=persistent_agent, task="queued before pause", now=timezone.now())
    agent_pause(agent=persistent_agent)
    failed = heartbeat_execute(run_id=run.id)
    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "agent_paused")
    assert fake_anthropic.message_requests == []


def test_a_second_run_waits_while_the_agent_is_busy(persistent_agent, fake_anthropic):
    now = timezone.now()
    first, _ = heartbeat_enqueue(agent=persistent_agent, task="first", now=now)
    second, _ = heartbeat_enqueue(agent=persistent_agent, task="second", now=now)
    HeartbeatRun.objects.filter(id=first.id).update(status=RunStatus.RUNNING, started_at=now)

    assert heartbeat_execute(run_id=second.id).status == RunStatus.QUEUED
    assert fake_anthropic.message_requests == []

    HeartbeatRun.objects.filter(id=first.id).update(status=RunStatus.FAILED)
    assert heartbeat_execute(run_id=second.id).status == RunStatus.SUCCEEDED


def test_process_adapter_runs_a_command_with_the_request_on_stdin(company, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, sys\n"
        "request = json.load(sys.stdin)\n"
        "last = request['messages'][-1]['content']\n"
        "print(json.dumps({'text': f'echo {len(request[\"messages\"])}: ' + last,\n"
        "                  'usage': {'input_tokens': 10, 'output_tokens': 2}, 'message_id': 'proc-1'}))\n"
    )
    agent = Agent.objects.create(
        company=company,
        name="cli",
        adapter_type="process",
        adapter_config={"command": ["python3", str(script)], "model": "claude-haiku-4-5", "session_mode": "persistent"},
    )
    beat(agent, "ping")
    run = beat(agent, "pong")
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.output == "echo 3: pong"
    # Both calls reported the same message id: two calls all the same, two ledger rows.
    assert CostEvent.objects.filter(agent_id=agent.id).count() == 2


def test_process_adapter_kills_its_process_group_on_timeout(company, tmp_path):
    marker = tmp_path / "child-alive"
    script = tmp_path / "slow.sh"
    script.write_text(f"#!/bin/sh\n(sleep 3; touch {marker}) &\nsleep 30\n")
    script.chmod(0o755)
    agent = Agent.objects.create(
        company=company,
        name="slow",
        adapter_type="process",
        adapter_config={"command": [str(script)], "timeout_seconds": 0.5},
    )
    run = beat(agent, "hang")
    assert (run.status, run.error_code) == (RunStatus.FAILED, "process_timeout")
    import time

    time.sleep(3.5)
    assert not marker.exists()


def test_missing_credentials_fail_the_run_clearly(stateless_agent, fake_anthropic, monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    run = beat(stateless_agent, "hello")
    assert (run.status, run.error_code) == (RunStatus.FAILED, "adapter_not_configured")
    assert "ANTHROPIC_API_KEY" in run.error
    assert fake_anthropic.message_requests == []


@pytest.mark.parametrize("mode", ["stateless", "persistent"])
def test_a_heartbeat_makes_the_same_few_queries_however_long_the_session(
    mode, stateless_agent, persistent_agent, fake_anthropic, django_assert_max_num_queries
):
    agent = persistent_agent if mode == "persistent" else stateless_agent
    for i in range(20):
        beat(agent, f"turn {i}")
    # Budgets and the queue bound's count (and, on PostgreSQL, its advisory lock) at enqueue,
    # claim, session read, link and touch, the agent's lock, price, ledger row, session and
    # run updates, next queued run, and the savepoints around them: none of it per message
    # of history.
    with django_assert_max_num_queries(19 if mode == "stateless" else 24):
        assert beat(agent, "turn 20").status == RunStatus.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_a_run_answering_within_its_agents_timeout_is_not_reaped(company, fake_anthropic):
    from django.db import connection

    from sessions_app.maintenance import runs_reap

    agent = Agent.objects.create(
        company=company,
        name="slow thinker",
        adapter_config={"model": "claude-opus-4-5", "timeout_seconds": 3600, "max_retries": 1},
    )
    start = timezone.now()
    reaped = []

    def reaper_an_hour_into_the_call():
        # The first attempt took its whole hour; the retry is answering.
        reaped.extend(runs_reap(now=start + timedelta(minutes=61)))
        connection.close()

    fake_anthropic.push(Reply(before=reaper_an_hour_into_the_call))

    run = beat(agent, "think hard", now=start)

    assert reaped == []
    assert run.status == RunStatus.SUCCEEDED, run.error
    # Two attempts of an hour, the wait between them, and the run timeout for the rest.
    assert run.deadline_at == start + timedelta(seconds=2 * 3600 + 60 + 600)


def test_each_later_call_of_a_run_moves_its_deadline_and_a_reaped_run_calls_no_more(stateless_agent, fake_anthropic):
    from sessions_app.adapters import get_adapter
    from sessions_app.context import build_request, context_settings
    from sessions_app.heartbeat import RunAbandoned, RunCalls, claim_run
    from sessions_app.maintenance import runs_reap

    start = timezone.now()
    queued, _ = heartbeat_enqueue(agent=stateless_agent, task="many calls", now=start)
    run, claimed = claim_run(run_id=queued.id, now=start)
    assert claimed
    one_call = timedelta(seconds=3 * 600 + 2 * 60 + 600)  # the defaults: 600 s x 3 attempts
    assert run.deadline_at == start + one_call
    later = start + timedelta(minutes=50)  # a summary took 50 minutes before this call
    calls = RunCalls(get_adapter("claude-code"), run=run, clock=lambda: later)
    request = build_request(
        agent=stateless_agent, history=[], user_content="go", settings=context_settings(stateless_agent)
    )

    replies = [calls.call(request), calls.call(request)]

    assert [reply.call_number for reply in replies] == [1, 2]
    assert HeartbeatRun.objects.get(id=run.id).deadline_at == later + one_call
    assert runs_reap(now=later + one_call - timedelta(seconds=1)) == []
    assert runs_reap(now=later + one_call + timedelta(seconds=1)) == [stateless_agent.id]
    with pytest.raises(RunAbandoned) as abandoned:
        calls.call(request)
    assert abandoned.value.code == "run_timeout"
    assert len(fake_anthropic.message_requests) == 2


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


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("resumed", [False, True], ids=["new-session", "resumed-session"])
def test_an_agent_deleted_during_its_heartbeat_gains_no_session(
    persistent_agent, fake_anthropic, paperclip_home, resumed
):
    if resumed:
        beat(persistent_agent, "zero")
    fake_anthropic.push(
        Reply.during(on_own_connection(lambda: agent_delete(agent=persistent_agent, now=timezone.now())))
    )

    run = beat(persistent_agent, "one")

    assert fake_anthropic.action_errors == []
    assert (run.status, run.error_code) == (RunStatus.FAILED, "agent_deleted")
    assert not AgentSession.objects.filter(agent=persistent_agent).exists()
    assert list(paperclip_home.rglob("*.json")) == []
    assert CostEvent.objects.get(run=run).kind == "message"  # billed, so recorded


@pytest.mark.django_db(transaction=True)
def test_an_answer_whose_commit_fails_leaves_the_old_file_and_the_next_heartbeat_resumes(
    settings, persistent_agent, fake_anthropic, refuse_at_commit
):
    settings.PAPERCLIP_SESSION_STORE = "file"
    beat(persistent_agent, "one")
    session = AgentSession.objects.get(agent=persistent_agent)
    before = store_for(session).path_for(session).read_bytes()
    allow = refuse_at_commit("agent_sessions", when="NEW.message_count > OLD.message_count")

    failed = beat(persistent_agent, "two")

    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "internal_error")
    assert store_for(session).path_for(session).read_bytes() == before
    allow()
    run = beat(persistent_agent, "three")
    assert (run.status, run.error_code) == (RunStatus.SUCCEEDED, ""), run.error
    session.refresh_from_db()
    assert [m["content"] for m in store_for(session).read(session) if m["role"] == "user"] == ["one", "three"]
    assert plain_messages(fake_anthropic.message_requests[-1])[:2] == [
        text_turn("user", "one"),
        text_turn("assistant", "answer 1: one"),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_first_answer_whose_commit_fails_leaves_no_session_and_no_file(
    settings, persistent_agent, fake_anthropic, refuse_at_commit
):
    settings.PAPERCLIP_SESSION_STORE = "file"
    refuse_at_commit("agent_sessions", when="1 = 1", event="INSERT")

    failed = beat(persistent_agent, "one")

    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "internal_error")
    assert not AgentSession.objects.exists()
    folder = settings.PAPERCLIP_HOME / "sessions" / str(persistent_agent.id)
    assert not folder.exists() or list(folder.iterdir()) == []


def test_an_answer_whose_rename_fails_after_the_commit_is_published_by_the_next_read(
    settings, persistent_agent, fake_anthropic, monkeypatch
):
    """The COMMIT succeeded, then the rename (or the directory's fsync) failed: the run is
    answered, and the staged file the row names is put in place by the next reader."""
    settings.PAPERCLIP_SESSION_STORE = "file"
    beat(persistent_agent, "one")
    real_replace = os.replace
    failures = []

    def replace_fails_once(*args, **kwargs):
        if not failures:
            failures.append(args)
            raise OSError(5, "Input/output error")
        return real_replace(*args, **kwargs)

    monkeypatch.setattr("sessions_app.stores.os.replace", replace_fails_once)

    answered = beat(persistent_agent, "two")

    assert (answered.status, answered.error_code) == (RunStatus.SUCCEEDED, ""), answered.error
    assert failures, "the rename was never attempted"
    session = AgentSession.objects.get(agent=persistent_agent)
    assert len(json.loads(store_for(session).path_for(session).read_text())["messages"]) == 2
    run = beat(persistent_agent, "three")
    assert (run.status, run.error_code) == (RunStatus.SUCCEEDED, ""), run.error
    session.refresh_from_db()
    assert [m["content"] for m in store_for(session).read(session) if m["role"] == "user"] == ["one", "two", "three"]
    assert len(json.loads(store_for(session).path_for(session).read_text())["messages"]) == 6


def test_the_queue_bound_refuses_with_queue_full_and_a_used_key_still_answers(settings, persistent_agent):
    settings.PAPERCLIP_MAX_QUEUED_RUNS = 2
    now = timezone.now()
    first, _ = heartbeat_enqueue(agent=persistent_agent, task="one", now=now, idempotency_key="k1")
    heartbeat_enqueue(agent=persistent_agent, task="two", now=now)
    with pytest.raises(HeartbeatRefused) as refused:
        heartbeat_enqueue(agent=persistent_agent, task="three", now=now)
    assert refused.value.code == "queue_full"
    assert heartbeat_enqueue(agent=persistent_agent, task="one", now=now, idempotency_key="k1") == (first, False)
    # Running and finished runs take no place in the queue.
    HeartbeatRun.objects.filter(pk=first.pk).update(status=RunStatus.SUCCEEDED)
    assert heartbeat_enqueue(agent=persistent_agent, task="three", now=now)[1] is True


@pytest.mark.django_db(transaction=True)
def test_two_enqueues_racing_for_the_last_place_in_the_queue_let_one_in(postgres_only, settings, persistent_agent):
    """The second enqueue counts while the first's insert is still uncommitted (held by a
    sleeping trigger): without serialization both would see room for one."""
    settings.PAPERCLIP_MAX_QUEUED_RUNS = 2
    heartbeat_enqueue(agent=persistent_agent, task="already queued", now=timezone.now())
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION slow_run_insert() RETURNS trigger AS $$ BEGIN PERFORM pg_sleep(1); RETURN NEW; END $$ "
            "LANGUAGE plpgsql; CREATE TRIGGER slow_run_insert BEFORE INSERT ON heartbeat_runs "
            "FOR EACH ROW EXECUTE FUNCTION slow_run_insert();"
        )
    outcomes = {}

    def enqueue(name):
        try:
            outcomes[name] = heartbeat_enqueue(agent=persistent_agent, task=name, now=timezone.now())[1]
        except HeartbeatRefused as exc:
            outcomes[name] = exc.code
        finally:
            connection.close()

    try:
        first = threading.Thread(target=enqueue, args=("first",))
        first.start()
        time.sleep(0.3)  # the first is inside its insert
        enqueue_second = threading.Thread(target=enqueue, args=("second",))
        enqueue_second.start()
        first.join(10)
        enqueue_second.join(10)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER slow_run_insert ON heartbeat_runs; DROP FUNCTION slow_run_insert();")
    assert outcomes == {"first": True, "second": "queue_full"}
    assert HeartbeatRun.objects.filter(agent=persistent_agent, status=RunStatus.QUEUED).count() == 2


class SessionKeepingAdapter:
    """A runtime that resumes a session it keeps itself: it is sent only the new turn."""

    type_name = "own-session-test"
    keeps_own_session = True
    config_keys = frozenset({"model"})

    def __init__(self, *, keeps_own_session: bool = True) -> None:
        self.keeps_own_session = keeps_own_session
        self.requests = []

    def validate_config(self, config, errors):
        return {"model": config.get("model", "runtime-model")}

    def call_seconds(self, config) -> float:
        return 5

    def call(self, request):
        from sessions_app.adapters import AdapterReply

        self.requests.append(request)
        text = f"answer {len(self.requests)}"
        return AdapterReply(text=text, content=text, model=request.model, usage={"input_tokens": 7, "output_tokens": 3})


def runtime_agent(company, monkeypatch, adapter):
    from sessions_app.adapters import ADAPTERS

    monkeypatch.setitem(ADAPTERS, adapter.type_name, adapter)
    return Agent.objects.create(
        company=company,
        name="Runtime",
        adapter_type=adapter.type_name,
        # A budget far too small to replay anything, and a rotation after every turn: a
        # runtime that keeps its own session is neither compacted nor rotated.
        adapter_config={"session_mode": "persistent", "context_budget_tokens": 1000, "rotate_after_turns": 1},
    )


def test_a_runtime_that_keeps_its_own_session_gets_only_the_new_turn_and_reports_it_back(company, monkeypatch):
    from sessions_app.models import SessionCompaction

    adapter = SessionKeepingAdapter()
    agent = runtime_agent(company, monkeypatch, adapter)
    big = "x" * 6000  # alone over the 1000-token budget: a replayed session could not fit it twice

    runs = [beat(agent, f"{big} task {n}") for n in range(3)]

    assert [run.status for run in runs] == [RunStatus.SUCCEEDED] * 3, [run.error for run in runs]
    assert [len(request.messages) for request in adapter.requests] == [1, 1, 1]
    assert adapter.requests[2].messages[0]["content"] == f"{big} task 2"
    session = AgentSession.objects.get(agent=agent)  # one session: never rotated
    assert {run.session_id for run in runs} == {session.id}
    assert (session.turn_count, session.message_count, session.total_output_tokens) == (3, 6, 9)
    assert [m["content"] for m in store_for(session).read(session)][1::2] == ["answer 1", "answer 2", "answer 3"]
    assert not SessionCompaction.objects.exists()
    assert CostEvent.objects.filter(agent=agent).count() == 3


def test_a_runtime_without_its_own_session_has_the_history_replayed(company, monkeypatch):
    adapter = SessionKeepingAdapter(keeps_own_session=False)
    agent = runtime_agent(company, monkeypatch, adapter)
    agent.adapter_config = {"session_mode": "persistent"}
    agent.save()

    beat(agent, "one")
    beat(agent, "two")

    assert [len(request.messages) for request in adapter.requests] == [1, 3]


def test_a_scheduled_tick_on_a_busy_agent_leaves_its_run_queued_without_waiting(persistent_agent, fake_anthropic):
    from sessions_app.tasks import scheduled_heartbeat

    now = timezone.now()
    busy, _ = heartbeat_enqueue(agent=persistent_agent, task="busy", now=now)
    HeartbeatRun.objects.filter(id=busy.id).update(status=RunStatus.RUNNING, started_at=now)

    started = time.monotonic()
    assert scheduled_heartbeat(str(persistent_agent.id)) == RunStatus.QUEUED
    assert time.monotonic() - started < 5  # the cluster worker is not held while the agent is busy
    assert fake_anthropic.message_requests == []


def test_the_heartbeat_command_sees_the_run_of_a_repeated_key_through(persistent_agent, fake_anthropic, capsys):
    from django.core.management import call_command

    heartbeat_enqueue(agent=persistent_agent, task="queued earlier", now=timezone.now(), idempotency_key="k-cmd")
    call_command("heartbeat", str(persistent_agent.id), "--task", "queued earlier", "--idempotency-key", "k-cmd")

    assert "answer 1: queued earlier" in capsys.readouterr().out
    assert HeartbeatRun.objects.get().status == RunStatus.SUCCEEDED


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("store", ["database", "file"])
def test_terminated_connection_mid_commit_leaves_history_whole_and_still_bills(
    postgres_only, settings, persistent_agent, fake_anthropic, store
):
    settings.PAPERCLIP_SESSION_STORE = store
    beat(persistent_agent, "first")
    count, history, costs = snapshot(persistent_agent)
    with connection.cursor() as cursor:
        # Hold the commit transaction open: the ledger insert sleeps, so it can be killed.
        cursor.execute(
            "CREATE FUNCTION slow_ledger() RETURNS trigger AS $$ BEGIN PERFORM pg_sleep(3); RETURN NEW; END $$ "
            "LANGUAGE plpgsql; CREATE TRIGGER slow_ledger BEFORE INSERT ON cost_events "
            "FOR EACH ROW EXECUTE FUNCTION slow_ledger();"
        )
    outcome = {}

    def run_heartbeat():
        try:
            outcome["run"] = beat(persistent_agent, "second")
        except Exception as exc:  # the connection dies under it
            outcome["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run_heartbeat)
    thread.start()
    try:
        terminate_backend_running('%INSERT INTO "cost_events"%')
        thread.join(timeout=30)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS slow_ledger ON cost_events; DROP FUNCTION IF EXISTS slow_ledger();")

    # Nothing of the answer's commit was written, but the answer was billed: the ledger
    # records it on a new connection.
    assert snapshot(persistent_agent) == (count, history, costs + 1)
    stuck = HeartbeatRun.objects.get(task="second")
    assert CostEvent.objects.get(run=stuck).kind == "message"
    assert stuck.status in (RunStatus.RUNNING, RunStatus.FAILED)
    runs_reap(now=timezone.now() + timedelta(hours=1))
    assert HeartbeatRun.objects.get(task="second").status == RunStatus.FAILED
    assert beat(persistent_agent, "third").status == RunStatus.SUCCEEDED
    assert snapshot(persistent_agent)[0] == count + 2
    assert [m["content"] for m in snapshot(persistent_agent)[1] if m["role"] == "user"] == ["first", "third"]


def test_a_database_error_while_committing_the_answer_still_records_its_cost(persistent_agent, fake_anthropic):
    beat(persistent_agent, "first")
    session = AgentSession.objects.get(agent=persistent_agent)
    before = store_for(session).read(session)
    refuse_writes("agent_sessions", when="NEW.message_count > OLD.message_count")

    run = beat(persistent_agent, "second")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "internal_error")
    billed = fake_anthropic.message_requests[-1]
    event = CostEvent.objects.get(run=run)
    assert (event.kind, event.input_tokens) == (CostKind.MESSAGE, fake_anthropic.default_usage(billed)["input_tokens"])
    session.refresh_from_db()
    assert (session.message_count, store_for(session).read(session)) == (2, before)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("postgres_only")
def test_concurrent_heartbeats_lose_no_turn_and_never_interleave(persistent_agent, fake_anthropic):
    """One writer per agent, proven with real threads and connections on PostgreSQL."""
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
