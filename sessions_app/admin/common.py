"""What the admin's pages share: the capped paginator, links, expiry wording, delete summaries,
the read-only inline, and the filters that more than one changelist uses.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import quote, unquote
from django.contrib.admin.widgets import AutocompleteSelect
from django.contrib.auth import get_permission_codename
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db import connection
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponseRedirect, QueryDict
from django.urls import reverse
from django.utils.formats import date_format
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.text import capfirst
from django.utils.timesince import timesince, timeuntil

from costs_app.money import usd
from sessions_app.adapters import ADAPTERS
from sessions_app.models import Agent, parse_uuid

RECENT_INLINE_ROWS = 10


def money_column(field: str, description: str):
    """A column (or read-only field) showing the money field `field` by costs_app.money's
    rule, where Django would print every decimal place of the column. Assign it in a
    ModelAdmin's body and name the attribute in list_display or fields."""

    @admin.display(description=description, ordering=field)
    def column(model_admin, obj) -> str:
        value = getattr(obj, field)
        return model_admin.get_empty_value_display() if value is None else usd(value)

    return column


class CappedCountPaginator(Paginator):
    """Counts at most `count_cap` rows instead of the whole (filtered) table.

    `SELECT COUNT(*) FROM (... LIMIT cap+1)` stops after cap+1 index entries, so a filtered
    changelist of a table with millions of rows stays fast. Past the cap, an unfiltered list
    on PostgreSQL shows the planner's estimate (pg_class.reltuples); otherwise the cap. The
    pages beyond it are reached by narrowing with filters or the date hierarchy.
    """

    count_cap = 10_000

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return len(queryset)
        if queryset.query.is_sliced:
            return queryset.count()
        capped = queryset.values("pk").order_by()[: self.count_cap + 1].count()
        if capped <= self.count_cap:
            return capped
        if connection.vendor == "postgresql" and not queryset.query.where:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
                    [queryset.model._meta.db_table],
                )
                row = cursor.fetchone()
            if row and row[0] > self.count_cap:
                return int(row[0])
        return self.count_cap


class ApiIdsInUrls:
    """Admin pages of a row opened by the id the API shows: a session's `sess_...` id, or a
    UUID spelled another way (no dashes, capitals). Answered with a redirect to the row's own
    URL, so what an operator pastes from an API answer or a log line opens the row."""

    def parse_api_id(self, object_id: str):
        return parse_uuid(object_id)

    def get_object(self, request, object_id, from_field=None):
        parsed = self.parse_api_id(object_id) if from_field is None else None
        return super().get_object(request, str(parsed) if parsed else object_id, from_field)

    def redirect_to_row(self, request: HttpRequest, view: str, object_id: str) -> HttpResponseRedirect | None:
        # The id as it came in the URL: the admin's unquote() would read the "_22" of a
        # `sess_22...` id as an escaped quote mark.
        parsed = self.parse_api_id(object_id)
        if parsed is None or str(parsed) == object_id:
            return None
        opts = self.model._meta
        url = reverse(f"admin:{opts.app_label}_{opts.model_name}_{view}", args=[quote(str(parsed))])
        query = request.META.get("QUERY_STRING", "")
        return HttpResponseRedirect(f"{url}?{query}" if query else url)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        redirect = self.redirect_to_row(request, "change", object_id)
        return redirect or super().change_view(request, object_id, form_url, extra_context)

    def delete_view(self, request, object_id, extra_context=None):
        redirect = self.redirect_to_row(request, "delete", object_id)
        return redirect or super().delete_view(request, object_id, extra_context)

    def history_view(self, request, object_id, extra_context=None):
        redirect = self.redirect_to_row(request, "history", object_id)
        return redirect or super().history_view(request, object_id, extra_context)


class IdCheckedAutocompleteSelect(AutocompleteSelect):
    """Django's search box for a related row, given a value that is no id of it.

    The form refuses such a value as an invalid choice, but to show the form again the
    widget looks the value up as an id of the related row (`?company=x` on an add page, a
    tampered POST), and a UUID column raised ValidationError there: a 500 instead of the
    form's error. The value is left out: the box shows no row chosen."""

    def optgroups(self, name, value, attr=None):
        remote = self.field.remote_field
        target = remote.model._meta.get_field(remote.field_name)
        return super().optgroups(name, [item for item in value if is_id_of(target, item)], attr)


def is_id_of(target, value) -> bool:
    try:
        target.to_python(value)
    except ValidationError:
        return False
    return True


class CheckedAutocompleteFields:
    """A ModelAdmin whose `autocomplete_fields` show a value that is no id without a 500
    (`IdCheckedAutocompleteSelect`)."""

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if "widget" not in kwargs and db_field.name in self.get_autocomplete_fields(request):
            kwargs["widget"] = IdCheckedAutocompleteSelect(db_field, self.admin_site, using=kwargs.get("using"))
        return super().formfield_for_foreignkey(db_field, request, **kwargs)


class LargeTableAdmin(admin.ModelAdmin):
    """For tables that grow without bound (sessions, runs, cost events): no exact count
    of the whole table and no facet counts, which would each scan it on every page."""

    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = CappedCountPaginator


def humane_expiry(expires_at: datetime | None, *, now: datetime) -> str:
    """'in 3 hours', 'expired 2 days ago', or 'never'."""
    if expires_at is None:
        return "never"
    if expires_at > now:
        return f"in {timeuntil(expires_at, now, depth=1)}"
    return f"expired {timesince(expires_at, now, depth=1)} ago"


def admin_time(value: datetime | None, *, zone=None) -> str:
    """A time as every admin page writes it (DATETIME_FORMAT: `2026-11-30 18:04 UTC`), in
    `zone` when given (an agent's own), else in UTC."""
    if value is None:
        return "-"
    return date_format(value.astimezone(zone or UTC), "DATETIME_FORMAT")


def short_text(text: str, length: int) -> str:
    """`text` cut to `length` characters for a list column, the whole of it in the tooltip
    (and on the row's own page)."""
    if len(text) <= length:
        return text
    return format_html('<span title="{}">{}…</span>', text, text[: length - 1])


def tokens_text(count: int | None) -> str:
    """A token count as a list column shows it: 950, 12.3k, 1.2M."""
    if count is None:
        return "-"
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if abs(count) >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def tokens_in_out(input_tokens: int | None, output_tokens: int | None, *, detail: str = "") -> str:
    """`12.3k / 950`: what went in and what came out, exact figures in the tooltip."""
    if input_tokens is None and output_tokens is None:
        return "-"
    title = f"{input_tokens or 0} in, {output_tokens or 0} out{detail}"
    return format_html('<span title="{}">{} / {}</span>', title, tokens_text(input_tokens), tokens_text(output_tokens))


def is_changelist(request: HttpRequest) -> bool:
    match = request.resolver_match
    return bool(match and match.url_name and match.url_name.endswith("_changelist"))


def is_autocomplete(request: HttpRequest) -> bool:
    """A form's search for a related row (`autocomplete_fields`): twenty names a page."""
    match = request.resolver_match
    return bool(match and match.url_name == "autocomplete")


def admin_link(viewname: str, object_id, text: str) -> str:
    return format_html('<a href="{}">{}</a>', reverse(viewname, args=[object_id]), text)


def changelist_url(model, **filters) -> str:
    url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    return f"{url}?{urlencode(filters)}" if filters else url


def deletion_summary(model_admin: admin.ModelAdmin, objs, request: HttpRequest, related: list[QuerySet]):
    """The delete confirmation's (to_delete, model_count, perms_needed, protected), by counts.

    Django's default lists every cascaded row, loading each one: for an agent that means
    every session with its history. One COUNT per related table says as much.
    """
    objs = list(objs)
    opts = model_admin.model._meta
    counts = {opts.verbose_name_plural: len(objs)}
    lines = []
    perms_needed = set()
    for queryset in related:
        related_opts = queryset.model._meta
        count = queryset.count()
        if not count:
            continue
        counts[related_opts.verbose_name_plural] = count
        lines.append(f"{count} {related_opts.verbose_name if count == 1 else related_opts.verbose_name_plural}")
        if model_admin.admin_site.is_registered(queryset.model) and not request.user.has_perm(
            f"{related_opts.app_label}.{get_permission_codename('delete', related_opts)}"
        ):
            # The model permission, not the related admin's: a read-only admin (alert
            # deliveries) refuses deleting a record from its own list, not with its parent,
            # as the API's DELETE of the parent removes it too.
            perms_needed.add(related_opts.verbose_name)
    to_delete = []
    for obj in objs:
        to_delete.append(f"{capfirst(opts.verbose_name)}: {obj}")
    to_delete.append(lines)
    return to_delete, counts, perms_needed, []


class CountedDeletion:
    """A delete confirmation by counts (`deletion_summary`) instead of Django's listing of
    every cascaded row. `deleted_with`: what goes with the selected rows, one query each."""

    def deleted_with(self, ids: list) -> list[QuerySet]:
        return []

    def get_deleted_objects(self, objs, request):
        objs = list(objs)
        return deletion_summary(self, objs, request, self.deleted_with([obj.pk for obj in objs]))


class ReadOnlyInline(admin.TabularInline):
    """The newest rows of a related list, for reading; the full list is one link away."""

    extra = 0
    max_num = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def recent(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        # The formset filters by the parent itself but cannot slice; restrict to the newest
        # rows with a LIMITed subquery on the parent's id (uses the (agent, -time) index).
        object_id = request.resolver_match.kwargs.get("object_id") if request.resolver_match else None
        if object_id is None:
            return queryset.none()
        newest = (
            self.model._default_manager.filter(agent_id=unquote(object_id))
            .order_by(*self.model._meta.ordering)
            .values("pk")[:RECENT_INLINE_ROWS]
        )
        return queryset.filter(pk__in=newest)


def adapter_choices() -> list[tuple[str, str]]:
    return [(name, name) for name in sorted(ADAPTERS)]


# An agent's columns a list that names the agent never shows: each may be kilobytes.
AGENT_LONG_COLUMNS = ("system_prompt", "adapter_config", "managed_remote")


def agent_long_columns(path: str = "agent") -> list[str]:
    """`AGENT_LONG_COLUMNS` as reached from a list's model (`defer(*agent_long_columns())`)."""
    return [f"{path}__{name}" for name in AGENT_LONG_COLUMNS]


# A sidebar lists this many agents (companies) at most: thousands would be read and rendered
# on every page.
AGENT_CHOICES_CAP = 50
COMPANY_CHOICES_CAP = 50


def filter_spellings(field_path: str, target: str = "id") -> list[str]:
    """The parameters that choose a row of a capped filter: Django's own, the relation's name
    (what the admin's links write) and the id box's."""
    return [f"{field_path}__{target}__exact", field_path, f"{field_path}_id"]


def newest_by_name(rows: QuerySet, cap: int) -> tuple[list[tuple], bool]:
    """The newest `cap` of `rows` (a model with `created_at` and `name`) as (pk, name), by
    name; and whether there are more."""
    newest = list(rows.order_by("-created_at", "-pk").values_list("pk", "name")[: cap + 1])
    listed = sorted(newest[:cap], key=lambda choice: (choice[1].casefold(), choice[1], str(choice[0])))
    return listed, len(newest) > cap


class CappedRelatedFilter(admin.RelatedFieldListFilter):
    """The rows of a related table in a list's sidebar by id and name, at most `cap` of them.

    Django's default reads every row of the related table, whole, on every page. Up to the
    cap every row is listed, by name; past it the newest are, with a box that filters by any
    row's id (`?{field_path}_id=`). The relation's name (`?{field_path}=`) filters too, and
    the row chosen shows as selected however it was spelled. The related model needs
    `created_at` and `name`; `noun` names it in the box and in the message a malformed id
    gets.
    """

    template = "admin/capped_filter.html"
    cap: int
    noun: str
    article = "a"

    def __init__(self, field, request, params, model, model_admin, field_path):
        lookup_kwarg, relation, self.id_parameter = filter_spellings(field_path, field.target_field.name)
        self.aliases = [relation, self.id_parameter]
        given = [value for name in (lookup_kwarg, *self.aliases) for value in params.pop(name, [])]
        if chosen := self.ids_given(request, given):
            params[lookup_kwarg] = chosen
        self.more_rows = False
        self.hidden_params: list[tuple[str, str]] = []
        super().__init__(field, request, params, model, model_admin, field_path)

    @property
    def chosen_id(self) -> str:
        return self.lookup_val[0] if self.lookup_val else ""

    def has_output(self) -> bool:
        # A chosen row filters even where there is no choice to offer (one row).
        return bool(self.lookup_val) or self.more_rows or super().has_output()

    def scoped(self, request: HttpRequest, rows: QuerySet) -> QuerySet:
        """The rows the sidebar chooses among: all of them unless a subclass narrows them."""
        return rows

    def field_choices(self, field, request, model_admin):
        listed, self.more_rows = newest_by_name(
            self.scoped(request, field.related_model._default_manager.all()), self.cap
        )
        return listed + self.chosen_unlisted(field, listed)

    def chosen_unlisted(self, field, listed) -> list[tuple]:
        """The chosen rows the capped list left out, so that they show as selected."""
        missing = set(self.lookup_val or ()) - {str(pk) for pk, _ in listed}
        if not missing:
            return []
        return list(field.related_model._default_manager.filter(pk__in=missing).values_list("pk", "name"))

    def choices(self, changelist):
        # Any link of the filter replaces the row chosen, however it was spelled.
        changelist = AliasesRemoved(changelist, self.aliases)
        kept = changelist.get_query_string(remove=[self.lookup_kwarg, self.lookup_kwarg_isnull])
        self.hidden_params = [(name, value) for name, values in QueryDict(kept[1:]).lists() for value in values]
        yield from super().choices(changelist)

    def ids_given(self, request: HttpRequest, values: list[str]) -> list[str]:
        """The ids given to the filter, as the database stores them. One that is no UUID is
        said in a message; the list is then shown whole (Django's redirect to `?e=1`)."""
        ids = []
        for value in filter(None, (value.strip() for value in values)):
            parsed = parse_uuid(value)
            if parsed is None:
                messages.error(
                    request,
                    f"The {self.noun} filter takes {self.article} {self.noun}'s id (a UUID): "
                    f"“{value[:80]}” is not one. Showing the whole list.",
                )
                raise IncorrectLookupParameters(value)
            ids.append(str(parsed))
        return list(dict.fromkeys(ids))


class AgentFilter(CappedRelatedFilter):
    """The agents of a list's sidebar (CappedRelatedFilter), counted and listed in the company
    filtered, if one is. The agent's page links with `?agent=`."""

    cap = AGENT_CHOICES_CAP
    noun = "agent"
    article = "an"

    def scoped(self, request, rows):
        company_id = self.company_filtered(request)
        return rows.filter(company_id=company_id) if company_id else rows

    def company_filtered(self, request: HttpRequest):
        # Read from the query string, however the company filter's spellings chose it: that
        # filter has taken its parameters from the changelist's by now, or is not on the list.
        company_path = f"{self.field_path.removesuffix('agent')}company"
        given = [value for name in filter_spellings(company_path) for value in request.GET.getlist(name)]
        chosen = {parse_uuid(value) for value in given if value.strip()}
        return chosen.pop() if len(chosen) == 1 else None


class CompanyFilter(CappedRelatedFilter):
    """The companies of a list's sidebar (CappedRelatedFilter)."""

    cap = COMPANY_CHOICES_CAP
    noun = "company"


class CappedFilterIds:
    """A ModelAdmin whose capped filters reach across a relation (`store__agent`). Django
    refuses a lookup through two relations that list_filter does not name, with a 400 before
    any filter sees the parameters: the id box's `?store__agent_id=` among them."""

    def lookup_allowed(self, lookup, value, request=None) -> bool:
        id_boxes = {
            filter_spellings(entry[0])[-1]
            for entry in self.list_filter
            if isinstance(entry, tuple) and issubclass(entry[1], CappedRelatedFilter)
        }
        return lookup in id_boxes or super().lookup_allowed(lookup, value, request)


class AliasesRemoved:
    """A changelist whose query strings also drop the given parameters."""

    def __init__(self, changelist, names: list[str]) -> None:
        self.changelist, self.names = changelist, names

    def __getattr__(self, name):
        return getattr(self.changelist, name)

    def get_query_string(self, new_params=None, remove=None) -> str:
        return self.changelist.get_query_string(new_params, [*(remove or []), *self.names])


class ModelNameFilter(admin.SimpleListFilter):
    """Models named by agents or prices: two small tables, never a DISTINCT over the big one."""

    title = "model"
    parameter_name = "model"

    def lookups(self, request, model_admin):
        from costs_app.models import ModelPrice

        names = set(ModelPrice.objects.order_by().values_list("model", flat=True).distinct())
        # One row per model, not per agent (nor sorted by the agents' names): the sidebar of
        # every sessions and ledger page runs this.
        models = Agent.objects.order_by().values_list("adapter_config__model", flat=True).distinct()
        names |= {name for name in models if isinstance(name, str)}
        return [(name, name) for name in sorted(names) if name]

    def queryset(self, request, queryset):
        return queryset.filter(model=self.value()) if self.value() else queryset
