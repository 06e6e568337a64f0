"""API keys: created here, where the plaintext is shown once and never stored, and revoked."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.utils import timezone
from django.utils.html import format_html

from sessions_app.admin.common import CheckedAutocompleteFields, CompanyFilter
from sessions_app.api_keys import api_key_create, api_key_revoke
from sessions_app.models import ApiKey


class ApiKeyAddForm(forms.ModelForm):
    class Meta:
        model = ApiKey
        fields = ["company", "name"]


@admin.register(ApiKey)
class ApiKeyAdmin(CheckedAutocompleteFields, admin.ModelAdmin):
    list_display = ["prefix", "name", "company", "is_active", "created_at", "last_used_at", "revoked_at"]
    list_filter = [("company", CompanyFilter)]
    list_select_related = ["company"]
    search_fields = ["prefix", "name"]
    autocomplete_fields = ["company"]  # a search box, not a list of every company
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
        # Revocation goes through the action and is final: a leaked key that an operator
        # revoked must not come back by clearing a date field.
        return ["company", "prefix", "created_at", "last_used_at", "revoked_at"]

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
