"""django-q2's own admin (schedules, failures) works inside ours; the paginator caps counts."""

from __future__ import annotations

from django.urls import reverse
from django.utils import timezone

from sessions_app.admin import CappedCountPaginator
from sessions_app.models import AgentSession, HistoryStore
from tests.admin.conftest import make_session


def test_an_operator_can_add_a_schedule(admin_client):
    from django_q.models import Schedule

    data = {
        "name": "nightly-report",
        "func": "sessions_app.tasks.maintenance",
        "schedule_type": Schedule.DAILY,
        "minutes": "",
        "repeats": "-1",
        "next_run_0": timezone.now().date().isoformat(),
        "next_run_1": "03:00:00",
        "cluster": "",
        "intended_date_kwarg": "",
        "args": "",
        "kwargs": "",
        "hook": "",
        "cron": "",
    }
    response = admin_client.post(reverse("admin:django_q_schedule_add"), data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    assert Schedule.objects.filter(name="nightly-report").exists()
    assert b"nightly-report" in admin_client.get(reverse("admin:django_q_schedule_changelist")).content


def test_failed_tasks_are_listed_and_can_be_resubmitted(admin_client):
    from django_q.models import Failure, OrmQ

    now = timezone.now()
    failure = Failure.objects.create(
        id="f" * 32,
        name="heartbeat x",
        func="math.floor",
        args=(1.5,),
        started=now,
        stopped=now,
        success=False,
        result="boom",
    )
    page = admin_client.get(reverse("admin:django_q_failure_changelist")).content.decode()
    assert "heartbeat x" in page and "boom" in page
    admin_client.post(
        reverse("admin:django_q_failure_changelist"), {"action": "resubmit_task", "_selected_action": [failure.pk]}
    )
    assert not Failure.objects.filter(pk=failure.pk).exists()
    assert OrmQ.objects.count() == 1  # back in the queue for the cluster


def test_capped_paginator_counts_at_most_the_cap(persistent_agent, monkeypatch):
    for _ in range(5):
        make_session(persistent_agent, history=[], store=HistoryStore.DATABASE)
    monkeypatch.setattr(CappedCountPaginator, "count_cap", 3)
    paginator = CappedCountPaginator(AgentSession.objects.all(), 2)
    assert paginator.count == 3
    assert paginator.num_pages == 2
    assert len(paginator.page(2).object_list) == 1
    assert CappedCountPaginator(AgentSession.objects.filter(agent=persistent_agent)[:2], 2).count == 2
    assert CappedCountPaginator(list(range(4)), 2).count == 4


def test_capped_paginator_uses_the_planner_estimate_on_postgresql(postgres_only, persistent_agent, monkeypatch):
    from django.db import connection

    for _ in range(5):
        make_session(persistent_agent, history=[], store=HistoryStore.DATABASE)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE agent_sessions")
    monkeypatch.setattr(CappedCountPaginator, "count_cap", 2)
    assert CappedCountPaginator(AgentSession.objects.all(), 2).count == 5  # unfiltered: the estimate
    assert CappedCountPaginator(AgentSession.objects.filter(agent=persistent_agent), 2).count == 2  # filtered: the cap


def test_a_cron_schedule_without_croniter_is_a_field_error_not_a_500(admin_client):
    from django_q.models import Schedule

    data = {
        "name": "weekday-report",
        "func": "sessions_app.tasks.maintenance",
        "schedule_type": Schedule.CRON,
        "repeats": "-1",
        "next_run_0": timezone.now().date().isoformat(),
        "next_run_1": "03:00:00",
    }

    response = admin_client.post(reverse("admin:django_q_schedule_add"), data)

    assert response.status_code == 200
    [error] = response.context["adminform"].form.errors["schedule_type"]
    assert error.startswith("Cron schedules are not available here (croniter is not installed)")
    assert not Schedule.objects.filter(name="weekday-report").exists()
    # Nor turned into one on a change: the cluster's scheduler could not compute its next run.
    schedule = Schedule.objects.create(name="nightly", func="math.floor", schedule_type=Schedule.DAILY)
    response = admin_client.post(reverse("admin:django_q_schedule_change", args=[schedule.pk]), data)
    assert response.status_code == 200
    assert "schedule_type" in response.context["adminform"].form.errors
    schedule.refresh_from_db()
    assert (schedule.name, schedule.schedule_type) == ("nightly", Schedule.DAILY)
