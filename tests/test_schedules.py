"""Heartbeat schedules: cron wake times in the agent's zone, and the django-q2 row that follows them."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.utils import timezone
from django_q.brokers import get_broker
from django_q.models import OrmQ, Schedule
from django_q.scheduler import scheduler

from sessions_app.maintenance import maintenance_pass
from sessions_app.models import Agent, HeartbeatRun, RunStatus, RunTrigger
from sessions_app.schedules import agent_next_wakes, agent_schedule_sync, schedule_name
from sessions_app.services import agent_delete, agent_pause, agent_resume
from sessions_app.tasks import scheduled_heartbeat
from sessions_app.wakes import HeartbeatPlan, cron_wakes
from tests.conftest import Actor, WriteGate, run_queued_tasks, wait_until_blocked

BERLIN = "Europe/Berlin"


def utc(*args) -> datetime:
    return datetime(*args, tzinfo=UTC)


def berlin_wakes(expression: str, after: datetime, count: int) -> list[tuple[str, datetime]]:
    wakes = cron_wakes(expression=expression, zone_name=BERLIN, after=after, count=count)
    return [(wake.strftime("%a %m-%d %H:%M %Z"), wake.astimezone(UTC)) for wake in wakes]


def test_a_wake_in_the_hour_skipped_in_spring_runs_once_at_the_first_minute_that_exists():
    # 2026-03-29 02:00 CET becomes 03:00 CEST: 02:30 does not exist that night.
    assert berlin_wakes("30 2 * * *", after=utc(2026, 3, 27, 12), count=3) == [
        ("Sat 03-28 02:30 CET", utc(2026, 3, 28, 1, 30)),
        ("Sun 03-29 03:00 CEST", utc(2026, 3, 29, 1, 0)),
        ("Mon 03-30 02:30 CEST", utc(2026, 3, 30, 0, 30)),
    ]


def test_a_wake_in_the_hour_repeated_in_autumn_runs_once():
    # 2026-10-25 03:00 CEST becomes 02:00 CET: 02:30 happens twice; cron runs the first.
    assert berlin_wakes("30 2 * * *", after=utc(2026, 10, 23, 12), count=3) == [
        ("Sat 10-24 02:30 CEST", utc(2026, 10, 24, 0, 30)),
        ("Sun 10-25 02:30 CEST", utc(2026, 10, 25, 0, 30)),
        ("Mon 10-26 02:30 CET", utc(2026, 10, 26, 1, 30)),
    ]


def test_weekdays_at_nine_stay_at_nine_local_across_both_changes():
    # 09:00 in Berlin is 08:00 UTC in winter (CET, +1) and 07:00 UTC in summer (CEST, +2).
    assert berlin_wakes("0 9 * * 1-5", after=utc(2026, 3, 26, 12), count=2) == [
        ("Fri 03-27 09:00 CET", utc(2026, 3, 27, 8)),
        ("Mon 03-30 09:00 CEST", utc(2026, 3, 30, 7)),
    ]
    assert berlin_wakes("0 9 * * 1-5", after=utc(2026, 10, 22, 12), count=2) == [
        ("Fri 10-23 09:00 CEST", utc(2026, 10, 23, 7)),
        ("Mon 10-26 09:00 CET", utc(2026, 10, 26, 8)),
    ]


def test_wakes_are_strictly_after_now_and_a_missing_zone_means_utc():
    plan = HeartbeatPlan.of({"heartbeat_cron": "0 9 * * *"})
    assert plan.zone_name == "UTC"
    assert plan.wakes(now=utc(2026, 5, 1, 9), count=2) == [utc(2026, 5, 2, 9), utc(2026, 5, 3, 9)]


def test_an_overdue_interval_wakes_once_then_keeps_its_step():
    plan = HeartbeatPlan.of({"heartbeat_interval_minutes": 60})
    now = utc(2026, 5, 1, 12, 30)
    assert plan.wakes(now=now, count=3, next_run=utc(2026, 5, 1, 9)) == [
        utc(2026, 5, 1, 9),  # due: django-q2 fires it once (catch_up off) ...
        utc(2026, 5, 1, 13),  # ... and moves past now on the same step
        utc(2026, 5, 1, 14),
    ]
    assert plan.wakes(now=now, count=2, next_run=utc(2026, 5, 1, 13)) == [utc(2026, 5, 1, 13), utc(2026, 5, 1, 14)]


def make_cron_agent(agent, expression: str = "0 9 * * 1-5", zone: str = BERLIN, *, now: datetime):
    config = {key: value for key, value in agent.adapter_config.items() if key != "heartbeat_interval_minutes"}
    agent.adapter_config = {**config, "heartbeat_cron": expression, "heartbeat_timezone": zone}
    agent.full_clean()
    agent.save()
    agent_schedule_sync(agent=agent, now=now)
    return agent


def armed(agent) -> list[Schedule]:
    return list(Schedule.objects.filter(name=schedule_name(agent.pk)))


def test_a_cron_agent_is_armed_for_its_next_local_wake(persistent_agent):
    make_cron_agent(persistent_agent, now=utc(2026, 3, 27, 12))  # a Friday afternoon
    (row,) = armed(persistent_agent)
    assert (row.schedule_type, row.repeats, row.func) == (Schedule.ONCE, -1, "sessions_app.tasks.scheduled_heartbeat")
    assert row.next_run == utc(2026, 3, 30, 7)  # Monday 09:00 CEST
    assert row.args == repr((str(persistent_agent.pk),))


def test_saving_the_agent_re_arms_it_and_keeps_a_wake_that_is_due(persistent_agent):
    make_cron_agent(persistent_agent, now=utc(2026, 3, 27, 12))
    # Saved again unchanged: the same wake, the same row.
    (before,) = armed(persistent_agent)
    agent_schedule_sync(agent=persistent_agent, now=utc(2026, 3, 28, 12))
    assert [row.pk for row in armed(persistent_agent)] == [before.pk]
    # Saved seconds after the wake, before the scheduler took it: that wake still fires.
    agent_schedule_sync(agent=persistent_agent, now=utc(2026, 3, 30, 7, 0, 20))
    assert [row.next_run for row in armed(persistent_agent)] == [utc(2026, 3, 30, 7)]
    # A new expression is armed for its own next wake.
    make_cron_agent(persistent_agent, "30 2 * * *", now=utc(2026, 3, 28, 12))
    assert [row.next_run for row in armed(persistent_agent)] == [utc(2026, 3, 29, 1)]  # 03:00 CEST


def test_a_save_just_after_a_wake_in_the_repeated_hour_keeps_that_wake(persistent_agent):
    """On 2026-10-25 02:30 happens twice in Berlin; its first instance (00:30 UTC) is due
    and not yet taken when the agent is saved. An ambiguous local time never compares equal
    to a time in another zone (PEP 495), which re-armed the agent for the next day."""
    make_cron_agent(persistent_agent, "30 2 * * *", now=utc(2026, 10, 24, 12))
    assert [row.next_run for row in armed(persistent_agent)] == [utc(2026, 10, 25, 0, 30)]

    agent_schedule_sync(agent=persistent_agent, now=utc(2026, 10, 25, 0, 30, 20))
    assert [row.next_run for row in armed(persistent_agent)] == [utc(2026, 10, 25, 0, 30)]
    # Saved again in the second 02:30 (CET), the first one still not taken: still kept.
    agent_schedule_sync(agent=persistent_agent, now=utc(2026, 10, 25, 1, 31))
    assert [row.next_run for row in armed(persistent_agent)] == [utc(2026, 10, 25, 0, 30)]


def test_the_schedule_follows_pause_resume_delete_and_a_cleared_cron(persistent_agent):
    now = timezone.now()
    make_cron_agent(persistent_agent, now=now)
    agent_pause(agent=persistent_agent)
    assert armed(persistent_agent) == []
    agent_resume(agent=persistent_agent)
    assert len(armed(persistent_agent)) == 1

    persistent_agent.adapter_config = {**persistent_agent.adapter_config, "heartbeat_cron": None}
    del persistent_agent.adapter_config["heartbeat_timezone"]
    persistent_agent.full_clean()
    persistent_agent.save()
    agent_schedule_sync(agent=persistent_agent, now=now)
    assert armed(persistent_agent) == []

    make_cron_agent(persistent_agent, now=now)
    agent_delete(agent=persistent_agent, now=now)
    assert armed(persistent_agent) == []


def test_switching_between_cron_and_interval_replaces_the_row(persistent_agent):
    now = timezone.now()
    make_cron_agent(persistent_agent, now=now)
    config = {key: value for key, value in persistent_agent.adapter_config.items() if "heartbeat" not in key}
    persistent_agent.adapter_config = {**config, "heartbeat_interval_minutes": 15}
    persistent_agent.save()
    agent_schedule_sync(agent=persistent_agent, now=now)
    (row,) = armed(persistent_agent)
    assert (row.schedule_type, row.minutes, row.repeats) == (Schedule.MINUTES, 15, -1)
    assert row.next_run <= timezone.now()  # an interval starts now, not at the cron's wake
    make_cron_agent(persistent_agent, now=now)
    assert [row.schedule_type for row in armed(persistent_agent)] == [Schedule.ONCE]


def test_a_fired_wake_is_re_armed_by_the_heartbeat_it_starts(persistent_agent, fake_anthropic):
    make_cron_agent(persistent_agent, "*/5 * * * *", "UTC", now=timezone.now() - timedelta(days=1))
    Schedule.objects.filter(name=schedule_name(persistent_agent.pk)).delete()  # as django-q2 does on firing
    assert scheduled_heartbeat(str(persistent_agent.pk)) == RunStatus.SUCCEEDED
    (row,) = armed(persistent_agent)
    now = timezone.now()
    assert now < row.next_run <= now + timedelta(minutes=5)
    assert row.next_run.minute % 5 == 0


def test_a_heartbeat_that_starts_before_its_scheduler_commits_still_arms_the_next_wake(
    persistent_agent, fake_anthropic
):
    """With Redis the task can run while the scheduler that fired it has not yet committed
    the delete of the fired row: the heartbeat must not take that row, still due, for its
    next wake, or the commit leaves the agent with no schedule at all."""
    now = timezone.now()
    make_cron_agent(persistent_agent, "*/5 * * * *", "UTC", now=now - timedelta(days=1))
    (fired,) = armed(persistent_agent)
    assert scheduled_heartbeat(str(persistent_agent.pk)) == RunStatus.SUCCEEDED
    Schedule.objects.filter(pk=fired.pk).delete()  # the scheduler's commit
    (row,) = armed(persistent_agent)
    assert now < row.next_run <= timezone.now() + timedelta(minutes=5)


def test_the_maintenance_pass_arms_a_scheduled_agent_left_without_its_row(persistent_agent, stateless_agent):
    now = timezone.now()
    make_cron_agent(persistent_agent, now=now)
    Schedule.objects.all().filter(name__startswith="heartbeat:").delete()  # a task lost with Redis
    result = maintenance_pass(now=now)
    assert result["schedules_armed"] == 1
    assert len(armed(persistent_agent)) == 1 and armed(stateless_agent) == []
    assert maintenance_pass(now=now)["schedules_armed"] == 0


@pytest.mark.django_db(transaction=True)
def test_a_real_scheduler_pass_fires_a_due_cron_wake_once_and_re_arms_the_next_future_one(
    persistent_agent, fake_anthropic
):
    # (Transactional: the scheduler closes the connection it finds, as in a cluster.)
    # Armed three days ago for the wakes of a cluster that was down since: one is due.
    make_cron_agent(persistent_agent, "0 * * * *", BERLIN, now=timezone.now() - timedelta(days=3))
    (due,) = armed(persistent_agent)
    assert due.next_run < timezone.now()
    Schedule.objects.exclude(pk=due.pk).update(next_run=timezone.now() + timedelta(days=1))  # maintenance

    scheduler(broker=get_broker())
    assert armed(persistent_agent) == []  # django-q2 deletes a ONCE schedule that fired
    assert OrmQ.objects.count() == 1  # one tick, not a replay of 72 missed hours

    assert run_queued_tasks() == [RunStatus.SUCCEEDED]
    run = HeartbeatRun.objects.get(agent=persistent_agent)
    assert run.trigger == RunTrigger.SCHEDULE
    (row,) = armed(persistent_agent)
    now = timezone.now()
    assert now < row.next_run <= now + timedelta(hours=1)
    assert row.next_run.astimezone(ZoneInfo(BERLIN)).minute == 0

    scheduler(broker=get_broker())  # not due yet: nothing fires
    assert OrmQ.objects.count() == 0 and len(armed(persistent_agent)) == 1


def test_next_wakes_of_an_interval_count_from_its_schedule(persistent_agent):
    persistent_agent.adapter_config = {**persistent_agent.adapter_config, "heartbeat_interval_minutes": 90}
    persistent_agent.save()
    agent_schedule_sync(agent=persistent_agent)
    start = Schedule.objects.get(name=schedule_name(persistent_agent.pk)).next_run
    wakes = agent_next_wakes(agent=persistent_agent, now=timezone.now(), count=3)
    assert wakes == [start, start + timedelta(minutes=90), start + timedelta(minutes=180)]
    agent_pause(agent=persistent_agent)
    assert agent_next_wakes(agent=persistent_agent, now=timezone.now()) == []


@pytest.mark.django_db(transaction=True)
def test_two_armings_at_once_leave_one_row(persistent_agent):
    """A save and a fire's re-arm racing, the first one's insert still uncommitted (held at a
    gate inside it): without the agent-row lock (SQLite: IMMEDIATE transactions) both find
    no row, both insert, and the agent wakes twice at every wake. The gate opens only once
    the second is seen waiting for a lock."""
    now = timezone.now()
    make_cron_agent(persistent_agent, "0 9 * * *", now=now)
    Schedule.objects.filter(name=schedule_name(persistent_agent.pk)).delete()

    def arm():
        agent_schedule_sync(agent=persistent_agent, now=now)

    with WriteGate("django_q_schedule", event="INSERT") as gate:
        first = Actor(arm)
        first.start()
        gate.wait_entered()
        second = Actor(arm)
        second.start()
        wait_until_blocked(second)
        gate.open()
        first.result()
        second.result()

    assert len(armed(persistent_agent)) == 1


def test_the_backoff_factor_doubles_from_n_idle_runs_up_to_its_cap():
    from sessions_app.wakes import backoff_factor

    factors = [backoff_factor(idle_streak=streak, after_runs=3, max_factor=8) for streak in range(8)]
    assert factors == [1, 1, 1, 2, 4, 8, 8, 8]
    assert backoff_factor(idle_streak=10**9, after_runs=1, max_factor=6) == 6  # capped, not 2**10**9
    assert backoff_factor(idle_streak=100, after_runs=0, max_factor=8) == 1  # 0: never


def test_a_backed_off_cron_plan_wakes_on_every_nth_time():
    plan = HeartbeatPlan.of({"heartbeat_cron": "0 9 * * 1-5", "heartbeat_timezone": BERLIN}, backoff=2)
    # Friday noon: the next weekday mornings are Mon, Tue, Wed, Thu, Fri, Mon; every 2nd.
    assert [
        wake.astimezone(ZoneInfo(BERLIN)).strftime("%a") for wake in plan.wakes(now=utc(2026, 5, 1, 10), count=3)
    ] == [
        "Tue",
        "Thu",
        "Mon",
    ]


def weekly_agent_backed_off(agent, *, idle_streak: int, now: datetime):
    """A weekly agent whose interval doubles from 1 idle run in a row (x2, then x4: four
    weeks, 40320 minutes, past django-q2's smallint minutes on PostgreSQL)."""
    agent.adapter_config = {
        **agent.adapter_config,
        "heartbeat_interval_minutes": 7 * 24 * 60,
        "backoff_after_runs": 1,
        "backoff_max_factor": 4,
    }
    agent.save()
    agent_schedule_sync(agent=agent, now=now)
    HeartbeatRun.objects.filter(agent=agent).delete()
    agent.__class__.objects.filter(pk=agent.pk).update(idle_streak=idle_streak)
    agent.refresh_from_db()
    agent_schedule_sync(agent=agent, now=now)
    return agent


def test_a_back_off_past_the_schedule_tables_minutes_wakes_on_its_step(persistent_agent):
    """x4 of a week: the wake moves to four weeks after the last one (before, on PostgreSQL
    the update failed and the row kept x2 while the agent said x4)."""
    now = utc(2026, 5, 1, 12)
    weekly_agent_backed_off(persistent_agent, idle_streak=1, now=now)  # x2
    (row,) = armed(persistent_agent)
    last = row.next_run - timedelta(weeks=2)

    Agent.objects.filter(pk=persistent_agent.pk).update(idle_streak=2)  # x4, as the engine counts it
    persistent_agent.refresh_from_db()
    agent_schedule_sync(agent=persistent_agent, now=now + timedelta(days=1))

    (row,) = armed(persistent_agent)
    assert row.next_run == last + timedelta(weeks=4)
    assert agent_next_wakes(agent=persistent_agent, now=now + timedelta(days=1), count=2) == [
        last + timedelta(weeks=4),
        last + timedelta(weeks=8),
    ]
    # The first run with work puts it back to a week from its last wake (due: at once).
    Agent.objects.filter(pk=persistent_agent.pk).update(idle_streak=0)
    persistent_agent.refresh_from_db()
    agent_schedule_sync(agent=persistent_agent, now=now + timedelta(days=2))
    (row,) = armed(persistent_agent)
    assert (row.schedule_type, row.minutes) == (Schedule.MINUTES, 7 * 24 * 60)
    assert row.next_run == max(last + timedelta(weeks=1), now + timedelta(days=2))


@pytest.mark.django_db(transaction=True)
def test_a_real_scheduler_pass_fires_a_long_interval_once_and_re_arms_it_a_step_later(
    persistent_agent, fake_anthropic, tmp_path
):
    # (Transactional: the scheduler closes the connection it finds, as in a cluster.)
    no_work = tmp_path / "no-work.py"
    no_work.write_text("import sys\nsys.exit(1)\n")
    persistent_agent.adapter_config = {
        **persistent_agent.adapter_config,
        "work_check": {"command": [sys.executable, str(no_work)]},
    }
    persistent_agent.save()
    now = timezone.now()
    weekly_agent_backed_off(persistent_agent, idle_streak=2, now=now - timedelta(weeks=5))
    (due,) = armed(persistent_agent)
    assert due.next_run < now
    Schedule.objects.exclude(pk=due.pk).update(next_run=now + timedelta(days=1))  # maintenance

    scheduler(broker=get_broker())
    assert armed(persistent_agent) == [] and OrmQ.objects.count() == 1

    assert run_queued_tasks() == [RunStatus.SKIPPED]  # no work: still x4
    (row,) = armed(persistent_agent)
    assert row.next_run == due.next_run + timedelta(weeks=4)
    scheduler(broker=get_broker())  # not due yet: nothing fires
    assert OrmQ.objects.count() == 0


def test_a_leap_day_cron_backed_off_lists_the_wakes_before_the_year_9999():
    """`0 0 29 2 *` at x512: five wakes would be 2,560 leap days, past what a datetime holds
    (before, cronsim's OverflowError). The wakes that exist are listed; at x1024 it is
    still armed for its next one."""
    plan = HeartbeatPlan.of({"heartbeat_cron": "0 0 29 2 *"}, backoff=512)
    wakes = plan.wakes(now=utc(2026, 12, 1), count=5)
    assert 1 <= len(wakes) < 5 and all(wake.month == 2 and wake.day == 29 for wake in wakes)
    assert wakes == sorted(wakes) and wakes[-1].year < 10000
    far = HeartbeatPlan.of({"heartbeat_cron": "0 0 29 2 *"}, backoff=1024)
    assert far.next_cron_run(now=utc(2026, 12, 1), armed=None).year > 5000
