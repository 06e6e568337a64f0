"""Session hours: every path that ends a session bills its active time exactly once."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from sessions_app.maintenance import maintenance_pass, sessions_pause_idle
from sessions_app.models import Agent, AgentSession, HeartbeatRun, RunStatus, SessionStatus
from sessions_app.services import agent_delete, session_delete, session_expire
from tests.conftest import Actor, WriteGate, beat, on_own_connection, process_agent, wait_until_blocked
from tests.fake_anthropic import Reply

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


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("second_end", ["deletion", "maintenance"])
def test_a_second_ender_arriving_while_the_first_bill_is_uncommitted_bills_nothing_more(
    settings, persistent_agent, fake_anthropic, second_end
):
    """The worst moment for "each active second is billed exactly once": the operator's
    "expire now" has written the session's hours to the ledger, not yet committed (held at
    a gate inside that insert), when a deletion of the session, or a maintenance pass, ends
    and bills it too. The second waits for the first (the row's lock; SQLite: IMMEDIATE
    transactions), then finds nothing unbilled: one row, the half hour once."""
    settings.PAPERCLIP_SESSION_HOUR_USD = Decimal("0.08")
    now = timezone.now()
    first = beat(persistent_agent, "one", now=now)
    AgentSession.objects.filter(id=first.session_id).update(unbilled_active_seconds=HALF_HOUR)
    session = AgentSession.objects.get(id=first.session_id)

    def second_ender():
        if second_end == "deletion":
            return session_delete(session=AgentSession.objects.get(pk=session.pk), now=now)
        return maintenance_pass(now=now + timedelta(hours=26))

    with WriteGate("cost_events", event="INSERT", when="NEW.kind = 'session_hours'") as gate:
        operator = Actor(lambda: session_expire(session=session, now=now))
        operator.start()
        gate.wait_entered()
        second = Actor(second_ender)
        second.start()
        wait_until_blocked(second)
        gate.open()
        assert operator.result() is True
        second.result()

    [event] = session_hours(first.session_id)
    assert (event.session_seconds, event.cost_usd) == (HALF_HOUR, Decimal("0.04"))
    ended = AgentSession.objects.filter(id=first.session_id).first()
    if second_end == "deletion":
        assert ended is None
    else:
        assert (ended.status, ended.unbilled_active_seconds) == (SessionStatus.EXPIRED, 0)


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


SLOW_AGENT = (
    "import json, sys, time\n"
    "request = json.load(sys.stdin)\n"
    "time.sleep(0.5)\n"
    "if 'fail' in json.dumps(request['messages'][-1]):\n"
    "    sys.exit('failed on purpose')\n"
    "print(json.dumps({'text': 'done', 'usage': {'input_tokens': 1, 'output_tokens': 1}}))\n"
)


def test_a_failed_runs_time_is_active_time_billed_like_any_other(settings, company, tmp_path):
    """Three runs of 0.5 s on one session, two of them failed: 1.5 s are billed, not 0.5."""
    settings.PAPERCLIP_SESSION_HOUR_USD = Decimal("0.08")
    agent = process_agent(company, tmp_path, SLOW_AGENT)
    start = timezone.now()
    runs = [beat(agent, task, now=start + timedelta(minutes=i)) for i, task in enumerate(["one", "fail", "fail"])]

    assert [run.status for run in runs] == [RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.FAILED]
    assert {run.session_id for run in runs} == {runs[0].session_id}
    in_progress = sum((run.finished_at - run.started_at).total_seconds() for run in runs)
    assert in_progress >= 1.5
    session = AgentSession.objects.get(id=runs[0].session_id)
    assert session.active_seconds == pytest.approx(in_progress)
    session_expire(session=session, now=start + timedelta(minutes=5))
    [event] = session_hours(session.id)
    assert event.session_seconds == round(in_progress)
    assert event.cost_usd == (Decimal(str(session.active_seconds)) / 3600 * Decimal("0.08")).quantize(
        Decimal("0.0000000001")
    )


@pytest.mark.django_db(transaction=True)
def test_a_run_the_reaper_fails_while_its_worker_still_answers_is_counted_once(settings, company, fake_anthropic):
    """The reaper fails the run from inside the model's answer (its own connection); the
    worker's commit then finds the run failed and fails too: the run's time is added to
    the session once, from its start to the reaper's end of it."""
    agent = Agent.objects.create(
        company=company, name="slow", adapter_config={"session_mode": "persistent", "session_ttl_hours": 0.05}
    )
    start = timezone.now()
    first = beat(agent, "one", now=start)
    before = AgentSession.objects.get(id=first.session_id).active_seconds
    reaped = []

    def reap():
        run = HeartbeatRun.objects.get(agent=agent, status=RunStatus.RUNNING)
        reaped.append(run.deadline_at + timedelta(seconds=1))
        maintenance_pass(now=reaped[0])

    fake_anthropic.push(Reply(before=on_own_connection(reap)))
    during = start + timedelta(minutes=1)

    second = beat(agent, "two", now=during)

    assert fake_anthropic.action_errors == []
    assert (second.status, second.error_code, second.finished_at) == (RunStatus.FAILED, "run_timeout", reaped[0])
    session = AgentSession.objects.get(id=first.session_id)
    assert session.active_seconds == pytest.approx(before + (reaped[0] - during).total_seconds())
    assert session.expires_at == reaped[0] + timedelta(hours=0.05)
