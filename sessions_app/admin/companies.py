"""Companies. Deleting one goes through its agents' delete, so their history files go too."""

from __future__ import annotations

from django.contrib import admin
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from sessions_app import services
from sessions_app.admin.common import ApiIdsInUrls, CountedDeletion, is_autocomplete
from sessions_app.models import Agent, AgentSession, ApiKey, Company, HeartbeatRun, SessionCompaction


@admin.register(Company)
class CompanyAdmin(CountedDeletion, ApiIdsInUrls, admin.ModelAdmin):
    list_display = ["name", "id", "agent_count", "created_at"]
    search_fields = ["name", "=id"]
    readonly_fields = ["id", "created_at"]

    def get_queryset(self, request):
        if is_autocomplete(request):
            return super().get_queryset(request).only("id", "name")  # a form choosing a company
        return super().get_queryset(request).annotate(agent_total=Count("agents"))

    @admin.display(description="agents", ordering="agent_total")
    def agent_count(self, obj: Company) -> int:
        return obj.agent_total

    def deleted_with(self, ids):
        return [
            Agent.objects.filter(company_id__in=ids),
            AgentSession.objects.filter(company_id__in=ids),
            SessionCompaction.objects.filter(session__company_id__in=ids),
            HeartbeatRun.objects.filter(company_id__in=ids),
            ApiKey.objects.filter(company_id__in=ids),
        ]

    def delete_model(self, request, obj):
        self.delete_queryset(request, Company.objects.filter(pk=obj.pk))

    def delete_queryset(self, request, queryset):
        # Through the agents' delete, so their sessions' history files go too (a plain
        # cascade would leave them on disk). The cost ledger stays, as for agents.
        with transaction.atomic():
            services.agents_hard_delete(agents=Agent.objects.filter(company__in=queryset), now=timezone.now())
            queryset.delete()
