"""An agent's model against the catalogue: an unknown model is refused when saved (naming
the field, with close matches), an overridden one is accepted, a retired one refuses runs,
a deprecated one is warned about; max_tokens within the model's; the default model comes
from the catalogue."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.utils import timezone

from costs_app.models import ModelPrice
from sessions_app.adapters import AgentConfigError
from sessions_app.errors import HeartbeatRefused
from sessions_app.heartbeat import heartbeat_execute
from sessions_app.models import Agent, RunStatus
from sessions_app.run_queue import heartbeat_enqueue
from tests.conftest import agent_on_unknown_model, beat, catalogue_stored
from tests.fake_anthropic import CATALOGUE


def create(company, **config) -> Agent:
    return Agent.objects.create(company=company, name="agent", adapter_config=config)


def test_a_model_the_catalogue_does_not_have_is_refused_with_close_matches(company):
    catalogue_stored()
    with pytest.raises(AgentConfigError) as refused:
        create(company, model="claude-sonet-5-5")
    message = refused.value.fields["adapter_config.model"]
    assert "unknown model 'claude-sonet-5-5'" in message
    assert "'claude-sonnet-5-5'" in message  # the close match
    assert not Agent.objects.exists()


def test_without_a_catalogue_the_price_librarys_models_are_accepted(company):
    assert create(company, model="claude-fable-5-1").model_name == "claude-fable-5-1"
    with pytest.raises(AgentConfigError) as refused:
        create(company, model="claude-fable-9")
    assert "adapter_config.model" in refused.value.fields


def test_snapshots_and_1m_variants_of_a_listed_model_are_accepted(company):
    catalogue_stored()
    assert create(company, model="claude-opus-5-5-20261118").model_name == "claude-opus-5-5-20261118"
    assert create(company, model="claude-sonnet-5-5[1m]").model_name == "claude-sonnet-5-5[1m]"


def test_a_model_with_an_override_price_is_accepted(company):
    catalogue_stored()
    ModelPrice.from_list_price("acme-finetune-1", date(2026, 1, 1), Decimal("1"), Decimal("2")).save()
    assert create(company, model="acme-finetune-1").model_name == "acme-finetune-1"


def test_an_unknown_summary_model_is_refused_naming_it(company):
    with pytest.raises(AgentConfigError) as refused:
        create(company, model="claude-opus-5-5", session_mode="persistent", summary_model="claude-haiku-5-6")
    assert set(refused.value.fields) == {"adapter_config.summary_model"}
    assert "'claude-haiku-5-5'" in refused.value.fields["adapter_config.summary_model"]


def test_a_retired_model_is_refused_at_save(company):
    catalogue_stored()
    with pytest.raises(AgentConfigError) as refused:
        create(company, model="claude-opus-4-1")
    assert "retired" in refused.value.fields["adapter_config.model"]


def test_max_tokens_above_the_models_is_refused(company):
    catalogue_stored()  # claude-sonnet-5-5 answers with at most 64,000 tokens
    with pytest.raises(AgentConfigError) as refused:
        create(company, model="claude-sonnet-5-5", max_tokens=100_000)
    assert "at most 64000" in refused.value.fields["adapter_config.max_tokens"]
    assert create(company, model="claude-opus-5-5", max_tokens=100_000).adapter_config["max_tokens"] == 100_000


def test_the_model_is_checked_when_set_or_changed_not_on_every_save(company):
    agent = agent_on_unknown_model(company, "claude-legacy-1")
    agent.name = "renamed"
    agent.save()  # the stored model is not checked again: the agent can still be paused, renamed
    agent.adapter_config = {**agent.adapter_config, "model": "claude-legacy-2"}
    with pytest.raises(AgentConfigError):
        agent.save()


def test_the_default_model_is_the_catalogues_newest_sonnet(company, settings):
    assert create(company).model_name == "claude-sonnet-5-5"  # the price library's models
    catalogue_stored([entry for entry in CATALOGUE if entry["id"] != "claude-sonnet-5-5"])
    assert create(company).model_name == "claude-sonnet-5"
    settings.PAPERCLIP_DEFAULT_MODEL = "claude-haiku-5-5"
    assert create(company).model_name == "claude-haiku-5-5"


def test_a_retired_model_refuses_runs_at_enqueue_and_at_claim(company, fake_anthropic):
    agent = create(company, model="claude-opus-4-1")  # active in the price library's list
    queued, _ = heartbeat_enqueue(agent=agent, task="queued before it retired", now=timezone.now())
    catalogue_stored()  # the Models API now lists it as retired

    with pytest.raises(HeartbeatRefused) as refused:
        heartbeat_enqueue(agent=agent, task="after", now=timezone.now())
    done = heartbeat_execute(run_id=queued.id)

    assert refused.value.code == "model_retired"
    assert (done.status, done.error_code) == (RunStatus.FAILED, "model_retired")
    assert "claude-opus-4-1" in done.error
    assert fake_anthropic.message_requests == []


def test_a_retired_summary_model_refuses_runs(company, fake_anthropic):
    agent = create(company, model="claude-opus-5-5", session_mode="persistent", summary_model="claude-opus-4-1")
    catalogue_stored()
    with pytest.raises(HeartbeatRefused) as refused:
        beat(agent, "summarise later")
    assert refused.value.code == "model_retired" and "summary_model" in refused.value.message


def test_manage_py_check_names_the_agents_on_a_deprecated_model_and_its_date(company, capsys):
    create(company, model="claude-opus-4-5")
    Agent.objects.create(company=company, name="second", adapter_config={"model": "claude-opus-4-5"})
    create(company, model="claude-sonnet-5-5")
    catalogue_stored()

    call_command("check")

    err = capsys.readouterr().err
    assert "paperclip.W020" in err
    warning = next(line for line in err.splitlines() if "claude-opus-4-5 is deprecated" in line)
    assert "retires on 2027-02-01" in warning and "'agent'" in warning and "'second'" in warning
    assert "claude-sonnet-5-5" not in err
