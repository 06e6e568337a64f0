"""Keep-warm arithmetic: whether reading a cached prefix before it expires, until the
agent's next wake, costs less than writing it again at that wake.

A cached prefix lives for its lifetime (5 minutes or 1 hour) from its last write or read.
An agent whose next wake comes later pays, at that wake, a cache write of the whole prefix
(1.25x or 2x input). A refresh, a request that reads the prefix and asks for one output
token, restarts the lifetime for the price of a cache read (0.1x input) plus its own few
tokens; enough of them, spaced under the lifetime, carry the prefix to the wake, where it
is read instead of written. The refresh pays when the refreshes cost less than the write
they save minus the read that replaces it.

This module only decides; nothing here sends a request. (Sending the refreshes, billed
through `RunCalls` with the ledger kind `cache_refresh`, is not built yet.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

from costs_app.pricing import MILLION, Rates

LIFETIMES = {"5m": timedelta(minutes=5), "1h": timedelta(hours=1)}
# What a refresh adds to the prefix it reads: the short user turn after the cached prefix
# and the one output token it asks for.
REFRESH_INPUT_TOKENS = 16
REFRESH_OUTPUT_TOKENS = 1


@dataclass(frozen=True)
class KeepWarm:
    """The decision for one agent and one wake, with its figures in USD."""

    refresh: bool
    refreshes: int  # how many refreshes carry the prefix to the wake (0: it is alive then)
    refreshes_usd: Decimal  # what they cost
    rewrite_usd: Decimal  # the write at the wake they avoid, less the read that replaces it
    saved_usd: Decimal  # what refreshing saves (0 when it does not refresh)
    reason: str


def refreshes_needed(gap: timedelta, lifetime: timedelta) -> int:
    """Refreshes, each just before the prefix expires, so that it is alive at the wake
    `gap` after the last call: none when the wake comes within the lifetime."""
    if gap <= lifetime:
        return 0
    return math.ceil(gap / lifetime) - 1


def keep_warm_decide(*, prefix_tokens: int, ttl: str, gap: timedelta, rates: Rates) -> KeepWarm:
    """Whether to keep a prefix of `prefix_tokens` cached at lifetime `ttl` warm until the
    wake `gap` after its last use, at `rates` (the model's price, per million tokens)."""
    lifetime = LIFETIMES[ttl]
    write = rates.cache_write_1h if ttl == "1h" else rates.cache_write_5m
    rewrite = prefix_tokens * (write - rates.cache_read) / MILLION
    count = refreshes_needed(gap, lifetime)
    if prefix_tokens <= 0:
        return KeepWarm(False, 0, Decimal(0), Decimal(0), Decimal(0), "nothing is cached")
    if count == 0:
        return KeepWarm(False, 0, Decimal(0), rewrite, Decimal(0), "the prefix is still cached at the next wake")
    one = (
        prefix_tokens * rates.cache_read + REFRESH_INPUT_TOKENS * rates.input + REFRESH_OUTPUT_TOKENS * rates.output
    ) / MILLION
    refreshes = count * one
    if refreshes < rewrite:
        return KeepWarm(True, count, refreshes, rewrite, rewrite - refreshes, "refreshing costs less than rewriting")
    return KeepWarm(False, count, refreshes, rewrite, Decimal(0), "rewriting at the wake costs less")
