from django.contrib import admin

from costs_app.models import CostEvent, ModelPrice


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    list_display = [
        "model",
        "effective_from",
        "input_usd_per_mtok",
        "output_usd_per_mtok",
        "cache_write_5m_usd_per_mtok",
        "cache_write_1h_usd_per_mtok",
        "cache_read_usd_per_mtok",
    ]
    list_filter = ["model"]


@admin.register(CostEvent)
class CostEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "kind", "model", "agent_id", "input_tokens", "output_tokens", "cost_usd", "unpriced"]
    list_filter = ["kind", "unpriced", "model"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
