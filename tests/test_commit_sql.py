"""The commit's statements compiled once per shape (`sessions_app.commit_sql`): for every
shape a heartbeat gives them, and for other values of the same shape, the compiled
statement is the one the ORM writes from the same values; and it writes what it says."""

from __future__ import annotations

import uuid
from datetime import timedelta
from decimal import Decimal
from types import SimpleNamespace

import pytest
from django.utils import timezone

from sessions_app.commit_sql import (
    STATELESS_OUTCOME,
    TURN_AND_OUTCOME,
    outcome_values,
    run_outcome_update,
    session_turn_update,
    stateless_outcome_update,
    turn_values,
)
from sessions_app.hot_sql import _comparable, _update_sql, turn_and_outcome_run, turn_and_outcome_statement
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus
from sessions_app.stores import InRow, StagedHistory
from tests.conftest import beat


class VersionNamed(StagedHistory):
    """What the file store stages: the row names the history's new version."""

    fields = ("history_version",)


def as_compared(statement: tuple[str, list]) -> tuple[str, list]:
    sql, params = statement
    return sql, [_comparable(param) for param in params]


def turn_of(session: AgentSession, *, staged: StagedHistory, replayed: bool, input_tokens: int | None, at) -> dict:
    assigned, added = session.turn_changes(
        message_count=session.message_count + 2,
        manifest=[{"name": f"report-{at.microsecond}.md"}] if replayed else [],
        started=at - timedelta(seconds=3),
        finished=at,
        ttl=timedelta(hours=24),
        idle_pause=timedelta(minutes=10),
        input_tokens=input_tokens,
        output_tokens=7 if input_tokens is not None else None,
        replayed=replayed,
    )
    return turn_values(
        agent_id=session.agent_id,
        session=session,
        message_count_was=session.message_count,
        staged=staged,
        assigned=assigned,
        added=added,
    )


def outcome_of(session: AgentSession | None, *, cost: Decimal | None, report: dict | None, at) -> dict:
    return {
        "status": RunStatus.SUCCEEDED,
        "nothing_to_do": cost is None,
        "session": session,
        "output": f"answer at {at}",
        "model": "claude-haiku-4-5",
        "message_id": f"msg_{at.microsecond}",
        "stop_reason": "end_turn",
        "input_tokens": 12 if cost is not None else None,
        "output_tokens": 7 if cost is not None else None,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "cost_usd": cost,
        "finished_at": at,
        "reserved_usd": Decimal(0),
        "runtime_report": report,
    }


SHAPES = [
    # staged, replayed, input tokens, cost, runtime report
    ("appended", True, 12, Decimal("0.0000123456"), None),
    ("appended", False, None, None, None),
    ("version", True, 12, Decimal("0.5"), {"ledger_cost_usd": "0.5"}),
    ("version", True, None, Decimal(0), None),
]


@pytest.mark.parametrize(("staged_as", "replayed", "input_tokens", "cost", "report"), SHAPES)
def test_the_compiled_turn_and_outcome_is_the_statement_the_orm_writes_for_each_shape_and_any_values(
    persistent_agent, staged_as, replayed, input_tokens, cost, report
):
    session = AgentSession.objects.create(agent=persistent_agent, company=persistent_agent.company)
    at = timezone.now()
    # The second values of each shape run through the statement compiled for the first.
    for message_count, later in [(4, timedelta(0)), (400, timedelta(days=300, microseconds=17))]:
        session.message_count, session.next_seq = message_count, message_count + 1
        session.history_version = uuid.uuid4().hex
        staged = InRow(appended=[{"role": "user", "content": f"turn {message_count}"}])
        staged = staged if staged_as == "appended" else VersionNamed()
        values = {
            **turn_of(session, staged=staged, replayed=replayed, input_tokens=input_tokens, at=at + later),
            **outcome_values(run_id=uuid.uuid4(), outcome=outcome_of(session, cost=cost, report=report, at=at + later)),
        }
        namespace = SimpleNamespace(**values)
        the_orms = turn_and_outcome_statement(session_turn_update(namespace), run_outcome_update(namespace))
        assert as_compared(TURN_AND_OUTCOME.statement(**values)) == as_compared(the_orms)


@pytest.mark.parametrize(("cost", "report"), [(Decimal("0.25"), None), (None, {"ledger_cost_usd": None})])
def test_the_compiled_stateless_outcome_is_the_update_the_orm_writes_for_each_shape_and_any_values(
    stateless_agent, cost, report
):
    at = timezone.now()
    for later in (timedelta(0), timedelta(days=300, microseconds=17)):
        outcome = outcome_of(None, cost=cost, report=report, at=at + later)
        values = {"agent_id": stateless_agent.pk, **outcome_values(run_id=uuid.uuid4(), outcome=outcome)}
        the_orms = _update_sql(*stateless_outcome_update(SimpleNamespace(**values)))
        assert as_compared(STATELESS_OUTCOME.statement(**values)) == as_compared(the_orms)


@pytest.mark.django_db(transaction=True)
def test_the_compiled_turn_writes_the_turn_and_the_outcome_it_was_given(
    postgres_only, persistent_agent, fake_anthropic
):
    first = beat(persistent_agent, "first")
    session = AgentSession.objects.get(pk=first.session_id)
    run = HeartbeatRun.objects.create(
        agent=persistent_agent, company=persistent_agent.company, status=RunStatus.RUNNING, task="second"
    )
    at = timezone.now()
    new = [{"role": "user", "content": "second"}, {"role": "assistant", "content": "done"}]
    values = {
        **turn_of(session, staged=InRow(appended=new), replayed=True, input_tokens=12, at=at),
        **outcome_values(run_id=run.id, outcome=outcome_of(session, cost=Decimal("0.0000123456"), report=None, at=at)),
    }

    written, _, history_rev = turn_and_outcome_run(TURN_AND_OUTCOME.statement(**values))

    assert written is True
    after = AgentSession.objects.get(pk=session.pk)
    assert after.history == session.history + new
    # Appending moved the history's revision (the database's trigger), and the statement says to what.
    assert after.history_rev == session.history_rev + 1 == history_rev
    assert (after.message_count, after.next_seq, after.turn_count) == (
        session.message_count + 2,
        session.next_seq + 2,
        session.turn_count + 1,
    )
    assert after.total_input_tokens == session.total_input_tokens + 12
    run.refresh_from_db()
    assert (run.status, run.session_id, run.cost_usd) == (RunStatus.SUCCEEDED, session.pk, Decimal("0.0000123456"))
    # The same values again: the session no longer holds what they were read from.
    assert turn_and_outcome_run(TURN_AND_OUTCOME.statement(**values)) == (False, None, None)
