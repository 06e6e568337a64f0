"""Time-driven state changes, each one set-based query on an indexed column.

Run every minute by the `maintenance` schedule and by `manage.py expire_sessions`.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F

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


def sessions_expire(*, now: datetime) -> int:
    """End live sessions unused past their TTL. A heartbeat touches its session's
    expires_at before calling the model, so a session in use is not expired under it."""
    return AgentSession.objects.filter(status__in=LIVE_SESSION_STATUSES, expires_at__lte=now).update(
        status=SessionStatus.EXPIRED, ended_at=F("expires_at"), end_reason="ttl"
    )


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


def maintenance_pass(*, now: datetime) -> dict:
    expired = sessions_expire(now=now)
    reaped_agents = runs_reap(now=now)
    purged = histories_purge(now=now)
    unstuck = queues_unstick()
    return {"expired": expired, "reaped_agents": len(reaped_agents), "purged": purged, "unstuck": unstuck}
