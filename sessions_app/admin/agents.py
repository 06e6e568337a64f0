"""Agents: the configuration form, their recent sessions and runs, and the actions an operator
takes on them (pause, resume, retire, delete, a heartbeat now).
"""

from __future__ import annotations

import json
import sys
from contextvars import ContextVar
from zoneinfo import ZoneInfo

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import models
from django.forms.fields import InvalidJSONInput
from django.forms.models import BaseInlineFormSet
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from costs_app.models import CostEvent
from memory_app.admin import agent_memory_link
from sessions_app import services
from sessions_app.adapters.claude_cli import workspace_listing
from sessions_app.admin.common import (
    AGENT_LONG_COLUMNS,
    RECENT_INLINE_ROWS,
    ApiIdsInUrls,
    CheckedAutocompleteFields,
    CompanyFilter,
    CountedDeletion,
    ReadOnlyInline,
    adapter_choices,
    admin_link,
    admin_time,
    changelist_url,
    humane_expiry,
    is_autocomplete,
    is_changelist,
    money_column,
    short_text,
)
from sessions_app.agent_health import agent_health, config_problem, facts_of, with_health_facts
from sessions_app.keep_warm import keep_warm_report, keep_warm_summary
from sessions_app.model_checks import agent_model_info, model_warning
from sessions_app.models import (
    LIVE_SESSION_STATUSES,
    MAX_PINS_PER_AGENT,
    Agent,
    AgentSession,
    AgentStatus,
    HealthState,
    HeartbeatRun,
    PinnedFact,
    RunTrigger,
    SessionCompaction,
)
from sessions_app.quota import holds_now
from sessions_app.schedules import agent_next_wakes, agent_schedule_sync
from sessions_app.text import holds_unstorable
from sessions_app.wakes import HeartbeatPlan
from sessions_app.work_checks import agent_backoff

DEFAULT_HEARTBEAT_TASK = "Heartbeat started by an operator from the admin."
# Listed by name in an action's message up to this many; the rest are counted.
NAMED_IN_MESSAGES = 10
# The list's model, session mode, back-off and health columns are read from the
# configuration; the other long columns are shown on the agent's page only.
LIST_DEFERRED_COLUMNS = [name for name in AGENT_LONG_COLUMNS if name != "adapter_config"]


def config_unreadable(agent: Agent) -> bool:
    """A stored configuration that is not a JSON object (written by SQL or an older
    version). Agent's properties and the schedule's sync read it with .get(), so the pages
    show it without them and the actions that run through them skip the agent: an operator
    corrects it on the agent's page (validation refuses it there) or deletes the agent."""
    return not isinstance(agent.adapter_config, dict)


def named(agents: list[Agent], *, with_status: bool = False) -> str:
    shown = [f"{agent.name} ({agent.status})" if with_status else agent.name for agent in agents[:NAMED_IN_MESSAGES]]
    more = len(agents) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


class PrettyJSONField(forms.JSONField):
    """A JSON object edited as indented text, so a configuration reads like the docs."""

    # Django catches JSONDecodeError only; JSON nested past the parser's depth raises
    # RecursionError, and an integer longer than Python converts (sys.get_int_max_str_digits,
    # 4300 digits) a plain ValueError: either would be a 500.
    def to_python(self, value):
        try:
            return super().to_python(value)
        except RecursionError:
            raise ValidationError(self.error_messages["invalid"], code="invalid", params={"value": value}) from None
        except ValueError:
            # json.loads raises no other ValueError than JSONDecodeError (caught by Django).
            raise ValidationError(
                "Enter a valid JSON: a number has more than %(digits)s digits.",
                code="invalid",
                params={"value": value, "digits": sys.get_int_max_str_digits()},
            ) from None

    def bound_data(self, data, initial):
        try:
            return super().bound_data(data, initial)
        except (RecursionError, ValueError):
            return InvalidJSONInput(data)

    def prepare_value(self, value):
        if isinstance(value, InvalidJSONInput):
            return value
        # A lone surrogate cannot go out in a UTF-8 page; escaped, the operator sees what to fix.
        escape = holds_unstorable(value)
        return json.dumps(value, indent=2, ensure_ascii=escape, sort_keys=True, cls=self.encoder)


class AgentAdminForm(forms.ModelForm):
    adapter_type = forms.ChoiceField(choices=adapter_choices)
    adapter_config = PrettyJSONField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 10, "cols": 70, "class": "vLargeTextField", "spellcheck": "false"}),
        help_text=(
            'A JSON object, e.g. {"session_mode": "persistent", "session_ttl_hours": 24}, and for Claude '
            '"model": a model of the catalogue (Costs > Model catalogue; unset: the default model). '
            "Defaults are filled in when saved; unknown keys are refused. "
            'Scheduled heartbeats: "heartbeat_interval_minutes": 60, or "heartbeat_cron": "0 9 * * 1-5" '
            'with "heartbeat_timezone": "Europe/Berlin". Heartbeats without work: "work_check": '
            '{"command": "has-work"} or {"url": "https://..."}, "nothing_to_do_marker": "NOTHING_TO_DO".'
        ),
    )

    class Meta:
        model = Agent
        fields = ["company", "name", "system_prompt", "adapter_type", "adapter_config"]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Staff choose among the operator's commands like API keys do; the list itself is
        # the deployment's (PAPERCLIP_PROCESS_COMMANDS), so no web login can widen it.
        # (The admin renders help text as HTML; names are letters, digits, '.', '_', '-'.)
        if names := sorted(settings.PAPERCLIP_PROCESS_COMMANDS):
            listed = f"A process agent names one of the listed commands: {', '.join(names)}."
            self.fields["adapter_config"].help_text += f" {listed}"

    def clean_adapter_config(self):
        value = self.cleaned_data.get("adapter_config")
        return {} if value is None else value

    # Agent.clean() (run by the ModelForm) raises AgentConfigError, a ValidationError keyed
    # by "adapter_config" / "adapter_type": both are fields here, so Django shows them as
    # field errors next to the textarea instead of a 500.


class HeartbeatForm(forms.Form):
    task = forms.CharField(widget=forms.Textarea(attrs={"rows": 6, "cols": 80}), initial=DEFAULT_HEARTBEAT_TASK)


class PinnedFactsFormSet(BaseInlineFormSet):
    """The API's limit of pinned facts per agent. `max_num` only limits the forms the page
    offers: a post with more forms (TOTAL_FORMS raised by hand), or new forms beside pins
    the post leaves out, saved them all past it."""

    def clean(self) -> None:
        super().clean()
        kept = set()
        if self.instance.pk is not None:
            kept = set(PinnedFact.objects.filter(agent_id=self.instance.pk).values_list("pk", flat=True))
        kept -= {form.instance.pk for form in self.deleted_forms}
        deleted = set(self.deleted_forms)
        added = sum(1 for form in self.extra_forms if form.has_changed() and form not in deleted)
        if len(kept) + added > MAX_PINS_PER_AGENT:
            raise ValidationError(
                f"An agent has at most {MAX_PINS_PER_AGENT} pinned facts: this would make {len(kept) + added}. "
                "Delete some first."
            )


class PinnedFactsInline(admin.TabularInline):
    """The agent's pinned facts, edited in place: every summary of its sessions keeps them."""

    model = PinnedFact
    formset = PinnedFactsFormSet
    fk_name = "agent"
    fields = ["text", "created_at"]
    readonly_fields = ["created_at"]
    extra = 1
    max_num = MAX_PINS_PER_AGENT
    verbose_name = "pinned fact"
    verbose_name_plural = (
        "pinned facts: every summary of this agent's sessions must keep them verbatim (or carries them after it)"
    )
    formfield_overrides = {models.TextField: {"widget": forms.Textarea(attrs={"rows": 2, "cols": 80})}}


class RecentSessionsInline(ReadOnlyInline):
    model = AgentSession
    fk_name = "agent"
    verbose_name_plural = f"recent sessions (newest {RECENT_INLINE_ROWS})"
    fields = readonly_fields = [
        "status",
        "message_count",
        "last_used",
        "expires",
        "last_input_tokens",
        "total_cost",
    ]

    def get_queryset(self, request):
        return self.recent(request, super().get_queryset(request).defer("history"))

    @admin.display(description="expires")
    def expires(self, obj: AgentSession) -> str:
        return humane_expiry(obj.expires_at, now=timezone.now())

    total_cost = money_column("total_cost_usd", "total cost (USD)")


class RecentRunsInline(ReadOnlyInline):
    model = HeartbeatRun
    fk_name = "agent"
    verbose_name_plural = f"recent runs (newest {RECENT_INLINE_ROWS})"
    fields = readonly_fields = [
        "status",
        "trigger",
        "created_at",
        "finished_at",
        "input_tokens",
        "output_tokens",
        "cost",
        "error_code",
    ]
    cost = money_column("cost_usd", "cost (USD)")

    def get_queryset(self, request):
        # The columns shown, and nothing of the long texts or a batch run's whole request.
        shown = [name for name in self.fields if name != "cost"] + ["id", "agent_id", "cost_usd"]
        return self.recent(request, super().get_queryset(request).only(*shown))


HELD_CREDENTIALS: ContextVar[frozenset] = ContextVar("held_credentials", default=frozenset())


@admin.register(Agent)
class AgentAdmin(CheckedAutocompleteFields, CountedDeletion, ApiIdsInUrls, admin.ModelAdmin):
    form = AgentAdminForm
    list_display = [
        "name",
        "company_name",
        "adapter_type",
        "agent_model",
        "session_mode",
        "status_flag",
        "health",
        "backoff",
        "updated_at",
    ]
    list_filter = ["status", "paused_reason", "adapter_type", ("company", CompanyFilter)]
    list_select_related = ["company"]
    search_fields = ["name", "=id"]
    search_help_text = "Agent name, or its exact id."
    # A search box, not a list of every company (`CompanyAdmin` answers it twenty at a time).
    autocomplete_fields = ["company"]
    readonly_fields = ["id", "status", "paused_reason", "backoff", "created_at", "updated_at", "deleted_at"]
    inlines = [PinnedFactsInline, RecentSessionsInline, RecentRunsInline]
    actions = ["pause_agents", "resume_agents", "run_heartbeat_now", "retire_agents"]
    change_form_template = "admin/sessions_app/agent/change_form.html"

    def get_fields(self, request, obj=None):
        fields = ["company", "name", "system_prompt", "adapter_type", "adapter_config"]
        if obj is None:
            return fields
        workspace = ["workspace_files"] if not config_unreadable(obj) and obj.runs_claude_code_cli else []
        return [
            "id",
            *fields,
            "model_status",
            "next_wakes",
            "keep_warm",
            "backoff",
            "memory",
            *workspace,
            "status",
            "paused_reason",
            "created_at",
            "updated_at",
        ]

    def get_readonly_fields(self, request, obj=None):
        # Only the change page shows wake times: one schedule lookup for one agent. The company
        # is fixed once created, as in the API: moving the agent left its sessions, runs,
        # budget and memory stores in the old company (a store of another company is never
        # mounted, a budget of another company's agent never applies).
        return (
            [*self.readonly_fields, "company", "model_status", "next_wakes", "keep_warm", "memory", "workspace_files"]
            if obj is not None
            else self.readonly_fields
        )

    @admin.display(description="keep-warm")
    def keep_warm(self, obj: Agent) -> str:
        session = (
            AgentSession.objects.filter(agent=obj, status__in=LIVE_SESSION_STATUSES)
            .only("id", "keep_warm", "cache_refresh_at")
            .order_by("-last_used")
            .first()
        )
        return keep_warm_summary(keep_warm_report(session) if session is not None else None)

    @admin.display(description="workspace files")
    def workspace_files(self, obj: Agent) -> str:
        try:
            listing = workspace_listing(agent_id=obj.id, config=obj.adapter_config)
        except TypeError:
            # A stored `workspace` that is no path (written by SQL or an older version) made
            # the page a 500: the page where it is corrected.
            return f"unknown: the stored workspace is not a path ({obj.adapter_config.get('workspace')!r})"
        if listing.missing:
            return f"{listing.root} (not created yet: it is made by the first heartbeat)"
        rows = format_html_join(
            "",
            '<tr><td>{}</td><td style="text-align:right">{}</td><td>{}</td></tr>',
            ((f.name, f.size, admin_time(f.modified)) for f in listing.files),
        )
        more = f" (the first {len(listing.files)} shown)" if listing.truncated else ""
        return format_html(
            '<div class="workspace-files">{}: {} files{}<table><tr><th>name</th><th>bytes</th><th>modified</th></tr>'
            "{}</table></div>",
            listing.root,
            listing.count,
            more,
            rows,
        )

    @admin.display(description="model")
    def model_status(self, obj: Agent) -> str:
        """What the model catalogue says of the agent's model: its window, its largest
        answer and its lifecycle, a deprecation or retirement said out loud."""
        info = agent_model_info(obj.adapter_config)
        if info is None:
            return "none"
        if info["lifecycle"] == "unknown":
            return f"{info['model']}: not in the model catalogue (priced by an override, or saved before the check)"
        facts = ", ".join(
            part
            for part in (
                info["display_name"] or "",
                f"context window {info['max_input_tokens']:,} tokens" if info["max_input_tokens"] else "",
                f"answers up to {info['max_tokens']:,} tokens" if info["max_tokens"] else "",
                info["lifecycle"],
            )
            if part
        )
        if info["warning"]:
            return format_html(
                '{}: {} <strong class="model-warning" style="color:#ba2121">{}</strong>',
                info["model"],
                facts,
                info["warning"],
            )
        return f"{info['model']}: {facts}"

    @admin.display(description="memory")
    def memory(self, obj: Agent):
        return agent_memory_link(obj)

    @admin.display(description="next wakes")
    def next_wakes(self, obj: Agent) -> str:
        if problem := config_problem(obj.adapter_config):
            return f"unknown: {problem}"
        now = timezone.now()
        wakes = agent_next_wakes(agent=obj, now=now, count=5)
        if not wakes:
            return (
                "none: no heartbeat schedule"
                if obj.status == AgentStatus.ACTIVE
                else f"none: the agent is {obj.status}"
            )
        zone = ZoneInfo(HeartbeatPlan.of(obj.adapter_config).zone_name)
        return format_html_join(
            mark_safe("<br>"),
            '<span class="next-wake">{} {} <span class="quiet">({})</span>{}</span>',
            (
                (
                    wake.astimezone(zone).strftime("%a"),
                    admin_time(wake, zone=zone),
                    admin_time(wake),
                    # An interval schedule past its time (a cluster that is down) fires on the
                    # scheduler's next pass.
                    ": due, waiting for the task cluster" if wake <= now else "",
                )
                for wake in wakes
            ),
        )

    @admin.display(description="back-off", ordering="idle_streak")
    def backoff(self, obj: Agent) -> str:
        """The schedule's back-off, from the row alone (no query per agent in the list)."""
        if config_problem(obj.adapter_config):  # the health column says what it is
            return self.get_empty_value_display()
        factor = agent_backoff(obj.adapter_config, obj.idle_streak)
        streak = f"{obj.idle_streak} run(s) in a row without work"
        if factor == 1:
            return f"none ({streak})" if obj.idle_streak else "none"
        plan = HeartbeatPlan.of(obj.adapter_config)
        if plan is not None and plan.interval_minutes:
            stretched = f"every {plan.interval_minutes * factor} min instead of {plan.interval_minutes}"
        elif plan is not None:
            stretched = f"1 of every {factor} times of its cron expression"
        else:
            stretched = "no schedule to stretch"
        return format_html('<strong class="backoff">x{}</strong>: {} ({})', factor, stretched, streak)

    @admin.display(description="company", ordering="company__name")
    def company_name(self, obj: Agent) -> str:
        return short_text(obj.company.name, 28)

    # Not `model`: that is ModelAdmin's own attribute (the Agent class), which shadowed this
    # method and left the column empty, headed "Agent".
    @admin.display(description="model")
    def agent_model(self, obj: Agent) -> str:
        return self.get_empty_value_display() if config_unreadable(obj) else obj.model_name

    def get_queryset(self, request):
        if is_autocomplete(request):
            # A form choosing an agent (a budget's, a memory store's): its name, and never a
            # deleted one.
            return super().get_queryset(request).exclude(status=AgentStatus.DELETED).only("id", "name")
        # The health column's facts, for the whole page in the list's own query.
        queryset = with_health_facts(super().get_queryset(request))
        return queryset.defer(*LIST_DEFERRED_COLUMNS) if is_changelist(request) else queryset

    def changelist_view(self, request, extra_context=None):
        # The credentials held, read once for the page (the admin is shared by threads:
        # a context variable, set while the page renders).
        token = HELD_CREDENTIALS.set(frozenset(hold.credential for hold in holds_now()))
        try:
            response = super().changelist_view(request, extra_context)
            return response.render() if hasattr(response, "render") else response
        finally:
            HELD_CREDENTIALS.reset(token)

    @admin.display(description="health", ordering="health_state")
    def health(self, obj: Agent) -> str:
        found = agent_health(facts_of(obj, held_credentials=HELD_CREDENTIALS.get()), now=timezone.now())
        if found.config_invalid:
            # Said in the list itself: only an operator's correction brings the agent back.
            return format_html(
                '<strong class="config-invalid" style="color:#ba2121">{}: {}</strong>', found.state, found.reason
            )
        if found.state in (HealthState.DOWN, HealthState.FAILING):
            return format_html('<strong style="color:#ba2121" title="{}">{}</strong>', found.reason, found.state)
        return format_html('<span title="{}">{}</span>', found.reason, found.state)

    @admin.display(description="status", ordering="status")
    def status_flag(self, obj: Agent) -> str:
        if obj.paused_by_budget:
            # The one pause an operator must act on: raise the budget (or wait for the month).
            return format_html(
                '<strong class="budget-paused" style="color:#ba2121">{}</strong>', "paused: budget spent"
            )
        if obj.paused_reason:
            return f"{obj.status} ({obj.paused_reason})"
        return obj.status

    @admin.display(description="session mode")
    def session_mode(self, obj: Agent) -> str:
        return self.get_empty_value_display() if config_unreadable(obj) else obj.session_mode

    def get_urls(self):
        urls = [
            path(
                "<path:object_id>/heartbeat/",
                self.admin_site.admin_view(self.heartbeat_view),
                name="sessions_app_agent_heartbeat",
            ),
        ]
        return urls + super().get_urls()

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra_context = {
            **(extra_context or {}),
            "sessions_url": changelist_url(AgentSession, agent=unquote(object_id)),
            "runs_url": changelist_url(HeartbeatRun, agent=unquote(object_id)),
            "costs_url": changelist_url(CostEvent, agent=unquote(object_id)),
        }
        return super().change_view(request, object_id, form_url, extra_context)

    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):
        if obj is not None and request.method == "POST":
            # A refused form leaves its posted values on the agent, and the read-only fields
            # (model, next wakes, workspace files) would describe a configuration that was
            # never saved: one with a lone surrogate made the page a 500. The form itself
            # shows what was posted; these describe the agent as it is.
            stored = Agent.objects.filter(pk=obj.pk).values_list("adapter_type", "adapter_config").first()
            if stored is not None:
                obj.adapter_type, obj.adapter_config = stored
        # A deprecated or retired model is said at the top of the agent's page too.
        if obj is not None and request.method == "GET" and (warning := model_warning(obj.adapter_config)):
            self.message_user(request, warning, messages.WARNING)
        if obj is not None and request.method == "GET" and (problem := config_problem(obj.adapter_config)):
            self.message_user(
                request,
                f"The stored configuration of this agent no longer validates ({problem}): "
                "correct it below and save, or delete the agent.",
                messages.WARNING,
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        # A changed heartbeat_interval_minutes or heartbeat_cron moves the django-q2 schedule with it.
        agent_schedule_sync(agent=obj)

    def deleted_with(self, ids):
        return [
            AgentSession.objects.filter(agent_id__in=ids),
            SessionCompaction.objects.filter(session__agent_id__in=ids),
            HeartbeatRun.objects.filter(agent_id__in=ids),
        ]

    def delete_model(self, request, obj):
        services.agents_hard_delete(agents=Agent.objects.filter(pk=obj.pk), now=timezone.now())

    def delete_queryset(self, request, queryset):
        services.agents_hard_delete(agents=queryset, now=timezone.now())

    @admin.action(description="Pause selected agents", permissions=["change"])
    def pause_agents(self, request, queryset):
        self.change_each(request, queryset, services.agent_pause, verb="paused", unless="active")

    @admin.action(description="Resume selected agents", permissions=["change"])
    def resume_agents(self, request, queryset):
        resumed = self.change_each(request, queryset, services.agent_resume, verb="resumed", unless="paused")
        if stuck := [agent for agent in resumed if config_problem(agent.adapter_config)]:
            self.message_user(
                request,
                f"Resumed, but not woken by their schedule until their configuration is corrected: {named(stuck)}.",
                messages.WARNING,
            )

    def change_each(self, request, queryset, change, *, verb: str, unless: str) -> list[Agent]:
        """`change` (a service that says whether it changed the agent: only an agent that
        was `unless`) on each selected agent: the ones it changed are counted, the others
        named with their status. Returns the ones changed."""
        changed, unchanged, unreadable = [], [], []
        for agent in queryset:
            if config_unreadable(agent):
                unreadable.append(agent)
            elif change(agent=agent):
                changed.append(agent)
            else:
                unchanged.append(agent)
        if changed or not (unchanged or unreadable):
            self.message_user(request, f"{verb.capitalize()} {len(changed)} agent(s).", messages.SUCCESS)
        if unchanged:
            self.message_user(
                request, f"Not {verb}, as not {unless}: {named(unchanged, with_status=True)}.", messages.WARNING
            )
        self.say_unreadable(request, unreadable, verb=verb)
        return changed

    def say_unreadable(self, request, agents: list[Agent], *, verb: str) -> None:
        if agents:
            self.message_user(
                request,
                f"Not {verb}, as their stored configuration is not a JSON object (correct it on the "
                f"agent's page, or delete the agent): {named(agents)}.",
                messages.ERROR,
            )

    @admin.action(
        description="Retire selected agents (as the API's DELETE: keep runs and costs)", permissions=["change"]
    )
    def retire_agents(self, request, queryset):
        now = timezone.now()
        count = 0
        unreadable = []
        for agent in queryset.exclude(status=AgentStatus.DELETED):
            if config_unreadable(agent):
                unreadable.append(agent)
                continue
            services.agent_delete(agent=agent, now=now)
            count += 1
        self.message_user(request, f"Retired {count} agent(s); their sessions were deleted.", messages.SUCCESS)
        self.say_unreadable(request, unreadable, verb="retired")

    @admin.action(description="Run a heartbeat now", permissions=["change"])
    def run_heartbeat_now(self, request, queryset):
        for agent in queryset:
            self.start_heartbeat(request, agent=agent, task=DEFAULT_HEARTBEAT_TASK)

    def start_heartbeat(self, request, *, agent: Agent, task: str) -> HeartbeatRun | None:
        from sessions_app.errors import HeartbeatRefused, QueueUnavailable
        from sessions_app.heartbeat import heartbeat_start

        if config_unreadable(agent):
            self.say_unreadable(request, [agent], verb="started")
            return None
        try:
            # Outside any transaction of ours: heartbeat_start hands the run to the task queue
            # once its enqueue commits and says so when the queue refuses it. Inside one, the
            # hand-off ran at its end, past that check: a queue that was down was a 500.
            run, _ = heartbeat_start(agent=agent, task=task, trigger=RunTrigger.ADMIN, now=timezone.now(), wait=False)
        except HeartbeatRefused as exc:
            self.message_user(request, f"{agent.name}: heartbeat refused ({exc.code}): {exc.message}", messages.ERROR)
            return None
        except QueueUnavailable as exc:
            self.message_user(request, f"{agent.name}: {exc.message}", messages.ERROR)
            return None
        self.message_user(
            request,
            format_html(
                "{}: heartbeat queued as {}.",
                agent.name,
                admin_link("admin:sessions_app_heartbeatrun_change", run.pk, f"run {run.pk}"),
            ),
            messages.SUCCESS,
        )
        return run

    def heartbeat_view(self, request, object_id):
        agent = self.get_object(request, unquote(object_id))
        if agent is None:
            raise Http404("No such agent.")
        if not self.has_change_permission(request, agent):
            raise PermissionDenied
        if config_unreadable(agent):
            # The page describes the agent by its configuration: the agent's page shows the problem.
            self.say_unreadable(request, [agent], verb="started")
            return HttpResponseRedirect(reverse("admin:sessions_app_agent_change", args=[agent.pk]))
        form = HeartbeatForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            run = self.start_heartbeat(request, agent=agent, task=form.cleaned_data["task"])
            if run is not None:
                return HttpResponseRedirect(reverse("admin:sessions_app_heartbeatrun_change", args=[run.pk]))
            return HttpResponseRedirect(reverse("admin:sessions_app_agent_change", args=[agent.pk]))
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Run a heartbeat of {agent.name}",
            "agent": agent,
            "form": form,
        }
        return TemplateResponse(request, "admin/sessions_app/agent/heartbeat.html", context)
