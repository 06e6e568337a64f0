"""`sessions_app.keep_warm`: the arithmetic that decides whether a cached prefix is kept
warm until the next wake, over cadences from 5 minutes to 2 hours and both lifetimes, at
the price source's rates (genai-prices)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from costs_app.pricing import price_table
from sessions_app.keep_warm import keep_warm_decide, refreshes_needed

NOW = datetime(2026, 12, 1, tzinfo=UTC)
PREFIX = 50_000


@pytest.fixture
def rates(db):
    found = price_table(model="claude-opus-4-5", at=NOW).rates()
    # The figures the table below was worked out from (per million tokens).
    assert (found.input, found.output, found.cache_write_5m, found.cache_write_1h, found.cache_read) == (
        Decimal(5),
        Decimal(25),
        Decimal("6.25"),
        Decimal(10),
        Decimal("0.5"),
    )
    return found


# (lifetime, minutes to the next wake, refreshes needed, refresh?). A refresh comes 2 minutes
# (5-minute lifetime) or 5 minutes (1 hour) before expiry, and a wake that late in the
# lifetime counts as one that finds it expired. A 5-minute prefix saves 5.75 per
# token-million rewritten and a refresh costs 0.5 plus its own 105 micro-dollars: up to 11
# refreshes (33 minutes) pay; a 1-hour prefix saves 9.5: any cadence here pays.
TABLE = [
    ("5m", 3, 0, False),
    ("5m", 5, 1, True),
    ("5m", 10, 2, True),
    ("5m", 15, 4, True),
    ("5m", 30, 9, True),
    ("5m", 38, 11, True),
    ("5m", 39, 12, False),
    ("5m", 45, 14, False),
    ("5m", 60, 19, False),
    ("5m", 90, 29, False),
    ("5m", 120, 39, False),
    ("1h", 5, 0, False),
    ("1h", 30, 0, False),
    ("1h", 55, 0, False),
    ("1h", 60, 1, True),
    ("1h", 90, 1, True),
    ("1h", 120, 2, True),
]


@pytest.mark.parametrize(("ttl", "minutes", "count", "refresh"), TABLE)
def test_a_refresh_is_chosen_exactly_when_it_costs_less_than_the_rewrite(rates, ttl, minutes, count, refresh):
    decision = keep_warm_decide(prefix_tokens=PREFIX, ttl=ttl, gap=timedelta(minutes=minutes), rates=rates)
    assert (decision.refreshes, decision.refresh) == (count, refresh)
    write = rates.cache_write_1h if ttl == "1h" else rates.cache_write_5m
    assert decision.rewrite_usd == PREFIX * (write - rates.cache_read) / 1_000_000
    one = (PREFIX * rates.cache_read + 16 * rates.input + 1 * rates.output) / 1_000_000
    assert decision.refreshes_usd == count * one
    assert decision.saved_usd == (decision.rewrite_usd - decision.refreshes_usd if refresh else 0)
    assert decision.saved_usd >= 0


def test_the_batch_price_halves_both_sides_and_leaves_the_decision(rates):
    batch = price_table(model="claude-opus-4-5", at=NOW, delivery="batch").rates()
    for ttl, minutes, _, refresh in TABLE:
        gap = timedelta(minutes=minutes)
        # The refresh's own few tokens halve too: the same choice at half the figures.
        decision = keep_warm_decide(prefix_tokens=PREFIX, ttl=ttl, gap=gap, rates=batch)
        assert decision.refresh == refresh
        assert decision.saved_usd * 2 == keep_warm_decide(prefix_tokens=PREFIX, ttl=ttl, gap=gap, rates=rates).saved_usd


def test_a_tiny_prefix_is_not_worth_refreshing_and_nothing_cached_is_never_refreshed(rates):
    assert not keep_warm_decide(prefix_tokens=10, ttl="5m", gap=timedelta(minutes=10), rates=rates).refresh
    assert not keep_warm_decide(prefix_tokens=0, ttl="1h", gap=timedelta(hours=2), rates=rates).refresh


def test_refreshes_are_spaced_under_the_lifetime_less_a_margin():
    gaps = [timedelta(minutes=m) for m in (1, 3, 4, 5, 8, 9, 11)]
    assert [refreshes_needed(gap, "5m") for gap in gaps] == [0, 0, 1, 1, 1, 2, 2]
    assert [refreshes_needed(timedelta(minutes=m), "1h") for m in (55, 56, 115, 116)] == [0, 1, 1, 2]
