from django.contrib import admin

from sessions_app.models import Agent, AgentSession, ApiKey, Company, HeartbeatRun


@admin.register(Company)
class CompanyAdmin(admin.ModelAdmin):
    list_display = ["name", "id", "created_at"]
    search_fields = ["name", "=id"]


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    list_display = ["name", "company", "adapter_type", "status", "updated_at"]
    list_filter = ["status", "adapter_type"]
    list_select_related = ["company"]
    search_fields = ["name", "=id"]


@admin.register(AgentSession)
class AgentSessionAdmin(admin.ModelAdmin):
    list_display = ["public_id", "agent", "status", "message_count", "last_used", "expires_at"]
    list_filter = ["status", "store"]
    list_select_related = ["agent"]
    exclude = ["history"]
    readonly_fields = ["message_count", "store", "created_at"]


@admin.register(HeartbeatRun)
class HeartbeatRunAdmin(admin.ModelAdmin):
    list_display = ["id", "agent", "status", "trigger", "created_at", "finished_at", "cost_usd"]
    list_filter = ["status", "trigger"]
    list_select_related = ["agent"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "company", "created_at", "last_used_at", "revoked_at"]
    list_select_related = ["company"]
