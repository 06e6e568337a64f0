"""Sessions: a changelist that never loads history or counts the table, and a read-only page
that shows the conversation, with export, expire and clear-history.
"""

from __future__ import annotations

import json

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Sum
from django.http import Http404, HttpResponse, HttpResponseRedirect, JsonResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.views.decorators.http import require_POST

from costs_app.models import CostEvent
from sessions_app import services
from sessions_app.admin.common import (
    AgentFilter,
    ApiIdsInUrls,
    CompanyFilter,
    CountedDeletion,
    LargeTableAdmin,
    ModelNameFilter,
    adapter_choices,
    admin_link,
    admin_time,
    agent_long_columns,
    changelist_url,
    humane_expiry,
    money_column,
    short_text,
    tokens_in_out,
)
from sessions_app.admin.managed import managed_outputs_html
from sessions_app.admin.transcript import transcript
from sessions_app.compact_now import session_compact
from sessions_app.errors import HistoryUnavailable, RunFailure
from sessions_app.models import (
    LIVE_SESSION_STATUSES,
    AgentSession,
    HeartbeatRun,
    ManagedOutput,
    RunTrigger,
    SessionCompaction,
    parse_session_id,
    session_public_id,
)
from sessions_app.serializers import SessionSerializer
from sessions_app.stores import store_for
from sessions_app.text import holds_unstorable, storable

# A session id in the list: `sess_` and 8 of its 32 hex digits.
SHORT_ID_CHARS = 14
# The raw JSON toggle shows at most this much; the export has the whole history.
RAW_HISTORY_MAX_CHARS = 500_000
# A session that never rotates gathers compactions, each holding every turn it replaced:
# its page shows the newest ones; the API's archive lists them from the oldest.
SESSION_PAGE_COMPACTIONS = 20


class AdapterTypeFilter(admin.SimpleListFilter):
    title = "adapter"
    parameter_name = "adapter_type"

    def lookups(self, request, model_admin):
        return adapter_choices()

    def queryset(self, request, queryset):
        return queryset.filter(adapter_type=self.value()) if self.value() else queryset


class RemoteHealthFilter(admin.SimpleListFilter):
    """Live sessions whose Managed Agents session is lost or was unreachable (`managed_health`)."""

    title = "remote session"
    parameter_name = "remote"

    def lookups(self, request, model_admin):
        return [("lost", "lost at the provider"), ("unreachable", "unreachable at the last check")]

    def queryset(self, request, queryset):
        if self.value() == "lost":
            return queryset.filter(status__in=LIVE_SESSION_STATUSES, managed_lost_at__isnull=False)
        if self.value() == "unreachable":
            return queryset.filter(
                status__in=LIVE_SESSION_STATUSES, managed_lost_at__isnull=True, managed_check_failures__gt=0
            )
        return queryset


@admin.register(AgentSession)
class AgentSessionAdmin(CountedDeletion, ApiIdsInUrls, LargeTableAdmin):
    # The columns an operator decides on, inside a 1366-pixel screen beside the filters
    # (tests/admin/test_browser.py); the company is a filter, the rest is on the row's page.
    list_display = [
        "short_session_id",
        "agent_name",
        "status_now",
        "message_count",
        "tokens",
        "total_cost",
        "last_used_at",
        "expires",
    ]
    list_display_links = ["short_session_id"]
    list_filter = [
        "status",
        ("company", CompanyFilter),
        ("agent", AgentFilter),
        AdapterTypeFilter,
        ModelNameFilter,
        RemoteHealthFilter,
    ]
    search_fields = ["agent__name"]
    search_help_text = "A session id (sess_… or UUID) or an agent name."
    date_hierarchy = "last_used"
    actions = ["expire_now", "clear_history", "compact_now"]
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
                    "cli_session_id",
                    ("managed_session_id", "remote_health"),
                    "outputs",
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
                "fields": [
                    "turn_count",
                    "compaction_count",
                    ("compaction_error", "compaction_error_at"),
                    "archived_message_count",
                    "manifest_json",
                ],
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
        "cli_session_id",
        "managed_session_id",
        "remote_health",
        "outputs",
        "ended_at",
        "end_reason",
        "history_purged_at",
        "predecessor_link",
        "paused_at",
        "pause_at",
        "active_seconds",
        "turn_count",
        "compaction_count",
        "compaction_error",
        "compaction_error_at",
        "archived_message_count",
        "manifest_json",
    ]
    change_form_template = "admin/sessions_app/agentsession/change_form.html"

    def get_queryset(self, request):
        # Never the history (it can be megabytes per row); the agent and company come in
        # the same query, so a page costs the same whatever its length.
        return super().get_queryset(request).select_related("agent", "company").defer("history", *agent_long_columns())

    def parse_api_id(self, object_id: str):
        return parse_session_id(object_id)

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

    @admin.display(description="session", ordering="id")
    def short_session_id(self, obj: AgentSession) -> str:
        # Enough to tell sessions apart; the tooltip and the page show all of it.
        return short_text(obj.public_id, SHORT_ID_CHARS)

    @admin.display(description="agent", ordering="agent__name")
    def agent_name(self, obj: AgentSession) -> str:
        return short_text(obj.agent.name, 28)

    @admin.display(description="status", ordering="status")
    def status_now(self, obj: AgentSession) -> str:
        # A row inserted without expires_at gets it from the next maintenance pass; its
        # agent's TTL is not read here, one query per row of the list.
        if obj.status in LIVE_SESSION_STATUSES and obj.expires_at is not None and obj.expires_at <= timezone.now():
            return "expired (not yet swept)"
        if obj.status in LIVE_SESSION_STATUSES and obj.managed_lost_at is not None:
            return f"{obj.status} (remote session lost)"
        return obj.status

    @admin.display(description="remote session health")
    def remote_health(self, obj: AgentSession) -> str:
        """The maintenance pass's last reading of its Managed Agents session."""
        if not obj.managed_session_id:
            return "-"
        if obj.managed_lost_at is not None:
            return f"lost {admin_time(obj.managed_lost_at)}: {obj.managed_problem}"
        if obj.managed_check_failures:
            return f"unreachable at the last {obj.managed_check_failures} checks: {obj.managed_problem}"
        return f"ok at {admin_time(obj.managed_checked_at)}" if obj.managed_checked_at else "not checked yet"

    @admin.display(description="expires", ordering="expires_at")
    def expires(self, obj: AgentSession) -> str:
        return format_html(
            '<span title="{}">{}</span>', admin_time(obj.expires_at), humane_expiry(obj.expires_at, now=timezone.now())
        )

    @admin.display(description="last used", ordering="last_used")
    def last_used_at(self, obj: AgentSession) -> str:
        return admin_time(obj.last_used)

    @admin.display(description="tokens in / out", ordering="total_input_tokens")
    def tokens(self, obj: AgentSession) -> str:
        return tokens_in_out(
            obj.total_input_tokens, obj.total_output_tokens, detail=f"; the last request {obj.last_input_tokens} in"
        )

    total_cost = money_column("total_cost_usd", "total cost (USD)")

    @admin.display(description="artifact manifest")
    def manifest_json(self, obj: AgentSession) -> str:
        if not obj.manifest:
            return "-"
        return format_html("<pre>{}</pre>", json.dumps(obj.manifest, indent=2, ensure_ascii=False, default=str))

    @admin.display(description="outputs")
    def outputs(self, obj: AgentSession) -> str:
        """The files its Managed Agents session produced, copied as the remote session ended."""
        if not obj.managed_session_id:
            return "-"  # no query for the sessions of other runtimes
        return managed_outputs_html(ManagedOutput.objects.filter(session_id=obj.pk))

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
            # Buttons that change the session: a GET (a link followed, a prefetch) is a 405.
            path(
                "<path:object_id>/expire/",
                self.admin_site.admin_view(require_POST(self.expire_view)),
                name=f"{info}_expire",
            ),
            path(
                "<path:object_id>/clear-history/",
                self.admin_site.admin_view(require_POST(self.clear_history_view)),
                name=f"{info}_clear_history",
            ),
        ]
        return urls + super().get_urls()

    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):
        # Here rather than in change_view, which would fetch the row a second time.
        if obj is not None:
            context = {**context, **self.conversation_context(request, obj)}
        return super().render_change_form(request, context, add, change, form_url, obj)

    def conversation_context(self, request, session: AgentSession) -> dict:
        try:
            # A lone surrogate (a file edited by hand or written by an older version: the
            # reader's json fallback takes what msgspec refuses) cannot go out in a UTF-8
            # page, and made it a 500: shown as U+FFFD, as a damaged answer is stored.
            history = storable(store_for(session).read(session))
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
        # marked as archived, in the order they happened (one query; a count past the cap).
        recorded = SessionCompaction.objects.filter(session_id=session.pk)
        newest = list(recorded.order_by("-created_at")[: SESSION_PAGE_COMPACTIONS + 1])
        compaction_total = recorded.count() if len(newest) > SESSION_PAGE_COMPACTIONS else len(newest)
        compactions = [
            {
                "record": compaction,
                "turns": transcript(storable(compaction.archived_messages or []), run_costs=run_costs),
                "facts_passed": sum(1 for fact in compaction.facts or [] if fact.get("passed")),
            }
            for compaction in reversed(newest[:SESSION_PAGE_COMPACTIONS])
        ]
        return {
            "compactions": compactions,
            "compaction_total": compaction_total,
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
        parsed = parse_session_id(object_id)  # before unquote(), which would mangle `sess_22...`
        session = self.get_object(request, str(parsed) if parsed else unquote(object_id))
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
        # The session as the API shows it, so an export reads like GET .../sessions/<id>.
        document = {
            "session": {**SessionSerializer(session).data, "company_id": str(session.company_id)},
            "history": history,
        }
        # Escaped where it holds a lone surrogate, which UTF-8 cannot carry: the export stays
        # the history as stored.
        escape = holds_unstorable(history)
        response = JsonResponse(document, json_dumps_params={"indent": 2, "ensure_ascii": escape})
        response["Content-Disposition"] = f'attachment; filename="{session.public_id}.json"'
        return response

    def _post_action(self, request, object_id) -> AgentSession:
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
        if not services.session_clear_history(session=session):
            self.message_user(request, f"Session {session.public_id} was deleted meanwhile.", messages.WARNING)
            return HttpResponseRedirect(reverse("admin:sessions_app_agentsession_changelist"))
        self.message_user(request, f"History of session {session.public_id} cleared.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:sessions_app_agentsession_change", args=[session.pk]))

    def deleted_with(self, ids):
        return [SessionCompaction.objects.filter(session_id__in=ids)]

    def delete_model(self, request, obj):
        services.session_delete(session=obj, now=timezone.now())

    def delete_queryset(self, request, queryset):
        services.sessions_delete(sessions=queryset, now=timezone.now())

    @admin.action(description="Expire selected sessions now", permissions=["change"])
    def expire_now(self, request, queryset):
        now = timezone.now()
        expired = sum(services.session_expire(session=session, now=now) for session in queryset)
        self.message_user(request, f"Expired {expired} session(s).", messages.SUCCESS)

    @admin.action(description="Clear history of selected sessions (keep the rows)", permissions=["change"])
    def clear_history(self, request, queryset):
        # A session deleted while the others are cleared is not counted.
        count = sum(services.session_clear_history(session=session) for session in queryset)
        self.message_user(request, f"Cleared the history of {count} session(s).", messages.SUCCESS)

    @admin.action(description="Compact selected sessions now (summarise their older turns)", permissions=["change"])
    def compact_now(self, request, queryset):
        """Each through `session_compact`, as the API does: a refusal (a heartbeat running,
        nothing to compact, a budget, a stored configuration no save would accept) is
        reported by session, the others still compacted."""
        compacted = 0
        for session in queryset.select_related("agent"):
            try:
                session_compact(session=session, now=timezone.now(), trigger=RunTrigger.ADMIN)
            except RunFailure as failure:
                self.message_user(
                    request, f"Session {session.public_id}: {failure.code}: {failure.message}", messages.WARNING
                )
            else:
                compacted += 1
        self.message_user(request, f"Compacted {compacted} session(s).", messages.SUCCESS)
