"""Credential holds (`sessions_app.quota`): read-only, the record of what a provider refused."""

from __future__ import annotations

from django.contrib import admin

from sessions_app.models import CredentialHold


@admin.register(CredentialHold)
class CredentialHoldAdmin(admin.ModelAdmin):
    """Each credential a provider's quota refused, by its fingerprint: held until when and
    why, or released. The service writes these rows; an operator reads them."""

    list_display = ["credential", "held_until", "code", "reason", "refusals", "held_at", "released_at"]
    list_filter = ["code"]
    readonly_fields = [field.name for field in CredentialHold._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
