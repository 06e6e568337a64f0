"""Budgets that stop spend before it happens.

Before each model call the heartbeat estimates its cost (input tokens x input price, plus
max_tokens x output price: the most it can cost) and reserves it against every limit that
applies, under a lock on the company row. Running runs' reservations count as spent, so
concurrent heartbeats near a limit cannot all pass: at most one call's estimate error can
overshoot. Paperclip's original checked only after a run ended, which let a $0.50 cap
spend $5.11.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db import transaction
from django.db.models import Exists, OuterRef, Q, Sum
from django.db.models.functions import Coalesce

from costs_app.models import Budget, CostEvent
from costs_app.pricing import MILLION, price_for

ZERO = Decimal(0)
PERIOD_NAMES = {"day": "daily", "month": "monthly", "lifetime": "lifetime", "day_runs": "daily run"}


class BudgetExceeded(Exception):
    code = "budget_exceeded"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class BudgetUse:
    scope: str  # "agent" or "company"
    period: str  # "day", "month" or "lifetime"; "day_runs" for the run cap
    limit: Decimal
    spent: Decimal
    reserved: Decimal
    warn_percent: int

    @property
    def percent(self) -> float:
        return float((self.spent + self.reserved) / self.limit * 100) if self.limit else 100.0

    @property
    def warning(self) -> bool:
        return self.percent >= self.warn_percent

    @property
    def exceeded(self) -> bool:
        return self.spent >= self.limit

    def describe(self) -> str:
        unit = "runs" if self.period == "day_runs" else "USD"
        return f"{self.scope} {PERIOD_NAMES[self.period]} limit: {self.spent:.6f} of {self.limit:.6f} {unit} used ({self.percent:.0f}%)"


def period_start(period: str, now: datetime) -> datetime | None:
    utc = now.astimezone(UTC)
    if period == "day":
        return utc.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "month":
        return utc.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return None


def budgets_for(*, company_id, agent_id) -> list[Budget]:
    return list(Budget.objects.filter(Q(agent__isnull=True) | Q(agent_id=agent_id), company_id=company_id))


def _spent(*, company_id, agent_id, since) -> Decimal:
    events = CostEvent.objects.filter(company_id=company_id)
    if agent_id is not None:
        events = events.filter(agent_id=agent_id)
    if since is not None:
        events = events.filter(created_at__gte=since)
    return events.aggregate(total=Coalesce(Sum("cost_usd"), ZERO))["total"]


def _reserved(*, company_id, agent_id, exclude_run_id) -> Decimal:
    from sessions_app.models import HeartbeatRun, RunStatus

    running = HeartbeatRun.objects.filter(company_id=company_id, status=RunStatus.RUNNING)
    if agent_id is not None:
        running = running.filter(agent_id=agent_id)
    if exclude_run_id is not None:
        running = running.exclude(id=exclude_run_id)
    return running.aggregate(total=Coalesce(Sum("reserved_usd"), ZERO))["total"]


def _runs_today(*, company_id, agent_id, now, exclude_run_id) -> int:
    from sessions_app.models import HeartbeatRun, RunStatus

    runs = HeartbeatRun.objects.filter(
        company_id=company_id,
        started_at__gte=period_start("day", now),
        status__in=[RunStatus.RUNNING, RunStatus.SUCCEEDED],
    )
    if agent_id is not None:
        runs = runs.filter(agent_id=agent_id)
    if exclude_run_id is not None:
        runs = runs.exclude(id=exclude_run_id)
    return runs.count()


def budget_uses(*, company_id, agent_id, now: datetime, exclude_run_id=None) -> list[BudgetUse]:
    uses = []
    for budget in budgets_for(company_id=company_id, agent_id=agent_id):
        scope_agent = budget.agent_id
        scope = "agent" if scope_agent else "company"
        limits = {
            "day": budget.daily_limit_usd,
            "month": budget.monthly_limit_usd,
            "lifetime": budget.lifetime_limit_usd,
        }
        money_limits = {period: limit for period, limit in limits.items() if limit is not None}
        # Calls in flight hold the same amount against every period of a scope: one query.
        reserved = (
            _reserved(company_id=company_id, agent_id=scope_agent, exclude_run_id=exclude_run_id)
            if money_limits
            else ZERO
        )
        for period, limit in money_limits.items():
            uses.append(
                BudgetUse(
                    scope=scope,
                    period=period,
                    limit=limit,
                    spent=_spent(company_id=company_id, agent_id=scope_agent, since=period_start(period, now)),
                    reserved=reserved,
                    warn_percent=budget.warn_percent,
                )
            )
        if budget.daily_run_limit is not None:
            runs = _runs_today(company_id=company_id, agent_id=scope_agent, now=now, exclude_run_id=exclude_run_id)
            uses.append(
                BudgetUse(
                    scope=scope,
                    period="day_runs",
                    limit=Decimal(budget.daily_run_limit),
                    spent=Decimal(runs),
                    reserved=ZERO,
                    warn_percent=budget.warn_percent,
                )
            )
    return uses


def budgets_exist(*, company_id_ref: str, agent_id_ref: str) -> Exists:
    """Whether any budget applies to an agent, as an expression over another query's
    columns: a heartbeat learns whether it must reserve money in the query that loads it,
    not in one more round trip."""
    return Exists(
        Budget.objects.filter(
            Q(agent__isnull=True) | Q(agent_id=OuterRef(agent_id_ref)), company_id=OuterRef(company_id_ref)
        )
    )


def budget_headroom(*, company_id, agent_id, now: datetime, exclude_run_id=None) -> Decimal | None:
    """The least money left under any limit (None without spending limits). Advisory:
    budget_reserve decides under the lock."""
    uses = budget_uses(company_id=company_id, agent_id=agent_id, now=now, exclude_run_id=exclude_run_id)
    money = [u for u in uses if u.period != "day_runs"]
    if not money:
        return None
    return min(u.limit - u.spent - u.reserved for u in money)


def estimate_call_cost(*, model: str, input_tokens: int, max_output_tokens: int, at: datetime) -> Decimal:
    """The most a call can cost: every input token uncached, every output token used."""
    price = price_for(model=model, at=at)
    if price is None:
        return ZERO
    return (input_tokens * price.input_usd_per_mtok + max_output_tokens * price.output_usd_per_mtok) / MILLION


def budget_reserve(*, run, agent, estimate: Decimal, now: datetime) -> str:
    """Hold `estimate` for this run against every applicable limit, or refuse.

    Returns a soft-warning text (empty when no limit is near).
    """
    from sessions_app.models import Company, HeartbeatRun

    with transaction.atomic():
        # One reservation at a time per company: the lock makes check-then-reserve atomic
        # across processes (on SQLite the IMMEDIATE transaction does the same).
        Company.objects.select_for_update().filter(id=agent.company_id).first()
        uses = budget_uses(company_id=agent.company_id, agent_id=agent.id, now=now, exclude_run_id=run.id)
        for use in uses:
            if use.period == "day_runs":
                if use.spent + 1 > use.limit:
                    raise BudgetExceeded(f"The {use.scope} daily run cap of {use.limit:.0f} runs is reached.")
                continue
            if use.spent + use.reserved + estimate > use.limit:
                raise BudgetExceeded(
                    f"This call could cost up to ${estimate:.6f}, which would cross the {use.scope} {PERIOD_NAMES[use.period]} "
                    f"budget of ${use.limit:.2f} (spent ${use.spent:.6f}, ${use.reserved:.6f} held by running calls)."
                )
        HeartbeatRun.objects.filter(id=run.id).update(reserved_usd=estimate)
    warnings = [
        use.describe()
        for use in uses
        if use.period != "day_runs" and (use.spent + use.reserved + estimate) / use.limit * 100 >= use.warn_percent
    ]
    return "Budget warning: " + "; ".join(warnings) if warnings else ""


def budgets_enforce(*, agent, now: datetime) -> bool:
    """Pause agents whose hard limit is reached (reason `budget`). True when paused."""
    from sessions_app.models import Agent, AgentStatus
    from sessions_app.services import agent_pause

    reached = [
        use
        for use in budget_uses(company_id=agent.company_id, agent_id=agent.id, now=now)
        if use.exceeded and use.period in ("month", "lifetime")
    ]
    if not reached:
        return False
    if any(use.scope == "company" for use in reached):
        targets = Agent.objects.filter(company_id=agent.company_id, status=AgentStatus.ACTIVE)
    else:
        targets = Agent.objects.filter(id=agent.id, status=AgentStatus.ACTIVE)
    for target in targets:
        agent_pause(agent=target, reason="budget")
    return True


def budgets_release(*, company_id, now: datetime) -> int:
    """After a budget changed: resume agents paused by budget that are now under it."""
    from sessions_app.models import Agent, AgentStatus
    from sessions_app.services import agent_resume

    resumed = 0
    for agent in Agent.objects.filter(company_id=company_id, status=AgentStatus.PAUSED, paused_reason="budget"):
        still = any(
            use.exceeded and use.period in ("month", "lifetime")
            for use in budget_uses(company_id=company_id, agent_id=agent.id, now=now)
        )
        if not still:
            agent_resume(agent=agent)
            resumed += 1
    return resumed


def next_month(now: datetime) -> datetime:
    start = period_start("month", now)
    return (start + timedelta(days=32)).replace(day=1)
