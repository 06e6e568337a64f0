"""The run queue: how a run is recorded, handed to a worker and claimed.

- `heartbeat_enqueue` validates a task and records a queued run, exactly bounded per agent
  (PAPERCLIP_MAX_QUEUED_RUNS) and merging scheduled ticks into an unfinished run;
- `heartbeat_dispatch` and its callers hand queued runs to the django-q2 cluster, oldest
  first, under PAPERCLIP_MAX_CONCURRENT_RUNS;
- `claim_run` moves a queued run to running: one per agent, decided by the database,
  within the deployment's cap;
- `run_fail` ends a queued or running run as failed, whoever ends it, and gives its session
  the run's time and a TTL from its end.

The heartbeat engine (`sessions_app.heartbeat`) runs what is claimed here.
"""

from __future__ import annotations

import logging
import os
import socket
from contextlib import nullcontext
from datetime import datetime, timedelta
from types import SimpleNamespace

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Count, Exists, F, Min, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce

from costs_app.budgets import budgets_exist, money_budgets_exist
from costs_app.ledger import spend_of
from costs_app.models import Delivery
from costs_app.pricing import is_priced, overrides_revision, overrides_revision_seen
from sessions_app import quota
from sessions_app.adapters import adapter_for
from sessions_app.batch_delivery import claimable, run_delivery
from sessions_app.context import context_settings
from sessions_app.context_defaults import recent_wakes_columns, recent_wakes_of
from sessions_app.errors import HeartbeatRefused
from sessions_app.hot_sql import (
    CompiledLookup,
    CompiledUpdate,
    pipelines,
    queued_run_insert,
    queued_run_insert_locking,
    write_then_read,
)
from sessions_app.metering import alone_seconds, session_run_time_record, unrecorded_time_bill
from sessions_app.model_checks import retired_model_refusal
from sessions_app.models import (
    HOLDS_AGENT_PLACE,
    UNFINISHED_RUN_STATUSES,
    Agent,
    AgentSession,
    AgentStatus,
    BesideState,
    CredentialHold,
    HeartbeatRun,
    ReadAhead,
    RunStatus,
    RunTrigger,
)
from sessions_app.plan import LiveSessionRead
from sessions_app.text import is_storable, storable
from sessions_app.work_checks import check_seconds

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
    if refusal := agent.refusal():
        raise HeartbeatRefused(*refusal)


def refuse_retired(agent: Agent) -> None:
    """A model the catalogue lists as retired fails every call: refused before anything is
    queued (runs queued before it retired fail so at their claim)."""
    if message := retired_model_refusal(agent.adapter_config):
        raise HeartbeatRefused("model_retired", message)


def _models_of(agent: Agent, *, now: datetime) -> set[str]:
    """The models an agent's runs call: its own, and its summaries' when it keeps a session."""
    models = {agent.model_name}
    if agent.is_persistent:
        models.add(context_settings(agent, now=now).summary_model)
    return models


def _keyed(agent: Agent, idempotency_key: str) -> HeartbeatRun | None:
    return HeartbeatRun.objects.filter(agent=agent, idempotency_key=idempotency_key).first()


def refuse_unpriced(agent: Agent, *, now: datetime) -> None:
    """An agent under a money budget whose model has no price is refused before anything
    is queued: its calls could not be held against the budget (each run would fail
    model_unpriced). Called only for such agents (`_refuse_when_queue_full_or_unpriced`)."""
    unpriced = sorted(model for model in _models_of(agent, now=now) if not is_priced(model=model, at=now))
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
    merge: bool = False,
    delivery: str | None = None,
) -> tuple[HeartbeatRun, bool]:
    """Create a queued run; with a used idempotency key, return the earlier run (False).
    With `merge` (a scheduled tick), an agent that has a queued or running run gets no
    other: the tick is counted on that run, which is returned (False), whatever its
    delivery. `delivery` is what an API caller asked for (`run_delivery`).

    The task and delivery are validated first, as input is everywhere (400 before any
    state's 409)."""
    validate_task(task)
    delivery = run_delivery(agent, trigger=trigger, asked=delivery)
    if idempotency_key and (len(idempotency_key) > IDEMPOTENCY_KEY_LENGTH or not is_storable(idempotency_key)):
        raise HeartbeatRefused(
            "invalid_idempotency_key",
            f"idempotency_key must be at most {IDEMPOTENCY_KEY_LENGTH} characters of valid Unicode without NUL.",
        )
    if idempotency_key:
        earlier = _keyed(agent, idempotency_key)
        if earlier is not None:
            return _same_request(earlier, task, delivery), False
    refuse_unless_active(agent)
    refuse_retired(agent)
    fields = {
        "company_id": agent.company_id,
        "agent": agent,
        "task": task,
        "idempotency_key": idempotency_key or None,
        "force_fresh": force_fresh,
        "trigger": trigger,
        "delivery": delivery,
        "created_at": now,
    }
    # Whether a money budget applies is read only for an agent whose models are not all
    # priced (from memory): only then can it be refused `model_unpriced`.
    priced = all(is_priced(model=model, at=now) for model in _models_of(agent, now=now))
    try:
        if priced and not merge and _queued_at_once(run := HeartbeatRun(**fields), agent=agent):
            return run, True
        with transaction.atomic():
            _queue_lock(agent)
            if merge and (merged := tick_merge(agent_id=agent.pk)) is not None:
                return merged, False
            if priced:
                run = HeartbeatRun(**fields)
                if queued_run_insert(run, agent_id=agent.pk, bound=settings.PAPERCLIP_MAX_QUEUED_RUNS):
                    return run, True
                # Nothing inserted: the key's earlier run, or a full queue (read only now).
                if idempotency_key and (earlier := _keyed(agent, idempotency_key)) is not None:
                    return _same_request(earlier, task, delivery), False
            _refuse_when_queue_full_or_unpriced(agent, now=now)
            # A duplicate key needs a savepoint of its own to leave the transaction usable.
            with transaction.atomic() if idempotency_key else nullcontext():
                run = HeartbeatRun.objects.create(**fields)
    except IntegrityError:
        if not idempotency_key:
            raise
        # Another request with the same key won the race; theirs is the run.
        earlier = HeartbeatRun.objects.get(agent=agent, idempotency_key=idempotency_key)
        return _same_request(earlier, task, delivery), False
    return run, True


# Keys of the transaction-level advisory lock that makes an agent's queue bound exact.
QUEUE_LOCK_NAMESPACE = 7_301


def _queue_lock(agent: Agent) -> None:
    """Inside the enqueue's transaction, until it ends: one enqueue of the agent at a time.

    Two enqueues of one agent must not both see room for one run (the queue bound), nor two
    ticks both see no run to merge into. On PostgreSQL they take an advisory lock on the
    agent, which only enqueues take (a lock on the agent's row would also stall, and be
    stalled by, every update of the agent and every insert that references it); SQLite's
    IMMEDIATE transactions already run one writer at a time. Two agents whose ids share 31
    bits share a lock, which only makes their enqueues wait for each other."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(*_queue_lock_statement(agent))


def _queue_lock_statement(agent: Agent) -> tuple[str, list]:
    return "SELECT pg_advisory_xact_lock(%s, %s)", [QUEUE_LOCK_NAMESPACE, agent.pk.int % 2**31]


def _queued_at_once(run: HeartbeatRun, *, agent: Agent) -> bool:
    """The common enqueue on PostgreSQL outside a caller's transaction (an API request, the
    `heartbeat` command; not a tick, which may merge): the transaction, the queue lock and
    the bounded INSERT in one round trip (`hot_sql.queued_run_insert_locking`). False when
    that does not apply or inserted nothing; the enqueue's transaction then finds out why."""
    if not pipelines():
        return False
    return queued_run_insert_locking(
        run, agent_id=agent.pk, bound=settings.PAPERCLIP_MAX_QUEUED_RUNS, lock=_queue_lock_statement(agent)
    )


# The task of compact-now's run (`sessions_app.compact_now`): a run of the agent that only
# summarises its session.
COMPACT_TASK = "Compact the session now."
REFRESH_TASK = "Refresh the cached prompt."
# Runs of an agent that do no task of its own: no tick is counted on them.
NO_TASK_RUNS = (COMPACT_TASK, REFRESH_TASK)


def tick_merge(*, agent_id) -> HeartbeatRun | None:
    """No pile-up: a tick for an agent with a queued or running run is counted on that run
    (its oldest queued one, else the running one) instead of queueing another. Returns that
    run, or None when the agent has no unfinished run. Called under `_queue_lock`, so no
    other tick counts itself meanwhile.

    The UPDATE re-checks the status, so a run that finished meanwhile is not counted: the
    tick then queues a run of its own. A compaction's or a cache refresh's run does no task,
    so a tick is never counted on it (a heartbeat asked for with that very task text is passed over too: its
    tick queues a run of its own, which loses nothing)."""
    unfinished = HeartbeatRun.objects.filter(agent_id=agent_id).exclude(task__in=NO_TASK_RUNS)
    for status in (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.SUBMITTED):
        oldest = unfinished.filter(status=status).order_by("created_at").first()
        if oldest and HeartbeatRun.objects.filter(pk=oldest.pk, status=status).update(
            merged_ticks=F("merged_ticks") + 1
        ):
            oldest.merged_ticks += 1
            return oldest
    return None


def _refuse_when_queue_full_or_unpriced(agent: Agent, *, now: datetime) -> None:
    """Refuse `model_unpriced` (`refuse_unpriced`), then `queue_full` when the agent already
    has PAPERCLIP_MAX_QUEUED_RUNS queued runs.

    Called inside the enqueue's transaction, under `_queue_lock`: the count is exact. It
    reads runs_unfinished_idx. The enqueue of an agent whose models are priced counts in
    its INSERT instead (`hot_sql.queued_run_insert`) and comes here only to say why that
    inserted nothing; an agent with an unpriced model comes here first, and whether a money
    budget applies is read in the same query as the count.
    """
    bound = settings.PAPERCLIP_MAX_QUEUED_RUNS
    queued_runs = (
        HeartbeatRun.objects.filter(agent_id=OuterRef("pk"), status=RunStatus.QUEUED)
        .order_by()
        .values("agent_id")
        .annotate(n=Count("pk"))
        .values("n")
    )
    found = (
        Agent.objects.filter(pk=agent.pk)
        .annotate(
            queued=Coalesce(Subquery(queued_runs), 0),
            budgeted=money_budgets_exist(company_id_ref="company_id", agent_id_ref="pk"),
        )
        .values_list("queued", "budgeted")
        .first()
    )
    # A deleted row leaves the insert's foreign key to refuse the run, as before.
    queued, budgeted = found or (0, False)
    if budgeted:
        refuse_unpriced(agent, now=now)
    if queued >= bound:
        raise HeartbeatRefused(
            "queue_full", f"The agent already has {bound} queued runs (PAPERCLIP_MAX_QUEUED_RUNS); try again later."
        )


def _same_request(earlier: HeartbeatRun, task: str, delivery: str) -> HeartbeatRun:
    """The earlier run, as the answer to a repeated key. Asked for batch, a direct run is
    still the answer (it is only sooner); asked direct, a batch run is not: the caller
    would wait for a batch it did not ask for."""
    if earlier.task != task:
        raise HeartbeatRefused("idempotency_key_reused", "This idempotency key was already used for a different task.")
    if delivery == Delivery.DIRECT and earlier.delivery == Delivery.BATCH:
        raise HeartbeatRefused(
            "idempotency_key_reused", 'This idempotency key was already used for a heartbeat with "delivery": "batch".'
        )
    return earlier


def heartbeat_dispatch(*, run: HeartbeatRun) -> None:
    """Hand a queued run to the django-q2 cluster once the current transaction commits: the
    one its agent is pinned to (`run_cluster`), or the deployment's."""
    from django_q.tasks import async_task

    run_id = str(run.id)
    config = run.agent.adapter_config if HeartbeatRun.agent.is_cached(run) else _agent_config(run.agent_id)
    cluster = run_cluster(config)
    transaction.on_commit(
        lambda: async_task("sessions_app.tasks.execute_run", run_id, task_name=f"heartbeat {run_id}", cluster=cluster)
    )


def run_cluster(config: dict) -> str | None:
    """The task cluster an agent's runs execute in: its `cluster`, the PAPERCLIP_CLUSTER_NAME
    of a host's cluster (a Claude Code agent's workspace is on that host's disk), or None
    for the deployment's."""
    return config.get("cluster") or None


def runs_elsewhere(config: dict) -> str | None:
    """The cluster the agent's runs execute in when it is not this process's, else None."""
    cluster = run_cluster(config)
    return cluster if cluster not in (None, settings.PAPERCLIP_CLUSTER_NAME) else None


def _agent_config(agent_id) -> dict:
    return Agent.objects.filter(pk=agent_id).values_list("adapter_config", flat=True).first() or {}


def dispatch_next_queued(*, agent_id, read: ReadAhead | None = None) -> None:
    """Wake the oldest queued run of an agent (after a run finished or was reaped); `read`:
    that run as read after the run's end was committed (read now without it)."""
    nxt = read.row if read is not None else NEXT_QUEUED.first(agent_id)
    if nxt is not None:
        heartbeat_dispatch(run=nxt)


def next_queued_query(agent_id):
    return HeartbeatRun.objects.filter(agent_id=agent_id, status=RunStatus.QUEUED).order_by("created_at").only("id")[:1]


# Every heartbeat's release reads it: compiled once per connection (`hot_sql.CompiledLookup`).
NEXT_QUEUED = CompiledLookup(next_queued_query)


def dispatch_waiting(*, agent_ids=None) -> int:
    """Wake the oldest queued run of each agent with nothing running, oldest first; under
    PAPERCLIP_MAX_CONCURRENT_RUNS only as many active agents' runs as there are free places
    (a paused or deleted agent's run is woken regardless: its claim fails it). Returns how
    many agents were woken. Used after a run finishes and by the maintenance pass."""
    free = free_run_places()
    waiting = HeartbeatRun.objects.filter(status=RunStatus.QUEUED)
    if agent_ids is not None:
        waiting = waiting.filter(agent_id__in=agent_ids)
    # An agent with a run in flight holding its place (running, or submitted in a batch;
    # not a summary written beside its heartbeats) cannot start another.
    running = HeartbeatRun.objects.filter(HOLDS_AGENT_PLACE).values("agent_id")
    heads = (
        waiting.exclude(agent_id__in=running)
        .values("agent_id", "agent__status")
        .annotate(first=Min("created_at"))
        .order_by("first")
    )
    chosen = []
    for head in heads.iterator():
        if free is not None and head["agent__status"] == AgentStatus.ACTIVE:
            if free <= 0:
                continue
            free -= 1
        chosen.append(head["agent_id"])
    # Only once the query is read to its end: an enqueue on the database broker closes the
    # connection (CONN_MAX_AGE=0 on SQLite), and with it a cursor still being read.
    for agent_id in chosen:
        dispatch_next_queued(agent_id=agent_id)
    return len(chosen)


def free_run_places() -> int | None:
    """Places left under PAPERCLIP_MAX_CONCURRENT_RUNS (None: no cap)."""
    cap = settings.PAPERCLIP_MAX_CONCURRENT_RUNS
    if not cap:
        return None
    return cap - HeartbeatRun.objects.filter(status=RunStatus.RUNNING).count()


# Key of the transaction-level advisory lock that makes the deployment's run cap exact.
RUN_CAP_LOCK = (7_302, 0)


def claim_read_query(run_id):
    return (
        HeartbeatRun.objects.select_related("agent")
        .annotate(
            budgeted=budgets_exist(company_id_ref="company_id", agent_id_ref="agent_id"),
            held=quota.holds_exist(),
            prices_revision=overrides_revision(),
            summary_waiting=summary_waiting_for_place(agent_id_ref="agent_id"),
            **recent_wakes_columns(agent_id_ref="agent_id"),
        )
        .filter(id=run_id)
    )


def summary_waiting_for_place(*, agent_id_ref: str) -> Exists:
    """Whether a summary written beside the agent's heartbeats waits for the agent's place
    to commit (`sessions_app.compact_now`): the claim then leaves its run queued, or
    heartbeats arriving back to back would keep the summary from ever committing."""
    return Exists(
        HeartbeatRun.objects.filter(
            agent_id=OuterRef(agent_id_ref), status=RunStatus.RUNNING, beside=BesideState.WAITING
        )
    )


# The claim's read, compiled once per connection (`hot_sql.CompiledLookup`).
CLAIM_READ = CompiledLookup(claim_read_query)


def claim_update_query(values) -> tuple[QuerySet, dict]:
    """The claim's UPDATE: the run moves to `running` if it is still as the claim read it
    and its credential is not held by a provider's quota (`quota.hold_free`)."""
    queryset = HeartbeatRun.objects.filter(id=values.run_id, status=values.status, batch_state=values.batch_state)
    queryset = queryset.filter(quota.hold_free(credential=values.credential, run_id=values.run_id))
    running = {
        "status": RunStatus.RUNNING,
        "started_at": values.started_at,
        "deadline_at": values.deadline_at,
        "claimed_by": values.claimed_by,
    }
    return queryset, running


_CLAIM_FIELDS = {
    name: HeartbeatRun._meta.get_field(field)
    for name, field in {
        "run_id": "id",
        "status": "status",
        "batch_state": "batch_state",
        "started_at": "started_at",
        "deadline_at": "deadline_at",
        "claimed_by": "claimed_by",
    }.items()
}
# Compiled once per connection (`hot_sql.CompiledUpdate`): a run whose adapter names no
# credential has no hold to check.
CLAIM_UPDATE = CompiledUpdate(
    lambda values: claim_update_query(SimpleNamespace(**vars(values), credential=None)), _CLAIM_FIELDS
)
CLAIM_UPDATE_UNLESS_HELD = CompiledUpdate(
    claim_update_query, {**_CLAIM_FIELDS, "credential": CredentialHold._meta.get_field("credential")}
)


def claim_run(*, run_id, now: datetime) -> tuple[HeartbeatRun, bool]:
    """1. claim: move a queued run to running unless another run of its agent is running,
    or the deployment's runs in progress are at PAPERCLIP_MAX_CONCURRENT_RUNS.

    The database decides: a partial unique index allows one `running` row per agent, so
    of two processes claiming at once (any host, any worker) exactly one update succeeds;
    the other gets an IntegrityError and leaves its run queued. The cap is checked in the
    claim's transaction (`_claim_under_cap`). The run comes back with its agent,
    `budgeted` (whether any budget applies) and `recent_wakes` (its agent's last runs'
    creation, for the cache lifetime), all read in one query with the price overrides'
    revision (`costs_app.pricing`: the run's prices come from memory); a run claimed for a
    persistent agent may come back with its agent's live session too, read after the UPDATE
    in the same round trip (`run.live_session_read`, `_plan_reads_at_once`).
    """
    run = CLAIM_READ.first(run_id)
    if run is None:
        raise HeartbeatRun.DoesNotExist(f"No run {run_id}.")
    overrides_revision_seen(run.prices_revision)
    run.recent_wakes = recent_wakes_of(run)
    if not claimable(run):  # queued, or a submitted run its batch poll made ready
        return run, False
    if run.summary_waiting:  # it is dispatched when the summary ends
        return run, False
    agent = run.agent
    if refusal := agent.refusal():
        code, _ = refusal
        run_fail(run, code=code, message=f"The agent is {agent.status}.", now=now)
        run.refresh_from_db()
        return run, False
    if message := retired_model_refusal(agent.adapter_config):
        run_fail(run, code="model_retired", message=message, now=now)
        run.refresh_from_db()
        return run, False
    if (runs_in := runs_elsewhere(agent.adapter_config)) is not None:
        run.runs_in = runs_in
        return run, False  # its agent's files are on that cluster's host: it runs there
    adapter = adapter_for(agent.adapter_type, agent.adapter_config)
    deadline = run_deadline(adapter, agent.adapter_config, at=now)
    deadline += timedelta(seconds=check_seconds(agent.adapter_config))  # the work check comes first
    credential = adapter.credential(agent.adapter_config) if adapter is not None else None
    if run.held and not quota.claim_check(run=run, credential=credential, now=now, lease_until=deadline):
        return run, False  # its credential is held by a provider's quota: it waits queued
    capped = bool(settings.PAPERCLIP_MAX_CONCURRENT_RUNS)
    claim = CLAIM_UPDATE_UNLESS_HELD if credential is not None else CLAIM_UPDATE
    values = {
        "run_id": run.id,
        "status": run.status,
        "batch_state": run.batch_state,
        "credential": credential,
        "started_at": now,
        "deadline_at": deadline,
        "claimed_by": worker_id(),
    }
    try:
        if not capped and _plan_reads_at_once(agent):
            live = LiveSessionRead(agent.pk)
            claimed, live_rows = write_then_read(claim.statement(**values), live.statement())
            if claimed and live_rows is not None:
                run.live_session_read = ReadAhead(live.session(live_rows))
        else:
            # One statement is its own transaction; only inside a caller's transaction does
            # the refusal need a savepoint to leave that transaction usable.
            with transaction.atomic() if capped or connection.in_atomic_block else nullcontext():
                if capped and not run_place_free(agent_id=run.agent_id, created_at=run.created_at):
                    quota.probe_give_back(run=run)
                    return run, False
                claimed = claim.update(**values)
    except IntegrityError:
        quota.probe_give_back(run=run)
        return run, False  # another run of this agent is running
    if not claimed:
        quota.probe_give_back(run=run)
        run.refresh_from_db()
        return run, False
    run.status, run.started_at, run.deadline_at = RunStatus.RUNNING, now, deadline
    return run, True


def _plan_reads_at_once(agent: Agent) -> bool:
    """Whether the claim reads the agent's live session for the plan, after its UPDATE and
    in the same round trip (`hot_sql.write_then_read`): on PostgreSQL, outside a
    transaction, for a persistent agent with no work check (a check runs before the plan,
    and may find no work)."""
    return pipelines() and agent.is_persistent and not agent.adapter_config.get("work_check")


def run_place_free(*, agent_id, created_at: datetime) -> bool:
    """Whether a run of `agent_id` created at `created_at` may start under
    PAPERCLIP_MAX_CONCURRENT_RUNS: a place is free and no older run waits for it (each
    agent with nothing running counts its oldest queued run).

    Called inside the transaction that moves the run to `running` (a claim, or compact
    now's insert). Two of them must not both take the last place: on PostgreSQL they take
    one advisory lock until commit (only runs under a cap take it, and hold it for two
    queries, never across a model call); SQLite's IMMEDIATE transactions run one writer at
    a time. A run deferring to older ones wakes them, in case nobody else will (their
    waiter timed out, their task was lost)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", list(RUN_CAP_LOCK))
    free = free_run_places()
    if free <= 0:
        return False
    # An agent with a run in flight holding its place (running, or submitted in a batch;
    # not a summary written beside its heartbeats) cannot start another.
    running = HeartbeatRun.objects.filter(HOLDS_AGENT_PLACE).values("agent_id")
    ahead = list(
        HeartbeatRun.objects.filter(
            status=RunStatus.QUEUED, created_at__lt=created_at, agent__status=AgentStatus.ACTIVE
        )
        .exclude(agent_id=agent_id)
        .exclude(agent_id__in=running)
        .values("agent_id")
        .annotate(first=Min("created_at"))
        .order_by("first")[:free]
    )
    for older in ahead if len(ahead) >= free else ():
        dispatch_next_queued(agent_id=older["agent_id"])
    return len(ahead) < free


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


def dispatch_after_run(*, agent_id, next_queued: ReadAhead | None = None) -> None:
    """A run of the agent ended (a heartbeat, a compaction): wake its next queued run (as
    `next_queued` read it after the end's COMMIT, if given) or, under a cap on runs in
    progress, the oldest runs of any agent waiting for the place."""
    if settings.PAPERCLIP_MAX_CONCURRENT_RUNS:
        dispatch_waiting()
    else:
        dispatch_next_queued(agent_id=agent_id, read=next_queued)


def run_cost_refresh(*, run_id) -> None:
    """The run's cost as the ledger has it now: for a run whose row another actor ended (the
    reaper) while its calls went on being billed, or one that broke before it could say."""
    HeartbeatRun.objects.filter(id=run_id).update(cost_usd=spend_of("run_id"))


def run_fail(
    run: HeartbeatRun,
    *,
    code: str,
    message: str,
    now: datetime,
    overdue: bool = False,
    active_seconds: float | None = None,
    **kept,
) -> bool:
    """End a queued or running run as failed, whoever ends it: its worker, its claim, or
    (`overdue`: only a run still running past its deadline at `now`) the reaper. True when
    this call ended it.

    Of two enders (the reaper and a worker that was not dead after all) one update wins,
    and only the winner gives the run's session what a run's end owes it: the time the
    run was in progress, as active time, and a TTL counted from `now`
    (`session_run_time_record`; `active_seconds`: the provider's measure of it, when the
    runtime has one). The session row is locked before the run's, in the order the
    heartbeat's commit takes them, so that a reaper and a committing worker never
    deadlock."""
    with transaction.atomic():
        _run_session_lock(run_id=run.id)
        ending = HeartbeatRun.objects.filter(id=run.id, status__in=UNFINISHED_RUN_STATUSES)
        if overdue:
            ending = ending.filter(status=RunStatus.RUNNING, deadline_at__lt=now)
        # Messages quote what failed (an agent command's stderr, an API error body): made
        # storable, or the failure itself would fail to be written.
        if not ending.update(
            status=RunStatus.FAILED,
            error_code=code,
            error=storable(message[:5000]),
            finished_at=now,
            reserved_usd=0,
            **kept,
        ):
            return False
        ended_run_session_record(run_id=run.id, now=now, active_seconds=active_seconds)
    return True


def run_requeue(
    run: HeartbeatRun, *, calls_numbered: int, cost_usd, reason: str, now: datetime, quota: bool = True
) -> bool:
    """Put a running run back in the queue, not failed: a provider's quota refused its call
    (`sessions_app.quota`), or (`quota` False) it waits for its session's summary. It keeps
    what its calls cost (each was billed as it returned) and how many there were, releases
    its reservation, and gives its session the attempt's time, as any ended attempt does.
    False when it was no longer running."""
    with transaction.atomic():
        _run_session_lock(run_id=run.id)  # before the run's row, as `run_fail` and the commit
        requeued = HeartbeatRun.objects.filter(id=run.id, status=RunStatus.RUNNING).update(
            status=RunStatus.QUEUED,
            started_at=None,
            deadline_at=None,
            claimed_by="",
            reserved_usd=0,
            cost_usd=cost_usd,
            calls_before=calls_numbered,
            quota_requeues=F("quota_requeues") + int(quota),
            warning=storable(f"Put back in the queue: {reason}"[:2000]),
        )
        if requeued and run.started_at is not None:
            ended_run_session_record(run_id=run.id, started=run.started_at, now=now, erased=True)
    return bool(requeued)


def _run_session_lock(*, run_id) -> None:
    """Lock the session a run is linked to, if any: whoever ends a run's attempt takes the
    session's row before the run's, in the order the heartbeat's commit takes them, so that
    two enders (a reaper, a worker) never deadlock."""
    linked = HeartbeatRun.objects.filter(id=run_id).values_list("session_id", flat=True).first()
    if linked is not None:
        AgentSession.objects.select_for_update().filter(pk=linked).values_list("pk", flat=True).first()


def ended_run_session_record(
    *,
    run_id,
    now: datetime,
    started: datetime | None = None,
    active_seconds: float | None = None,
    erased: bool = False,
) -> None:
    """Inside the transaction that ended a run's attempt (failed, or put back in the queue):
    its session, if it has one, counts the attempt's time (from `started`, by default the
    row's; `active_seconds` when the provider measured it) as active time, and its TTL from
    `now`. Only the time no other run of the session was in progress counts for a summary
    written beside the heartbeats, and for an attempt whose times the row is about to lose
    (`erased`: a requeue), which a summary ending later could not see to count once.

    Time the provider measured is what it charges, whatever became of the row: when no row
    records it (deleted while the run went on, or never made), it is billed here, in the
    transaction whose conditional update ended the run, so once."""
    ended = (
        HeartbeatRun.objects.filter(id=run_id)
        .values("session_id", "company_id", "agent_id", "started_at", "trigger", "agent__adapter_config")
        .first()
    )
    if ended is None:
        return
    measured = active_seconds
    started = started or ended["started_at"]
    recorded = False
    if ended["session_id"] is not None and started is not None:
        ttl = Agent(adapter_config=ended["agent__adapter_config"] or {}).session_ttl
        if active_seconds is None and (erased or ended["trigger"] == RunTrigger.COMPACTION):
            active_seconds = alone_seconds(run_id=run_id, session_id=ended["session_id"], started=started, finished=now)
        recorded = session_run_time_record(
            session_id=ended["session_id"],
            started=started,
            finished=now,
            ttl=ttl,
            active_seconds=active_seconds,
        )
    if not recorded and measured is not None:
        unrecorded_time_bill(company_id=ended["company_id"], agent_id=ended["agent_id"], seconds=measured, at=now)
