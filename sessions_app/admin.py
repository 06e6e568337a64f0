"""The operator admin: companies, agents, sessions, runs and API keys.

Every operation that spans models or leaves the process goes through `sessions_app.services`
(or the heartbeat engine), exactly as the API does: the admin's deletes, including the bulk
action that bypasses `Model.delete()`, remove history files too.

Lists of sessions and runs grow without bound, so their changelists never load `history`,
join what they display in the one page query, and never COUNT(*) the whole table.
"""

from __future__ import annotations

import json
from datetime import datetime

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.contrib.humanize.templatetags.humanize import naturaltime
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import connection, transaction
from django.db.models import Count, QuerySet, Sum
from django.forms.fields import InvalidJSONInput
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.text import capfirst
from django.utils.timesince import timesince, timeuntil

from costs_app.models import CostEvent
from sessions_app import services
from sessions_app.adapters import ADAPTERS
from sessions_app.api_keys import api_key_create, api_key_revoke
from sessions_app.models import (
    LIVE_SESSION_STATUSES,
    Agent,
    AgentSession,
    AgentStatus,
    ApiKey,
    Company,
    HeartbeatRun,
    RunTrigger,
    SessionCompaction,
    parse_session_id,
)
from sessions_app.schedules import agent_schedule_sync
from sessions_app.stores import HistoryUnavailable, store_for
from sessions_app.transcript import transcript

RECENT_INLINE_ROWS = 10
# The raw JSON toggle shows at most this much; the export has the whole history.
RAW_HISTORY_MAX_CHARS = 500_000
DEFAULT_HEARTBEAT_TASK = "Heartbeat started by an operator from the admin."


# ---------------------------------------------------------------------------------------
# Shared pieces


class CappedCountPaginator(Paginator):
    """Counts at most `count_cap` rows instead of the whole (filtered) table.

    `SELECT COUNT(*) FROM (... LIMIT cap+1)` stops after cap+1 index entries, so a filtered
    changelist of a table with millions of rows stays fast. Past the cap, an unfiltered list
    on PostgreSQL shows the planner's estimate (pg_class.reltuples); otherwise the cap. The
    pages beyond it are reached by narrowing with filters or the date hierarchy.
    """

    count_cap = 10_000

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return len(queryset)
        if queryset.query.is_sliced:
            return queryset.count()
        capped = queryset.values("pk").order_by()[: self.count_cap + 1].count()
        if capped <= self.count_cap:
            return capped
        if connection.vendor == "postgresql" and not queryset.query.where:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
                    [queryset.model._meta.db_table],
                )
                row = cursor.fetchone()
            if row and row[0] > self.count_cap:
                return int(row[0])
        return self.count_cap


def humane_expiry(expires_at: datetime | None, *, now: datetime) -> str:
    """'in 3 hours', 'expired 2 days ago', or 'never'."""
    if expires_at is None:
        return "never"
    if expires_at > now:
        return f"in {timeuntil(expires_at, now, depth=1)}"
    return f"expired {timesince(expires_at, now, depth=1)} ago"


def session_public_id(session_id) -> str:
    return AgentSession(id=session_id).public_id if session_id else ""


def is_changelist(request: HttpRequest) -> bool:
    match = request.resolver_match
    return bool(match and match.url_name and match.url_name.endswith("_changelist"))


def admin_link(viewname: str, object_id, text: str) -> str:
    return format_html('<a href="{}">{}</a>', reverse(viewname, args=[object_id]), text)


def changelist_url(model, **filters) -> str:
    url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    return f"{url}?{urlencode(filters)}" if filters else url


def deletion_summary(model_admin: admin.ModelAdmin, objs, request: HttpRequest, related: list[QuerySet]):
    """The delete confirmation's (to_delete, model_count, perms_needed, protected), by counts.

    Django's default lists every cascaded row, loading each one: for an agent that means
    every session with its history. One COUNT per related table says as much.
    """
    objs = list(objs)
    opts = model_admin.model._meta
    counts = {opts.verbose_name_plural: len(objs)}
    lines = []
    perms_needed = set()
    for queryset in related:
        related_opts = queryset.model._meta
        count = queryset.count()
        if not count:
            continue
        counts[related_opts.verbose_name_plural] = count
        lines.append(f"{count} {related_opts.verbose_name if count == 1 else related_opts.verbose_name_plural}")
        related_admin = model_admin.admin_site._registry.get(queryset.model)
        if related_admin is not None and not related_admin.has_delete_permission(request):
            perms_needed.add(related_opts.verbose_name)
    to_delete = []
    for obj in objs:
        to_delete.append(f"{capfirst(opts.verbose_name)}: {obj}")
    to_delete.append(lines)
    return to_delete, counts, perms_needed, []


class ReadOnlyInline(admin.TabularInline):
    """The newest rows of a related list, for reading; the full list is one link away."""

    extra = 0
    max_num = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def recent(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        # The formset filters by the parent itself but cannot slice; restrict to the newest
        # rows with a LIMITed subquery on the parent's id (uses the (agent, -time) index).
        object_id = request.resolver_match.kwargs.get("object_id") if request.resolver_match else None
        if object_id is None:
            return queryset.none()
        newest = (
            self.model._default_manager.filter(agent_id=unquote(object_id))
            .order_by(*self.model._meta.ordering)
            .values("pk")[:RECENT_INLINE_ROWS]
        )
        return queryset.filter(pk__in=newest)


# ---------------------------------------------------------------------------------------
# Companies


@admin.register(Company)
class CompanyAdmin(admin.ModelAdmin):
    list_display = ["name", "id", "agent_count", "created_at"]
    search_fields = ["name", "=id"]
    readonly_fields = ["id", "created_at"]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(agent_total=Count("agents"))

    @admin.display(description="agents", ordering="agent_total")
    def agent_count(self, obj: Company) -> int:
        return obj.agent_total

    def get_deleted_objects(self, objs, request):
        ids = [obj.pk for obj in objs]
        return deletion_summary(
            self,
            objs,
            request,
            [
                Agent.objects.filter(company_id__in=ids),
                AgentSession.objects.filter(company_id__in=ids),
                SessionCompaction.objects.filter(session__company_id__in=ids),
                HeartbeatRun.objects.filter(company_id__in=ids),
                ApiKey.objects.filter(company_id__in=ids),
            ],
        )

    def delete_model(self, request, obj):
        self.delete_queryset(request, Company.objects.filter(pk=obj.pk))

    def delete_queryset(self, request, queryset):
        # Through the agents' delete, so their sessions' history files go too (a plain
        # cascade would leave them on disk). The cost ledger stays, as for agents.
        with transaction.atomic():
            services.agents_hard_delete(agents=Agent.objects.filter(company__in=queryset))
            queryset.delete()


# ---------------------------------------------------------------------------------------
# Agents


class PrettyJSONField(forms.JSONField):
    """A JSON object edited as indented text, so a configuration reads like the docs."""

    def prepare_value(self, value):
        if isinstance(value, InvalidJSONInput):
            return value
        return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, cls=self.encoder)


def adapter_choices() -> list[tuple[str, str]]:
    return [(name, name) for name in sorted(ADAPTERS)]


class AgentAdminForm(forms.ModelForm):
    adapter_type = forms.ChoiceField(choices=adapter_choices)
    adapter_config = PrettyJSONField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 10, "cols": 70, "class": "vLargeTextField", "spellcheck": "false"}),
        help_text=(
            'A JSON object, e.g. {"model": "claude-opus-4-5", "session_mode": "persistent", '
            '"session_ttl_hours": 24}. Defaults are filled in when saved; unknown keys are refused.'
        ),
    )

    class Meta:
        model = Agent
        fields = ["company", "name", "system_prompt", "adapter_type", "adapter_config"]

    def clean_adapter_config(self):
        value = self.cleaned_data.get("adapter_config")
        return {} if value is None else value

    # Agent.clean() (run by the ModelForm) raises AgentConfigError, a ValidationError keyed
    # by "adapter_config" / "adapter_type": both are fields here, so Django shows them as
    # field errors next to the textarea instead of a 500.


class HeartbeatForm(forms.Form):
    task = forms.CharField(widget=forms.Textarea(attrs={"rows": 6, "cols": 80}), initial=DEFAULT_HEARTBEAT_TASK)


class RecentSessionsInline(ReadOnlyInline):
    model = AgentSession
    fk_name = "agent"
    verbose_name_plural = f"recent sessions (newest {RECENT_INLINE_ROWS})"
    fields = readonly_fields = [
        "status",
        "message_count",
        "last_used",
        "expires",
        "last_input_tokens",
        "total_cost",
    ]

    def get_queryset(self, request):
        return self.recent(request, super().get_queryset(request).defer("history"))

    @admin.display(description="expires")
    def expires(self, obj: AgentSession) -> str:
        return humane_expiry(obj.expires_at, now=timezone.now())

    @admin.display(description="total cost (USD)")
    def total_cost(self, obj: AgentSession) -> str:
        return f"{obj.total_cost_usd:.4f}"


class RecentRunsInline(ReadOnlyInline):
    model = HeartbeatRun
    fk_name = "agent"
    verbose_name_plural = f"recent runs (newest {RECENT_INLINE_ROWS})"
    fields = readonly_fields = [
        "status",
        "trigger",
        "created_at",
        "finished_at",
        "input_tokens",
        "output_tokens",
        "cost_usd",
        "error_code",
    ]

    def get_queryset(self, request):
        return self.recent(request, super().get_queryset(request).defer("task", "output"))


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    form = AgentAdminForm
    list_display = ["name", "company", "adapter_type", "model", "session_mode", "status_flag", "updated_at"]
    list_filter = ["status", "paused_reason", "adapter_type", "company"]
    list_select_related = ["company"]
    search_fields = ["name", "=id"]
    search_help_text = "Agent name, or its exact id."
    readonly_fields = ["id", "status", "paused_reason", "created_at", "updated_at", "deleted_at"]
    inlines = [RecentSessionsInline, RecentRunsInline]
    actions = ["pause_agents", "resume_agents", "run_heartbeat_now", "retire_agents"]
    change_form_template = "admin/sessions_app/agent/change_form.html"

    def get_fields(self, request, obj=None):
        fields = ["company", "name", "system_prompt", "adapter_type", "adapter_config"]
        return fields if obj is None else ["id", *fields, "status", "paused_reason", "created_at", "updated_at"]

    @admin.display(description="model")
    def model(self, obj: Agent) -> str:
        return obj.model_name

    @admin.display(description="status", ordering="status")
    def status_flag(self, obj: Agent) -> str:
        if obj.status == "paused" and obj.paused_reason == "budget":
            # The one pause an operator must act on: raise the budget (or wait for the month).
            return format_html(
                '<strong class="budget-paused" style="color:#ba2121">{}</strong>', "paused: budget spent"
            )
        if obj.paused_reason:
            return f"{obj.status} ({obj.paused_reason})"
        return obj.status

    @admin.display(description="session mode")
    def session_mode(self, obj: Agent) -> str:
        return obj.session_mode

    def get_urls(self):
        urls = [
            path(
                "<path:object_id>/heartbeat/",
                self.admin_site.admin_view(self.heartbeat_view),
                name="sessions_app_agent_heartbeat",
            ),
        ]
        return urls + super().get_urls()

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra_context = {
            **(extra_context or {}),
            "sessions_url": changelist_url(AgentSession, agent=unquote(object_id)),
            "runs_url": changelist_url(HeartbeatRun, agent=unquote(object_id)),
            "costs_url": changelist_url(CostEvent, agent=unquote(object_id)),
        }
        return super().change_view(request, object_id, form_url, extra_context)

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        # A changed heartbeat_interval_minutes moves the django-q2 schedule with it.
        agent_schedule_sync(agent=obj)

    def get_deleted_objects(self, objs, request):
        ids = [obj.pk for obj in objs]
        return deletion_summary(
            self,
            objs,
            request,
            [
                AgentSession.objects.filter(agent_id__in=ids),
                SessionCompaction.objects.filter(session__agent_id__in=ids),
                HeartbeatRun.objects.filter(agent_id__in=ids),
            ],
        )

    def delete_model(self, request, obj):
        services.agents_hard_delete(agents=Agent.objects.filter(pk=obj.pk))

    def delete_queryset(self, request, queryset):
        services.agents_hard_delete(agents=queryset)

    @admin.action(description="Pause selected agents", permissions=["change"])
    def pause_agents(self, request, queryset):
        for agent in queryset:
            services.agent_pause(agent=agent)
        self.message_user(request, f"Paused {queryset.count()} agent(s).", messages.SUCCESS)

    @admin.action(description="Resume selected agents", permissions=["change"])
    def resume_agents(self, request, queryset):
        for agent in queryset:
            services.agent_resume(agent=agent)
        self.message_user(request, f"Resumed {queryset.count()} agent(s).", messages.SUCCESS)

    @admin.action(
        description="Retire selected agents (as the API's DELETE: keep runs and costs)", permissions=["change"]
    )
    def retire_agents(self, request, queryset):
        now = timezone.now()
        count = 0
        for agent in queryset.exclude(status=AgentStatus.DELETED):
            services.agent_delete(agent=agent, now=now)
            count += 1
        self.message_user(request, f"Retired {count} agent(s); their sessions were deleted.", messages.SUCCESS)

    @admin.action(description="Run a heartbeat now", permissions=["change"])
    def run_heartbeat_now(self, request, queryset):
        for agent in queryset:
            self.start_heartbeat(request, agent=agent, task=DEFAULT_HEARTBEAT_TASK)

    def start_heartbeat(self, request, *, agent: Agent, task: str) -> HeartbeatRun | None:
        from sessions_app.heartbeat import HeartbeatRefused, heartbeat_dispatch, heartbeat_enqueue

        try:
            with transaction.atomic():
                run, _ = heartbeat_enqueue(agent=agent, task=task, now=timezone.now(), trigger=RunTrigger.ADMIN)
                heartbeat_dispatch(run=run)
        except HeartbeatRefused as exc:
            self.message_user(request, f"{agent.name}: heartbeat refused ({exc.code}): {exc.message}", messages.ERROR)
            return None
        self.message_user(
            request,
            format_html(
                "{}: heartbeat queued as {}.",
                agent.name,
                admin_link("admin:sessions_app_heartbeatrun_change", run.pk, f"run {run.pk}"),
            ),
            messages.SUCCESS,
        )
        return run

    def heartbeat_view(self, request, object_id):
        agent = self.get_object(request, unquote(object_id))
        if agent is None:
            raise Http404("No such agent.")
        if not self.has_change_permission(request, agent):
            raise PermissionDenied
        form = HeartbeatForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            run = self.start_heartbeat(request, agent=agent, task=form.cleaned_data["task"])
            if run is not None:
                return HttpResponseRedirect(reverse("admin:sessions_app_heartbeatrun_change", args=[run.pk]))
            return HttpResponseRedirect(reverse("admin:sessions_app_agent_change", args=[agent.pk]))
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Run a heartbeat of {agent.name}",
            "agent": agent,
            "form": form,
        }
        return TemplateResponse(request, "admin/sessions_app/agent/heartbeat.html", context)


# ---------------------------------------------------------------------------------------
# Sessions


class AdapterTypeFilter(admin.SimpleListFilter):
    title = "adapter"
    parameter_name = "adapter_type"

    def lookups(self, request, model_admin):
        return adapter_choices()

    def queryset(self, request, queryset):
        return queryset.filter(adapter_type=self.value()) if self.value() else queryset


class ModelNameFilter(admin.SimpleListFilter):
    """Models named by agents or prices: two small tables, never a DISTINCT over the big one."""

    title = "model"
    parameter_name = "model"

    def lookups(self, request, model_admin):
        from costs_app.models import ModelPrice

        names = set(ModelPrice.objects.order_by().values_list("model", flat=True).distinct())
        names |= {
            name for name in Agent.objects.values_list("adapter_config__model", flat=True) if isinstance(name, str)
        }
        return [(name, name) for name in sorted(names) if name]

    def queryset(self, request, queryset):
        return queryset.filter(model=self.value()) if self.value() else queryset


@admin.register(AgentSession)
class AgentSessionAdmin(admin.ModelAdmin):
    list_display = [
        "session_id",
        "agent",
        "company",
        "status_now",
        "message_count",
        "last_used_ago",
        "expires",
        "last_input_tokens",
        "total_cost",
    ]
    list_display_links = ["session_id"]
    list_filter = ["status", "company", "agent", AdapterTypeFilter, ModelNameFilter]
    search_fields = ["agent__name"]
    search_help_text = "A session id (sess_… or UUID) or an agent name."
    date_hierarchy = "last_used"
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = CappedCountPaginator
    actions = ["expire_now", "clear_history"]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    ("session_id", "status_now"),
                    ("agent", "company"),
                    ("message_count", "expires"),
                    ("created_at", "last_used"),
                ]
            },
        ),
        (
            "Usage",
            {
                "fields": [
                    ("adapter_type", "model"),
                    ("last_input_tokens", "total_cost"),
                    ("total_input_tokens", "total_output_tokens"),
                ]
            },
        ),
        (
            "Lifecycle and storage",
            {
                "classes": ["collapse"],
                "fields": [
                    "store",
                    ("paused_at", "pause_at"),
                    "active_seconds",
                    ("ended_at", "end_reason"),
                    "history_purged_at",
                    "predecessor_link",
                ],
            },
        ),
        (
            "Context management",
            {
                "classes": ["collapse"],
                "fields": ["turn_count", "compaction_count", "archived_message_count", "manifest_json"],
            },
        ),
    ]
    readonly_fields = [
        "session_id",
        "status_now",
        "agent",
        "company",
        "message_count",
        "expires",
        "created_at",
        "last_used",
        "adapter_type",
        "model",
        "last_input_tokens",
        "total_cost",
        "total_input_tokens",
        "total_output_tokens",
        "store",
        "ended_at",
        "end_reason",
        "history_purged_at",
        "predecessor_link",
        "paused_at",
        "pause_at",
        "active_seconds",
        "turn_count",
        "compaction_count",
        "archived_message_count",
        "manifest_json",
    ]
    change_form_template = "admin/sessions_app/agentsession/change_form.html"

    def get_queryset(self, request):
        # Never the history (it can be megabytes per row); the agent and company come in
        # the same query, so a page costs the same whatever its length.
        return (
            super()
            .get_queryset(request)
            .select_related("agent", "company")
            .defer("history", "agent__system_prompt", "agent__adapter_config")
        )

    def get_search_results(self, request, queryset, search_term):
        session_id = parse_session_id(search_term)
        if session_id is not None:
            return queryset.filter(pk=session_id), False
        return super().get_search_results(request, queryset, search_term)

    def has_add_permission(self, request) -> bool:
        return False  # sessions are created by heartbeats

    def has_change_permission(self, request, obj=None) -> bool:
        # A session page is for reading (and deleting); the list's actions still change.
        return obj is None and super().has_change_permission(request)

    @admin.display(description="session", ordering="id")
    def session_id(self, obj: AgentSession) -> str:
        return obj.public_id

    @admin.display(description="status", ordering="status")
    def status_now(self, obj: AgentSession) -> str:
        if obj.status in LIVE_SESSION_STATUSES and not obj.is_live_at(timezone.now()):
            return "expired (not yet swept)"
        return obj.status

    @admin.display(description="expires", ordering="expires_at")
    def expires(self, obj: AgentSession) -> str:
        return humane_expiry(obj.expires_at, now=timezone.now())

    @admin.display(description="last used", ordering="last_used")
    def last_used_ago(self, obj: AgentSession) -> str:
        return format_html('<span title="{}">{}</span>', obj.last_used.isoformat(), naturaltime(obj.last_used))

    @admin.display(description="total cost (USD)", ordering="total_cost_usd")
    def total_cost(self, obj: AgentSession) -> str:
        return f"{obj.total_cost_usd:.4f}"

    @admin.display(description="artifact manifest")
    def manifest_json(self, obj: AgentSession) -> str:
        if not obj.manifest:
            return "-"
        return format_html("<pre>{}</pre>", json.dumps(obj.manifest, indent=2, ensure_ascii=False, default=str))

    @admin.display(description="predecessor")
    def predecessor_link(self, obj: AgentSession) -> str:
        if not obj.predecessor_id:
            return "-"
        return admin_link(
            "admin:sessions_app_agentsession_change", obj.predecessor_id, session_public_id(obj.predecessor_id)
        )

    def get_urls(self):
        info = "sessions_app_agentsession"
        urls = [
            path("<path:object_id>/export/", self.admin_site.admin_view(self.export_view), name=f"{info}_export"),
            path("<path:object_id>/expire/", self.admin_site.admin_view(self.expire_view), name=f"{info}_expire"),
            path(
                "<path:object_id>/clear-history/",
                self.admin_site.admin_view(self.clear_history_view),
                name=f"{info}_clear_history",
            ),
        ]
        return urls + super().get_urls()

    def change_view(self, request, object_id, form_url="", extra_context=None):
        session = self.get_object(request, unquote(object_id))
        if session is not None:
            extra_context = {**(extra_context or {}), **self.conversation_context(request, session)}
        return super().change_view(request, object_id, form_url, extra_context)

    def conversation_context(self, request, session: AgentSession) -> dict:
        try:
            history = store_for(session).read(session)
            history_error = ""
        except HistoryUnavailable as exc:
            history, history_error = [], exc.message
        run_costs = {
            str(row["run_id"]): row["cost"]
            for row in CostEvent.objects.filter(session_id=session.pk, run_id__isnull=False)
            .values("run_id")
            .annotate(cost=Sum("cost_usd"))
            .order_by()
        }
        raw = json.dumps(history, indent=2, ensure_ascii=False, default=str) if not history_error else ""
        # Compacted turns were moved, verbatim, to the session's compactions: shown apart,
        # marked as archived, in the order they happened (one query).
        compactions = [
            {"record": compaction, "turns": transcript(compaction.archived_messages or [], run_costs=run_costs)}
            for compaction in SessionCompaction.objects.filter(session_id=session.pk).order_by("created_at")
        ]
        return {
            "compactions": compactions,
            "session": session,
            "turns": transcript(history, run_costs=run_costs),
            "history_error": history_error,
            "raw_history": raw[:RAW_HISTORY_MAX_CHARS],
            "raw_history_truncated": len(raw) > RAW_HISTORY_MAX_CHARS,
            "runs_url": changelist_url(HeartbeatRun, session=session.pk),
            "costs_url": changelist_url(CostEvent, session=session.pk),
            "agent_url": reverse("admin:sessions_app_agent_change", args=[session.agent_id]),
            "can_act_on_session": super().has_change_permission(request),
        }

    def _get_session_or_404(self, request, object_id) -> AgentSession:
        session = self.get_object(request, unquote(object_id))
        if session is None:
            raise Http404("No such session.")
        return session

    def export_view(self, request, object_id):
        session = self._get_session_or_404(request, object_id)
        if not self.has_view_permission(request, session):
            raise PermissionDenied
        try:
            history = store_for(session).read(session)
        except HistoryUnavailable as exc:
            self.message_user(request, f"Cannot export: {exc.message}", messages.ERROR)
            return HttpResponseRedirect(reverse("admin:sessions_app_agentsession_change", args=[session.pk]))
        document = {
            "session": {
                "id": session.public_id,
                "agent_id": str(session.agent_id),
                "company_id": str(session.company_id),
                "status": session.status,
                "store": session.store,
                "message_count": session.message_count,
                "created_at": session.created_at,
                "last_used": session.last_used,
                "expires_at": session.expires_at,
                "ended_at": session.ended_at,
                "end_reason": session.end_reason,
                "adapter_type": session.adapter_type,
                "model": session.model,
                "last_input_tokens": session.last_input_tokens,
                "total_input_tokens": session.total_input_tokens,
                "total_output_tokens": session.total_output_tokens,
                "total_cost_usd": str(session.total_cost_usd),
            },
            "history": history,
        }
        response = JsonResponse(document, json_dumps_params={"indent": 2, "ensure_ascii": False})
        response["Content-Disposition"] = f'attachment; filename="{session.public_id}.json"'
        return response

    def _post_action(self, request, object_id) -> AgentSession:
        if request.method != "POST":
            raise PermissionDenied
        if not super().has_change_permission(request):
            raise PermissionDenied
        return self._get_session_or_404(request, object_id)

    def expire_view(self, request, object_id) -> HttpResponse:
        session = self._post_action(request, object_id)
        if services.session_expire(session=session, now=timezone.now()):
            self.message_user(request, f"Session {session.public_id} expired.", messages.SUCCESS)
        else:
            self.message_user(request, f"Session {session.public_id} was no longer live.", messages.WARNING)
        return HttpResponseRedirect(reverse("admin:sessions_app_agentsession_change", args=[session.pk]))

    def clear_history_view(self, request, object_id) -> HttpResponse:
        session = self._post_action(request, object_id)
        services.session_clear_history(session=session)
        self.message_user(request, f"History of session {session.public_id} cleared.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:sessions_app_agentsession_change", args=[session.pk]))

    def get_deleted_objects(self, objs, request):
        ids = [obj.pk for obj in objs]
        return deletion_summary(self, objs, request, [SessionCompaction.objects.filter(session_id__in=ids)])

    def delete_model(self, request, obj):
        services.session_delete(session=obj)

    def delete_queryset(self, request, queryset):
        services.sessions_delete(sessions=queryset)

    @admin.action(description="Expire selected sessions now", permissions=["change"])
    def expire_now(self, request, queryset):
        now = timezone.now()
        expired = sum(services.session_expire(session=session, now=now) for session in queryset)
        self.message_user(request, f"Expired {expired} session(s).", messages.SUCCESS)

    @admin.action(description="Clear history of selected sessions (keep the rows)", permissions=["change"])
    def clear_history(self, request, queryset):
        count = 0
        for session in queryset:
            services.session_clear_history(session=session)
            count += 1
        self.message_user(request, f"Cleared the history of {count} session(s).", messages.SUCCESS)


# ---------------------------------------------------------------------------------------
# Runs


@admin.register(HeartbeatRun)
class HeartbeatRunAdmin(admin.ModelAdmin):
    list_display = [
        "run_id",
        "agent",
        "company",
        "status",
        "trigger",
        "session_link",
        "created_at",
        "finished_at",
        "input_tokens",
        "output_tokens",
        "cost_usd",
        "error_code",
    ]
    list_display_links = ["run_id"]
    list_filter = ["status", "trigger", "company", "agent"]
    search_fields = ["agent__name"]
    search_help_text = "A run id, a session id (sess_… or UUID), or an agent name."
    date_hierarchy = "created_at"
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = CappedCountPaginator
    fields = [
        "id",
        "agent",
        "company",
        "session_link",
        "status",
        "trigger",
        "task",
        "force_fresh",
        "idempotency_key",
        "output",
        "error_code",
        "error",
        "model",
        "message_id",
        "stop_reason",
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "cost_usd",
        "reserved_usd",
        "warning",
        "created_at",
        "started_at",
        "finished_at",
        "deadline_at",
        "claimed_by",
    ]
    readonly_fields = fields

    def get_queryset(self, request):
        queryset = super().get_queryset(request).select_related("agent", "company")
        queryset = queryset.defer("agent__system_prompt", "agent__adapter_config")
        # The list shows none of the long texts; the run's own page shows them all.
        return queryset.defer("task", "output", "error", "warning") if is_changelist(request) else queryset

    def get_search_results(self, request, queryset, search_term):
        object_id = parse_session_id(search_term)
        if object_id is not None:
            return queryset.filter(pk=object_id) | queryset.filter(session_id=object_id), False
        return super().get_search_results(request, queryset, search_term)

    def has_add_permission(self, request) -> bool:
        return False  # runs are created by heartbeats

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # a run is a record of what happened

    @admin.display(description="run", ordering="created_at")
    def run_id(self, obj: HeartbeatRun) -> str:
        return str(obj.pk)[:8] + "…"

    @admin.display(description="session")
    def session_link(self, obj: HeartbeatRun) -> str:
        # By id only: joining the session would drag its history along.
        if not obj.session_id:
            return "-"
        return admin_link("admin:sessions_app_agentsession_change", obj.session_id, session_public_id(obj.session_id))


# ---------------------------------------------------------------------------------------
# API keys


class ApiKeyAddForm(forms.ModelForm):
    class Meta:
        model = ApiKey
        fields = ["company", "name"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "company", "is_active", "created_at", "last_used_at", "revoked_at"]
    list_filter = ["company"]
    list_select_related = ["company"]
    search_fields = ["prefix", "name"]
    actions = ["revoke"]

    def get_form(self, request, obj=None, change=False, **kwargs):
        if obj is None:
            kwargs["form"] = ApiKeyAddForm
        return super().get_form(request, obj, change=change, **kwargs)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["company", "name"]
        return ["company", "name", "prefix", "created_at", "last_used_at", "revoked_at"]

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return []
        return ["company", "prefix", "created_at", "last_used_at"]

    @admin.display(boolean=True, description="active")
    def is_active(self, obj: ApiKey) -> bool:
        return obj.is_active

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        key, plaintext = api_key_create(company=obj.company, name=obj.name)
        # The admin goes on with `obj` (log entry, redirect): make it the created row.
        for model_field in ApiKey._meta.concrete_fields:
            setattr(obj, model_field.attname, getattr(key, model_field.attname))
        obj._state.adding = False
        obj._state.db = key._state.db
        self.message_user(
            request,
            format_html(
                "The new key is <code>{}</code>. Copy it now: it is not stored and will not be shown again.",
                plaintext,
            ),
            messages.WARNING,
        )

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke(self, request, queryset):
        now = timezone.now()
        keys = list(queryset.filter(revoked_at__isnull=True))
        for key in keys:
            api_key_revoke(api_key=key, now=now)
        self.message_user(request, f"Revoked {len(keys)} key(s).", messages.SUCCESS)
