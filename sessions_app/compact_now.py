"""Compact now: summarise a live session at once, from the API or the admin.

It runs as a run of the agent, so the rules of a heartbeat's compaction hold unchanged:
- one writer per session: the index that allows one `running` run per agent refuses it
  while a heartbeat runs (`session_busy`), and a heartbeat arriving meanwhile stays
  queued and is dispatched when the compaction ends, so no turn is lost; a scheduled tick
  is never counted on the compaction's run (`tick_merge`), it queues its own. A summary a
  commit asked for (`session_compact_ahead`) is written beside the heartbeats instead and
  takes the agent's place only to commit (`agent_place_take`);
- the summary is reserved against the budgets before it is sent and billed to the
  ledger under the run (kind `compaction`); the record is the heartbeat's own
  (`compaction_commit`), and a summary that does not shrink the session is refused the
  same way (`compaction_not_shrinking`).
"""

from __future__ import annotations

import time
from datetime import datetime

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from costs_app.budgets import BudgetExceeded, budgets_exist
from paperclip.errors import RunFailure
from sessions_app.adapters import get_adapter
from sessions_app.adapters.base import QuotaRefused
from sessions_app.compaction import compaction_commit, compaction_refused, summary_call, summary_not_shrinking
from sessions_app.context import choose_split, estimate_tokens, history_problem, summary_pair
from sessions_app.errors import StepFailed
from sessions_app.heartbeat import ClaimedRun, Reservation, RunClock, config_invalid_message
from sessions_app.metering import alone_seconds, session_run_time_record
from sessions_app.models import (
    Agent,
    AgentSession,
    BesideState,
    HeartbeatRun,
    RunStatus,
    RunTrigger,
    SessionCompaction,
)
from sessions_app.no_work import run_skip
from sessions_app.quota import quota_refused
from sessions_app.run_queue import COMPACT_TASK, dispatch_after_run, run_deadline, run_fail, run_place_free, worker_id
from sessions_app.services import budgets_enforce
from sessions_app.stores import store_for

# How often a summary waiting for its agent's place looks again, doubling up to the most.
PLACE_POLL_FIRST_SECONDS = 0.02
PLACE_POLL_MAX_SECONDS = 0.5


class CompactRefused(RunFailure):
    """The session cannot be compacted now; `code` maps to an API status."""


class SessionMoved(CompactRefused):
    """The session is no longer as the commit that asked for its summary left it: the
    summary it asked for is not needed, or would summarise another session."""

    def __init__(self) -> None:
        super().__init__("session_changed", "The session changed since the commit that asked for its summary.")


def session_compact(
    *,
    session: AgentSession,
    now: datetime,
    keep_recent_turns: int | None = None,
    trigger: str = RunTrigger.API,
    seen: tuple[int, int] | None = None,
) -> SessionCompaction:
    """Summarise the session's older turns now, keeping the last `keep_recent_turns` (the
    agent's setting when not given) verbatim. Returns the compaction record. With `seen`
    (its message and compaction counts), only a session still so: otherwise the run ends
    `skipped`, with no model call, and `SessionMoved` is raised. A summary a commit asked
    for (`RunTrigger.COMPACTION`) is written beside the agent's heartbeats."""
    agent = session.agent
    refuse_unless_compactable(session, now=now)
    run = compaction_run(session, now=now, trigger=trigger, beside=trigger == RunTrigger.COMPACTION)
    clock = RunClock(now=now, started=time.monotonic())
    beat = ClaimedRun.of(run, now=now, clock=clock)
    beat.calls.names_session(session.pk)
    try:
        record = compact(beat, session, keep_recent_turns=keep_recent_turns, seen=seen)
    except SessionMoved:
        run_skip(run=run, finished=clock())
        raise
    except RunFailure as failure:
        run_fail(run, code=failure.code, message=failure.message, now=clock(), cost_usd=beat.calls.cost_usd)
        if isinstance(failure, BudgetExceeded):
            budgets_enforce(agent=agent, now=now)
        if isinstance(failure, QuotaRefused):  # the heartbeats of the key wait for the reset too
            quota_refused(credential=beat.calls.adapter.credential(agent.adapter_config), refusal=failure, now=clock())
        raise
    except BaseException:
        run_fail(
            run,
            code="internal_error",
            message="The compaction failed unexpectedly.",
            now=clock(),
            cost_usd=beat.calls.cost_usd,
        )
        raise
    finally:
        dispatch_after_run(agent_id=agent.id)
    if beat.budgeted:
        budgets_enforce(agent=agent, now=now)
    return record


def session_compact_ahead(*, session_id, seen: tuple[int, int], now: datetime | None = None) -> str:
    """The compaction a heartbeat's commit asked for (`sessions_app.compaction_ahead`), as
    compact now makes it, if the session is still as that commit left it (`seen`: its
    message and compaction counts). Returns what happened, for the task's result. `now`
    is the clock's time unless given (a benchmark on a simulated clock)."""
    seen = tuple(seen)
    session = AgentSession.objects.select_related("agent").filter(pk=session_id).first()
    # Checked before the run too: a session that moved on long ago costs no run.
    if session is None or session_counts(session) != seen:
        return "skipped: the session changed or ended since"
    try:
        record = session_compact(session=session, now=now or timezone.now(), trigger=RunTrigger.COMPACTION, seen=seen)
    except SessionMoved:  # a heartbeat committed between the check above and the run's insert
        return "skipped: the session changed since the commit that asked for its summary"
    except CompactRefused as refusal:  # busy, capped, paused, ended: the next commit asks again
        return f"skipped: {refusal.code}"
    except RunFailure as failure:  # recorded on its run, as a heartbeat's would be
        return f"failed: {failure.code}"
    return f"compacted {record.messages_before} messages into {record.messages_after}"


def session_counts(session: AgentSession) -> tuple[int, int]:
    """What a turn or a compaction changes: the session as a commit left it."""
    return session.message_count, session.compaction_count


def refuse_unless_compactable(session: AgentSession, *, now: datetime) -> None:
    if refusal := session.agent.refusal():
        raise CompactRefused(*refusal)
    # Checked first here, unlike a heartbeat: a summary is rare beside its model call, and a
    # stored configuration no save would accept failed it at any step, once after the call
    # (its summary model priced), with a run left running.
    if (problem := session.agent.config_problem()) is not None:
        raise CompactRefused("agent_config_invalid", config_invalid_message(problem))
    if not session.is_live_at(now, ttl=session.agent.session_ttl):
        raise CompactRefused("session_not_live", "The session has ended or expired; only a live session is compacted.")
    if get_adapter(session.agent.adapter_type, session.agent.adapter_config).keeps_own_session:
        raise CompactRefused(
            "compaction_not_supported", "The agent's runtime keeps its own session; it compacts its own context."
        )


def compaction_run(session: AgentSession, *, now: datetime, trigger: str, beside: bool = False) -> HeartbeatRun:
    """The run the compaction is done and billed under (`agent_run_open`)."""
    return agent_run_open(session.agent, session=session, now=now, trigger=trigger, task=COMPACT_TASK, beside=beside)


def agent_run_open(
    agent: Agent, *, session: AgentSession | None, now: datetime, trigger: str, task: str, beside: bool = False
) -> HeartbeatRun:
    """A run of the agent doing no task of its own (a compaction, a cache refresh),
    `running` from the start: the database refuses it while another run of the agent is
    running. It is a run in progress like any: under PAPERCLIP_MAX_CONCURRENT_RUNS it takes
    a place, under the claims' lock, or is refused (`run_cap_reached`); being asked for
    now, it is not queued for later. `session`: the session its end gives its time to.
    `beside`: it does not take the agent's place (only another such run refuses it) until
    it asks for it to commit (`agent_place_take`)."""
    run = None
    # A heartbeat parked in a batch holds the place for hours: a summary beside it would be
    # paid for and then wait it out. It is refused instead, as a summary next to any run is.
    beside = beside and not HeartbeatRun.objects.filter(agent_id=agent.pk, status=RunStatus.SUBMITTED).exists()
    try:
        with transaction.atomic():
            # Refused by committing, not rolling back: a deferral wakes the older runs waiting.
            if settings.PAPERCLIP_MAX_CONCURRENT_RUNS and not run_place_free(agent_id=agent.pk, created_at=now):
                busy = HeartbeatRun.objects.filter(agent_id=agent.pk, status=RunStatus.RUNNING).exists()
            else:
                run = HeartbeatRun.objects.create(
                    company_id=agent.company_id,
                    agent=agent,
                    session=session,
                    status=RunStatus.RUNNING,
                    trigger=trigger,
                    task=task,
                    started_at=now,
                    deadline_at=run_deadline(
                        get_adapter(agent.adapter_type, agent.adapter_config), agent.adapter_config, at=now
                    ),
                    claimed_by=worker_id(),
                    beside=BesideState.CALLING if beside else None,
                )
    except IntegrityError:
        raise _session_busy() from None
    if run is None:
        if busy:
            raise _session_busy()  # its own heartbeat holds the place
        raise CompactRefused(
            "run_cap_reached",
            f"{settings.PAPERCLIP_MAX_CONCURRENT_RUNS} runs are in progress or waiting for a place "
            "(PAPERCLIP_MAX_CONCURRENT_RUNS); compact the session when one has finished.",
        )
    return (
        HeartbeatRun.objects.select_related("agent")
        .annotate(budgeted=budgets_exist(company_id_ref="company_id", agent_id_ref="agent_id"))
        .get(id=run.id)
    )


def _session_busy() -> CompactRefused:
    return CompactRefused(
        "session_busy", "A heartbeat of this agent is running; compact the session when it has finished."
    )


def compact(
    beat: ClaimedRun, session: AgentSession, *, keep_recent_turns: int | None, seen: tuple[int, int] | None = None
) -> SessionCompaction:
    # Read only now that the run exists: a session still as `seen` is the one the summary was
    # asked for. Only a run beside the heartbeats sees turns appended after this read, and
    # keeps them (`compaction_commit`'s `rebase`).
    session = AgentSession.objects.get(pk=session.pk)
    if seen is not None and session_counts(session) != seen:
        raise SessionMoved()
    history = store_for(session).read(session)
    if problem := history_problem(history):
        # Refused before any model call: every step below reads the history turn by turn.
        raise CompactRefused("history_malformed", f"The session's history cannot be compacted: {problem}.")
    keep = keep_recent_turns or beat.settings_.keep_recent_turns
    split = choose_split(history, keep)
    if split is None:
        raise CompactRefused(
            "nothing_to_compact", f"The session has nothing older than its last {keep} turns that is not a summary."
        )
    summary = summary_call(
        agent=beat.agent,
        adapter=beat.calls,
        settings_=beat.settings_,
        turns=history[:split],
        before_call=Reservation(beat),
    )
    new_history = summary_pair(summary.text, kind="summary", at=beat.now) + history[split:]
    if summary_not_shrinking(new_history[:2], history[:split]):
        compaction_refused(session=session, replaced=split, at=beat.now)
    beside = beat.run.beside is not None
    if beside:
        agent_place_take(beat.run, clock=beat.clock)
    system = beat.agent.system_prompt
    updated = compaction_commit(
        session=session,
        run=beat.run,
        old_history=history,
        new_history=new_history,
        archived=history[:split],
        summary=summary,
        tokens_before=estimate_tokens({"system": system, "messages": history}),
        tokens_after=estimate_tokens({"system": system, "messages": new_history}),
        at=beat.now,
        rebase=beside,
    )
    record = SessionCompaction.objects.filter(run=beat.run).latest("created_at")
    finished = beat.clock()
    with transaction.atomic():
        if HeartbeatRun.objects.filter(id=beat.run.id, status=RunStatus.RUNNING).update(
            status=RunStatus.SUCCEEDED,
            finished_at=finished,
            reserved_usd=0,
            model=summary.reply.model,
            cost_usd=beat.calls.cost_usd,
            output=f"Compacted {record.messages_before} messages into {updated.message_count}.",
        ):
            # Its time is the session's active time, as a heartbeat's (a failed one's: run_fail).
            started = beat.run.started_at
            session_run_time_record(
                session_id=session.pk,
                started=started,
                finished=finished,
                ttl=beat.agent.session_ttl,
                active_seconds=alone_seconds(
                    run_id=beat.run.id, session_id=session.pk, started=started, finished=finished
                )
                if beside
                else None,
            )
    return record


def agent_place_take(run: HeartbeatRun, *, clock: RunClock) -> None:
    """A summary written beside its agent's heartbeats commits only from the agent's place,
    so that no heartbeat's plan ever read the history it replaces: it says it waits (from
    then on no heartbeat is claimed, `run_queue.summary_waiting_for_place`), then takes the
    place once the heartbeat in progress, if any, has ended. Given up at the run's deadline
    (`session_busy`; its summary stays billed, as a refused one's does)."""
    mine = HeartbeatRun.objects.filter(id=run.id, status=RunStatus.RUNNING)
    if not mine.update(beside=BesideState.WAITING):
        raise _reaped()
    pause = PLACE_POLL_FIRST_SECONDS
    while True:
        try:
            with transaction.atomic():  # a savepoint inside a caller's transaction
                taken = mine.update(beside=None)
        except IntegrityError:  # a heartbeat of the agent holds it
            parked = HeartbeatRun.objects.filter(agent_id=run.agent_id, status=RunStatus.SUBMITTED).exists()
            if parked or clock() >= run.deadline_at:  # a batch's answer may take hours
                raise _session_busy() from None
            time.sleep(pause)
            pause = min(pause * 2, PLACE_POLL_MAX_SECONDS)
            continue
        if not taken:
            raise _reaped()
        run.beside = None
        return


def _reaped() -> StepFailed:
    return StepFailed("run_timeout", "The run was reaped as timed out while the session was summarised.")
