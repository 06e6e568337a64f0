"""Cost rollups over the ledger, shared by the API, the admin costs page and cost_report.

Days are UTC days: the ledger stores UTC and operators compare against the provider's
invoices, which are UTC too. The rollups by day and month read cost_days, the ledger
summed per UTC day by the database in each ledger write's statement (models.CostDay), so
they cost a few rows per agent and day however many calls the ledger holds; each is one
aggregate query on an indexed range.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal
from uuid import UUID

from django.db.models import F, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from costs_app.models import CostDay, CostEvent

ZERO = Decimal(0)
# Over cost_days rows, each already the sum of its day's ledger rows (`events` counts
# them). Only grouped: a group has rows, so no sum is NULL.
TOKEN_SUMS = {
    column: Sum(column)
    for column in (
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "cost_usd",
        "events",
    )
}


def window_start(*, now: datetime, days: int) -> datetime:
    """Midnight UTC of the first of the last `days` days (today included)."""
    today = now.astimezone(tz=timezone.get_fixed_timezone(0)).date()
    first = today - timedelta(days=days - 1)
    return datetime(first.year, first.month, first.day, tzinfo=timezone.get_fixed_timezone(0))


def days_for(*, company_id: UUID | None, agent_id: UUID | None = None, since: date | None = None):
    """The cost_days rows of a company (None: every company), or of one of its agents, from
    the UTC day `since` on: the agent's through cost_days_one_per_key, the company's
    through cost_days_company_day_idx."""
    rows = CostDay.objects.all() if company_id is None else CostDay.objects.filter(company_id=company_id)
    if agent_id is not None:
        rows = rows.filter(agent_id=agent_id)
    if since is not None:
        rows = rows.filter(day__gte=since)
    return rows


def daily_costs(*, company_id: UUID, now: datetime, days: int = 30, agent_id: UUID | None = None) -> list[dict]:
    """Per UTC day, newest first: tokens and cost. Days without spend are omitted."""
    since = window_start(now=now, days=days).date()
    rows = (
        days_for(company_id=company_id, agent_id=agent_id, since=since)
        .values("day")
        .annotate(**TOKEN_SUMS)
        .order_by("-day")
    )
    return list(rows)


def daily_costs_by_agent(*, company_id: UUID | None, now: datetime, days: int = 30) -> list[dict]:
    """Per UTC day and agent (for charts): day, agent_id, tokens, cost."""
    since = window_start(now=now, days=days).date()
    return list(
        days_for(company_id=company_id, since=since)
        .values("day", "agent_id")
        .annotate(**TOKEN_SUMS)
        .order_by("day", "agent_id")
    )


def month_to_date(*, company_id: UUID, now: datetime, agent_id: UUID | None = None) -> list[dict]:
    """This UTC month so far, per agent and model."""
    month_start = now.astimezone(timezone.get_fixed_timezone(0)).date().replace(day=1)
    return list(
        days_for(company_id=company_id, agent_id=agent_id, since=month_start)
        .values("agent_id", "model")
        .annotate(**TOKEN_SUMS)
        .order_by("agent_id", "model")
    )


# When input growth is worth an operator's time: enough calls to be a trend, and a slope
# that would add GROWTH_SHARE of the agent's ceiling (its context budget or its model's
# window) within GROWTH_HORIZON_RUNS more runs. "From 12 to 119 tokens over 6 calls" is not.
GROWTH_MIN_CALLS = 10
GROWTH_HORIZON_RUNS = 50
GROWTH_SHARE = 0.10


@dataclass(frozen=True)
class Growth:
    """Least-squares slope of input tokens per run over an agent's recent runs."""

    agent_id: UUID
    runs: int
    slope_tokens_per_run: float
    first_input_tokens: int
    last_input_tokens: int

    def is_growing(self, *, ceiling_tokens: int) -> bool:
        """A steady rise, over enough calls, that matters against `ceiling_tokens`: what the
        agent's requests may grow to (sessions_app.context_defaults.growth_ceiling)."""
        if self.runs < GROWTH_MIN_CALLS or self.last_input_tokens <= self.first_input_tokens:
            return False
        return self.slope_tokens_per_run * GROWTH_HORIZON_RUNS >= GROWTH_SHARE * ceiling_tokens

    def runs_to_add(self, tokens: int) -> int | None:
        """Runs until the input per call has grown by `tokens` at this slope (None: flat)."""
        return int(tokens / self.slope_tokens_per_run) if self.slope_tokens_per_run > 0 else None


def slope(values: list[int]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    numerator = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
    denominator = sum((x - mean_x) ** 2 for x in range(n))
    return numerator / denominator


def input_growth(*, agent_id: UUID, last_runs: int = 30) -> Growth:
    """Input tokens of the agent's last message calls, oldest first, and their slope.

    Input here counts everything the model read: uncached, cache writes and cache reads,
    since all three grow with replayed history.
    """
    recent = list(
        CostEvent.objects.filter(agent_id=agent_id, kind="message")
        .order_by("-created_at")
        .annotate(total_in=F("input_tokens") + F("cache_creation_input_tokens") + F("cache_read_input_tokens"))
        .values_list("total_in", flat=True)[:last_runs]
    )
    recent.reverse()
    return Growth(
        agent_id=agent_id,
        runs=len(recent),
        slope_tokens_per_run=slope(recent),
        first_input_tokens=recent[0] if recent else 0,
        last_input_tokens=recent[-1] if recent else 0,
    )


def daily_input_growth(*, agent_id: UUID, now: datetime, days: int = 14) -> dict:
    """Slope of the agent's average input tokens per call, per UTC day, over `days` days."""
    since = window_start(now=now, days=days).date()
    rows = list(
        CostDay.objects.filter(agent_id=agent_id, kind="message", day__gte=since)
        .values("day")
        .annotate(
            total_in=Coalesce(
                Sum(F("input_tokens") + F("cache_creation_input_tokens") + F("cache_read_input_tokens")), 0
            ),
            calls=Coalesce(Sum("events"), 0),
        )
        .order_by("day")
    )
    per_call = [row["total_in"] // max(row["calls"], 1) for row in rows]
    return {
        "days": [
            {"day": row["day"].isoformat(), "input_tokens_per_call": value}
            for row, value in zip(rows, per_call, strict=True)
        ],
        "slope_tokens_per_day": slope(per_call),
    }
