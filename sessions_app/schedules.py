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

import functools
import itertools
import math
import zoneinfo
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cronsim import CronSim, CronSimError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django_q.models import Schedule

from sessions_app.models import Agent, AgentStatus

HEARTBEAT_FUNC = "sessions_app.tasks.scheduled_heartbeat"
DEFAULT_TIMEZONE = "UTC"
MAX_CRON_CHARS = 200


def schedule_name(agent_id) -> str:
    return f"heartbeat:{agent_id}"


# Wake-time arithmetic: pure functions of the configuration and `now`.


@functools.cache
def _zone_names() -> frozenset[str]:
    # "localtime" is the host's own zone, not a place: the same agent would wake at other
    # hours on another worker.
    return frozenset(zoneinfo.available_timezones() - {"localtime"})


def zone_error(name: object) -> str | None:
    """Why `name` is not an IANA time zone, or None when it is one."""
    if not isinstance(name, str) or name not in _zone_names():
        return f"must be an IANA time zone name such as 'Europe/Berlin' or 'UTC', got {name!r}"
    return None


def cron_error(expression: object) -> str | None:
    """Why `expression` is not a 5-field cron expression that fires, or None."""
    if not isinstance(expression, str) or len(expression) > MAX_CRON_CHARS:
        return f"must be a 5-field cron expression such as '0 9 * * 1-5', got {expression!r}"
    if len(expression.split()) != 5:
        return f"must have 5 fields (minute hour day-of-month month day-of-week), got {expression!r}"
    try:
        next(CronSim(expression, datetime(2000, 1, 1, tzinfo=UTC)))
    except CronSimError as exc:
        return f"is not a valid cron expression ({exc}): {expression!r}"
    except StopIteration:
        return f"never fires: {expression!r}"
    return None


def cron_wakes(*, expression: str, zone_name: str, after: datetime, count: int) -> list[datetime]:
    """The next `count` wake times strictly after `after`, in the agent's zone.

    cronsim keeps cron's daylight-saving rules: a time skipped by the spring change runs at
    the first minute that exists (02:30 -> 03:00 in Berlin), a time repeated in autumn runs
    once (its first, summer-time instance).
    """
    zone = zoneinfo.ZoneInfo(zone_name)
    wakes = CronSim(expression, after.astimezone(zone))
    return list(itertools.islice(wakes, count))


@dataclass(frozen=True)
class HeartbeatPlan:
    """How an agent's configuration says it wakes: every `interval_minutes`, or on `cron`."""

    interval_minutes: int | None = None
    cron: str | None = None
    zone_name: str = DEFAULT_TIMEZONE

    @classmethod
    def of(cls, config: dict | None) -> HeartbeatPlan | None:
        config = config or {}
        if config.get("heartbeat_cron"):
            return cls(cron=config["heartbeat_cron"], zone_name=config.get("heartbeat_timezone") or DEFAULT_TIMEZONE)
        if config.get("heartbeat_interval_minutes"):
            return cls(interval_minutes=int(config["heartbeat_interval_minutes"]))
        return None

    def wakes(self, *, now: datetime, count: int, next_run: datetime | None = None) -> list[datetime]:
        """The next `count` wakes. An interval counts from its schedule's `next_run` (which
        may be due already); a cron expression needs only `now`."""
        if self.cron:
            return cron_wakes(expression=self.cron, zone_name=self.zone_name, after=now, count=count)
        if next_run is None:
            return []
        step = timedelta(minutes=self.interval_minutes)
        # An overdue schedule (a cluster that was down) fires once, then moves past now.
        skipped = max(0, math.ceil((now - next_run) / step)) if next_run <= now else 0
        later = [next_run + step * (skipped + index) for index in range(count)]
        wakes = ([next_run] if skipped else []) + [wake for wake in later if wake > now]
        return wakes[:count]

    def next_cron_run(self, *, now: datetime, armed: datetime | None) -> datetime:
        """The wake a cron schedule is armed for: the first after `now`, except that an
        armed wake that is due and still one of this expression's is kept, so a save just
        after 09:00 does not drop the 09:00 wake the scheduler has not picked up yet."""
        if armed is not None and armed <= now:
            (first,) = cron_wakes(
                expression=self.cron, zone_name=self.zone_name, after=armed - timedelta(seconds=1), count=1
            )
            if first == armed:
                return armed
        (first,) = cron_wakes(expression=self.cron, zone_name=self.zone_name, after=now, count=1)
        return first.astimezone(UTC)


# The schedule rows.


def agent_schedule_sync(*, agent: Agent, now: datetime | None = None, fired: bool = False) -> None:
    """Make the agent's django-q2 schedule match its stored status and configuration.

    `fired`: called by the heartbeat a cron wake started. That wake is taken, so the next
    one is armed even if the fired row is still there, due (with Redis the task can start
    before the scheduler that fired it commits the row's deletion).
    """
    now = now or timezone.now()
    name = schedule_name(agent.id)
    with transaction.atomic():
        # The agent row's lock serialises every arming of its schedule (a save, a fire's
        # re-arm, the maintenance pass): two replacing the row at once would leave two rows,
        # and the agent would wake twice. The row is read under it, not taken from the caller.
        stored = Agent.objects.select_for_update().filter(pk=agent.pk).values("status", "adapter_config").first()
        plan = HeartbeatPlan.of(stored["adapter_config"]) if stored else None
        rows = list(Schedule.objects.filter(name=name))
        if plan is None or stored["status"] != AgentStatus.ACTIVE:
            Schedule.objects.filter(name=name).delete()
        elif plan.cron:
            _arm_cron(name=name, agent_id=agent.pk, plan=plan, rows=[] if fired else rows, now=now)
        else:
            _arm_interval(name=name, agent_id=agent.pk, plan=plan, rows=rows)


def _arm_cron(*, name: str, agent_id, plan: HeartbeatPlan, rows: list[Schedule], now: datetime) -> None:
    armed = rows[0].next_run if len(rows) == 1 and rows[0].schedule_type == Schedule.ONCE else None
    next_run = plan.next_cron_run(now=now, armed=armed)
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


def _arm_interval(*, name: str, agent_id, plan: HeartbeatPlan, rows: list[Schedule]) -> None:
    if any(row.schedule_type != Schedule.MINUTES for row in rows):
        # Was a cron schedule: the interval starts now, not at the cron's next wake.
        Schedule.objects.filter(name=name).delete()
    Schedule.objects.update_or_create(
        name=name,
        defaults={
            "func": HEARTBEAT_FUNC,
            "args": repr((str(agent_id),)),
            "schedule_type": Schedule.MINUTES,
            "minutes": plan.interval_minutes,
            "repeats": -1,
        },
    )


def agent_next_wakes(*, agent: Agent, now: datetime, count: int = 5) -> list[datetime]:
    """When the agent will wake next (empty when it has no schedule or is not active)."""
    plan = HeartbeatPlan.of(agent.adapter_config)
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
