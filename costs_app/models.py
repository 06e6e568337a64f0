"""Model prices and the cost ledger.

Money is Decimal throughout. Ledger columns carry ten decimal places: a cache read of one
token on a $1/MTok model costs $0.0000001, and sums must match the API's usage exactly.
"""

from __future__ import annotations

from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, URLValidator
from django.db import models
from django.db.models.functions import Now
from django.utils import timezone

from sessions_app.text import MESSAGE_ID_MAX_LENGTH

MONEY = {"max_digits": 20, "decimal_places": 10}
PRICE = {"max_digits": 12, "decimal_places": 6}
# The prices of a ModelPrice, USD per million tokens.
PRICE_FIELDS = (
    "input_usd_per_mtok",
    "output_usd_per_mtok",
    "cache_write_5m_usd_per_mtok",
    "cache_write_1h_usd_per_mtok",
    "cache_read_usd_per_mtok",
)


class ModelPrice(models.Model):
    """List price of one model, in USD per million tokens, from `effective_from` on."""

    model = models.CharField(max_length=200)
    effective_from = models.DateField(help_text="Calls made on or after this UTC day use this price.")
    input_usd_per_mtok = models.DecimalField(**PRICE)
    output_usd_per_mtok = models.DecimalField(**PRICE)
    cache_write_5m_usd_per_mtok = models.DecimalField(**PRICE, help_text="Usually 1.25x input.")
    cache_write_1h_usd_per_mtok = models.DecimalField(**PRICE, help_text="Usually 2x input.")
    cache_read_usd_per_mtok = models.DecimalField(**PRICE, help_text="Usually 0.1x input.")
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        db_table = "model_prices"
        ordering = ["model", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["model", "effective_from"], name="model_prices_one_per_day"),
        ]

    def __str__(self) -> str:
        return f"{self.model} from {self.effective_from}"

    def clean(self) -> None:
        # Here rather than as validators of the fields: those would need a migration that
        # changes nothing in the database.
        errors = {
            name: "A price cannot be negative."
            for name in PRICE_FIELDS
            if getattr(self, name) is not None and getattr(self, name) < 0
        }
        if errors:
            raise ValidationError(errors)

    @classmethod
    def from_list_price(cls, model: str, effective_from, input_price: Decimal, output_price: Decimal) -> ModelPrice:
        return cls(
            model=model,
            effective_from=effective_from,
            input_usd_per_mtok=input_price,
            output_usd_per_mtok=output_price,
            cache_write_5m_usd_per_mtok=input_price * Decimal("1.25"),
            cache_write_1h_usd_per_mtok=input_price * 2,
            cache_read_usd_per_mtok=input_price * Decimal("0.1"),
        )


class PriceOverridesRevision(models.Model):
    """One row, counting changes to `ModelPrice`: every process keeps the overrides in memory
    and re-reads them only when this number moved (`costs_app.pricing.override_for`)."""

    revision = models.PositiveBigIntegerField(default=0)

    class Meta:
        db_table = "price_overrides_revision"

    def __str__(self) -> str:
        return f"price overrides revision {self.revision}"


class Lifecycle(models.TextChoices):
    """A model's stage, as the Models API says (`ModelInfo.lifecycle`)."""

    ACTIVE = "active"
    DEPRECATED = "deprecated"  # still callable, headed for retirement
    RETIRED = "retired"  # calls naming it fail


class CatalogueModel(models.Model):
    """One model of the Models API's list (`client.models.list()`), as last refreshed.

    The table is the catalogue as a whole: a refresh replaces it (costs_app.catalogue).
    """

    model = models.CharField(max_length=200, unique=True)
    display_name = models.CharField(max_length=200, blank=True, default="")
    # The API's model line (opus, sonnet, haiku, ...); empty when it names none.
    line = models.CharField(max_length=32, blank=True, default="")
    max_input_tokens = models.PositiveIntegerField(null=True, blank=True, help_text="The context window.")
    max_tokens = models.PositiveIntegerField(null=True, blank=True, help_text="The most max_tokens may ask for.")
    lifecycle = models.CharField(max_length=16, choices=Lifecycle.choices, default=Lifecycle.ACTIVE)
    released_at = models.DateTimeField(null=True, blank=True)
    deprecated_at = models.DateTimeField(null=True, blank=True)
    retires_at = models.DateTimeField(null=True, blank=True)
    refreshed_at = models.DateTimeField()

    class Meta:
        db_table = "model_catalogue"
        ordering = ["model"]

    def __str__(self) -> str:
        return self.model


class CatalogueRefresh(models.Model):
    """When the catalogue was last asked for and what came of it: one row. The conditional
    update on `attempted_at` lets one process of many ask per interval."""

    attempted_at = models.DateTimeField(null=True, blank=True)
    refreshed_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True, default="")

    class Meta:
        db_table = "model_catalogue_refreshes"

    def __str__(self) -> str:
        return f"catalogue refreshed {self.refreshed_at or 'never'}"


class CostKind(models.TextChoices):
    MESSAGE = "message"
    COMPACTION = "compaction"
    COUNT_TOKENS = "count_tokens"
    SESSION_HOURS = "session_hours"
    # A request that only reads a persistent agent's cached prefix before it expires, so
    # that the next wake reads it instead of writing it again (`sessions_app.keep_warm`).
    CACHE_REFRESH = "cache_refresh"


class Delivery(models.TextChoices):
    DIRECT = "direct"  # the Messages API, answered at once
    BATCH = "batch"  # the Message Batches API: the Batch discount applies


class CostEvent(models.Model):
    """One row per priced event (usually one model call). Append-only.

    References to agents, sessions and runs carry no database constraint: the ledger is
    money already spent and outlives whatever it names.
    """

    kind = models.CharField(max_length=16, choices=CostKind.choices, default=CostKind.MESSAGE)
    # Each heartbeat inserts here, so no column is indexed twice: company_id and agent_id
    # lead the day indexes below, and session_id has its own named index there.
    company = models.ForeignKey(
        "sessions_app.Company", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+", db_index=False
    )
    agent = models.ForeignKey(
        "sessions_app.Agent", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+", db_index=False
    )
    session = models.ForeignKey(
        "sessions_app.AgentSession",
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        null=True,
        blank=True,
        related_name="+",
        db_index=False,
    )
    run = models.ForeignKey(
        "sessions_app.HeartbeatRun",
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        null=True,
        blank=True,
        related_name="+",
    )
    model = models.TextField(blank=True, default="")
    input_tokens = models.IntegerField(default=0)
    output_tokens = models.IntegerField(default=0)
    # Total cache writes, and their split by lifetime (priced differently).
    cache_creation_input_tokens = models.IntegerField(default=0)
    cache_creation_5m_input_tokens = models.IntegerField(default=0)
    cache_creation_1h_input_tokens = models.IntegerField(default=0)
    cache_read_input_tokens = models.IntegerField(default=0)
    session_seconds = models.IntegerField(default=0)
    cost_usd = models.DecimalField(**MONEY, default=Decimal(0))
    unpriced = models.BooleanField(default=False, help_text="No price was known for this model when it was recorded.")
    # The operator's override that priced the call (price_source "override"), if any.
    price = models.ForeignKey(ModelPrice, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # Where the price came from: "library <genai-prices version>", "override", or "" (unpriced).
    price_source = models.CharField(max_length=64, blank=True, default="")
    delivery = models.CharField(
        max_length=16, choices=Delivery.choices, default=Delivery.DIRECT, help_text="batch: billed at the Batch rates."
    )
    # Which call of its run this row bills (1, 2, ...): with the run, the identity of the
    # call, so a retried write of it is refused, never billed twice.
    call_number = models.PositiveSmallIntegerField(null=True, blank=True)
    # The id the API (or an agent command) reported, for display: not unique, not ours.
    message_id = models.CharField(max_length=MESSAGE_ID_MAX_LENGTH, null=True, blank=True)
    raw_usage = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_default=Now())

    class Meta:
        db_table = "cost_events"
        ordering = ["-created_at"]
        indexes = [
            # Daily spend of one agent (monitoring SQL, cost_report --agent).
            models.Index(fields=["agent", "created_at"], name="cost_events_agent_day_idx"),
            # Daily spend of a company (costs API, admin costs page, budgets).
            models.Index(fields=["company", "created_at"], name="cost_events_company_day_idx"),
            # Costs of one session (session page, session totals).
            models.Index(fields=["session"], name="cost_events_session_idx"),
        ]
        constraints = [
            # One row per call of a run, within its company (cost_event_record's dedupe).
            models.UniqueConstraint(
                fields=["company", "run", "call_number"],
                condition=models.Q(run__isnull=False, call_number__isnull=False),
                name="cost_events_one_per_call",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.model} ${self.cost_usd}"


class CostDay(models.Model):
    """The ledger summed per UTC day, company, agent, model and kind: what the cost reports
    read instead of scanning cost_events.

    Written only by the database: triggers on cost_events (migration 0014) add every
    inserted row, move an updated one and take back a deleted one in the statement that
    changed the ledger, so a row here always equals the GROUP BY over the ledger, in every
    transaction that can see the ledger. No code path writes it.
    """

    day = models.DateField(help_text="The UTC day of the ledger rows' created_at.")
    company = models.ForeignKey(
        "sessions_app.Company", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+", db_index=False
    )
    agent = models.ForeignKey(
        "sessions_app.Agent", on_delete=models.DO_NOTHING, db_constraint=False, related_name="+", db_index=False
    )
    model = models.TextField(blank=True, default="")
    kind = models.CharField(max_length=16, choices=CostKind.choices)
    # Sums of the ledger's columns of the same names: wider, since a day adds many rows.
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cache_creation_input_tokens = models.BigIntegerField(default=0)
    cache_creation_5m_input_tokens = models.BigIntegerField(default=0)
    cache_creation_1h_input_tokens = models.BigIntegerField(default=0)
    cache_read_input_tokens = models.BigIntegerField(default=0)
    session_seconds = models.BigIntegerField(default=0)
    cost_usd = models.DecimalField(max_digits=28, decimal_places=MONEY["decimal_places"], default=Decimal(0))
    events = models.BigIntegerField(default=0, help_text="Ledger rows summed here (never 0: such a row is deleted).")

    class Meta:
        db_table = "cost_days"
        indexes = [
            # A company's days (the costs API and page without an agent filter).
            models.Index(fields=["company", "day"], name="cost_days_company_day_idx"),
        ]
        constraints = [
            # The triggers' upsert key; led by the agent, it serves one agent's days too.
            models.UniqueConstraint(fields=["agent", "day", "model", "kind", "company"], name="cost_days_one_per_key"),
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.kind} {self.model} ${self.cost_usd}"


# The money limits of a budget (its session limit has a validator of its own: above 0).
MONEY_LIMITS = ("monthly_limit_usd", "lifetime_limit_usd", "daily_limit_usd")


class Budget(models.Model):
    """Spending limits of a company (agent empty) or of one agent. Months are UTC."""

    # The unique budgets_one_per_agent (company_id, agent_id) serves company lookups and cascades.
    company = models.ForeignKey(
        "sessions_app.Company", on_delete=models.CASCADE, related_name="budgets", db_index=False
    )
    agent = models.ForeignKey(
        "sessions_app.Agent", null=True, blank=True, on_delete=models.CASCADE, related_name="budgets"
    )
    monthly_limit_usd = models.DecimalField(**PRICE, null=True, blank=True)
    lifetime_limit_usd = models.DecimalField(**PRICE, null=True, blank=True)
    daily_limit_usd = models.DecimalField(**PRICE, null=True, blank=True)
    daily_run_limit = models.PositiveIntegerField(null=True, blank=True)
    warn_percent = models.PositiveSmallIntegerField(default=80, help_text="Soft warning at this share of a limit.")
    alert_percent = models.PositiveSmallIntegerField(
        default=95,
        validators=[MinValueValidator(1), MaxValueValidator(100)],
        help_text="Second alert at this share of a limit (the first is warn_percent).",
    )
    session_limit_usd = models.DecimalField(
        **PRICE,
        null=True,
        blank=True,
        # Zero would end every session on its first heartbeat, the successor included.
        validators=[MinValueValidator(Decimal("0.000001"))],
        help_text="A session that has spent this much is ended with a handoff to a new one.",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "budgets"
        constraints = [
            models.UniqueConstraint(fields=["company", "agent"], name="budgets_one_per_agent"),
            models.UniqueConstraint(
                fields=["company"], condition=models.Q(agent__isnull=True), name="budgets_one_per_company"
            ),
        ]

    def __str__(self) -> str:
        return f"budget of {self.agent or self.company}"

    def clean(self) -> None:
        # The API's rules (costs_app.budget_views.BudgetSerializer), for the admin's form: the
        # API takes the company from the URL and the agent from that company. Here rather than
        # as validators of the fields: those would need a migration that changes nothing in
        # the database.
        errors = {
            name: "A limit cannot be negative (0 stops all spend; leave it empty for no limit)."
            for name in MONEY_LIMITS
            if getattr(self, name) is not None and getattr(self, name) < 0
        }
        if self.warn_percent is not None and not 1 <= self.warn_percent <= 100:
            errors["warn_percent"] = "Must be from 1 to 100."
        if (
            self.agent_id is None
            and self.company_id is not None
            and Budget.objects.filter(company_id=self.company_id, agent__isnull=True).exclude(pk=self.pk).exists()
        ):
            # Said here: the partial unique constraint's own message names only the constraint.
            errors["company"] = "This company has a budget already: change that one (a company has one budget)."
        if self.agent_id is not None and self.company_id is not None and self.agent.company_id != self.company_id:
            # Budget checks look an agent's budget up under the agent's own company.
            errors["agent"] = (
                f"{self.agent.name} is an agent of {self.agent.company.name}, not of this budget's company: "
                "its budget would never apply."
            )
        if errors:
            raise ValidationError(errors)


class AlertThreshold(models.TextChoices):
    SOFT = "soft"  # the budget's warn_percent
    SECOND = "second"  # the budget's alert_percent (95% unless set)
    HARD = "hard"  # the limit is spent, or a call was refused by it


class AlertTarget(models.Model):
    """A webhook told when one of its budget's limits crosses a threshold.

    The secret signs each delivery (HMAC-SHA256); it is stored because signing needs it,
    and never shown again: the API and the admin accept it and echo nothing of it.
    """

    budget = models.ForeignKey(Budget, on_delete=models.CASCADE, related_name="alert_targets")
    url = models.URLField(max_length=2000, validators=[URLValidator(schemes=["http", "https"])])
    secret = models.CharField(max_length=200)
    active = models.BooleanField(default=True)
    # Operations events besides the budget's own alerts (`AlertEvent`): a provider quota
    # holding the deployment's credential and its release (`quota_held`, `quota_released`),
    # and an agent of the budget's scope going down or failing and coming back
    # (`agent_down`, `agent_up`).
    quota_events = models.BooleanField(default=False, help_text="Also send quota_held and quota_released.")
    health_events = models.BooleanField(default=False, help_text="Also send agent_down and agent_up.")
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        db_table = "budget_alert_targets"
        ordering = ["created_at"]

    def __str__(self) -> str:
        return self.url


class BudgetAlert(models.Model):
    """One threshold of one limit crossed in one period: the row that makes an alert fire
    once. Two workers crossing it at once both try the insert; the unique constraint lets
    one in, and only that one hands deliveries to the queue."""

    # The unique budget_alerts_once_per_period_and_limit leads with budget_id: it serves the cascade.
    budget = models.ForeignKey(Budget, on_delete=models.CASCADE, related_name="alerts", db_index=False)
    period = models.CharField(max_length=16, help_text="day, month, lifetime or day_runs.")
    # The UTC day (YYYY-MM-DD), month (YYYY-MM) or "lifetime": which period it fired in.
    period_key = models.CharField(max_length=16)
    threshold = models.CharField(max_length=8, choices=AlertThreshold.choices)
    percent = models.PositiveSmallIntegerField(help_text="The threshold, as a share of the limit.")
    limit = models.DecimalField(**MONEY)
    spent = models.DecimalField(**MONEY)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "budget_alerts"
        ordering = ["-created_at"]
        constraints = [
            # Once per period for each limit and percent: a raised limit re-arms its alerts.
            models.UniqueConstraint(
                fields=["budget", "period", "period_key", "threshold", "limit", "percent"],
                name="budget_alerts_once_per_period_and_limit",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.threshold} alert of {self.period} limit ({self.period_key})"


class AlertEventKind(models.TextChoices):
    QUOTA_HELD = "quota_held"
    QUOTA_RELEASED = "quota_released"
    AGENT_DOWN = "agent_down"
    AGENT_UP = "agent_up"


class AlertEvent(models.Model):
    """An operations event sent to the alert targets that asked for its kind: a quota
    hold or its release (deployment-wide), an agent's health going down or coming back.
    `key` names the transition; its unique constraint lets the first of two workers (two
    maintenance passes, two refused calls) record it, and only that one sends it."""

    kind = models.CharField(max_length=32, choices=AlertEventKind.choices)
    key = models.CharField(max_length=200, unique=True)
    # The scope whose targets receive it: none for a quota (every target that asked).
    company = models.ForeignKey(
        "sessions_app.Company", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    agent = models.ForeignKey("sessions_app.Agent", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "alert_events"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.kind} ({self.created_at:%Y-%m-%d %H:%M})"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


class AlertDelivery(models.Model):
    """One alert sent to one target, retried with back-off until delivered or failed."""

    # A budget's alert, or an operations event: exactly one of the two.
    alert = models.ForeignKey(BudgetAlert, null=True, blank=True, on_delete=models.CASCADE, related_name="deliveries")
    event = models.ForeignKey(AlertEvent, null=True, blank=True, on_delete=models.CASCADE, related_name="deliveries")
    target = models.ForeignKey(AlertTarget, on_delete=models.CASCADE, related_name="deliveries")
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    # When the next attempt is due; a claimed attempt moves it past its own timeout, so a
    # worker killed mid-request is retried by the maintenance sweep, never twice at once.
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "budget_alert_deliveries"
        verbose_name_plural = "alert deliveries"
        ordering = ["-created_at"]
        indexes = [
            # The maintenance sweep: pending deliveries whose next attempt is due.
            models.Index(
                fields=["next_attempt_at"],
                condition=models.Q(status="pending"),
                name="alert_deliveries_due_idx",
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(alert__isnull=False, event__isnull=True)
                | models.Q(alert__isnull=True, event__isnull=False),
                name="alert_deliveries_alert_or_event",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.alert or self.event} to {self.target}"


class AlertAttempt(models.Model):
    """One HTTP attempt of a delivery: what the target answered, or why it could not."""

    # The unique alert_attempts_one_per_number leads with delivery_id: it serves the cascade.
    delivery = models.ForeignKey(AlertDelivery, on_delete=models.CASCADE, related_name="attempt_rows", db_index=False)
    number = models.PositiveSmallIntegerField()
    at = models.DateTimeField()
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    duration_ms = models.PositiveIntegerField(default=0)

    class Meta:
        db_table = "budget_alert_attempts"
        ordering = ["delivery", "number"]
        constraints = [
            models.UniqueConstraint(fields=["delivery", "number"], name="alert_attempts_one_per_number"),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number}: {self.status_code or self.error[:40]}"
