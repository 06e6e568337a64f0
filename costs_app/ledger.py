"""Every row of the cost ledger is written here, through `ledger_write`.

Two kinds of row: a model call's usage (`cost_event_record`, priced by pricing.py, called
by `sessions_app.run_calls` the moment a call returns) and a session's active time
(`session_hours_record`). Callers hand in what happened; how a row is priced,
deduplicated and inserted is decided in this one place. Each row is also added to its UTC
day's total in cost_days by the database, in the insert's own statement (models.CostDay).
"""

from __future__ import annotations

from contextlib import nullcontext
from datetime import datetime
from decimal import Decimal

from django.db import IntegrityError, connection, transaction
from django.db.models import OuterRef, Subquery, Sum

from costs_app.models import CostEvent, CostKind, Delivery
from costs_app.pricing import call_price, ledger_usd, token_counts
from sessions_app.hot_sql import row_insert


def ledger_write(event: CostEvent) -> CostEvent:
    """Insert one ledger row; for a call of a run, the row already recorded for it if any.

    A call is identified by our own ids: its run and its number within the run, in its
    company. A retried write of the same call returns the row already recorded instead
    of billing twice.
    """
    if event.run_id is None or event.call_number is None:
        row_insert(event)
        return event
    try:
        # The unique (company, run, call) index decides, in the same round trip as the
        # insert; a lookup first would cost one more query on every call. Outside a
        # transaction the insert is one statement; inside one, a savepoint keeps the
        # caller's transaction usable after a refusal.
        with transaction.atomic() if connection.in_atomic_block else nullcontext():
            row_insert(event)
    except IntegrityError:
        existing = CostEvent.objects.filter(
            company_id=event.company_id, run_id=event.run_id, call_number=event.call_number
        ).first()
        if existing is None:
            raise
        return existing
    return event


def cost_event_record(
    *,
    usage: dict,
    model: str,
    company_id,
    agent_id,
    at: datetime,
    session_id=None,
    run_id=None,
    call_number: int | None = None,
    message_id: str | None = None,
    kind: str = CostKind.MESSAGE,
    delivery: str = Delivery.DIRECT,
    inference_geo: str | None = None,
) -> CostEvent:
    """Write one ledger row for a call's usage, priced by `model` (the model requested) at
    the price in force at `at` (`pricing.call_price`); the row says where the price came
    from. `delivery` and `inference_geo` are what the request asked for.

    The message id the API or an agent command reports is kept for display only: it is
    not ours, and two calls (of one agent or of two companies) may report the same one,
    so it never decides whether a row is written.
    """
    counts = token_counts(usage)
    price = call_price(usage=usage, model=model, at=at, delivery=delivery, inference_geo=inference_geo)
    return ledger_write(
        CostEvent(
            kind=kind,
            company_id=company_id,
            agent_id=agent_id,
            session_id=session_id,
            run_id=run_id,
            call_number=call_number,
            model=model,
            input_tokens=counts.input_tokens,
            output_tokens=counts.output_tokens,
            cache_creation_input_tokens=counts.cache_creation_input_tokens,
            cache_creation_5m_input_tokens=counts.cache_creation_5m_input_tokens,
            cache_creation_1h_input_tokens=counts.cache_creation_1h_input_tokens,
            cache_read_input_tokens=counts.cache_read_input_tokens,
            cost_usd=price.cost_usd,
            unpriced=price.unpriced,
            price=price.override,
            price_source=price.source,
            delivery=delivery,
            message_id=message_id or None,
            raw_usage=usage,
            created_at=at,
        )
    )


def run_calls_join_session(*, run_id, session_id) -> int:
    """Give the rows of a run's calls recorded before its session existed (a new session's
    tool-loop rounds, billed as each call returned) the session its answer created: the
    ledger and the session's total then agree. Called in the commit that creates it."""
    return CostEvent.objects.filter(run_id=run_id, session_id__isnull=True).update(session_id=session_id)


def run_cost(*, run_id) -> Decimal:
    """What the ledger holds for a run's calls."""
    # Rounded as each row is: SQLite's SUM answers with more places than the column has.
    return ledger_usd(CostEvent.objects.filter(run_id=run_id).aggregate(total=Sum("cost_usd"))["total"] or Decimal(0))


def billed_message_ids(*, run_id) -> list[str]:
    """The message ids of a run's ledger rows that name one (a runtime's request ids)."""
    return list(CostEvent.objects.filter(run_id=run_id, message_id__isnull=False).values_list("message_id", flat=True))


def run_calls_numbered(*, run_id) -> int:
    """How many ledger rows a run's calls wrote (its attempts so far)."""
    return CostEvent.objects.filter(run_id=run_id).count()


def spend_of(column: str, ref: str = "pk") -> Subquery:
    """The ledger's total for the row of another query whose id is `ref`, over the rows
    whose `column` (`run_id`, `session_id`) names it (NULL when none does): what a run or a
    session cost is this sum, never a figure kept beside it. One index probe per row
    (cost_events_session_idx, the run foreign key's index)."""
    rows = CostEvent.objects.filter(**{column: OuterRef(ref)}).order_by().values(column)
    return Subquery(
        rows.annotate(total=Sum("cost_usd")).values("total"), output_field=CostEvent._meta.get_field("cost_usd")
    )


def session_hours_record(*, company_id, agent_id, session_id, seconds: float, cost: Decimal, at: datetime) -> CostEvent:
    """Write the ledger row of a session's active time, priced by the caller's hourly rate."""
    return ledger_write(
        CostEvent(
            kind=CostKind.SESSION_HOURS,
            company_id=company_id,
            agent_id=agent_id,
            session_id=session_id,
            model="",
            session_seconds=round(seconds),
            cost_usd=cost,
            created_at=at,
        )
    )
