"""The ledger: one row per billed call, identified by its run and its number in the run,
never by the message id it reports."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from decimal import Decimal

from django.utils import timezone

from costs_app.budgets import budget_uses
from costs_app.ledger import cost_event_record
from costs_app.models import Budget, CostEvent
from sessions_app.models import Agent, HeartbeatRun, RunStatus
from tests.conftest import beat
from tests.fake_anthropic import Reply

NOW = datetime(2026, 11, 15, 12, 0, tzinfo=UTC)


def fixed_id_agent(company, tmp_path, name="cli"):
    """A `process` agent whose command reports the same message id on every call."""
    script = tmp_path / f"{name}.py"
    script.write_text(
        "import json, sys\n"
        "json.load(sys.stdin)\n"
        "print(json.dumps({'text': 'done', 'message_id': 'msg_fixed',\n"
        "                  'usage': {'input_tokens': 1000, 'output_tokens': 1000}}))\n"
    )
    return Agent.objects.create(
        company=company,
        name=name,
        adapter_type="process",
        adapter_config={"command": [sys.executable, str(script)], "model": "claude-haiku-4-5"},
    )


def test_calls_reporting_one_message_id_are_each_in_the_ledger(company, tmp_path):
    agent = fixed_id_agent(company, tmp_path)

    runs = [beat(agent, f"call {i}") for i in range(3)]

    assert [run.status for run in runs] == [RunStatus.SUCCEEDED] * 3
    events = CostEvent.objects.filter(agent_id=agent.id)
    assert sorted(e.run_id for e in events) == sorted(run.id for run in runs)
    assert {e.message_id for e in events} == {"msg_fixed"}  # kept, for display
    assert sum(e.cost_usd for e in events) == 3 * runs[0].cost_usd > 0


def test_an_id_reported_in_another_company_is_charged_to_each_company(company, other_company, tmp_path):
    ours, theirs = fixed_id_agent(company, tmp_path, "ours"), fixed_id_agent(other_company, tmp_path, "theirs")
    Budget.objects.create(company=other_company, monthly_limit_usd=Decimal("10"))

    assert beat(ours, "first").status == RunStatus.SUCCEEDED
    assert beat(theirs, "second").status == RunStatus.SUCCEEDED

    assert CostEvent.objects.filter(company=company).count() == 1
    assert CostEvent.objects.filter(company=other_company).count() == 1
    [use] = budget_uses(company_id=other_company.id, agent_id=theirs.id, now=timezone.now())
    assert use.spent == HeartbeatRun.objects.get(agent=theirs).cost_usd > 0


def test_a_retried_write_of_one_call_bills_it_once(stateless_agent):
    run = HeartbeatRun.objects.create(company=stateless_agent.company, agent=stateless_agent, task="t")
    usage = {"input_tokens": 10, "output_tokens": 5}
    call = {
        "usage": usage,
        "model": "claude-opus-4-5",
        "company_id": stateless_agent.company_id,
        "agent_id": stateless_agent.id,
        "run_id": run.id,
        "at": NOW,
    }

    first = cost_event_record(**call, call_number=1, message_id="msg_a")
    again = cost_event_record(**call, call_number=1, message_id="msg_a")
    second_call = cost_event_record(**call, call_number=2, message_id="msg_a")

    assert again.pk == first.pk
    assert second_call.pk != first.pk
    assert CostEvent.objects.filter(run=run).count() == 2


def test_a_call_without_usage_writes_no_cost_row(stateless_agent, fake_anthropic):
    fake_anthropic.push(Reply.no_usage())
    run = beat(stateless_agent, "free?")
    assert run.status == RunStatus.SUCCEEDED
    assert not CostEvent.objects.exists()
