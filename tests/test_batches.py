"""Batch delivery (`sessions_app.batch_delivery`, `sessions_app.batches`): scheduled
heartbeats, and API heartbeats asking for it, through the Message Batches API of the fake,
by the real SDK, committed by the poll through the normal commit step, billed once at the
batch price."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta
from decimal import Decimal
from unittest.mock import ANY

import anthropic
import pytest
from django.utils import timezone

from costs_app.models import CostEvent
from costs_app.pricing import call_price
from sessions_app import tasks
from sessions_app.adapters import AgentConfigError, validate_agent_config
from sessions_app.batches import SUBMIT_GRACE, batches_poll, batches_read, batches_submit
from sessions_app.heartbeat import heartbeat_execute, heartbeat_start
from sessions_app.models import Agent, AgentSession, BatchState, HeartbeatRun, RunStatus, RunTrigger
from sessions_app.stores import store_for
from tests.api.conftest import Api, agent_url, assert_error
from tests.conftest import ROOT, database_environment, writes_refused

BATCH = {"model": "claude-opus-4-5", "delivery": "batch"}


def batch_agent(company, name="Batcher", **config) -> Agent:
    return Agent.objects.create(
        company=company,
        name=name,
        system_prompt="You work on schedule.",
        adapter_type="claude-code",
        adapter_config={**BATCH, **config},
    )


def tick(agent) -> HeartbeatRun:
    """A scheduled wake, as the scheduler fires it (the run executes in the tick's worker)."""
    tasks.scheduled_heartbeat(str(agent.id))
    return HeartbeatRun.objects.filter(agent=agent).order_by("-created_at").first()


def run_dispatched(agent) -> HeartbeatRun:
    """What the task cluster does with the run the poll handed it."""
    run = HeartbeatRun.objects.filter(agent=agent).order_by("created_at").exclude(status=RunStatus.SUCCEEDED).first()
    return heartbeat_execute(run_id=run.id)


def history(agent) -> list[dict]:
    session = AgentSession.objects.get(agent=agent)
    return store_for(session).read(session)


def batch_bill(fake) -> Decimal:
    """What the provider billed for the batch's answers: half of each rate (genai-prices'
    direct price of the same usage, halved)."""
    now = timezone.now()
    return sum(
        (call_price(usage=a["usage"], model=a["model"], at=now).cost_usd / 2 for a in fake.batch_answers), Decimal(0)
    )


def test_a_hundred_batch_agents_waking_at_once_make_one_batch_and_each_run_commits_once(company, fake_anthropic):
    fake_anthropic.batch_seconds = 600
    clock = [0.0]
    fake_anthropic.clock = lambda: clock[0]
    agents = [batch_agent(company, f"agent {n}", session_mode="persistent") for n in range(100)]
    runs = [tick(agent) for agent in agents]
    # Each tick's worker parked its run and went: no direct request, no batch yet.
    assert {(run.status, run.batch_state) for run in runs} == {(RunStatus.SUBMITTED, BatchState.PARKED)}
    assert fake_anthropic.message_requests == [] and fake_anthropic.batch_creates == 0
    now = timezone.now()
    assert batches_poll(now=now) == {"submitted": 100, "read": 0, "committed": 0}
    assert fake_anthropic.batch_creates == 1
    (batch,) = fake_anthropic.batches.values()
    assert len(batch["requests"]) == 100
    assert set(HeartbeatRun.objects.values_list("batch_state", "status")) == {
        (BatchState.IN_BATCH, RunStatus.SUBMITTED)
    }
    assert batches_poll(now=now)["committed"] == 0  # still processing
    clock[0] += 600
    assert batches_poll(now=now) == {"submitted": 0, "read": 100, "committed": 100}
    assert batches_poll(now=now) == {"submitted": 0, "read": 0, "committed": 0}
    assert fake_anthropic.batch_creates == 1 and fake_anthropic.message_requests == []
    for agent, run in zip(agents, runs, strict=True):
        run.refresh_from_db()
        assert run.status == RunStatus.SUCCEEDED and run.batch_id == batch["id"]
        assert [turn["role"] for turn in history(agent)] == ["user", "assistant"]
        assert history(agent)[1]["content"][0]["text"] == run.output
    rows = CostEvent.objects.filter(run__in=[r.id for r in runs])
    assert rows.count() == 100 and set(rows.values_list("delivery", "call_number")) == {("batch", 1)}
    total = sum((row.cost_usd for row in rows), Decimal(0))
    assert abs(total - batch_bill(fake_anthropic)) <= Decimal("1e-6")
    assert total > 0
    for row in rows[:3]:  # half of each rate
        assert row.cost_usd == (call_price(usage=row.raw_usage, model=row.model, at=row.created_at).cost_usd / 2)
        assert (
            row.cost_usd
            == call_price(usage=row.raw_usage, model=row.model, at=row.created_at, delivery="batch").cost_usd
        )


def test_a_persistent_batch_agent_keeps_one_heartbeat_in_flight_and_its_turns_in_order(company, fake_anthropic):
    agent = batch_agent(company, session_mode="persistent")
    first = tick(agent)
    batches_poll(now=timezone.now())
    assert HeartbeatRun.objects.get(id=first.id).status == RunStatus.SUCCEEDED
    second = tick(agent)
    assert second.status == RunStatus.SUBMITTED
    # While it waits: the next tick merges into it, an API heartbeat queues behind it.
    tasks.scheduled_heartbeat(str(agent.id))
    assert HeartbeatRun.objects.get(id=second.id).merged_ticks == 1
    api, _ = heartbeat_start(agent=agent, task="from the API", trigger=RunTrigger.API, now=timezone.now(), wait=False)
    assert heartbeat_execute(run_id=api.id).status == RunStatus.QUEUED
    batches_poll(now=timezone.now())
    assert HeartbeatRun.objects.get(id=second.id).status == RunStatus.SUCCEEDED
    assert heartbeat_execute(run_id=api.id).status == RunStatus.SUCCEEDED  # its dispatch, as the cluster runs it
    turns = history(agent)
    assert [t["role"] for t in turns] == ["user", "assistant"] * 3
    assert [t["run_id"] for t in turns[::2]] == [str(first.id), str(second.id), str(api.id)]
    # The second batch request replayed the first turn; the direct one both.
    second_request = list(fake_anthropic.batches.values())[1]["requests"][0]["params"]
    assert len(second_request["messages"]) == 3
    assert len(fake_anthropic.message_requests[-1]["messages"]) == 5
    assert [t["seq"] for t in turns] == list(range(len(turns)))


def test_errored_and_expired_results_are_sent_direct_once(company, fake_anthropic):
    fake_anthropic.batch_outcomes = ["expired", "errored"]
    agents = [batch_agent(company, f"agent {n}") for n in range(3)]
    runs = [tick(agent) for agent in agents]
    assert batches_poll(now=timezone.now())["committed"] == 1
    states = {run.id: HeartbeatRun.objects.get(id=run.id) for run in runs}
    assert [states[r.id].batch_state for r in runs] == [BatchState.DIRECT, BatchState.DIRECT, BatchState.ANSWERED]
    assert "expired" in states[runs[0].id].warning and "errored" in states[runs[1].id].warning
    for agent in agents[:2]:
        assert run_dispatched(agent).status == RunStatus.SUCCEEDED
    assert batches_poll(now=timezone.now()) == {"submitted": 0, "read": 0, "committed": 0}
    # Two direct requests, one per run that was not answered in the batch; each run billed once.
    assert len(fake_anthropic.message_requests) == 2
    assert list(CostEvent.objects.order_by("delivery").values_list("delivery", flat=True)) == [
        "batch",
        "direct",
        "direct",
    ]
    assert all(HeartbeatRun.objects.get(id=r.id).status == RunStatus.SUCCEEDED for r in runs)


def test_a_batch_still_processing_past_the_max_wait_is_cancelled_and_its_run_sent_direct(company, fake_anthropic):
    fake_anthropic.batch_seconds = 3600
    agent = batch_agent(company, batch_max_wait_minutes=30)
    run = tick(agent)
    start = timezone.now()
    batches_poll(now=start)
    assert batches_poll(now=start + timedelta(minutes=29))["read"] == 0
    assert not next(iter(fake_anthropic.batches.values()))["cancelled"]
    batches_poll(now=start + timedelta(minutes=31))  # cancels: ends with the request canceled
    batches_poll(now=start + timedelta(minutes=32))
    run.refresh_from_db()
    assert run.batch_state == BatchState.DIRECT and "canceled" in run.warning
    assert run_dispatched(agent).status == RunStatus.SUCCEEDED
    assert len(fake_anthropic.message_requests) == 1 and fake_anthropic.batch_answers == []
    assert list(CostEvent.objects.values_list("delivery", flat=True)) == ["direct"]


def test_api_heartbeats_with_wait_are_always_direct(company, fake_anthropic):
    agent = batch_agent(company)
    run, _ = heartbeat_start(agent=agent, task="now please", trigger=RunTrigger.API, now=timezone.now(), wait=True)
    assert run.status == RunStatus.SUCCEEDED and run.batch_state == ""
    assert len(fake_anthropic.message_requests) == 1 and fake_anthropic.batch_creates == 0


def test_a_batch_the_api_refuses_to_create_stays_parked_and_is_sent_by_a_later_poll(company, fake_anthropic):
    agent = batch_agent(company)
    run = tick(agent)
    fake_anthropic.batch_create_error = 400
    batches_poll(now=timezone.now())
    run.refresh_from_db()
    assert (run.status, run.batch_state, run.batch_id) == (RunStatus.SUBMITTED, BatchState.PARKED, "")
    fake_anthropic.batch_create_error = None
    batches_poll(now=timezone.now())
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED and CostEvent.objects.count() == 1
    assert fake_anthropic.batch_creates == 2 and fake_anthropic.message_requests == []


@pytest.mark.parametrize("lost_with", [500, "timeout"])
def test_a_create_whose_answer_is_lost_is_never_sent_again_and_its_batch_is_found(company, fake_anthropic, lost_with):
    """The provider made the batch and its answer never came back (a 500 after the create,
    or no answer before the client's timeout). Sent again by the SDK's retry or the next
    poll, the request would be answered, and charged, twice: the SDK does not retry the
    create, the runs wait `submitting`, and once any create is over the batch is found at
    the provider, its answer billed once at batch price and committed."""
    agent = batch_agent(company, session_mode="persistent", timeout_seconds=1, max_retries=2)
    run = tick(agent)
    start = timezone.now()
    if lost_with == "timeout":
        fake_anthropic.batch_before = lambda: time.sleep(2)
    else:
        fake_anthropic.batch_create_answer_lost = lost_with
    assert batches_poll(now=start)["submitted"] == 0
    fake_anthropic.batch_before, fake_anthropic.batch_create_answer_lost = None, None
    deadline = time.monotonic() + 10
    while not fake_anthropic.batches and time.monotonic() < deadline:
        time.sleep(0.05)  # the create the client gave up on is still being made
    assert fake_anthropic.batch_creates == 1  # no retry of the create
    run.refresh_from_db()
    assert (run.status, run.batch_state) == (RunStatus.SUBMITTED, BatchState.SUBMITTING)

    batches_poll(now=start + timedelta(minutes=5))
    assert fake_anthropic.batch_creates == 1  # nor a second create by the next poll
    assert batches_poll(now=start + SUBMIT_GRACE + timedelta(minutes=1))["committed"] == 1
    run.refresh_from_db()
    (batch,) = fake_anthropic.batches.values()
    assert run.status == RunStatus.SUCCEEDED and run.batch_id == batch["id"]
    assert fake_anthropic.message_requests == [] and fake_anthropic.batch_creates == 1
    (row,) = CostEvent.objects.filter(run_id=run.id)
    assert row.delivery == "batch" and row.cost_usd == batch_bill(fake_anthropic)


@pytest.mark.django_db(transaction=True)
def test_a_poll_stopped_between_the_bill_and_the_answer_bills_it_once_and_the_next_poll_commits(
    company, fake_anthropic
):
    agent = batch_agent(company, session_mode="persistent")
    run = tick(agent)
    with writes_refused("heartbeat_runs", when="NEW.batch_state = 'answered'"):
        with pytest.raises(Exception, match="refused by a test trigger"):
            batches_poll(now=timezone.now())
    assert CostEvent.objects.filter(run_id=run.id).count() == 1  # billed when it was read
    assert HeartbeatRun.objects.get(id=run.id).batch_state == BatchState.IN_BATCH
    batches_poll(now=timezone.now())
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert CostEvent.objects.filter(run_id=run.id).count() == 1 and fake_anthropic.batch_creates == 1
    assert run.cost_usd == CostEvent.objects.get(run_id=run.id).cost_usd
    assert len(history(agent)) == 2


@pytest.mark.django_db(transaction=True)
def test_runs_submitted_by_a_worker_that_is_gone_are_committed_by_a_poll_in_another_process(
    company, fake_anthropic, settings
):
    agents = [batch_agent(company, f"agent {n}", session_mode="persistent") for n in range(3)]
    runs = [tick(agent) for agent in agents]
    assert {run.status for run in runs} == {RunStatus.SUBMITTED}
    # The process that parked them keeps nothing: a maintenance pass of another one commits them.
    done = subprocess.run(
        [sys.executable, "manage.py", "expire_sessions"],
        cwd=ROOT,
        env={**__import__("os").environ, **database_environment(settings)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for agent, run in zip(agents, runs, strict=True):
        run.refresh_from_db()
        assert run.status == RunStatus.SUCCEEDED
        assert len(history(agent)) == 2
    assert fake_anthropic.batch_creates == 1 and CostEvent.objects.count() == 3


@pytest.mark.django_db(transaction=True)
def test_budgets_reserve_a_batch_request_at_the_batch_price(company, fake_anthropic):
    from costs_app.models import Budget

    Budget.objects.create(company=company, monthly_limit_usd=Decimal("100"))
    batched, direct = batch_agent(company, "batched"), batch_agent(company, "direct", delivery="direct")
    parked = tick(batched)
    held = []
    from tests.conftest import on_own_connection
    from tests.fake_anthropic import Reply

    fake_anthropic.push(
        Reply.during(
            on_own_connection(
                lambda: held.append(HeartbeatRun.objects.get(agent=direct, status=RunStatus.RUNNING).reserved_usd)
            )
        )
    )
    tick(direct)
    parked.refresh_from_db()
    assert parked.reserved_usd > 0 and parked.reserved_usd * 2 == held[0]
    batches_poll(now=timezone.now())
    parked.refresh_from_db()
    assert parked.status == RunStatus.SUCCEEDED and parked.reserved_usd == 0


@pytest.mark.parametrize(
    ("adapter_type", "config"),
    [
        ("claude-code", {"runtime": "cli", "delivery": "batch"}),
        ("process", {"command": ["true"], "delivery": "batch"}),
    ],
)
def test_runtimes_without_a_batch_api_refuse_batch_delivery_naming_the_field(adapter_type, config):
    with pytest.raises(AgentConfigError) as refused:
        validate_agent_config(adapter_type, config)
    assert "adapter_config.delivery" in refused.value.fields


def test_delivery_settings_are_validated():
    for config, field in [
        ({"delivery": "later"}, "adapter_config.delivery"),
        ({"delivery": "batch", "batch_max_wait_minutes": 1441}, "adapter_config.batch_max_wait_minutes"),
        ({"batch_max_wait_minutes": 0}, "adapter_config.batch_max_wait_minutes"),
        ({"cache_keep_warm": "on"}, "adapter_config.cache_keep_warm"),
    ]:
        with pytest.raises(AgentConfigError) as refused:
            validate_agent_config("claude-code", {"model": "claude-opus-4-5", **config})
        assert field in refused.value.fields, config
    clean = validate_agent_config("claude-code", {**BATCH, "batch_max_wait_minutes": 1440, "cache_keep_warm": "off"})
    assert clean["delivery"] == "batch" and clean["batch_max_wait_minutes"] == 1440


def test_the_api_refuses_batch_delivery_for_claude_code_with_400_naming_the_field(client, company):
    answer = client.post(
        f"/api/companies/{company.id}/agents",
        {"name": "cli", "adapter_config": {"runtime": "cli", "delivery": "batch"}},
        content_type="application/json",
    )
    assert answer.status_code == 400
    assert "delivery" in answer.content.decode()


@pytest.mark.django_db(transaction=True)
def test_a_second_poll_while_the_first_creates_the_batch_sends_nothing_and_bills_nothing(company, fake_anthropic):
    from tests.conftest import on_own_connection

    agents = [batch_agent(company, f"agent {n}", session_mode="persistent") for n in range(3)]
    runs = [tick(agent) for agent in agents]
    second = []
    fake_anthropic.batch_before = on_own_connection(lambda: second.append(batches_poll(now=timezone.now())))
    first = batches_poll(now=timezone.now())
    fake_anthropic.batch_before = None
    # The second poll, on its own connection while the first's create was in flight, found
    # the runs taken (`submitting`): it sent no batch of its own.
    assert second == [{"submitted": 0, "read": 0, "committed": 0}]
    assert first == {"submitted": 3, "read": 3, "committed": 3}
    assert fake_anthropic.batch_creates == 1 and len(fake_anthropic.batch_answers) == 3
    assert CostEvent.objects.count() == 3
    assert all(HeartbeatRun.objects.get(id=run.id).status == RunStatus.SUCCEEDED for run in runs)


def test_runs_left_submitting_by_a_poll_that_died_go_direct_after_their_wait(company, fake_anthropic):
    agent = batch_agent(company, batch_max_wait_minutes=10)
    run = tick(agent)
    HeartbeatRun.objects.filter(id=run.id).update(batch_state=BatchState.SUBMITTING, batch_id="submitting-dead")
    batches_poll(now=timezone.now() + timedelta(minutes=20))  # a create may still be in flight
    assert HeartbeatRun.objects.get(id=run.id).batch_state == BatchState.SUBMITTING
    batches_poll(now=timezone.now() + timedelta(minutes=41))
    run.refresh_from_db()
    assert run.batch_state == BatchState.DIRECT and "stopped while creating" in run.warning
    assert run_dispatched(agent).status == RunStatus.SUCCEEDED
    assert fake_anthropic.batch_creates == 0 and len(fake_anthropic.message_requests) == 1


def test_under_a_cap_a_run_waiting_behind_a_submitted_one_does_not_hold_back_other_agents(
    company, fake_anthropic, settings
):
    settings.PAPERCLIP_MAX_CONCURRENT_RUNS = 1
    batched, other = batch_agent(company, "batched"), batch_agent(company, "other", delivery="direct")
    parked = tick(batched)
    waiting, _ = heartbeat_start(
        agent=batched, task="behind the batch", trigger=RunTrigger.API, now=timezone.now(), wait=False
    )
    assert heartbeat_execute(run_id=waiting.id).status == RunStatus.QUEUED
    # A submitted run takes no place under the cap, and the run queued behind it cannot
    # start: another agent's heartbeat is not kept waiting for it.
    run, _ = heartbeat_start(
        agent=other, task="now", trigger=RunTrigger.API, now=timezone.now(), wait=True, wait_seconds=2
    )
    assert run.status == RunStatus.SUCCEEDED
    batches_poll(now=timezone.now())
    assert HeartbeatRun.objects.get(id=parked.id).status == RunStatus.SUCCEEDED
    assert heartbeat_execute(run_id=waiting.id).status == RunStatus.SUCCEEDED


# API heartbeats asking for batch (`"delivery"` in the heartbeat body).


def api_agent(company, name="On call", adapter_type="claude-code", **config) -> Agent:
    """An agent whose own configuration does not batch: the caller's ask is enough."""
    return Agent.objects.create(
        company=company,
        name=name,
        system_prompt="You answer when asked.",
        adapter_type=adapter_type,
        adapter_config={"model": "claude-opus-4-5", **config} if adapter_type == "claude-code" else config,
    )


def api_beat(agent, **body):
    return Api().post(agent_url(agent, "/heartbeat"), {"task": "Summarise the week", **body})


def executed(answer) -> HeartbeatRun:
    """What the task cluster does with the run a 202 queued."""
    assert answer.status_code == 202, answer.json()
    return heartbeat_execute(run_id=answer.json()["id"])


def test_an_api_heartbeat_asking_for_batch_is_parked_sent_in_a_batch_at_half_price_and_committed_once(
    company, fake_anthropic
):
    agent = api_agent(company, session_mode="persistent")
    answer = api_beat(agent, delivery="batch")
    assert answer.json()["delivery"] == "batch" and answer.json()["status"] == "queued"
    run = executed(answer)
    assert (run.status, run.batch_state) == (RunStatus.SUBMITTED, BatchState.PARKED)
    shown = Api().get(agent_url(agent, f"/runs/{run.id}")).json()
    assert (shown["status"], shown["delivery"], shown["batch_state"]) == ("submitted", "batch", "parked")
    assert fake_anthropic.message_requests == []
    assert batches_poll(now=timezone.now()) == {"submitted": 1, "read": 1, "committed": 1}
    assert batches_poll(now=timezone.now()) == {"submitted": 0, "read": 0, "committed": 0}
    run.refresh_from_db()
    (batch,) = fake_anthropic.batches.values()
    assert run.status == RunStatus.SUCCEEDED and run.batch_id == batch["id"]
    assert fake_anthropic.batch_creates == 1 and fake_anthropic.message_requests == []
    (row,) = CostEvent.objects.filter(run=run.id)
    assert (row.delivery, row.call_number) == ("batch", 1)
    assert row.cost_usd == call_price(usage=row.raw_usage, model=row.model, at=row.created_at).cost_usd / 2
    assert row.cost_usd == batch_bill(fake_anthropic) and run.cost_usd == row.cost_usd
    turns = history(agent)
    assert [t["role"] for t in turns] == ["user", "assistant"] and turns[1]["content"][0]["text"] == run.output
    shown = Api().get(agent_url(agent, f"/runs/{run.id}")).json()
    assert (shown["status"], shown["delivery"], shown["batch_id"]) == ("succeeded", "batch", batch["id"])


def test_batch_with_wait_is_400_naming_the_field(company, fake_anthropic):
    agent = api_agent(company)
    error = assert_error(api_beat(agent, delivery="batch", wait=True), 400, "invalid")
    assert "delivery" in error["fields"]
    assert not HeartbeatRun.objects.exists()


@pytest.mark.parametrize("value", ["later", "BATCH", "", 1, True, None, ["batch"]])
def test_a_delivery_that_is_not_one_is_400_naming_the_field(company, value):
    error = assert_error(api_beat(api_agent(company), delivery=value), 400, "invalid")
    assert "delivery" in error["fields"]
    assert not HeartbeatRun.objects.exists()


@pytest.mark.parametrize(
    ("adapter_type", "config"),
    [("claude-code", {"runtime": "cli"}), ("process", {"command": ["true"]})],
)
def test_batch_asked_of_a_runtime_without_a_batch_api_is_400_naming_the_field(company, adapter_type, config):
    agent = api_agent(company, adapter_type=adapter_type, **config)
    error = assert_error(api_beat(agent, delivery="batch"), 400, "invalid")
    assert "delivery" in error["fields"] and "batch" in error["fields"]["delivery"]
    assert not HeartbeatRun.objects.exists()


@pytest.mark.parametrize("body", [{}, {"delivery": "direct"}])
def test_an_api_heartbeat_not_asking_for_batch_goes_direct_even_for_a_batch_agent(company, fake_anthropic, body):
    agent = batch_agent(company)
    waited = api_beat(agent, wait=True, **body)
    assert waited.status_code == 200
    assert (waited.json()["status"], waited.json()["delivery"], waited.json()["batch_state"]) == (
        "succeeded",
        "direct",
        None,
    )
    queued = executed(api_beat(agent, **body))
    assert queued.status == RunStatus.SUCCEEDED and queued.delivery == "direct" and queued.batch_state == ""
    assert len(fake_anthropic.message_requests) == 2 and fake_anthropic.batch_creates == 0
    assert list(CostEvent.objects.values_list("delivery", flat=True)) == ["direct", "direct"]


def test_scheduled_runs_of_a_batch_agent_record_batch_and_other_agents_ticks_direct(company, fake_anthropic):
    batched, direct = batch_agent(company, "batched"), batch_agent(company, "direct", delivery="direct")
    assert (tick(batched).delivery, tick(direct).delivery) == ("batch", "direct")
    assert Api().get(agent_url(batched, "/runs")).json()["runs"][0]["delivery"] == "batch"


def test_a_tick_merged_into_a_queued_direct_api_run_goes_direct_with_it(company, fake_anthropic):
    agent = batch_agent(company)
    queued = api_beat(agent).json()
    assert tasks.scheduled_heartbeat(str(agent.id)) == f"merged into run {queued['id']}"
    run = heartbeat_execute(run_id=queued["id"])
    assert run.status == RunStatus.SUCCEEDED and run.merged_ticks == 1 and run.batch_state == ""
    assert len(fake_anthropic.message_requests) == 1 and fake_anthropic.batch_creates == 0


def test_a_repeated_key_never_answers_a_direct_request_with_a_batch_run(company, fake_anthropic):
    agent = api_agent(company)
    batch_run = executed(api_beat(agent, delivery="batch", idempotency_key="week"))
    assert batch_run.status == RunStatus.SUBMITTED
    assert_error(api_beat(agent, idempotency_key="week"), 409, "idempotency_key_reused")
    assert api_beat(agent, delivery="batch", idempotency_key="week").json()["id"] == str(batch_run.id)
    # Asked for batch, a direct run is the answer: it is only sooner.
    other = api_agent(company, "other")
    direct_run = executed(api_beat(other, idempotency_key="today", task="today"))
    again = Api().post(
        agent_url(other, "/heartbeat"), {"task": "today", "delivery": "batch", "idempotency_key": "today"}
    )
    assert again.status_code == 200 and again.json()["id"] == str(direct_run.id)
    assert again.json()["delivery"] == "direct"
    assert HeartbeatRun.objects.count() == 2


def test_the_migration_marks_the_runs_that_asked_for_batch_before_the_column(company):
    from importlib import import_module

    from django.apps import apps

    migration = import_module("sessions_app.migrations.0026_run_delivery")
    batched, direct = batch_agent(company, "batched"), batch_agent(company, "direct", delivery="direct")

    def run(agent, status, **fields):
        return HeartbeatRun.objects.create(
            agent=agent, company=company, task="tick", trigger=RunTrigger.SCHEDULE, status=status, **fields
        )

    marked = [
        run(batched, RunStatus.QUEUED),
        run(batched, RunStatus.SUBMITTED, batch_state=BatchState.PARKED),
        run(batched, RunStatus.SUCCEEDED, batch_state=BatchState.ANSWERED),
    ]
    left = [run(batched, RunStatus.SUCCEEDED), run(direct, RunStatus.QUEUED)]
    left.append(HeartbeatRun.objects.create(agent=batched, company=company, task="asked", status=RunStatus.QUEUED))

    migration.batch_runs_mark(apps, None)

    assert [HeartbeatRun.objects.get(id=r.id).delivery for r in marked] == ["batch"] * 3
    assert [HeartbeatRun.objects.get(id=r.id).delivery for r in left] == ["direct"] * 3


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["delete", "expire"])
def test_a_session_ended_while_its_turn_is_in_a_batch_gets_no_answer_and_the_run_goes_direct(
    company, fake_anthropic, change
):
    from sessions_app.services import session_delete, session_expire
    from tests.conftest import on_own_connection

    agent = batch_agent(company, session_mode="persistent")
    first = tick(agent)
    batches_poll(now=timezone.now())
    session = AgentSession.objects.get(agent=agent)
    second = tick(agent)
    assert second.status == RunStatus.SUBMITTED and second.session_id == session.id

    def operator():
        if change == "delete":
            session_delete(session=session, now=timezone.now())
        else:
            assert session_expire(session=session, now=timezone.now())

    # The worst moment: the request holding the session's history is at the provider.
    fake_anthropic.batch_before = on_own_connection(operator)
    batches_poll(now=timezone.now())
    if HeartbeatRun.objects.get(id=second.id).status == RunStatus.QUEUED:
        run_dispatched(agent)  # sent direct, as the cluster runs it
    second.refresh_from_db()

    assert fake_anthropic.action_errors == []
    assert second.status == RunStatus.SUCCEEDED, (second.error_code, second.error)
    assert second.session_id not in (None, session.id)
    assert CostEvent.objects.filter(run_id=second.id).count() == 2  # the batch's answer stays billed
    kept = AgentSession.objects.filter(pk=session.pk).first()
    if kept is not None:
        assert [t["run_id"] for t in store_for(kept).read(kept)] == [str(first.id)] * 2
    fresh = AgentSession.objects.get(agent=agent, status="active")
    assert [t["run_id"] for t in store_for(fresh).read(fresh)] == [str(second.id)] * 2


# A poll killed between the provider's create and writing the batch id (`batches_recover`).

LOST = "NEW.batch_state = 'in_batch'"  # the write of the batch id, refused as a kill would stop it


def poll_killed_after_its_create(now) -> None:
    """The poll creates its batch at the provider, and is stopped before it writes the id."""
    with writes_refused("heartbeat_runs", when=LOST):
        with pytest.raises(Exception, match="refused by a test trigger"):
            batches_poll(now=now)


def another_clients_batch(fake, custom_id="theirs") -> str:
    """A batch the same workspace holds that this service did not create."""
    client = anthropic.Anthropic(base_url=fake.base_url, api_key="another-client")
    params = {"model": "claude-opus-4-5", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    return client.messages.batches.create(requests=[{"custom_id": custom_id, "params": params}]).id


def results_read(fake, batch_id) -> int:
    return sum(1 for r in fake.requests if r["path"] == f"/v1/messages/batches/{batch_id}/results")


@pytest.mark.django_db(transaction=True)
def test_a_poll_killed_after_its_batch_create_leaves_the_answer_found_billed_once_and_never_sent_direct(
    company, fake_anthropic
):
    agent = batch_agent(company, session_mode="persistent")
    run = tick(agent)
    start = timezone.now()
    poll_killed_after_its_create(start)
    (batch,) = fake_anthropic.batches.values()
    assert HeartbeatRun.objects.get(id=run.id).batch_state == BatchState.SUBMITTING
    # A create may still be in flight: nothing is looked for yet.
    assert batches_poll(now=start + timedelta(minutes=20)) == {"submitted": 0, "read": 0, "committed": 0}
    assert fake_anthropic.batch_lists == []
    assert batches_poll(now=start + SUBMIT_GRACE + timedelta(minutes=1))["committed"] == 1
    batches_poll(now=start + timedelta(hours=3))  # and long past its wait: nothing more
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED and run.batch_id == batch["id"]
    assert fake_anthropic.message_requests == [] and fake_anthropic.batch_creates == 1
    (row,) = CostEvent.objects.filter(run_id=run.id)
    assert row.delivery == "batch" and row.cost_usd == batch_bill(fake_anthropic) == run.cost_usd
    assert [t["content"][0]["text"] for t in history(agent)[1:]] == [run.output]


@pytest.mark.django_db(transaction=True)
def test_a_lost_run_whose_create_never_reached_the_provider_goes_direct_once(company, fake_anthropic):
    known_agent = batch_agent(company, "known")
    known = tick(known_agent)
    batches_poll(now=timezone.now())
    known.refresh_from_db()
    theirs = another_clients_batch(fake_anthropic)
    found_agent, never_agent = batch_agent(company, "found"), batch_agent(company, "never sent")
    found, never = tick(found_agent), tick(never_agent)
    start = timezone.now()
    # Killed twice: once after a create, once after taking its runs and before the create.
    HeartbeatRun.objects.filter(id=never.id).update(
        batch_state=BatchState.SUBMITTING, batch_id="submitting-dead", batch_submitted_at=start
    )
    poll_killed_after_its_create(start)
    assert fake_anthropic.batch_creates == 3  # the known, the other client's and the lost one

    batches_poll(now=start + SUBMIT_GRACE + timedelta(minutes=1))
    never.refresh_from_db()
    assert never.batch_state == BatchState.DIRECT and "no batch at the provider holds it" in never.warning
    assert run_dispatched(never_agent).status == RunStatus.SUCCEEDED
    batches_poll(now=start + timedelta(hours=3))

    assert HeartbeatRun.objects.get(id=found.id).status == RunStatus.SUCCEEDED
    assert HeartbeatRun.objects.get(id=never.id).status == RunStatus.SUCCEEDED
    assert len(fake_anthropic.message_requests) == 1  # the one never sent, once
    assert sorted(CostEvent.objects.values_list("run_id", "delivery")) == sorted(
        [(known.id, "batch"), (found.id, "batch"), (never.id, "direct")]
    )
    # The batch a run names is not read again; another client's is read to its first line.
    assert results_read(fake_anthropic, known.batch_id) == 1 and results_read(fake_anthropic, theirs) == 1
    assert not any(b["cancelled"] for b in fake_anthropic.batches.values())


@pytest.mark.django_db(transaction=True)
def test_two_polls_recovering_one_lost_batch_adopt_bill_and_commit_each_run_once(company, fake_anthropic):
    from tests.conftest import on_own_connection

    agents = [batch_agent(company, f"agent {n}", session_mode="persistent") for n in range(3)]
    runs = [tick(agent) for agent in agents]
    start = timezone.now()
    poll_killed_after_its_create(start)
    later = start + SUBMIT_GRACE + timedelta(minutes=1)
    second = []

    def second_poll():
        fake_anthropic.batch_results_before = None
        second.append(batches_poll(now=later))

    # The worst moment: the first poll has listed the batch, found no run naming it, and
    # asks for its results; the second, on its own connection, recovers it all.
    fake_anthropic.batch_results_before = on_own_connection(second_poll)
    first = batches_poll(now=later)

    assert second == [{"submitted": 0, "read": 3, "committed": 3}]
    assert first == {"submitted": 0, "read": 0, "committed": 0}
    assert all(HeartbeatRun.objects.get(id=run.id).status == RunStatus.SUCCEEDED for run in runs)
    assert CostEvent.objects.count() == 3 and set(CostEvent.objects.values_list("delivery", flat=True)) == {"batch"}
    assert fake_anthropic.message_requests == [] and len(fake_anthropic.batch_answers) == 3
    assert all(len(history(agent)) == 2 for agent in agents)


@pytest.mark.django_db(transaction=True)
def test_a_lost_batch_still_processing_past_the_wait_is_waited_for_never_cancelled_and_never_answered_twice(
    company, fake_anthropic
):
    fake_anthropic.batch_seconds = 3 * 3600
    clock = [0.0]
    fake_anthropic.clock = lambda: clock[0]
    agent = batch_agent(company, batch_max_wait_minutes=30)
    run = tick(agent)
    start = timezone.now()
    poll_killed_after_its_create(start)
    (batch,) = fake_anthropic.batches.values()
    # Past its wait and the grace: its results cannot be read yet, and the batch cannot be
    # told from another client's, so the run waits for it.
    for minutes in (31, 61, 120):
        assert batches_poll(now=start + timedelta(minutes=minutes)) == {"submitted": 0, "read": 0, "committed": 0}
        assert HeartbeatRun.objects.get(id=run.id).batch_state == BatchState.SUBMITTING
    assert not batch["cancelled"] and fake_anthropic.message_requests == []
    clock[0] += 3 * 3600
    assert batches_poll(now=start + timedelta(hours=3))["committed"] == 1
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED and run.batch_id == batch["id"]
    assert fake_anthropic.message_requests == [] and not batch["cancelled"]
    assert list(CostEvent.objects.values_list("delivery", flat=True)) == ["batch"]


@pytest.mark.django_db(transaction=True)
def test_the_search_for_a_lost_batch_reads_a_bounded_number_of_pages_and_stops_at_its_submit_time(
    company, fake_anthropic, monkeypatch, caplog
):
    from sessions_app import batches
    from sessions_app.adapters import claude_code

    monkeypatch.setattr(claude_code, "BATCH_LIST_PAGE", 2)
    monkeypatch.setattr(batches, "MAX_LIST_PAGES", 1)
    agent = batch_agent(company)
    run = tick(agent)
    older = [another_clients_batch(fake_anthropic, f"old-{n}") for n in range(4)]
    for batch_id in older:
        fake_anthropic.batches[batch_id]["created_at"] = "2020-01-01T00:00:00Z"
    start = timezone.now()
    poll_killed_after_its_create(start)
    for n in range(3):
        another_clients_batch(fake_anthropic, f"new-{n}")
    later = start + SUBMIT_GRACE + timedelta(minutes=1)

    batches_poll(now=later)  # one page of two: the lost batch is on the second
    assert HeartbeatRun.objects.get(id=run.id).batch_state == BatchState.SUBMITTING
    assert "pages of batches were read" in caplog.text and fake_anthropic.message_requests == []
    assert len(fake_anthropic.batch_lists) == 1

    monkeypatch.setattr(batches, "MAX_LIST_PAGES", 10)
    batches_poll(now=later)
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED and fake_anthropic.message_requests == []
    # Pages of two: the three newer and the lost one, then the first older than its submit time.
    assert [q.get("after_id") for q in fake_anthropic.batch_lists[1:]] == [None, [ANY], [ANY]]
    assert not any(results_read(fake_anthropic, batch_id) for batch_id in older)


# An operator moves a batch agent to a runtime without a batch API while a run is batched.


@pytest.mark.parametrize("where", ["parked", "in a batch", "answered"])
def test_an_agent_moved_off_the_messages_api_while_its_run_is_batched_bills_what_was_answered_and_runs_direct(
    company, fake_anthropic, tmp_path, where
):
    agent = batch_agent(company, session_mode="persistent")
    run = tick(agent)
    fake_anthropic.batch_seconds = 0 if where == "answered" else 3600
    if where != "parked":
        batches_submit(now=timezone.now())
        batches_read(now=timezone.now())  # a poll that stops here leaves an answer uncommitted
    assert (
        HeartbeatRun.objects.get(id=run.id).batch_state
        == {
            "parked": BatchState.PARKED,
            "in a batch": BatchState.IN_BATCH,
            "answered": BatchState.ANSWERED,
        }[where]
    )
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, sys\nsys.stdin.read()\n"
        "print(json.dumps({'text': 'done here', 'usage': {'input_tokens': 3, 'output_tokens': 1}}))\n"
    )
    moved = Api().patch(
        agent_url(agent),
        {
            "adapter_type": "process",
            "adapter_config": {"command": [sys.executable, str(script)], "session_mode": "persistent"},
        },
    )
    assert moved.status_code == 200, moved.json()

    fake_anthropic.batch_seconds = 0
    start = timezone.now()
    batches_poll(now=start)  # the batch ends: read with the API that took it, and billed
    batches_poll(now=start)  # hands what goes direct to the cluster
    run.refresh_from_db()
    if not run.is_finished:
        run = run_dispatched(agent)  # as the cluster runs what the poll handed it

    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    assert run.output == "done here"
    assert "moved to a runtime without a batch API" in run.warning
    rows = CostEvent.objects.filter(run_id=run.id).order_by("call_number")
    if where == "parked":
        assert fake_anthropic.batch_creates == 0 and [r.delivery for r in rows] == ["direct"]
    else:
        # What the provider answered in the batch stays billed, once, at the batch price.
        assert fake_anthropic.batch_creates == 1 and [r.delivery for r in rows] == ["batch", "direct"]
        assert rows[0].cost_usd == batch_bill(fake_anthropic)
    assert fake_anthropic.message_requests == []
    assert batches_poll(now=timezone.now() + timedelta(hours=3)) == {"submitted": 0, "read": 0, "committed": 0}
