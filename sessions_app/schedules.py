"""Per-agent heartbeat schedules in django-q2, kept in step with the agent row.

An agent wakes on `heartbeat_interval_minutes` (a django-q2 MINUTES schedule) or on
`heartbeat_cron` read in `heartbeat_timezone` (default UTC). django-q2's own CRON type reads
every expression in the server's zone, so a cron agent instead has a ONCE schedule whose
`next_run` is its next local wake time converted to UTC. django-q2 deletes a ONCE schedule
(repeats -1) when it fires; `scheduled_heartbeat` arms the following wake first thing, and
the maintenance pass arms any agent left without its schedule (a task lost with Redis, a
row deleted by hand). A cluster that was down fires an overdue wake once and re-arms to
the next future one: no replay storm, like `catch_up` off for interval schedules.

Created, replaced and removed by name whenever an agent is saved, paused or deleted;
never from AppConfig.ready().
"""

from __future__ import annotations

import ast
import math
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django_q.models import Schedule

from sessions_app.models import Agent, AgentStatus
from sessions_app.wakes import HeartbeatPlan
from sessions_app.work_checks import agent_backoff

HEARTBEAT_FUNC = "sessions_app.tasks.scheduled_heartbeat"


def schedule_name(agent_id) -> str:
    return f"heartbeat:{agent_id}"


# The schedule rows.


def agent_schedule_sync(
    *, agent: Agent, now: datetime | None = None, fired: bool = False, wake_at: datetime | None = None
) -> None:
    """Make the agent's django-q2 schedule match its stored status and configuration.

    `fired`: called by the heartbeat a ONCE row's wake started (a cron agent's, or a long
    interval's, which says which wake it was: `wake_at`). That wake is taken, so the next
    one is armed even if the fired row is still there, due (with Redis the task can start
    before the scheduler that fired it commits the row's deletion).
    """
    now = now or timezone.now()
    name = schedule_name(agent.id)
    with transaction.atomic():
        # The agent row's lock serialises every arming of its schedule (a save, a fire's
        # re-arm, the maintenance pass): two replacing the row at once would leave two rows,
        # and the agent would wake twice. The row is read under it, not taken from the caller.
        stored = (
            Agent.objects.select_for_update()
            .filter(pk=agent.pk)
            .values("status", "adapter_config", "idle_streak")
            .first()
        )
        plan = agent_plan(stored["adapter_config"], stored["idle_streak"]) if stored else None
        rows = list(Schedule.objects.filter(name=name))
        if plan is None or stored["status"] != AgentStatus.ACTIVE:
            Schedule.objects.filter(name=name).delete()
        elif plan.cron:
            _arm_cron(name=name, agent_id=agent.pk, plan=plan, rows=[] if fired else rows, now=now)
        else:
            fired_wake = wake_at if fired else None
            _arm_interval(
                name=name, agent_id=agent.pk, plan=plan, rows=[] if fired_wake else rows, now=now, fired=fired_wake
            )


def _arm_cron(*, name: str, agent_id, plan: HeartbeatPlan, rows: list[Schedule], now: datetime) -> None:
    armed = rows[0].next_run if len(rows) == 1 and rows[0].schedule_type == Schedule.ONCE else None
    next_run = plan.next_cron_run(now=now, armed=armed)
    if next_run is None:
        # Backed off so far that no wake is left before the year 9999: none is armed.
        Schedule.objects.filter(name=name).delete()
        return
    if armed == next_run:
        return
    # Replaced, never updated: the scheduler that just fired the old row deletes it by its
    # id when it commits, which must not take the new wake with it.
    Schedule.objects.filter(name=name).delete()
    Schedule.objects.create(
        name=name,
        func=HEARTBEAT_FUNC,
        args=repr((str(agent_id),)),
        schedule_type=Schedule.ONCE,
        repeats=-1,
        next_run=next_run,
    )


def agent_plan(config: dict, idle_streak: int) -> HeartbeatPlan | None:
    """How the agent wakes now: its configuration, stretched by its back-off."""
    return HeartbeatPlan.of(config, backoff=agent_backoff(config, idle_streak))


# django-q2's `minutes` is a smallint on PostgreSQL. An interval step longer than it holds
# (up to 44640 minutes, times a back-off of up to 1024) is a ONCE row armed for its next
# wake, as a cron agent's is: the scheduler passes the row's wake to the task
# (`intended_date_kwarg`), whose heartbeat arms the one a step later; the row keeps its
# step (`kwargs`, handed to the task too) so that a changed step counts from the last wake.
MAX_SCHEDULE_MINUTES = 32767
WAKE_KWARG = "wake_at"


def _arm_interval(
    *, name: str, agent_id, plan: HeartbeatPlan, rows: list[Schedule], now: datetime, fired: datetime | None = None
) -> None:
    step = plan.step_minutes
    row = rows[0] if len(rows) == 1 else None
    if step <= MAX_SCHEDULE_MINUTES and row is not None and row.schedule_type == Schedule.MINUTES:
        defaults = {
            "func": HEARTBEAT_FUNC,
            "args": repr((str(agent_id),)),
            "schedule_type": Schedule.MINUTES,
            "minutes": step,
            "repeats": -1,
        }
        if row.minutes and row.next_run and row.minutes != step:
            # A back-off (or its end) moves the next wake too: the new step counts from the
            # last wake (django-q2 set next_run to it plus the old step when it fired), and a
            # wake that is due by then fires at once.
            defaults["next_run"] = max(_last_wake(row) + timedelta(minutes=step), now)
        Schedule.objects.update_or_create(name=name, defaults=defaults)
        return
    # A new row: the first, a cron agent's turned interval, or a step across the bound.
    if fired is not None:
        # The fired wake's next, past now: a cluster that was down does not replay.
        missed = max(0, math.floor((now - fired) / timedelta(minutes=step)))
        next_run = fired + timedelta(minutes=step) * (missed + 1)
    elif row is not None and _armed_step(row) is not None:
        next_run = max(_last_wake(row) + timedelta(minutes=step), now)
    else:
        next_run = now  # an interval counts from when it is made (a cron's wake is not one)
    if row is not None and row.schedule_type == Schedule.ONCE and (_armed_step(row), row.next_run) == (step, next_run):
        return
    Schedule.objects.filter(name=name).delete()
    if step <= MAX_SCHEDULE_MINUTES:
        kind = {"schedule_type": Schedule.MINUTES, "minutes": step}
    else:
        kind = {
            "schedule_type": Schedule.ONCE,
            "kwargs": repr({"step_minutes": step}),
            "intended_date_kwarg": WAKE_KWARG,
        }
    Schedule.objects.create(
        name=name, func=HEARTBEAT_FUNC, args=repr((str(agent_id),)), repeats=-1, next_run=next_run, **kind
    )


def _armed_step(row: Schedule) -> int | None:
    """The step an interval's row was armed with (None: a cron agent's row)."""
    if row.schedule_type == Schedule.MINUTES:
        return row.minutes or None
    try:
        step = ast.literal_eval(row.kwargs or "{}").get("step_minutes")
    except (ValueError, SyntaxError, AttributeError):
        return None
    return step if isinstance(step, int) and step > 0 else None


def _last_wake(row: Schedule) -> datetime:
    """An interval row's last wake: its next one, a step earlier."""
    return row.next_run - timedelta(minutes=_armed_step(row))


def agent_next_wakes(*, agent: Agent, now: datetime, count: int = 5) -> list[datetime]:
    """When the agent will wake next (empty when it has no schedule or is not active)."""
    plan = agent_plan(agent.adapter_config, agent.idle_streak)
    if plan is None or agent.status != AgentStatus.ACTIVE:
        return []
    next_run = None
    if plan.interval_minutes:
        next_run = Schedule.objects.filter(name=schedule_name(agent.pk)).values_list("next_run", flat=True).first()
    return plan.wakes(now=now, count=count, next_run=next_run)


def schedules_arm_missing(*, now: datetime) -> int:
    """Arm every active scheduled agent that has no schedule row; how many were armed."""
    scheduled = Agent.objects.filter(status=AgentStatus.ACTIVE).filter(
        Q(adapter_config__has_key="heartbeat_cron") | Q(adapter_config__has_key="heartbeat_interval_minutes")
    )
    armed = set(Schedule.objects.filter(name__startswith="heartbeat:").values_list("name", flat=True))
    missing = [
        agent
        for agent in scheduled.only("id", "status", "adapter_config")
        if schedule_name(agent.pk) not in armed and HeartbeatPlan.of(agent.adapter_config)
    ]
    for agent in missing:
        agent_schedule_sync(agent=agent, now=now)
    return len(missing)
