"""One heartbeat, start to finish.

1. `heartbeat_start` is how the API, the admin, the `heartbeat` command and the scheduled
   task wake an agent: `heartbeat_enqueue` validates the task and records a queued run (or
   returns the earlier run of a reused idempotency key), which then runs here (`wait`) or
   in the task cluster.
2. `heartbeat_execute` runs it as its steps: claim -> plan -> (handoff) -> fit -> reserve
   -> call -> commit -> release, each a function below with its own docstring. The claim
   is decided by the database (one running run per agent), the model is called outside
   any transaction, every call is billed the moment it returns (`sessions_app.run_calls`),
   and the user turn, the answer, the session and the run's completion commit together; a
   failed call changes no history.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace
from typing import Protocol

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from costs_app.budgets import (
    BudgetExceeded,
    budget_headroom,
    budget_reserve,
    call_cost_bound,
)
from costs_app.ledger import run_calls_join_session
from costs_app.money import usd
from costs_app.pricing import token_counts
from paperclip.long_lived import long_lived_objects_freeze
from paperclip.telemetry import step, traced_heartbeat
from sessions_app import history_cache
from sessions_app.adapters import AdapterError, AdapterReply, AdapterRequest, get_adapter
from sessions_app.adapters.base import ApprovalNeeded, QuotaRefused
from sessions_app.approvals import approval_park
from sessions_app.batch_delivery import BatchParked, batch_park
from sessions_app.cli_transcripts import SessionTranscripts
from sessions_app.commit_sql import (
    STATELESS_OUTCOME,
    TURN_AND_OUTCOME,
    outcome_values,
    session_turn_update,
    turn_values,
)
from sessions_app.compaction import (
    BeforeCall,
    SummaryAwaited,
    fit_budget,
    handoff_record,
    server_compaction_archive,
    starts_with_compaction,
    write_handoff,
)
from sessions_app.compaction_ahead import compaction_ahead_enqueue, compaction_due
from sessions_app.context import (
    ContextSettings,
    build_request,
    context_settings,
    manifest_merge,
    read_as_turns,
    reported_artifacts,
    request_tokens_bound,
    summary_pair,
    user_turn_content,
)
from sessions_app.errors import HeartbeatRefused, QueueUnavailable, RunAbandoned, RunFailure, RunRemoved
from sessions_app.hot_sql import pipelines, turn_and_outcome_run, write_then_read
from sessions_app.keep_warm import keep_warm_arm
from sessions_app.managed_health import lost_session_note
from sessions_app.managed_sessions import ManagedSessionHandle, managed_ends_for_sessions
from sessions_app.metering import session_hours_bill
from sessions_app.models import (
    LIVE_SESSION_STATUSES,
    Agent,
    AgentSession,
    AgentStatus,
    BesideState,
    HeartbeatRun,
    HistoryStore,
    ManagedEndAction,
    ReadAhead,
    RunStatus,
    SessionStatus,
)
from sessions_app.no_work import check_for_work, continued_task, heartbeat_skip, idle_streak_record
from sessions_app.plan import HANDOFF_REASONS, Plan, idle_pause, plan_session
from sessions_app.quota import probe_end, quota_refused
from sessions_app.run_calls import RunCalls
from sessions_app.run_queue import (
    NEXT_QUEUED,
    claim_run,
    dispatch_after_run,
    dispatch_waiting,
    heartbeat_dispatch,
    heartbeat_enqueue,
    run_cost_refresh,
    run_fail,
    run_requeue,
)
from sessions_app.services import budgets_enforce
from sessions_app.stores import NOTHING_STAGED, StagedHistory, configured_store_name, store_for
from sessions_app.tool_loop import call_with_tools, memory_tool_for, offering
from sessions_app.work_checks import is_nothing_to_do

logger = logging.getLogger(__name__)


def heartbeat_start(
    *,
    agent: Agent,
    task: str,
    trigger: str,
    now: datetime,
    wait: bool,
    idempotency_key: str | None = None,
    force_fresh: bool = False,
    wait_seconds: float | None = None,
    merge: bool = False,
    delivery: str | None = None,
) -> tuple[HeartbeatRun, bool]:
    """Wake an agent with a task: the one path of the API, the admin, the `heartbeat`
    command and the scheduled heartbeat.

    Records a queued run (`heartbeat_enqueue`: the task is validated there, and refusals
    raise `HeartbeatRefused`); a reused idempotency key returns the earlier run and False,
    and starts nothing, as does a `merge` (a scheduled tick) counted on the agent's
    unfinished run. `delivery` is an API caller's (`batch_delivery.run_delivery`). With
    `wait`, the run is executed here, waiting up to
    `wait_seconds` (PAPERCLIP_RUN_TIMEOUT_SECONDS by default) for the agent's current run
    to finish; 0 tries once and leaves it queued while the agent is busy. Otherwise it is
    handed to the task cluster when the current transaction commits (`QueueUnavailable`
    when the queue refuses it: the run stays recorded).
    """
    try:
        run, created = heartbeat_enqueue(
            agent=agent,
            task=task,
            now=now,
            idempotency_key=idempotency_key,
            force_fresh=force_fresh,
            trigger=trigger,
            merge=merge,
            delivery=delivery,
        )
    except (AttributeError, KeyError, TypeError, ValueError):
        # The enqueue reads the agent's settings (its models, its budget's); a stored
        # configuration no save would accept fails there: said, where it is the cause.
        if (problem := agent.config_problem()) is None:
            raise
        raise HeartbeatRefused("agent_config_invalid", config_invalid_message(problem)) from None
    if not created:
        return run, False
    if wait:
        timeout = settings.PAPERCLIP_RUN_TIMEOUT_SECONDS if wait_seconds is None else wait_seconds
        return heartbeat_wait(run_id=run.id, timeout_seconds=timeout), True
    try:
        heartbeat_dispatch(run=run)
    except Exception as exc:  # the broker (Redis, or the database queue) is down
        logger.exception("Could not hand run %s to the task queue", run.id)
        raise QueueUnavailable(
            "queue_unavailable", f"The task queue is unavailable; run {run.id} is recorded but not started."
        ) from exc
    return run, True


def _unexpected_failure(run: HeartbeatRun) -> dict:
    """The code and message of a run an unexpected error ended: its agent's stored
    configuration when no save would accept it (the likely cause), else `internal_error`."""
    try:
        problem = run.agent.config_problem()
    except Exception:  # the run is failed whatever this says (a dropped connection, say)
        problem = None
    if problem is not None:
        return {"code": "agent_config_invalid", "message": config_invalid_message(problem)}
    return {"code": "internal_error", "message": "The run failed unexpectedly; see server logs."}


def config_invalid_message(problem: str) -> str:
    return (
        f"The agent's stored configuration is not valid ({problem}): correct it "
        "(PATCH the agent, or its page in the admin)."
    )


# One run, as its steps.


@traced_heartbeat
def heartbeat_execute(*, run_id, now: datetime | None = None) -> HeartbeatRun:
    """Run a queued run to a terminal state, or leave it queued while its agent is busy.

    1. claim: the run becomes `running` unless another run of its agent is; then the
       agent's work check, if it has one: no work ends the run `skipped` (`no_work`);
    2. plan: the session the answer goes to, and the history the model sees;
    3. handoff: a rotated session's successor opens with a note the model writes;
    4. fit: the request, the session compacted first when it would pass its budget;
    5. reserve: a budgeted run holds the most the call can cost, or is refused;
    6. call: the adapter, outside any transaction;
    7. commit: the turns, the session, the ledger row and the run in one transaction;
       the history file is published after the COMMIT;
    8. release: the agent's next queued run is dispatched (read in the commit's round
       trip, after its COMMIT, where it could be; a failed run's session counts its time
       and its TTL from the end of the run: `run_fail`).

    Steps 2-4 are the adapter's session strategy (`ReplayedHistory` or `OwnSession`). A
    step that fails raises a `RunFailure`, whose code and message the run keeps; anything
    else fails the run `internal_error`. `now` is the heartbeat's logical time (expiry
    decisions, last_used); the finish time adds the measured duration of the run to it.
    """
    now = now or timezone.now()
    with step("claim", run_id=run_id):
        try:
            run, claimed = claim_run(run_id=run_id, now=now)  # 1
        except HeartbeatRun.DoesNotExist:
            raise RunRemoved(run_id) from None
    if not claimed:
        return run
    clock = RunClock(now=now, started=time.monotonic())
    current = False
    try:
        current = _run_claimed(run, now=now, clock=clock)  # 2-7
    except Exception:
        # Never leave a run `running` behind an unexpected error (a bug, a dropped
        # database connection): fail it with the class name and keep the traceback in logs.
        logger.exception("Heartbeat run %s failed unexpectedly", run.id)
        run_fail(run, **_unexpected_failure(run), now=clock())
        run_cost_refresh(run_id=run.id)
    with step("release", run_id=run.id):
        if run.quota_probe is not None and probe_end(run=run, now=clock()):
            dispatch_waiting()  # the probe was not refused: the hold ended, the queue drains
        released = _release(run, current=current, now=now)  # 8
    long_lived_objects_freeze()  # once per process: what a heartbeat loads is loaded now
    return released


def _run_claimed(run: HeartbeatRun, *, now: datetime, clock: RunClock) -> bool:
    """Steps 2-7. True when the run succeeded and `run` holds every value written to its row."""
    beat = ClaimedRun.of(run, now=now, clock=clock)
    try:
        # 1, the work check; a turn that waited for an approval goes on with its task.
        task = continued_task(run) if run.managed_turn else check_for_work(run=run, agent=beat.agent)
        if task is None:
            return heartbeat_skip(run=run, agent=beat.agent, finished=clock(), now=now)
        ids = beat.ids()
        with step("plan", **ids):
            plan = _plan(beat)  # 2
            plan = _handoff(beat, plan)  # 3
        ids["session_id"] = plan.session.pk if plan.session is not None else None
        reserve = Reservation(beat)
        user_content = user_turn_content(task, plan.manifest)
        with step("fit", **ids):
            plan, request = _fit(beat, plan, user_content, reserve=reserve)  # 4
        with step("reserve", **ids):
            tool = memory_tool_for(beat)
            request = offering(request, tool)
            reserve(request, delivery=beat.calls.batch.delivery_for(request))  # 5
        with step("call", **ids):
            reply = _call(beat, plan, request, tool=tool, reserve=reserve)  # 6
    except RunFailure as exc:
        _fail(beat, exc)
        return False
    with step("commit", **ids):
        succeeded = _commit(beat, plan, reply, user_content=user_content, finished=clock())  # 7
    if succeeded:
        idle_streak_record(agent=beat.agent, idle=run.nothing_to_do, now=now)
        if run.session_id is not None and compaction_due(plan, reply, user_content):
            # The session the commit saved (`_run_outcome`): its counts are the ones it wrote.
            compaction_ahead_enqueue(session=run.session)  # the next heartbeat finds it summarised
        elif run.session_id is not None:
            keep_warm_arm(
                agent=beat.agent, session_id=run.session_id, ttl=plan.cache_ttl, usage=reply.usage, at=clock()
            )
    if beat.budgeted:
        budgets_enforce(agent=beat.agent, now=now)
    # A reservation wrote its warning and amount to the row; reading it back is simpler
    # than tracking them.
    return succeeded and not beat.budgeted


@dataclass(frozen=True)
class RunClock:
    """The run's time: its logical start plus what was measured since the claim."""

    now: datetime
    started: float

    def __call__(self) -> datetime:
        return self.now + timedelta(seconds=time.monotonic() - self.started)


@dataclass(frozen=True)
class ClaimedRun:
    """A claimed run and what its steps share; fixed for the whole run."""

    run: HeartbeatRun
    agent: Agent
    calls: RunCalls  # the adapter, every call billed as it returns
    strategy: SessionStrategy
    settings_: ContextSettings
    now: datetime
    clock: RunClock
    budgeted: bool  # any budget applies: every call is reserved before it is sent

    def ids(self) -> dict:
        """What every step's span names (`paperclip.telemetry`)."""
        return {"run_id": self.run.id, "agent_id": self.agent.id, "company_id": self.agent.company_id}

    @classmethod
    def of(cls, run: HeartbeatRun, *, now: datetime, clock: RunClock) -> ClaimedRun:
        agent = run.agent
        settings_ = context_settings(agent, now=now)
        adapter = get_adapter(agent.adapter_type, agent.adapter_config)
        return cls(
            run=run,
            agent=agent,
            calls=RunCalls(adapter, run=run, agent=agent, clock=clock, budgeted=run.budgeted),
            strategy=session_strategy(adapter),
            settings_=settings_,
            now=now,
            clock=clock,
            budgeted=run.budgeted,
        )


def _plan(beat: ClaimedRun) -> Plan:
    """2. plan: resume the agent's live session or plan a new one (`sessions_app.plan`).
    The run's calls from here on are billed to the session its answer goes to (a new
    session's, once its commit creates it)."""
    plan = beat.strategy.plan(beat)
    if plan.session is not None and not plan.new_session:
        beat.calls.names_session(plan.session.pk)
    return plan


def _handoff(beat: ClaimedRun, plan: Plan) -> Plan:
    """3. handoff: when the live session is rotated, the model writes the note that opens
    its successor (reserved like any call); the plan returned carries it."""
    return beat.strategy.handoff(beat, plan, reserve=Reservation(beat))


def _fit(beat: ClaimedRun, plan: Plan, user_content, *, reserve: Reservation) -> tuple[Plan, AdapterRequest]:
    """4. fit: the request for this turn. Over the session's budget, older turns are
    summarised first (each summary reserved and committed on its own): the plan returned
    is the one the request was built from."""
    plan, request = beat.strategy.fit(beat, plan, user_content, reserve=reserve)
    return plan, replace(request, metadata={"run_id": str(beat.run.id), "agent_id": str(beat.agent.id)})


def _call(beat: ClaimedRun, plan: Plan, request: AdapterRequest, *, tool, reserve: Reservation) -> AdapterReply:
    """6. call: the model, outside any transaction (an `AdapterError` when it fails); with
    tools, until its final answer, each call reserved and billed (`sessions_app.tool_loop`)."""
    return call_with_tools(beat, request, tool=tool, reserve=reserve)


def _fail(beat: ClaimedRun, failure: RunFailure, *, active_seconds: float | None = None) -> None:
    """A step failed: the run keeps its code and message, and the cost of the calls it made
    (each billed as it returned); a refused budget pauses agents. A runtime stopped at one
    of its caps did work: the run keeps the runtime's report of it (turns, tool calls), as
    a succeeded run does. Its session counts the time the runtime measured (the failure's,
    or `active_seconds`: the answer's, when its commit failed), else the run's own; measured
    time with no row left to count it is billed at once (`run_fail`). A
    quota's refusal is no failure: the credential is held and the run goes back to the
    queue (`sessions_app.quota`). Nor is a call parked for a batch: the run waits
    `submitted` (`sessions_app.batch_delivery`)."""
    if isinstance(failure, ApprovalNeeded):
        calls = beat.calls
        approval_park(
            beat.run, state=failure.state, calls_numbered=calls.numbered, cost_usd=calls.cost_usd, now=beat.clock()
        )
        return
    if isinstance(failure, BatchParked):
        calls = beat.calls
        batch_park(
            beat.run,
            agent=beat.agent,
            params=failure.params,
            calls_numbered=calls.numbered,
            cost_usd=calls.cost_usd,
            now=beat.clock(),
        )
        return
    if isinstance(failure, SummaryAwaited):
        summary_await(beat)
        return
    if isinstance(failure, QuotaRefused):
        now = beat.clock()
        quota_refused(credential=beat.calls.adapter.credential(beat.agent.adapter_config), refusal=failure, now=now)
        calls = beat.calls
        run_requeue(beat.run, calls_numbered=calls.numbered, cost_usd=calls.cost_usd, reason=failure.message, now=now)
        return
    cost = beat.calls.cost_usd
    kept = {"cost_usd": cost}
    report = failure.runtime_report if isinstance(failure, AdapterError) else None
    kept["active_seconds"] = failure.active_seconds if isinstance(failure, AdapterError) else active_seconds
    if report is not None:
        kept["runtime_report"] = {**report, "ledger_cost_usd": str(cost) if cost is not None else None}
    run_fail(beat.run, code=failure.code, message=failure.message, now=beat.clock(), **kept)
    if isinstance(failure, RunAbandoned):
        run_cost_refresh(run_id=beat.run.id)  # reaped meanwhile: its row is the reaper's, its calls ours
    if isinstance(failure, BudgetExceeded):
        budgets_enforce(agent=beat.agent, now=beat.now)


def summary_await(beat: ClaimedRun) -> None:
    """The run goes back to the queue behind its session's summary, which from then on
    waits for the agent's place (no heartbeat is claimed until it ends, and its end
    dispatches this run): otherwise the release would claim this run again at once."""
    calls = beat.calls
    with transaction.atomic():  # the session's row, then the runs', as every ender of a run
        run_requeue(
            beat.run,
            calls_numbered=calls.numbered,
            cost_usd=calls.cost_usd,
            reason="its session's summary is being written",
            now=beat.clock(),
            quota=False,
        )
        HeartbeatRun.objects.filter(
            agent_id=beat.agent.pk, status=RunStatus.RUNNING, beside=BesideState.CALLING
        ).update(beside=BesideState.WAITING)


def _release(run: HeartbeatRun, *, current: bool, now: datetime) -> HeartbeatRun:
    """8. release: dispatch the agent's next queued run and, under a cap on runs in
    progress, the oldest runs of other agents waiting for the place (a failed run's
    session was given its time and TTL by `run_fail`). Returns the run as its row says."""
    dispatch_after_run(agent_id=run.agent_id, next_queued=run.next_queued_read)
    if not current:
        try:
            run.refresh_from_db()
        except HeartbeatRun.DoesNotExist:
            raise RunRemoved(run.id) from None
    return run


# Session strategies: steps 2-4, chosen by what the adapter declares.


class SessionStrategy(Protocol):
    def plan(self, beat: ClaimedRun) -> Plan: ...

    def handoff(self, beat: ClaimedRun, plan: Plan, *, reserve: BeforeCall) -> Plan: ...

    def fit(
        self, beat: ClaimedRun, plan: Plan, user_content, *, reserve: BeforeCall
    ) -> tuple[Plan, AdapterRequest]: ...


class ReplayedHistory:
    """The engine keeps the session's history and replays it with every request (today's
    `claude-code` and `process`): planned, rotated with a handoff note, compacted to fit."""

    def plan(self, beat: ClaimedRun) -> Plan:
        return plan_session(agent=beat.agent, run=beat.run, now=beat.now, settings_=beat.settings_)

    def handoff(self, beat: ClaimedRun, plan: Plan, *, reserve: BeforeCall) -> Plan:
        if plan.retire_reason not in HANDOFF_REASONS:
            return plan
        return write_handoff(
            agent=beat.agent,
            adapter=beat.calls,
            plan=plan,
            settings_=beat.settings_,
            now=beat.now,
            before_call=reserve,
        )

    def fit(self, beat: ClaimedRun, plan: Plan, user_content, *, reserve: BeforeCall) -> tuple[Plan, AdapterRequest]:
        with read_as_turns(plan.history, to="replayed"):
            return fit_budget(
                agent=beat.agent,
                adapter=beat.calls,
                run=beat.run,
                plan=plan,
                user_content=user_content,
                settings_=beat.settings_,
                now=beat.now,
                before_call=reserve,
            )


class OwnSession:
    """The runtime resumes a session it keeps itself and only reports each turn back: the
    engine still records the turn on the agent's session, but sends only the new one, and
    never compacts (the runtime manages its own context); it rotates only where the runtime
    says so (`rotates_own_session`), with no handoff note."""

    def plan(self, beat: ClaimedRun) -> Plan:
        rotates = beat.calls.adapter.rotates_own_session
        return plan_session(agent=beat.agent, run=beat.run, now=beat.now, settings_=beat.settings_, rotates=rotates)

    def handoff(self, beat: ClaimedRun, plan: Plan, *, reserve: BeforeCall) -> Plan:
        if plan.retire_reason != "remote_lost":
            return plan
        # The lost session's successor opens with what our mirror of it holds (no model call).
        note = lost_session_note(plan.retire)
        return replace(plan, lost_note=note, history=summary_pair(note, kind="handoff", at=beat.now))

    def fit(self, beat: ClaimedRun, plan: Plan, user_content, *, reserve: BeforeCall) -> tuple[Plan, AdapterRequest]:
        request = build_request(agent=beat.agent, history=[], user_content=user_content, settings=beat.settings_)
        if beat.calls.adapter.own_session_store == "managed":
            own = ManagedSessionHandle(plan.session, agent=beat.agent, run=beat.run, lost_note=plan.lost_note)
        else:
            own = SessionTranscripts(plan.session, agent_id=beat.agent.id)
        return plan, replace(request, own_session=own)


def session_strategy(adapter) -> SessionStrategy:
    """An adapter with `keeps_own_session` resumes its own session; the others are replayed."""
    return OwnSession() if adapter.keeps_own_session else ReplayedHistory()


@dataclass(frozen=True)
class Reservation:
    """5. reserve: called with every request a run sends, summaries included, before it
    is sent. A budgeted run reserves the call's most possible cost or is refused
    (`BudgetExceeded`), so a budget is never crossed by a call nobody checked. The run's
    earlier calls are in the ledger already (each was billed as it returned)."""

    beat: ClaimedRun

    def __call__(self, request: AdapterRequest, *, delivery: str = "direct") -> None:
        beat = self.beat
        if beat.budgeted:
            reserve_budget(
                run=beat.run, agent=beat.agent, calls=beat.calls, request=request, now=beat.now, delivery=delivery
            )


def reserve_budget(
    *,
    run: HeartbeatRun,
    agent: Agent,
    calls: RunCalls,
    request: AdapterRequest,
    now: datetime,
    delivery: str = "direct",
) -> None:
    """Refuse before the call when it could cross a hard limit; hold its most possible cost.

    The input is sized by its byte bound (no token is shorter than a byte) plus the input
    the API adds unseen for the tools it offers (`request_tokens_bound`), so what is held
    is never less than what the call can cost, whatever the text's language. When that
    bound comes near the money left, the input is measured with count_tokens instead, so
    a call that fits is not refused on the bound alone; a call far under every limit, or
    over one even with no input at all, costs no extra request.
    """
    if (cap := calls.adapter.reservation_usd(request.config)) is not None:
        # A runtime with a spending cap of its own (Claude Code) holds that cap.
        if warning := budget_reserve(run=run, agent=agent, estimate=cap, now=now, model=request.model):
            HeartbeatRun.objects.filter(id=run.id).update(warning=warning[:2000])
        return
    max_output = request.max_tokens or int(agent.adapter_config.get("max_tokens") or 4096)
    size = request_tokens_bound(request)
    cost = call_cost_bound(
        model=request.model,
        max_output_tokens=max_output,
        at=now,
        cache_lifetimes=cache_lifetimes([request.system_blocks, request.messages]),
        samplings=2 if request.config.get("context_strategy") == "server" else 1,
        delivery=delivery,  # a request going in a batch can only be billed at the batch price
        inference_geo=request.config.get("inference_geo"),
    )
    estimate = cost(size) if cost is not None else None
    if estimate is not None and calls.counts_tokens:
        headroom = budget_headroom(company_id=agent.company_id, agent_id=agent.id, now=now, exclude_run_id=run.id)
        # Measuring helps only between "fits by the bound" and "over even with no input".
        if headroom is not None and estimate > headroom / 2 and cost(0) <= headroom:
            try:
                estimate = cost(calls.count_tokens(request))
            except AdapterError:
                pass  # the byte bound stands: it may refuse a call that would fit, never pass one that cannot
    warning = budget_reserve(run=run, agent=agent, estimate=estimate, now=now, model=request.model)
    if warning:
        HeartbeatRun.objects.filter(id=run.id).update(warning=warning[:2000])


def cache_lifetimes(value) -> frozenset[str]:
    """The lifetimes the cache_control markers in a request ask for (`5m` unless named):
    its input may be written to the cache at their prices."""
    found: set[str] = set()
    if isinstance(value, dict):
        marker = value.get("cache_control")
        if isinstance(marker, dict):
            found.add(marker.get("ttl") or "5m")
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            found |= cache_lifetimes(item)
    return frozenset(found)


def _commit(beat: ClaimedRun, plan: Plan, reply: AdapterReply, *, user_content, finished: datetime) -> bool:
    """7. commit: in one durable transaction, the agent row locked first, the session the
    answer goes to (retiring or creating one as planned, and giving a new one the ledger
    rows of the calls made before it existed), the turn recorded on the session
    (`AgentSession.record_turn`) and the run's success. The new history is published only
    after the COMMIT; after a failure it is discarded. Every call was billed when it
    returned, so nothing here writes to the ledger and a failure loses no spend.

    True when it committed and `run` holds every value written to its row; False when the
    run failed instead (a `RunFailure`, recorded on the run).
    """
    run, agent, now = beat.run, beat.agent, beat.now
    counts = token_counts(reply.usage) if reply.usage is not None else None
    cost = beat.calls.cost_usd
    # A nothing-to-do answer is billed and shown on the run, never replayed in later turns
    # (an answer that carries a server compaction is: the compaction must be kept).
    replayed = not is_nothing_to_do(reply.text, agent.adapter_config) or starts_with_compaction(reply.content)
    if not agent.is_persistent and reply.on_commit is None:
        outcome = _run_outcome(None, reply, counts, cost, finished=finished, replayed=replayed)
        return _commit_stateless(beat, outcome)
    appends = _appends_only(agent, plan, reply)
    if appends and connection.vendor == "postgresql":
        return _commit_appended(beat, plan, reply, user_content, counts, finished=finished, replayed=replayed)
    staged = runtime_staged = NOTHING_STAGED
    try:
        # Durable: its end is the COMMIT, and the history is published only after it.
        with transaction.atomic(durable=True):
            session = plan.session if appends else _session_for_answer(agent=agent, run=run, plan=plan, now=now)
            if session is not None and plan.new_session and beat.calls.billed_anything:
                run_calls_join_session(run_id=run.id, session_id=session.id)
            if reply.on_commit is not None:  # a runtime's own session state (Claude Code's transcript)
                # Not replayed by the runtime either: its session stays as it was, so it
                # never resumes from a nothing-to-do answer.
                runtime_staged = reply.on_commit(session if replayed else None, cost) or NOTHING_STAGED
            if session is not None:
                turns, staged = _stage_turns(
                    beat, session, plan, reply, user_content, counts, finished=finished, replayed=replayed
                )
                turn = _turn(beat, plan, reply, counts, turns=turns, finished=finished, replayed=replayed)
                if appends:
                    _session_append(agent=agent, session=session, plan=plan, staged=staged, turn=turn)
                else:
                    session.record_turn(**turn)
            outcome = _run_outcome(session, reply, counts, cost, finished=finished, replayed=replayed)
            if not HeartbeatRun.objects.filter(id=run.id, status=RunStatus.RUNNING).update(**outcome):
                raise RunAbandoned("run_timeout", "The run was reaped as timed out before its answer arrived.")
    except Exception as exc:
        staged.discard()
        runtime_staged.discard()
        if not isinstance(exc, RunFailure):
            raise
        _fail(beat, exc, active_seconds=reply.active_seconds)
        return False
    staged.publish()
    runtime_staged.publish()
    for name, value in outcome.items():
        setattr(run, name, value)
    return True


def _turn(beat: ClaimedRun, plan: Plan, reply: AdapterReply, counts, *, turns: list, finished, replayed) -> dict:
    """What the turn changes on its session (`AgentSession.turn_changes`)."""
    return {
        "replayed": replayed,
        "message_count": len(turns),
        "manifest": manifest_merge(plan.manifest, reported_artifacts(reply.text, reply.artifacts), at=finished),
        "started": beat.now,
        "finished": finished,
        "ttl": beat.agent.session_ttl,
        "idle_pause": idle_pause(beat.agent),
        "input_tokens": counts.total_input_tokens if counts is not None else None,
        "output_tokens": counts.output_tokens if counts is not None else None,
        "new_messages": 2 + len(reply.exchanges),
        "active_seconds": reply.active_seconds,
    }


def _commit_appended(
    beat: ClaimedRun, plan: Plan, reply: AdapterReply, user_content, counts, *, finished: datetime, replayed: bool
) -> bool:
    """7. commit, PostgreSQL, for a turn appended to the session the plan resumed (the
    common persistent heartbeat): the session's UPDATE and the run's in one statement
    (`hot_sql.turn_and_outcome_run`, compiled once: `commit_sql.TURN_AND_OUTCOME`), with the
    checks and locks of the transaction `_commit` writes and the same outcomes; the history
    published after it."""
    run, session = beat.run, plan.session
    staged = NOTHING_STAGED
    try:
        turns, staged = _stage_turns(
            beat, session, plan, reply, user_content, counts, finished=finished, replayed=replayed
        )
        turn = _turn(beat, plan, reply, counts, turns=turns, finished=finished, replayed=replayed)
        outcome = _run_outcome(session, reply, counts, beat.calls.cost_usd, finished=finished, replayed=replayed)
        assigned, added, values = _session_append_values(beat.agent, session, plan, staged, turn)
        statement = TURN_AND_OUTCOME.statement(**values, **outcome_values(run_id=run.id, outcome=outcome))
        written, next_queued, history_rev = turn_and_outcome_run(statement, read_after=_next_queued_read_after(run))
        if next_queued is not None:
            run.next_queued_read = ReadAhead(NEXT_QUEUED.first_of(next_queued))
        if written is None:
            raise RunAbandoned("run_timeout", "The run was reaped as timed out before its answer arrived.")
        if not written:
            _session_refusal(agent=beat.agent, session_id=session.pk)
    except Exception as exc:
        staged.discard()
        if not isinstance(exc, RunFailure):
            raise
        _fail(beat, exc, active_seconds=reply.active_seconds)
        return False
    staged.publish()
    _session_turn_set(session, assigned, added)
    _history_keep(beat.agent, session, plan, staged, turns=turns, history_rev=history_rev)
    for name, value in outcome.items():
        setattr(run, name, value)
    return True


def _history_keep(
    agent: Agent, session: AgentSession, plan: Plan, staged: StagedHistory, *, turns: list, history_rev: int
) -> None:
    """Keep the history this commit wrote for the agent's next heartbeat
    (`sessions_app.history_cache`), when the revision the commit left is the one the plan's
    history had, moved by the commit's own append: then that history is what the row
    held when the turns were appended to it (anything else moved the revision too)."""
    appended = "history" in staged.fields
    if session.store == HistoryStore.DATABASE and history_rev == session.history_rev + appended:
        written = plan.history + history_cache.as_stored(turns[len(plan.history) :])
        history_cache.keep(agent.pk, session_id=session.pk, history_rev=history_rev, history=written)
    session.history_rev = history_rev


def _commit_stateless(beat: ClaimedRun, outcome: dict) -> bool:
    """7. commit, for a run with no session and no runtime state to keep: the run's success
    is one statement, its agent's row locked as the transaction above locks it (a deletion
    commits first and the run fails `agent_deleted`, or waits for this one). Why a statement
    updated nothing is read only then. Compiled once (`commit_sql.STATELESS_OUTCOME`)."""
    run, agent = beat.run, beat.agent
    values = {"agent_id": agent.pk, **outcome_values(run_id=run.id, outcome=outcome)}
    if (next_queued := _next_queued_read_after(run)) is not None:
        succeeded, next_queued_rows = write_then_read(STATELESS_OUTCOME.statement(**values), next_queued)
        # Unless the run's end was written, the read came while it still ran: it tells nothing.
        if succeeded and next_queued_rows is not None:
            run.next_queued_read = ReadAhead(NEXT_QUEUED.first_of(next_queued_rows))
    else:
        succeeded = STATELESS_OUTCOME.update(**values)
    if not succeeded:
        alive = Agent.objects.filter(pk=agent.pk).exclude(status=AgentStatus.DELETED).exists()
        if alive:
            _fail(beat, RunAbandoned("run_timeout", "The run was reaped as timed out before its answer arrived."))
        else:
            _fail(beat, RunAbandoned("agent_deleted", "The agent was deleted while the model answered."))
        return False
    for name, value in outcome.items():
        setattr(run, name, value)
    return True


def _next_queued_read_after(run: HeartbeatRun) -> tuple[str, list] | None:
    """The release's read of the agent's next queued run, for the commit to run after its
    COMMIT in the same round trip: on PostgreSQL, outside a transaction, and where the
    release wakes that run (under a cap on runs in progress it wakes the oldest of any
    agent instead)."""
    if not pipelines() or settings.PAPERCLIP_MAX_CONCURRENT_RUNS:
        return None
    return NEXT_QUEUED.statement(run.agent_id)


def _stage_turns(
    beat: ClaimedRun,
    session: AgentSession,
    plan: Plan,
    reply: AdapterReply,
    user_content,
    counts,
    *,
    finished: datetime,
    replayed: bool = True,
) -> tuple[list, StagedHistory]:
    """The session's history with this turn, staged in its store (published after the
    COMMIT), and the compaction and handoff records that go with it. A turn that is not
    `replayed` (a nothing-to-do answer) adds no message."""
    run, now = beat.run, beat.now
    if not replayed:
        if plan.handoff is not None:
            handoff_record(session, run=run, handoff=plan.handoff, at=now)
        if plan.new_session:
            return plan.history, store_for(session).stage(session, plan.history)
        return plan.history, NOTHING_STAGED
    new_turns = [
        {
            "role": "user",
            "content": user_content,
            "at": now.isoformat(),
            "run_id": str(run.id),
            "seq": session.next_seq,
        },
        *[{**turn, "seq": session.next_seq + 1 + index} for index, turn in enumerate(reply.exchanges)],
        {
            "role": "assistant",
            "content": reply.content,
            "at": finished.isoformat(),
            "run_id": str(run.id),
            "seq": session.next_seq + 1 + len(reply.exchanges),
            "message_id": reply.message_id,
            "usage": counts.__dict__ if counts else None,
            "cost_usd": usd(reply.cost_usd) if reply.cost_usd is not None else None,
        },
    ]
    turns = plan.history + new_turns
    if starts_with_compaction(reply.content):
        # Server-side compaction: the API ignores everything before the compaction block
        # from now on, so those turns move to the archive.
        server_compaction_archive(session, run=run, archived=plan.history, reply=reply, at=finished)
        turns = new_turns
    if plan.handoff is not None:
        handoff_record(session, run=run, handoff=plan.handoff, at=now)
    store = store_for(session)
    if turns is new_turns or plan.new_session:
        return turns, store.stage(session, turns)
    return turns, store.stage_append(session, plan.history, new_turns)


def _run_outcome(
    session: AgentSession | None, reply: AdapterReply, counts, cost, *, finished: datetime, replayed: bool = True
) -> dict:
    """The fields of a succeeded run."""
    return {
        "status": RunStatus.SUCCEEDED,
        "nothing_to_do": not replayed,
        "session": session,
        "output": reply.text,
        "model": reply.model,
        "message_id": reply.message_id,
        "stop_reason": reply.stop_reason,
        "input_tokens": counts.input_tokens if counts else None,
        "output_tokens": counts.output_tokens if counts else None,
        "cache_creation_input_tokens": counts.cache_creation_input_tokens if counts else None,
        "cache_read_input_tokens": counts.cache_read_input_tokens if counts else None,
        "cost_usd": cost,
        "finished_at": finished,
        "reserved_usd": Decimal(0),
        # A runtime's own report, with the ledger's cost beside whatever cost it reported.
        "runtime_report": {**reply.runtime_report, "ledger_cost_usd": str(cost) if cost is not None else None}
        if reply.runtime_report is not None
        else None,
    }


def _appends_only(agent: Agent, plan: Plan, reply: AdapterReply) -> bool:
    """Whether the commit only appends a turn to the session the plan resumed: no session
    to create or retire, no handoff note, no server compaction to archive, no runtime
    state (each of those changes more of the row, or other rows, and takes the general
    path). The common case of a persistent heartbeat."""
    return (
        agent.is_persistent
        and plan.session is not None
        and not plan.new_session
        and plan.retire is None
        and plan.handoff is None
        and reply.on_commit is None
        and not starts_with_compaction(reply.content)
    )


def _session_append(*, agent: Agent, session: AgentSession, plan: Plan, staged: StagedHistory, turn: dict) -> None:
    """Inside the commit transaction: the turn recorded on the resumed session in one
    UPDATE (`commit_sql.session_turn_update`), which is the checks `_session_for_answer`
    makes and the save in one statement."""
    assigned, added, values = _session_append_values(agent, session, plan, staged, turn)
    queryset, fields = session_turn_update(SimpleNamespace(**values))
    if not queryset.update(**fields):
        _session_refusal(agent=agent, session_id=session.pk)
    _session_turn_set(session, assigned, added)


def _session_append_values(agent: Agent, session: AgentSession, plan: Plan, staged: StagedHistory, turn: dict):
    """What the UPDATE that records a turn on the resumed session assigns, what it adds, and
    the statement's values (`commit_sql.turn_values`).

    Its condition locks the agent's row first (`hot_sql.agent_not_deleted_locked`), as the
    SELECT ... FOR NO KEY UPDATE of the general path does, then the session's row (the
    UPDATE's own lock, before the run's row, the order `run_fail` takes them in), and holds
    both to the COMMIT. Once the locks are granted PostgreSQL re-reads both rows, so a
    deletion, an end of the session or another writer's turn committed meanwhile makes it
    match nothing: then, and only then, one read says which. The turns were numbered and
    the history staged from what the plan read, which the condition requires the row to
    hold still. Counters are added to the row as it is, never written back from what the
    plan read: the session's hours may be billed (`unbilled_active_seconds` zeroed) while
    the model answers."""
    assigned, added = session.turn_changes(**turn)
    values = turn_values(
        agent_id=agent.pk,
        session=session,
        message_count_was=len(plan.history),
        staged=staged,
        assigned=assigned,
        added=added,
    )
    return assigned, added, values


def _session_turn_set(session: AgentSession, assigned: dict, added: dict) -> None:
    """The instance made to hold what the turn's UPDATE wrote."""
    for name, value in assigned.items():
        setattr(session, name, value)
    for name, value in added.items():
        setattr(session, name, getattr(session, name) + value)


def _session_refusal(*, agent: Agent, session_id) -> None:
    """Why the commit's UPDATE of the session matched nothing, as `_session_for_answer`
    names it (read in the failed transaction, which rolls back)."""
    if not Agent.objects.filter(pk=agent.pk).exclude(status=AgentStatus.DELETED).exists():
        raise RunAbandoned("agent_deleted", "The agent was deleted while the model answered.")
    status = AgentSession.objects.filter(pk=session_id).values_list("status", flat=True).first()
    if status is None:
        raise RunAbandoned("session_deleted", "The session was deleted while the model answered.")
    if status not in LIVE_SESSION_STATUSES:
        raise RunAbandoned("session_ended", f"The session was {status} while the model answered.")
    # Only one run per agent may be running, so this means the one-writer rule was broken
    # (for example a run reaped while still alive). Refuse rather than lose a turn.
    raise RunAbandoned("session_conflict", "The session changed while the model answered.")


def _session_for_answer(*, agent: Agent, run: HeartbeatRun, plan: Plan, now: datetime) -> AgentSession | None:
    """Inside the commit transaction: the session row the answer goes to, locked.

    The agent row is locked first, as `agent_delete` does: a deletion either commits
    before this (the run fails `agent_deleted`) or waits and deletes the new session too.
    """
    if Agent.is_gone(agent.pk, lock=True):
        raise RunAbandoned("agent_deleted", "The agent was deleted while the model answered.")
    if not agent.is_persistent:
        return None
    if plan.retire is not None:
        _session_retire(plan, now=now, ttl=agent.session_ttl)
    if plan.new_session:
        return AgentSession.objects.create(
            agent=agent,
            company_id=agent.company_id,
            store=configured_store_name(),
            model=agent.model_name,
            adapter_type=agent.adapter_type,
            created_at=now,
            last_used=now,
            expires_at=now + agent.session_ttl,
            predecessor=plan.predecessor,
            manifest=plan.manifest,
        )
    # The history was read before the call; only the row's metadata is needed (and locked).
    session = AgentSession.objects.select_for_update().defer("history").filter(pk=plan.session.pk).first()
    if session is None:
        raise RunAbandoned("session_deleted", "The session was deleted while the model answered.")
    if session.status not in LIVE_SESSION_STATUSES:
        raise RunAbandoned("session_ended", f"The session was {session.status} while the model answered.")
    if session.message_count != len(plan.history):
        # Only one run per agent may be running, so this means the one-writer rule was
        # broken (for example a run reaped while still alive). Refuse rather than lose a turn.
        raise RunAbandoned("session_conflict", "The session changed while the model answered.")
    return session


def _session_retire(plan: Plan, *, now: datetime, ttl: timedelta) -> None:
    end_status = SessionStatus.EXPIRED if plan.retire_reason == "expired" else SessionStatus.ENDED
    ended_at = min(now, plan.retire.expiry(ttl)) if plan.retire_reason == "expired" else now
    retired = AgentSession.objects.filter(pk=plan.retire.pk, status__in=LIVE_SESSION_STATUSES).update(
        status=end_status, ended_at=ended_at, end_reason=plan.retire_reason
    )
    if not retired and plan.handoff is not None:
        if not AgentSession.objects.filter(pk=plan.retire.pk).exists():
            raise RunAbandoned(
                "session_deleted", "The session being rotated was deleted while the handoff was written."
            )
        raise RunAbandoned("session_conflict", "The session being rotated ended while the handoff was written.")
    if retired:  # its remote Managed Agents session, if any, is archived after the commit
        managed_ends_for_sessions([plan.retire.pk], action=ManagedEndAction.ARCHIVE)
    # Whoever ended it, its unbilled time is billed once (the bill zeroes what it bills).
    session_hours_bill(session_ids=[plan.retire.pk], now=now)


def heartbeat_wait(*, run_id, timeout_seconds: float, poll_seconds: float = 0.1) -> HeartbeatRun:
    """Execute a run here, waiting for the agent's current run to finish first.

    Used by `"wait": true` requests and the `heartbeat` command. If another process claims
    the run meanwhile (the cluster), this waits for it to finish instead; so it does for a
    run whose agent is pinned to another cluster (`run_queue.run_cluster`), handed to that
    cluster first. A run a quota's hold keeps queued is returned at once, queued: a web
    thread does not wait for a reset.
    """
    deadline = time.monotonic() + timeout_seconds
    handed = False
    while True:
        run = heartbeat_execute(run_id=run_id)
        if run.runs_in is not None and not handed:
            heartbeat_dispatch(run=run)
            handed = True
        if run.is_finished or time.monotonic() >= deadline:
            return run
        if run.status == RunStatus.WAITING_APPROVAL:
            return run  # an operator decides: the caller reads the run's approval and comes back
        if run.quota_held_until is not None:
            return run  # a provider's quota holds it: queued (202), it runs after the reset
        time.sleep(poll_seconds)
        poll_seconds = min(poll_seconds * 1.5, 1.0)
