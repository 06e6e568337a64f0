"""The batch poll: parked runs sent as batches, results billed, answers committed.

Run by every maintenance pass (`batches_poll`). Each run's way through it is a conditional
update on the state it expects (`HeartbeatRun.batch_state`), so two polls at once (two
hosts) neither send a request twice nor bill a result twice:

1. submit: the parked runs are taken (`submitting`, marked with this poll's token and the
   time), sent as one batch per adapter (up to the API's limits), and given its id
   (`in_batch`). A run whose wait passed before it was sent goes direct instead. A create
   the provider refused leaves them parked for the next poll. Runs a poll left
   `submitting` (it died between its create and writing the batch id) are looked for in
   the provider's batches once any create is over (`batches_recover`): found, they are
   `in_batch` as if the id had been written; in no batch, they go direct.
2. read: an ended batch's results. A succeeded one is billed at once, at the batch price
   (`RunCalls.bill`, `delivery: batch`; the ledger numbers it after the run's earlier
   calls, so a poll killed after the bill bills nothing more), and kept on the run
   (`answered`). Errored, expired or canceled: the run goes direct. A batch still
   processing when one of its runs' `batch_max_wait_minutes` has passed is cancelled: the
   requests not yet answered end `canceled` and go direct, once the batch has ended, so a
   request is never answered twice.
3. commit: answered runs are claimed from `submitted` and run their steps again, here, in
   the order they were created (one per agent, so a persistent session's turns stay in
   order): the call returns the kept answer (`sessions_app.batch_delivery`) and the normal
   commit step commits it. Runs going direct are handed to the task cluster.

Nothing is held in a transaction across a call to the provider.
"""

from __future__ import annotations

import json
import logging
import uuid
from datetime import datetime, timedelta

from django.db.models import Q

from costs_app.models import CostKind, Delivery
from sessions_app.adapters import BATCH_API, AdapterError, adapter_for
from sessions_app.adapters.base import Adapter, BatchResult, ListedBatch, usage_error
from sessions_app.heartbeat import heartbeat_execute
from sessions_app.models import Agent, BatchState, HeartbeatRun, RunStatus
from sessions_app.run_calls import RunCalls
from sessions_app.run_queue import heartbeat_dispatch

logger = logging.getLogger(__name__)

# The Message Batches API's limits: 100,000 requests and 256 MB per batch.
MAX_BATCH_REQUESTS = 100_000
MAX_BATCH_BYTES = 200 * 1024 * 1024  # under the limit, for the envelope of each request


# Longer than a batch create can take (the SDK's timeout and retries).
SUBMIT_GRACE = timedelta(minutes=30)
# How much earlier than our clock the provider's may date a batch we created.
CLOCK_MARGIN = timedelta(minutes=10)
# Pages of the provider's batches (1,000 each) one poll reads looking for a lost batch; the
# next poll reads them again.
MAX_LIST_PAGES = 5
# Runs given a batch id in one statement when a lost batch is found.
ADOPT_CHUNK = 500
# A create that failed these ways may have made its batch (no answer came back, or the
# server failed after taking the request); a refusal (4xx, 529 overloaded) made none.
MAYBE_CREATED = frozenset({"model_timeout", "model_unreachable", "model_server_error"})


def custom_id(run) -> str:
    return run.id.hex


def submitted():
    return HeartbeatRun.objects.filter(status=RunStatus.SUBMITTED)


def _own_batch_api(agent: Agent) -> Adapter | None:
    """The agent's runtime, if it still has a batch API."""
    adapter = adapter_for(agent.adapter_type, agent.adapter_config)
    return adapter if adapter is not None and adapter.delivers_batch else None


def batch_api(agent: Agent) -> tuple[Adapter, dict]:
    """The adapter and configuration that send, read, list and cancel the batches of this
    agent's runs: its own; or, once an operator has moved it to a runtime without a batch
    API, the Messages API's with its defaults (a batch already made is still answered, and
    billed, at the provider)."""
    own = _own_batch_api(agent)
    return (own, agent.adapter_config) if own is not None else (BATCH_API, {})


def still_batched(run: HeartbeatRun) -> bool:
    """Whether the run's agent still has a runtime with a batch API."""
    return _own_batch_api(run.agent) is not None


def batches_poll(*, now: datetime) -> dict:
    """One pass of the poll: submit, read, commit. Returns what each step did."""
    return {
        "submitted": batches_submit(now=now),
        "read": batches_read(now=now),
        "committed": batch_runs_commit(now=now),
    }


# 1. submit


def batches_submit(*, now: datetime) -> int:
    """Send every parked run in a batch; returns how many were sent."""
    too_late(submitted().filter(batch_state=BatchState.PARKED, batch_deadline_at__lte=now), "was never sent")
    batches_recover(now=now)
    token = f"submitting-{uuid.uuid4().hex}"
    parked = submitted().filter(batch_state=BatchState.PARKED).order_by("created_at")
    ids = list(parked.values_list("id", flat=True)[:MAX_BATCH_REQUESTS])
    submitted().filter(id__in=ids, batch_state=BatchState.PARKED).update(
        batch_state=BatchState.SUBMITTING, batch_id=token, batch_submitted_at=now
    )
    taken = list(
        submitted()
        .filter(batch_id=token, batch_state=BatchState.SUBMITTING)
        .select_related("agent")
        .only("id", "batch_request", "agent__adapter_type", "agent__adapter_config")
        .order_by("created_at")
    )
    # Every batch goes through the one batch API (`batch_api`), whatever runtime sent it.
    return sum(_send(chunk, token=token) for chunk in chunks(_still_batched(taken, token=token)))


def _still_batched(runs: list, *, token: str) -> list:
    """The runs whose agents still have a batch API. The others, moved by an operator to a
    runtime without one, go direct on that runtime: nothing was spent on them yet."""
    kept, moved = [], []
    for run in runs:
        (kept if still_batched(run) else moved).append(run)
    if moved:
        too_late(
            taken_by(token, [run.id for run in moved]),
            "was never sent: its agent moved to a runtime without a batch API",
        )
    return kept


def chunks(runs: list) -> list[list]:
    """Runs in batches within the API's limits, in order."""
    found, current, size = [], [], 0
    for run in runs:
        length = len(json.dumps(run.batch_request))
        if current and (len(current) >= MAX_BATCH_REQUESTS or size + length > MAX_BATCH_BYTES):
            found.append(current)
            current, size = [], 0
        current.append(run)
        size += length
    return found + ([current] if current else [])


def _send(runs: list, *, token: str) -> int:
    adapter, config = batch_api(runs[0].agent)
    ids = [run.id for run in runs]
    try:
        batch_id = adapter.batch_send(config, [(custom_id(run), run.batch_request) for run in runs])
    except AdapterError as exc:
        if exc.code in MAYBE_CREATED:
            # Left `submitting`, as by a poll killed after its create: once any create is
            # over, the batch is looked for at the provider, and the runs go direct only if
            # no batch holds them (`batches_recover`). Sent again now, they could be
            # answered twice.
            logger.warning(
                "A batch of %s runs may have been created (%s): %s; it is looked for after %s",
                len(runs),
                exc.code,
                exc.message,
                SUBMIT_GRACE,
            )
            return 0
        # Refused: nothing was created; parked again, they are sent by the next poll, or
        # direct once their wait has passed.
        logger.warning("A batch of %s runs was not created (%s): %s", len(runs), exc.code, exc.message)
        taken_by(token, ids).update(batch_state=BatchState.PARKED, batch_id="")
        return 0
    taken_by(token, ids).update(batch_state=BatchState.IN_BATCH, batch_id=batch_id)
    return len(runs)


def taken_by(token: str, ids: list):
    """These runs, while the poll marked `token` still holds them (a later poll may have
    found their batch, or sent them direct, if this one was too slow)."""
    return submitted().filter(id__in=ids, batch_state=BatchState.SUBMITTING, batch_id=token)


# 1b. recover: runs left `submitting` by a poll that died


def lost_runs(now: datetime):
    """Runs left `submitting` for longer than any create takes. Those taken before
    `batch_submitted_at` existed count from their wait's end."""
    past = now - SUBMIT_GRACE
    return submitted().filter(
        Q(batch_submitted_at__lte=past) | Q(batch_submitted_at__isnull=True, batch_deadline_at__lte=past),
        batch_state=BatchState.SUBMITTING,
    )


def batches_recover(*, now: datetime) -> int:
    """Look for lost runs' batches at the provider; returns how many runs were found in one."""
    lost = list(
        lost_runs(now)
        .select_related("agent")
        .only("id", "created_at", "batch_submitted_at", "agent__adapter_type", "agent__adapter_config")
        .order_by("created_at")
    )
    if not lost:
        return 0
    # Every batch this service makes is the one batch API's (`BATCH_API`), whatever runtime
    # the runs' agents have now: their custom ids (run ids) are looked for together.
    return _recover(lost, now=now)


def _recover(runs: list, *, now: datetime) -> int:
    adapter, config = batch_api(runs[0].agent)
    taken = dict(_taken())
    # A lost batch was created after its runs were taken and before the grace ended.
    since = min(run.batch_submitted_at or run.created_at for run in runs) - CLOCK_MARGIN
    until = max(run.batch_submitted_at or now for run in runs) + SUBMIT_GRACE + CLOCK_MARGIN
    try:
        listing = adapter.batch_list(config, since=since, pages=MAX_LIST_PAGES)
    except AdapterError as exc:
        logger.warning("Batches could not be listed to find lost runs (%s): %s", exc.code, exc.message)
        return 0
    # Every request of a lost batch is a run still `submitting`: a bigger batch is another's.
    candidates = [b for b in listing.batches if b.created_at <= until and b.requests <= len(taken)]
    known = set(HeartbeatRun.objects.filter(batch_id__in=[b.id for b in candidates]).values_list("batch_id", flat=True))
    unknown = [batch for batch in candidates if batch.id not in known]
    found = [batch_adopt(adapter, config, batch, taken) for batch in unknown if batch.ended]
    if not listing.complete:
        logger.warning("Lost batch runs: %s pages of batches were read, not back to %s", MAX_LIST_PAGES, since)
    elif None in found or any(not batch.ended for batch in unknown):
        # Its results cannot be read until it ends: it may hold them, so they wait for it.
        logger.info("Lost batch runs wait for batches to end or to be read: %s", [b.id for b in unknown])
    else:
        too_late(
            submitted().filter(id__in=[run.id for run in runs], batch_state=BatchState.SUBMITTING),
            "was lost by a poll that stopped while creating its batch, and no batch at the provider holds it",
        )
    return sum(n or 0 for n in found)


def _taken():
    """Custom id -> (run id, token) of every run being submitted."""
    rows = submitted().filter(batch_state=BatchState.SUBMITTING)
    for run_id, token in rows.values_list("id", "batch_id").iterator():
        yield run_id.hex, (run_id, token)


def batch_adopt(adapter: Adapter, config: dict, batch: ListedBatch, taken: dict) -> int | None:
    """Give the runs whose requests this ended batch holds its id, from `submitting` with
    their poll's token (two polls never both adopt one); None when it could not be read."""
    adopted, pending = 0, {}
    try:
        for number, found in enumerate(adapter.batch_custom_ids(config, batch.id)):
            if found not in taken:
                if number == 0:
                    return 0  # another's batch (every request of one of ours is in `taken`)
                continue
            run_id, token = taken[found]
            pending.setdefault(token, []).append(run_id)
            if sum(map(len, pending.values())) >= ADOPT_CHUNK:
                adopted += _adopt(pending, batch.id)
    except AdapterError as exc:
        logger.warning("Batch %s could not be read for lost runs (%s): %s", batch.id, exc.code, exc.message)
        return None
    return adopted + _adopt(pending, batch.id)


def _adopt(pending: dict, batch_id: str) -> int:
    adopted = sum(
        taken_by(token, ids).update(batch_state=BatchState.IN_BATCH, batch_id=batch_id)
        for token, ids in pending.items()
    )
    pending.clear()
    if adopted:
        logger.warning("%s runs a poll lost were found in batch %s", adopted, batch_id)
    return adopted


# 2. read


def batches_read(*, now: datetime) -> int:
    """Read every batch with runs in it; returns how many results were recorded."""
    batch_ids = list(
        submitted().filter(batch_state=BatchState.IN_BATCH).order_by().values_list("batch_id", flat=True).distinct()
    )
    return sum(batch_read(batch_id, now=now) for batch_id in batch_ids)


def batch_read(batch_id: str, *, now: datetime) -> int:
    runs = list(submitted().filter(batch_state=BatchState.IN_BATCH, batch_id=batch_id).select_related("agent"))
    if not runs:
        return 0
    adapter, config = batch_api(runs[0].agent)
    try:
        results = adapter.batch_read(config, batch_id)
        if results is None:
            if any(run.batch_deadline_at <= now for run in runs):
                adapter.batch_cancel(config, batch_id)  # what it has not answered ends canceled
            return 0
    except AdapterError as exc:
        logger.warning("Batch %s could not be read (%s): %s", batch_id, exc.code, exc.message)
        return 0
    for run in runs:
        result_record(run, results.get(custom_id(run)), now=now)
    return len(runs)


def result_record(run: HeartbeatRun, result: BatchResult | None, *, now: datetime) -> None:
    """Bill a succeeded result and keep it on the run; any other sends the run direct."""
    in_batch = submitted().filter(id=run.id, batch_state=BatchState.IN_BATCH, batch_id=run.batch_id)
    if result is None or result.kind != "succeeded" or not isinstance(result.message, dict):
        kind = result.kind if result is not None else "missing"
        detail = f": {result.error}" if result is not None and result.error else ""
        too_late(in_batch, f"was {kind} in batch {run.batch_id}{detail}")
        return
    usage = result.message.get("usage")
    if not isinstance(usage, dict) or usage_error(usage):
        too_late(in_batch, f"was answered in batch {run.batch_id} with an impossible usage")
        return
    agent = run.agent
    calls = RunCalls(
        batch_api(agent)[0],
        run=run,
        agent=agent,
        clock=lambda: now,
        budgeted=bool(run.reserved_usd),
    )
    # The provider billed it: the ledger has it before anything else is done with it.
    event = calls.bill(
        usage=usage,
        model=run.batch_request.get("model") or result.message.get("model") or "",
        message_id=str(result.message.get("id") or ""),
        kind=CostKind.MESSAGE,
        inference_geo=run.batch_request.get("inference_geo"),
        delivery=Delivery.BATCH,
    )
    in_batch.update(
        batch_state=BatchState.ANSWERED,
        batch_answer={"message": result.message, "cost_usd": str(event.cost_usd), "cost_event_id": event.id},
        calls_before=calls.numbered,
        cost_usd=calls.cost_usd,
    )


def too_late(runs, why: str) -> int:
    """Send these runs direct (their batch request will never be answered)."""
    return runs.update(
        batch_state=BatchState.DIRECT,
        batch_request=None,
        warning=f"Sent direct: the batch request {why}."[:2000],
    )


# 3. commit


def batch_runs_commit(*, now: datetime) -> int:
    """Commit every answered run here, oldest first; hand those going direct to the task
    cluster. Returns how many answered runs committed."""
    committed = 0
    for run_id in list(
        submitted().filter(batch_state=BatchState.ANSWERED).order_by("created_at").values_list("id", flat=True)
    ):
        run = heartbeat_execute(run_id=run_id, now=now)
        if run.status == RunStatus.SUCCEEDED:
            committed += 1
        if run.is_finished:
            HeartbeatRun.objects.filter(id=run_id).update(batch_request=None, batch_answer=None)
    for run in submitted().filter(batch_state=BatchState.DIRECT).only("id"):
        heartbeat_dispatch(run=run)
    return committed
