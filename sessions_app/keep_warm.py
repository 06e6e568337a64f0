"""Keep-warm arithmetic: whether reading a cached prefix before it expires, until the
agent's next wake, costs less than writing it again at that wake.

A cached prefix lives for its lifetime (5 minutes or 1 hour) from its last write or read.
An agent whose next wake comes later pays, at that wake, a cache write of the whole prefix
(1.25x or 2x input). A refresh, a request that reads the prefix and asks for one output
token, restarts the lifetime for the price of a cache read (0.1x input) plus its own few
tokens; enough of them, spaced under the lifetime, carry the prefix to the wake, where it
is read instead of written. The refresh pays when the refreshes cost less than the write
they save minus the read that replaces it.

Refreshes are sent by the maintenance pass's workers (`sessions_app.cache_refresh`), which
pick a session up within a minute of its refresh falling due: a refresh is due REFRESH_MARGIN
before the prefix would expire, so refreshes come every lifetime less that margin.

This module decides; `keep_warm_arm` writes the decision on the session after a commit
(the sending is `sessions_app.cache_refresh`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db.models import Count, Exists, OuterRef, Subquery, Sum

from costs_app.models import CostEvent, CostKind
from costs_app.money import usd
from costs_app.pricing import MILLION, Rates, price_table
from sessions_app.models import Agent, AgentSession
from sessions_app.wakes import HeartbeatPlan

logger = logging.getLogger(__name__)

LIFETIMES = {"5m": timedelta(minutes=5), "1h": timedelta(hours=1)}
# How long before its prefix expires a refresh falls due: the maintenance pass that finds it
# runs every minute, and its worker may wait behind others.
REFRESH_MARGIN = {"5m": timedelta(minutes=2), "1h": timedelta(minutes=5)}
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


def refresh_spacing(ttl: str) -> timedelta:
    """The time from a use of the prefix to the refresh that keeps it."""
    return LIFETIMES[ttl] - REFRESH_MARGIN[ttl]


def refreshes_needed(gap: timedelta, ttl: str) -> int:
    """Refreshes, each REFRESH_MARGIN before the prefix expires, so that it is alive at the
    wake `gap` after the last call: none when the wake comes a margin before expiry (a wake
    due at the very end of the lifetime is late more often than not: the scheduler's and
    the queue's delays come after it)."""
    spacing = refresh_spacing(ttl)
    if gap <= spacing:
        return 0
    return max(1, math.ceil((gap - LIFETIMES[ttl]) / spacing))


def keep_warm_decide(*, prefix_tokens: int, ttl: str, gap: timedelta, rates: Rates) -> KeepWarm:
    """Whether to keep a prefix of `prefix_tokens` cached at lifetime `ttl` warm until the
    wake `gap` after its last use, at `rates` (the model's price, per million tokens)."""
    write = rates.cache_write_1h if ttl == "1h" else rates.cache_write_5m
    rewrite = prefix_tokens * (write - rates.cache_read) / MILLION
    count = refreshes_needed(gap, ttl)
    if prefix_tokens <= 0:
        return KeepWarm(False, 0, Decimal(0), Decimal(0), Decimal(0), "nothing is cached")
    if count == 0:
        return KeepWarm(False, 0, Decimal(0), rewrite, Decimal(0), "the prefix is still cached at the next wake")
    refreshes = count * refresh_usd(prefix_tokens, rates)
    if refreshes < rewrite:
        return KeepWarm(True, count, refreshes, rewrite, rewrite - refreshes, "refreshing costs less than rewriting")
    return KeepWarm(False, count, refreshes, rewrite, Decimal(0), "rewriting at the wake costs less")


def refresh_usd(prefix_tokens: int, rates: Rates) -> Decimal:
    """What one refresh of a prefix of `prefix_tokens` costs."""
    return (
        prefix_tokens * rates.cache_read + REFRESH_INPUT_TOKENS * rates.input + REFRESH_OUTPUT_TOKENS * rates.output
    ) / MILLION


def keep_warm_beats_uncached(*, prefix_tokens: int, turn_tokens: int, gap: timedelta, rates: Rates) -> bool:
    """Whether an agent waking `gap` apart, an hour or more, pays less per wake with its
    prefix in the 1-hour cache kept warm (the refreshes, the prefix read at the wake, the
    new turn written at the 1-hour price) than sending all of it uncached, as it would
    without caching (`sessions_app.context_defaults`: an hour apart every write expires
    unread)."""
    warm = (
        refreshes_needed(gap, "1h") * refresh_usd(prefix_tokens, rates)
        + (prefix_tokens * rates.cache_read + turn_tokens * rates.cache_write_1h) / MILLION
    )
    cold = (prefix_tokens + turn_tokens) * rates.input / MILLION
    return warm < cold


def keep_warm_applies(config: dict, *, persistent: bool) -> bool:
    """Whether an agent's prefix may be kept warm: a persistent agent of the Messages API
    runtime (this service replays its history, so it knows the prefix) that wakes on a
    schedule (so its next wake is known), with `cache_keep_warm` not "off"."""
    return (
        persistent
        and config.get("cache_keep_warm", "auto") != "off"
        and config.get("runtime", "api") == "api"
        and HeartbeatPlan.of(config) is not None
    )


def prefix_tokens_of(usage: dict | None) -> int:
    """The tokens of a call's request: with the cache marker at its end, the prefix cached."""
    usage = usage or {}
    return sum(
        int(usage.get(key) or 0) for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    )


def keep_warm_arm(*, agent: Agent, session_id, ttl: str | None, usage: dict | None, at: datetime) -> None:
    """After a heartbeat's commit: decide whether to keep the prefix it cached (`ttl`, its
    `usage`) warm until the agent's next wake, and when the first refresh falls due. An
    agent that keep-warm does not apply to writes nothing. Never the run's failure."""
    if ttl is None or not keep_warm_applies(agent.adapter_config, persistent=agent.is_persistent):
        return
    try:
        keep_warm_record(agent=agent, session_id=session_id, ttl=ttl, prefix_tokens=prefix_tokens_of(usage), at=at)
    except Exception:  # the next wake writes the prefix again: money, never data
        logger.exception("Could not decide keep-warm for session %s", session_id)


def keep_warm_record(*, agent: Agent, session_id, ttl: str, prefix_tokens: int, at: datetime) -> dict | None:
    """Decide for the next wake after `at` and write the decision on the session; None
    when there is no next wake or no price to decide with (nothing is refreshed)."""
    from sessions_app.schedules import agent_next_wakes

    wakes = agent_next_wakes(agent=agent, now=at, count=1)
    table = price_table(model=agent.model_name, at=at)
    if not wakes or table is None:
        AgentSession.objects.filter(pk=session_id).update(cache_refresh_at=None)
        return None
    decision = keep_warm_decide(prefix_tokens=prefix_tokens, ttl=ttl, gap=wakes[0] - at, rates=table.rates())
    record = {
        "decided_at": at.isoformat(),
        "next_wake": wakes[0].isoformat(),
        "ttl": ttl,
        "prefix_tokens": prefix_tokens,
        "refresh": decision.refresh,
        "refreshes": decision.refreshes,
        "refreshes_usd": usd(decision.refreshes_usd),
        "rewrite_usd": usd(decision.rewrite_usd),
        "saved_usd": usd(decision.saved_usd),
        "reason": decision.reason,
    }
    due = at + refresh_spacing(ttl) if decision.refresh else None
    AgentSession.objects.filter(pk=session_id).update(keep_warm=record, cache_refresh_at=due)
    return record


def keep_warm_report(session: AgentSession, *, at: datetime | None = None) -> dict | None:
    """What the API and the admin show of a session's keep-warm: the last decision, the
    next refresh's time, and from the ledger (two aggregates) the refreshes sent, what they
    cost, and what they saved: the prefix the wakes after them read instead of writing
    again, at the write price less the read price, less the refreshes' cost."""
    if session.keep_warm is None:
        return None
    sent = CostEvent.objects.filter(session_id=session.pk, kind=CostKind.CACHE_REFRESH).aggregate(
        count=Count("id"), usd=Sum("cost_usd")
    )
    spent = sent["usd"] or Decimal(0)
    table = price_table(model=session.model, at=at or datetime.now(UTC)) if session.model else None
    saved = None
    if table is not None:
        rates = table.rates()
        write = rates.cache_write_1h if session.keep_warm["ttl"] == "1h" else rates.cache_write_5m
        saved = refreshed_reads(session.pk) * (write - rates.cache_read) / MILLION - spent
    return {
        **session.keep_warm,
        "next_refresh_at": session.cache_refresh_at.isoformat() if session.cache_refresh_at else None,
        "refreshes_sent": sent["count"],
        "refreshes_sent_usd": usd(spent),
        "refreshes_saved_usd": usd(saved) if saved is not None else None,
    }


def refreshed_reads(session_id) -> int:
    """The cache reads of the session's heartbeat calls that came after a refresh (one since
    the call before them): what the refreshes kept alive."""
    calls = CostEvent.objects.filter(session_id=session_id, kind=CostKind.MESSAGE)
    before = calls.filter(created_at__lt=OuterRef("created_at")).order_by("-created_at").values("created_at")[:1]
    refreshed = CostEvent.objects.filter(
        session_id=session_id,
        kind=CostKind.CACHE_REFRESH,
        created_at__lt=OuterRef("created_at"),
        created_at__gt=OuterRef("before"),
    )
    reads = (
        calls.annotate(before=Subquery(before))
        .filter(Exists(refreshed))
        .aggregate(tokens=Sum("cache_read_input_tokens"))["tokens"]
    )
    return int(reads or 0)


def keep_warm_summary(report: dict | None) -> str:
    """One line of `keep_warm_report` for the admin's pages."""
    if report is None:
        return "does not apply (a persistent agent of the Messages API on a schedule, cache_keep_warm not off)"
    if report["refresh"]:
        decision = (
            f"refresh before the next wake: {report['refreshes']} refreshes, ${Decimal(report['refreshes_usd']):.4f}, "
            f"save ${Decimal(report['saved_usd']):.4f} of a ${Decimal(report['rewrite_usd']):.4f} rewrite"
        )
    else:
        decision = f"no refresh: {report['reason']}"
    nxt = f"; next refresh due {report['next_refresh_at']}" if report["next_refresh_at"] else ""
    saved = (
        f", saving ${Decimal(report['refreshes_saved_usd']):.4f} at the wakes after them"
        if report["refreshes_saved_usd"] is not None
        else ""
    )
    return (
        f"{decision} ({report['prefix_tokens']} tokens cached for {report['ttl']}, next wake {report['next_wake']}){nxt}; "
        f"sent so far {report['refreshes_sent']} (${Decimal(report['refreshes_sent_usd']):.4f}, from the ledger){saved}"
    )
