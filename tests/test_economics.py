"""Idle pause and resume, session-hour metering, and budgets that stop spend beforehand."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.utils import timezone

from costs_app.budgets import budget_uses
from costs_app.models import Budget, CostEvent, CostKind
from sessions_app.heartbeat import HeartbeatRefused, heartbeat_enqueue, heartbeat_wait
from sessions_app.maintenance import maintenance_pass, sessions_pause_idle
from sessions_app.models import Agent, AgentSession, AgentStatus, HeartbeatRun, RunStatus, SessionStatus
from sessions_app.services import budgets_release
from tests.conftest import beat, context_agent
from tests.fake_anthropic import Reply


def test_idle_session_pauses_and_resumes_on_its_next_heartbeat(persistent_agent, fake_anthropic):
    start = timezone.now()
    first = beat(persistent_agent, "one", now=start)
    session = AgentSession.objects.get(id=first.session_id)
    assert session.pause_at == session.last_used + timedelta(minutes=30)

    assert sessions_pause_idle(now=start + timedelta(minutes=29)) == 0
    assert sessions_pause_idle(now=start + timedelta(minutes=31)) == 1
    session.refresh_from_db()
    assert (session.status, session.paused_at) == (SessionStatus.PAUSED, start + timedelta(minutes=31))

    second = beat(persistent_agent, "two", now=start + timedelta(hours=2))

    assert second.session_id == session.id
    session.refresh_from_db()
    assert session.status == SessionStatus.ACTIVE and session.paused_at is None
    assert session.message_count == 4


def test_a_paused_session_past_its_ttl_expires_instead(persistent_agent, fake_anthropic):
    start = timezone.now()
    first = beat(persistent_agent, "one", now=start)
    maintenance_pass(now=start + timedelta(hours=1))
    maintenance_pass(now=start + timedelta(hours=25))
    assert AgentSession.objects.get(id=first.session_id).status == SessionStatus.EXPIRED
    assert beat(persistent_agent, "two", now=start + timedelta(hours=26)).session_id != first.session_id


def test_metering_bills_only_active_seconds(settings, company, tmp_path):
    settings.PAPERCLIP_SESSION_HOUR_USD = Decimal("0.08")
    script = tmp_path / "slow_agent.py"
    script.write_text(
        "import json, sys, time\njson.load(sys.stdin)\ntime.sleep(0.6)\n"
        "print(json.dumps({'text': 'done', 'usage': {'input_tokens': 1, 'output_tokens': 1}}))\n"
    )
    agent = Agent.objects.create(
        company=company,
        name="metered",
        adapter_type="process",
        adapter_config={"command": ["python3", str(script)], "session_mode": "persistent"},
    )
    start = timezone.now()
    beat(agent, "one", now=start)
    beat(agent, "two", now=start + timedelta(hours=3))  # three idle hours in between
    session = AgentSession.objects.get(agent=agent)
    assert 1.2 <= session.active_seconds < 10

    sessions_pause_idle(now=start + timedelta(hours=4))

    event = CostEvent.objects.get(kind=CostKind.SESSION_HOURS)
    assert event.session_seconds == round(session.active_seconds)
    assert event.cost_usd == (Decimal(str(session.active_seconds)) / 3600 * Decimal("0.08")).quantize(
        Decimal("0.0000000001")
    )
    session.refresh_from_db()
    assert session.unbilled_active_seconds == 0
    sessions_pause_idle(now=start + timedelta(hours=5))
    assert CostEvent.objects.filter(kind=CostKind.SESSION_HOURS).count() == 1  # billed once


def test_zero_rate_turns_metering_off(settings, persistent_agent, fake_anthropic):
    settings.PAPERCLIP_SESSION_HOUR_USD = Decimal(0)
    start = timezone.now()
    beat(persistent_agent, "one", now=start)
    sessions_pause_idle(now=start + timedelta(hours=1))
    assert not CostEvent.objects.filter(kind=CostKind.SESSION_HOURS).exists()


def test_a_call_that_would_cross_the_hard_limit_is_refused_before_any_request(persistent_agent, fake_anthropic):
    # claude-opus-4-5 with max_tokens 4096 can cost up to $0.10 in output alone.
    Budget.objects.create(company=persistent_agent.company, agent=persistent_agent, monthly_limit_usd=Decimal("0.05"))

    run = beat(persistent_agent, "expensive")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded")
    assert "monthly" in run.error
    assert fake_anthropic.requests == []
    assert not CostEvent.objects.exists()


def test_soft_warning_appears_near_the_limit(persistent_agent, fake_anthropic):
    Budget.objects.create(company=persistent_agent.company, monthly_limit_usd=Decimal("1.00"), warn_percent=80)
    CostEvent.objects.create(
        company=persistent_agent.company, agent=persistent_agent, model="claude-opus-4-5", cost_usd=Decimal("0.80")
    )
    run = beat(persistent_agent, "fine")
    assert run.status == RunStatus.SUCCEEDED
    assert run.warning.startswith("Budget warning: company monthly limit")


def test_hard_limit_pauses_the_agent_and_raising_the_budget_resumes_it(persistent_agent, fake_anthropic):
    budget = Budget.objects.create(
        company=persistent_agent.company, agent=persistent_agent, lifetime_limit_usd=Decimal("0.11")
    )
    CostEvent.objects.create(
        company=persistent_agent.company, agent=persistent_agent, model="claude-opus-4-5", cost_usd=Decimal("0.10")
    )
    refused = beat(persistent_agent, "over")
    assert refused.error_code == "budget_exceeded"
    CostEvent.objects.create(
        company=persistent_agent.company, agent=persistent_agent, model="claude-opus-4-5", cost_usd=Decimal("0.02")
    )
    refused_again = beat(persistent_agent, "over again")
    assert refused_again.error_code == "budget_exceeded"
    persistent_agent.refresh_from_db()
    assert (persistent_agent.status, persistent_agent.paused_reason) == (AgentStatus.PAUSED, "budget")
    with pytest.raises(HeartbeatRefused) as caught:
        heartbeat_enqueue(agent=persistent_agent, task="x", now=timezone.now())
    assert caught.value.code == "budget_exceeded"

    budget.lifetime_limit_usd = Decimal("10")
    budget.save()
    assert budgets_release(company_id=persistent_agent.company_id, now=timezone.now()) == 1
    persistent_agent.refresh_from_db()
    assert persistent_agent.status == AgentStatus.ACTIVE
    assert beat(persistent_agent, "back").status == RunStatus.SUCCEEDED


def test_a_summary_call_is_reserved_too_and_refused_before_any_request(company, fake_anthropic):
    agent = context_agent(company, context_budget_tokens=1000, keep_recent_turns=1)
    for i in range(3):
        assert beat(agent, f"step {i}: " + "w" * 1200).status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    sent = len(fake_anthropic.message_requests)
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("0.01"))

    # This turn no longer fits the context budget: the session would be summarised first.
    run = beat(agent, "step 3: " + "w" * 1200)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded")
    assert len(fake_anthropic.message_requests) == sent  # neither the summary nor the turn
    unchanged = AgentSession.objects.get(pk=session.pk)
    assert (unchanged.message_count, unchanged.compaction_count) == (session.message_count, session.compaction_count)


def test_a_handoff_call_is_reserved_too_and_refused_before_any_request(company, fake_anthropic):
    agent = context_agent(company, rotate_after_turns=3)
    for i in range(3):
        assert beat(agent, f"turn {i}").status == RunStatus.SUCCEEDED
    sent = len(fake_anthropic.message_requests)
    Budget.objects.create(company=company, agent=agent, monthly_limit_usd=Decimal("0.01"))

    run = beat(agent, "turn 3")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded")
    assert len(fake_anthropic.message_requests) == sent
    session = AgentSession.objects.get(agent=agent)
    assert (session.status, session.message_count) == (SessionStatus.ACTIVE, 6)


def test_a_handoff_not_yet_in_the_ledger_still_counts_against_the_turn(company, fake_anthropic):
    agent = context_agent(company, rotate_after_turns=3)
    for i in range(3):
        assert beat(agent, f"turn {i}").status == RunStatus.SUCCEEDED
    Budget.objects.create(company=company, agent=agent, monthly_limit_usd=Decimal("1.00"))
    # The note fits its own reservation, but reports $25 of output ($25/M on opus): the
    # turn's reservation must see it, although its ledger row is written with the answer.
    fake_anthropic.push(Reply.message("State: done.", usage={"input_tokens": 100, "output_tokens": 1_000_000}))
    sent = len(fake_anthropic.message_requests)

    run = beat(agent, "turn 3")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded")
    assert len(fake_anthropic.message_requests) == sent + 1  # the note only, never the turn
    # The note was billed although the run failed: the ledger has it.
    note = CostEvent.objects.get(run=run)
    assert (note.kind, note.output_tokens) == (CostKind.COMPACTION, 1_000_000)


def test_daily_run_cap(persistent_agent, fake_anthropic):
    Budget.objects.create(company=persistent_agent.company, agent=persistent_agent, daily_run_limit=2)
    assert [beat(persistent_agent, f"t{i}").status for i in range(3)] == ["succeeded", "succeeded", "failed"]
    assert HeartbeatRun.objects.order_by("-created_at").first().error_code == "budget_exceeded"


@pytest.mark.django_db(transaction=True)
def test_concurrent_heartbeats_near_the_limit_cannot_both_pass(postgres_only, company, fake_anthropic):
    agents = [
        Agent.objects.create(
            company=company, name=f"a{i}", adapter_config={"model": "claude-haiku-4-5", "max_tokens": 1000}
        )
        for i in range(4)
    ]
    # Each call can cost up to ~$0.005 (1000 output tokens at $5/MTok): room for one only.
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("0.008"))
    # Answers take long enough that all four reservations happen while one call is in flight.
    fake_anthropic.push(*[Reply.delay(2) for _ in range(4)])
    barrier = threading.Barrier(len(agents))
    results = []

    def fire(agent):
        try:
            run, _ = heartbeat_enqueue(agent=agent, task="go", now=timezone.now())
            barrier.wait()
            results.append(heartbeat_wait(run_id=run.id, timeout_seconds=30))
        finally:
            connection.close()

    threads = [threading.Thread(target=fire, args=(agent,)) for agent in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    statuses = sorted(run.status for run in results)
    assert statuses == ["failed", "failed", "failed", "succeeded"]
    assert {run.error_code for run in results if run.status == "failed"} == {"budget_exceeded"}
    assert len(fake_anthropic.message_requests) == 1


def test_budget_use_sums_every_scope_and_period_in_a_constant_number_of_queries(company, django_assert_num_queries):
    now = datetime(2026, 11, 15, 12, 0, tzinfo=UTC)
    worker, other = (Agent.objects.create(company=company, name=name) for name in ("worker", "other"))
    for agent, cost, at in [
        (worker, "1", now),
        (worker, "2", now - timedelta(days=3)),
        (worker, "4", now - timedelta(days=40)),
        (other, "8", now),
    ]:
        CostEvent.objects.create(company=company, agent=agent, cost_usd=Decimal(cost), created_at=at)
    for agent, status, reserved, started in [
        (worker, RunStatus.RUNNING, "0.5", now),
        (other, RunStatus.RUNNING, "0.25", now),
        (worker, RunStatus.SUCCEEDED, "0", now),
        (other, RunStatus.FAILED, "0", now),
        (worker, RunStatus.SUCCEEDED, "0", now - timedelta(days=1)),
    ]:
        HeartbeatRun.objects.create(
            company=company, agent=agent, task="t", status=status, reserved_usd=Decimal(reserved), started_at=started
        )
    hundred, fifty = Decimal(100), Decimal(50)
    Budget.objects.create(
        company=company,
        daily_limit_usd=hundred,
        monthly_limit_usd=hundred,
        lifetime_limit_usd=hundred,
        daily_run_limit=10,
    )
    Budget.objects.create(
        company=company, agent=worker, daily_limit_usd=fifty, monthly_limit_usd=fifty, daily_run_limit=5
    )

    with django_assert_num_queries(4):  # the budgets, money spent, money held, runs today
        uses = budget_uses(company_id=company.id, agent_id=worker.id, now=now)

    figures = {(use.scope, use.period): (use.spent, use.reserved) for use in uses}
    assert figures == {
        ("company", "day"): (Decimal(9), Decimal("0.75")),
        ("company", "month"): (Decimal(11), Decimal("0.75")),
        ("company", "lifetime"): (Decimal(15), Decimal("0.75")),
        ("company", "day_runs"): (Decimal(3), Decimal(0)),
        ("agent", "day"): (Decimal(1), Decimal("0.5")),
        ("agent", "month"): (Decimal(3), Decimal("0.5")),
        ("agent", "day_runs"): (Decimal(2), Decimal(0)),
    }
