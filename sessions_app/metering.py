"""Session-hour metering: only time with a run in progress is paid for.

A session accrues active seconds only while one of its runs is in progress; they are
billed as `session_hours` cost events when the session pauses, expires or ends, at
PAPERCLIP_SESSION_HOUR_USD per hour (0 turns metering off). Time a provider measured for a
run that no row will record (a Managed Agents turn whose row was deleted while it ran) is
billed when that run ends.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Case, F, Q, Value, When

from costs_app.ledger import session_hours_record
from costs_app.pricing import session_hour_rate, session_hours_cost
from sessions_app.models import LIVE_SESSION_STATUSES, AgentSession, HeartbeatRun


def session_hours_bill(*, session_ids, now: datetime, statuses=None) -> int:
    """Write one session_hours event per session with unbilled active time (of those in
    `statuses`, when given). Billing zeroes the unbilled time under the row's lock, so
    every path that ends a session can call this and each second is billed once."""
    rate = session_hour_rate()
    billed = 0
    with transaction.atomic():
        sessions = AgentSession.objects.select_for_update().filter(
            id__in=list(session_ids), unbilled_active_seconds__gt=0
        )
        if statuses is not None:
            sessions = sessions.filter(status__in=statuses)
        sessions = sessions.only("id", "agent_id", "company_id", "unbilled_active_seconds")
        for session in sessions:
            cost = session_hours_cost(session.unbilled_active_seconds, rate=rate)
            if rate > 0:
                session_hours_record(
                    company_id=session.company_id,
                    agent_id=session.agent_id,
                    session_id=session.id,
                    seconds=session.unbilled_active_seconds,
                    cost=cost,
                    at=now,
                )
                billed += 1
            AgentSession.objects.filter(id=session.id).update(unbilled_active_seconds=0)
    return billed


def unrecorded_time_bill(*, company_id, agent_id, seconds: float, at: datetime) -> None:
    """Bill now the time a provider measured for a run that no session row will record (its
    row was deleted while the run went on, or it never had one: a stateless run, a new
    session its commit did not make), since no pause or end of a row will. The caller is
    the one place that decides, once, where the run's time goes (its commit, or `run_fail`)."""
    if seconds <= 0 or (rate := session_hour_rate()) <= 0:
        return
    session_hours_record(
        company_id=company_id,
        agent_id=agent_id,
        session_id=None,
        seconds=seconds,
        cost=session_hours_cost(seconds, rate=rate),
        at=at,
    )


def session_run_time_record(
    *, session_id, started: datetime, finished: datetime, ttl: timedelta, active_seconds: float | None = None
) -> bool:
    """A run of the session ended without a turn to record (it failed, was reaped, or was a
    compaction): the time it was in progress is active time, billed with the rest when the
    session pauses or ends (an ended session's by the maintenance pass); a live session was
    used until the end of the run, so its TTL counts from there (`expires_at = last_used +
    ttl`, never moved back: a turn committed after this run's end stays the last use). Called
    by whoever ended the run, once (`run_fail` and the compaction decide by a conditional
    update of the run). `active_seconds`: the provider's own measure, when it has one.
    False when the row is gone (deleted): nothing recorded it."""
    seconds = max((finished - started).total_seconds(), 0.0) if active_seconds is None else active_seconds
    # Both clocks move together, judged on the row as it was: expires_at = last_used + ttl.
    moves_forward = Q(status__in=LIVE_SESSION_STATUSES, expires_at__lt=finished + ttl)
    return bool(
        AgentSession.objects.filter(pk=session_id).update(
            active_seconds=F("active_seconds") + seconds,
            unbilled_active_seconds=F("unbilled_active_seconds") + seconds,
            last_used=Case(When(moves_forward, then=Value(finished)), default=F("last_used")),
            expires_at=Case(When(moves_forward, then=Value(finished + ttl)), default=F("expires_at")),
        )
    )


def alone_seconds(*, run_id, session_id, started: datetime, finished: datetime) -> float:
    """The part of a run's time (`started` to `finished`) when no other run of the session
    was in progress: what a summary written beside its heartbeats adds to the session's
    active time, so that time with both in progress is counted once. A run still in
    progress overlaps it up to `finished`."""
    others = (
        HeartbeatRun.objects.filter(session_id=session_id, started_at__lt=finished)
        .exclude(id=run_id)
        .exclude(finished_at__lte=started)
        .values_list("started_at", "finished_at")
    )
    overlap = sum(
        max((min(other_finished or finished, finished) - max(other_started, started)).total_seconds(), 0.0)
        for other_started, other_finished in others
    )
    return max((finished - started).total_seconds() - overlap, 0.0)
