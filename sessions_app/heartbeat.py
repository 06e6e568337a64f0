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
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Exists
from django.utils import timezone

from costs_app.budgets import (
    BudgetExceeded,
    budget_headroom,
    budget_reserve,
    budgets_enforce,
    budgets_exist,
    budgets_for,
    estimate_call_cost,
    money_limits_of,
)
from costs_app.models import CostKind
from costs_app.pricing import billed_call_record, call_cost, cost_event_record, price_for, token_counts
from sessions_app.adapters import ADAPTERS, AdapterError, AdapterReply, AdapterRequest, get_adapter
from sessions_app.compaction import (
    Handoff,
    fit_budget,
    handoff_record,
    server_compaction_archive,
    starts_with_compaction,
    write_handoff,
)
from sessions_app.context import (
    SUMMARY_KINDS,
    ContextSettings,
    context_settings,
    estimate_tokens,
    manifest_merge,
    reported_artifacts,
    rotation_due,
    user_turn_content,
)
from sessions_app.errors import HeartbeatRefused, RunAbandoned, RunFailure
from sessions_app.metering import session_hours_bill
from sessions_app.models import (
    LIVE_SESSION_STATUSES,
    Agent,
    AgentSession,
    AgentStatus,
    HeartbeatRun,
    HistoryStore,
    RunStatus,
    RunTrigger,
    SessionStatus,
)
from sessions_app.stores import configured_store_name, store_for
from sessions_app.text import is_storable, storable

logger = logging.getLogger(__name__)
HOSTNAME = socket.gethostname()


def worker_id() -> str:
    # Read at claim time: cluster workers are forked after this module may be imported.
    return f"{HOSTNAME}:{os.getpid()}"


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


def refuse_unpriced(agent: Agent, *, now: datetime) -> None:
    """A budgeted agent whose model has no price is refused before anything is queued:
    its calls could not be held against the budget (each run would fail model_unpriced)."""
    if not any(money_limits_of(b) for b in budgets_for(company_id=agent.company_id, agent_id=agent.id)):
        return
    models = {agent.model_name}
    if agent.is_persistent:
        models.add(context_settings(agent).summary_model)
    unpriced = sorted(model for model in models if price_for(model=model, at=now) is None)
    if unpriced:
        raise HeartbeatRefused(
            "model_unpriced",
            f"The agent has a budget but its model {unpriced[0]!r} has no price, so its calls cannot be held "
            "against the budget. Add a model price (admin: Costs > Model prices) or configure a priced model.",
        )


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
    refuse_unpriced(agent, now=now)
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
    deadline = run_deadline(ADAPTERS.get(agent.adapter_type), agent.adapter_config, at=now)
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


def run_deadline(adapter, config: dict, *, at: datetime) -> datetime:
    """When a run whose next call starts at `at` is presumed dead: that call's own limit
    (the agent's timeout for each attempt, its retries and the waits between them) plus
    PAPERCLIP_RUN_TIMEOUT_SECONDS for the work around it (history, commit)."""
    try:
        seconds = adapter.call_seconds(config) if adapter is not None else 0
    except (TypeError, ValueError):
        # A configuration edited past validation: the claim must not fail on it (the
        # call will, with its own error); the run timeout alone bounds the wait.
        seconds = 0
    return at + timedelta(seconds=seconds + settings.PAPERCLIP_RUN_TIMEOUT_SECONDS)


class RunCalls:
    """The adapter as one run uses it.

    - Numbers the run's model calls: the run and the number are the ledger's identity of
      a call, never an id the answer reports.
    - Before every request after the first (a summary, the answer after a handoff note, a
      token count), moves the run's deadline to cover it, so a run of many calls is reaped
      only when one of them overruns its own limit; the claim's deadline covers the first.
      A run the reaper failed meanwhile sends nothing more: run_timeout.
    """

    def __init__(self, adapter, *, run: HeartbeatRun, clock) -> None:
        self._adapter = adapter
        self._run = run
        self._clock = clock
        self._requests = 0
        self._calls = 0

    def call(self, request: AdapterRequest) -> AdapterReply:
        self._hold_deadline(request)
        self._calls += 1
        number = self._calls
        return replace(self._adapter.call(request), call_number=number)

    def __getattr__(self, name: str):
        # Everything else is the adapter's own; `hasattr(adapter, "count_tokens")` still
        # tells whether it can measure a request.
        attribute = getattr(self._adapter, name)
        if name != "count_tokens":
            return attribute

        def count_tokens(request: AdapterRequest) -> int:
            self._hold_deadline(request)
            return attribute(request)

        return count_tokens

    def _hold_deadline(self, request: AdapterRequest) -> None:
        self._requests += 1
        if self._requests == 1:
            return
        deadline = run_deadline(self._adapter, request.config, at=self._clock())
        if not HeartbeatRun.objects.filter(id=self._run.id, status=RunStatus.RUNNING).update(deadline_at=deadline):
            raise RunAbandoned("run_timeout", "The run was reaped as timed out; it made no further call.")


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
    fresh = Plan(session=None, history=[], retire=None, retire_reason="", new_session=True)
    live = AgentSession.objects.filter(agent=agent, status__in=LIVE_SESSION_STATUSES).first()
    if live is None:
        return fresh
    reason = retire_reason(live, agent=agent, run=run, now=now, settings_=settings_)
    if reason == "rotated" and not _link_run(run, live):
        return fresh  # it ended (or was deleted) meanwhile: nothing is left to rotate
    if reason:
        return Plan(session=None, history=[], retire=live, retire_reason=reason, new_session=True)
    history = store_for(live).read(live)
    live = _take_session(live, agent=agent, run=run, history=history, now=now)
    if live is None:
        return fresh  # expired, ended or deleted since it was read: never resurrected
    return Plan(
        session=live, history=history, retire=None, retire_reason="", new_session=False, manifest=list(live.manifest)
    )


def retire_reason(live: AgentSession, *, agent: Agent, run: HeartbeatRun, now: datetime, settings_) -> str:
    """Why the live session cannot take this run ("" when it can). A session inserted by
    raw SQL names no model or adapter: it continues with the agent's."""
    if not live.is_live_at(now):
        return "expired"
    if run.force_fresh:
        return "force_fresh"
    if live.model not in ("", agent.model_name) or live.adapter_type not in ("", agent.adapter_type):
        return "config_changed"
    if rotation_due(live, settings_, now):
        return "rotated"
    return ""


def _link_run(run: HeartbeatRun, session: AgentSession) -> bool:
    """Mark `session` as in use by `run` (the sweeps skip sessions with a running run),
    unless it is no longer live. False when it is gone or ended."""
    still_live = AgentSession.objects.filter(pk=session.pk, status__in=LIVE_SESSION_STATUSES)
    try:
        return bool(HeartbeatRun.objects.filter(id=run.id).filter(Exists(still_live)).update(session=session))
    except IntegrityError:
        # A delete committed between the check and this update: the (deferred) foreign
        # key fails when this one-statement transaction commits.
        return False


def _take_session(
    live: AgentSession, *, agent: Agent, run: HeartbeatRun, history: list, now: datetime
) -> AgentSession | None:
    """Resume `live` for this run; None when it stopped being live after it was read.

    The run is linked first, so from then on neither sweep expires or pauses the session;
    a sweep that ended it before the link makes the conditional update below find
    nothing, and the run starts a fresh session instead of resurrecting it.
    """
    if not _link_run(run, live):
        return None
    fields = {
        "last_used": now,
        "expires_at": max(now + agent.session_ttl, live.expires_at or now),
        "status": SessionStatus.ACTIVE,
        "paused_at": None,
        "pause_at": now + timedelta(seconds=settings.PAPERCLIP_RUN_TIMEOUT_SECONDS) + idle_pause(agent),
        **_repairs(live, agent=agent, history=history),
    }
    if not AgentSession.objects.filter(pk=live.pk, status__in=LIVE_SESSION_STATUSES).update(**fields):
        HeartbeatRun.objects.filter(id=run.id, session=live.pk).update(session=None)
        return None
    for name, value in fields.items():
        setattr(live, name, value)
    return live


def _repairs(live: AgentSession, *, agent: Agent, history: list) -> dict:
    """Fields a row inserted by raw SQL leaves at their defaults, derived from what it holds:
    the agent's model and adapter, and the counts of the history in its `history` column."""
    repairs = {}
    if not live.model:
        repairs["model"] = agent.model_name
    if not live.adapter_type:
        repairs["adapter_type"] = agent.adapter_type
    if live.store == HistoryStore.DATABASE and live.message_count != len(history):
        repairs["message_count"] = len(history)
    numbered = live.archived_message_count + sum(1 for m in history if m.get("kind") not in SUMMARY_KINDS)
    if live.next_seq < numbered:
        repairs["next_seq"] = numbered
    return repairs


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
    if run.status == RunStatus.FAILED and run.session_id is not None:
        session_release(session_id=run.session_id, agent=run.agent, finished=run.finished_at or now)
    return run


def session_release(*, session_id, agent: Agent, finished: datetime) -> None:
    """After a failed run: its session's TTL counts from the end of the run, as after a
    committed answer (the sweep skipped it while the run was in progress)."""
    until = finished + agent.session_ttl
    AgentSession.objects.filter(pk=session_id, status__in=LIVE_SESSION_STATUSES, expires_at__lt=until).update(
        expires_at=until
    )


def _run_claimed(run: HeartbeatRun, *, now: datetime, started: float) -> bool:
    """True when the run succeeded and `run` holds every value written to its row."""
    agent = run.agent
    settings_ = context_settings(agent)

    def elapsed() -> datetime:
        return now + timedelta(seconds=time.monotonic() - started)

    adapter = RunCalls(get_adapter(agent.adapter_type), run=run, clock=elapsed)
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
        if plan.retire_reason == "rotated":
            write_handoff(agent=agent, adapter=adapter, plan=plan, settings_=settings_, now=now, before_call=reserve)
            note = plan.handoff.reply
            if budgeted and note.usage is not None:
                unrecorded = call_cost(usage=note.usage, model=note.priced_model, at=now)
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
        if not isinstance(exc, RunFailure):
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
    pricing = {
        "model": request.model,
        "max_output_tokens": max_output,
        "at": now,
        "cache_lifetimes": cache_lifetimes([request.system_blocks, request.messages]),
        "samplings": 2 if request.config.get("context_strategy") == "server" else 1,
    }
    estimate = estimate_call_cost(input_tokens=size, **pricing)
    if estimate is not None and hasattr(adapter, "count_tokens"):
        headroom = budget_headroom(company_id=agent.company_id, agent_id=agent.id, now=now, exclude_run_id=run.id)
        if headroom is not None and headroom / 2 <= estimate + held <= headroom * Decimal("1.5"):
            try:
                estimate = estimate_call_cost(input_tokens=adapter.count_tokens(request), **pricing)
            except AdapterError:
                pass  # the character estimate is conservative enough to decide on
    total = estimate + held if estimate is not None else None
    warning = budget_reserve(run=run, agent=agent, estimate=total, now=now, model=request.model)
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
    staged = None
    try:
        # Durable: its end is the COMMIT, and the history is published only after it.
        with transaction.atomic(durable=True):
            session = _session_for_answer(agent=agent, run=run, plan=plan, now=now)
            cost_event = None
            if reply.usage is not None:
                cost_event = cost_event_record(
                    usage=reply.usage,
                    model=reply.priced_model,
                    company_id=agent.company_id,
                    agent_id=agent.id,
                    session_id=session.id if session else None,
                    run_id=run.id,
                    call_number=reply.call_number,
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
                    staged = store.stage(session, turns)
                else:
                    staged = store.stage_append(session, plan.history, new_turns)
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
    except Exception as exc:
        if staged is not None:
            staged.discard()
        _record_discarded_calls(run, agent=agent, plan=plan, reply=reply, finished=finished)
        if not isinstance(exc, RunFailure):
            raise
        _finish_failed(run, code=exc.code, message=exc.message, now=finished)
        return False
    if staged is not None:
        staged.publish()
    for name, value in outcome.items():
        setattr(run, name, value)
    return True


def _session_for_answer(*, agent: Agent, run: HeartbeatRun, plan: Plan, now: datetime) -> AgentSession | None:
    """Inside the commit transaction: the session row the answer goes to, locked.

    The agent row is locked first, as `agent_delete` does: a deletion either commits
    before this (the run fails `agent_deleted`) or waits and deletes the new session too.
    """
    status = Agent.objects.select_for_update(no_key=True).filter(pk=agent.pk).values_list("status", flat=True)
    if status.first() in (None, AgentStatus.DELETED):
        raise RunAbandoned("agent_deleted", "The agent was deleted while the model answered.")
    if not agent.is_persistent:
        return None
    if plan.retire is not None:
        _session_retire(plan, now=now)
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


def _session_retire(plan: Plan, *, now: datetime) -> None:
    end_status = SessionStatus.EXPIRED if plan.retire_reason == "expired" else SessionStatus.ENDED
    ended_at = min(now, plan.retire.expires_at) if plan.retire_reason == "expired" else now
    retired = AgentSession.objects.filter(pk=plan.retire.pk, status__in=LIVE_SESSION_STATUSES).update(
        status=end_status, ended_at=ended_at, end_reason=plan.retire_reason
    )
    if not retired and plan.handoff is not None:
        if not AgentSession.objects.filter(pk=plan.retire.pk).exists():
            raise RunAbandoned(
                "session_deleted", "The session being rotated was deleted while the handoff was written."
            )
        raise RunAbandoned("session_conflict", "The session being rotated ended while the handoff was written.")
    # Whoever ended it, its unbilled time is billed once (the bill zeroes what it bills).
    session_hours_bill(session_ids=[plan.retire.pk], now=now)


def _record_spend_only(
    run: HeartbeatRun, *, agent: Agent, reply: AdapterReply, finished: datetime, kind: str = CostKind.MESSAGE
) -> None:
    """The answer is discarded but the call was billed: the ledger still records it."""
    billed_call_record(
        usage=reply.usage,
        model=reply.priced_model,
        company_id=agent.company_id,
        agent_id=agent.id,
        run_id=run.id,
        call_number=reply.call_number,
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
