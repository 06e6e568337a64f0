"""Agents that go quiet: each agent's health, a pure function of stored fields and `now`.

As healthchecks.io does for its checks: a scheduled agent is expected to have a successful
(or skipped-for-no-work) run within its schedule's step (its interval, or the time to its
next cron wake, times its back-off) after the last one; past it the agent is `late`; past
the grace too (`health_grace_minutes`, one interval by default) it is `down`. An agent whose
last N runs failed (`health_failing_after_runs`, PAPERCLIP_HEALTH_FAILING_AFTER_RUNS) is
`failing`. Paused agents, and agents whose credential a provider's quota holds
(`sessions_app.quota`), are never late: they are not expected to run. An active agent whose
stored configuration no longer validates where health reads it (`config_problem`: a time
zone a tzdata upgrade removed, a value written by SQL) is `down`, with the problem as the
reason: it will not wake as its schedule says until an operator corrects it.

1. `agent_health(facts, now=...)`: the state, from `HealthFacts` (the agent's fields and
   two of its runs' facts, annotated by `with_health_facts` in one query for a whole list);
2. `agents_health_check` (a maintenance step): each change of state is stored on the agent
   by a conditional update (`filter(health_state=old)`), so of two maintenance passes one
   writes it; a change from up (`ok`, `late`) to down (`down`, `failing`) or back is sent
   to the alert targets that asked (`agent_down`, `agent_up`), once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db.models import Count, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce

from sessions_app.adapters import adapter_for
from sessions_app.adapters.base import validate_common
from sessions_app.models import Agent, AgentStatus, HealthState, HeartbeatRun, RunStatus
from sessions_app.wakes import HeartbeatPlan
from sessions_app.work_checks import agent_backoff, validate_work_settings

DOWN_STATES = (HealthState.DOWN, HealthState.FAILING)
EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
# What health reads of a configuration: the schedule and its back-off, the grace and the
# failure threshold (`config_problem`).
HEALTH_SETTINGS = (
    "heartbeat_interval_minutes",
    "heartbeat_cron",
    "heartbeat_timezone",
    "backoff_after_runs",
    "backoff_max_factor",
    "health_grace_minutes",
    "health_failing_after_runs",
)


@dataclass(frozen=True)
class HealthFacts:
    """What an agent's health is computed from: its stored fields and its runs'."""

    status: str
    config: dict
    idle_streak: int
    since: datetime  # its last successful (or skipped) run's tick, or its last save
    failed_in_a_row: int  # failed runs since then
    held: bool = False  # its credential is held by a provider's quota


@dataclass(frozen=True)
class Health:
    state: str
    reason: str
    due_at: datetime | None = None  # when the next successful run is expected by
    down_at: datetime | None = None  # and when, without one, the agent is down
    config_invalid: bool = False  # the reason is the stored configuration's, for an operator to correct

    def as_json(self) -> dict:
        return {
            "state": self.state,
            "reason": self.reason,
            "due_at": self.due_at.isoformat() if self.due_at else None,
            "down_at": self.down_at.isoformat() if self.down_at else None,
        }


def failing_after(config: dict) -> int:
    return int(config.get("health_failing_after_runs") or settings.PAPERCLIP_HEALTH_FAILING_AFTER_RUNS)


def config_problem(config: object) -> str | None:
    """Why health cannot be read from an agent's stored configuration, or None: it is not a
    JSON object, or a setting health reads fails the validation of a save (a time zone a
    tzdata upgrade removed, a value written by SQL or an older version)."""
    if not isinstance(config, dict):
        return "invalid configuration: not a JSON object"
    read = {key: config[key] for key in HEALTH_SETTINGS if key in config}
    errors: dict[str, str] = {}
    validate_common(read, errors)
    validate_work_settings(read, errors, {})
    if errors:
        key, message = min(errors.items())
        return f"invalid configuration: {key} {message}"
    return None


def agent_health(facts: HealthFacts, *, now: datetime) -> Health:
    """The agent's state at `now` (module docstring): failing, down, late or ok."""
    if facts.status != AgentStatus.ACTIVE:
        return Health(HealthState.OK, f"{facts.status}: not expected to run")
    if problem := config_problem(facts.config):
        return Health(HealthState.DOWN, problem, config_invalid=True)
    threshold = failing_after(facts.config)
    if facts.failed_in_a_row >= threshold:
        return Health(HealthState.FAILING, f"its last {facts.failed_in_a_row} runs failed (failing after {threshold})")
    expected = expectation(facts)
    if expected is None:
        return Health(HealthState.OK, "not scheduled")
    due_at, down_at = expected
    if facts.held:
        return Health(HealthState.OK, "its credential is held by a provider's quota", due_at, down_at)
    if now > down_at:
        return Health(HealthState.DOWN, f"no successful run since {facts.since.isoformat()}", due_at, down_at)
    if now > due_at:
        return Health(HealthState.LATE, f"a run was due by {due_at.isoformat()}", due_at, down_at)
    return Health(HealthState.OK, "on schedule", due_at, down_at)


def expectation(facts: HealthFacts) -> tuple[datetime, datetime] | None:
    """(due, down): when the next successful run is due after `facts.since`, by the
    schedule stretched by the back-off, and when the grace after it ends. None: the agent
    has no schedule (or no wake is left)."""
    backoff = agent_backoff(facts.config, facts.idle_streak)
    plan = HeartbeatPlan.of(facts.config, backoff=backoff)
    if plan is None:
        return None
    grace_minutes = facts.config.get("health_grace_minutes")
    if plan.interval_minutes:
        due = facts.since + timedelta(minutes=plan.step_minutes)
        grace = timedelta(minutes=grace_minutes or plan.interval_minutes)
        return due, due + grace
    wakes = plan.wakes(now=facts.since, count=1)
    if not wakes:
        return None
    due = wakes[0].astimezone(UTC)
    if grace_minutes:
        return due, due + timedelta(minutes=grace_minutes)
    # One interval of the expression itself, in its zone: the gap to the wake after `due`
    # (23 or 25 hours for a daily wake across a change of clocks).
    following = HeartbeatPlan.of(facts.config).wakes(now=due, count=1)
    return due, (following[0].astimezone(UTC) if following else due + timedelta(days=1))


# The facts, for a whole list in one query.


def with_health_facts(agents: QuerySet) -> QuerySet:
    """Annotate `health_last_ok` (the tick of the agent's last successful or skipped run;
    runs_agent_created_idx, newest first) and `health_failed` (its failed runs since)."""
    last_ok = (
        HeartbeatRun.objects.filter(agent_id=OuterRef("pk"), status__in=[RunStatus.SUCCEEDED, RunStatus.SKIPPED])
        .order_by("-created_at")
        .values("created_at")[:1]
    )
    failed = (
        HeartbeatRun.objects.filter(
            agent_id=OuterRef("pk"), status=RunStatus.FAILED, created_at__gt=OuterRef("health_last_ok_or_epoch")
        )
        .order_by()
        .values("agent_id")
        .annotate(n=Count("pk"))
        .values("n")
    )
    agents = agents.annotate(health_last_ok=Subquery(last_ok))
    agents = agents.annotate(health_last_ok_or_epoch=Coalesce("health_last_ok", EPOCH))
    return agents.annotate(health_failed=Coalesce(Subquery(failed), 0))


def facts_of(agent: Agent, *, held_credentials: frozenset[str] = frozenset()) -> HealthFacts:
    """The facts of an agent read through `with_health_facts` (its runs' fields), with the
    credentials a quota holds now (`quota.holds_now`)."""
    last_ok = getattr(agent, "health_last_ok", None)
    since = max(last_ok, agent.updated_at) if last_ok is not None else agent.updated_at
    adapter = adapter_for(agent.adapter_type, agent.adapter_config)
    # A configuration that is not an object names no credential (`agent_health` says what it is).
    readable = adapter is not None and isinstance(agent.adapter_config, dict)
    credential = adapter.credential(agent.adapter_config) if readable else None
    return HealthFacts(
        status=agent.status,
        config=agent.adapter_config or {},
        idle_streak=agent.idle_streak,
        since=since,
        failed_in_a_row=getattr(agent, "health_failed", 0) or 0,
        held=credential is not None and credential in held_credentials,
    )


def agents_health_check(*, now: datetime) -> int:
    """Store each agent's change of state; send the ones from up to down and back. Returns
    how many were sent. Reads every agent not deleted, with its facts, in one query."""
    from sessions_app.quota import holds_now

    held = frozenset(hold.credential for hold in holds_now())
    sent = 0
    agents = with_health_facts(Agent.objects.exclude(status=AgentStatus.DELETED))
    changed = []
    for agent in agents.iterator(chunk_size=500):
        health = agent_health(facts_of(agent, held_credentials=held), now=now)
        if health.state != agent.health_state:
            changed.append((agent, health))
    # Only once the query is read to its end (an enqueue may close the connection).
    for agent, health in changed:
        sent += health_transition(agent=agent, health=health, now=now)
    return sent


def health_transition(*, agent: Agent, health: Health, now: datetime) -> int:
    """Move the agent's stored state from what was read to `health.state`; of two passes
    one update matches, and only it sends the alert a change across up and down calls
    for. 1 when this sent one."""
    before = agent.health_state
    moved = Agent.objects.filter(pk=agent.pk, health_state=before).update(
        health_state=health.state, health_changed_at=now
    )
    if not moved or (before in DOWN_STATES) == (health.state in DOWN_STATES):
        return 0
    from costs_app.alerts import alert_event_fire

    kind = "agent_down" if health.state in DOWN_STATES else "agent_up"
    return alert_event_fire(
        kind=kind,
        key=f"{kind}:{agent.pk}:{now.isoformat()}",
        payload={"agent_name": agent.name, "previous": before, **health.as_json()},
        now=now,
        company_id=agent.company_id,
        agent_id=agent.pk,
    )
