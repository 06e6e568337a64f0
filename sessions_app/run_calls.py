"""Every model call of a run: numbered, covered by the run's deadline, billed when it returns.

This is the one place a model call is written to the ledger (`costs_app.ledger`):

- an adapter's reply is billed the moment `adapter.call` returns, before anything else is
  done with it, in a statement (or, for a budgeted run, a transaction) of its own; the
  answer, a summary, a handoff note and each tool round alike;
- a runtime that makes several model requests in one call (Claude Code) is handed a meter
  on the request and bills each request through it as the request ends
  (`Adapter.bills_while_running`), so a worker killed at any moment leaves every answered
  request in the ledger;
- a row names the session the run's answer goes to: the live session the run resumed,
  none while the run is starting one (its commit gives those rows the session it creates,
  `costs_app.ledger.run_calls_join_session`), none for a stateless agent.

Nothing here prices after the fact or holds an amount back: a session's cost and a run's
cost are the sums of the ledger rows that name them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from datetime import datetime
from decimal import Decimal

from django.db import connection, transaction
from django.db.models import F, Value
from django.db.models.functions import Greatest

from costs_app.ledger import billed_message_ids, cost_event_record
from costs_app.models import CostEvent, CostKind, Delivery
from paperclip.telemetry import record_bill
from sessions_app.adapters import AdapterReply, AdapterRequest
from sessions_app.adapters.base import Adapter
from sessions_app.batch_delivery import BatchCall
from sessions_app.errors import RunAbandoned
from sessions_app.models import Agent, HeartbeatRun, RunStatus
from sessions_app.quota import quota_observe
from sessions_app.run_queue import run_deadline

logger = logging.getLogger(__name__)


class RunCalls:
    """The adapter as one run uses it.

    - Bills every call when it returns (`bill`), numbering the run's ledger rows: the run
      and the number are the ledger's identity of a call, never an id the answer reports.
    - Before every request after the first (a summary, the answer after a handoff note, a
      token count, a tool round), moves the run's deadline to cover it, so a run of many
      calls is reaped only when one of them overruns its own limit; the claim's deadline
      covers the first. A run the reaper failed meanwhile sends nothing more: run_timeout.
    - For a budgeted run, each bill then releases as much of the run's reservation (held
      before the call, `costs_app.budgets.budget_reserve`): between the two, the call is
      counted twice, never less than once; the row never waits on the release.
    """

    def __init__(
        self, adapter: Adapter, *, run: HeartbeatRun, agent: Agent, clock: Callable[[], datetime], budgeted: bool
    ) -> None:
        self.adapter = adapter
        self._run = run
        self._agent = agent
        self._clock = clock
        self._budgeted = budgeted
        self._requests = 0
        # An attempt after one a quota put back in the queue numbers its rows after that
        # one's, and its cost adds to theirs (`sessions_app.quota.run_requeue`).
        self._rows = run.calls_before
        # A turn continued from an earlier attempt (a Managed Agents turn whose worker died)
        # may report again requests that attempt billed: each is billed once.
        self._billed_ids: set[str] = set(billed_message_ids(run_id=run.id)) if run.calls_before else set()
        self.session_id = None  # the session the rows name (see the module docstring)
        self.billed_usd = (run.cost_usd or Decimal(0)) if run.calls_before else Decimal(0)
        self.billed_anything = bool(run.calls_before) and run.cost_usd is not None
        # Batch delivery: the first answer call may be parked for a batch, or answered by
        # one (`sessions_app.batch_delivery`).
        self.batch = BatchCall(run, adapter)

    @property
    def numbered(self) -> int:
        """The ledger rows this run has numbered, earlier attempts' included."""
        return self._rows

    @property
    def counts_tokens(self) -> bool:
        return self.adapter.counts_tokens

    def names_session(self, session_id) -> None:
        """From now on, rows name this session: the live session the run's answer goes to."""
        self.session_id = session_id

    def call(self, request: AdapterRequest, *, kind: str = CostKind.MESSAGE) -> AdapterReply:
        """One call of the adapter, billed the moment it returns (or, for a runtime that
        bills while running, each of its model requests as it ends)."""
        self._hold_deadline(request)
        if kind == CostKind.MESSAGE and (answered := self.batch.take(request)) is not None:
            return answered  # billed when the batch's result was read
        if self.adapter.bills_while_running:
            meter = RunMeter(self, kind=kind)
            reply = self.adapter.call(replace(request, meter=meter))
            return replace(reply, cost_usd=meter.billed_usd if meter.rows else None)
        reply = self.adapter.call(request)
        if reply.headroom is not None:
            quota_observe(
                credential=self.adapter.credential(request.config), headroom=reply.headroom, now=self._clock()
            )
        if reply.usage is None:
            return reply
        event = self.bill(
            usage=reply.usage,
            model=reply.priced_model,
            message_id=reply.message_id,
            kind=kind,
            inference_geo=request.config.get("inference_geo"),
        )
        return replace(reply, cost_usd=event.cost_usd, cost_event_id=event.id)

    def count_tokens(self, request: AdapterRequest) -> int:
        self._hold_deadline(request)
        return self.adapter.count_tokens(request)

    def bill(
        self,
        *,
        usage: dict,
        model: str,
        message_id: str = "",
        kind: str = CostKind.MESSAGE,
        inference_geo: str | None = None,
        delivery: str = Delivery.DIRECT,
    ) -> CostEvent:
        """Write the ledger row of one model request of this run, now, priced with the
        request's own factors (its `inference_geo`)."""
        self._rows += 1
        fields = {
            "usage": usage,
            "model": model,
            "company_id": self._agent.company_id,
            "agent_id": self._agent.id,
            "session_id": self.session_id,
            "run_id": self._run.id,
            "call_number": self._rows,
            "message_id": message_id or None,
            "kind": kind,
            "delivery": delivery,
            "inference_geo": inference_geo,
            "at": self._clock(),
        }
        try:
            event = self._write(fields)
        except Exception:
            # The provider billed this call; an operator reconciles it from this line.
            logger.error(
                "Could not bill call %s of run %s (%s): usage %s", self._rows, self._run.id, model, usage, exc_info=True
            )
            raise
        self.billed_usd += event.cost_usd
        self.billed_anything = True
        record_bill(model=model, cost_usd=event.cost_usd, usage=usage)
        if message_id:
            self._billed_ids.add(message_id)
        return event

    def billed(self, message_id: str) -> bool:
        """Whether a model request reporting this id was billed in this run already."""
        return bool(message_id) and message_id in self._billed_ids

    @property
    def cost_usd(self) -> Decimal | None:
        """What the run's calls cost so far (None while nothing reported usage)."""
        return self.billed_usd if self.billed_anything else None

    def _write(self, fields: dict) -> CostEvent:
        event = cost_event_record(**fields)
        if self._budgeted:
            # A savepoint inside a caller's transaction: a failed release must not undo the row.
            with transaction.atomic() if connection.in_atomic_block else nullcontext():
                HeartbeatRun.objects.filter(id=self._run.id).update(
                    reserved_usd=Greatest(F("reserved_usd") - event.cost_usd, Value(Decimal(0)))
                )
        return event

    def _hold_deadline(self, request: AdapterRequest) -> None:
        self._requests += 1
        if self._requests == 1:
            return
        deadline = run_deadline(self.adapter, request.config, at=self._clock())
        if not HeartbeatRun.objects.filter(id=self._run.id, status=RunStatus.RUNNING).update(deadline_at=deadline):
            raise RunAbandoned("run_timeout", "The run was reaped as timed out; it made no further call.")


class RunMeter:
    """The meter of one call of a runtime that bills while it runs (`CallMeter`): each
    model request it reports is billed at once, a message id it reports twice once."""

    def __init__(self, calls: RunCalls, *, kind: str) -> None:
        self._calls = calls
        self._kind = kind
        self.rows = 0
        self.billed_usd = Decimal(0)

    def bill(self, *, usage: dict, model: str, message_id: str = "") -> Decimal:
        if self._calls.billed(message_id):
            return Decimal(0)
        event = self._calls.bill(usage=usage, model=model, message_id=message_id, kind=self._kind)
        self.rows += 1
        self.billed_usd += event.cost_usd
        return event.cost_usd

    @property
    def run_cost_usd(self) -> Decimal | None:
        return self._calls.cost_usd
