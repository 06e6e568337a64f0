"""Data for the admin tests: sessions with history (in files and in the database), runs,
the ledger, keys, and django-q2's own rows, so that every admin page has something to show."""

from __future__ import annotations

import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from costs_app.models import AlertAttempt, AlertDelivery, AlertTarget, Budget, BudgetAlert, CostEvent, ModelPrice
from sessions_app.models import (
    AgentSession,
    ApiKey,
    HeartbeatRun,
    HistoryStore,
    ManagedOutput,
    ManagedSessionEnd,
    RunStatus,
    SessionStatus,
)
from sessions_app.stores import store_for
from tests.conftest import catalogue_stored


def conversation(turns: int, *, run_id: str = "", text: str = "turn") -> list[dict]:
    now = timezone.now()
    messages = []
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        message = {"role": role, "at": (now - timedelta(minutes=turns - i)).isoformat(), "run_id": run_id}
        if role == "user":
            message["content"] = f"{text} {i}: what next?"
        else:
            message["content"] = [{"type": "text", "text": f"{text} {i}: the answer."}]
            message["usage"] = {"input_tokens": 100 * (i + 1), "output_tokens": 20}
        messages.append(message)
    return messages


def make_session(agent, *, history: list[dict], store: str = HistoryStore.FILE, **fields) -> AgentSession:
    """A session whose history is really written where its store keeps it."""
    now = timezone.now()
    fields.setdefault("status", SessionStatus.ENDED)
    fields.setdefault("expires_at", now + timedelta(hours=3))
    session = AgentSession.objects.create(
        agent=agent,
        company=agent.company,
        store=store,
        last_used=fields.pop("last_used", now),
        adapter_type=agent.adapter_type,
        model=agent.model_name,
        **fields,
    )
    staged = store_for(session).stage(session, history)
    session.message_count = len(history)
    session.save(update_fields=["message_count", *staged.fields])
    staged.publish()
    return session


def make_run(agent, *, session=None, **fields) -> HeartbeatRun:
    now = timezone.now()
    defaults = {
        "status": RunStatus.SUCCEEDED,
        "task": "Summarise the inbox.",
        "output": "Done.",
        "input_tokens": 1200,
        "output_tokens": 80,
        "cost_usd": Decimal("0.008"),
        "started_at": now,
        "finished_at": now,
    }
    defaults.update(fields)
    return HeartbeatRun.objects.create(company=agent.company, agent=agent, session=session, **defaults)


def make_cost(agent, *, session=None, run=None, **fields) -> CostEvent:
    defaults = {"model": agent.model_name, "input_tokens": 1000, "output_tokens": 100, "cost_usd": Decimal("0.0075")}
    defaults.update(fields)
    return CostEvent.objects.create(company=agent.company, agent=agent, session=session, run=run, **defaults)


@pytest.fixture
def file_session(persistent_agent):
    return make_session(persistent_agent, history=conversation(4), store=HistoryStore.FILE)


def memory_write_demo(agent, reader, *, run) -> None:
    """A memory store with a file written by a run, and a read-only share of it."""
    from memory_app.models import MemoryStoreShare
    from memory_app.stores import Writer, mounts_for
    from memory_app.tool import StoreMemoryTool

    agent.adapter_config = {**agent.adapter_config, "memory": True}
    agent.save()
    # Written while the run ran: a run writes memory only then.
    HeartbeatRun.objects.filter(id=run.id).update(status=RunStatus.RUNNING)
    StoreMemoryTool(mounts_for(agent), writer=Writer(run_id=run.id)).call(
        {"command": "create", "path": "/memories/notes.md", "file_text": "The launch is on Friday."}
    )
    HeartbeatRun.objects.filter(id=run.id).update(status=run.status)
    MemoryStoreShare.objects.create(store=mounts_for(agent)[0].store, agent=reader, access="read")


def budget_alert_delivered(budget: Budget) -> AlertDelivery:
    """A webhook target of `budget`, a soft alert and its delivery after one failed attempt."""
    now = timezone.now()
    target = AlertTarget.objects.create(budget=budget, url="https://alerts.example/hook", secret="s" * 32)
    alert = BudgetAlert.objects.create(
        budget=budget,
        period="month",
        period_key=f"{now:%Y-%m}",
        threshold="soft",
        percent=80,
        limit=Decimal("100"),
        spent=Decimal("81"),
    )
    delivery = AlertDelivery.objects.create(
        alert=alert, target=target, attempts=1, last_status_code=500, last_error="HTTP 500"
    )
    AlertAttempt.objects.create(delivery=delivery, number=1, at=now, status_code=500, error="HTTP 500", duration_ms=12)
    return delivery


def hold_and_event(budget, *, now) -> None:
    """A credential held by a quota, and its event delivered to a target that asked."""
    from costs_app.models import AlertDelivery, AlertEvent, AlertTarget
    from sessions_app.models import CredentialHold

    hold = CredentialHold.objects.create(
        credential="sha256:0123456789abcdef", held_until=now, held_at=now, code="rate_limited", reason="429", refusals=1
    )
    target = AlertTarget.objects.create(
        budget=budget, url="https://ops.example/hook", secret="s" * 16, quota_events=True
    )
    event = AlertEvent.objects.create(kind="quota_held", key=f"quota_held:{hold.credential}", payload={"code": "429"})
    AlertDelivery.objects.create(event=event, target=target, created_at=now, status="delivered")


@pytest.fixture
def full_house(db, company, persistent_agent, stateless_agent, other_agent):
    """One of everything every admin page lists."""
    from django.contrib.auth.models import Group
    from django_q.models import Failure, OrmQ, Schedule, Success
    from django_q.signing import SignedPackage

    session = make_session(
        persistent_agent,
        history=conversation(4),
        status=SessionStatus.ACTIVE,
        managed_session_id="sesn_011CZkZZLKTAm2ydZ7zxGvFx",
    )
    db_session = make_session(other_agent, history=conversation(2), store=HistoryStore.DATABASE)
    run = make_run(persistent_agent, session=session)
    make_run(stateless_agent, status=RunStatus.FAILED, error_code="model_timeout", error="Timed out.")
    make_cost(persistent_agent, session=session, run=run)
    make_cost(other_agent, session=db_session, model="claude-unknown-9", unpriced=True, cost_usd=Decimal(0))
    key = ApiKey.objects.create(company=company, name="ci", prefix="pc_abcde", key_hash="0" * 64)
    budget = Budget.objects.create(company=company, monthly_limit_usd=Decimal("100"))
    budget_alert_delivered(budget)
    Budget.objects.create(company=company, agent=persistent_agent, daily_limit_usd=Decimal("5"), daily_run_limit=50)
    Group.objects.create(name="operators")
    Schedule.objects.create(name="heartbeat:demo", func="sessions_app.tasks.scheduled_heartbeat", minutes=5)
    now = timezone.now()
    task = {"id": uuid.uuid4().hex, "name": "demo-task", "func": "math.floor", "args": (1.5,), "kwargs": {}}
    Success.objects.create(
        id=uuid.uuid4().hex, name="ok-task", func="math.floor", started=now, stopped=now, success=True, result=1
    )
    Failure.objects.create(
        id=uuid.uuid4().hex, name="bad-task", func="math.floor", started=now, stopped=now, success=False, result="boom"
    )
    OrmQ.objects.create(key="paperclip", payload=SignedPackage.dumps(task), lock=now)
    memory_write_demo(persistent_agent, stateless_agent, run=run)
    catalogue_stored()
    ModelPrice.from_list_price("claude-opus-5-5", now.date(), Decimal("3"), Decimal("15")).save()
    hold_and_event(budget, now=now)
    ManagedSessionEnd.objects.create(
        remote_session_id="sesn_011CZkZZLKTAm2ydZ7zxGvFx",
        action="delete",
        company=company,
        attempts=7,
        last_error="Could not reach the Managed Agents API: the connection was refused by api.anthropic.com. " * 3,
    )
    ManagedOutput.objects.create(
        company=company,
        agent=persistent_agent,
        session_id=session.pk,
        remote_session_id="sesn_011CZkZZLKTAm2ydZ7zxGvFx",
        file_id="file_011CNha8iCJcU1wXNR6q4V8w",
        filename="quarterly-planning-report-for-the-northern-european-sales-regions-final-v2.xlsx",
        size_bytes=123_456_789,
        skipped="larger than PAPERCLIP_MANAGED_OUTPUT_MAX_BYTES (123456789 > 26214400 bytes)",
    )
    return {"session": session, "db_session": db_session, "run": run, "key": key}
