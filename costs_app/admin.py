"""Admin for model prices, the cost ledger (read-only), and the costs page."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, time, timedelta
from decimal import Decimal

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import (
    Case,
    Count,
    DateTimeField,
    DecimalField,
    Exists,
    Max,
    Min,
    OuterRef,
    Q,
    Subquery,
    Sum,
    When,
)
from django.template.defaultfilters import pluralize
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from costs_app.alerts import target_url_problem
from costs_app.budgets import BudgetUse, budget_uses, period_start
from costs_app.charts import Series, limit_series, stacked_bar_chart
from costs_app.forecast import RATE_DAYS, Forecast, budget_forecasts, crossing_date, daily_rate
from costs_app.models import (
    AlertAttempt,
    AlertDelivery,
    AlertTarget,
    Budget,
    BudgetAlert,
    CatalogueModel,
    CostEvent,
    ModelPrice,
)
from costs_app.money import amount_text, usd
from costs_app.pricing import LIBRARY_SOURCE, is_priced, library_table
from costs_app.reports import daily_costs_by_agent, input_growth, window_start
from costs_app.signals import budget_changed
from sessions_app.admin import LargeTableAdmin, ModelNameFilter, admin_link, is_changelist, money_column
from sessions_app.admin.common import (
    COMPANY_CHOICES_CAP,
    AgentFilter,
    CheckedAutocompleteFields,
    CompanyFilter,
    CountedDeletion,
    admin_time,
    newest_by_name,
    short_text,
    tokens_in_out,
)
from sessions_app.context_defaults import growth_advice, growth_flag
from sessions_app.models import Agent, Company, parse_uuid, session_public_id
from sessions_app.text import is_storable

REPORT_DAYS = 30
# Growth is one query per agent: computed for the biggest spenders of the window only.
GROWTH_MAX_AGENTS = 20


def unpriced_models_in_use(*, now) -> list[dict]:
    """Models whose calls were recorded unpriced and that still have no price (neither the
    library nor an override prices them)."""
    rows = list(
        CostEvent.objects.filter(unpriced=True)
        .values("model")
        .annotate(events=Count("id"), last_seen=Max("created_at"))
        .order_by("model")
    )
    return [row for row in rows if not is_priced(model=row["model"], at=now)]


def library_price_text(model: str, *, at) -> str:
    table = library_table(model=model, at=at)
    if table is None:
        return "none: the price library does not know this model"
    return f"{table.describe()} ({LIBRARY_SOURCE})"


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    """The operator's overrides: each wins over the price library from its effective day on.
    Beside each, what the library would charge on that day."""

    list_display = [
        "model",
        "effective_from",
        "input_usd_per_mtok",
        "output_usd_per_mtok",
        "cache_write_5m_usd_per_mtok",
        "cache_write_1h_usd_per_mtok",
        "cache_read_usd_per_mtok",
        "library_price",
    ]
    list_filter = ["model"]
    search_fields = ["model"]
    date_hierarchy = "effective_from"
    readonly_fields = ["library_price"]

    @admin.display(description="the library's price that day")
    def library_price(self, obj: ModelPrice) -> str:
        if not obj.model or obj.effective_from is None:
            return "-"
        return library_price_text(obj.model, at=datetime.combine(obj.effective_from, time(12), UTC))

    def changelist_view(self, request, extra_context=None):
        if request.method == "GET":
            missing = unpriced_models_in_use(now=timezone.now())
            if missing:
                add_url = reverse("admin:costs_app_modelprice_add")
                self.message_user(
                    request,
                    format_html(
                        "Unpriced models in use (their calls are recorded with cost 0): {}",
                        format_html_join(
                            ", ",
                            '<a href="{}?{}">{}</a> ({} call{}, last {})',
                            (
                                (
                                    add_url,
                                    urlencode({"model": row["model"]}),
                                    row["model"] or "(no model name)",
                                    row["events"],
                                    pluralize(row["events"]),
                                    admin_time(row["last_seen"]),
                                )
                                for row in missing
                            ),
                        ),
                    ),
                    messages.WARNING,
                )
        return super().changelist_view(request, extra_context)


@admin.register(CatalogueModel)
class CatalogueModelAdmin(admin.ModelAdmin):
    """The model catalogue, as the Models API last listed it (read-only: the maintenance
    pass refreshes it; `manage.py prices --refresh` does now)."""

    list_display = [
        "model",
        "display_name",
        "line",
        "lifecycle",
        "retires_at",
        "max_input_tokens",
        "max_tokens",
        "library_price",
        "refreshed_at",
    ]
    list_filter = ["lifecycle", "line"]
    search_fields = ["model", "display_name"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def get_queryset(self, request):
        # Whether an override prices the model, in the list's one query.
        overrides = ModelPrice.objects.filter(model=OuterRef("model"))
        return super().get_queryset(request).annotate(overridden=Exists(overrides))

    @admin.display(description="the library's price today")
    def library_price(self, obj: CatalogueModel) -> str:
        text = library_price_text(obj.model, at=timezone.now())
        return f"{text}; overridden (Costs > Model prices)" if getattr(obj, "overridden", False) else text


def scope_spend(field: str, *, since=None) -> Subquery:
    events = CostEvent.objects.filter(**{field: OuterRef(field)})
    if since is not None:
        events = events.filter(created_at__gte=since)
    total = events.order_by().values(field).annotate(total=Sum("cost_usd")).values("total")
    return Subquery(total, output_field=DecimalField(max_digits=30, decimal_places=10))


def scope_first(field: str, *, since) -> Subquery:
    events = CostEvent.objects.filter(**{field: OuterRef(field)}, created_at__gte=since)
    first = events.order_by().values(field).annotate(first=Min("created_at")).values("first")
    return Subquery(first, output_field=DateTimeField())


def use_bar(spent, limit, warn_percent: int) -> str:
    """A small bar: green under the warning level, amber past it, red at the limit."""
    spent = spent or Decimal(0)
    if limit is None:
        return format_html("{} spent, no limit", f"${usd(spent)}")
    percent = float(spent / limit * 100) if limit else 100.0
    colour = "#ba2121" if percent >= 100 else "#c58f00" if percent >= warn_percent else "#2e7d32"
    return format_html(
        '<div title="{}" style="width:140px;background:#e6e6e6;border-radius:3px">'
        '<div style="width:{}%;background:{};height:10px;border-radius:3px"></div></div>'
        "<small>{} of {} ({}%)</small>",
        f"{percent:.1f}%",
        f"{min(percent, 100):.1f}",
        colour,
        f"${usd(spent)}",
        f"${usd(limit)}",
        f"{percent:.0f}",
    )


class AlertTargetForm(forms.ModelForm):
    """The secret is write-only: never rendered back; left empty on a change, it stays."""

    url = forms.URLField(max_length=2000, assume_scheme="https", help_text="http(s) URL that receives the alerts.")
    secret = forms.CharField(
        widget=forms.PasswordInput(render_value=False),
        required=False,
        # As sent: the receiver verifies with the secret it was given, and one trimmed here
        # would sign every delivery with another key (the API keeps it as sent too).
        strip=False,
        min_length=16,
        max_length=200,
        help_text="HMAC-SHA256 key of the X-Paperclip-Signature header (16-200 characters). Never shown again; "
        "leave empty to keep the current one.",
    )

    class Meta:
        model = AlertTarget
        fields = ["url", "secret", "active", "quota_events", "health_events"]

    def clean_url(self) -> str:
        url = self.cleaned_data["url"]
        if problem := target_url_problem(url):
            raise forms.ValidationError(problem)
        return url

    def clean_secret(self) -> str:
        secret = self.cleaned_data["secret"]
        if not secret and self.instance.pk is None:
            raise forms.ValidationError("A new target needs a secret.")
        if secret and not is_storable(secret):
            raise forms.ValidationError("The secret must be valid text without NUL characters.")
        return secret or self.instance.secret


class AlertTargetInline(admin.TabularInline):
    model = AlertTarget
    form = AlertTargetForm
    extra = 0
    fields = ["url", "secret", "active", "quota_events", "health_events", "created_at"]
    readonly_fields = ["created_at"]


def forecast_text(forecast: Forecast | None) -> str:
    if forecast is None or forecast.date is None:
        return "not foreseen"
    return f"crossed on {forecast.date:%Y-%m-%d} at ${usd(forecast.daily_rate_usd)}/day"


def budgets_changed(company_ids) -> None:
    """After the admin's COMMIT: the budgets of these companies changed (`budget_changed`)."""
    for company_id in company_ids - {None}:
        transaction.on_commit(
            lambda company_id=company_id: budget_changed.send(sender=Budget, company_id=company_id, now=timezone.now())
        )


@admin.register(Budget)
class BudgetAdmin(CheckedAutocompleteFields, CountedDeletion, admin.ModelAdmin):
    """Limits checked before every model call (costs_app.budgets), the webhooks told when
    they near, and when each will be crossed at the current rate (costs_app.forecast)."""

    inlines = [AlertTargetInline]

    # Inside a 1366-pixel screen beside the filters (tests/admin/test_browser.py): the two
    # money bars and the forecast, the other limits in one column; all of them on the page.
    list_display = [
        "owner",
        "month_use",
        "lifetime_use",
        "forecast",
        "other_limits",
    ]
    list_filter = [("company", CompanyFilter)]
    list_select_related = ["company", "agent"]
    search_fields = ["company__name", "agent__name"]
    autocomplete_fields = ["company", "agent"]  # search boxes, not lists of every company and agent
    readonly_fields = ["current_use", "updated_at"]
    daily_limit = money_column("daily_limit_usd", "daily limit (USD)")
    session_limit = money_column("session_limit_usd", "session limit (USD)")

    # A limit raised, removed or moved here resumes the agents it paused for budget at once,
    # as the API's PUT and DELETE do (`budget_changed`), not at the next maintenance pass.

    def save_model(self, request, obj, form, change):
        moved_from = form.initial.get("company") if change else None
        super().save_model(request, obj, form, change)
        budgets_changed({obj.company_id, moved_from})

    def delete_model(self, request, obj):
        super().delete_model(request, obj)
        budgets_changed({obj.company_id})

    def delete_queryset(self, request, queryset):
        companies = set(queryset.values_list("company_id", flat=True))
        super().delete_queryset(request, queryset)
        budgets_changed(companies)

    def get_queryset(self, request):
        # Spend of each budget's scope, as two correlated subqueries per period (and the
        # last 7 days' spend and first event for the forecast): the changelist costs the
        # same few queries however many budgets it shows.
        now = timezone.now()
        month = period_start("month", now)
        week = now - timedelta(days=RATE_DAYS)
        return (
            super()
            .get_queryset(request)
            # Each budget's name is its agent's or company's (the delete pages list them).
            .select_related("company", "agent")
            .annotate(
                month_spent=Case(
                    When(agent__isnull=True, then=scope_spend("company_id", since=month)),
                    default=scope_spend("agent_id", since=month),
                ),
                lifetime_spent=Case(
                    When(agent__isnull=True, then=scope_spend("company_id")),
                    default=scope_spend("agent_id"),
                ),
                week_spent=Case(
                    When(agent__isnull=True, then=scope_spend("company_id", since=week)),
                    default=scope_spend("agent_id", since=week),
                ),
                week_first=Case(
                    When(agent__isnull=True, then=scope_first("company_id", since=week)),
                    default=scope_first("agent_id", since=week),
                ),
            )
        )

    @admin.display(description="forecast")
    def forecast(self, obj: Budget) -> str:
        """When the monthly (else lifetime) limit is crossed at the last 7 days' rate."""
        now = timezone.now()
        rate = daily_rate(spent=obj.week_spent, first=obj.week_first, now=now)
        for period, limit, spent in (
            ("month", obj.monthly_limit_usd, obj.month_spent),
            ("lifetime", obj.lifetime_limit_usd, obj.lifetime_spent),
        ):
            if limit is not None:
                use = BudgetUse(
                    scope="", period=period, limit=limit, spent=spent or Decimal(0), reserved=Decimal(0), warn_percent=0
                )
                day = crossing_date(use, rate=rate, now=now)
                return f"{period} limit on {day:%Y-%m-%d}" if day else "not foreseen"
        return "-"

    @admin.display(description="budget of", ordering="agent__name")
    def owner(self, obj: Budget) -> str:
        return short_text(f"agent {obj.agent.name}" if obj.agent_id else f"company {obj.company.name}", 30)

    @admin.display(description="other limits")
    def other_limits(self, obj: Budget) -> str:
        limits = [
            f"${usd(obj.daily_limit_usd)} a day" if obj.daily_limit_usd is not None else "",
            f"{obj.daily_run_limit} runs a day" if obj.daily_run_limit is not None else "",
            f"${usd(obj.session_limit_usd)} a session" if obj.session_limit_usd is not None else "",
        ]
        warn = f"alerts at {obj.warn_percent}% and {obj.alert_percent}%"
        return "; ".join([limit for limit in limits if limit] + [warn])

    @admin.display(description="this month")
    def month_use(self, obj: Budget) -> str:
        return use_bar(obj.month_spent, obj.monthly_limit_usd, obj.warn_percent)

    @admin.display(description="lifetime")
    def lifetime_use(self, obj: Budget) -> str:
        return use_bar(obj.lifetime_spent, obj.lifetime_limit_usd, obj.warn_percent)

    @admin.display(description="current use")
    def current_use(self, obj: Budget) -> str:
        if obj.pk is None:
            return "-"
        scope = "agent" if obj.agent_id else "company"
        now = timezone.now()
        uses = [
            use for use in budget_uses(company_id=obj.company_id, agent_id=obj.agent_id, now=now) if use.scope == scope
        ]
        if not uses:
            return "no limits set"
        forecasts = budget_forecasts(company_id=obj.company_id, uses=uses, now=now)
        return format_html_join(
            "",
            '<div class="{}">{}{}</div>',
            (
                (
                    "errornote" if use.exceeded else "",
                    use.describe(),
                    f"; forecast: {forecast_text(forecasts[(use.scope, use.period)])}"
                    if (use.scope, use.period) in forecasts
                    else "",
                )
                for use in uses
            ),
        )

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "agent":
            kwargs["queryset"] = Agent.objects.select_related("company").only("id", "name", "company__name")
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def deleted_with(self, ids):
        # A daily budget gathers alerts every day, each with its deliveries and attempts:
        # counted, never each loaded and listed (Django's default, one query per alert).
        deliveries = AlertDelivery.objects.filter(Q(target__budget_id__in=ids) | Q(alert__budget_id__in=ids))
        return [
            AlertTarget.objects.filter(budget_id__in=ids),
            BudgetAlert.objects.filter(budget_id__in=ids),
            deliveries,
            AlertAttempt.objects.filter(delivery__in=deliveries),
        ]


class AlertAttemptInline(admin.TabularInline):
    model = AlertAttempt
    extra = 0
    fields = ["number", "at", "status_code", "error", "duration_ms"]
    readonly_fields = fields
    can_delete = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False


class ReadOnlyRecords:
    """Records the service writes and operators only read: the ledger, alert deliveries."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(AlertDelivery)
class AlertDeliveryAdmin(ReadOnlyRecords, LargeTableAdmin):
    """Every budget alert sent to every target, with each HTTP attempt. Read-only: the
    record of what was told to whom. It grows with every alert and event, so its list
    never counts the whole table."""

    # The columns an operator decides on, inside a 1366-pixel screen beside the filters
    # (tests/admin/test_browser.py): long text is cut, whole on the delivery's page.
    list_display = [
        "created_at",
        "budget_link",
        "threshold",
        "target_short",
        "status",
        "attempts",
        "last_error_short",
    ]
    list_filter = ["status", "alert__threshold", "alert__period"]
    list_select_related = ["alert", "event", "target__budget__company", "target__budget__agent"]
    search_fields = ["target__url"]
    date_hierarchy = "created_at"
    inlines = [AlertAttemptInline]
    actions = None
    fields = [
        "alert_label",
        "target_url",
        "status",
        "attempts",
        "next_attempt_at",
        "last_status_code",
        "last_error",
        "created_at",
        "finished_at",
    ]
    readonly_fields = fields

    def get_queryset(self, request):
        queryset = super().get_queryset(request)
        if not is_changelist(request):
            return queryset
        # The list shows an event's kind and an agent's name: not the event's payload, nor
        # the agent's prompt and configuration, joined on every row.
        agent = "target__budget__agent__"
        return queryset.defer(
            "event__payload", f"{agent}system_prompt", f"{agent}adapter_config", f"{agent}managed_remote"
        )

    @admin.display(description="alert", ordering="alert__created_at")
    def alert_label(self, obj: AlertDelivery) -> str:
        alert = obj.alert
        if alert is None:
            return f"{obj.event.kind}: {obj.event.payload}"
        if alert.period == "day_runs":
            figures = f"{amount_text(alert.spent, count=True)} of {amount_text(alert.limit, count=True)} runs"
        else:
            figures = f"${usd(alert.spent)} of ${usd(alert.limit)}"
        return f"{alert.threshold} ({alert.percent}%) of the {alert.period} limit, {alert.period_key}: {figures}"

    @admin.display(description="target", ordering="target__url")
    def target_url(self, obj: AlertDelivery) -> str:
        return obj.target.url

    @admin.display(description="target", ordering="target__url")
    def target_short(self, obj: AlertDelivery) -> str:
        return short_text(obj.target.url, 34)

    @admin.display(description="budget", ordering="alert__budget")
    def budget_link(self, obj: AlertDelivery) -> str:
        budget = obj.target.budget
        owner = f"agent {budget.agent.name}" if budget.agent_id else f"company {budget.company.name}"
        return admin_link("admin:costs_app_budget_change", budget.pk, short_text(owner, 28))

    @admin.display(description="threshold", ordering="alert__threshold")
    def threshold(self, obj: AlertDelivery) -> str:
        alert = obj.alert
        if alert is None:
            return obj.event.kind
        return f"{alert.threshold}: {alert.percent}% of the {alert.period} limit"

    @admin.display(description="last error", ordering="last_error")
    def last_error_short(self, obj: AlertDelivery) -> str:
        return short_text(obj.last_error, 30) if obj.last_error else "-"


@admin.register(CostEvent)
class CostEventAdmin(ReadOnlyRecords, LargeTableAdmin):
    """The ledger: money already spent. Readable and filterable, never edited."""

    # The columns an operator decides on, inside a 1366-pixel screen beside the filters
    # (tests/admin/test_browser.py); the company, session, run and cache split are on the row.
    list_display = [
        "created_at",
        "agent_name",
        "model_name",
        "kind",
        "tokens",
        "cost",
        "unpriced",
    ]
    cost = money_column("cost_usd", "cost (USD)")
    list_filter = ["kind", "unpriced", ModelNameFilter, ("company", CompanyFilter), ("agent", AgentFilter)]
    date_hierarchy = "created_at"
    actions = None

    def get_queryset(self, request):
        # Names by subquery, not a join: the ledger outlives the agents it names (no FK
        # constraint), and an INNER JOIN would silently hide the rows of a deleted agent.
        queryset = super().get_queryset(request)
        if is_changelist(request):
            queryset = queryset.defer("raw_usage")
        return queryset.annotate(
            agent_label=Subquery(Agent.objects.filter(pk=OuterRef("agent_id")).values("name")[:1]),
            company_label=Subquery(Company.objects.filter(pk=OuterRef("company_id")).values("name")[:1]),
        )

    @admin.display(description="agent", ordering="agent_label")
    def agent_name(self, obj: CostEvent) -> str:
        if not obj.agent_label:
            return short_text(f"(deleted {obj.agent_id})", 28)
        return admin_link("admin:sessions_app_agent_change", obj.agent_id, short_text(obj.agent_label, 28))

    @admin.display(description="model", ordering="model")
    def model_name(self, obj: CostEvent) -> str:
        return short_text(obj.model, 26)

    @admin.display(description="tokens in / out", ordering="input_tokens")
    def tokens(self, obj: CostEvent) -> str:
        cache = obj.cache_read_input_tokens + obj.cache_creation_input_tokens
        detail = f" ({obj.cache_read_input_tokens} read from the cache, {obj.cache_creation_input_tokens} written)"
        return tokens_in_out(obj.input_tokens + cache, obj.output_tokens, detail=detail)

    @admin.display(description="company", ordering="company_label")
    def company_name(self, obj: CostEvent) -> str:
        return obj.company_label or str(obj.company_id)

    @admin.display(description="session")
    def session_link(self, obj: CostEvent) -> str:
        if not obj.session_id:
            return "-"
        return session_public_id(obj.session_id)

    @admin.display(description="run")
    def run_link(self, obj: CostEvent) -> str:
        return admin_link("admin:sessions_app_heartbeatrun_change", obj.run_id, str(obj.run_id)) if obj.run_id else "-"

    @admin.display(description="price")
    def price_link(self, obj: CostEvent) -> str:
        return admin_link("admin:costs_app_modelprice_change", obj.price_id, str(obj.price_id)) if obj.price_id else "-"

    def get_fields(self, request, obj=None):
        return [
            "cost" if f.name == "cost_usd" else f.name
            for f in CostEvent._meta.fields
            if f.name not in ("agent", "company", "session", "run", "price")
        ] + [
            "agent_name",
            "company_name",
            "session_link",
            "run_link",
            "price_link",
        ]

    def get_readonly_fields(self, request, obj=None):
        return self.get_fields(request, obj)

    def get_urls(self):
        return [
            path("report/", self.admin_site.admin_view(self.report_view), name="costs_app_costevent_report"),
            *super().get_urls(),
        ]

    def report_view(self, request):
        if not self.has_view_permission(request):
            raise PermissionDenied
        now = timezone.now()
        chosen = report_company(request)
        company_id = str(chosen[0]) if chosen else None
        companies, more_companies = newest_by_name(Company.objects.all(), COMPANY_CHOICES_CAP)
        if chosen is not None and chosen not in companies:
            companies.append(chosen)  # past the cap, as the lists' company filter shows it
        context = {
            **self.admin_site.each_context(request),
            **costs_report(company_id=company_id, now=now, days=REPORT_DAYS),
            "opts": self.opts,
            "title": f"Costs, last {REPORT_DAYS} days (UTC)",
            "companies": companies,
            "more_companies": more_companies,
            "companies_cap": COMPANY_CHOICES_CAP,
            "company_id": company_id,
            "ledger_url": reverse("admin:costs_app_costevent_changelist"),
        }
        return TemplateResponse(request, "admin/costs_app/costs.html", context)


def report_company(request) -> tuple | None:
    """The company the costs page is for, as (id, name) (`?company=`, or the id box's
    `?company_id=`), or None for all; an id that names none is said in a message, and all
    are shown."""
    given = (request.GET.get("company_id") or request.GET.get("company") or "").strip()
    if not given:
        return None
    company_id = parse_uuid(given)
    chosen = Company.objects.filter(pk=company_id).values_list("pk", "name").first() if company_id else None
    if chosen is None:
        messages.error(request, f"No company has the id “{given[:80]}”. Showing every company.")
    return chosen


def format_usd(value) -> str:
    return f"${usd(value)}"


def format_tokens(value) -> str:
    value = float(value)
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


def growth_judged(agent: Agent, growth) -> tuple[bool, str]:
    """Whether the agent's growth is flagged (`growth_flag`) and the advice, or (False, "")
    where its stored configuration gives nothing to judge or advise by: not a JSON object,
    or a setting that is no number (written by SQL or an older version; a save validates
    both). Either made the whole page a 500; the agent's page says what to correct, and its
    spend is still listed here."""
    if not isinstance(agent.adapter_config, dict):
        return False, ""
    try:
        growing = growth_flag(agent, growth)
        return growing, growth_advice(agent, growth) if growing else ""
    except (TypeError, ValueError):
        return False, ""


def costs_report(*, company_id, now, days: int) -> dict:
    """Everything the costs page shows, in a bounded number of queries:
    one rollup, one for agent names, and at most GROWTH_MAX_AGENTS growth queries."""
    rows = daily_costs_by_agent(company_id=company_id, now=now, days=days)
    first_day = window_start(now=now, days=days).date()
    day_list = [first_day + timedelta(days=i) for i in range(days)]

    per_agent: dict = defaultdict(
        lambda: {"input_tokens": 0, "output_tokens": 0, "cache_tokens": 0, "cost_usd": Decimal(0), "events": 0}
    )
    cost_by_agent: dict = defaultdict(dict)
    tokens_by_agent: dict = defaultdict(dict)
    per_day: dict = defaultdict(lambda: {"input_tokens": 0, "output_tokens": 0, "cost_usd": Decimal(0), "events": 0})
    for row in rows:
        agent_id, day = row["agent_id"], row["day"]
        cache = row["cache_creation_input_tokens"] + row["cache_read_input_tokens"]
        totals = per_agent[agent_id]
        totals["input_tokens"] += row["input_tokens"]
        totals["output_tokens"] += row["output_tokens"]
        totals["cache_tokens"] += cache
        totals["cost_usd"] += row["cost_usd"]
        totals["events"] += row["events"]
        cost_by_agent[agent_id][day] = row["cost_usd"]
        tokens_by_agent[agent_id][day] = row["input_tokens"] + cache + row["output_tokens"]
        day_totals = per_day[day]
        day_totals["input_tokens"] += row["input_tokens"] + cache
        day_totals["output_tokens"] += row["output_tokens"]
        day_totals["cost_usd"] += row["cost_usd"]
        day_totals["events"] += row["events"]

    agents = {
        agent.pk: agent
        for agent in Agent.objects.filter(pk__in=list(per_agent)).only("id", "name", "adapter_type", "adapter_config")
    }
    label = {
        agent_id: agents[agent_id].name if agent_id in agents else f"(deleted {str(agent_id)[:8]})"
        for agent_id in per_agent
    }

    ranked = sorted(per_agent, key=lambda a: (-per_agent[a]["cost_usd"], -per_agent[a]["input_tokens"]))
    growth = {agent_id: input_growth(agent_id=agent_id) for agent_id in ranked[:GROWTH_MAX_AGENTS]}

    agents_table = []
    for agent_id in ranked:
        g, agent = growth.get(agent_id), agents.get(agent_id)
        # Judged against what this agent's requests may grow to, and advised in its terms.
        growing, advice = growth_judged(agent, g) if g and agent else (False, "")
        agents_table.append(
            {
                "agent_id": agent_id,
                "name": label[agent_id],
                "exists": agent is not None,
                **per_agent[agent_id],
                "growth": g,
                "growing": growing,
                "advice": advice,
            }
        )

    cost_chart = stacked_bar_chart(
        days=day_list,
        series=limit_series([Series(label[a], cost_by_agent[a]) for a in ranked]),
        format_value=format_usd,
    )
    token_chart = stacked_bar_chart(
        days=day_list,
        series=limit_series([Series(label[a], tokens_by_agent[a]) for a in ranked]),
        format_value=format_tokens,
    )
    days_table = [{"day": day, **per_day[day]} for day in reversed(day_list) if day in per_day]
    return {
        "cost_chart": cost_chart,
        "token_chart": token_chart,
        "agents_table": agents_table,
        "days_table": days_table,
        "growing_agents": [row for row in agents_table if row["growing"]],
        "growth_checked": min(len(ranked), GROWTH_MAX_AGENTS),
        "total_cost": sum((row["cost_usd"] for row in agents_table), Decimal(0)),
        "first_day": first_day,
        "last_day": day_list[-1],
    }
