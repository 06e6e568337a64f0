"""Reservations that bound the spend: the dearest way a call can be billed, unpriced
models and zero limits."""

from __future__ import annotations

import threading
from decimal import ROUND_DOWN, Decimal

import pytest
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from costs_app.models import Budget, CostEvent, ModelPrice
from costs_app.pricing import MILLION, price_for
from sessions_app.context import build_request, context_settings, estimate_tokens
from sessions_app.heartbeat import HeartbeatRefused, heartbeat_enqueue, heartbeat_execute, heartbeat_wait
from sessions_app.models import Agent, AgentSession, RunStatus
from sessions_app.stores import store_for
from tests.conftest import beat
from tests.fake_anthropic import Reply, dense_tokens


def plain_input_estimate(agent, task: str, history: list | None = None) -> Decimal:
    """What a reservation pricing every input token at the plain input rate holds."""
    request = build_request(agent=agent, history=history or [], user_content=task, settings=context_settings(agent))
    size = estimate_tokens({"system": request.system_blocks or request.system, "messages": request.messages})
    price = price_for(model=agent.model_name, at=timezone.now())
    max_tokens = agent.adapter_config.get("max_tokens", 4096)
    return (size * price.input_usd_per_mtok + max_tokens * price.output_usd_per_mtok) / MILLION


def spent() -> Decimal:
    return CostEvent.objects.aggregate(total=Sum("cost_usd"))["total"] or Decimal(0)


@pytest.mark.django_db(transaction=True)
def test_concurrent_cached_calls_cannot_cross_the_limit(postgres_only, company, fake_anthropic):
    # Four agents whose input is nearly all system prompt, written to the 1-hour cache at
    # 2x the input price (each its own prompt, so no call reads another's cache).
    agents = [
        Agent.objects.create(
            company=company,
            name=f"a{i}",
            system_prompt=f"Agent {i}. " + "Background material. " * 4000,
            adapter_config={"model": "claude-opus-4-5", "max_tokens": 16, "cache_ttl": "1h"},
        )
        for i in range(4)
    ]
    limit = (4 * plain_input_estimate(agents[0], "go")).quantize(Decimal("0.000001"), rounding=ROUND_DOWN)
    Budget.objects.create(company=company, monthly_limit_usd=limit)
    # Answers take long enough that every reservation happens while the others are in flight.
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

    assert len(results) == 4
    assert {run.error_code for run in results if run.status == RunStatus.FAILED} <= {"budget_exceeded"}
    assert CostEvent.objects.filter(cache_creation_1h_input_tokens__gt=0).exists()
    assert spent() <= limit


def test_server_compaction_is_reserved_as_two_readings_of_the_input(settings, company, fake_anthropic):
    settings.PAPERCLIP_MAX_TASK_CHARS = 400_000
    agent = Agent.objects.create(
        company=company,
        name="server",
        adapter_config={
            "model": "claude-opus-4-5",
            "session_mode": "persistent",
            "context_strategy": "server",
            "compaction_trigger_tokens": 50_000,
            "max_tokens": 16,
        },
    )
    assert beat(agent, "small one").status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    big = "data " * 45_000
    # Room for the call as if its input were read once; the compaction reads it twice.
    before = spent()
    limit = (before + plain_input_estimate(agent, big, store_for(session).read(session)) * Decimal("1.2")).quantize(
        Decimal("0.000001")
    )
    Budget.objects.create(company=company, monthly_limit_usd=limit)

    beat(agent, big)

    assert spent() <= limit


def test_a_budgeted_agent_on_an_unpriced_model_is_refused_before_any_call(company, fake_anthropic):
    agent = Agent.objects.create(company=company, name="new", adapter_config={"model": "claude-future-9"})
    run, _ = heartbeat_enqueue(agent=agent, task="queued before the budget", now=timezone.now())
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("5"))

    with pytest.raises(HeartbeatRefused) as refused:
        heartbeat_enqueue(agent=agent, task="after", now=timezone.now())
    assert refused.value.code == "model_unpriced"
    # A run queued before the budget existed is refused when it would call.
    done = heartbeat_execute(run_id=run.id)
    assert (done.status, done.error_code) == (RunStatus.FAILED, "model_unpriced")
    assert "claude-future-9" in done.error
    assert fake_anthropic.message_requests == []


def test_an_unpriced_summary_model_is_refused_too(company, fake_anthropic):
    agent = Agent.objects.create(
        company=company,
        name="summarising",
        adapter_config={"model": "claude-opus-4-5", "session_mode": "persistent", "summary_model": "cheap-unknown"},
    )
    Budget.objects.create(company=company, agent=agent, monthly_limit_usd=Decimal("5"))

    with pytest.raises(HeartbeatRefused) as refused:
        heartbeat_enqueue(agent=agent, task="go", now=timezone.now())
    assert refused.value.code == "model_unpriced"


def test_an_unpriced_model_without_a_money_limit_still_runs(company, fake_anthropic):
    agent = Agent.objects.create(company=company, name="capped", adapter_config={"model": "claude-future-9"})
    Budget.objects.create(company=company, daily_run_limit=5)

    run = beat(agent, "go")

    assert run.status == RunStatus.SUCCEEDED
    assert CostEvent.objects.get(run=run).unpriced


@pytest.mark.parametrize("model", ["free-local-model", "claude-opus-4-5"])
def test_a_zero_limit_refuses_every_call(company, fake_anthropic, model):
    ModelPrice.from_list_price("free-local-model", timezone.now().date(), Decimal(0), Decimal(0)).save()
    agent = Agent.objects.create(company=company, name="zero", adapter_config={"model": model})
    Budget.objects.create(company=company, agent=agent, daily_limit_usd=Decimal(0))

    run = beat(agent, "go")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded")
    assert "$0" in run.error
    assert fake_anthropic.message_requests == []


@pytest.mark.django_db(transaction=True)
def test_a_call_denser_than_the_character_estimate_is_measured_and_refused(company, fake_anthropic):
    # 20,000 CJK characters: about 5,000 tokens by four characters a token, 20,000 as the
    # API counts them. Far under the limit by the estimate, over it in truth.
    fake_anthropic.tokens = dense_tokens
    agent = Agent.objects.create(
        company=company, name="dense", adapter_config={"model": "claude-opus-4-5", "max_tokens": 16}
    )
    task = "語" * 20_000
    Budget.objects.create(company=company, agent=agent, monthly_limit_usd=Decimal("0.10"))

    run = beat(agent, task)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded"), run.error
    assert fake_anthropic.message_requests == []  # refused before the call was sent
    assert spent() == 0


@pytest.mark.django_db(transaction=True)
def test_a_call_that_fits_by_its_byte_bound_is_reserved_at_that_bound_without_a_count(company, fake_anthropic):
    agent = Agent.objects.create(
        company=company, name="small", adapter_config={"model": "claude-opus-4-5", "max_tokens": 16}
    )
    Budget.objects.create(company=company, agent=agent, monthly_limit_usd=Decimal("100"))

    run = beat(agent, "a short task")

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert [r["path"] for r in fake_anthropic.requests] == ["/v1/messages"]  # no count_tokens request
