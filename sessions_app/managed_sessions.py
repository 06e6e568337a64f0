"""The engine's side of `claude-managed` agents: the remote Managed Agents state kept in
this service's database, and the end of remote sessions.

- `ManagedSessionHandle` is what a run hands the runtime (`request.own_session`): the
  remote agent and the session the agent's live session maps to. The agent's remote ids
  and the run's session are written the moment the runtime learns them (outside any
  transaction: a single UPDATE), so a session the run made is never lost to a worker's
  death; the session row is mapped to it by the turn's commit.
- Ending or deleting a session here, or clearing its history, writes a `ManagedSessionEnd`
  in the same transaction; the remote session is archived or deleted after the COMMIT and
  retried by the maintenance pass until the provider confirms it; while a turn of ours is
  still on the remote session the end waits for it (interrupted), so that what the provider
  measured of the turn is read and billed. Our row and the remote session may disagree for
  a while, never for good, and never the other way round (a remote session ended while our
  row still resumes it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta
from decimal import Decimal

from django.db import transaction
from django.db.models import Case, F, Q, TextField, Value, When
from django.db.models.functions import Concat
from django.utils import timezone

from sessions_app.adapters.claude_managed import OutputsUnavailable
from sessions_app.errors import RunAbandoned
from sessions_app.hot_sql import rows_insert_ignoring_conflicts
from sessions_app.managed_health import lost_session_note, managed_health_state
from sessions_app.managed_outputs import outputs_extract
from sessions_app.metering import session_hours_bill, unrecorded_time_bill
from sessions_app.models import (
    HOLDS_AGENT_PLACE,
    LIVE_SESSION_STATUSES,
    Agent,
    AgentSession,
    HeartbeatRun,
    ManagedEndAction,
    ManagedSessionEnd,
    RunStatus,
)
from sessions_app.text import storable

logger = logging.getLogger(__name__)
TASK = "sessions_app.tasks.managed_ends"
BATCH = 100
# A claimed end is someone's for this long; a worker that died with it leaves it to the next pass.
CLAIM_LEASE = timedelta(minutes=5)
MAX_RETRY_WAIT = timedelta(hours=1)
ORPHAN_WINDOW = timedelta(days=1)
# An end put off for a turn of ours still on its remote session looks again this soon: the
# interrupted turn ends within seconds, and the reaper ends a run whose worker is gone.
RUN_WAIT = timedelta(minutes=1)
# Runs a worker holds or will continue (waiting for an approval ends with the session).
TURN_IN_FLIGHT = (RunStatus.RUNNING, RunStatus.RESUMING)
CENT = Decimal("0.01")


class ManagedSessionHandle:
    """The run's handle on its agent's remote state (the runtime's `ManagedSessions`)."""

    def __init__(self, session: AgentSession | None, *, agent: Agent, run: HeartbeatRun, lost_note: str = "") -> None:
        self.session = session
        self.lost_note = lost_note
        self.agent = agent
        self.run = run
        self.resumed_id = (session.managed_session_id or "") if session is not None else ""
        self.persistent = agent.is_persistent
        # A turn that goes on: one an operator decided on, or one whose worker died.
        turn = run.managed_turn or {}
        self.continuation = turn if "decision" in turn or turn.get("resume") else None
        self.turn_begun = False

    def remote(self) -> dict | None:
        return self.agent.managed_remote

    def handoff_note(self) -> str:
        """What a new remote session replacing a lost one opens with: the note the plan
        made (the health check found it lost), or one made now from the resumed row (the
        run found it lost). Nothing for a row whose history was cleared: the operator asked
        for a session that starts empty."""
        if self.lost_note or self.session is None:
            return self.lost_note
        if not self.resumed_id and not self.session.message_count:
            return ""
        return lost_session_note(self.session)

    def remote_record(self, remote: dict) -> None:
        Agent.objects.filter(pk=self.agent.pk).update(managed_remote=remote)
        self.agent.managed_remote = remote

    def turn_started(self, state: dict) -> None:
        HeartbeatRun.objects.filter(pk=self.run.pk).update(
            managed_turn=storable(state), managed_session_id=state["session"]
        )
        self.run.managed_turn = state
        self.run.managed_session_id = state["session"]
        self.turn_begun = True

    def session_end_later(self, remote_session_id: str) -> None:
        session_id = self.session.pk if self.session is not None and remote_session_id == self.resumed_id else None
        managed_ends_record(
            [(remote_session_id, self.agent.pk, session_id)],
            action=ManagedEndAction.ARCHIVE,
            company_id=self.agent.company_id,
        )

    def turn_time(self, seconds: float) -> None:
        """A finished turn's remote active time, which session hours are billed on. A
        persistent session's commit records it on the row (or, when the commit fails, the
        run's failure does: `run_fail`); a stateless run's commit records no time, so it is
        billed now. A failed turn's goes with its failure to `run_fail`."""
        if not self.persistent:
            unrecorded_time_bill(
                company_id=self.agent.company_id, agent_id=self.agent.pk, seconds=seconds, at=timezone.now()
            )

    def list_cost_check(self, report: dict, cost: Decimal | None) -> None:
        """Before the commit (a failed commit keeps the warning on the failed run)."""
        if disagreement := list_cost_disagreement(report, cost):
            logger.warning("Managed Agents session %s: %s", report.get("managed_session_id"), disagreement)
            run_warning_add(self.run.pk, disagreement)

    def on_commit(self, *, remote_session_id: str):
        """Inside the heartbeat's commit, the session row names a remote session the turn
        made; a nothing-to-do answer on one leaves it to be archived (no row names it). A
        stateless run's session ends with it (recorded by the adapter), and a turn that
        went to the session already named needs nothing: None, so the commit takes the
        path of a plain turn (one statement on PostgreSQL)."""
        if not self.persistent or remote_session_id == self.resumed_id:
            return None

        def commit(session: AgentSession | None, cost: Decimal | None) -> None:
            if session is None:
                managed_ends_record(
                    [(remote_session_id, self.agent.pk, None)],
                    action=ManagedEndAction.ARCHIVE,
                    company_id=self.agent.company_id,
                )
            elif session.managed_session_id != remote_session_id:
                _never_an_ended_session(remote_session_id)
                AgentSession.objects.filter(pk=session.pk).update(managed_session_id=remote_session_id)
                session.managed_session_id = remote_session_id

        return commit


def _never_an_ended_session(remote_session_id: str) -> None:
    """A row is never mapped to a remote session ended here: naming it again would hand
    whatever ended it back to the next heartbeat. A turn's session has an end only when its
    session ended here while the turn went on without a worker holding the session (one
    resumed after its worker died, an approved one not yet continued) and the turn's
    worker then found no live session to take, or the row with its history cleared. The
    failure says which, in the code the docs give a turn cut off that way."""
    ends = list(
        ManagedSessionEnd.objects.filter(remote_session_id=remote_session_id).values_list("action", "session_id")
    )
    if not ends:
        return
    kept = "its remote session ended with it, and the answer is not kept."
    session_ids = [session_id for _, session_id in ends if session_id is not None]
    row = AgentSession.objects.filter(pk__in=session_ids).values("status", "managed_session_id").first()
    if any(action == ManagedEndAction.DELETE for action, _ in ends) or (session_ids and row is None):
        raise RunAbandoned("session_deleted", f"The session was deleted while this turn went on: {kept}")
    if (
        row is not None
        and row["managed_session_id"] == remote_session_id
        and row["status"] not in LIVE_SESSION_STATUSES
    ):
        # A clear forgets the mapping; a row that still names the remote session ended with it.
        raise RunAbandoned("session_ended", f"The session was {row['status']} while this turn went on: {kept}")
    if row is not None and row["managed_session_id"] != remote_session_id:
        raise RunAbandoned(
            "session_conflict",
            "The session's history was cleared while this turn went on: its remote session ended "
            "with the cleared turns, and the answer is not kept.",
        )
    raise RunAbandoned(
        "session_conflict",
        "The remote session this turn went on was ended while it went on, and the answer is not kept.",
    )


def list_cost_disagreement(report: dict, cost: Decimal | None) -> str:
    """The service's own list cost of the turn beside the ledger's: what to say when they
    differ by more than 1% ("" when they agree). The service counts whole cents, so a
    turn's figure (the difference of two totals) is exact only to a cent."""
    theirs = report.get("list_cost_turn_usd")
    if cost is None or theirs is None:
        return ""
    theirs = Decimal(theirs)
    if abs(theirs - cost) <= max(max(cost, theirs) / 100, CENT):
        return ""
    return f"the session reported a list cost of ${theirs} for this turn; the ledger priced it at ${cost}"


def run_warning_add(run_id, warning: str) -> None:
    """Add `warning` to the run's (a budget's may be there already), shown in the admin and the API."""
    HeartbeatRun.objects.filter(pk=run_id).update(
        warning=Case(
            When(warning="", then=Value(warning)),
            default=Concat(F("warning"), Value(f"; {warning}"), output_field=TextField()),
            output_field=TextField(),
        )
    )


def remote_turn_stop(remote_session_id: str, *, why: str) -> None:
    """Interrupt a remote turn whose run has ended here (an approval that expired, a turn
    resumed too often), so the session spends nothing more on it; a failure is logged (the
    session's end, when it comes, stops it for good)."""
    from sessions_app.adapters.claude_managed import remote_turn_interrupt

    if remote_session_id and (problem := remote_turn_interrupt(remote_session_id)):
        logger.warning(
            "Could not interrupt the turn of Managed Agents session %s (%s): %s", remote_session_id, why, problem
        )


# --- ending remote sessions ------------------------------------------------------------------


def managed_ends_record(ends: Iterable[tuple[str, object, object]], *, action: str, company_id) -> int:
    """Record remote sessions `(remote_id, agent_id, session_id)` to end, in the caller's
    transaction; they are carried out after its COMMIT. Recording one twice is harmless."""
    rows = [
        ManagedSessionEnd(
            remote_session_id=remote_id, action=action, company_id=company_id, agent_id=agent_id, session_id=session_id
        )
        for remote_id, agent_id, session_id in ends
        if remote_id
    ]
    if not rows:
        return 0
    rows_insert_ignoring_conflicts(rows)
    transaction.on_commit(managed_ends_enqueue)
    return len(rows)


# What a session row knows of the remote session it maps to: the mapping, and the health
# check's readings of it (`sessions_app.managed_health`).
REMOTE_SESSION_FIELDS = (
    "managed_session_id",
    "managed_checked_at",
    "managed_problem",
    "managed_check_failures",
    "managed_lost_at",
)


def managed_session_clear(session: AgentSession, *, now: datetime) -> list[str]:
    """Inside the transaction that clears `session`'s history, its row locked: the remote
    session it maps to holds every cleared turn, so it ends as any ended session's does
    (archived after the COMMIT, its files copied first; the hours it was active billed) and
    the row forgets it, with what was read of it. The next heartbeat opens a new one.
    Returns the fields to save ([] for a row that maps none)."""
    if not session.managed_session_id:
        return []
    managed_ends_for_sessions([session.pk], action=ManagedEndAction.ARCHIVE)
    session_hours_bill(session_ids=[session.pk], now=now)
    for name in REMOTE_SESSION_FIELDS:
        setattr(session, name, None)
    return list(REMOTE_SESSION_FIELDS)


def managed_ends_for_sessions(session_ids: Iterable, *, action: str) -> int:
    """Record the end of the remote sessions that these sessions (being ended or deleted in
    the caller's transaction) map to."""
    mapped = list(
        AgentSession.objects.filter(id__in=list(session_ids))
        .filter(managed_session_id__isnull=False)
        .values_list("company_id", "managed_session_id", "agent_id", "id")
    )
    by_company: dict = {}
    for company_id, remote_id, agent_id, session_id in mapped:
        by_company.setdefault(company_id, []).append((remote_id, agent_id, session_id))
    return sum(managed_ends_record(ends, action=action, company_id=company) for company, ends in by_company.items())


def managed_ends_enqueue() -> None:
    from django_q.tasks import async_task

    try:
        async_task(TASK, task_name="managed session ends")
    except Exception:
        # The maintenance pass carries out what is recorded; a lost enqueue only delays it.
        logger.exception("Could not enqueue the end of Managed Agents sessions")


def managed_ends_process(*, now: datetime) -> int:
    """Carry out the recorded ends that are due, each claimed by one worker (a conditional
    update of its next attempt), and return how many the provider confirmed. A session the
    provider no longer knows is ended; a failure is kept on the row and retried later."""
    due = list(
        ManagedSessionEnd.objects.filter(done_at__isnull=True, next_attempt_at__lte=now)
        .order_by("next_attempt_at")
        .values_list("id", "next_attempt_at")[:BATCH]
    )
    done = 0
    for end_id, seen in due:
        lease = now + CLAIM_LEASE
        if not ManagedSessionEnd.objects.filter(id=end_id, next_attempt_at=seen, done_at__isnull=True).update(
            next_attempt_at=lease
        ):
            continue  # another worker has it
        end = ManagedSessionEnd.objects.get(id=end_id)
        done += managed_end_carry_out(end, now=now, lease=lease)
    return done


def managed_end_carry_out(end: ManagedSessionEnd, *, now: datetime, lease: datetime) -> int:
    """Copy the session's outputs here, then archive or delete it: a session whose files
    could not all be read is not ended (its files would go with it). Each write is made
    only while the claim (`lease`, the attempt time it set) is still this worker's."""
    from sessions_app.adapters.claude_managed import remote_session_end

    if (run_id := _turn_in_flight(end)) is not None:
        return _end_put_off(end, run_id=run_id, now=now, lease=lease)
    try:
        outputs_extract(end)
    except (OutputsUnavailable, OSError) as unavailable:  # the provider, or our disk
        problem = str(unavailable)
    else:
        # A long copy can outlast the lease, and another worker then claims the end and
        # carries it out: renewed only if still ours, or the end is left to that worker.
        if (lease := _lease_renew(end.id, lease=lease, now=now)) is None:
            return 0
        problem = remote_session_end(end.remote_session_id, action=end.action)
    ours = ManagedSessionEnd.objects.filter(id=end.id, next_attempt_at=lease, done_at__isnull=True)
    if problem is None:
        return ours.update(done_at=now, attempts=end.attempts + 1, last_error="")
    wait = min(timedelta(minutes=2**end.attempts), MAX_RETRY_WAIT)
    ours.update(attempts=end.attempts + 1, last_error=problem[:2000], next_attempt_at=now + wait)
    logger.warning("Could not %s Managed Agents session %s: %s", end.action, end.remote_session_id, problem)
    return 0


def _turn_in_flight(end: ManagedSessionEnd):
    """The run of ours whose turn is still on the remote session, if any: its agent's one run
    in flight, found through an index on the agent (`runs_one_running_per_agent`'s, or the
    agent's runs), never by reading the whole runs table. An end whose agent is gone has none."""
    if end.agent_id is None:
        return None
    return (
        HeartbeatRun.objects.filter(
            HOLDS_AGENT_PLACE,
            agent_id=end.agent_id,
            managed_session_id=end.remote_session_id,
            status__in=TURN_IN_FLIGHT,
        )
        .values_list("id", flat=True)
        .first()
    )


def _end_put_off(end: ManagedSessionEnd, *, run_id, now: datetime, lease: datetime) -> int:
    """Ending the remote session under a turn of ours would lose what the provider measured
    of that turn (its worker reads the session's usage after the turn, and a deleted session
    answers 404), so the turn is interrupted, once, to stop its spending, and the end waits
    for its worker to read the usage and bill it. Waiting is no failure: neither the attempts
    nor the backoff grow. The wait is bounded by the run's: the reaper ends a run past its
    deadline, and then the end goes ahead."""
    waiting = f"Waits for run {run_id}, whose turn is still on this session."
    if end.last_error != waiting:
        remote_turn_stop(end.remote_session_id, why=f"its session ended while run {run_id} went on")
    ManagedSessionEnd.objects.filter(id=end.id, next_attempt_at=lease, done_at__isnull=True).update(
        last_error=waiting, next_attempt_at=now + RUN_WAIT
    )
    return 0


def _lease_renew(end_id, *, lease: datetime, now: datetime) -> datetime | None:
    """The claim's new attempt time, a lease from now; None when the claim is no longer this
    worker's (another claimed the end after the lease ran out)."""
    renewed = max(now, timezone.now()) + CLAIM_LEASE
    claim = ManagedSessionEnd.objects.filter(id=end_id, next_attempt_at=lease, done_at__isnull=True)
    return renewed if claim.update(next_attempt_at=renewed) else None


def managed_orphans_end(*, now: datetime) -> int:
    """Remote sessions made by runs that ended without a session row naming them (a worker
    killed before its commit): archived, as a failed turn's session is."""
    named = AgentSession.objects.filter(managed_session_id__isnull=False).values("managed_session_id")
    ended = ManagedSessionEnd.objects.values("remote_session_id")
    orphans = (
        HeartbeatRun.objects.filter(managed_session_id__isnull=False)
        # A run's remote session is recorded on it as it ends, or not at all: older runs are settled.
        .filter(finished_at__gte=now - ORPHAN_WINDOW, finished_at__lte=now)
        .exclude(Q(managed_session_id__in=named) | Q(managed_session_id__in=ended))
        .values_list("company_id", "managed_session_id", "agent_id")[:BATCH]
    )
    count = 0
    with transaction.atomic():
        for company_id, remote_id, agent_id in orphans:
            count += managed_ends_record(
                [(remote_id, agent_id, None)], action=ManagedEndAction.ARCHIVE, company_id=company_id
            )
    return count


def managed_state() -> dict:
    """What /api/health shows: remote sessions still to end, and those whose end the
    provider refused at least once (both read the pending index, normally empty); live
    sessions whose remote session is lost or was unreachable at its last check."""
    pending = ManagedSessionEnd.objects.filter(done_at__isnull=True)
    return {
        "ends_pending": pending.count(),
        "ends_failing": pending.filter(attempts__gt=0).count(),
        **managed_health_state(),
    }
