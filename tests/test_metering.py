"""Session hours: every path that ends a session bills its active time exactly once."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from sessions_app.maintenance import maintenance_pass, sessions_pause_idle
from sessions_app.models import Agent, AgentSession, SessionStatus
from sessions_app.services import agent_delete, session_delete, session_expire
from tests.conftest import beat

HALF_HOUR = 1800


def session_hours(session_id) -> list:
    return list(CostEvent.objects.filter(kind=CostKind.SESSION_HOURS, session_id=session_id))


def end_by_operator(agent, session, now):
    session_expire(session=session, now=now)
    session_expire(session=session, now=now)


def end_by_maintenance(agent, session, now):
    maintenance_pass(now=now + timedelta(hours=25))


def end_by_deletion(agent, session, now):
    session_delete(session=session, now=now)


def end_by_agent_deletion(agent, session, now):
    agent_delete(agent=agent, now=now)


def end_by_force_fresh(agent, session, now):
    beat(agent, "fresh", now=now, force_fresh=True)


def end_by_rotation(agent, session, now):
    agent.adapter_config = {**agent.adapter_config, "rotate_after_turns": 1}
    agent.save()
    beat(agent, "rotate", now=now)


def end_by_ttl_at_heartbeat(agent, session, now):
    beat(agent, "later", now=now + timedelta(hours=25))


@pytest.mark.parametrize(
    "end",
    [
        end_by_operator,
        end_by_maintenance,
        end_by_deletion,
        end_by_agent_deletion,
        end_by_force_fresh,
        end_by_rotation,
        end_by_ttl_at_heartbeat,
    ],
)
def test_every_path_that_ends_a_session_bills_its_hours_exactly_once(settings, persistent_agent, fake_anthropic, end):
    settings.PAPERCLIP_SESSION_HOUR_USD = Decimal("0.08")
    now = timezone.now()
    first = beat(persistent_agent, "one", now=now)
    AgentSession.objects.filter(id=first.session_id).update(unbilled_active_seconds=HALF_HOUR)
    session = AgentSession.objects.get(id=first.session_id)

    end(persistent_agent, session, now)
    maintenance_pass(now=now + timedelta(hours=26))
    maintenance_pass(now=now + timedelta(hours=27))

    [event] = session_hours(first.session_id)
    assert (event.session_seconds, event.cost_usd) == (HALF_HOUR, Decimal("0.04"))
    ended = AgentSession.objects.filter(id=first.session_id).first()
    if end in (end_by_deletion, end_by_agent_deletion):
        assert ended is None  # deleted with its history; its bill stays in the ledger
    else:
        assert ended is not None, "the session row was lost"
        assert (ended.status in (SessionStatus.EXPIRED, SessionStatus.ENDED), ended.unbilled_active_seconds) == (
            True,
            0,
        ), (ended.status, ended.unbilled_active_seconds)


def test_a_later_pass_bills_a_session_ended_without_its_bill(settings, persistent_agent, fake_anthropic):
    """Sessions an earlier version ended without billing (the operator's "expire now")."""
    settings.PAPERCLIP_SESSION_HOUR_USD = Decimal("0.08")
    now = timezone.now()
    first = beat(persistent_agent, "one", now=now)
    AgentSession.objects.filter(id=first.session_id).update(
        unbilled_active_seconds=HALF_HOUR, status=SessionStatus.EXPIRED, ended_at=now
    )

    assert maintenance_pass(now=now)["billed"] == 1
    assert maintenance_pass(now=now)["billed"] == 0
    assert len(session_hours(first.session_id)) == 1


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
