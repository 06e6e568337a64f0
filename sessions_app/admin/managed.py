"""Remote Managed Agents sessions to end (`sessions_app.managed_sessions`): read-only, the
record of what was archived or deleted at Anthropic, and what the provider has refused."""

from __future__ import annotations

from django.contrib import admin

from sessions_app.admin.common import LargeTableAdmin, admin_time, short_text
from sessions_app.models import ManagedSessionEnd


class EndStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return [("pending", "pending"), ("failing", "refused at least once, not done"), ("done", "done")]

    def queryset(self, request, queryset):
        if self.value() == "pending":
            return queryset.filter(done_at__isnull=True)
        if self.value() == "failing":
            return queryset.filter(done_at__isnull=True, attempts__gt=0)
        if self.value() == "done":
            return queryset.filter(done_at__isnull=False)
        return queryset


@admin.register(ManagedSessionEnd)
class ManagedSessionEndAdmin(LargeTableAdmin):
    """Each remote session this service archived or deleted, or still means to: the maintenance
    pass retries one the provider refused until it is done. The service writes these rows."""

    # One state column instead of four: the list fits a laptop screen, and the row's own page
    # has every field.
    list_display = ["remote_session", "action", "company", "created", "state"]
    list_filter = [EndStateFilter, "action"]
    list_select_related = ["company"]
    search_fields = ["remote_session_id"]
    readonly_fields = [field.name for field in ManagedSessionEnd._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="remote session", ordering="remote_session_id")
    def remote_session(self, obj: ManagedSessionEnd) -> str:
        return short_text(obj.remote_session_id, 28)

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: ManagedSessionEnd) -> str:
        return admin_time(obj.created_at)

    @admin.display(description="state")
    def state(self, obj: ManagedSessionEnd) -> str:
        if obj.done_at is not None:
            return f"done {admin_time(obj.done_at)}"
        if not obj.attempts:
            return "pending"
        return short_text(f"refused {obj.attempts}x, next {admin_time(obj.next_attempt_at)}: {obj.last_error}", 60)
