"""One heartbeat, start to finish.

1. `heartbeat_enqueue` records a queued run (or returns the earlier run for a reused
   idempotency key).
2. `heartbeat_execute` claims it — one running run per agent, decided under a short lock
   on the agent row, never in process memory — then resolves the session, builds the
   request and calls the adapter outside any transaction.
3. The user turn, the answer, the session's clocks, the cost event and the run's completion
   commit together. A failed call changes no history.

The API, the `heartbeat` command, the admin and the django-q2 tasks all come through here.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from costs_app.budgets import (
    BudgetExceeded,
    budget_headroom,
    budget_reserve,
    budgets_enforce,
    budgets_exist,
    estimate_call_cost,
)
from costs_app.models import CostKind
from costs_app.pricing import billed_call_record, call_cost, cost_event_record, token_counts
from sessions_app.adapters import AdapterError, AdapterReply, AdapterRequest, get_adapter
from sessions_app.compaction import (
    Handoff,
    StepFailed,
    fit_budget,
    handoff_record,
    server_compaction_archive,
    starts_with_compaction,
    write_handoff,
)
from sessions_app.context import (
    ContextSettings,
    context_settings,
    estimate_tokens,
    manifest_merge,
    reported_artifacts,
    rotation_due,
    user_turn_content,
)
from sessions_app.metering import session_hours_bill
from sessions_app.models import (
    LIVE_SESSION_STATUSES,
    Agent,
    AgentSession,
    AgentStatus,
    HeartbeatRun,
    RunStatus,
    RunTrigger,
    SessionStatus,
)
from sessions_app.stores import HistoryUnavailable, configured_store_name, store_for
from sessions_app.text import is_storable, storable

logger = logging.getLogger(__name__)
HOSTNAME = socket.gethostname()


def worker_id() -> str:
    # Read at claim time: cluster workers are forked after this module may be imported.
    return f"{HOSTNAME}:{os.getpid()}"


class HeartbeatRefused(Exception):
    """The heartbeat cannot be queued. `code` maps to an API status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RunAbandoned(Exception):
    """The run stopped being ours while the model answered (reaped, or session gone)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


IDEMPOTENCY_KEY_LENGTH = HeartbeatRun._meta.get_field("idempotency_key").max_length


def validate_task(task: object) -> str:
    if not isinstance(task, str) or not task.strip():
        raise HeartbeatRefused("invalid_task", "task must be a non-empty string.")
    if not is_storable(task):
        raise HeartbeatRefused("invalid_task", "task must be valid Unicode without NUL characters.")
    if len(task) > settings.PAPERCLIP_MAX_TASK_CHARS:
        raise HeartbeatRefused(
            "task_too_long", f"task is {len(task)} characters; the limit is {settings.PAPERCLIP_MAX_TASK_CHARS}."
        )
    return task


def refuse_unless_active(agent: Agent) -> None:
    if agent.status == AgentStatus.DELETED:
        raise HeartbeatRefused("agent_deleted", "The agent was deleted.")
    if agent.status == AgentStatus.PAUSED and agent.paused_reason == "budget":
        raise HeartbeatRefused(
            "budget_exceeded", "The agent is paused: its budget is spent. Raise the budget to resume."
        )
    if agent.status == AgentStatus.PAUSED:
        reason = f" ({agent.paused_reason})" if agent.paused_reason else ""
        raise HeartbeatRefused("agent_paused", f"The agent is paused{reason}; resume it first.")


def heartbeat_enqueue(
    *,
    agent: Agent,
    task: str,
    now: datetime,
    idempotency_key: str | None = None,
    force_fresh: bool = False,
    trigger: str = RunTrigger.API,
) -> tuple[HeartbeatRun, bool]:
    """Create a queued run; with a used idempotency key, return the earlier run (False)."""
    if idempotency_key and (len(idempotency_key) > IDEMPOTENCY_KEY_LENGTH or not is_storable(idempotency_key)):
        raise HeartbeatRefused(
            "invalid_idempotency_key",
            f"idempotency_key must be at most {IDEMPOTENCY_KEY_LENGTH} characters of valid Unicode without NUL.",
        )
    if idempotency_key:
        earlier = HeartbeatRun.objects.filter(agent=agent, idempotency_key=idempotency_key).first()
        if earlier is not None:
            return _same_request(earlier, task), False
    refuse_unless_active(agent)
    validate_task(task)
    fields = {
        "company_id": agent.company_id,
        "agent": agent,
        "task": task,
        "idempotency_key": idempotency_key or None,
        "force_fresh": force_fresh,
        "trigger": trigger,
        "created_at": now,
    }
    try:
        with transaction.atomic():
            _refuse_when_queue_full(agent)
            # A duplicate key needs a savepoint of its own to leave the transaction usable.
            with transaction.atomic() if idempotency_key else nullcontext():
                run = HeartbeatRun.objects.create(**fields)
    except IntegrityError:
        if not idempotency_key:
            raise
        # Another request with the same key won the race; theirs is the run.
        earlier = HeartbeatRun.objects.get(agent=agent, idempotency_key=idempotency_key)
        return _same_request(earlier, task), False
    return run, True


# Keys of the transaction-level advisory lock that makes an agent's queue bound exact.
QUEUE_LOCK_NAMESPACE = 7_301


def _refuse_when_queue_full(agent: Agent) -> None:
    """Refuse `queue_full` when the agent already has PAPERCLIP_MAX_QUEUED_RUNS queued runs.

    Called inside the enqueue's transaction. Two enqueues of one agent must not both see
    room for one: on PostgreSQL they take an advisory lock on the agent until commit, which
    only enqueues take (a lock on the agent's row would also stall, and be stalled by, every
    update of the agent and every insert that references it). SQLite's IMMEDIATE
    transactions already run one writer at a time. The count reads runs_unfinished_idx and
    stops at the bound. Two agents whose ids share 31 bits share a lock, which only makes
    their enqueues wait for each other.
    """
    bound = settings.PAPERCLIP_MAX_QUEUED_RUNS
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [QUEUE_LOCK_NAMESPACE, agent.pk.int % 2**31])
    queued = HeartbeatRun.objects.filter(agent=agent, status=RunStatus.QUEUED).values("pk")[:bound].count()
    if queued >= bound:
        raise HeartbeatRefused(
            "queue_full", f"The agent already has {bound} queued runs (PAPERCLIP_MAX_QUEUED_RUNS); try again later."
        )


def _same_request(earlier: HeartbeatRun, task: str) -> HeartbeatRun:
    if earlier.task != task:
        raise HeartbeatRefused("idempotency_key_reused", "This idempotency key was already used for a different task.")
    return earlier


def heartbeat_dispatch(*, run: HeartbeatRun) -> None:
    """Hand a queued run to the django-q2 cluster once the current transaction commits."""
    from django_q.tasks import async_task

    run_id = str(run.id)
    transaction.on_commit(lambda: async_task("sessions_app.tasks.execute_run", run_id, task_name=f"heartbeat {run_id}"))


def dispatch_next_queued(*, agent_id) -> None:
    """Wake the oldest queued run of an agent (after a run finished or was reaped)."""
    nxt = (
        HeartbeatRun.objects.filter(agent_id=agent_id, status=RunStatus.QUEUED)
        .order_by("created_at")
        .only("id")
        .first()
    )
    if nxt is not None:
        heartbeat_dispatch(run=nxt)


def claim_run(*, run_id, now: datetime) -> tuple[HeartbeatRun, bool]:
    """Move a queued run to running unless another run of its agent is running.

    The database decides: a partial unique index allows one `running` row per agent, so
    of two processes claiming at once (any host, any worker) exactly one update succeeds;
    the other gets an IntegrityError and leaves its run queued. The run comes back with
    its agent and `budgeted` (whether any budget applies), all read in one query.
    """
    run = (
        HeartbeatRun.objects.select_related("agent")
        .annotate(budgeted=budgets_exist(company_id_ref="company_id", agent_id_ref="agent_id"))
        .get(id=run_id)
    )
    if run.status != RunStatus.QUEUED:
        return run, False
    agent = run.agent
    if agent.status != AgentStatus.ACTIVE:
        code = "agent_deleted" if agent.status == AgentStatus.DELETED else "agent_paused"
        if agent.paused_reason == "budget":
            code = "budget_exceeded"
        _finish_failed(run, code=code, message=f"The agent is {agent.status}.", now=now)
        run.refresh_from_db()
        return run, False
    deadline = now + timedelta(seconds=settings.PAPERCLIP_RUN_TIMEOUT_SECONDS)
    try:
        # One statement is its own transaction; only inside a caller's transaction does
        # the refusal need a savepoint to leave that transaction usable.
        with transaction.atomic() if connection.in_atomic_block else nullcontext():
            claimed = HeartbeatRun.objects.filter(id=run.id, status=RunStatus.QUEUED).update(
                status=RunStatus.RUNNING, started_at=now, deadline_at=deadline, claimed_by=worker_id()
            )
    except IntegrityError:
        return run, False  # another run of this agent is running
    if not claimed:
        run.refresh_from_db()
        return run, False
    run.status, run.started_at, run.deadline_at = RunStatus.RUNNING, now, deadline
    return run, True


@dataclass
class Plan:
    """What the model will see, and where the answer will be written."""

    session: AgentSession | None  # the live session resumed, if any
    history: list
    retire: AgentSession | None  # a live session that must end before a new one starts
    retire_reason: str
    new_session: bool
    manifest: list = field(default_factory=list)
    handoff: Handoff | None = None


def plan_session(*, agent: Agent, run: HeartbeatRun, now: datetime, settings_: ContextSettings) -> Plan:
    if not agent.is_persistent:
        return Plan(session=None, history=[], retire=None, retire_reason="", new_session=False)
    live = AgentSession.objects.filter(agent=agent, status__in=LIVE_SESSION_STATUSES).first()
    if live is None:
        return Plan(session=None, history=[], retire=None, retire_reason="", new_session=True)
    reason = ""
    if not live.is_live_at(now):
        reason = "expired"
    elif run.force_fresh:
        reason = "force_fresh"
    elif live.model != agent.model_name or live.adapter_type != agent.adapter_type:
        reason = "config_changed"
    elif rotation_due(live, settings_, now):
        reason = "rotated"
    if reason:
        return Plan(session=None, history=[], retire=live, retire_reason=reason, new_session=True)
    history = store_for(live).read(live)
    # Touch the session so neither the expiry nor the idle-pause task ends it while the
    # model answers; a paused session resumes here.
    hold = now + timedelta(seconds=settings.PAPERCLIP_RUN_TIMEOUT_SECONDS)
    AgentSession.objects.filter(pk=live.pk).update(
        last_used=now,
        expires_at=max(now + agent.session_ttl, live.expires_at or now),
        status=SessionStatus.ACTIVE,
        paused_at=None,
        pause_at=hold + idle_pause(agent),
    )
    return Plan(
        session=live, history=history, retire=None, retire_reason="", new_session=False, manifest=list(live.manifest)
    )


def heartbeat_execute(*, run_id, now: datetime | None = None) -> HeartbeatRun:
    """Run a queued run to a terminal state, or leave it queued while its agent is busy.

    `now` is the heartbeat's logical time (expiry decisions, last_used); the finish time
    adds the measured duration of the call to it.
    """
    now = now or timezone.now()
    run, claimed = claim_run(run_id=run_id, now=now)
    if not claimed:
        return run
    started = time.monotonic()
    current = False
    try:
        current = _run_claimed(run, now=now, started=started)
    except Exception:
        # Never leave a run `running` behind an unexpected error (a bug, a dropped
        # database connection): fail it with the class name and keep the traceback in logs.
        logger.exception("Heartbeat run %s failed unexpectedly", run.id)
        finished = now + timedelta(seconds=time.monotonic() - started)
        _finish_failed(
            run, code="internal_error", message="The run failed unexpectedly; see server logs.", now=finished
        )
    dispatch_next_queued(agent_id=run.agent_id)
    if not current:
        run.refresh_from_db()
    return run


def _run_claimed(run: HeartbeatRun, *, now: datetime, started: float) -> bool:
    """True when the run succeeded and `run` holds every value written to its row."""
    agent = run.agent
    settings_ = context_settings(agent)

    def elapsed() -> datetime:
        return now + timedelta(seconds=time.monotonic() - started)

    adapter = get_adapter(agent.adapter_type)
    budgeted = run.budgeted
    # Spent by this run's own earlier calls and not yet in the ledger (a handoff note is
    # recorded with the answer): held on top of each later reservation.
    unrecorded = Decimal(0)

    def reserve(request: AdapterRequest) -> None:
        # Every model call a budgeted run makes is reserved before it is sent, summaries
        # included: a budget is never crossed by a call nobody checked.
        if budgeted:
            reserve_budget(run=run, agent=agent, adapter=adapter, request=request, now=now, held=unrecorded)

    plan = None
    try:
        plan = plan_session(agent=agent, run=run, now=now, settings_=settings_)
        if plan.session is not None:
            HeartbeatRun.objects.filter(id=run.id).update(session=plan.session)
        if plan.retire_reason == "rotated":
            write_handoff(agent=agent, adapter=adapter, plan=plan, settings_=settings_, now=now, before_call=reserve)
            note = plan.handoff.reply
            if budgeted and note.usage is not None:
                unrecorded = call_cost(usage=note.usage, model=note.model or agent.model_name, at=now)
        user_content = user_turn_content(run.task, plan.manifest)
        request = fit_budget(
            agent=agent,
            adapter=adapter,
            run=run,
            plan=plan,
            user_content=user_content,
            settings_=settings_,
            now=now,
            before_call=reserve,
        )
        request.metadata = {"run_id": str(run.id), "agent_id": str(agent.id)}
        reserve(request)
        reply = adapter.call(request)
    except Exception as exc:
        _record_discarded_handoff(run, agent=agent, plan=plan, finished=elapsed())
        if not isinstance(exc, (HistoryUnavailable, StepFailed, BudgetExceeded, AdapterError)):
            raise
        # Every step's failure carries a stable code and a message for the run row.
        _finish_failed(run, code=exc.code, message=exc.message, now=elapsed())
        if isinstance(exc, BudgetExceeded):
            budgets_enforce(agent=agent, now=now)
        return False
    succeeded = _finish_succeeded(
        run, agent=agent, plan=plan, reply=reply, user_content=user_content, now=now, finished=elapsed()
    )
    if budgeted:
        budgets_enforce(agent=agent, now=now)
    # A reservation wrote its warning and amount to the row; reading it back is simpler
    # than tracking them.
    return succeeded and not budgeted


def idle_pause(agent: Agent) -> timedelta:
    minutes = agent.adapter_config.get("idle_pause_minutes") or settings.PAPERCLIP_IDLE_PAUSE_MINUTES
    return timedelta(minutes=minutes)


def reserve_budget(
    *, run: HeartbeatRun, agent: Agent, adapter, request: AdapterRequest, now: datetime, held: Decimal = Decimal(0)
) -> None:
    """Refuse before the call when it could cross a hard limit; hold its estimate otherwise.

    The size comes from a character estimate; only when that lands near the money left is
    it measured with count_tokens, so a call far over (or far under) a limit costs no
    extra request. `held` is what this run already spent outside the ledger.
    """
    max_output = request.max_tokens or int(agent.adapter_config.get("max_tokens") or 4096)
    size = estimate_tokens({"system": request.system_blocks or request.system, "messages": request.messages})
    estimate = estimate_call_cost(model=request.model, input_tokens=size, max_output_tokens=max_output, at=now)
    headroom = budget_headroom(company_id=agent.company_id, agent_id=agent.id, now=now, exclude_run_id=run.id)
    near = headroom is not None and headroom / 2 <= estimate + held <= headroom * Decimal("1.5")
    if near and hasattr(adapter, "count_tokens"):
        try:
            size = adapter.count_tokens(request)
            estimate = estimate_call_cost(model=request.model, input_tokens=size, max_output_tokens=max_output, at=now)
        except AdapterError:
            pass  # the character estimate is conservative enough to decide on
    warning = budget_reserve(run=run, agent=agent, estimate=estimate + held, now=now)
    if warning:
        HeartbeatRun.objects.filter(id=run.id).update(warning=warning[:2000])


def _finish_failed(run: HeartbeatRun, *, code: str, message: str, now: datetime) -> None:
    # Messages quote what failed (an agent command's stderr, an API error body): made
    # storable, or the failure itself would fail to be written.
    HeartbeatRun.objects.filter(id=run.id, status__in=[RunStatus.QUEUED, RunStatus.RUNNING]).update(
        status=RunStatus.FAILED, error_code=code, error=storable(message[:5000]), finished_at=now, reserved_usd=0
    )


def _finish_succeeded(
    run: HeartbeatRun,
    *,
    agent: Agent,
    plan: Plan,
    reply: AdapterReply,
    user_content,
    now: datetime,
    finished: datetime,
) -> bool:
    """Commit the answer; True when it committed and `run` was brought up to date."""
    counts = token_counts(reply.usage) if reply.usage is not None else None
    store = None
    session = None
    try:
        with transaction.atomic():
            session = _session_for_answer(agent=agent, run=run, plan=plan, now=now)
            cost_event = None
            if reply.usage is not None:
                cost_event = cost_event_record(
                    usage=reply.usage,
                    model=reply.model or agent.model_name,
                    company_id=agent.company_id,
                    agent_id=agent.id,
                    session_id=session.id if session else None,
                    run_id=run.id,
                    message_id=reply.message_id or None,
                    at=finished,
                )
            cost = cost_event.cost_usd if cost_event is not None else None
            if session is not None:
                store = store_for(session)
                new_turns = [
                    {
                        "role": "user",
                        "content": user_content,
                        "at": now.isoformat(),
                        "run_id": str(run.id),
                        "seq": session.next_seq,
                    },
                    {
                        "role": "assistant",
                        "content": reply.content,
                        "at": finished.isoformat(),
                        "run_id": str(run.id),
                        "seq": session.next_seq + 1,
                        "message_id": reply.message_id,
                        "usage": counts.__dict__ if counts else None,
                        "cost_usd": str(cost) if cost is not None else None,
                    },
                ]
                turns = plan.history + new_turns
                if starts_with_compaction(reply.content):
                    # Server-side compaction: the API ignores everything before the
                    # compaction block from now on, so those turns move to the archive.
                    server_compaction_archive(session, run=run, archived=plan.history, reply=reply, at=finished)
                    turns = new_turns
                if plan.handoff is not None:
                    handoff_record(session, run=run, handoff=plan.handoff, at=now)
                if turns is new_turns or plan.new_session:
                    store.prepare(session, turns)
                else:
                    store.append(session, plan.history, new_turns)
                session.message_count = len(turns)
                session.next_seq += 2
                session.turn_count += 1
                session.manifest = manifest_merge(
                    plan.manifest, reported_artifacts(reply.text, reply.artifacts), at=finished
                )
                session.last_used = finished
                session.expires_at = finished + agent.session_ttl
                session.status = SessionStatus.ACTIVE
                session.paused_at = None
                session.pause_at = finished + idle_pause(agent)
                active = max((finished - now).total_seconds(), 0.0)
                session.active_seconds += active
                session.unbilled_active_seconds += active
                if counts is not None:
                    session.last_input_tokens = counts.total_input_tokens
                    session.total_input_tokens += counts.total_input_tokens
                    session.total_output_tokens += counts.output_tokens
                if cost is not None:
                    session.total_cost_usd += cost
                session.save()
            outcome = {
                "status": RunStatus.SUCCEEDED,
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
            }
            updated = HeartbeatRun.objects.filter(id=run.id, status=RunStatus.RUNNING).update(**outcome)
            if not updated:
                raise RunAbandoned("run_timeout", "The run was reaped as timed out before its answer arrived.")
            if store is not None:
                store.commit(session)
    except Exception as exc:
        if store is not None:
            store.discard(session)
        _record_discarded_calls(run, agent=agent, plan=plan, reply=reply, finished=finished)
        if not isinstance(exc, (RunAbandoned, HistoryUnavailable)):
            raise
        _finish_failed(run, code=exc.code, message=exc.message, now=finished)
        return False
    for name, value in outcome.items():
        setattr(run, name, value)
    return True


def _session_for_answer(*, agent: Agent, run: HeartbeatRun, plan: Plan, now: datetime) -> AgentSession | None:
    """Inside the commit transaction: the session row the answer goes to, locked."""
    if not agent.is_persistent:
        return None
    if plan.retire is not None:
        end_status = SessionStatus.EXPIRED if plan.retire_reason == "expired" else SessionStatus.ENDED
        ended_at = min(now, plan.retire.expires_at) if plan.retire_reason == "expired" else now
        retired = AgentSession.objects.filter(pk=plan.retire.pk, status__in=LIVE_SESSION_STATUSES).update(
            status=end_status, ended_at=ended_at, end_reason=plan.retire_reason
        )
        if not retired and plan.handoff is not None:
            raise RunAbandoned("session_conflict", "The session being rotated ended while the handoff was written.")
        session_hours_bill(session_ids=[plan.retire.pk], now=now)
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
            predecessor=plan.handoff.predecessor if plan.handoff else None,
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


def _record_spend_only(
    run: HeartbeatRun, *, agent: Agent, reply: AdapterReply, finished: datetime, kind: str = CostKind.MESSAGE
) -> None:
    """The answer is discarded but the call was billed: the ledger still records it."""
    billed_call_record(
        usage=reply.usage,
        model=reply.model or agent.model_name,
        company_id=agent.company_id,
        agent_id=agent.id,
        run_id=run.id,
        message_id=reply.message_id or None,
        kind=kind,
        at=finished,
    )


def _record_discarded_handoff(run: HeartbeatRun, *, agent: Agent, plan: Plan | None, finished: datetime) -> None:
    # A handoff note's cost is written with the answer; when the run fails after the note
    # was written, the call was still billed.
    if plan is not None and plan.handoff is not None:
        _record_spend_only(run, agent=agent, reply=plan.handoff.reply, finished=finished, kind=CostKind.COMPACTION)


def _record_discarded_calls(
    run: HeartbeatRun, *, agent: Agent, plan: Plan, reply: AdapterReply, finished: datetime
) -> None:
    _record_spend_only(run, agent=agent, reply=reply, finished=finished)
    _record_discarded_handoff(run, agent=agent, plan=plan, finished=finished)


def heartbeat_wait(*, run_id, timeout_seconds: float, poll_seconds: float = 0.1) -> HeartbeatRun:
    """Execute a run here, waiting for the agent's current run to finish first.

    Used by `"wait": true` requests and the `heartbeat` command. If another process claims
    the run meanwhile (the cluster), this waits for it to finish instead.
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        run = heartbeat_execute(run_id=run_id)
        if run.is_finished or time.monotonic() >= deadline:
            return run
        time.sleep(poll_seconds)
        poll_seconds = min(poll_seconds * 1.5, 1.0)
