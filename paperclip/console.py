"""The operator's console, the admin's front page: is everything all right?

Each tile answers one question, and every figure links to the filtered list behind it:
1. runs in progress and queued (the oldest queued one's age), and runs past their deadline;
2. failed runs of the last 24 hours, by error code;
3. the task cluster: clusters seen, tasks queued and failed;
4. spend today and this month, and each budget's daily and monthly limit as a bar;
5. agents that need a person: runs that keep failing, a wake the scheduler has not taken,
   a spent budget;
6. sessions expiring in the next hour, and models that are deprecated or retiring.

The page costs the same few queries however many agents, sessions, runs and budgets there
are (tests/admin/test_console.py): aggregates, and lists cut to ROWS.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db.models import Case, Count, Max, Q, Sum, When
from django.urls import reverse
from django.utils.http import urlencode
from django.utils.timesince import timesince

from costs_app.admin import scope_spend, use_bar
from costs_app.budgets import period_start
from costs_app.catalogue import catalogue
from costs_app.models import Budget, CatalogueModel, CostEvent
from paperclip.health import queue_state
from sessions_app.admin.common import admin_time
from sessions_app.model_checks import CHECKED_KEYS
from sessions_app.models import (
    LIVE_SESSION_STATUSES,
    Agent,
    AgentSession,
    AgentStatus,
    ApiKey,
    Company,
    HealthState,
    HeartbeatRun,
    PausedReason,
    RunStatus,
    parse_session_id,
    parse_uuid,
)
from sessions_app.quota import holds_now

# Rows a tile lists before "and N more".
ROWS = 5
# An agent whose last this many finished runs (of the last day) all failed is failing.
FAILING_RUNS = 3
# A scheduled wake this late was not taken: no scheduler runs, or it cannot keep up.
WAKE_GRACE = timedelta(minutes=5)
DAY = timedelta(hours=24)
EXPIRY_WINDOW = timedelta(hours=1)


@dataclass(frozen=True)
class Flag:
    """One row of a tile: what, why, and where to look."""

    label: str
    url: str
    detail: str = ""
    level: str = "warning"  # "warning" or "error"


def changelist(model, **filters) -> str:
    url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    return f"{url}?{urlencode(filters)}" if filters else url


def change_page(model, pk) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_change", args=[pk])


def since(moment: datetime) -> str:
    """A `created_at__gte` value: the minute, in ISO form (what the lists' URLs show)."""
    return moment.replace(second=0, microsecond=0).isoformat()


def console(*, request, now: datetime) -> dict:
    """Every tile the user may see (a tile needs the view permission of what it counts)."""
    can = request.user.has_perm
    tiles: dict = {"now": now, "find_url": reverse("admin:find_form")}
    if can("sessions_app.view_heartbeatrun"):
        tiles["runs"] = runs_now(now=now)
        tiles["failures"] = failed_runs(now=now)
    if can("sessions_app.view_agent") and can("sessions_app.view_heartbeatrun"):
        tiles["attention"] = agents_needing_attention(now=now)
    if can("costs_app.view_costevent") and can("costs_app.view_budget"):
        tiles["spend"] = spend(now=now)
    if can("sessions_app.view_agentsession"):
        tiles["expiring"] = sessions_expiring(now=now)
    tiles["retiring"] = models_retiring(now=now)
    tiles["queue"] = task_queue(now=now)
    return {"console": tiles}


# 1. Runs now.


def runs_now(*, now: datetime) -> dict:
    # Both read the partial index of unfinished runs (runs_unfinished_idx).
    unfinished = HeartbeatRun.objects.filter(status__in=(RunStatus.QUEUED, RunStatus.RUNNING))
    counts = unfinished.aggregate(
        running=Count("id", filter=Q(status=RunStatus.RUNNING)),
        queued=Count("id", filter=Q(status=RunStatus.QUEUED)),
        past_deadline=Count("id", filter=Q(status=RunStatus.RUNNING, deadline_at__lt=now)),
    )
    oldest = unfinished.filter(status=RunStatus.QUEUED).order_by("created_at").values("id", "created_at").first()
    cap = settings.PAPERCLIP_MAX_CONCURRENT_RUNS
    return {
        **counts,
        "cap": cap,
        # Credentials a provider's quota holds: their runs wait queued until the reset.
        "held": [f"Credential {hold.credential}: {hold.status_text}" for hold in holds_now()],
        "running_url": changelist(HeartbeatRun, status__exact=RunStatus.RUNNING),
        "queued_url": changelist(HeartbeatRun, status__exact=RunStatus.QUEUED),
        "past_deadline_url": changelist(HeartbeatRun, status__exact=RunStatus.RUNNING, deadline_at__lt=since(now)),
        "oldest_queued": oldest
        and {"age": timesince(oldest["created_at"], now, depth=1), "url": change_page(HeartbeatRun, oldest["id"])},
    }


# 2. Failed runs.


def failed_runs(*, now: datetime) -> dict:
    start = since(now - DAY)
    codes = list(
        HeartbeatRun.objects.filter(status=RunStatus.FAILED, created_at__gte=start)
        .values("error_code")
        .annotate(runs=Count("id"), last=Max("created_at"))
        .order_by("-runs", "error_code")
    )
    return {
        "total": sum(row["runs"] for row in codes),
        "url": changelist(HeartbeatRun, status__exact=RunStatus.FAILED, created_at__gte=start),
        "codes": [
            {
                "code": row["error_code"] or "(no code)",
                "runs": row["runs"],
                "last": row["last"],
                "url": changelist(
                    HeartbeatRun, status__exact=RunStatus.FAILED, error_code=row["error_code"], created_at__gte=start
                ),
            }
            for row in codes[:ROWS]
        ],
        "more": max(len(codes) - ROWS, 0),
    }


# 3. The task cluster.


def task_queue(*, now: datetime) -> dict:
    from django_q.models import Failure, OrmQ

    state = queue_state()
    failed = Failure.objects.filter(stopped__gte=now - DAY).count()
    waiting = OrmQ.objects.count() if not settings.REDIS_URL else None
    return {
        **state,
        "failed_tasks": failed,
        "failed_url": changelist(Failure),
        "waiting_tasks": waiting,
        "waiting_url": changelist(OrmQ),
        "health_url": reverse("health"),
    }


# 4. Spend and budgets.


def spend(*, now: datetime) -> dict:
    day, month = period_start("day", now), period_start("month", now)
    # The month's rows of every company (the ledger's indexes lead with the company or the
    # agent: every heartbeat inserts here, so none is on the time alone), as the costs page reads them.
    totals = CostEvent.objects.filter(created_at__gte=month).aggregate(
        month=Sum("cost_usd"), today=Sum("cost_usd", filter=Q(created_at__gte=day))
    )
    limited = (
        Budget.objects.filter(Q(daily_limit_usd__isnull=False) | Q(monthly_limit_usd__isnull=False))
        .select_related("company", "agent")
        .defer("agent__system_prompt", "agent__adapter_config")
        .annotate(
            day_spent=Case(
                When(agent__isnull=True, then=scope_spend("company_id", since=day)),
                default=scope_spend("agent_id", since=day),
            ),
            month_spent=Case(
                When(agent__isnull=True, then=scope_spend("company_id", since=month)),
                default=scope_spend("agent_id", since=month),
            ),
        )
    )
    rows = []
    for budget in limited:
        scope = {"agent": budget.agent_id} if budget.agent_id else {"company__id__exact": budget.company_id}
        # Today's bar, then this month's (None where that limit is not set).
        bars = [
            limit is not None
            and {
                "bar": use_bar(spent or Decimal(0), limit, budget.warn_percent),
                "url": changelist(CostEvent, **scope, created_at__gte=since(start)),
                "share": (spent or Decimal(0)) / limit if limit else Decimal(1),
            }
            or None
            for limit, spent, start in (
                (budget.daily_limit_usd, budget.day_spent, day),
                (budget.monthly_limit_usd, budget.month_spent, month),
            )
        ]
        rows.append(
            {
                "label": f"agent {budget.agent.name}" if budget.agent_id else f"company {budget.company.name}",
                "url": change_page(Budget, budget.pk),
                "bars": bars,
                "share": max(bar["share"] for bar in bars if bar),
            }
        )
    rows.sort(key=lambda row: row["share"], reverse=True)
    return {
        "today": totals["today"] or Decimal(0),
        "month": totals["month"] or Decimal(0),
        "today_url": changelist(CostEvent, created_at__gte=since(day)),
        "month_url": changelist(CostEvent, created_at__gte=since(month)),
        "budgets": rows[:ROWS],
        "more": max(len(rows) - ROWS, 0),
        "budgets_url": changelist(Budget),
        "report_url": reverse("admin:costs_app_costevent_report"),
    }


# 5. Agents that need a person.


def agents_needing_attention(*, now: datetime) -> dict:
    """Agents whose runs keep failing, whose wake was not taken, or whose budget is spent."""
    from django_q.models import Schedule

    flags: dict = {}  # agent id -> [reasons]
    start = since(now - DAY)
    # Three queries whatever the number of agents: failures of the day (the partial index
    # runs_failed_created_idx), then the last success of only the agents with enough of them.
    failures = {
        row["agent_id"]: row
        for row in HeartbeatRun.objects.filter(status=RunStatus.FAILED, created_at__gte=start)
        .values("agent_id")
        .annotate(failed=Count("id"), last_failed=Max("created_at"))
        .filter(failed__gte=FAILING_RUNS)
    }
    recovered = dict(
        HeartbeatRun.objects.filter(
            agent_id__in=list(failures), status__in=(RunStatus.SUCCEEDED, RunStatus.SKIPPED), created_at__gte=start
        )
        .values("agent_id")
        .annotate(last=Max("created_at"))
        .values_list("agent_id", "last")
    )
    for agent_id, row in failures.items():
        if recovered.get(agent_id) is None or recovered[agent_id] < row["last_failed"]:
            flags.setdefault(agent_id, []).append(
                (
                    f"{row['failed']} failed runs in 24 h, the last at {admin_time(row['last_failed'])}",
                    changelist(HeartbeatRun, agent=agent_id, status__exact=RunStatus.FAILED, created_at__gte=start),
                    "error",
                )
            )
    late = Schedule.objects.filter(name__startswith="heartbeat:", next_run__lt=now - WAKE_GRACE).values_list(
        "name", "next_run"
    )
    for name, next_run in late:
        agent_id = parse_uuid(name.removeprefix("heartbeat:"))
        if agent_id is not None:
            minutes = int((now - next_run).total_seconds() // 60)
            flags.setdefault(agent_id, []).append(
                (
                    f"wake due {minutes} min ago, not taken: is a task cluster running?",
                    change_page(Agent, agent_id),
                    "error",
                )
            )
    # As the maintenance pass last found them (sessions_app.agent_health).
    for agent_id, state, changed in Agent.objects.filter(
        health_state__in=[HealthState.DOWN, HealthState.FAILING]
    ).values_list("id", "health_state", "health_changed_at"):
        flags.setdefault(agent_id, []).append(
            (f"health: {state} since {admin_time(changed) if changed else '?'}", change_page(Agent, agent_id), "error")
        )
    for agent_id in Agent.objects.filter(status="paused", paused_reason=PausedReason.BUDGET).values_list(
        "id", flat=True
    ):
        flags.setdefault(agent_id, []).append(
            ("paused: its budget is spent", changelist(Agent, paused_reason=PausedReason.BUDGET), "warning")
        )
    names = dict(Agent.objects.filter(pk__in=list(flags)).values_list("id", "name"))
    rows = [
        Flag(
            label=names.get(agent_id, str(agent_id)),
            url=reasons[0][1],
            detail="; ".join(reason for reason, _, _ in reasons),
            level="error" if any(level == "error" for _, _, level in reasons) else "warning",
        )
        for agent_id, reasons in flags.items()
        if agent_id in names
    ]
    rows.sort(key=lambda flag: (flag.level != "error", flag.label))
    return {"rows": rows[:ROWS], "more": max(len(rows) - ROWS, 0), "agents_url": changelist(Agent)}


# 6. Sessions expiring, and models going away.


def sessions_expiring(*, now: datetime) -> dict:
    live = ",".join(LIVE_SESSION_STATUSES)
    # Both counts read the partial index of live sessions by expiry (sessions_live_expires_idx).
    counts = AgentSession.objects.filter(
        status__in=LIVE_SESSION_STATUSES, expires_at__lte=now + EXPIRY_WINDOW
    ).aggregate(soon=Count("id", filter=Q(expires_at__gt=now)), overdue=Count("id", filter=Q(expires_at__lte=now)))
    return {
        **counts,
        "soon_url": changelist(
            AgentSession, status__in=live, expires_at__gt=since(now), expires_at__lte=since(now + EXPIRY_WINDOW)
        ),
        "overdue_url": changelist(AgentSession, status__in=live, expires_at__lte=since(now)),
    }


@dataclass(frozen=True)
class RetiringModel:
    model: str
    state: str  # "deprecated" or "retiring"
    retires_on: object  # a date, or None when not announced
    agents: int
    url: str


def models_retiring(*, now: datetime) -> list[RetiringModel]:
    """The models agents use (as `model` or `summary_model`) that the model catalogue marks
    deprecated, retiring or retired, soonest retirement first, each with the number of
    agents on it. One query, whatever the number of agents: their configurations."""
    models = catalogue()
    used: dict[str, set] = {}
    configs = Agent.objects.exclude(status=AgentStatus.DELETED).values_list("id", "adapter_config")
    for agent_id, config in configs:
        for key in CHECKED_KEYS:
            entry = models.get(config.get(key) or "") if isinstance(config, dict) else None
            if entry is not None and entry.warning:
                used.setdefault(entry.id, set()).add(agent_id)
    rows = [
        RetiringModel(
            model=entry.id,
            state="retired" if entry.retired else ("retiring" if entry.retires_at else "deprecated"),
            retires_on=entry.retires_at.date() if entry.retires_at else None,
            agents=len(used[entry.id]),
            url=changelist(CatalogueModel, q=entry.id),
        )
        for entry in (models.get(model) for model in used)
    ]
    return sorted(rows, key=lambda row: (row.retires_on is None, row.retires_on or now.date(), row.model))


# Any id, opened.


def admin_url_of(object_id: str, *, user) -> str | None:
    """The admin page of the row an API id names: a session (`sess_...` or its UUID), a run,
    an agent, a company or an API key, in that order; None when none has it (or the user
    may not see it)."""
    session_id = parse_session_id(object_id)
    if session_id is None:
        return None
    for model in (AgentSession, HeartbeatRun, Agent, Company, ApiKey):
        opts = model._meta
        if user.has_perm(f"{opts.app_label}.view_{opts.model_name}") and model.objects.filter(pk=session_id).exists():
            return change_page(model, session_id)
    return None
