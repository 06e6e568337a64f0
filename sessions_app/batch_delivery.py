"""Batch delivery as one run sees it: whether its answer call goes in a batch, and the
answer a batch gave it.

A run that asked for batch delivery (`run_delivery`: a scheduled heartbeat of an agent with
`delivery: "batch"`, or an API heartbeat with `"delivery": "batch"`) runs its steps as any heartbeat
does (claim, plan, fit, reserve); at its answer call, instead of sending the request, it
is parked (`BatchParked`, then `batch_park`): the run becomes `submitted`, keeps the
request's parameters and its reservation, and frees its worker. The batch poll
(`sessions_app.batches`) sends it, bills its result and claims the run again; its steps
then build the same request, and the call returns the batch's answer instead of sending
it (`BatchCall.take`), which the normal commit step commits. A request that is not the
one sent (the session changed meanwhile) is sent direct: an answer is only ever committed
to the request it answers.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timedelta
from decimal import Decimal

from django.db.models import Q

from costs_app.models import Delivery
from sessions_app.adapters import AdapterReply, AdapterRequest, adapter_for
from sessions_app.adapters.base import DEFAULT_BATCH_MAX_WAIT_MINUTES, Adapter
from sessions_app.errors import HeartbeatRefused, RunFailure
from sessions_app.models import Agent, BatchState, HeartbeatRun, RunStatus, RunTrigger
from sessions_app.text import storable


class BatchParked(RunFailure):
    """Not a failure: the run's answer call goes in the next batch (`batch_park`)."""

    def __init__(self, params: dict) -> None:
        super().__init__("batch_parked", "The request waits for the next batch.")
        self.params = params


def run_delivery(agent: Agent, *, trigger: str, asked: str | None) -> str:
    """The delivery a new run asks for: an API caller's (direct unless it asks for batch),
    a scheduled tick's agent configuration; command, admin and compaction runs go direct.

    An API caller may ask for batch for any agent whose runtime delivers by batch, whatever
    the agent's own `delivery`: the agent's `batch_max_wait_minutes` bounds the wait.
    `HeartbeatRefused` (`invalid_delivery`) for a value that is not a delivery, or batch
    asked of a runtime that has no batch API."""
    if trigger == RunTrigger.SCHEDULE:
        return Delivery.BATCH if agent.adapter_config.get("delivery") == Delivery.BATCH else Delivery.DIRECT
    if asked is None:
        return Delivery.DIRECT
    if asked not in Delivery.values:
        raise HeartbeatRefused("invalid_delivery", f"delivery must be one of: {', '.join(Delivery.values)}.")
    if asked == Delivery.BATCH and not delivers_batch(agent):
        raise HeartbeatRefused(
            "invalid_delivery", "This agent's runtime cannot deliver by batch (it has no Message Batches API)."
        )
    return asked


def delivers_batch(agent: Agent) -> bool:
    adapter = adapter_for(agent.adapter_type, agent.adapter_config)
    return adapter is not None and adapter.delivers_batch


def batch_wanted(run: HeartbeatRun, adapter: Adapter) -> bool:
    """Whether this run's answer call goes in a batch: it asked for batch when it was
    queued (`run_delivery`), its runtime still can, and it was never batched."""
    return run.delivery == Delivery.BATCH and adapter.delivers_batch and not run.batch_state


def max_wait(agent: Agent) -> timedelta:
    minutes = agent.adapter_config.get("batch_max_wait_minutes") or DEFAULT_BATCH_MAX_WAIT_MINUTES
    return timedelta(minutes=minutes)


def as_stored(params: dict) -> dict:
    """Parameters as a JSON column gives them back, so that two requests compare."""
    return json.loads(json.dumps(storable(params)))


class BatchCall:
    """The batch side of one run's calls (`sessions_app.run_calls.RunCalls`): only its
    first answer call can be parked or answered from a batch; later ones (tool rounds)
    go direct."""

    def __init__(self, run: HeartbeatRun, adapter: Adapter) -> None:
        self._run = run
        self._adapter = adapter
        self._taken = False

    def delivery_for(self, request: AdapterRequest) -> str:
        """How the answer call for `request` would be billed: what its reservation holds."""
        if self._taken or not self._adapter.delivers_batch:
            return Delivery.DIRECT
        answered = self._run.batch_state == BatchState.ANSWERED
        if answered or batch_wanted(self._run, self._adapter):
            params = self._adapter.batch_params(request)
            if params is not None and (not answered or as_stored(params) == self._run.batch_request):
                return Delivery.BATCH
        return Delivery.DIRECT

    def take(self, request: AdapterRequest) -> AdapterReply | None:
        """For the run's first answer call: the batch's answer (already billed) when the
        request is the one sent; raises `BatchParked` when the call goes in a batch; None:
        send it direct."""
        if self._taken:
            return None
        self._taken = True
        run = self._run
        if run.batch_state == BatchState.ANSWERED:
            if not self._adapter.delivers_batch:
                return self._not_committed("The agent moved to a runtime without a batch API")
            params = self._adapter.batch_params(request)
            kept = run.batch_answer or {}
            if params is not None and as_stored(params) == run.batch_request and "message" in kept:
                reply = self._adapter.batch_reply(request, kept["message"])
                return replace(reply, cost_usd=Decimal(kept["cost_usd"]), cost_event_id=kept.get("cost_event_id"))
            return self._not_committed("The session changed")
        if batch_wanted(run, self._adapter) and (params := self._adapter.batch_params(request)):
            raise BatchParked(params)
        return None

    def _not_committed(self, why: str) -> None:
        """The batch's answer does not answer the request the run makes now: it stays
        billed, and the request goes direct."""
        HeartbeatRun.objects.filter(id=self._run.id).update(
            warning=f"{why} after the request was batched: the batch's answer (billed) was not committed "
            "and the request was sent direct."
        )


def batch_park(run: HeartbeatRun, *, agent: Agent, params: dict, calls_numbered: int, cost_usd, now: datetime) -> bool:
    """The run waits for a batch: `submitted` (`parked`), holding the agent's place in flight
    and its reservation, with the calls it made so far counted (as a quota's requeue does)
    and no deadline (the reaper leaves it; the poll sends it direct past its
    `batch_max_wait_minutes`). False when it was no longer running (reaped meanwhile)."""
    return bool(
        HeartbeatRun.objects.filter(id=run.id, status=RunStatus.RUNNING).update(
            status=RunStatus.SUBMITTED,
            batch_state=BatchState.PARKED,
            batch_request=as_stored(params),
            batch_deadline_at=now + max_wait(agent),
            deadline_at=None,
            claimed_by="",
            calls_before=calls_numbered,
            cost_usd=cost_usd,
        )
    )


def batch_ready() -> Q:
    """The submitted runs a claim may take: answered, or to be sent direct."""
    return Q(status=RunStatus.SUBMITTED, batch_state__in=[BatchState.ANSWERED, BatchState.DIRECT])


def claimable(run: HeartbeatRun) -> bool:
    """Queued, a submitted run its batch poll made ready, a run waiting for an approval
    that an operator has decided (`sessions_app.approvals`), or a turn whose worker died
    (`sessions_app.managed_resume`)."""
    return (
        run.status == RunStatus.QUEUED
        or (run.status == RunStatus.SUBMITTED and run.batch_state in (BatchState.ANSWERED, BatchState.DIRECT))
        or (run.status == RunStatus.WAITING_APPROVAL and "decision" in (run.managed_turn or {}))
        or run.status == RunStatus.RESUMING
    )
