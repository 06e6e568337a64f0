"""Time-driven state changes, each one set-based query on an indexed column.

Run every minute by the `maintenance` schedule and by `manage.py expire_sessions`.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F

from sessions_app.metering import session_hours_bill
from sessions_app.models import (
    LIVE_SESSION_STATUSES,
    AgentSession,
    HeartbeatRun,
    HistoryStore,
    RunStatus,
    SessionStatus,
)
from sessions_app.stores import STORES

PURGE_BATCH = 500
BATCH = 5000


def sessions_expire(*, now: datetime) -> int:
    """End live sessions unused past their TTL, and bill their active time. A heartbeat
    touches its session's expires_at before calling the model, so a session in use is
    not expired under it."""
    stale = AgentSession.objects.filter(status__in=LIVE_SESSION_STATUSES, expires_at__lte=now)
    ids = list(stale.values_list("id", flat=True)[:BATCH])
    expired = AgentSession.objects.filter(id__in=ids, status__in=LIVE_SESSION_STATUSES, expires_at__lte=now).update(
        status=SessionStatus.EXPIRED, ended_at=F("expires_at"), end_reason="ttl"
    )
    session_hours_bill(session_ids=ids, now=now)
    return expired


def sessions_pause_idle(*, now: datetime) -> int:
    """Pause active sessions idle past their pause_at, billing their active time.

    A running heartbeat holds its session's pause_at beyond the run's deadline, and its
    commit sets the session active again, so a pause racing a heartbeat loses nothing.
    """
    busy = HeartbeatRun.objects.filter(status=RunStatus.RUNNING, session__isnull=False).values("session_id")
    idle = AgentSession.objects.filter(status=SessionStatus.ACTIVE, pause_at__lte=now).exclude(id__in=busy)
    ids = list(idle.values_list("id", flat=True)[:BATCH])
    paused = AgentSession.objects.filter(id__in=ids, status=SessionStatus.ACTIVE, pause_at__lte=now).update(
        status=SessionStatus.PAUSED, paused_at=now
    )
    session_hours_bill(session_ids=ids, now=now)
    return paused


def runs_reap(*, now: datetime) -> list:
    """Fail runs left `running` past their deadline (a killed worker, a lost host).
    Returns the ids of agents whose queue can move again."""
    stuck = list(
        HeartbeatRun.objects.filter(status=RunStatus.RUNNING, deadline_at__lt=now).values_list("id", "agent_id")
    )
    if not stuck:
        return []
    HeartbeatRun.objects.filter(id__in=[run_id for run_id, _ in stuck], status=RunStatus.RUNNING).update(
        status=RunStatus.FAILED,
        error_code="run_timeout",
        error="The run did not finish before its deadline; its worker was killed or stuck.",
        finished_at=now,
    )
    return sorted({agent_id for _, agent_id in stuck}, key=str)


def histories_purge(*, now: datetime) -> int:
    """Drop the turns of sessions that ended more than PAPERCLIP_RETENTION_DAYS ago."""
    cutoff = now - timedelta(days=settings.PAPERCLIP_RETENTION_DAYS)
    purged = 0
    while True:
        batch = list(
            AgentSession.objects.filter(
                status__in=[SessionStatus.EXPIRED, SessionStatus.ENDED],
                history_purged_at__isnull=True,
                ended_at__lt=cutoff,
            )
            .order_by("ended_at")
            .only("id", "agent_id", "store")[:PURGE_BATCH]
        )
        if not batch:
            return purged
        for session in batch:
            if session.store == HistoryStore.FILE:
                STORES[HistoryStore.FILE].delete(session)
        purged += AgentSession.objects.filter(id__in=[s.id for s in batch]).update(history=[], history_purged_at=now)


def queues_unstick(*, agent_ids=None) -> int:
    """Dispatch the oldest queued run of agents with nothing running (lost tasks, reaped runs)."""
    from sessions_app.heartbeat import dispatch_next_queued

    waiting = HeartbeatRun.objects.filter(status=RunStatus.QUEUED)
    if agent_ids is not None:
        waiting = waiting.filter(agent_id__in=agent_ids)
    running = HeartbeatRun.objects.filter(status=RunStatus.RUNNING).values("agent_id")
    agents = set(waiting.exclude(agent_id__in=running).values_list("agent_id", flat=True).distinct())
    for agent_id in agents:
        dispatch_next_queued(agent_id=agent_id)
    return len(agents)


def budget_pauses_release(*, now: datetime) -> int:
    """A new month (or a raised budget) lets agents paused by budget run again."""
    from costs_app.budgets import budgets_release
    from sessions_app.models import Agent, AgentStatus

    companies = Agent.objects.filter(status=AgentStatus.PAUSED, paused_reason="budget").values_list(
        "company_id", flat=True
    )
    return sum(budgets_release(company_id=company_id, now=now) for company_id in set(companies))


def maintenance_pass(*, now: datetime) -> dict:
    paused = sessions_pause_idle(now=now)
    expired = sessions_expire(now=now)
    reaped_agents = runs_reap(now=now)
    purged = histories_purge(now=now)
    unstuck = queues_unstick()
    released = budget_pauses_release(now=now)
    return {
        "paused": paused,
        "expired": expired,
        "reaped_agents": len(reaped_agents),
        "purged": purged,
        "unstuck": unstuck,
        "budget_resumed": released,
    }
