"""When an agent wakes: pure functions of its configuration and `now`.

No model and no database here, so that configuration validation (sessions_app.adapters)
can use them without importing models; `schedules` turns them into django-q2 rows.
"""

from __future__ import annotations

import functools
import itertools
import math
import zoneinfo
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cronsim import CronSim, CronSimError

DEFAULT_TIMEZONE = "UTC"
MAX_CRON_CHARS = 200


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
