"""Approvals of Managed Agents tool calls: a turn that stops at a tool whose permission is
"always ask" waits `waiting_approval` for an operator, who approves or denies it (the API,
the admin); the next worker then continues the same turn. Nobody holds a transaction, a
row lock or a worker while the run waits.

- The run keeps its agent's one place in flight, so no other heartbeat sends a task to the
  remote session while it waits on a confirmation.
- What the turn streamed so far (its mirror, the requests it billed) is kept on the run
  (`managed_turn`), so the continued turn records the whole of it.
- A decision is taken by one conditional update: of two operators, or an operator and the
  expiry, exactly one wins; the loser is told the run no longer waits.
- Unanswered past `approval_timeout_minutes` the run fails `approval_expired` and the remote
  turn is interrupted, so the agent spends nothing more on it.
- A clear of the session's history, a delete or an operator's expiry of the session, and the
  agent's retirement end its waiting runs (`approvals_end`): the remote session they wait on
  ends with ours. (The TTL never expires a session whose run waits: it is in flight.)
- A decided run whose hand-off to the task queue failed or was lost keeps its decision; the
  maintenance pass hands it over again (`approvals_dispatch`), as it does lost queued runs.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import NamedTuple

from django.db.models import Q, QuerySet

from sessions_app.errors import QueueUnavailable, RunFailure
from sessions_app.managed_sessions import remote_turn_stop
from sessions_app.models import HeartbeatRun, RunStatus
from sessions_app.run_queue import heartbeat_dispatch, run_fail
from sessions_app.text import storable

logger = logging.getLogger(__name__)
DEFAULT_APPROVAL_TIMEOUT_MINUTES = 60
MAX_REASON_CHARS = 2000


class ApprovalRefused(RunFailure):
    """A decision that cannot be taken: the run does not wait for one (409), or the reason
    given is not one (400)."""

    def __init__(self, code: str, message: str, *, status: int = 409) -> None:
        super().__init__(code, message)
        self.status = status


def approval_timeout(config: dict) -> timedelta:
    return timedelta(minutes=int(config.get("approval_timeout_minutes") or DEFAULT_APPROVAL_TIMEOUT_MINUTES))


def approval_park(run: HeartbeatRun, *, state: dict, calls_numbered: int, cost_usd, now: datetime) -> bool:
    """The run waits for an operator: `waiting_approval`, keeping its place in flight, the
    turn so far and the calls it billed (numbered on after them when it continues), with
    no deadline (the reaper leaves it; the expiry ends it). False when it was no longer
    running (reaped meanwhile)."""
    return bool(
        HeartbeatRun.objects.filter(id=run.id, status=RunStatus.RUNNING).update(
            status=RunStatus.WAITING_APPROVAL,
            managed_turn=storable(state),
            approval_deadline_at=now + approval_timeout(run.agent.adapter_config),
            deadline_at=None,
            claimed_by="",
            calls_before=calls_numbered,
            cost_usd=cost_usd,
        )
    )


def approval_decide(run: HeartbeatRun, *, allow: bool, reason: str = "", by: str = "", now: datetime) -> HeartbeatRun:
    """Record an operator's decision on a waiting run and hand it to a worker, which sends
    the confirmation and continues the turn. Raises `ApprovalRefused` when the run does not
    wait for one (already decided, expired, or never waiting)."""
    if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS or "\x00" in reason:
        raise ApprovalRefused("invalid", f"reason must be text of at most {MAX_REASON_CHARS} characters.", status=400)
    state = dict(run.managed_turn or {})
    decision = {"result": "allow" if allow else "deny", "reason": reason, "by": by, "at": now.isoformat()}
    waiting = Q(id=run.id, status=RunStatus.WAITING_APPROVAL, approval_deadline_at__gt=now)
    # The decision is taken once: the row must still hold the turn as it was read, undecided.
    decided = HeartbeatRun.objects.filter(waiting, managed_turn__decision__isnull=True).update(
        managed_turn={**state, "decision": decision}
    )
    if not decided or "decision" in state:
        raise ApprovalRefused("run_not_waiting_approval", "The run does not wait for an approval (any more).")
    run.managed_turn = {**state, "decision": decision}
    try:
        heartbeat_dispatch(run=run)
    except Exception as exc:  # the broker (Redis, or the database queue) is down
        logger.exception("Could not hand decided run %s to the task queue", run.id)
        raise QueueUnavailable(
            "queue_unavailable",
            f"The task queue is unavailable; the decision on run {run.id} is recorded, and the run "
            "continues once the queue takes it (the maintenance pass hands it over).",
        ) from exc
    return run


class WaitEnd(NamedTuple):
    """Why a waiting turn ends with its session, in the code the docs give a turn cut off
    that way while the model answered, and what its run says."""

    code: str
    message: str


CLEARED = WaitEnd(
    "session_conflict",
    "The session's history was cleared while this turn waited for an approval: the turn ended with the "
    "cleared conversation and its remote session, and nothing more was sent.",
)
DELETED = WaitEnd(
    "session_deleted",
    "The session was deleted while this turn waited for an approval: the turn ended with it and its remote "
    "session, and nothing more was sent.",
)
AGENT_DELETED = WaitEnd(
    "agent_deleted",
    "The agent was deleted while this turn waited for an approval: the turn ended with it and its remote "
    "session, and nothing more was sent.",
)
EXPIRED = WaitEnd(
    "session_ended",
    "The session was expired while this turn waited for an approval: the turn ended with it and its remote "
    "session, and nothing more was sent.",
)


def approvals_end(*, runs: QuerySet[HeartbeatRun], why: WaitEnd, now: datetime) -> int:
    """Inside the transaction that clears, deletes or expires the runs' sessions (or retires
    their agent), the session rows locked: those of `runs` still waiting for an approval,
    decided or not (no worker has taken them), fail `why.code`. The remote session they wait
    on is ended after the COMMIT: a confirmation sent later would pay for the rest of a turn
    whose answer can never be kept. Ended in this transaction, a decision after it is refused
    as for any run that no longer waits, and a decided run's worker finds nothing to
    continue. The time each turn ran so far goes to its session's row, so the caller must
    call this before it bills the row (and, for a delete, before the row goes, or the time
    would be added to a row never billed); a run with no row (stateless) bills it at once.
    Nothing is sent to the provider here. Returns how many ended."""
    ended = 0
    for run in runs.filter(status=RunStatus.WAITING_APPROVAL).only("id", "managed_turn"):
        ended += run_fail(
            run,
            code=why.code,
            message=why.message,
            now=now,
            active_seconds=float((run.managed_turn or {}).get("active_seconds") or 0.0),
        )
    return ended


# Decided runs waiting for a worker are few and are claimed within seconds; a pass hands
# over at most this many (a second hand-off of one is harmless: only one claim succeeds).
DISPATCH_BATCH = 100


def approvals_dispatch() -> int:
    """Hand decided runs to the task queue again: one whose hand-off failed (the queue was
    down when the operator decided) or whose task was lost would otherwise wait for ever, as
    the expiry leaves decided runs alone."""
    decided = HeartbeatRun.objects.filter(
        status=RunStatus.WAITING_APPROVAL, managed_turn__decision__isnull=False
    ).select_related("agent")[:DISPATCH_BATCH]
    # Read to the end first: an enqueue on the database broker may close the connection
    # under a cursor still being read (CONN_MAX_AGE=0 on SQLite).
    runs = list(decided)
    for run in runs:
        heartbeat_dispatch(run=run)
    return len(runs)


def approval_pending(run: HeartbeatRun) -> dict | None:
    """What the API and the admin show of a run's approval: the tool calls waiting, until
    when, and the decision once taken; None for a run that never waited."""
    state = run.managed_turn
    if not state or "pending" not in state:
        return None
    return {
        "tool_calls": state.get("pending", []),
        "expires_at": run.approval_deadline_at.isoformat() if run.approval_deadline_at else None,
        "decision": state.get("decision"),
    }


def approvals_expire(*, now: datetime) -> int:
    """Fail the runs whose approval nobody gave in time (`approval_expired`), then interrupt
    their remote turns. The run's remote active time so far is its session's, or billed at
    once when no session row will record it (`run_fail`)."""
    due = HeartbeatRun.objects.filter(
        status=RunStatus.WAITING_APPROVAL, approval_deadline_at__lte=now, managed_turn__decision__isnull=True
    ).select_related("agent")[:100]
    expired = 0
    for run in due:
        state = run.managed_turn or {}
        seconds = float(state.get("active_seconds") or 0.0)
        if not run_fail(
            run,
            code="approval_expired",
            message="Nobody approved or denied the tool call in time (approval_timeout_minutes).",
            now=now,
            active_seconds=seconds,
        ):
            continue  # decided (or ended) meanwhile
        expired += 1
        remote_turn_stop(state.get("session", ""), why="its approval expired")
    return expired
