"""Maintenance: the time-driven state changes, each a set-based query on an indexed column.

Idle sessions are paused, stale ones expired and billed, dead runs reaped (and the Claude
Code processes their dead workers left), old histories purged, files no row names removed
(`sessions_app.orphan_files`), stuck queues re-dispatched,
budget pauses released and the model catalogue refreshed. Run every minute by the
`paperclip:maintenance` schedule (`sessions_app.tasks.maintenance`) and by
`manage.py expire_sessions`.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F

from costs_app.alerts import alert_deliveries_retry
from costs_app.catalogue import catalogue_refresh, catalogue_refresh_due
from costs_app.ledger import spend_of
from sessions_app.adapters.cli_processes import cli_orphans_kill
from sessions_app.agent_health import agents_health_check
from sessions_app.approvals import approvals_dispatch, approvals_expire
from sessions_app.batches import batches_poll
from sessions_app.cache_refresh import cache_refreshes_queue
from sessions_app.cli_transcripts import cli_sessions_delete
from sessions_app.managed_health import managed_health_check
from sessions_app.managed_resume import resumable, run_resume
from sessions_app.managed_sessions import (
    managed_ends_for_sessions,
    managed_ends_process,
    managed_orphans_end,
    remote_turn_stop,
)
from sessions_app.metering import session_hours_bill
from sessions_app.models import (
    ENDED_SESSION_STATUSES,
    IN_FLIGHT_RUN_STATUSES,
    LIVE_SESSION_STATUSES,
    Agent,
    AgentSession,
    AgentStatus,
    HeartbeatRun,
    HistoryStore,
    ManagedEndAction,
    PausedReason,
    RunStatus,
    SessionStatus,
)
from sessions_app.orphan_files import orphan_files_sweep
from sessions_app.run_queue import dispatch_waiting, run_fail
from sessions_app.schedules import schedules_arm_missing
from sessions_app.services import budgets_release
from sessions_app.stores import STORES

logger = logging.getLogger(__name__)
PURGE_BATCH = 500
BATCH = 5000


def in_use():
    """Sessions a run in flight (running, or submitted in a batch) is linked to. A heartbeat
    links its run before it touches the session, so there is no moment when a session is
    taken but not seen here."""
    return HeartbeatRun.objects.filter(status__in=IN_FLIGHT_RUN_STATUSES, session__isnull=False).values("session_id")


def sessions_expiry_set(*, now: datetime) -> int:
    """Live sessions inserted without `expires_at` (raw SQL) get it: their agent's TTL after
    their last use, so that the sweep expires them as any other. One UPDATE per agent with
    such rows; a heartbeat that took one meanwhile set it, and is left as it set it."""
    unset = AgentSession.objects.filter(status__in=LIVE_SESSION_STATUSES, expires_at__isnull=True)
    agent_ids = list(unset.order_by().values_list("agent_id", flat=True).distinct()[:BATCH])
    agents = Agent.objects.filter(pk__in=agent_ids).only("id", "adapter_config")
    return sum(
        unset.filter(agent_id=agent.pk).update(expires_at=F("last_used") + agent.session_ttl) for agent in agents
    )


def sessions_expire(*, now: datetime) -> int:
    """End live sessions unused past their TTL, and bill their active time. A session with
    a run in progress is never expired: its TTL counts from the end of the run."""
    stale = AgentSession.objects.filter(status__in=LIVE_SESSION_STATUSES, expires_at__lte=now).exclude(id__in=in_use())
    ids = list(stale.values_list("id", flat=True)[:BATCH])
    with transaction.atomic():
        # Conditional on what was seen: a heartbeat that took one meanwhile moved its
        # expires_at (and linked its run), so that session stays live.
        expired = (
            AgentSession.objects.filter(id__in=ids, status__in=LIVE_SESSION_STATUSES, expires_at__lte=now)
            .exclude(id__in=in_use())
            .update(status=SessionStatus.EXPIRED, ended_at=F("expires_at"), end_reason="ttl")
        )
        if expired:  # the remote sessions of those that expired are archived after the commit
            managed_ends_for_sessions(
                AgentSession.objects.filter(id__in=ids, status=SessionStatus.EXPIRED, end_reason="ttl").values_list(
                    "id", flat=True
                ),
                action=ManagedEndAction.ARCHIVE,
            )
        session_hours_bill(session_ids=ids, statuses=ENDED_SESSION_STATUSES, now=now)
    return expired


def sessions_pause_idle(*, now: datetime) -> int:
    """Pause active sessions idle past their pause_at, billing their active time.

    A running heartbeat holds its session's pause_at beyond the run's deadline, and its
    commit sets the session active again, so a pause racing a heartbeat loses nothing.
    """
    idle = AgentSession.objects.filter(status=SessionStatus.ACTIVE, pause_at__lte=now).exclude(id__in=in_use())
    ids = list(idle.values_list("id", flat=True)[:BATCH])
    with transaction.atomic():
        paused = (
            AgentSession.objects.filter(id__in=ids, status=SessionStatus.ACTIVE, pause_at__lte=now)
            .exclude(id__in=in_use())
            .update(status=SessionStatus.PAUSED, paused_at=now)
        )
        session_hours_bill(session_ids=ids, statuses=[SessionStatus.PAUSED], now=now)
    return paused


def sessions_bill_ended(*, now: datetime) -> int:
    """Bill ended sessions that still carry unbilled active time: a process that died
    between ending a session and billing it, or a row ended by raw SQL."""
    ids = AgentSession.objects.filter(unbilled_active_seconds__gt=0, status__in=ENDED_SESSION_STATUSES).values_list(
        "id", flat=True
    )
    return session_hours_bill(session_ids=list(ids[:BATCH]), now=now)


def runs_reap(*, now: datetime) -> list:
    """Fail runs left `running` past their deadline (a killed worker, a lost host), each
    with `run_fail`, so its session counts the run's time and its TTL from now, as after
    any failed run; a Managed Agents turn is resumed by the next worker instead
    (`sessions_app.managed_resume`). Returns the ids of agents whose queue can move again."""
    stuck = HeartbeatRun.objects.filter(status=RunStatus.RUNNING, deadline_at__lt=now).only(
        "id", "agent_id", "managed_session_id", "managed_turn"
    )
    stuck = list(stuck)
    # A Managed Agents turn goes on at the provider: the next worker continues it instead.
    stuck = [run for run in stuck if not (resumable(run) and run_resume(run, now=now))]
    reaped = set()
    for run in stuck:
        if run_fail(
            run,
            code="run_timeout",
            message="The run did not finish before its deadline; its worker was killed or stuck.",
            now=now,
            overdue=True,
            # Its calls were billed as each returned: the run shows what they cost.
            cost_usd=spend_of("run_id"),
        ):
            reaped.add(run.agent_id)
            # A turn given up on here may still be working at the provider, spending.
            remote_turn_stop(run.managed_session_id or "", why="its run was given up on")
    return sorted(reaped, key=str)


def cli_orphans_reap(*, now: datetime) -> int:
    """Kill the Claude Code processes on this host of runs whose worker died (a SIGKILL, a
    deploy: nobody else would stop them, and the CLI would go on calling the model) or whose
    run has ended (reaped while its worker hung). Returns how many runs' processes."""

    def ended(run_ids) -> set[str]:
        running = HeartbeatRun.objects.filter(id__in=list(run_ids), status=RunStatus.RUNNING)
        return set(run_ids) - {str(run_id) for run_id in running.values_list("id", flat=True)}

    return cli_orphans_kill(ended=ended)


def histories_purge(*, now: datetime) -> int:
    """Drop the turns of sessions that ended more than PAPERCLIP_RETENTION_DAYS ago.

    The row is marked purged (and committed) before its files go: a failed write leaves
    the history whole, and a file left after the COMMIT is never read (`FileStore.read`
    answers a purged session with nothing). A history file that cannot be deleted is
    logged and its mark taken back, so the next pass tries again; the others are purged.
    """
    cutoff = now - timedelta(days=settings.PAPERCLIP_RETENTION_DAYS)
    purged = 0
    failed: set = set()
    while True:
        batch = list(
            AgentSession.objects.filter(
                status__in=ENDED_SESSION_STATUSES, history_purged_at__isnull=True, ended_at__lt=cutoff
            )
            .exclude(id__in=failed)
            .order_by("ended_at")
            .only("id", "agent_id", "store", "cli_session_id")[:PURGE_BATCH]
        )
        if not batch:
            return purged
        with transaction.atomic():
            purged += AgentSession.objects.filter(
                id__in=[session.id for session in batch], history_purged_at__isnull=True
            ).update(history=[], history_purged_at=now)
            cli_sessions_delete([(session.agent_id, session.cli_session_id) for session in batch])
        for session in batch:
            if _history_file_stays(session):
                failed.add(session.id)
                purged -= AgentSession.objects.filter(pk=session.pk, history_purged_at=now).update(
                    history_purged_at=None
                )


def _history_file_stays(session: AgentSession) -> bool:
    """Delete the session's history file; True when it could not be, and is still whole
    (the row may then name it again)."""
    if session.store != HistoryStore.FILE:
        return False
    store = STORES[HistoryStore.FILE]
    try:
        store.delete(session)
    except OSError:
        stays = store.path_for(session).exists()
        logger.exception(
            "Could not delete the history file of session %s%s",
            session.public_id,
            "; retrying next pass" if stays else "",
        )
        return stays
    return False


def queues_unstick(*, agent_ids=None) -> int:
    """Dispatch the oldest queued run of agents with nothing running (lost tasks, reaped
    runs), oldest first and within PAPERCLIP_MAX_CONCURRENT_RUNS (`dispatch_waiting`)."""
    return dispatch_waiting(agent_ids=agent_ids)


def budget_pauses_release(*, now: datetime) -> int:
    """A new month (or a raised budget) lets agents paused by budget run again."""
    companies = Agent.objects.filter(status=AgentStatus.PAUSED, paused_reason=PausedReason.BUDGET).values_list(
        "company_id", flat=True
    )
    return sum(budgets_release(company_id=company_id, now=now) for company_id in set(companies))


def models_refresh(*, now: datetime) -> int | None:
    """Refresh the model catalogue from the Models API, at most once per
    PAPERCLIP_MODELS_REFRESH_MINUTES across every process (0: never). Returns the models
    stored, 0 when it was not this pass's turn, None when the refresh failed: logged, and
    the last catalogue is kept."""
    minutes = settings.PAPERCLIP_MODELS_REFRESH_MINUTES
    if not minutes or not catalogue_refresh_due(now=now, interval=timedelta(minutes=minutes)):
        return 0
    try:
        return catalogue_refresh(now=now)
    except Exception as exc:
        logger.warning(
            "The model catalogue could not be refreshed (%s: %s); the last one is kept", type(exc).__name__, exc
        )
        return None


MAINTENANCE_STEPS = {
    "expiry_set": sessions_expiry_set,
    "paused": sessions_pause_idle,
    "expired": sessions_expire,
    "billed": sessions_bill_ended,
    "reaped_agents": lambda *, now: len(runs_reap(now=now)),
    "cli_orphans_killed": cli_orphans_reap,
    "purged": histories_purge,
    "orphan_files": orphan_files_sweep,
    "unstuck": lambda *, now: queues_unstick(),
    "budget_resumed": budget_pauses_release,
    "alerts_queued": alert_deliveries_retry,
    "schedules_armed": schedules_arm_missing,
    "health_alerts": agents_health_check,
    "models_refreshed": models_refresh,
    "batches": lambda *, now: batches_poll(now=now),
    "cache_refreshes": cache_refreshes_queue,
    "approvals_expired": approvals_expire,
    "approvals_dispatched": lambda *, now: approvals_dispatch(),
    "managed_orphans": managed_orphans_end,
    "managed_health": managed_health_check,
    "managed_session_ends": managed_ends_process,
}


def maintenance_pass(*, now: datetime) -> dict:
    """Run every step; each is independent. A step that fails is logged, reported as None
    and rolled back alone, and the steps after it still run (a stuck file must not keep
    queues stuck or budget pauses in place)."""
    result = {}
    for name, step in MAINTENANCE_STEPS.items():
        try:
            # Inside a caller's transaction a failed step needs a savepoint to leave it usable.
            with transaction.atomic() if connection.in_atomic_block else nullcontext():
                result[name] = step(now=now)
        except Exception:
            logger.exception("Maintenance step %r failed; the other steps ran", name)
            result[name] = None
    return result
