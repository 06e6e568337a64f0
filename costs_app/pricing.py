"""Prices, and what a call's reported usage costs, in exact Decimal.

Where a price comes from:
- the operator's overrides (`ModelPrice` rows: a negotiated price, a change the library does
  not have yet) win over everything from their `effective_from` UTC day on;
- otherwise the `genai-prices` library's bundled data (its Anthropic provider, read from
  memory: never fetched; its background updater is never started), which knows every Claude
  model with its dated snapshot ids, 5-minute and 1-hour cache writes, cache reads, the
  long-prompt tiers (a request whose prompt, input + cache reads + cache writes, passes a
  tier's start is billed at that tier for every token) and web searches;
- a model neither knows is unpriced: its calls are recorded at 0 and flagged.

A call is priced at the price in force when it was made. Request-level factors apply on top:
the Batch discount (`delivery="batch"`: the library's batch price variant, or half of every
rate where it has none) and `inference_geo` (PAPERCLIP_INFERENCE_GEO_MULTIPLIERS).

Token classes are priced separately: uncached input, output, cache writes (5-minute and
1-hour lifetimes differ) and cache reads. With server-side compaction the API reports the
summarising pass only in `usage.iterations`, so those entries are added to the top-level
counts (the `message` iteration mirrors the top level and is not added twice); each is a
request of its own for the tiers.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal

import genai_prices
from django.conf import settings
from django.db import transaction
from django.db.models import Subquery
from genai_prices import data_snapshot
from genai_prices import types as library_types

from costs_app.models import CostEvent, Delivery, ModelPrice, PriceOverridesRevision
from costs_app.money import usd

MILLION = Decimal(1_000_000)
THOUSAND = Decimal(1000)
LIBRARY_VERSION = genai_prices.__version__
LIBRARY_SOURCE = f"library {LIBRARY_VERSION}"
OVERRIDE_SOURCE = "override"
PROVIDER_ID = "anthropic"
# Anthropic's Batch API bills half of every rate: used for an override, and for a library
# model without a batch price variant in force.
BATCH_FACTOR = Decimal("0.5")
BATCH_CONTEXT = {"processing": "batch"}


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


def _sampled_counts(usage: dict) -> list[TokenCounts]:
    """The counts of each sampling a usage reports: the top level, then each iteration
    beyond it (a server compaction's summarising pass)."""
    counts = [_counts_of(usage)]
    for iteration in usage.get("iterations") or []:
        if isinstance(iteration, dict) and iteration.get("type") != "message":
            counts.append(_counts_of(iteration))
    return counts


def token_counts(usage: dict) -> TokenCounts:
    return sum(_sampled_counts(usage), TokenCounts())


def web_searches(usage: dict) -> int:
    """Web searches the call made (`usage.server_tool_use.web_search_requests`)."""
    server_tools = usage.get("server_tool_use")
    return _count(server_tools.get("web_search_requests")) if isinstance(server_tools, dict) else 0


# Claude Code names a model's 1M-context variant `<model>[1m]`; a dated snapshot id
# (claude-opus-4-5-20251101, or @20251101 as some platforms write it) names one release.
VARIANT_SUFFIX = re.compile(r"\[[0-9a-z]+\]$", re.IGNORECASE)
SNAPSHOT_SUFFIX = re.compile(r"[-@]\d{8}$")


def model_base(model: str) -> str:
    """The model id without a context variant suffix (`[1m]`)."""
    return VARIANT_SUFFIX.sub("", model.strip())


def model_family(model: str) -> str:
    """The family a snapshot or variant id belongs to (the model itself when it is neither)."""
    return SNAPSHOT_SUFFIX.sub("", model_base(model))


def _names(model: str) -> list[str]:
    """The ids a model is priced by, most specific first."""
    return list(dict.fromkeys([model, model_base(model), model_family(model)]))


# --- the library ----------------------------------------------------------------------------


@functools.cache
def _provider() -> library_types.Provider:
    # The bundled snapshot (get_snapshot() would return one set by genai-prices' own
    # updater, which nothing here starts).
    return data_snapshot.get_snapshot().find_provider(None, PROVIDER_ID, None)


@functools.lru_cache(maxsize=4096)
def library_model(model: str) -> library_types.ModelInfo | None:
    """The library's model for an id (a snapshot or `[1m]` variant finds its family), None
    when the library has no price for it."""
    provider = _provider()
    for name in _names(model):
        found = provider.find_model(name)
        if found is not None and found.prices:
            return found
    return None


def library_models() -> list[library_types.ModelInfo]:
    """Every model the library prices (for the catalogue of an install without one)."""
    return [model for model in _provider().models if model.prices]


def _has_batch_variant(model: library_types.ModelInfo, at: datetime) -> bool:
    return any(
        variant.when == BATCH_CONTEXT and (variant.constraint is None or variant.constraint.active(at))
        for variant in model.price_variants or ()
    )


def _tier_rate(price, prompt_tokens: int) -> Decimal | None:
    """A library price at the tier a prompt of `prompt_tokens` is billed at (every token
    of a request past a tier's start is billed at that tier)."""
    if isinstance(price, library_types.TieredPrices):
        rate = price.base
        for tier in price.tiers:
            if prompt_tokens > tier.start:
                rate = tier.price
        return rate
    return price


# --- overrides ------------------------------------------------------------------------------


# How long a process trusts the overrides it read without looking at the revision again.
# A heartbeat's claim reads the revision in its own query (`overrides_revision_seen`), so
# the worker path never waits on this; it bounds how stale any other process can be.
OVERRIDES_TRUSTED_SECONDS = 60.0


@dataclass(frozen=True)
class KnownOverrides:
    """The overrides as this process last read them: by model, newest `effective_from` first."""

    revision: int
    confirmed: float  # time.monotonic() of the last look at the revision
    by_model: dict[str, tuple[ModelPrice, ...]]


_known: KnownOverrides | None = None


# Set in a thread whose open transaction changed an override: what it reads may yet be
# rolled back, so it is not kept (Django has no hook for a ROLLBACK).
class _Changing(threading.local):
    active = False


_changing = _Changing()


def overrides_revision() -> Subquery:
    """The revision, as a column of a query a caller makes anyway (the heartbeat's claim)."""
    return Subquery(PriceOverridesRevision.objects.filter(pk=1).values("revision")[:1])


def overrides_revision_seen(revision: int | None) -> None:
    """A query just read the revision: confirm what this process knows, or forget it."""
    global _known
    known = _known
    if known is not None and known.revision == (revision or 0):
        _known = replace(known, confirmed=time.monotonic())
    else:
        _known = None


def overrides_changed(**_signal) -> None:
    """`ModelPrice` saved or deleted (post_save / post_delete). The revision has moved in the
    same statement (a trigger on `model_prices`, migration 0017, which also covers update(),
    bulk_create() and SQL), so every process re-reads; this one forgets what it read at
    once, and again at COMMIT (a read in between would have cached the uncommitted rows)."""
    overrides_forget()
    _changing.active = transaction.get_connection().in_atomic_block
    transaction.on_commit(overrides_forget)


def overrides_forget() -> None:
    """Drop what this process read (also at the start of each test)."""
    global _known
    _known = None
    _changing.active = False


def _overrides_read() -> dict[str, tuple[ModelPrice, ...]]:
    by_model: dict[str, list[ModelPrice]] = {}
    for row in ModelPrice.objects.order_by("model", "-effective_from"):
        by_model.setdefault(row.model, []).append(row)
    return {name: tuple(rows) for name, rows in by_model.items()}


def _overrides() -> dict[str, tuple[ModelPrice, ...]]:
    global _known
    if _changing.active:
        if transaction.get_connection().in_atomic_block:
            return _overrides_read()
        _changing.active = False  # that transaction ended (a COMMIT clears it too)
    known = _known
    if known is not None and time.monotonic() - known.confirmed <= OVERRIDES_TRUSTED_SECONDS:
        return known.by_model
    revision = PriceOverridesRevision.objects.filter(pk=1).values_list("revision", flat=True).first() or 0
    if known is None or known.revision != revision:
        known = KnownOverrides(revision, 0.0, _overrides_read())
    _known = replace(known, confirmed=time.monotonic())
    return known.by_model


def override_for(*, model: str, at: datetime) -> ModelPrice | None:
    """The operator's price in force for `model` on the UTC day of `at`, if any, from the
    overrides this process holds in memory (re-read when their revision moves). A snapshot
    or variant id without a row of its own takes its family's; a row for the exact id wins."""
    day = at.astimezone(UTC).date()
    overrides = _overrides()
    for name in _names(model):
        for row in overrides.get(name, ()):
            if row.effective_from <= day:
                return row
    return None


# --- what a call costs ----------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    """USD per million tokens of one request, at the tier its prompt size falls in, with
    the request's factors (batch, geo) applied; web searches per thousand."""

    input: Decimal
    output: Decimal
    cache_write_5m: Decimal
    cache_write_1h: Decimal
    cache_read: Decimal
    web_searches_per_k: Decimal


@dataclass(frozen=True)
class PriceTable:
    """The price in force for one model at one moment, for one kind of request."""

    source: str
    factor: Decimal  # batch (where the price has no batch rates of its own) x geo
    override: ModelPrice | None = None
    library: library_types.ModelInfo | None = None
    library_price: library_types.ModelPrice | None = None
    price_context: dict | None = None
    at: datetime | None = None

    @property
    def tiered(self) -> bool:
        """Whether longer prompts are billed at higher rates."""
        price = self.library_price
        return price is not None and any(
            isinstance(value, library_types.TieredPrices) for value in vars(price).values()
        )

    def rates(self, *, prompt_tokens: int = 0) -> Rates:
        if self.override is not None:
            row = self.override
            rates = (
                row.input_usd_per_mtok,
                row.output_usd_per_mtok,
                row.cache_write_5m_usd_per_mtok,
                row.cache_write_1h_usd_per_mtok,
                row.cache_read_usd_per_mtok,
            )
            searches = self._library_searches()
        else:
            price = self.library_price

            def rate(key: str, fallback: Decimal | None = None) -> Decimal:
                found = _tier_rate(getattr(price, key, None), prompt_tokens)
                return found if found is not None else (fallback if fallback is not None else Decimal(0))

            base = rate("input_mtok")
            five = rate("cache_write_mtok", base)
            rates = (base, rate("output_mtok"), five, rate("cache_write_1h_mtok", five), rate("cache_read_mtok", base))
            searches = rate("web_searches_kcount")
        return Rates(*(value * self.factor for value in rates), web_searches_per_k=searches * self.factor)

    def tier_starts(self) -> list[int]:
        """The prompt sizes past which a higher tier bills every token of a request."""
        price = self.library_price
        if price is None:
            return []
        return sorted(
            {
                tier.start
                for value in vars(price).values()
                if isinstance(value, library_types.TieredPrices)
                for tier in value.tiers
            }
        )

    def describe(self) -> str:
        """The rates per million tokens in words (admin, `manage.py prices`)."""
        parts = [rates_text(self.rates())]
        parts += [
            f"prompts over {start:,} tokens: {rates_text(self.rates(prompt_tokens=start + 1))}"
            for start in self.tier_starts()
        ]
        return "; ".join(parts)

    def _library_searches(self) -> Decimal:
        # An override sets token rates; a web search is still priced as the library does.
        model = library_model(self.override.model) if self.override is not None else None
        if model is None:
            return Decimal(0)
        value = getattr(model.get_prices(self.at), "web_searches_kcount", None)
        return value if isinstance(value, Decimal) else Decimal(0)

    def cost(self, usage: dict) -> Decimal:
        """What `usage` costs at this price, unrounded."""
        if self.override is not None:
            total = Decimal(0)
            for counts in _sampled_counts(usage):
                rates = self.rates()
                total += (
                    counts.input_tokens * rates.input
                    + counts.output_tokens * rates.output
                    + counts.cache_creation_5m_input_tokens * rates.cache_write_5m
                    + counts.cache_creation_1h_input_tokens * rates.cache_write_1h
                    + counts.cache_read_input_tokens * rates.cache_read
                ) / MILLION
            return total + web_searches(usage) * self.rates().web_searches_per_k / THOUSAND
        total = Decimal(0)
        for index, counts in enumerate(_sampled_counts(usage)):
            reported = genai_prices.Usage(
                input_tokens=counts.total_input_tokens,
                output_tokens=counts.output_tokens,
                cache_read_tokens=counts.cache_read_input_tokens,
                cache_write_tokens=counts.cache_creation_input_tokens,
                cache_write_1h_tokens=counts.cache_creation_1h_input_tokens,
                web_searches=web_searches(usage) if index == 0 else 0,
            )
            calculation = self.library.calc_price(
                reported, _provider(), genai_request_timestamp=self.at, price_context=self.price_context
            )
            total += calculation.total_price
        return total * self.factor


def rates_text(rates: Rates) -> str:
    def price(value: Decimal) -> str:
        return f"${usd(value)}"  # money by the one rule, as the admin and commands show it everywhere

    return (
        f"{price(rates.input)} in / {price(rates.output)} out, cache writes {price(rates.cache_write_5m)} (5m) / "
        f"{price(rates.cache_write_1h)} (1h), reads {price(rates.cache_read)} per MTok"
    )


def geo_factor(inference_geo: str | None) -> Decimal:
    """What `inference_geo` multiplies a price by (PAPERCLIP_INFERENCE_GEO_MULTIPLIERS; 1
    for a geo it does not list, such as "global")."""
    if not inference_geo:
        return Decimal(1)
    return settings.PAPERCLIP_INFERENCE_GEO_MULTIPLIERS.get(inference_geo, Decimal(1))


def dearest_geo() -> str | None:
    """The geo with the highest multiplier (None when none is above 1): a request naming no
    `inference_geo` runs in the workspace's default geo, which its answer may report as
    this one, so a reservation holds its price."""
    dearest = max(settings.PAPERCLIP_INFERENCE_GEO_MULTIPLIERS.items(), key=lambda item: item[1], default=None)
    return dearest[0] if dearest is not None and dearest[1] > 1 else None


def price_table(
    *, model: str, at: datetime, delivery: str = Delivery.DIRECT, inference_geo: str | None = None
) -> PriceTable | None:
    """The price in force for `model` at `at` (None: unpriced), from memory: the library's
    data and the operator's overrides (`override_for`)."""
    factor = geo_factor(inference_geo)
    batch = delivery == Delivery.BATCH
    override = override_for(model=model, at=at)
    if override is not None:
        return PriceTable(
            source=OVERRIDE_SOURCE, factor=factor * (BATCH_FACTOR if batch else 1), override=override, at=at
        )
    return library_table(model=model, at=at, delivery=delivery, factor=factor)


def library_table(*, model: str, at: datetime, delivery: str = Delivery.DIRECT, factor=Decimal(1)) -> PriceTable | None:
    """The library's price for `model` at `at`, overrides aside (None: it has none)."""
    found = library_model(model)
    if found is None:
        return None
    context = None
    if delivery == Delivery.BATCH:
        if _has_batch_variant(found, at):
            context = BATCH_CONTEXT
        else:
            factor *= BATCH_FACTOR
    return PriceTable(
        source=LIBRARY_SOURCE,
        factor=factor,
        library=found,
        library_price=found.get_prices(at, context),
        price_context=context,
        at=at,
    )


@dataclass(frozen=True)
class CallPrice:
    cost_usd: Decimal  # rounded as the ledger stores it (ledger_usd)
    source: str  # "library <genai-prices version>", "override", or "" when unpriced
    unpriced: bool
    override: ModelPrice | None  # the override row that priced it, if any


UNPRICED = CallPrice(cost_usd=Decimal(0), source="", unpriced=True, override=None)


def call_price(
    *, usage: dict, model: str, at: datetime, delivery: str = Delivery.DIRECT, inference_geo: str | None = None
) -> CallPrice:
    """What a call cost, as its ledger row says: priced by `model` (the model requested)
    at the price in force at `at`. `inference_geo` is the geo the request asked for (None:
    the one its usage reports, if any)."""
    geo = inference_geo or (usage.get("inference_geo") if isinstance(usage.get("inference_geo"), str) else None)
    table = price_table(model=model, at=at, delivery=delivery, inference_geo=geo)
    if table is None:
        return UNPRICED
    return CallPrice(
        cost_usd=ledger_usd(table.cost(usage)), source=table.source, unpriced=False, override=table.override
    )


def is_priced(*, model: str, at: datetime) -> bool:
    """Whether calls to `model` at `at` have a price (the library's, read from memory, or
    an override)."""
    return library_model(model) is not None or override_for(model=model, at=at) is not None


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
