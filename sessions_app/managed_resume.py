"""A Managed Agents turn whose worker died: continued by the next worker, never resent.

The turn runs at the provider whether or not our worker lives, so failing it when its
worker dies would throw away work the ledger must still account for, and a retry would
send the task again. Instead the reaper puts such a run in `resuming`, keeping its place in
flight, and the next worker continues it: it reads back what the remote session did since
the cursor the turn recorded before it sent anything (`ManagedSessionHandle.turn_started`),
sends the task only if it never arrived, bills only the requests not billed yet, and reads
on until the session is idle. A run resumed `MAX_RESUMES` times fails `run_timeout` as any
run that outlived its deadline: something beyond a dead worker is wrong.
"""

from __future__ import annotations

from datetime import datetime

from django.db import transaction

from costs_app.ledger import run_calls_numbered, spend_of
from sessions_app.models import HeartbeatRun, RunStatus
from sessions_app.run_queue import heartbeat_dispatch
from sessions_app.text import storable

MAX_RESUMES = 3


def resumable(run: HeartbeatRun) -> bool:
    """A running Managed Agents run whose turn recorded where it started."""
    turn = run.managed_turn or {}
    return bool(run.managed_session_id) and "cursor" in turn and int(turn.get("resume") or 0) < MAX_RESUMES


def run_resume(run: HeartbeatRun, *, now: datetime) -> bool:
    """Hand an overdue Managed Agents run to the next worker (see the module). Its calls so
    far are counted, so the next attempt numbers its rows after them. False when it was no
    longer running past its deadline (its worker finished after all)."""
    turn = run.managed_turn or {}
    with transaction.atomic():
        resumed = HeartbeatRun.objects.filter(id=run.id, status=RunStatus.RUNNING, deadline_at__lt=now).update(
            status=RunStatus.RESUMING,
            managed_turn=storable({**turn, "resume": int(turn.get("resume") or 0) + 1}),
            calls_before=run_calls_numbered(run_id=run.id),
            cost_usd=spend_of("run_id"),
            deadline_at=None,
            claimed_by="",
        )
        if resumed:
            heartbeat_dispatch(run=run)
    return bool(resumed)
