"""Managed Agents in the admin, read-only: the remote sessions to end
(`sessions_app.managed_sessions`), what was archived or deleted at Anthropic and what the
provider refused; and the files sessions produced, copied here (`sessions_app.managed_outputs`)."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import FileResponse, Http404
from django.template.defaultfilters import filesizeformat
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from sessions_app.admin.common import LargeTableAdmin, admin_link, admin_time, agent_long_columns, short_text
from sessions_app.managed_outputs import output_delete, output_path
from sessions_app.models import ManagedOutput, ManagedSessionEnd

OUTPUTS_SHOWN = 50


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


def output_download_link(output: ManagedOutput) -> str:
    if not output.stored:
        return format_html("{} (not copied: {})", output.filename, output.skipped)
    url = reverse("admin:sessions_app_managedoutput_download", args=[output.pk])
    return format_html('<a href="{}">{}</a> ({})', url, output.filename, filesizeformat(output.size_bytes))


def managed_outputs_html(outputs: QuerySet) -> str:
    """A session page's list of its outputs (the newest few, with the full list one click away)."""
    rows = list(outputs.order_by("-created_at", "-id")[: OUTPUTS_SHOWN + 1])
    if not rows:
        return "-"
    links = format_html_join(
        mark_safe("<br>"), "{}", ((output_download_link(output),) for output in rows[:OUTPUTS_SHOWN])
    )
    if len(rows) > OUTPUTS_SHOWN:
        more = reverse("admin:sessions_app_managedoutput_changelist") + f"?session_id={rows[0].session_id}"
        links = format_html('{}<br><a href="{}">all of them</a>', links, more)
    return links


@admin.register(ManagedOutput)
class ManagedOutputAdmin(LargeTableAdmin):
    """The files Managed Agents sessions produced, copied here before each remote session
    ended. The service writes these rows; an operator may delete one (and its file)."""

    list_display = ["download", "agent_link", "size", "created"]
    list_select_related = ["agent"]
    search_fields = ["filename", "remote_session_id", "file_id"]
    readonly_fields = [field.name for field in ManagedOutput._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def get_queryset(self, request):
        # The list names each output's agent: never the agent's prompt and configuration.
        queryset = super().get_queryset(request).select_related("agent")
        queryset = queryset.defer(*agent_long_columns())
        if session_id := request.GET.get("session_id"):
            queryset = queryset.filter(session_id=session_id)
        return queryset

    def lookup_allowed(self, lookup, value, request=None) -> bool:
        return lookup == "session_id" or super().lookup_allowed(lookup, value, request)

    @admin.display(description="file", ordering="filename")
    def download(self, obj: ManagedOutput) -> str:
        return output_download_link(obj)

    @admin.display(description="agent", ordering="agent__name")
    def agent_link(self, obj: ManagedOutput) -> str:
        return admin_link("admin:sessions_app_agent_change", obj.agent_id, short_text(obj.agent.name, 28))

    @admin.display(description="size", ordering="size_bytes")
    def size(self, obj: ManagedOutput) -> str:
        return filesizeformat(obj.size_bytes)

    @admin.display(description="copied", ordering="created_at")
    def created(self, obj: ManagedOutput) -> str:
        return admin_time(obj.created_at)

    def get_urls(self):
        download = self.admin_site.admin_view(self.download_view)
        return [
            path("<int:output_id>/download/", download, name="sessions_app_managedoutput_download"),
            *super().get_urls(),
        ]

    def download_view(self, request, output_id: int):
        output = ManagedOutput.objects.filter(pk=output_id).first()
        if output is None or not output.stored or not self.has_view_permission(request, output):
            raise Http404("No such output.")
        try:
            handle = output_path(output).open("rb")
        except FileNotFoundError:
            raise Http404("The copy of this file is missing from this host.") from None
        return FileResponse(
            handle, as_attachment=True, filename=output.filename, content_type="application/octet-stream"
        )

    def delete_queryset(self, request, queryset) -> None:
        for output in queryset:
            output_delete(output)

    def delete_model(self, request, obj) -> None:
        output_delete(obj)
