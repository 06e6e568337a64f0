"""`sessions_app.run_calls`: every model call of a run numbered, under its deadline, and
billed the moment it returns, through the real SDK against the fake Messages API."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.utils import timezone
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from costs_app.models import Budget, CostEvent, CostKind
from costs_app.pricing import call_price
from sessions_app.adapters import AdapterRequest, get_adapter
from sessions_app.context import build_request, context_settings
from sessions_app.errors import RunAbandoned
from sessions_app.maintenance import runs_reap
from sessions_app.models import Agent, AgentSession, HeartbeatRun, RunStatus
from sessions_app.run_calls import RunCalls
from sessions_app.run_queue import claim_run, heartbeat_enqueue
from tests.conftest import (
    answered_usages,
    assert_ledger_holds_exactly,
    beat,
    context_agent,
    kill_once_billed,
    on_own_connection,
    worker_heartbeat,
)
from tests.fake_anthropic import Reply


def claimed(agent, *, now):
    queued, _ = heartbeat_enqueue(agent=agent, task="many calls", now=now)
    run, ok = claim_run(run_id=queued.id, now=now)
    assert ok
    return run


def request_for(agent) -> AdapterRequest:
    return build_request(agent=agent, history=[], user_content="go", settings=context_settings(agent))


def test_each_later_call_of_a_run_moves_its_deadline_and_a_reaped_run_calls_no_more(stateless_agent, fake_anthropic):
    start = timezone.now()
    run = claimed(stateless_agent, now=start)
    one_call = timedelta(seconds=3 * 600 + 2 * 60 + 600)  # the defaults: 600 s x 3 attempts
    assert run.deadline_at == start + one_call
    later = start + timedelta(minutes=50)  # a summary took 50 minutes before this call
    calls = RunCalls(get_adapter("claude-code"), run=run, agent=stateless_agent, clock=lambda: later, budgeted=False)
    request = request_for(stateless_agent)

    calls.call(request), calls.call(request)

    assert list(CostEvent.objects.filter(run=run).order_by("call_number").values_list("call_number", flat=True)) == [
        1,
        2,
    ]
    assert HeartbeatRun.objects.get(id=run.id).deadline_at == later + one_call
    assert runs_reap(now=later + one_call - timedelta(seconds=1)) == []
    assert runs_reap(now=later + one_call + timedelta(seconds=1)) == [stateless_agent.id]
    with pytest.raises(RunAbandoned) as abandoned:
        calls.call(request)
    assert abandoned.value.code == "run_timeout"
    assert len(fake_anthropic.message_requests) == 2


@pytest.mark.django_db(transaction=True)
def test_a_call_is_in_the_ledger_before_the_next_one_is_sent(persistent_agent, fake_anthropic):
    """The second request arrives at the fake only after the first's row is written, with
    the session the rows name and the call's cost on the reply."""
    now = timezone.now()
    run = claimed(persistent_agent, now=now)
    calls = RunCalls(get_adapter("claude-code"), run=run, agent=persistent_agent, clock=lambda: now, budgeted=False)
    seen_before_second = []
    fake_anthropic.push(
        Reply.message("first"),
        Reply.message(
            "second",
            before=on_own_connection(lambda: seen_before_second.extend(CostEvent.objects.filter(run_id=run.id))),
        ),
    )
    request = request_for(persistent_agent)

    first = calls.call(request, kind=CostKind.COMPACTION)
    second = calls.call(request)

    (row,) = seen_before_second
    assert (row.call_number, row.kind, row.id) == (1, CostKind.COMPACTION, first.cost_event_id)
    assert first.cost_usd == row.cost_usd > 0
    assert second.cost_usd == CostEvent.objects.get(id=second.cost_event_id).cost_usd
    assert calls.cost_usd == first.cost_usd + second.cost_usd
    assert set(CostEvent.objects.filter(run_id=run.id).values_list("session_id", flat=True)) == {None}


def test_rows_name_the_session_the_run_resumed(persistent_agent, fake_anthropic):
    from tests.conftest import beat

    session_id = beat(persistent_agent, "hello").session_id
    now = timezone.now()
    run = claimed(persistent_agent, now=now)
    calls = RunCalls(get_adapter("claude-code"), run=run, agent=persistent_agent, clock=lambda: now, budgeted=False)
    calls.names_session(session_id)

    calls.call(request_for(persistent_agent))

    assert CostEvent.objects.get(run_id=run.id).session_id == session_id


def test_a_budgeted_call_releases_its_reservation_as_it_is_billed(stateless_agent, fake_anthropic):
    """Once billed, a call is counted as spent, not held as well."""
    Budget.objects.create(company=stateless_agent.company, monthly_limit_usd=Decimal("100"))
    now = timezone.now()
    run = claimed(stateless_agent, now=now)
    HeartbeatRun.objects.filter(id=run.id).update(reserved_usd=Decimal("0.5"))
    calls = RunCalls(get_adapter("claude-code"), run=run, agent=stateless_agent, clock=lambda: now, budgeted=True)

    reply = calls.call(request_for(stateless_agent))

    assert HeartbeatRun.objects.get(id=run.id).reserved_usd == Decimal("0.5") - reply.cost_usd


def test_a_meter_bills_each_reported_request_once(stateless_agent, fake_anthropic):
    from sessions_app.adapters import AdapterReply
    from sessions_app.adapters.base import Adapter

    class Reporting(Adapter):
        type_name = "reporting"
        config_keys = set()
        bills_while_running = True

        def call_seconds(self, config):
            return 10

        def call(self, request):
            usage = {"input_tokens": 1000, "output_tokens": 10}
            request.meter.bill(usage=usage, model="claude-sonnet-4-5", message_id="msg_a")
            request.meter.bill(usage=usage, model="claude-sonnet-4-5", message_id="msg_a")  # in parts
            request.meter.bill(usage=usage, model="claude-haiku-4-5", message_id="msg_b")
            return AdapterReply(text="done", content="done", model="claude-sonnet-4-5")

    now = timezone.now()
    run = claimed(stateless_agent, now=now)
    calls = RunCalls(Reporting(), run=run, agent=stateless_agent, clock=lambda: now, budgeted=False)

    reply = calls.call(request_for(stateless_agent))

    rows = list(CostEvent.objects.filter(run_id=run.id).order_by("call_number"))
    assert [(row.call_number, row.model, row.message_id) for row in rows] == [
        (1, "claude-sonnet-4-5", "msg_a"),
        (2, "claude-haiku-4-5", "msg_b"),
    ]
    assert reply.cost_usd == sum(row.cost_usd for row in rows) == calls.cost_usd


# Money under faults: a worker SIGKILLed at any moment leaves every answered call billed.


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("calls", [1, 2, 3])
def test_a_worker_killed_after_its_nth_answered_tool_round_leaves_exactly_those_calls_billed(
    company, fake_anthropic, settings, calls
):
    agent = Agent.objects.create(
        company=company,
        name="Rememberer",
        adapter_type="claude-code",
        adapter_config={"model": "claude-opus-4-5", "memory": True, "session_mode": "persistent", "max_retries": 0},
    )
    worker: list = []
    rounds = [Reply.tool_calls({"command": "create", "path": f"/memories/r{n}.md", "file_text": "x"}) for n in range(3)]
    fake_anthropic.push(
        *rounds[:calls], Reply(kind="error", status=500, before=kill_once_billed(worker, agent=agent, calls=calls))
    )

    worker.append(worker_heartbeat(agent, "remember three things", settings))
    worker[0].wait(timeout=120)

    run = HeartbeatRun.objects.get(agent=agent)
    assert run.status == RunStatus.RUNNING  # as the killed worker left it
    assert runs_reap(now=run.deadline_at + timedelta(seconds=1)) == [agent.id]
    assert_ledger_holds_exactly(run, answered_usages(fake_anthropic))
    assert len(answered_usages(fake_anthropic)) == calls
    assert not AgentSession.objects.filter(agent=agent).exists()  # nothing of the turn was committed


@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_while_its_commit_waits_leaves_the_answer_billed(
    company, fake_anthropic, settings, postgres_only
):
    """The answer is billed when it returns, not in the commit: the worker is killed while
    its commit waits for the agent's row (held by another connection), and the answer is
    in the ledger all the same. PostgreSQL: on SQLite one writer at a time means the
    ledger's own insert would wait for the same holder."""
    agent = Agent.objects.create(
        company=company, name="Waiter", adapter_type="claude-code", adapter_config={"session_mode": "persistent"}
    )
    worker: list = []
    release = threading.Event()
    holding = threading.Event()

    def hold_the_agent_row():
        with transaction.atomic():
            Agent.objects.select_for_update().get(pk=agent.pk)
            holding.set()
            release.wait(timeout=60)

    holder = threading.Thread(target=on_own_connection(hold_the_agent_row))
    fake_anthropic.push(Reply.message("done", before=lambda: (holder.start(), holding.wait(timeout=30))))

    worker.append(worker_heartbeat(agent, "answer me", settings))
    try:
        deadline = time.monotonic() + 60
        while not commit_waiting_on_a_lock():
            assert time.monotonic() < deadline, "the worker's commit never waited for the agent's row"
            time.sleep(0.02)
        worker[0].kill()
        worker[0].wait(timeout=10)
    finally:
        release.set()
        holder.join(timeout=30)

    run = HeartbeatRun.objects.get(agent=agent)
    assert runs_reap(now=run.deadline_at + timedelta(seconds=1)) == [agent.id]
    assert_ledger_holds_exactly(run, answered_usages(fake_anthropic))
    assert len(answered_usages(fake_anthropic)) == 1
    assert not AgentSession.objects.filter(agent=agent).exists()


def commit_waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE %s",
            ['%FROM "agents"%FOR NO KEY UPDATE%'],
        )
        return cursor.fetchone()[0] > 0


# The ledger over random runs: whatever happens, every answered call is one row, once.

STEPS = st.sampled_from(["answer", "tools", "long", "tools_then_error", "summary_error", "answer_error"])


@given(steps=st.lists(STEPS, min_size=1, max_size=6))
@hypothesis_settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
def test_over_any_sequence_of_calls_and_failures_the_ledger_is_what_the_api_reported(company, fake_anthropic, steps):
    """Answers, tool rounds, summaries, handoff notes (rotation every third turn) and
    failures at each of those steps, in any order: the ledger holds one row per call the
    fake answered, to the token and priced to the cent's millionth; each session's total is
    the sum of the rows that name it, each run's cost the sum of its own."""
    agent = context_agent(
        company, memory=True, context_budget_tokens=1200, keep_recent_turns=1, rotate_after_turns=3, max_retries=0
    )
    fake_anthropic.reset_log()
    for step in steps:
        task = "y" * 2400 if step in ("long", "summary_error") else f"remember step {step}"
        if step == "tools":
            fake_anthropic.push(Reply.tool_calls({"command": "view", "path": "/memories"}))
        if step == "tools_then_error":
            fake_anthropic.push(Reply.tool_calls({"command": "view", "path": "/memories"}), Reply.error(400))
        if step in ("summary_error", "answer_error"):
            fake_anthropic.push(Reply.error(400))
        run = beat(agent, task)
        fake_anthropic.scripted.clear()  # what a step scripted and did not use is not the next one's
        assert run.status in (RunStatus.SUCCEEDED, RunStatus.FAILED)

    answered = answered_usages(fake_anthropic)
    rows = list(CostEvent.objects.filter(agent_id=agent.id).order_by("id"))
    calls = [row for row in rows if row.kind != CostKind.SESSION_HOURS]
    assert [
        (r.model, r.input_tokens, r.output_tokens, r.cache_creation_input_tokens, r.cache_read_input_tokens)
        for r in calls
    ] == [
        (
            model,
            u["input_tokens"],
            u["output_tokens"],
            u.get("cache_creation_input_tokens", 0),
            u.get("cache_read_input_tokens", 0),
        )
        for model, u in answered
    ]
    for row in calls:
        assert row.cost_usd == call_price(usage=row.raw_usage, model=row.model, at=row.created_at).cost_usd
    for session in AgentSession.objects.filter(agent=agent):
        named = sum((r.cost_usd for r in rows if r.session_id == session.id), Decimal(0))
        assert abs(session.total_cost_usd - named) < Decimal("0.000001")
    for run in HeartbeatRun.objects.filter(agent=agent):
        own = [r.cost_usd for r in rows if r.run_id == run.id]
        assert run.cost_usd == (sum(own, Decimal(0)) if own else None)
