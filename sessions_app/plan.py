"""Planning a heartbeat: which session the answer goes to and what history the model sees.

`plan_session` returns a frozen `Plan`. Later steps (a rotation's handoff note, compaction
in `sessions_app.compaction`) never change a plan they were handed: they return a new
one (`dataclasses.replace`), so the engine always holds the plan the next step sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, connection
from django.db.models import Exists, Field, QuerySet
from django.db.models.expressions import RawSQL

from costs_app.budgets import session_limit_reached
from paperclip.telemetry import annotate
from sessions_app import history_cache
from sessions_app.adapters import AdapterReply
from sessions_app.context import SUMMARY_KINDS, ContextSettings, read_as_turns, rotation_due
from sessions_app.history_cache import HISTORY_KEY_SQL
from sessions_app.hot_sql import (
    CompiledLookup,
    CompiledStatement,
    session_take_run,
    session_take_statement,
)
from sessions_app.models import (
    LIVE_SESSION_STATUSES,
    Agent,
    AgentSession,
    HeartbeatRun,
    HistoryField,
    HistoryStore,
    SessionStatus,
)
from sessions_app.stores import store_for

# Why a live session ends with a note that opens its successor: it grew past its rotation
# point, or it spent its budget's session_limit_usd.
HANDOFF_REASONS = frozenset({"rotated", "session_limit"})


@dataclass(frozen=True)
class Handoff:
    """The note that opens a rotated session, and what writing it cost."""

    summary: str
    reply: AdapterReply
    predecessor: AgentSession
    facts: list = field(default_factory=list)  # the pinned facts and candidates checked


@dataclass(frozen=True)
class Plan:
    """What the model will see, and where the answer will be written."""

    session: AgentSession | None  # the live session resumed, if any
    history: list
    retire: AgentSession | None  # a live session that must end before a new one starts
    retire_reason: str
    new_session: bool
    manifest: list = field(default_factory=list)
    handoff: Handoff | None = None
    # Set by the fit step of a session kept within a budget by summaries: the budget this
    # run's request was held to and that request's size, for the compaction after the commit.
    budget_tokens: int | None = None
    request_tokens: int | None = None
    # Set by the same step: the lifetime the request's prefix is cached at (None: not
    # cached), for keeping it warm after the commit (`sessions_app.cache_refresh`).
    cache_ttl: str | None = None
    # A session whose remote session was lost: the note the new remote session opens with.
    lost_note: str = ""

    @property
    def predecessor(self) -> AgentSession | None:
        """The session the new one continues from: one rotated with a note, or one lost."""
        if self.handoff is not None:
            return self.handoff.predecessor
        return self.retire if self.lost_note else None


def fresh_plan(*, new_session: bool = True) -> Plan:
    """A plan without a live session: a new one (or none, for a stateless agent)."""
    return Plan(session=None, history=[], retire=None, retire_reason="", new_session=new_session)


def plan_session(
    *, agent: Agent, run: HeartbeatRun, now: datetime, settings_: ContextSettings, rotates: bool = True
) -> Plan:
    """Resume the agent's live session, or plan a new one (retiring the live one when it
    cannot take this run). `rotates` False: the session is never rotated (its runtime
    keeps its own context)."""
    if not agent.is_persistent:
        return fresh_plan(new_session=False)
    live = live_session_of(run, agent=agent)
    if live is None:
        return fresh_plan()
    reason = retire_reason(live, agent=agent, run=run, now=now, settings_=settings_, rotates=rotates)
    if reason in HANDOFF_REASONS and not _link_run(run, live):
        return fresh_plan()  # it ended (or was deleted) meanwhile: nothing is left to rotate
    if reason:
        return Plan(session=None, history=[], retire=live, retire_reason=reason, new_session=True)
    history = store_for(live).read(live)
    live = _take_session(live, agent=agent, run=run, history=history, now=now)
    if live is None:
        return fresh_plan()  # expired, ended or deleted since it was read: never resurrected
    return Plan(
        session=live, history=history, retire=None, retire_reason="", new_session=False, manifest=list(live.manifest)
    )


def retire_reason(
    live: AgentSession, *, agent: Agent, run: HeartbeatRun, now: datetime, settings_, rotates: bool = True
) -> str:
    """Why the live session cannot take this run ("" when it can). A session inserted by
    raw SQL names no model or adapter: it continues with the agent's."""
    if not live.is_live_at(now, ttl=agent.session_ttl):
        return "expired"
    if live.managed_lost_at is not None:
        return "remote_lost"  # its remote session ended at the provider (`sessions_app.managed_health`)
    if run.force_fresh:
        return "force_fresh"
    if live.model not in ("", agent.model_name) or live.adapter_type not in ("", agent.adapter_type):
        return "config_changed"
    if bool(live.cli_session_id) != agent.runs_claude_code_cli and (live.cli_session_id or live.message_count):
        # The runtime changed: a CLI session and a chat transcript do not mix. A session
        # holding neither (its answers were all nothing to do) starts the runtime's own.
        return "config_changed"
    # Only a run that a budget applies to can have a session limit (one query when it may).
    if getattr(run, "budgeted", True) and session_limit_reached(
        company_id=agent.company_id, agent_id=agent.id, session_id=live.pk
    ):
        return "session_limit"
    if rotates and rotation_due(live, settings_, now):
        return "rotated"
    return ""


def _live_sessions(agent_id) -> QuerySet:
    return AgentSession.objects.filter(agent_id=agent_id, status__in=LIVE_SESSION_STATUSES).order_by("pk")


def _live_sessions_unless_kept(agent_id, *, kept_key: str) -> QuerySet:
    """PostgreSQL: the same, the history left out of a row whose key is `kept_key`."""
    history = RawSQL(  # noqa: S611 (our own SQL, the key a parameter)
        f'CASE WHEN {HISTORY_KEY_SQL} = %s THEN NULL ELSE "agent_sessions"."history" END',
        [kept_key],
        output_field=HistoryField(),
    )
    return _live_sessions(agent_id).defer("history").annotate(history_unless_kept=history)


# The agent's live session (at most one: sessions_one_live_per_agent), its query compiled
# once per connection: every persistent heartbeat reads it.
LIVE_SESSION = CompiledLookup(_live_sessions)
LIVE_SESSION_UNLESS_KEPT = CompiledLookup(_live_sessions_unless_kept, texts=("kept_key",))


class LiveSessionRead:
    """One read of the agent's live session. On PostgreSQL, when this process keeps the
    history its last heartbeat wrote (`sessions_app.history_cache`), the server sends the
    row's history only if the row no longer holds that one; the instance has its history
    either way."""

    def __init__(self, agent_id) -> None:
        self.agent_id = agent_id
        self.kept = history_cache.kept(agent_id) if connection.vendor == "postgresql" else None

    def statement(self) -> tuple[str, list]:
        """The read's SQL and parameters, to run alongside others (`hot_sql.write_then_read`)."""
        if self.kept is None:
            return LIVE_SESSION.statement(self.agent_id)
        return LIVE_SESSION_UNLESS_KEPT.statement(self.agent_id, kept_key=self.kept.key)

    def session(self, rows: list) -> AgentSession | None:
        """The live session in `rows` (the statement's), None when there was none."""
        if self.kept is None:
            return LIVE_SESSION.first_of(rows)
        live = LIVE_SESSION_UNLESS_KEPT.first_of(rows)
        if live is not None:
            from_row = live.__dict__.pop("history_unless_kept")
            # The key the server compared, compared again on the row it sent.
            unchanged = history_cache.key_of(live.pk, live.history_rev) == self.kept.key
            live.history = list(self.kept.history) if unchanged else from_row
            annotate(history_kept=unchanged)  # on the step's span: how often a kept history serves
        return live

    def first(self) -> AgentSession | None:
        with connection.cursor() as cursor:
            cursor.execute(*self.statement())
            return self.session(cursor.fetchall())


def live_session_of(run: HeartbeatRun, *, agent: Agent) -> AgentSession | None:
    """The agent's live session: as the run's claim read it, once (`run_queue.claim_run`),
    or read now."""
    read, run.live_session_read = run.live_session_read, None
    return read.row if read is not None else LiveSessionRead(agent.pk).first()


def idle_pause(agent: Agent) -> timedelta:
    minutes = agent.adapter_config.get("idle_pause_minutes") or settings.PAPERCLIP_IDLE_PAUSE_MINUTES
    return timedelta(minutes=minutes)


def _link_run(run: HeartbeatRun, session: AgentSession) -> bool:
    """Mark `session` as in use by `run` (the sweeps skip sessions with a running run),
    unless it is no longer live. False when it is gone or ended."""
    still_live = AgentSession.objects.filter(pk=session.pk, status__in=LIVE_SESSION_STATUSES)
    try:
        return bool(HeartbeatRun.objects.filter(id=run.id).filter(Exists(still_live)).update(session=session))
    except IntegrityError:
        # A delete committed between the check and this update: the (deferred) foreign
        # key fails when this one-statement transaction commits.
        return False


def _take_session(
    live: AgentSession, *, agent: Agent, run: HeartbeatRun, history: list, now: datetime
) -> AgentSession | None:
    """Resume `live` for this run; None when it stopped being live after it was read.

    On PostgreSQL the take and the run's link are one statement (`hot_sql.session_take_run`).
    On SQLite the run is linked first, so from then on neither sweep expires or pauses the
    session; a sweep that ended it before the link makes the conditional update below find
    nothing, and the run starts a fresh session instead of resurrecting it.
    """
    with read_as_turns(history, to="replayed"):  # before the take: a history that fails leaves it as it was
        repairs = _repairs(live, agent=agent, history=history)
    times = {
        "last_used": now,
        "expires_at": max(now + agent.session_ttl, live.expires_at or now),
        "pause_at": now + timedelta(seconds=settings.PAPERCLIP_RUN_TIMEOUT_SECONDS) + idle_pause(agent),
    }
    fields = {**_take_fields(**times), **repairs}
    if connection.vendor == "postgresql":
        repaired = {f"repair__{name}": value for name, value in repairs.items()}
        if not session_take_run(SESSION_TAKE.statement(session_id=live.pk, run_id=run.id, **times, **repaired)):
            return None
    elif not _link_run(run, live):
        return None
    elif not AgentSession.objects.filter(pk=live.pk, status__in=LIVE_SESSION_STATUSES).update(**fields):
        HeartbeatRun.objects.filter(id=run.id, session=live.pk).update(session=None)
        return None
    for name, value in fields.items():
        setattr(live, name, value)
    return live


def _take_fields(*, last_used: datetime, expires_at: datetime, pause_at: datetime) -> dict:
    """What a take writes on the session, beside any repair."""
    return {
        "last_used": last_used,
        "expires_at": expires_at,
        "status": SessionStatus.ACTIVE,
        "paused_at": None,
        "pause_at": pause_at,
    }


def take_statement(values) -> tuple[str, list]:
    """The take (`_take_session`) with `values`: the times it sets and, named
    `repair__<field>`, the repairs a row inserted by raw SQL needs (`_repairs`)."""
    given = vars(values)
    repairs = {key.removeprefix("repair__"): value for key, value in given.items() if key.startswith("repair__")}
    fields = _take_fields(last_used=values.last_used, expires_at=values.expires_at, pause_at=values.pause_at)
    still_live = AgentSession.objects.filter(pk=values.session_id, status__in=LIVE_SESSION_STATUSES)
    run = HeartbeatRun.objects.filter(id=values.run_id)
    return session_take_statement((still_live, {**fields, **repairs}), (run, {"session": values.session_id}))


def _take_value_field(name: str) -> Field:
    """The field that prepares a value of the take (`take_statement`)."""
    if name == "run_id":
        return HeartbeatRun._meta.pk
    if name == "session_id":
        return AgentSession._meta.pk
    return AgentSession._meta.get_field(name.removeprefix("repair__"))


# PostgreSQL: every resumed heartbeat takes its session; compiled once per connection and
# shape (a session that needs repairs has its own).
SESSION_TAKE = CompiledStatement(take_statement, _take_value_field)


def _repairs(live: AgentSession, *, agent: Agent, history: list) -> dict:
    """Fields a row inserted by raw SQL leaves at their defaults, derived from what it holds:
    the agent's model and adapter, and the counts of the history in its `history` column."""
    repairs = {}
    if not live.model:
        repairs["model"] = agent.model_name
    if not live.adapter_type:
        repairs["adapter_type"] = agent.adapter_type
    if live.store == HistoryStore.DATABASE and live.message_count != len(history):
        repairs["message_count"] = len(history)
    # Nothing numbered outnumbers the archive and the history together: a row at least that
    # far on needs no count, and its history is not scanned again for it on every heartbeat.
    if live.next_seq < live.archived_message_count + len(history):
        numbered = live.archived_message_count + sum(1 for m in history if m.get("kind") not in SUMMARY_KINDS)
        if live.next_seq < numbered:
            repairs["next_seq"] = numbered
    return repairs
