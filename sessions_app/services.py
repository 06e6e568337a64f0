"""Operations that span models or leave the process (files, the task queue).

The API, the admin (including its bulk actions, which bypass Model.delete()), the
management commands and the scheduled tasks all call these, so each has one behaviour.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from costs_app.alerts import budget_alerts_fire
from costs_app.budgets import budget_uses, budgets_lock, budgets_releasable, crossed_scopes
from memory_app.stores import agent_memory_delete
from sessions_app.agent_files import agents_folders_remove_after_commit
from sessions_app.approvals import AGENT_DELETED, CLEARED, DELETED, EXPIRED, WaitEnd, approvals_end
from sessions_app.cli_transcripts import cli_sessions_delete
from sessions_app.managed_outputs import outputs_delete
from sessions_app.managed_sessions import managed_ends_for_sessions, managed_session_clear
from sessions_app.metering import session_hours_bill
from sessions_app.models import (
    LIVE_SESSION_STATUSES,
    UNFINISHED_RUN_STATUSES,
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
from sessions_app.schedules import agent_schedule_sync
from sessions_app.stores import NOTHING_STAGED, STORES, store_for

logger = logging.getLogger(__name__)


def _delete_history_files(rows: list[tuple]) -> None:
    for session_id, agent_id, store, *_ in rows:
        if store != HistoryStore.FILE:
            continue
        session = AgentSession(id=session_id, agent_id=agent_id, store=store)
        try:
            STORES[HistoryStore.FILE].delete(session)
        except OSError:
            # The row is already gone; an orphaned file is harmless to the service and
            # is reported so an operator can remove it.
            logger.exception("Could not delete the history file of session %s", session.public_id)


def sessions_delete(*, sessions: QuerySet[AgentSession], now: datetime) -> int:
    """Delete sessions and their histories (rows, and files after the commit)."""
    with transaction.atomic():
        # Locked first: a heartbeat committing its turn holds the row, and the transcript
        # lines it writes are read (and deleted) only once it has committed.
        locked = AgentSession.objects.select_for_update().filter(id__in=sessions.values("id")).order_by("pk")
        rows = list(locked.values_list("id", "agent_id", "store", "cli_session_id"))
        session_ids = [row[0] for row in rows]
        # Claude Code transcripts: their rows go with this transaction, files after it.
        cli_sessions_delete([(agent_id, cli_id) for _, agent_id, _, cli_id in rows])
        # Managed Agents sessions deleted at the provider after this commit; the time already
        # spent billed while the rows still exist.
        _sessions_end_here(session_ids, action=ManagedEndAction.DELETE, why=DELETED, now=now)
        count, _ = AgentSession.objects.filter(id__in=session_ids).delete()
        transaction.on_commit(lambda: _delete_history_files(rows))
    return count


def session_delete(*, session: AgentSession, now: datetime) -> None:
    sessions_delete(sessions=AgentSession.objects.filter(pk=session.pk), now=now)


def session_expire(*, session: AgentSession, now: datetime) -> bool:
    """Expire one live session now and bill its active time. False when it was no longer
    live (raced). A heartbeat that read it just before cannot resume it: its take is
    conditional on the session still being live."""
    with transaction.atomic():
        updated = AgentSession.objects.filter(pk=session.pk, status__in=LIVE_SESSION_STATUSES).update(
            status=SessionStatus.EXPIRED, expires_at=now, ended_at=now, end_reason="expired_by_operator"
        )
        if updated:
            # The TTL skips a session whose turn waits for an approval; an operator does not.
            _sessions_end_here([session.pk], action=ManagedEndAction.ARCHIVE, why=EXPIRED, now=now)
        else:
            session_hours_bill(session_ids=[session.pk], now=now)  # ended by another: what it left
    return bool(updated)


def _sessions_end_here(session_ids: list, *, action: str, why: WaitEnd, now: datetime) -> None:
    """Inside the transaction that ends these sessions here (their rows locked or just
    updated): their turns waiting for an approval end with them, their remote sessions are
    recorded to end at the provider after the COMMIT, and their active time is billed. The
    bill comes last: a waiting turn's time so far goes to its row, which the bill reads."""
    approvals_end(runs=HeartbeatRun.objects.filter(session_id__in=session_ids), why=why, now=now)
    managed_ends_for_sessions(session_ids, action=action)
    session_hours_bill(session_ids=session_ids, now=now)


def session_clear_history(*, session: AgentSession, now: datetime | None = None) -> bool:
    """Empty a session's history but keep its row (and its place in the ledger). False when
    the session was deleted since it was read (nothing to clear)."""
    now = now or timezone.now()
    staged = NOTHING_STAGED
    try:
        # Durable: its end is the COMMIT, and the empty history is published only after it.
        with transaction.atomic(durable=True):
            # The old turns are never read: only the row is locked and replaced.
            locked = AgentSession.objects.select_for_update().defer("history").filter(pk=session.pk).first()
            if locked is None:
                return False
            staged = store_for(locked).stage(locked, [])
            # A Claude Code transcript is the history its CLI resumes from: it goes with the
            # turns (its rows now, its files after the COMMIT), and the next heartbeat
            # starts a CLI session of its own.
            cli_sessions_delete([(locked.agent_id, locked.cli_session_id)])
            locked.cli_session_id, locked.cli_transcript_sizes = "", None
            # A Managed Agents session holds the whole conversation at the provider: it goes too,
            # and so do the turns waiting there for an approval (their time billed with the row's).
            approvals_end(runs=HeartbeatRun.objects.filter(session_id=locked.pk), why=CLEARED, now=now)
            remote_fields = managed_session_clear(locked, now=now)
            locked.message_count = 0
            locked.last_input_tokens = None
            locked.save(
                update_fields=[
                    "message_count",
                    "last_input_tokens",
                    "cli_session_id",
                    "cli_transcript_sizes",
                    *remote_fields,
                    *staged.fields,
                ]
            )
    except BaseException:
        staged.discard()
        raise
    staged.publish()
    return True


def agent_pause(*, agent: Agent, reason: str = PausedReason.MANUAL) -> bool:
    """Pause the agent if it is active. True when this paused it; an agent paused already,
    or retired, is left as it is."""
    paused = Agent.objects.filter(pk=agent.pk, status=AgentStatus.ACTIVE).update(
        status=AgentStatus.PAUSED, paused_reason=reason
    )
    agent.refresh_from_db(fields=["status", "paused_reason"])
    agent_schedule_sync(agent=agent)
    return bool(paused)


def agent_resume(*, agent: Agent) -> bool:
    """Resume the agent if it is paused. True when this resumed it; an agent active
    already, or retired, is left as it is."""
    resumed = Agent.objects.filter(pk=agent.pk, status=AgentStatus.PAUSED).update(
        status=AgentStatus.ACTIVE, paused_reason=""
    )
    agent.refresh_from_db(fields=["status", "paused_reason"])
    agent_schedule_sync(agent=agent)
    return bool(resumed)


def budgets_enforce(*, agent: Agent, now: datetime) -> bool:
    """Pause the agents a spent monthly or lifetime limit covers: the agent, or every
    active agent of its company for a company limit. True when any limit is spent.
    The thresholds the agent's limits reached fire their alerts (costs_app.alerts)."""
    with transaction.atomic():
        # The read and the pause under the lock a release takes too: a budget raised before
        # it is read here, and one raised after waits for the pause to commit and then
        # releases it (without the lock its release could run between the read and the
        # pause, find nobody paused, and leave the agent paused until the maintenance pass).
        budgets_lock(company_id=agent.company_id)
        uses = budget_uses(company_id=agent.company_id, agent_id=agent.id, now=now)
        crossed = crossed_scopes(uses)
        if crossed:
            targets = Agent.objects.filter(status=AgentStatus.ACTIVE)
            if "company" in crossed:
                targets = targets.filter(company_id=agent.company_id)
            else:
                targets = targets.filter(id=agent.id)
            for target in targets:
                agent_pause(agent=target, reason=PausedReason.BUDGET)
    # Thresholds crossed are announced (once per period) whether or not anyone is paused,
    # after the lock: a delivery's hand-off to the task queue holds no reservation back.
    budget_alerts_fire(uses=uses, now=now)
    return bool(crossed)


def budgets_release(*, company_id, now: datetime) -> int:
    """Resume the company's agents paused by budget that no limit holds back any more
    (a budget raised or removed, a new month). Returns how many were resumed."""
    with transaction.atomic():
        # Waits for a pause for budget under way (`budgets_enforce`), so its agents are seen.
        budgets_lock(company_id=company_id)
        paused = list(
            Agent.objects.filter(company_id=company_id, status=AgentStatus.PAUSED, paused_reason=PausedReason.BUDGET)
        )
        released = set(budgets_releasable(company_id=company_id, agent_ids=[agent.id for agent in paused], now=now))
        for agent in paused:
            if agent.id in released:
                agent_resume(agent=agent)
    return len(released)


def budget_changed_release(sender, *, company_id, now: datetime, **kwargs) -> None:
    """costs_app's `budget_changed`: a raised or removed budget resumes the agents it paused."""
    budgets_release(company_id=company_id, now=now)


def agent_delete(*, agent: Agent, now: datetime) -> None:
    """Retire an agent: it disappears from the API, its sessions and their histories are
    deleted, so is its memory (memory_app), queued runs are failed, its schedule is removed,
    and its folders (its workspace among them) go after the COMMIT (`agent_files`). The
    agent row, its runs and its cost events stay: they are the record of what was done and
    spent."""
    with transaction.atomic():
        Agent.objects.filter(pk=agent.pk).update(status=AgentStatus.DELETED, deleted_at=now, paused_reason="")
        HeartbeatRun.objects.filter(agent=agent, status=RunStatus.QUEUED).update(
            status=RunStatus.FAILED, error_code="agent_deleted", error="The agent was deleted.", finished_at=now
        )
        # Said as the agent's end, before its sessions go (their rows take the turns' time);
        # a stateless turn's, with no row, is billed at once, and its remote session archived
        # by the maintenance pass as any ended run's that no row names.
        approvals_end(runs=HeartbeatRun.objects.filter(agent=agent), why=AGENT_DELETED, now=now)
        sessions_delete(sessions=AgentSession.objects.filter(agent=agent), now=now)
        agent_memory_delete(agent_ids=[agent.pk])
        outputs_delete(agent_ids=[agent.pk])
        agents_folders_remove_after_commit([agent.pk])
    agent.refresh_from_db(fields=["status", "deleted_at", "paused_reason"])
    agent_schedule_sync(agent=agent)


def agents_hard_delete(*, agents: QuerySet[Agent], now: datetime) -> int:
    """Remove agents entirely (admin): their sessions' files and their folders go too
    (`agent_files`). The ledger stays."""
    with transaction.atomic():
        agent_ids = list(agents.values_list("id", flat=True))
        sessions_delete(sessions=AgentSession.objects.filter(agent_id__in=agent_ids), now=now)
        outputs_delete(agent_ids=agent_ids)
        count, _ = Agent.objects.filter(id__in=agent_ids).delete()
        agents_folders_remove_after_commit(agent_ids)
    for agent_id in agent_ids:
        agent_schedule_sync(agent=Agent(id=agent_id, status=AgentStatus.DELETED))
    return count


__all__ = [
    "UNFINISHED_RUN_STATUSES",
    "agent_delete",
    "agent_pause",
    "agent_resume",
    "agents_hard_delete",
    "budgets_enforce",
    "budgets_release",
    "session_clear_history",
    "session_delete",
    "session_expire",
    "sessions_delete",
]
