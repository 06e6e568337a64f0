"""Prices: what a call's reported usage costs, to the micro-dollar, priced by the model requested."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal

from costs_app.models import Budget, CostEvent, ModelPrice
from costs_app.pricing import price_for
from sessions_app.models import Agent, AgentSession, RunStatus
from tests.conftest import beat
from tests.fake_anthropic import Reply

NOW = datetime(2026, 11, 15, 12, 0, tzinfo=UTC)


def test_a_snapshot_id_is_priced_as_its_family_unless_it_has_a_price_of_its_own(db):
    opus = price_for(model="claude-opus-4-5", at=NOW)
    assert price_for(model="claude-opus-4-5-20251101", at=NOW) == opus
    assert price_for(model="claude-opus-4-5-preview", at=NOW) is None

    own = ModelPrice.from_list_price("claude-opus-4-5-20251101", date(2025, 6, 1), Decimal("4"), Decimal("20"))
    own.save()
    assert price_for(model="claude-opus-4-5-20251101", at=NOW) == own


def test_an_answer_naming_a_snapshot_is_priced_and_trips_the_budget(stateless_agent, fake_anthropic):
    # One call of 4,000 output tokens on opus costs $0.10: the limit fits one.
    Budget.objects.create(company=stateless_agent.company, monthly_limit_usd=Decimal("0.25"))
    usage = {"input_tokens": 100, "output_tokens": 4000}
    fake_anthropic.push(
        *[Reply.message("ok", usage=usage, extra={"model": "claude-opus-4-5-20251101"}) for _ in range(10)]
    )

    runs = [beat(stateless_agent, f"call {i}") for i in range(10)]

    assert [run.status for run in runs[:2]] == [RunStatus.SUCCEEDED] * 2
    assert {(run.status, run.error_code) for run in runs[2:]} == {(RunStatus.FAILED, "budget_exceeded")}
    event = CostEvent.objects.filter(run=runs[0]).get()
    assert (event.model, event.unpriced) == ("claude-opus-4-5", False)
    assert event.cost_usd == Decimal("0.1005")
    assert runs[0].model == "claude-opus-4-5-20251101"  # the run shows what answered


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


def test_unknown_model_is_recorded_unpriced_not_refused(company, fake_anthropic):
    agent = Agent.objects.create(company=company, name="new", adapter_config={"model": "claude-future-9"})
    run = beat(agent, "hi")
    assert run.status == RunStatus.SUCCEEDED
    event = CostEvent.objects.get()
    assert event.unpriced and event.cost_usd == 0 and event.input_tokens > 0
