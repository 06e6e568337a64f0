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
    return _cron_text_error(expression)


# Cached: an agent's health and its wakes check its stored expression again on every read
# (each row of a list), and parsing one costs about 30 microseconds.
@functools.lru_cache(maxsize=1024)
def _cron_text_error(expression: str) -> str | None:
    if len(expression.split()) != 5:
        return f"must have 5 fields (minute hour day-of-month month day-of-week), got {expression!r}"
    try:
        next(CronSim(expression, datetime(2000, 1, 1, tzinfo=UTC)))
    except CronSimError as exc:
        if day := _day_no_month_has(expression):
            return f"never fires: none of the months it names has a day {day}: {expression!r}"
        return f"is not a valid cron expression ({exc}): {expression!r}"
    except StopIteration:
        return f"never fires: {expression!r}"
    return None


def _day_no_month_has(expression: str) -> int | None:
    """The day of the month an otherwise valid expression names that its months lack
    (`0 0 30 2 *`: cronsim refuses it as a bad day-of-month), or None."""
    minute, hour, day, month, weekday = expression.split()
    try:
        every_month = CronSim(f"{minute} {hour} {day} * {weekday}", datetime(2000, 1, 1, tzinfo=UTC))
    except CronSimError:
        return None  # the day field itself is wrong
    return min(every_month.days)


def cron_wakes(*, expression: str, zone_name: str, after: datetime, count: int) -> list[datetime]:
    """The next `count` wake times strictly after `after`, in the agent's zone.

    cronsim keeps cron's daylight-saving rules: a time skipped by the spring change runs at
    the first minute that exists (02:30 -> 03:00 in Berlin), a time repeated in autumn runs
    once (its first, summer-time instance).

    No wakes for a stored expression or zone that cannot be read (the agent's health says
    why: `agent_health.config_problem`): its schedule is disarmed as one with no wake left,
    rather than failing every save, resume and fire of the agent.
    """
    if zone_error(zone_name) or cron_error(expression):
        return []
    zone = zoneinfo.ZoneInfo(zone_name)
    wakes = CronSim(expression, after.astimezone(zone))
    found = []
    try:
        found.extend(itertools.islice(wakes, count))
    except (OverflowError, ValueError):
        pass  # past the year 9999 (a leap-day expression backed off): the wakes before it
    return found


def backoff_factor(*, idle_streak: int, after_runs: int, max_factor: int) -> int:
    """How many times an agent's wake interval is stretched after `idle_streak` runs in a row
    found no work: doubled once `after_runs` of them are reached and again with each more,
    up to `max_factor` (1: no back-off; `after_runs` 0: never)."""
    if after_runs <= 0 or idle_streak < after_runs:
        return 1
    # Bounded before the power: a streak of a million must not build a million-bit integer.
    doublings = min(idle_streak - after_runs + 1, max_factor.bit_length())
    return max(1, min(2**doublings, max_factor))


@dataclass(frozen=True)
class HeartbeatPlan:
    """How an agent's configuration says it wakes: every `interval_minutes`, or on `cron`;
    `backoff` stretches either (`backoff_factor`): an interval is multiplied by it, a cron
    agent wakes on every `backoff`-th time its expression names."""

    interval_minutes: int | None = None
    cron: str | None = None
    zone_name: str = DEFAULT_TIMEZONE
    backoff: int = 1

    @classmethod
    def of(cls, config: dict | None, *, backoff: int = 1) -> HeartbeatPlan | None:
        config = config or {}
        if config.get("heartbeat_cron"):
            return cls(
                cron=config["heartbeat_cron"],
                zone_name=config.get("heartbeat_timezone") or DEFAULT_TIMEZONE,
                backoff=backoff,
            )
        if config.get("heartbeat_interval_minutes"):
            return cls(interval_minutes=int(config["heartbeat_interval_minutes"]), backoff=backoff)
        return None

    @property
    def step_minutes(self) -> int | None:
        """An interval agent's minutes between wakes, back-off included."""
        return self.interval_minutes * self.backoff if self.interval_minutes else None

    def _cron_wakes(self, *, after: datetime, count: int) -> list[datetime]:
        wakes = cron_wakes(expression=self.cron, zone_name=self.zone_name, after=after, count=count * self.backoff)
        return wakes[self.backoff - 1 :: self.backoff]

    def wakes(self, *, now: datetime, count: int, next_run: datetime | None = None) -> list[datetime]:
        """The next `count` wakes. An interval counts from its schedule's `next_run` (which
        may be due already); a cron expression needs only `now`."""
        if self.cron:
            return self._cron_wakes(after=now, count=count)
        if next_run is None:
            return []
        step = timedelta(minutes=self.step_minutes)
        # An overdue schedule (a cluster that was down) fires once, then moves past now.
        skipped = max(0, math.ceil((now - next_run) / step)) if next_run <= now else 0
        later = [next_run + step * (skipped + index) for index in range(count)]
        wakes = ([next_run] if skipped else []) + [wake for wake in later if wake > now]
        return wakes[:count]

    def next_cron_run(self, *, now: datetime, armed: datetime | None) -> datetime | None:
        """The wake a cron schedule is armed for: the first after `now` (the `backoff`-th
        when backed off), except that an
        armed wake that is due and still one of this expression's is kept, so a save just
        after 09:00 does not drop the 09:00 wake the scheduler has not picked up yet. None
        when no wake is left before the year 9999."""
        if armed is not None and armed <= now:
            first = cron_wakes(
                expression=self.cron, zone_name=self.zone_name, after=armed - timedelta(seconds=1), count=1
            )
            # Compared in UTC: an ambiguous local time (the hour repeated in autumn) never
            # equals a time in another zone (PEP 495), however the two instants agree.
            if [wake.astimezone(UTC) for wake in first] == [armed.astimezone(UTC)]:
                return armed
        first = self._cron_wakes(after=now, count=1)
        return first[0].astimezone(UTC) if first else None
