from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from costs_app.models import CostEvent
from sessions_app.adapters import AgentConfigError, validate_agent_config
from sessions_app.models import (
    Agent,
    AgentSession,
    AgentStatus,
    HeartbeatRun,
    HistoryStore,
    PausedReason,
    parse_session_id,
)
from sessions_app.services import agent_delete, agents_hard_delete
from sessions_app.stores import store_for


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"session_mode": "forever"}, "adapter_config.session_mode"),
        ({"session_ttl_hours": 0}, "adapter_config.session_ttl_hours"),
        ({"session_ttl_hours": -3}, "adapter_config.session_ttl_hours"),
        ({"session_ttl_hours": "24"}, "adapter_config.session_ttl_hours"),
        ({"session_ttl_hours": True}, "adapter_config.session_ttl_hours"),
        ({"max_tokens": 0}, "adapter_config.max_tokens"),
        ({"sesion_mode": "persistent"}, "adapter_config.sesion_mode"),
    ],
)
def test_invalid_adapter_config_is_refused_naming_the_field(company, config, field):
    with pytest.raises(AgentConfigError) as caught:
        Agent.objects.create(company=company, name="bad", adapter_type="claude-code", adapter_config=config)
    assert field in caught.value.fields
    assert not Agent.objects.filter(name="bad").exists()


def test_unknown_adapter_type_is_refused(company):
    with pytest.raises(ValidationError) as caught:
        Agent.objects.create(company=company, name="bad", adapter_type="gpt-shell", adapter_config={})
    assert "adapter_type" in caught.value.fields


def test_process_adapter_needs_a_command():
    with pytest.raises(AgentConfigError) as caught:
        validate_agent_config("process", {"command": []})
    assert "adapter_config.command" in caught.value.fields
    assert validate_agent_config("process", {"command": ["python", "agent.py"]})["command"] == ["python", "agent.py"]


def test_valid_config_gets_defaults(company):
    agent = Agent.objects.create(
        company=company, name="ok", adapter_type="claude-code", adapter_config={"session_mode": "persistent"}
    )
    assert agent.adapter_config["session_ttl_hours"] == 24
    assert agent.is_persistent
    assert agent.session_ttl == timedelta(hours=24)


def test_session_ids_parse_in_both_forms():
    session = AgentSession()
    assert parse_session_id(session.public_id) == session.id
    assert parse_session_id(str(session.id)) == session.id
    assert parse_session_id("sess_nothex") is None
    assert parse_session_id("42") is None


def _session_with_file(agent, messages):
    session = AgentSession.objects.create(agent=agent, company=agent.company, store=HistoryStore.FILE)
    store = store_for(session)
    staged = store.stage(session, messages)
    session.message_count = len(messages)
    session.save(update_fields=["message_count", *staged.fields])
    staged.publish()
    return session, store.path_for(session)


def test_deleting_an_agent_retires_it_and_removes_its_sessions_but_keeps_the_ledger(
    persistent_agent, django_capture_on_commit_callbacks
):
    now = timezone.now()
    session, path = _session_with_file(persistent_agent, [{"role": "user", "content": "hi"}])
    run = HeartbeatRun.objects.create(
        company=persistent_agent.company, agent=persistent_agent, task="t", session=session
    )
    CostEvent.objects.create(
        company=persistent_agent.company, agent=persistent_agent, session=session, run=run, model="claude-opus-4-5"
    )
    assert path.exists()

    with django_capture_on_commit_callbacks(execute=True):
        agent_delete(agent=persistent_agent, now=now)

    persistent_agent.refresh_from_db()
    assert persistent_agent.status == AgentStatus.DELETED
    assert not AgentSession.objects.filter(agent=persistent_agent).exists()
    assert not path.exists()
    run.refresh_from_db()
    assert run.session_id is None
    assert CostEvent.objects.filter(agent_id=persistent_agent.id).count() == 1


def test_hard_deleting_agents_removes_history_files_and_keeps_cost_events(
    persistent_agent, django_capture_on_commit_callbacks
):
    session, path = _session_with_file(persistent_agent, [{"role": "user", "content": "hi"}])
    CostEvent.objects.create(company=persistent_agent.company, agent=persistent_agent, session=session, model="m")

    with django_capture_on_commit_callbacks(execute=True):
        agents_hard_delete(agents=Agent.objects.filter(pk=persistent_agent.pk), now=timezone.now())

    assert not Agent.objects.filter(pk=persistent_agent.pk).exists()
    assert not path.exists()
    assert CostEvent.objects.filter(agent_id=persistent_agent.id).count() == 1


@pytest.mark.parametrize(
    ("status", "reason", "code"),
    [
        (AgentStatus.ACTIVE, "", None),
        (AgentStatus.PAUSED, PausedReason.BUDGET, "budget_exceeded"),
        (AgentStatus.PAUSED, PausedReason.API, "agent_paused"),
        (AgentStatus.PAUSED, "", "agent_paused"),
        (AgentStatus.DELETED, "", "agent_deleted"),
    ],
)
def test_an_agent_names_why_it_may_not_run(stateless_agent, status, reason, code):
    stateless_agent.status, stateless_agent.paused_reason = status, reason
    refusal = stateless_agent.refusal()
    assert (refusal[0] if refusal else None) == code
    assert stateless_agent.paused_by_budget is (code == "budget_exceeded")
