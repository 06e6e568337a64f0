"""Turning the usage the API reported into ledger rows priced in Decimal.

Token classes are priced separately: uncached input, output, cache writes (5-minute and
1-hour lifetimes differ) and cache reads. With server-side compaction the API reports the
summarising pass only in `usage.iterations`, so those entries are added to the top-level
counts (the `message` iteration mirrors the top level and is not added twice).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal

from django.db import IntegrityError, transaction
from django.db.models import Case, IntegerField, Value, When

from costs_app.models import CostEvent, CostKind, ModelPrice

MILLION = Decimal(1_000_000)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenCounts:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_creation_5m_input_tokens: int = 0
    cache_creation_1h_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[int, ...]:
        return (
            self.input_tokens,
            self.output_tokens,
            self.cache_creation_input_tokens,
            self.cache_creation_5m_input_tokens,
            self.cache_creation_1h_input_tokens,
            self.cache_read_input_tokens,
        )

    @property
    def total_input_tokens(self) -> int:
        """Everything the model read: what grows with replayed history."""
        return self.input_tokens + self.cache_creation_input_tokens + self.cache_read_input_tokens


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _counts_of(entry: dict) -> TokenCounts:
    cache_total = _count(entry.get("cache_creation_input_tokens"))
    split = entry.get("cache_creation") if isinstance(entry.get("cache_creation"), dict) else {}
    five = _count(split.get("ephemeral_5m_input_tokens"))
    hour = _count(split.get("ephemeral_1h_input_tokens"))
    if not split:
        five = cache_total  # no split reported: the default lifetime is five minutes
    cache_total = max(cache_total, five + hour)
    return TokenCounts(
        input_tokens=_count(entry.get("input_tokens")),
        output_tokens=_count(entry.get("output_tokens")),
        cache_creation_input_tokens=cache_total,
        cache_creation_5m_input_tokens=five,
        cache_creation_1h_input_tokens=hour,
        cache_read_input_tokens=_count(entry.get("cache_read_input_tokens")),
    )


def token_counts(usage: dict) -> TokenCounts:
    counts = _counts_of(usage)
    for iteration in usage.get("iterations") or []:
        if isinstance(iteration, dict) and iteration.get("type") != "message":
            counts = counts + _counts_of(iteration)
    return counts


# A dated snapshot id (claude-opus-4-5-20251101) names one release of a model family.
SNAPSHOT_SUFFIX = re.compile(r"-\d{8}$")


def model_family(model: str) -> str:
    """The family a snapshot id belongs to (the model itself when it is not a snapshot)."""
    return SNAPSHOT_SUFFIX.sub("", model)


def price_for(*, model: str, at: datetime) -> ModelPrice | None:
    """The price in force for `model` on the UTC day of `at`.

    A snapshot id without a price of its own is priced as its family: the API may answer
    an alias with a dated id, and an agent may be configured with one. A price recorded
    for the snapshot itself wins.
    """
    day = at.astimezone(UTC).date()
    names = {model, model_family(model)}
    exact_first = Case(When(model=model, then=Value(0)), default=Value(1), output_field=IntegerField())
    return (
        ModelPrice.objects.filter(model__in=names, effective_from__lte=day)
        .order_by(exact_first, "-effective_from")
        .first()
    )


def cost_of(counts: TokenCounts, price: ModelPrice) -> Decimal:
    total = (
        counts.input_tokens * price.input_usd_per_mtok
        + counts.output_tokens * price.output_usd_per_mtok
        + counts.cache_creation_5m_input_tokens * price.cache_write_5m_usd_per_mtok
        + counts.cache_creation_1h_input_tokens * price.cache_write_1h_usd_per_mtok
        + counts.cache_read_input_tokens * price.cache_read_usd_per_mtok
    )
    return total / MILLION


def call_cost(*, usage: dict, model: str, at: datetime) -> Decimal:
    """What a call cost, as its ledger row will say (0 for a model without a price)."""
    price = price_for(model=model, at=at)
    return ledger_usd(cost_of(token_counts(usage), price)) if price else Decimal(0)


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
) -> CostEvent:
    """Write one ledger row for a call's usage, priced by `model` (the model requested).

    A call is identified by our own ids: its run and its number within the run, in its
    company. A retried write of the same call returns the row already recorded instead
    of billing twice. The message id the API or an agent command reports is kept for
    display only: it is not ours, and two calls (of one agent or of two companies) may
    report the same one, so it never decides whether a row is written.
    """
    counts = token_counts(usage)
    price = price_for(model=model, at=at)
    event = CostEvent(
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
        cost_usd=ledger_usd(cost_of(counts, price)) if price else Decimal(0),
        unpriced=price is None,
        price=price,
        message_id=message_id or None,
        raw_usage=usage,
        created_at=at,
    )
    if run_id is None or call_number is None:
        event.save(force_insert=True)
        return event
    try:
        # The unique (company, run, call) index decides, in the same round trip as the
        # insert; a lookup first would cost one more query on every call.
        with transaction.atomic():
            event.save(force_insert=True)
    except IntegrityError:
        existing = CostEvent.objects.filter(company_id=company_id, run_id=run_id, call_number=call_number).first()
        if existing is None:
            raise
        return existing
    return event


def billed_call_record(**fields) -> None:
    """The ledger row of a call whose result an error is throwing away: it was billed.

    Best effort, for error paths: the error may be the database itself, and it is the
    original error the caller goes on to report. The savepoint keeps a caller's
    transaction usable when this write fails too.
    """
    if fields.get("usage") is None:
        return
    try:
        with transaction.atomic():
            cost_event_record(**fields)
    except Exception:
        logger.exception(
            "Could not record the cost of call %s of run %s", fields.get("call_number"), fields.get("run_id")
        )


LEDGER_QUANTUM = Decimal(1).scaleb(-CostEvent._meta.get_field("cost_usd").decimal_places)


def ledger_usd(amount: Decimal) -> Decimal:
    """An amount as the ledger column stores it, rounded here rather than by the database
    so that the run, the session and the ledger row all carry the very same figure."""
    return amount.quantize(LEDGER_QUANTUM, rounding=ROUND_HALF_UP)
