"""Budgets that stop spend before it happens.

Before each model call the heartbeat reserves the most it can cost (its input sized by its
byte bound, or measured with count_tokens near a limit; every token at the long-prompt
tier that size reaches, every input token at the dearest rate it can be billed at, a
1-hour cache write being 2x input, read twice under server compaction; every output token
used) against every limit that applies, under a lock on
the company row. Running runs' reservations count as spent, so concurrent heartbeats near
a limit cannot all pass: at most the error of one count_tokens measurement can overshoot.

This module decides and reserves; it never pauses or resumes agents. `budgets_crossed`
and `budgets_releasable` return a verdict, and sessions_app.services acts on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db import transaction
from django.db.models import Count, DecimalField, Exists, OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce

from costs_app.alerts import budget_alerts_fire
from costs_app.models import MONEY, Budget, CostEvent, Delivery
from costs_app.money import amount_text, usd
from costs_app.pricing import MILLION, dearest_geo, price_table
from paperclip.errors import RunFailure
from sessions_app.models import Company, HeartbeatRun, RunStatus

ZERO = Decimal(0)
PERIOD_NAMES = {"day": "daily", "month": "monthly", "lifetime": "lifetime", "day_runs": "daily run"}


class BudgetExceeded(RunFailure):
    code = "budget_exceeded"

    def __init__(self, message: str, *, use: BudgetUse | None = None) -> None:
        super().__init__(type(self).code, message)
        self.use = use  # the limit that refused, when one did (its hard-stop alert)


class ModelUnpriced(BudgetExceeded):
    """A budgeted call to a model without a price: its cost cannot be held against the
    budget, and counting it as free would let it spend without limit."""

    code = "model_unpriced"


@dataclass(frozen=True)
class BudgetUse:
    scope: str  # "agent" or "company"
    period: str  # "day", "month" or "lifetime"; "day_runs" for the run cap
    limit: Decimal
    spent: Decimal
    reserved: Decimal
    warn_percent: int
    alert_percent: int = 95
    budget_id: int | None = None
    agent_id: object = None  # the agent of an agent budget (None: the company's)

    @property
    def spent_percent(self) -> float:
        """Money (or runs) actually spent, as a share of the limit: what alerts compare."""
        return float(self.spent / self.limit * 100) if self.limit else 100.0

    @property
    def percent(self) -> float:
        return float((self.spent + self.reserved) / self.limit * 100) if self.limit else 100.0

    @property
    def warning(self) -> bool:
        return self.percent >= self.warn_percent

    @property
    def exceeded(self) -> bool:
        return self.spent >= self.limit

    @property
    def counts_runs(self) -> bool:
        return self.period == "day_runs"

    def amount(self, value: Decimal) -> int | str:
        """One of this limit's figures: whole runs for the run cap, else money by the rule."""
        return amount_text(value, count=self.counts_runs)

    def describe(self, *, this_call: bool = False) -> str:
        """The limit's use as `percent` counts it: what is spent, and what calls in flight
        hold (with `this_call`, the reservation being decided is among them)."""
        unit = "runs" if self.counts_runs else "USD"
        used = f"{self.amount(self.spent)} of {self.amount(self.limit)} {unit} used"
        if self.reserved:
            holders = "this call and calls in flight" if this_call else "calls in flight"
            used += f" and {self.amount(self.reserved)} held for {holders}"
        return f"{self.scope} {PERIOD_NAMES[self.period]} limit: {used} ({self.percent:.0f}%)"


def period_start(period: str, now: datetime) -> datetime | None:
    utc = now.astimezone(UTC)
    if period == "day":
        return utc.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "month":
        return utc.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return None


def budgets_for(*, company_id, agent_id) -> list[Budget]:
    return list(Budget.objects.filter(Q(agent__isnull=True) | Q(agent_id=agent_id), company_id=company_id))


def _totals(queryset, aggregate, conditions: dict) -> dict:
    """One query for several totals over `queryset`, each under its condition (None: all rows)."""
    totals = queryset.aggregate(
        **{f"total_{i}": aggregate(condition) for i, condition in enumerate(conditions.values())}
    )
    return {key: totals[f"total_{i}"] for i, key in enumerate(conditions)}


def _scoped(queryset, *, company_id, scopes: set):
    # Company-wide budgets need every agent's rows; agent budgets alone need only theirs
    # (and then the agent's own indexes serve the query).
    queryset = queryset.filter(company_id=company_id)
    return queryset if None in scopes else queryset.filter(agent_id__in=scopes)


def _other_than(runs, run_id):
    # A run reserving for itself does not count against itself.
    return runs.exclude(id=run_id) if run_id is not None else runs


def _where(*, agent_id=None, since=None) -> Q | None:
    """The rows of one scope (None: the whole company) and period (None: all time)."""
    condition = Q()
    if agent_id is not None:
        condition &= Q(agent_id=agent_id)
    if since is not None:
        condition &= Q(created_at__gte=since)
    return condition or None


# The runs whose calls may still be billed hold their reservation: a run submitted in a
# batch until its result is billed, and a Managed Agents turn whose worker died, which goes
# on at the provider until the next worker continues it (`sessions_app.managed_resume`).
HOLDING_STATUSES = (RunStatus.RUNNING, RunStatus.SUBMITTED, RunStatus.RESUMING)


def budget_uses(*, company_id, agent_id, now: datetime, exclude_run_id=None) -> list[BudgetUse]:
    """Every limit that applies to an agent (or, with agent_id None, its company), and its use.

    Four queries at most however many budgets and periods apply: the budgets, then money
    spent, money held by calls in flight and runs started today, each summed for every
    scope and period at once.
    """
    budgets = budgets_for(company_id=company_id, agent_id=agent_id)
    money_budgets = [b for b in budgets if money_limits_of(b)]
    run_budgets = [b for b in budgets if b.daily_run_limit is not None]
    spent, reserved, runs = {}, {}, {}
    if money_budgets:
        scopes = {b.agent_id for b in money_budgets}
        periods = {period for b in money_budgets for period in money_limits_of(b)}
        since = {period: period_start(period, now) for period in periods}
        spent = _totals(
            _scoped(CostEvent.objects.all(), company_id=company_id, scopes=scopes),
            lambda condition: Coalesce(Sum("cost_usd", filter=condition), ZERO),
            {(scope, period): _where(agent_id=scope, since=since[period]) for scope in scopes for period in periods},
        )
        running = _other_than(HeartbeatRun.objects.filter(status__in=HOLDING_STATUSES), exclude_run_id)
        reserved = _totals(
            _scoped(running, company_id=company_id, scopes=scopes),
            lambda condition: Coalesce(Sum("reserved_usd", filter=condition), ZERO),
            {scope: _where(agent_id=scope) for scope in scopes},
        )
    if run_budgets:
        scopes = {b.agent_id for b in run_budgets}
        started = _other_than(
            HeartbeatRun.objects.filter(
                started_at__gte=period_start("day", now), status__in=[RunStatus.RUNNING, RunStatus.SUCCEEDED]
            ),
            exclude_run_id,
        )
        runs = _totals(
            _scoped(started, company_id=company_id, scopes=scopes),
            lambda condition: Count("id", filter=condition),
            {scope: _where(agent_id=scope) for scope in scopes},
        )
    uses = []
    for budget in budgets:
        scope = "agent" if budget.agent_id else "company"
        for period, limit in money_limits_of(budget).items():
            uses.append(
                BudgetUse(
                    scope=scope,
                    period=period,
                    limit=limit,
                    spent=spent[(budget.agent_id, period)],
                    reserved=reserved[budget.agent_id],
                    warn_percent=budget.warn_percent,
                    alert_percent=budget.alert_percent,
                    budget_id=budget.id,
                    agent_id=budget.agent_id,
                )
            )
        if budget.daily_run_limit is not None:
            uses.append(
                BudgetUse(
                    scope=scope,
                    period="day_runs",
                    limit=Decimal(budget.daily_run_limit),
                    spent=Decimal(runs[budget.agent_id]),
                    reserved=ZERO,
                    warn_percent=budget.warn_percent,
                    alert_percent=budget.alert_percent,
                    budget_id=budget.id,
                    agent_id=budget.agent_id,
                )
            )
    return uses


def money_limits_of(budget: Budget) -> dict[str, Decimal]:
    limits = {"day": budget.daily_limit_usd, "month": budget.monthly_limit_usd, "lifetime": budget.lifetime_limit_usd}
    return {period: limit for period, limit in limits.items() if limit is not None}


def budgets_exist(*, company_id_ref: str, agent_id_ref: str) -> Exists:
    """Whether any budget applies to an agent, as an expression over another query's
    columns: a heartbeat learns whether it must reserve money in the query that loads it,
    not in one more round trip."""
    return Exists(
        Budget.objects.filter(
            Q(agent__isnull=True) | Q(agent_id=OuterRef(agent_id_ref)), company_id=OuterRef(company_id_ref)
        )
    )


# A budget that limits money in any way (a session limit included).
MONEY_LIMITS = (
    Q(daily_limit_usd__isnull=False)
    | Q(monthly_limit_usd__isnull=False)
    | Q(lifetime_limit_usd__isnull=False)
    | Q(session_limit_usd__isnull=False)
)


def money_budgets_exist(*, company_id_ref: str, agent_id_ref: str) -> Exists:
    """Whether a budget with a money limit applies to an agent, as an expression over
    another query's columns (as `budgets_exist`): such an agent's model must have a price.
    A session limit is one: a session's spend at $0 a call would never reach it."""
    return Exists(
        Budget.objects.filter(
            Q(agent__isnull=True) | Q(agent_id=OuterRef(agent_id_ref)),
            MONEY_LIMITS,
            company_id=OuterRef(company_id_ref),
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


def call_cost_bound(
    *,
    model: str,
    max_output_tokens: int,
    at: datetime,
    cache_lifetimes: frozenset[str] = frozenset(),
    samplings: int = 1,
    delivery: str = Delivery.DIRECT,
    inference_geo: str | None = None,
) -> Callable[[int], Decimal] | None:
    """The most a call can cost, as a function of its input tokens (None: no price), so
    that reservations bound the spend: the most expensive way it can be billed. The price
    is read once: a reservation prices the same call at up to three sizes (its byte bound,
    no input, a measured count).

    Every token at the tier a prompt of that many input tokens is billed at (the highest
    its prompt can reach: no more tokens than that); each input token at the dearest rate
    it can be billed at (plain input, or a cache write of a lifetime the request's markers
    ask for); batch as the request asks; the geo it names, or, naming none, the dearest
    (the workspace's default geo is billed as the answer reports it). `samplings` is how many times the model
    may read the input and write up to max_output_tokens in this one call: 2 under server
    compaction, whose summarising pass reads the whole input before the answer reads the
    compacted one.
    """
    table = price_table(model=model, at=at, delivery=delivery, inference_geo=inference_geo or dearest_geo())
    if table is None:
        return None

    def cost(input_tokens: int) -> Decimal:
        rates = table.rates(prompt_tokens=input_tokens)
        writes = {"5m": rates.cache_write_5m, "1h": rates.cache_write_1h}
        input_rate = max([rates.input, rates.cache_read, *(writes[ttl] for ttl in cache_lifetimes)])
        return samplings * (input_tokens * input_rate + max_output_tokens * rates.output) / MILLION

    return cost


def budgets_lock(*, company_id) -> None:
    """Inside the caller's transaction: the company row's lock, taken by every decision on
    the company's budgets that reads its use and then acts on it (a reservation, a pause for
    budget, a release), so that none acts on a use or a limit another has changed meanwhile.
    On SQLite the IMMEDIATE transaction already serialises them."""
    Company.objects.select_for_update().filter(id=company_id).first()


def budget_reserve(*, run, agent, estimate: Decimal | None, now: datetime, model: str = "") -> str:
    """Hold `estimate` for this run against every applicable limit, or refuse.

    `estimate` None means the call's model has no price: refused (ModelUnpriced) when any
    money limit applies. Returns a soft-warning text (empty when no limit is near).
    """
    with transaction.atomic():
        # One reservation at a time per company: the lock makes check-then-reserve atomic
        # across processes (on SQLite the IMMEDIATE transaction does the same).
        budgets_lock(company_id=agent.company_id)
        uses = budget_uses(company_id=agent.company_id, agent_id=agent.id, now=now, exclude_run_id=run.id)
        refusal = _refusal(uses, estimate, model)
        if refusal is None and estimate is None and _session_limited(company_id=agent.company_id, agent_id=agent.id):
            refusal = _unpriced(model)
        if refusal is None:
            HeartbeatRun.objects.filter(id=run.id).update(reserved_usd=estimate or ZERO)
    if refusal is not None:
        # Spending stopped at this limit: its hard-stop alert, after the lock is released.
        if refusal.use is not None:
            budget_alerts_fire(uses=[refusal.use], now=now, refused=True)
        raise refusal
    # A warning says what reached its threshold: the spend and the money held, this call's
    # reservation included (the spend alone may be far below it).
    holding = [replace(use, reserved=use.reserved + estimate) for use in uses if use.period != "day_runs"]
    warnings = [
        f"{use.describe(this_call=True)}, past its {use.warn_percent}% warning" for use in holding if use.warning
    ]
    return "Budget warning: " + "; ".join(warnings) if warnings else ""


def _refusal(uses: list[BudgetUse], estimate: Decimal | None, model: str) -> BudgetExceeded | None:
    money = [use for use in uses if use.period != "day_runs"]
    for use in uses:
        if use.period == "day_runs" and use.spent + 1 > use.limit:
            return BudgetExceeded(f"The {use.scope} daily run cap of {use.amount(use.limit)} runs is reached.", use=use)
    for use in money:
        if use.limit <= 0:
            # Zero means nothing may be spent, even by a call priced at nothing.
            return BudgetExceeded(
                f"The {use.scope} {PERIOD_NAMES[use.period]} budget is $0: nothing may be spent.", use=use
            )
    if money and estimate is None:
        return _unpriced(model)
    for use in money:
        if use.spent + use.reserved + estimate > use.limit:
            return BudgetExceeded(
                f"This call could cost up to ${usd(estimate)}, which would cross the {use.scope} "
                f"{PERIOD_NAMES[use.period]} budget of ${usd(use.limit)} (spent ${usd(use.spent)}, "
                f"${usd(use.reserved)} held by running calls).",
                use=use,
            )
    return None


def _unpriced(model: str) -> ModelUnpriced:
    return ModelUnpriced(
        f"The model {model!r} has no price, so the cost of this call cannot be held against the budget. "
        "Add a model price (admin: Costs > Model prices) or configure a priced model."
    )


def _session_limited(*, company_id, agent_id) -> bool:
    """Whether a session limit applies to the agent: asked only of a call without a price."""
    return Budget.objects.filter(
        Q(agent__isnull=True) | Q(agent_id=agent_id), company_id=company_id, session_limit_usd__isnull=False
    ).exists()


HARD_PERIODS = ("month", "lifetime")


def budgets_crossed(*, company_id, agent_id, now: datetime) -> set[str]:
    """The scopes (`agent`, `company`) whose monthly or lifetime limit is spent.

    A verdict only: what to do about it (pause the agent, or all of the company's agents)
    is the caller's. Daily limits and the run cap refuse calls but pause no one: they
    clear themselves at midnight.
    """
    return crossed_scopes(budget_uses(company_id=company_id, agent_id=agent_id, now=now))


def crossed_scopes(uses: list[BudgetUse]) -> set[str]:
    """`budgets_crossed` of uses already read."""
    return {use.scope for use in uses if use.exceeded and use.period in HARD_PERIODS}


def budgets_releasable(*, company_id, agent_ids, now: datetime) -> list:
    """Of `agent_ids` (paused by budget), those no monthly or lifetime limit holds back now."""
    return [
        agent_id for agent_id in agent_ids if not budgets_crossed(company_id=company_id, agent_id=agent_id, now=now)
    ]


def next_month(now: datetime) -> datetime:
    start = period_start("month", now)
    return (start + timedelta(days=32)).replace(day=1)


def session_limit_reached(*, company_id, agent_id, session_id) -> bool:
    """Whether a session has spent its `session_limit_usd` (of the agent's or the company's
    budget; the lower applies). One query: the lowest limit, with the session's spend on
    the ledger as a subquery (cost_events_session_idx)."""
    spend = (
        CostEvent.objects.filter(session_id=session_id)
        .order_by()
        .values("session_id")
        .annotate(total=Sum("cost_usd"))
        .values("total")
    )
    row = (
        Budget.objects.filter(
            Q(agent__isnull=True) | Q(agent_id=agent_id), company_id=company_id, session_limit_usd__isnull=False
        )
        .annotate(spent=Coalesce(Subquery(spend, output_field=DecimalField(**MONEY)), ZERO))
        .order_by("session_limit_usd")
        .values_list("session_limit_usd", "spent")
        .first()
    )
    return row is not None and row[1] >= row[0]
