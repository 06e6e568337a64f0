"""Prices, and what a call's reported usage costs, in exact Decimal.

Token classes are priced separately: uncached input, output, cache writes (5-minute and
1-hour lifetimes differ) and cache reads. With server-side compaction the API reports the
summarising pass only in `usage.iterations`, so those entries are added to the top-level
counts (the `message` iteration mirrors the top level and is not added twice).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal

from django.conf import settings
from django.db.models import Case, IntegerField, Value, When

from costs_app.models import CostEvent, ModelPrice

MILLION = Decimal(1_000_000)


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


LEDGER_QUANTUM = Decimal(1).scaleb(-CostEvent._meta.get_field("cost_usd").decimal_places)


def ledger_usd(amount: Decimal) -> Decimal:
    """An amount as the ledger column stores it, rounded here rather than by the database
    so that the run, the session and the ledger row all carry the very same figure."""
    return amount.quantize(LEDGER_QUANTUM, rounding=ROUND_HALF_UP)


SECONDS_PER_HOUR = Decimal(3600)


def session_hour_rate() -> Decimal:
    """USD per active session hour (PAPERCLIP_SESSION_HOUR_USD); 0 turns metering off."""
    return Decimal(str(settings.PAPERCLIP_SESSION_HOUR_USD))


def session_hours_cost(seconds: float, *, rate: Decimal) -> Decimal:
    return (Decimal(str(seconds)) / SECONDS_PER_HOUR * rate).quantize(Decimal("0.0000000001"))
