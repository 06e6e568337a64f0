"""Agents' memory in the admin: files with their versions and diffs, edited by operators.

Every change an operator makes goes through `memory_app.stores` as the tool's do: an edit
is a version (written by the operator), refused when the file moved on since the form was
loaded; "revert to this version" writes that version's content back as a new version; a
delete is a version too.
"""

from __future__ import annotations

import difflib

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.forms.models import BaseInlineFormSet
from django.http import Http404, HttpResponseRedirect
from django.urls import path, reverse
from django.utils.formats import date_format
from django.utils.html import format_html, format_html_join

from memory_app.models import MemoryFile, MemoryStore, MemoryStoreShare, MemoryVersion
from memory_app.stores import MemoryFault, Mount, Writer, check_content, clean_path, file_write, version_revert
from sessions_app.adapters.tool_config import STORE_NAME
from sessions_app.admin.common import (
    AgentFilter,
    CappedFilterIds,
    CheckedAutocompleteFields,
    CompanyFilter,
    CountedDeletion,
    agent_long_columns,
    is_changelist,
)
from sessions_app.models import Agent, AgentStatus
from sessions_app.text import holds_unstorable

MAX_DIFF_LINES = 400


def writable_mount(store: MemoryStore) -> Mount:
    # An operator edits any store of the company the admin shows; sharing limits agents only.
    return Mount(store, "", writable=True, owned=True)


def operator(request) -> str:
    return f"admin {request.user.get_username()}"


def diff_html(before: str | None, after: str | None):
    """A unified diff, each line coloured by what it does."""
    lines = list(
        difflib.unified_diff(
            (before or "").splitlines(), (after or "").splitlines(), "before", "after", lineterm="", n=2
        )
    )[2:MAX_DIFF_LINES]
    if not lines:
        return format_html("<em>{}</em>", "no change in content")
    colours = {"+": "#1b5e20", "-": "#b71c1c", "@": "#555"}
    return format_html(
        '<pre class="memory-diff" style="white-space:pre-wrap;margin:0">{}</pre>',
        format_html_join(
            "\n", '<span style="color:{}">{}</span>', ((colours.get(line[:1], "inherit"), line) for line in lines)
        ),
    )


def agent_memory_link(agent):
    """The agent page's link to its memory files (one COUNT query)."""
    count = MemoryFile.objects.filter(store__agent=agent, deleted=False).count()
    url = reverse("admin:memory_app_memoryfile_changelist") + f"?store__agent__id__exact={agent.pk}&deleted__exact=0"
    return format_html('<a class="memory-files" href="{}">{} memory file{}</a>', url, count, "" if count == 1 else "s")


class MemoryFileForm(forms.ModelForm):
    content = forms.CharField(widget=forms.Textarea(attrs={"rows": 16, "cols": 100}), required=False, strip=False)
    loaded_version = forms.IntegerField(widget=forms.HiddenInput, required=False)

    class Meta:
        model = MemoryFile
        fields = ["store", "path", "content"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.fields["loaded_version"].initial = self.instance.version

    def clean_path(self):
        value = self.cleaned_data["path"]
        try:
            return clean_path(f"/memories/{value.strip('/')}", directory_ok=False)
        except MemoryFault as fault:
            raise forms.ValidationError(fault.message) from None

    def clean_content(self):
        value = self.cleaned_data.get("content") or ""
        if holds_unstorable(value):
            raise forms.ValidationError("Memory files hold text without NUL characters.")
        return check_content(value)


@admin.register(MemoryFile)
class MemoryFileAdmin(CappedFilterIds, CountedDeletion, admin.ModelAdmin):
    form = MemoryFileForm
    list_display = ["path", "store_name", "agent", "size", "version", "deleted", "updated_at"]
    list_filter = ["deleted", ("store__company", CompanyFilter), ("store__agent", AgentFilter)]
    list_select_related = ["store__agent"]
    search_fields = ["path", "store__agent__name"]
    ordering = ["store__agent__name", "store__name", "path"]

    def get_queryset(self, request):
        queryset = super().get_queryset(request).select_related("store__agent")
        queryset = queryset.defer(*agent_long_columns("store__agent"))
        # The list shows no content: a page of 100 files is not 100 files' contents.
        return queryset.defer("content") if is_changelist(request) else queryset

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["store", "path", "content"]
        return ["store_name", "agent", "path", "version", "deleted", "updated_at", "content", "loaded_version"]

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return []
        return ["store_name", "agent", "path", "version", "deleted", "updated_at", "versions"]

    def get_fieldsets(self, request, obj=None):
        fieldsets = [(None, {"fields": self.get_fields(request, obj)})]
        if obj is not None:
            fieldsets.append(("Versions", {"fields": ["versions"]}))
        return fieldsets

    @admin.display(description="store", ordering="store__name")
    def store_name(self, obj: MemoryFile) -> str:
        return obj.store.name

    @admin.display(description="agent", ordering="store__agent__name")
    def agent(self, obj: MemoryFile) -> str:
        return obj.store.agent.name

    @admin.display(description="versions (newest first)")
    def versions(self, obj: MemoryFile):
        versions = list(obj.versions.order_by("-number"))
        rows = []
        for index, version in enumerate(versions):
            previous = versions[index + 1].content if index + 1 < len(versions) else None
            writer = f"run {version.run_id}" if version.run_id else (version.operator or version.written_by)
            revert_url = reverse("admin:memory_app_memoryfile_revert", args=[obj.pk, version.number])
            rows.append(
                (
                    version.number,
                    version.operation,
                    writer,
                    date_format(version.created_at, "DATETIME_FORMAT"),
                    diff_html(previous, version.content),
                    revert_url,
                    version.number,
                )
            )
        return format_html(
            '<table class="memory-versions"><thead><tr><th>#</th><th>operation</th><th>by</th><th>when</th>'
            "<th>diff from the previous version</th><th></th></tr></thead><tbody>{}</tbody></table>",
            format_html_join(
                "",
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
                # Inside the change form (forms do not nest): the button posts that form, with
                # its CSRF token, to the revert URL instead.
                '<td><button type="submit" class="memory-revert" formaction="{}" formnovalidate '
                'name="revert" value="{}">Revert to this version</button></td></tr>',
                rows,
            ),
        )

    def get_urls(self):
        revert = path(
            "<path:object_id>/revert/<int:number>/",
            self.admin_site.admin_view(self.revert_view),
            name="memory_app_memoryfile_revert",
        )
        return [revert, *super().get_urls()]

    def revert_view(self, request, object_id, number: int):
        if request.method != "POST":
            raise Http404("Revert with the form's button.")
        found = self.get_object(request, unquote(object_id))
        if found is None:
            raise Http404("No such memory file.")
        if not self.has_change_permission(request, found):
            raise PermissionDenied
        version = found.versions.filter(number=number).first()
        if version is None:
            messages.error(request, f"Version {number} is no longer kept.")
        else:
            try:
                version_revert(writable_mount(found.store), version, writer=Writer(operator=operator(request)))
                messages.success(request, f"Reverted {found.path} to version {number} (as a new version).")
            except MemoryFault as fault:
                messages.error(request, fault.message)
        return HttpResponseRedirect(reverse("admin:memory_app_memoryfile_change", args=[found.pk]))

    def save_model(self, request, obj, form, change):
        content = form.cleaned_data.get("content") or ""
        store = obj.store
        expected = form.cleaned_data.get("loaded_version") if change else None
        saved = file_write(
            writable_mount(store),
            obj.path,
            lambda current: content,
            operation="edit",
            writer=Writer(operator=operator(request)),
            expected_version=expected if change else None,
        )
        obj.pk, obj.version = saved.pk, saved.version

    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        try:
            return super().changeform_view(request, object_id, form_url, extra_context)
        except MemoryFault as fault:
            # A limit or a concurrent edit: nothing was written; the operator reads why.
            messages.error(request, fault.message)
            target = [object_id] if object_id else []
            name = "change" if object_id else "add"
            return HttpResponseRedirect(reverse(f"admin:memory_app_memoryfile_{name}", args=target))

    # A deletion is a version (below): the files' versions stay, so none is read or listed,
    # and the confirmation names only the files (`CountedDeletion` with nothing deleted with them).

    def delete_model(self, request, obj):
        self._delete(request, [obj])

    def delete_queryset(self, request, queryset):
        self._delete(request, list(queryset.select_related("store")))

    def _delete(self, request, files):
        # A deletion is a version: the file's row and history stay, marked deleted.
        for found in files:
            if found.deleted:
                continue
            file_write(
                writable_mount(found.store),
                found.path,
                lambda current: None,
                operation="delete",
                writer=Writer(operator=operator(request)),
            )


class ShareFormSet(BaseInlineFormSet):
    """The store's shares. Each form's agent is a choice among the store's company's agents
    (a share with any other would never be mounted), read once for the page: left to each
    form, the list was read again for every share, and listed every company's agents."""

    agent_choices: list | None = None

    def add_fields(self, form, index):
        super().add_fields(form, index)
        field = form.fields["agent"]
        if self.instance.company_id is not None:
            field.queryset = field.queryset.filter(company_id=self.instance.company_id)
        if self.agent_choices is None:
            self.agent_choices = list(field.choices)
        field.choices = self.agent_choices


class ShareInline(admin.TabularInline):
    model = MemoryStoreShare
    formset = ShareFormSet
    extra = 0
    autocomplete_fields = []
    fields = ["agent", "access"]

    def get_queryset(self, request):
        # A share's name is its store's (the row's title in the table).
        return super().get_queryset(request).select_related("store")


class MemoryStoreForm(forms.ModelForm):
    """A new store: of its agent's company (shares are checked against it, and an agent
    mounts only its company's stores), named as an agent's `memory` configuration can name
    it, for an agent not deleted (whose memory went with it)."""

    class Meta:
        model = MemoryStore
        fields = ["company", "agent", "name"]

    def clean_name(self):
        name = self.cleaned_data["name"]
        if not STORE_NAME.fullmatch(name):
            raise forms.ValidationError(
                "A store name is what an agent's memory configuration lists: lowercase letters, digits, "
                "'-' and '_', starting with a letter or a digit, at most 64 characters."
            )
        return name

    def clean(self):
        cleaned = super().clean()
        agent, company = cleaned.get("agent"), cleaned.get("company")
        if agent is None:
            return cleaned
        # Locked until the admin's transaction commits: retiring the agent meanwhile waits,
        # then deletes this store with the rest of its memory; retired first, it is seen here.
        with transaction.atomic():
            current = Agent.objects.select_for_update().filter(pk=agent.pk).values("status", "company_id").first()
        if current is None or current["status"] == AgentStatus.DELETED:
            self.add_error("agent", f"The agent {agent} was deleted, and its memory with it.")
        elif company is not None and company.pk != current["company_id"]:
            self.add_error("company", f"{agent} is an agent of {agent.company}, not of {company}.")
        return cleaned


@admin.register(MemoryStore)
class MemoryStoreAdmin(CheckedAutocompleteFields, CountedDeletion, admin.ModelAdmin):
    form = MemoryStoreForm
    list_display = ["name", "agent", "company", "bytes_used", "files_link"]
    list_filter = [("company", CompanyFilter)]
    list_select_related = ["agent", "company"]
    search_fields = ["name", "agent__name"]
    autocomplete_fields = ["company", "agent"]  # search boxes, not lists of every company and agent
    fields = ["company", "agent", "name", "bytes_used"]
    readonly_fields = ["bytes_used"]
    inlines = [ShareInline]

    def get_queryset(self, request):
        # The list names each store's agent: never the agent's prompt and configuration.
        queryset = super().get_queryset(request)
        return queryset.defer(*agent_long_columns()) if is_changelist(request) else queryset

    def get_readonly_fields(self, request, obj=None):
        return ["company", "agent", "name", "bytes_used"] if obj is not None else ["bytes_used"]

    def get_inlines(self, request, obj):
        # A share's agent is one of the store's company's: before the store has one, the
        # choice would list every company's agents. Shares are added on the store's page.
        return self.inlines if obj is not None else []

    def deleted_with(self, ids):
        # Counted: Django's default loads every file and every version, contents and all.
        return [
            MemoryFile.objects.filter(store_id__in=ids),
            MemoryVersion.objects.filter(file__store_id__in=ids),
            MemoryStoreShare.objects.filter(store_id__in=ids),
        ]

    @admin.display(description="files")
    def files_link(self, obj: MemoryStore):
        url = reverse("admin:memory_app_memoryfile_changelist") + f"?store__agent__id__exact={obj.agent_id}"
        return format_html('<a href="{}">files</a>', url)

    def save_formset(self, request, form, formset, change):
        # A share with an agent of another company would never be mounted; refuse it here.
        for share_form in formset.forms:
            agent = share_form.cleaned_data.get("agent") if hasattr(share_form, "cleaned_data") else None
            if agent is not None and agent.company_id != form.instance.company_id:
                messages.error(request, f"{agent} is not an agent of {form.instance.company}; not shared.")
                share_form.cleaned_data["DELETE"] = True
                if share_form.instance.pk is None:
                    formset.forms.remove(share_form)
        super().save_formset(request, form, formset, change)
