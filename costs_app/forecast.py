"""When each budget limit will be crossed at the current daily rate.

The daily rate of a scope (a company, or one agent) is what it spent in the last 7 days
(the 168 hours ending now) divided by the days that window covers for it: 7, or fewer
(at least 1) when the scope's first spend in the window is more recent, so an agent that
started spending yesterday is not read as spending a seventh of its rate.

A limit's forecast is now + (limit - spent) / rate, as a UTC date. There is none when the
rate is zero, the limit is already reached, the crossing falls after the period ends (a
daily or monthly limit starts over first), or for the daily run cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.db.models import Min, Q, Sum
from django.db.models.functions import Coalesce

from costs_app.budgets import BudgetUse, next_month, period_start
from costs_app.models import CostEvent

RATE_DAYS = 7
ZERO = Decimal(0)
# Beyond this a forecast says nothing useful (and would overflow a date).
HORIZON_DAYS = 36_500


@dataclass(frozen=True)
class Forecast:
    daily_rate_usd: Decimal
    date: date | None  # the UTC day the limit is crossed at this rate; None: not foreseen


def daily_rates(*, company_id, agent_ids: set, now: datetime) -> dict:
    """The daily rate of each scope in `agent_ids` (None: the whole company), in one query."""
    if not agent_ids:
        return {}
    since = now - timedelta(days=RATE_DAYS)
    events = CostEvent.objects.filter(company_id=company_id, created_at__gte=since, created_at__lte=now)
    if None not in agent_ids:
        events = events.filter(agent_id__in=agent_ids)
    scopes = list(agent_ids)
    aggregates = {}
    for i, agent_id in enumerate(scopes):
        condition = Q(agent_id=agent_id) if agent_id is not None else None
        aggregates[f"spent_{i}"] = Coalesce(Sum("cost_usd", filter=condition), ZERO)
        aggregates[f"first_{i}"] = Min("created_at", filter=condition)
    totals = events.aggregate(**aggregates)
    return {
        agent_id: daily_rate(spent=totals[f"spent_{i}"], first=totals[f"first_{i}"], now=now)
        for i, agent_id in enumerate(scopes)
    }


def daily_rate(*, spent: Decimal | None, first: datetime | None, now: datetime) -> Decimal:
    """USD a day: `spent` in the window, over the days since its `first` event (1 to 7)."""
    if not spent or first is None:
        return ZERO
    covered = (now - first).total_seconds() / 86_400
    days = Decimal(str(round(min(max(covered, 1), RATE_DAYS), 6)))
    return spent / days


def crossing_date(use: BudgetUse, *, rate: Decimal, now: datetime) -> date | None:
    """The UTC day `use`'s limit is crossed at `rate` USD a day (see the module's rules)."""
    remaining = use.limit - use.spent
    if use.period == "day_runs" or rate <= 0 or remaining <= 0:
        return None
    days = remaining / rate
    if days > HORIZON_DAYS:
        return None
    at = now + timedelta(days=float(days))
    ends = {"day": (period_start("day", now) or now) + timedelta(days=1), "month": next_month(now)}.get(use.period)
    if ends is not None and at >= ends:
        return None
    return at.astimezone(UTC).date()


def budget_forecasts(*, company_id, uses: list[BudgetUse], now: datetime) -> dict:
    """The forecast of each money limit in `uses`, keyed by (scope, period); one query."""
    money = [use for use in uses if use.period != "day_runs"]
    rates = daily_rates(company_id=company_id, agent_ids={use.agent_id for use in money}, now=now)
    return {
        (use.scope, use.period): Forecast(
            daily_rate_usd=rates[use.agent_id], date=crossing_date(use, rate=rates[use.agent_id], now=now)
        )
        for use in money
    }
