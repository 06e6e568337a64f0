"""Budgets stop spend before it happens: hard and soft limits, pauses, daily run caps, and
reservations that bound the spend (summaries and handoff notes too, the dearest way a call
can be billed, unpriced models, zero limits, concurrent heartbeats)."""

from __future__ import annotations

import re
import threading
from datetime import UTC, datetime, timedelta
from decimal import ROUND_DOWN, Decimal

import pytest
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from costs_app.budget_views import budget_set
from costs_app.budgets import budget_uses
from costs_app.models import Budget, CostEvent, CostKind, ModelPrice
from costs_app.pricing import MILLION, price_table
from costs_app.signals import budget_changed
from sessions_app import services
from sessions_app.context import build_request, context_settings, estimate_tokens
from sessions_app.errors import HeartbeatRefused
from sessions_app.heartbeat import heartbeat_execute, heartbeat_wait
from sessions_app.maintenance import runs_reap
from sessions_app.models import Agent, AgentSession, AgentStatus, HeartbeatRun, RunStatus, SessionStatus
from sessions_app.run_queue import heartbeat_enqueue
from sessions_app.services import budgets_release
from sessions_app.stores import store_for
from tests.conftest import (
    Actor,
    WriteGate,
    agent_on_unknown_model,
    beat,
    context_agent,
    managed_agent,
    wait_until_blocked,
)
from tests.fake_anthropic import Reply, dense_tokens


def plain_input_estimate(agent, task: str, history: list | None = None) -> Decimal:
    """What a reservation pricing every input token at the plain input rate holds."""
    request = build_request(agent=agent, history=history or [], user_content=task, settings=context_settings(agent))
    size = estimate_tokens({"system": request.system_blocks or request.system, "messages": request.messages})
    rates = price_table(model=agent.model_name, at=timezone.now()).rates(prompt_tokens=size)
    max_tokens = agent.adapter_config.get("max_tokens", 4096)
    return (size * rates.input + max_tokens * rates.output) / MILLION


def spent() -> Decimal:
    return CostEvent.objects.aggregate(total=Sum("cost_usd"))["total"] or Decimal(0)


def race(agents: list[Agent]) -> list:
    """One heartbeat per agent, each in its own thread and connection, all reserving at
    once (a barrier after the enqueue); the finished runs."""
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
    return results


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
    fake_anthropic.push(*[Reply.delay(2) for _ in range(len(agents))])
    results = race(agents)

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
            # Input at the plain rate: a cache write's 1.25x alone would exceed the margin below.
            "prompt_caching": False,
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
    sent = len(fake_anthropic.message_requests)

    run = beat(agent, big)

    # Reserved as two readings of the input, the call does not fit: refused before it is sent.
    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded"), (run.status, run.error)
    assert len(fake_anthropic.message_requests) == sent
    assert spent() == before <= limit


def test_an_agent_that_names_no_geo_is_reserved_at_the_dearest_geo_it_may_be_billed_in(company, fake_anthropic):
    # Unset, the geo is the workspace's default, which the answer may report as `us`:
    # billed at 1.1x, so the reservation holds 1.1x.
    agent = Agent.objects.create(
        company=company, name="default geo", adapter_config={"model": "claude-opus-5-5", "max_tokens": 1000}
    )
    usage = {"input_tokens": 10, "output_tokens": 1000, "inference_geo": "us"}
    rates = price_table(model="claude-opus-5-5", at=timezone.now()).rates()
    billed = Decimal("1.1") * (10 * rates.input + 1000 * rates.output) / MILLION
    Budget.objects.create(
        company=company, agent=agent, monthly_limit_usd=(billed * Decimal("0.99")).quantize(Decimal("0.0001"))
    )
    fake_anthropic.push(Reply.message("done", usage=usage))

    run = beat(agent, "go")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded"), run.error
    assert fake_anthropic.message_requests == [] and spent() == 0


def test_a_managed_turn_resuming_after_its_worker_died_still_holds_its_reservation(company, fake_anthropic):
    # Its turn goes on at the provider while no worker holds it: what it may still spend
    # stays held, or another agent's call could take the same room.
    remote = managed_agent(company)
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("1.01"))
    run, _ = heartbeat_enqueue(agent=remote, task="the long task", now=timezone.now())
    now = run.created_at
    HeartbeatRun.objects.filter(pk=run.pk).update(
        status=RunStatus.RUNNING,
        started_at=now,
        deadline_at=now,
        reserved_usd=Decimal("1"),
        managed_session_id="sesn_remote",
        managed_turn={"cursor": "", "opening": []},
    )
    runs_reap(now=now + timedelta(seconds=1))
    assert HeartbeatRun.objects.get(pk=run.pk).status == RunStatus.RESUMING
    local = Agent.objects.create(
        company=company, name="local", adapter_config={"model": "claude-opus-4-5", "max_tokens": 1000}
    )

    refused = beat(local, "go")

    assert (refused.status, refused.error_code) == (RunStatus.FAILED, "budget_exceeded"), refused.error
    assert fake_anthropic.message_requests == []


def test_a_budgeted_agent_on_an_unpriced_model_is_refused_before_any_call(company, fake_anthropic):
    agent = agent_on_unknown_model(company, "claude-future-9")
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


@pytest.mark.parametrize("scope", ["company", "agent"])
def test_a_session_limit_alone_refuses_an_unpriced_model(company, fake_anthropic, scope):
    """A budget whose only limit is session_limit_usd: a session's spend could not be told
    at $0 a call, so the model is refused as under any money limit (before, four turns
    went to one session at $0 each)."""
    agent = agent_on_unknown_model(company, "claude-future-9", session_mode="persistent")
    run, _ = heartbeat_enqueue(agent=agent, task="queued before the budget", now=timezone.now())
    Budget.objects.create(company=company, agent=agent if scope == "agent" else None, session_limit_usd=Decimal("1"))

    with pytest.raises(HeartbeatRefused) as refused:
        heartbeat_enqueue(agent=agent, task="after", now=timezone.now())
    assert refused.value.code == "model_unpriced"
    done = heartbeat_execute(run_id=run.id)
    assert (done.status, done.error_code) == (RunStatus.FAILED, "model_unpriced")
    assert fake_anthropic.message_requests == []
    assert not CostEvent.objects.exists()


def test_an_unpriced_summary_model_is_refused_too(company, fake_anthropic):
    agent = Agent.objects.create(
        company=company, name="summarising", adapter_config={"model": "claude-opus-4-5", "session_mode": "persistent"}
    )
    # Saved before the model checks (which refuse an unknown summary model now).
    Agent.objects.filter(pk=agent.pk).update(adapter_config={**agent.adapter_config, "summary_model": "cheap-unknown"})
    agent.refresh_from_db()
    Budget.objects.create(company=company, agent=agent, monthly_limit_usd=Decimal("5"))

    with pytest.raises(HeartbeatRefused) as refused:
        heartbeat_enqueue(agent=agent, task="go", now=timezone.now())
    assert refused.value.code == "model_unpriced"


def test_an_unpriced_model_without_a_money_limit_still_runs(company, fake_anthropic):
    agent = agent_on_unknown_model(company, "claude-future-9")
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


def test_a_call_that_would_cross_the_hard_limit_is_refused_before_any_request(persistent_agent, fake_anthropic):
    # claude-opus-4-5 with max_tokens 4096 can cost up to $0.10 in output alone.
    Budget.objects.create(company=persistent_agent.company, agent=persistent_agent, monthly_limit_usd=Decimal("0.05"))

    run = beat(persistent_agent, "expensive")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded")
    assert "monthly" in run.error
    assert fake_anthropic.requests == []
    assert not CostEvent.objects.exists()


def test_a_refusal_names_a_limit_below_a_cent_as_it_is(persistent_agent, fake_anthropic):
    Budget.objects.create(company=persistent_agent.company, daily_limit_usd=Decimal("0.005"))

    run = beat(persistent_agent, "expensive")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded")
    assert "company daily budget of $0.005 (spent $0.00, $0.00 held by running calls)" in run.error, run.error
    estimate = re.search(r"could cost up to \$(\S+),", run.error).group(1)
    assert Decimal(estimate) > 0 and not estimate.endswith("0"), estimate


def test_a_run_cap_is_counted_in_whole_runs(persistent_agent, fake_anthropic):
    Budget.objects.create(company=persistent_agent.company, agent=persistent_agent, daily_run_limit=1)
    assert beat(persistent_agent, "first").status == RunStatus.SUCCEEDED
    (use,) = budget_uses(company_id=persistent_agent.company_id, agent_id=persistent_agent.id, now=timezone.now())

    refused = beat(persistent_agent, "second")

    assert use.describe() == "agent daily run limit: 1 of 1 runs used (100%)"
    assert refused.error == "The agent daily run cap of 1 runs is reached."


def test_soft_warning_appears_near_the_limit(persistent_agent, fake_anthropic):
    Budget.objects.create(company=persistent_agent.company, monthly_limit_usd=Decimal("1.00"), warn_percent=80)
    CostEvent.objects.create(
        company=persistent_agent.company, agent=persistent_agent, model="claude-opus-4-5", cost_usd=Decimal("0.80")
    )
    run = beat(persistent_agent, "fine")
    assert run.status == RunStatus.SUCCEEDED
    assert run.warning.startswith("Budget warning: company monthly limit")


def test_a_warning_says_what_crossed_its_threshold(persistent_agent, fake_anthropic):
    # The spend alone is 1% of the limit; with this call's reservation it is past 10%.
    Budget.objects.create(company=persistent_agent.company, monthly_limit_usd=Decimal("0.20"), warn_percent=10)
    CostEvent.objects.create(
        company=persistent_agent.company, agent=persistent_agent, model="claude-opus-4-5", cost_usd=Decimal("0.002255")
    )

    run = beat(persistent_agent, "fine")

    assert run.status == RunStatus.SUCCEEDED
    match = re.fullmatch(
        r"Budget warning: company monthly limit: (\S+) of (\S+) USD used and (\S+) held for this call and calls "
        r"in flight \((\d+)%\), past its 10% warning",
        run.warning,
    )
    assert match, run.warning
    spent, limit, held, percent = match.groups()
    assert (spent, limit) == ("0.002255", "0.20")
    assert int(percent) >= 10
    assert int(percent) == round((Decimal(spent) + Decimal(held)) / Decimal(limit) * 100)


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


@pytest.mark.django_db(transaction=True)
def test_a_budget_raised_while_the_pause_for_budget_is_decided_leaves_the_agent_active(persistent_agent, monkeypatch):
    """The worst moment for the raise: the enforcement has read the spent limit and not yet
    paused the agent, when an operator raises the budget (its own connection, as the API's
    PUT does: the write, then `budget_changed`). The raise's release waits for the pause to
    commit and then resumes the agent, with no maintenance pass (before: the release ran in
    between, found nobody paused, and the agent stayed paused until the next pass)."""
    agent = persistent_agent
    Budget.objects.create(company=agent.company, agent=agent, lifetime_limit_usd=Decimal("0.11"))
    CostEvent.objects.create(company=agent.company, agent=agent, model="claude-opus-4-5", cost_usd=Decimal("0.12"))

    def raise_budget():
        budget_set(company=agent.company, agent=agent, values={"lifetime_limit_usd": Decimal("10")})
        budget_changed.send(sender=Budget, company_id=agent.company_id, now=timezone.now())

    raised = []
    read_then_pause = services.crossed_scopes

    def between_the_read_and_the_pause(uses):
        raiser = Actor(raise_budget)
        raiser.start()
        raised.append(raiser)
        try:
            wait_until_blocked(raiser)  # on the lock the enforcement holds
        except AssertionError:
            raiser.result()  # it did not wait: its release has run already
        return read_then_pause(uses)

    monkeypatch.setattr(services, "crossed_scopes", between_the_read_and_the_pause)
    assert services.budgets_enforce(agent=agent, now=timezone.now())  # the limit it read was spent
    (raiser,) = raised
    raiser.result()

    agent.refresh_from_db()
    assert (agent.status, agent.paused_reason) == (AgentStatus.ACTIVE, "")
    assert Budget.objects.get(agent=agent).lifetime_limit_usd == Decimal("10")


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
    fake_anthropic.push(*[Reply.delay(2) for _ in range(len(agents))])
    results = race(agents)

    statuses = sorted(run.status for run in results)
    assert statuses == ["failed", "failed", "failed", "succeeded"]
    assert {run.error_code for run in results if run.status == "failed"} == {"budget_exceeded"}
    assert len(fake_anthropic.message_requests) == 1


@pytest.mark.django_db(transaction=True)
def test_a_reservation_arriving_while_anothers_is_uncommitted_waits_for_it_and_is_refused(company, fake_anthropic):
    """The worst moment for "cannot overshoot together": the first heartbeat has read the
    budget's use and written its reservation, not yet committed (held at a gate inside its
    UPDATE), when the second reads the use. Without the lock on the company row (SQLite:
    the IMMEDIATE transaction) the second reads no reservation and both calls are sent."""
    first_agent, second_agent = (
        Agent.objects.create(
            company=company, name=name, adapter_config={"model": "claude-haiku-4-5", "max_tokens": 1000}
        )
        for name in ("first", "second")
    )
    # Each call can cost up to ~$0.005 (1000 output tokens at $5/MTok): room for one only.
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("0.008"))
    now = timezone.now()
    first_run, _ = heartbeat_enqueue(agent=first_agent, task="go", now=now)
    second_run, _ = heartbeat_enqueue(agent=second_agent, task="go", now=now)
    # The first call stays in flight (its reservation held) until the second has finished:
    # on SQLite the second waits at its first write, before its reservation, and would
    # otherwise find the first's call ended and its reservation released.
    second_done = threading.Event()
    fake_anthropic.push(Reply.during(lambda: second_done.wait(30)))

    def second_heartbeat():
        try:
            return heartbeat_execute(run_id=second_run.id)
        finally:
            second_done.set()

    reservation = f"NEW.reserved_usd > 0 AND OLD.reserved_usd = 0 AND NEW.agent_id = '{first_agent.id.hex}'"
    if connection.vendor == "postgresql":
        reservation = reservation.replace(f"'{first_agent.id.hex}'", f"'{first_agent.id}'::uuid")
    with WriteGate("heartbeat_runs", event="UPDATE", when=reservation) as gate:
        first = Actor(lambda: heartbeat_execute(run_id=first_run.id))
        first.start()
        gate.wait_entered()
        second = Actor(second_heartbeat)
        second.start()
        wait_until_blocked(second)
        gate.open()
        first_done, second_done = first.result(), second.result()

    assert (first_done.status, first_done.error_code) == (RunStatus.SUCCEEDED, ""), first_done.error
    assert (second_done.status, second_done.error_code) == (RunStatus.FAILED, "budget_exceeded"), second_done.error
    assert len(fake_anthropic.message_requests) == 1
    assert spent() <= Decimal("0.008")


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
