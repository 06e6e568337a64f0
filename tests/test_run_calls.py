"""`sessions_app.run_calls`: every model call of a run numbered, under its deadline, and
billed the moment it returns, through the real SDK against the fake Messages API."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from costs_app.models import Budget, CostEvent, CostKind
from sessions_app.adapters import AdapterRequest, get_adapter
from sessions_app.context import build_request, context_settings
from sessions_app.errors import RunAbandoned
from sessions_app.maintenance import runs_reap
from sessions_app.models import HeartbeatRun
from sessions_app.run_calls import RunCalls
from sessions_app.run_queue import claim_run, heartbeat_enqueue
from tests.conftest import on_own_connection
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
