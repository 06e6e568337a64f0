"""Heartbeat runs: read-only records of what happened."""

from __future__ import annotations

import json

from django.contrib import admin, messages
from django.utils import timezone

from memory_app.models import RunToolLoop
from sessions_app.admin.common import (
    AgentFilter,
    ApiIdsInUrls,
    CompanyFilter,
    CountedDeletion,
    LargeTableAdmin,
    admin_link,
    admin_time,
    agent_long_columns,
    is_changelist,
    money_column,
    short_text,
    tokens_in_out,
)
from sessions_app.approvals import ApprovalRefused, approval_decide, approval_pending
from sessions_app.errors import QueueUnavailable
from sessions_app.models import RUN_BATCH_COLUMNS, HeartbeatRun, parse_session_id, session_public_id


@admin.register(HeartbeatRun)
class HeartbeatRunAdmin(CountedDeletion, ApiIdsInUrls, LargeTableAdmin):
    # The columns an operator decides on, inside a 1366-pixel screen beside the filters
    # (tests/admin/test_browser.py); the company, session and times are on the run's page.
    list_display = [
        "run_id",
        "agent_name",
        "status",
        "trigger",
        "started",
        "tokens",
        "cost",
        "error_code",
    ]
    list_display_links = ["run_id"]
    list_filter = ["status", "nothing_to_do", "trigger", ("company", CompanyFilter), ("agent", AgentFilter)]
    search_fields = ["agent__name"]
    search_help_text = "A run id, a session id (sess_… or UUID), or an agent name."
    date_hierarchy = "created_at"
    fields = [
        "id",
        "agent",
        "company",
        "session_link",
        "status",
        "approval",
        "trigger",
        "merged_ticks",
        "task",
        "work_check_output",
        "force_fresh",
        "idempotency_key",
        "output",
        "nothing_to_do",
        "error_code",
        "error",
        "model",
        "message_id",
        "stop_reason",
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "cost",
        "reserved",
        "warning",
        "created_at",
        "started_at",
        "finished_at",
        "deadline_at",
        "claimed_by",
    ]
    readonly_fields = fields
    actions = ["approve_tool_calls", "deny_tool_calls"]

    cost = money_column("cost_usd", "cost (USD)")
    reserved = money_column("reserved_usd", "reserved (USD)")

    def get_queryset(self, request):
        queryset = super().get_queryset(request).select_related("agent", "company")
        queryset = queryset.defer(*agent_long_columns(), *RUN_BATCH_COLUMNS)
        # The list shows none of the long texts; the run's own page shows them all.
        long_texts = ("task", "output", "error", "warning", "work_check_output", "managed_turn")
        return queryset.defer(*long_texts) if is_changelist(request) else queryset

    def deleted_with(self, ids):
        # Counted: Django's default joins each tool loop to its run and reads the run's every
        # column, a batch run's whole request included, to list it again.
        return [RunToolLoop.objects.filter(run_id__in=ids)]

    def get_search_results(self, request, queryset, search_term):
        object_id = parse_session_id(search_term)
        if object_id is not None:
            return queryset.filter(pk=object_id) | queryset.filter(session_id=object_id), False
        return super().get_search_results(request, queryset, search_term)

    def has_add_permission(self, request) -> bool:
        return False  # runs are created by heartbeats

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # a run is a record of what happened

    @admin.display(description="approval")
    def approval(self, obj: HeartbeatRun) -> str:
        shown = approval_pending(obj)
        if shown is None:
            return "-"
        calls = "; ".join(f"{call['name']} {json.dumps(call['input'])[:300]}" for call in shown["tool_calls"])
        decision = shown["decision"]
        if decision is not None:
            return f"{calls}: {decision['result']} by {decision['by'] or 'an operator'} ({decision['reason'] or 'no reason'})"
        return f"{calls}: waiting, until {shown['expires_at']}"

    @admin.action(description="Approve the tool calls the selected runs wait on")
    def approve_tool_calls(self, request, queryset):
        self._decide(request, queryset, allow=True)

    @admin.action(description="Deny the tool calls the selected runs wait on")
    def deny_tool_calls(self, request, queryset):
        self._decide(request, queryset, allow=False)

    def _decide(self, request, queryset, *, allow: bool) -> None:
        """Each through `approval_decide`, as the API does; a run that no longer waits is
        reported by run, the others still decided. Runs are read-only records, so the
        decision needs the operator's right to change them."""
        if not super().has_change_permission(request):
            self.message_user(request, "You may not decide on runs.", messages.ERROR)
            return
        decided = 0
        by = f"admin {request.user.get_username()}"
        reason = "" if allow else f"Denied by {by}."
        for run in queryset.select_related("agent"):
            try:
                approval_decide(run, allow=allow, reason=reason, by=by, now=timezone.now())
                decided += 1
            except ApprovalRefused as refused:
                self.message_user(request, f"Run {run.pk}: {refused.message}", messages.WARNING)
            except QueueUnavailable as unqueued:
                decided += 1  # the decision is recorded; the maintenance pass hands the run over
                self.message_user(request, f"Run {run.pk}: {unqueued.message}", messages.WARNING)
        self.message_user(request, f"{'Approved' if allow else 'Denied'} {decided} run(s).", messages.SUCCESS)

    @admin.display(description="run", ordering="created_at")
    def run_id(self, obj: HeartbeatRun) -> str:
        return str(obj.pk)[:8] + "…"

    @admin.display(description="agent", ordering="agent__name")
    def agent_name(self, obj: HeartbeatRun) -> str:
        return short_text(obj.agent.name, 28)

    @admin.display(description="started", ordering="started_at")
    def started(self, obj: HeartbeatRun) -> str:
        return admin_time(obj.started_at) if obj.started_at else f"not yet ({obj.status})"

    @admin.display(description="tokens in / out", ordering="input_tokens")
    def tokens(self, obj: HeartbeatRun) -> str:
        cache_read, cache_written = obj.cache_read_input_tokens or 0, obj.cache_creation_input_tokens or 0
        read = None if obj.input_tokens is None else obj.input_tokens + cache_read + cache_written
        return tokens_in_out(
            read, obj.output_tokens, detail=f" ({cache_read} read from the cache, {cache_written} written)"
        )

    @admin.display(description="session")
    def session_link(self, obj: HeartbeatRun) -> str:
        # By id only: joining the session would drag its history along.
        if not obj.session_id:
            return "-"
        return admin_link("admin:sessions_app_agentsession_change", obj.session_id, session_public_id(obj.session_id))
