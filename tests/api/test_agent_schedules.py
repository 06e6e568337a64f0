"""Agent heartbeat schedules through the API: cron and time zone settings, 400s naming the field."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from django_q.models import Schedule

from sessions_app.models import Agent
from sessions_app.schedules import agent_next_wakes
from tests.api.conftest import agent_url, assert_error

pytestmark = pytest.mark.django_db

BODY = {
    "name": "Standup",
    "system_prompt": "Report.",
    "adapter_type": "claude-code",
    "adapter_config": {
        "model": "claude-opus-4-5",
        "heartbeat_cron": "0 9 * * 1-5",
        "heartbeat_timezone": "Europe/Berlin",
    },
}


def with_config(**changes) -> dict:
    config = {**BODY["adapter_config"], **changes}
    return {**BODY, "adapter_config": {key: value for key, value in config.items() if value is not ...}}


def test_a_cron_agent_is_created_with_its_schedule(api, company):
    response = api.post(f"/api/companies/{company.id}/agents", BODY)
    assert response.status_code == 201, response.json()
    assert response.json()["adapter_config"]["heartbeat_timezone"] == "Europe/Berlin"
    schedule = Schedule.objects.get(name=f"heartbeat:{response.json()['id']}")
    assert schedule.schedule_type == Schedule.ONCE


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"heartbeat_cron": "0 9 * *"}, "adapter_config.heartbeat_cron"),
        ({"heartbeat_cron": "0 25 * * *"}, "adapter_config.heartbeat_cron"),
        ({"heartbeat_cron": "0 0 30 2 *"}, "adapter_config.heartbeat_cron"),  # never fires
        ({"heartbeat_cron": "* * * * * *"}, "adapter_config.heartbeat_cron"),  # seconds
        ({"heartbeat_cron": 9}, "adapter_config.heartbeat_cron"),
        ({"heartbeat_cron": "", "heartbeat_timezone": ...}, "adapter_config.heartbeat_cron"),
        ({"heartbeat_timezone": "Europe/Atlantis"}, "adapter_config.heartbeat_timezone"),
        ({"heartbeat_timezone": "localtime"}, "adapter_config.heartbeat_timezone"),
        ({"heartbeat_timezone": "../../etc/passwd"}, "adapter_config.heartbeat_timezone"),
        ({"heartbeat_interval_minutes": 15}, "adapter_config.heartbeat_cron"),
        ({"heartbeat_cron": ..., "heartbeat_interval_minutes": 15}, "adapter_config.heartbeat_timezone"),
    ],
)
def test_a_bad_schedule_is_400_naming_the_field(api, company, changes, field):
    error = assert_error(api.post(f"/api/companies/{company.id}/agents", with_config(**changes)), 400, "invalid")
    assert list(error["fields"]) == [field]
    assert not Agent.objects.exists() and not Schedule.objects.filter(name__startswith="heartbeat:").exists()


@pytest.mark.parametrize(("cron", "day"), [("0 0 30 2 *", 30), ("15 8 31 4,6 *", 31), ("0 0 31 FEB-APR/2 *", 31)])
def test_a_cron_expression_that_can_never_fire_is_refused_as_never_firing(api, company, cron, day):
    error = assert_error(api.post(f"/api/companies/{company.id}/agents", with_config(heartbeat_cron=cron)), 400)
    message = error["fields"]["adapter_config.heartbeat_cron"]
    assert message.startswith("never fires"), message
    assert f"day {day}" in message and cron in message


def test_patching_to_an_interval_replaces_the_cron_schedule(api, company):
    agent = Agent.objects.get(pk=api.post(f"/api/companies/{company.id}/agents", BODY).json()["id"])
    error = assert_error(api.patch(agent_url(agent), with_config(heartbeat_timezone="Mars/Olympus")), 400)
    assert list(error["fields"]) == ["adapter_config.heartbeat_timezone"]
    assert Schedule.objects.get(name=f"heartbeat:{agent.id}").schedule_type == Schedule.ONCE

    # A merge patch: the cron keys are removed with null, the interval added.
    patch = {"heartbeat_cron": None, "heartbeat_timezone": None, "heartbeat_interval_minutes": 30}
    assert api.patch(agent_url(agent), {"adapter_config": patch}).status_code == 200
    schedule = Schedule.objects.get(name=f"heartbeat:{agent.id}")
    assert (schedule.schedule_type, schedule.minutes) == (Schedule.MINUTES, 30)
    assert api.patch(agent_url(agent), {"adapter_config": {"heartbeat_interval_minutes": None}}).status_code == 200
    assert not Schedule.objects.filter(name=f"heartbeat:{agent.id}").exists()


def test_an_interval_longer_than_django_q2s_minutes_column_is_scheduled(api, company):
    """`heartbeat_interval_minutes` goes to 44640 (31 days); django-q2's schedule minutes
    are a smallint on PostgreSQL (at most 32767): before, 40000 was a 500."""
    body = {**BODY, "adapter_config": {"model": "claude-opus-4-5", "heartbeat_interval_minutes": 40000}}

    response = api.post(f"/api/companies/{company.id}/agents", body)

    assert response.status_code == 201, response.content[:500]
    agent = Agent.objects.get(pk=response.json()["id"])
    first, second = agent_next_wakes(agent=agent, now=timezone.now(), count=2)
    assert first == Schedule.objects.get(name=f"heartbeat:{agent.id}").next_run  # an interval starts when made
    assert second - first == timedelta(minutes=40000)
