"""Companies, agents, their sessions and heartbeat runs, and API keys.

Table and column names are public (docs/data-model.md): SQL from the docs
runs against them verbatim, so every model sets `db_table`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q
from django.db.models.fields.json import KeyTransform
from django.db.models.functions import Now
from django.utils import timezone

from costs_app.models import Delivery
from paperclip.errors import RunFailure
from sessions_app.adapters import validate_agent_config
from sessions_app.adapters.base import AgentConfigError
from sessions_app.history_json import history_loads
from sessions_app.model_checks import agent_models_validate, with_default_model
from sessions_app.text import MESSAGE_ID_MAX_LENGTH, STOP_REASON_MAX_LENGTH, is_storable

SESSION_ID_PREFIX = "sess_"


class Company(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(default=timezone.now, db_default=Now(), editable=False)

    class Meta:
        db_table = "companies"
        verbose_name_plural = "companies"
        ordering = ["name"]
        indexes = [
            # The admin's capped company choices, newest first (`CompanyFilter`), read on
            # every page of eight lists: a LIMIT on this index, not a sort of the table.
            models.Index(fields=["created_at", "id"], name="companies_newest_idx"),
        ]

    def __str__(self) -> str:
        return self.name


class AgentStatus(models.TextChoices):
    ACTIVE = "active"
    PAUSED = "paused"
    # Deleted agents keep their row so that runs and the cost ledger still name them.
    DELETED = "deleted"


class PausedReason(models.TextChoices):
    """Why an agent is paused. Not declared as the field's choices: rows written before
    it may hold other text, and an operator-set reason is shown as it is."""

    MANUAL = "manual"  # the admin
    API = "api"
    BUDGET = "budget"  # cleared by budgets_release when the budget allows again


class SessionMode(models.TextChoices):
    STATELESS = "stateless"
    PERSISTENT = "persistent"


class HealthState(models.TextChoices):
    """An agent's health (`sessions_app.agent_health`): `ok`, `late` (a run is overdue), `down`
    (overdue past the grace), `failing` (its last runs failed)."""

    OK = "ok"
    LATE = "late"
    DOWN = "down"
    FAILING = "failing"


# Agent columns only the engine writes (by conditional UPDATE), never a save of the row.
ENGINE_FIELDS = frozenset({"idle_streak", "health_state", "health_changed_at", "managed_remote"})


class Agent(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # agents_company_status_idx leads with company_id and serves its lookups and cascades.
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="agents", db_index=False)
    name = models.CharField(max_length=200)
    system_prompt = models.TextField(blank=True, default="")
    adapter_type = models.TextField(default="claude-code")
    adapter_config = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=AgentStatus.choices, default=AgentStatus.ACTIVE)
    paused_reason = models.CharField(max_length=32, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now, db_default=Now(), editable=False)
    updated_at = models.DateTimeField(auto_now=True)
    deleted_at = models.DateTimeField(null=True, blank=True)
    # Runs in a row that found no work (skipped by the work check, or answered with the
    # nothing-to-do marker); a scheduled agent backs off on it (`sessions_app.no_work`).
    # Written only by the engine: a save of the agent's form never writes it back.
    idle_streak = models.PositiveIntegerField(default=0, db_default=0, editable=False)
    # The health the maintenance pass last stored (`sessions_app.agent_health`): a change is
    # stored by a conditional update, and one across up and down alerts once. What the API
    # and the admin show is computed at `now`; this is the last state seen.
    health_state = models.CharField(
        max_length=16, choices=HealthState.choices, default=HealthState.OK, db_default=HealthState.OK, editable=False
    )
    health_changed_at = models.DateTimeField(null=True, blank=True, editable=False)
    # `claude-managed` (`sessions_app.managed_sessions`): the remote agent and environment
    # this agent runs as at Anthropic, the agent's version, and the digest of the
    # configuration they were made from (a changed configuration makes a new version).
    managed_remote = models.JSONField(null=True, blank=True, default=None, editable=False)

    class Meta:
        db_table = "agents"
        ordering = ["name"]
        indexes = [
            # The company's agent list (API and admin), which hides deleted agents.
            models.Index(fields=["company", "status", "name"], name="agents_company_status_idx"),
            # The admin's capped agent choices, newest first (`AgentFilter`).
            models.Index(fields=["created_at", "id"], name="agents_newest_idx"),
        ]

    def __str__(self) -> str:
        return self.name

    def save(self, *args, **kwargs) -> None:
        # Every path that saves an agent (API, admin, shell) goes through validation, so a
        # bad configuration is refused when it is written, never discovered at heartbeat.
        self.clean()
        if not self._state.adding and kwargs.get("update_fields") is None and not kwargs.get("force_insert"):
            # A form read before a run ended must not put back the idle streak it read.
            skipped = ENGINE_FIELDS | self.get_deferred_fields()  # deferred: Django saves only loaded fields
            kwargs["update_fields"] = [
                field.name
                for field in self._meta.concrete_fields
                if not field.primary_key and field.name not in skipped and field.attname not in skipped
            ]
        super().save(*args, **kwargs)
        self._stored_config = self.adapter_config

    @classmethod
    def from_db(cls, db, field_names, values):
        agent = super().from_db(db, field_names, values)
        # The configuration as stored: the model checks run on what a save changes.
        agent._stored_config = agent.__dict__.get("adapter_config")
        return agent

    def refresh_from_db(self, using=None, fields=None, from_queryset=None) -> None:
        super().refresh_from_db(using=using, fields=fields, from_queryset=from_queryset)
        if fields is None or "adapter_config" in fields:
            self._stored_config = self.__dict__.get("adapter_config")

    @classmethod
    def is_gone(cls, agent_id, *, lock: bool = False) -> bool:
        """Whether the agent was deleted or removed. With `lock` (inside a transaction), its
        row stays locked until the COMMIT, and every deletion locks that row first: a
        deletion either committed before (True) or waits for what the caller writes next,
        and then deletes it with the agent's other rows."""
        agents = cls.objects.filter(pk=agent_id)
        if lock:
            agents = agents.select_for_update(no_key=True)
        return agents.values_list("status", flat=True).first() in (None, AgentStatus.DELETED)

    def clean(self) -> None:
        config = validate_agent_config(self.adapter_type, with_default_model(self.adapter_type, self.adapter_config))
        stored = None
        if not self._state.adding:
            # A deferred configuration was just loaded, unchanged, by reading it above.
            stored = getattr(self, "_stored_config", None)
            stored = config if stored is None else stored
        agent_models_validate(adapter_type=self.adapter_type, config=config, previous=stored, now=timezone.now())
        self.adapter_config = config

    def config_problem(self) -> str | None:
        """What is wrong with the stored configuration, in one line; None when it validates.
        A save validates it, but one written by SQL or by an older version may not, and the
        code that reads it may then fail: a heartbeat says this instead of a bare error."""
        try:
            validate_agent_config(self.adapter_type, with_default_model(self.adapter_type, self.adapter_config))
        except AgentConfigError as exc:
            return "; ".join(f"{name}: {message}" for name, message in exc.fields.items())
        return None

    @property
    def session_mode(self) -> str:
        return self.adapter_config.get("session_mode", SessionMode.STATELESS)

    @property
    def is_persistent(self) -> bool:
        return self.session_mode == SessionMode.PERSISTENT

    @property
    def session_ttl(self) -> timedelta:
        return timedelta(hours=float(self.adapter_config.get("session_ttl_hours", 24)))

    @property
    def runs_claude_code_cli(self) -> bool:
        return self.adapter_type == "claude-code" and self.adapter_config.get("runtime") == "cli"

    @property
    def model_name(self) -> str:
        return str(self.adapter_config.get("model", ""))

    @property
    def paused_by_budget(self) -> bool:
        return self.status == AgentStatus.PAUSED and self.paused_reason == PausedReason.BUDGET

    def refusal(self) -> tuple[str, str] | None:
        """Why this agent may not run now, as (code, message); None when it is active.

        The codes are the API's: `budget_exceeded` is a 429 until the budget allows
        again, `agent_paused` and `agent_deleted` are 409s.
        """
        if self.status == AgentStatus.DELETED:
            return "agent_deleted", "The agent was deleted."
        if self.paused_by_budget:
            return "budget_exceeded", "The agent is paused: its budget is spent. Raise the budget to resume."
        if self.status == AgentStatus.PAUSED:
            reason = f" ({self.paused_reason})" if self.paused_reason else ""
            return "agent_paused", f"The agent is paused{reason}; resume it first."
        return None


class SessionStatus(models.TextChoices):
    ACTIVE = "active"
    PAUSED = "paused"
    EXPIRED = "expired"
    ENDED = "ended"


LIVE_SESSION_STATUSES = (SessionStatus.ACTIVE, SessionStatus.PAUSED)
ENDED_SESSION_STATUSES = (SessionStatus.EXPIRED, SessionStatus.ENDED)


class HistoryStore(models.TextChoices):
    DATABASE = "database"
    FILE = "file"


class HistoryField(models.JSONField):
    """A session's turns: a JSON column decoded by `history_loads` (the whole history is read
    by every heartbeat of a persistent agent; `sessions_app.history_json`)."""

    def from_db_value(self, value, expression, connection):
        as_django_reads_it = super().from_db_value
        if isinstance(value, str) and self.decoder is None and not isinstance(expression, KeyTransform):
            # What msgspec refuses is read as JSONField reads it (a text no JSON reads stays text).
            return history_loads(value, otherwise=lambda text: as_django_reads_it(text, expression, connection))
        return as_django_reads_it(value, expression, connection)


class AgentSession(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # sessions_agent_last_used_idx leads with agent_id and serves its lookups and cascades
    # (not the partial sessions_one_live_per_agent, which holds only live sessions).
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="sessions", db_index=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="sessions")
    # Only the `database` store keeps turns here; the `file` store leaves it empty.
    history = HistoryField(default=list, db_default=models.Value([], output_field=models.JSONField()))
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    last_used = models.DateTimeField(db_default=Now())
    expires_at = models.DateTimeField(null=True, blank=True)
    status = models.CharField(
        max_length=16, choices=SessionStatus.choices, default=SessionStatus.ACTIVE, db_default=SessionStatus.ACTIVE
    )
    # Kept beside the history so that listing sessions never reads a history.
    message_count = models.PositiveIntegerField(default=0, db_default=0)
    # Where this session's turns live; a row inserted by raw SQL holds them in `history`.
    store = models.CharField(
        max_length=16, choices=HistoryStore.choices, default=HistoryStore.DATABASE, db_default=HistoryStore.DATABASE
    )
    # The file store's name for the history version this row committed (its file says the
    # same): a read that finds the file and the row disagreeing picks the file that names the
    # row's version. Empty for the database store and for files written before it existed.
    history_version = models.CharField(max_length=32, blank=True, default="", db_default="")
    # PostgreSQL moves it by one in every UPDATE that sets `history` (a trigger: migration
    # 0037), so a session's id and revision name one history (`sessions_app.history_cache`).
    history_rev = models.BigIntegerField(default=0, db_default=0, editable=False)
    adapter_type = models.TextField(blank=True, default="", db_default="")
    model = models.TextField(blank=True, default="", db_default="")
    last_input_tokens = models.PositiveIntegerField(null=True, blank=True)
    total_input_tokens = models.BigIntegerField(default=0, db_default=0)
    total_output_tokens = models.BigIntegerField(default=0, db_default=0)
    # Kept by the ledger, not by this model: a database trigger on cost_events adds each
    # row's cost to the session the row names (costs_app migration `ledger_keeps_session_
    # totals`), so it is always the sum of those rows; `save` never writes it back.
    total_cost_usd = models.DecimalField(max_digits=20, decimal_places=10, default=0, db_default=0, editable=False)
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(max_length=32, blank=True, default="", db_default="")
    # Set when retention removed the turns of an ended session; its metadata stays.
    history_purged_at = models.DateTimeField(null=True, blank=True)
    # Context management: turns moved to the archive by compaction, the sequence number
    # the next message gets (archive + active history = every message, in order), the
    # heartbeats answered, and the artifacts the agent reported (sent with every request).
    archived_message_count = models.PositiveIntegerField(default=0, db_default=0)
    next_seq = models.PositiveIntegerField(default=0, db_default=0)
    turn_count = models.PositiveIntegerField(default=0, db_default=0)
    compaction_count = models.PositiveIntegerField(default=0, db_default=0)
    # Why the last summary was thrown away (`compaction_not_shrinking`), shown to operators
    # until the next compaction succeeds: a session that cannot be shrunk needs a person.
    compaction_error = models.CharField(max_length=64, blank=True, default="", db_default="")
    compaction_error_at = models.DateTimeField(null=True, blank=True)
    # What the refused summary covered: the session's next_seq then and how many of its
    # messages it would have replaced. While both still hold, the heartbeat would send
    # the same summary request again, so it fails without paying for it twice.
    compaction_error_next_seq = models.PositiveIntegerField(null=True, blank=True)
    compaction_error_replaced = models.PositiveIntegerField(null=True, blank=True)
    manifest = models.JSONField(default=list, blank=True, db_default=models.Value([], output_field=models.JSONField()))
    # Economics: an idle session is paused at `pause_at`; only seconds with a
    # run in progress count as active, billed as session hours at pause, expiry or end.
    pause_at = models.DateTimeField(null=True, blank=True)
    paused_at = models.DateTimeField(null=True, blank=True)
    active_seconds = models.FloatField(default=0, db_default=0)
    unbilled_active_seconds = models.FloatField(default=0, db_default=0)
    predecessor = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="successors")
    # The Claude Code CLI's own id for this session (`runtime: "cli"`): what a heartbeat
    # resumes. Its transcript is kept in `cli_transcript_entries` or under PAPERCLIP_HOME.
    cli_session_id = models.CharField(max_length=64, blank=True, default="", db_default="")
    # The file store's version of that transcript: the committed size in bytes of each of
    # its files (by path below the agent's `cli/` folder). A run appends its lines before
    # the COMMIT that names their new sizes, so lines past a file's size (a worker killed
    # before its COMMIT) or a file not named are never read, and the next write cuts them.
    # NULL: written before sizes were kept; the files are read whole.
    cli_transcript_sizes = models.JSONField(null=True, blank=True, default=None)
    # Keep-warm (`sessions_app.cache_refresh`): the last decision whether to refresh the
    # cached prefix before the next wake, with its figures, and when the next refresh is due
    # (NULL: none). A refresh is no use of the session: it never moves last_used or expiry.
    keep_warm = models.JSONField(null=True, blank=True, default=None)
    cache_refresh_at = models.DateTimeField(null=True, blank=True)
    # `claude-managed`: the Managed Agents session this one is at Anthropic, which a
    # heartbeat sends its task to; the remote session keeps the conversation, this row a
    # mirror of it. Ending this row archives it, deleting this row deletes it
    # (`ManagedSessionEnd`). NULL for every other runtime (a nullable column is added to
    # this table without rebuilding it under the ledger's triggers on SQLite).
    managed_session_id = models.CharField(max_length=128, null=True, blank=True, default=None)
    # The maintenance pass's last reading of that remote session (`sessions_app.managed_health`):
    # when, what was wrong ("" or NULL: nothing), how many readings in a row failed to reach
    # it, and when it was found ended at the provider (terminated, archived or unknown), after
    # which the next heartbeat retires this row (`remote_lost`) and opens a new remote session
    # with a handoff note from the mirrored history. Nullable: added without a table rebuild.
    managed_checked_at = models.DateTimeField(null=True, blank=True)
    managed_problem = models.TextField(null=True, blank=True)
    managed_check_failures = models.PositiveIntegerField(null=True, blank=True)
    managed_lost_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "agent_sessions"
        ordering = ["-last_used"]
        indexes = [
            # Sessions list of one agent, newest use first (API, admin inline), and the
            # heartbeat's lookup of the agent's live session.
            models.Index(fields=["agent", "-last_used"], name="sessions_agent_last_used_idx"),
            # Retention: ended sessions whose history is still kept, oldest end first.
            models.Index(
                fields=["ended_at"],
                name="sessions_unpurged_ended_idx",
                condition=Q(history_purged_at__isnull=True) & Q(status__in=["expired", "ended"]),
            ),
            # The maintenance pass's refreshes falling due (normally few rows).
            models.Index(
                fields=["cache_refresh_at"],
                name="sessions_refresh_due_idx",
                condition=Q(cache_refresh_at__isnull=False),
            ),
            # The idle-pause task: active sessions whose pause_at has passed.
            models.Index(fields=["pause_at"], name="sessions_active_pause_idx", condition=Q(status="active")),
            # The billing catch-up of maintenance: ended sessions whose active time is
            # still unbilled (normally none, so the index stays empty).
            models.Index(
                fields=["ended_at"],
                name="sessions_unbilled_ended_idx",
                condition=Q(unbilled_active_seconds__gt=0) & Q(status__in=["expired", "ended"]),
            ),
            # The health check's next readings: live sessions mapped to a remote session,
            # least recently checked first (only `claude-managed` rows are in it).
            models.Index(
                fields=["managed_checked_at"],
                name="sessions_managed_check_idx",
                condition=Q(managed_session_id__isnull=False) & Q(status__in=LIVE_SESSION_STATUSES),
            ),
            # The expiry task: live sessions whose expires_at has passed.
            models.Index(
                fields=["expires_at"],
                name="sessions_live_expires_idx",
                condition=Q(status__in=LIVE_SESSION_STATUSES),
            ),
        ]
        constraints = [
            # One live session per agent: two heartbeats racing to start a session cannot
            # both succeed, whatever process they run in.
            models.UniqueConstraint(
                fields=["agent"],
                condition=Q(status__in=LIVE_SESSION_STATUSES),
                name="sessions_one_live_per_agent",
            ),
        ]

    def __str__(self) -> str:
        return self.public_id

    def save(self, *args, **kwargs) -> None:
        # An instance read before one of the session's calls was billed holds an older
        # total: saving it whole would undo the ledger's addition.
        if not self._state.adding and kwargs.get("update_fields") is None and not kwargs.get("force_insert"):
            kwargs["update_fields"] = [
                field.name
                for field in self._meta.concrete_fields
                if not field.primary_key and field.name != "total_cost_usd"
            ]
        super().save(*args, **kwargs)

    @property
    def public_id(self) -> str:
        return session_public_id(self.id)

    def expiry(self, ttl: timedelta) -> datetime:
        """When the session expires: `expires_at`, or for a row inserted without it (raw
        SQL), `ttl` after its last use, as for any session."""
        return self.expires_at if self.expires_at is not None else self.last_used + ttl

    def is_live_at(self, now: datetime, *, ttl: timedelta) -> bool:
        return self.status in LIVE_SESSION_STATUSES and self.expiry(ttl) > now

    def record_turn(self, **turn) -> None:
        """A heartbeat's answer, committed to this session and saved (`turn_changes`).
        Called inside the heartbeat's commit, with the row locked and its new history
        staged (`sessions_app.stores`)."""
        assigned, added = self.turn_changes(**turn)
        for name, value in assigned.items():
            setattr(self, name, value)
        for name, value in added.items():
            setattr(self, name, getattr(self, name) + value)
        self.save()

    def turn_changes(
        self,
        *,
        message_count: int,
        manifest: list,
        started: datetime,
        finished: datetime,
        ttl: timedelta,
        idle_pause: timedelta,
        input_tokens: int | None,
        output_tokens: int | None,
        new_messages: int = 2,
        replayed: bool = True,
        active_seconds: float | None = None,
    ) -> tuple[dict, dict]:
        """What a heartbeat's answer changes on this session: `new_messages` more messages
        (the task and the answer, and the tool loop's turns between them), the clocks
        restarted from the end of the run (`finished`), the run's active time and tokens
        added (its cost is the ledger's: see `total_cost_usd`). A turn not `replayed` (a
        nothing-to-do answer) adds no message and no turn; its call is still counted and
        billed. Returns the fields set and the amounts added to counters, apart, so that
        a single UPDATE can add them to the row as it is (`heartbeat._session_append`).
        The active time is the run's unless the runtime measured it (`active_seconds`)."""
        active = max((finished - started).total_seconds(), 0.0) if active_seconds is None else active_seconds
        assigned = {
            "message_count": message_count,
            "manifest": manifest,
            "last_used": finished,
            "expires_at": finished + ttl,
            "status": SessionStatus.ACTIVE,
            "paused_at": None,
            "pause_at": finished + idle_pause,
        }
        added = {"active_seconds": active, "unbilled_active_seconds": active}
        if replayed:
            added |= {"next_seq": new_messages, "turn_count": 1}
        if input_tokens is not None:
            assigned["last_input_tokens"] = input_tokens
            added |= {"total_input_tokens": input_tokens, "total_output_tokens": output_tokens or 0}
        return assigned, added


def session_public_id(session_id: uuid.UUID | None) -> str | None:
    """The id the API and the admin show (`sess_` + 32 hex digits); None for no session."""
    return SESSION_ID_PREFIX + session_id.hex if session_id else None


def parse_uuid(value: str) -> uuid.UUID | None:
    """A plain UUID (companies, agents, runs); None if `value` is not one."""
    try:
        return uuid.UUID(str(value).strip())
    except ValueError:
        return None


def parse_session_id(value: str) -> uuid.UUID | None:
    """A session id in either public form (`sess_<hex>`) or as a plain UUID; None if neither."""
    text = str(value).strip()
    if text.startswith(SESSION_ID_PREFIX):
        text = text[len(SESSION_ID_PREFIX) :]
        if len(text) != 32:
            return None
    return parse_uuid(text)


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    # The work check found nothing to do: no model call, no ledger row, session untouched.
    SKIPPED = "skipped"
    # Sent through the Message Batches API (`sessions_app.batches`): no worker holds it;
    # the batch poll commits its answer, or sends it direct. Holds the agent's one place
    # in flight, as `running` does.
    SUBMITTED = "submitted"
    # A Managed Agents turn stopped at a tool that asks first (`sessions_app.approvals`): no
    # worker holds it; an operator's approval or denial lets the next worker continue the
    # same turn. Holds the agent's one place in flight, as `running` does.
    WAITING_APPROVAL = "waiting_approval"
    # A Managed Agents turn whose worker died (`sessions_app.managed_resume`): the next
    # worker continues the same turn from the remote session's events, never sending its
    # task twice. Holds the agent's one place in flight, as `running` does.
    RESUMING = "resuming"


class BatchState(models.TextChoices):
    """Where a `submitted` run's request is (`sessions_app.batches`)."""

    PARKED = "parked"  # waiting for the next poll to put it in a batch
    SUBMITTING = "submitting"  # taken by a poll, which is creating the batch
    IN_BATCH = "in_batch"  # in batch `batch_id`, not ended yet
    ANSWERED = "answered"  # its result is billed and kept: the next poll commits it
    DIRECT = "direct"  # errored, expired, cancelled or too late: sent direct instead


# The statuses that hold an agent's one place in flight (runs_one_in_flight_per_agent).
IN_FLIGHT_RUN_STATUSES = (RunStatus.RUNNING, RunStatus.SUBMITTED, RunStatus.WAITING_APPROVAL, RunStatus.RESUMING)
UNFINISHED_RUN_STATUSES = (RunStatus.QUEUED, *IN_FLIGHT_RUN_STATUSES)
# A run in flight that holds its agent's place: no other such run of the agent may start.
HOLDS_AGENT_PLACE = Q(status__in=IN_FLIGHT_RUN_STATUSES, beside__isnull=True)


class BesideState(models.TextChoices):
    """Where a summary written beside its agent's heartbeats is (`HeartbeatRun.beside`)."""

    CALLING = "calling"
    WAITING = "waiting"


FINISHED_RUN_STATUSES = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.SKIPPED)


class RunTrigger(models.TextChoices):
    API = "api", "API"
    SCHEDULE = "schedule"
    COMMAND = "command"
    ADMIN = "admin"
    COMPACTION = "compaction"  # a summary made after a heartbeat's commit (`compaction_ahead`)
    CACHE_REFRESH = "cache_refresh"  # a read that keeps the cached prefix warm (`cache_refresh`)


# A batch run's request (its whole history, while it is parked or in a batch) and its
# answer until committed: read by the batch machinery only. Every list and page of runs
# leaves them out.
RUN_BATCH_COLUMNS = ("batch_request", "batch_answer")


@dataclass(frozen=True)
class ReadAhead:
    """A row a heartbeat's step read in an earlier step's round trip
    (`sessions_app.hot_sql.write_then_read`), for the step that needs it; `row` is None
    when there was none."""

    row: models.Model | None


class HeartbeatRun(models.Model):
    # Not columns: the agent's live session as the claim read it, after its UPDATE (for the
    # plan), and the agent's next queued run as the commit read it, after its COMMIT (for
    # the release); None when that step did not read it, and the step using it reads it.
    live_session_read: ReadAhead | None = None
    next_queued_read: ReadAhead | None = None
    # Not a column: its agent's last runs' creation, newest first, when the claim read them
    # (`sessions_app.run_queue.claim_run`); None elsewhere, where they are read when needed.
    recent_wakes: tuple | None = None
    # Not a column: the task cluster the claim left the run to, its agent being pinned to
    # that cluster's host (`sessions_app.run_queue.run_cluster`); None when it runs anywhere.
    runs_in: str | None = None

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="runs")
    # runs_agent_created_idx leads with agent_id and serves its lookups and cascades (the
    # partial unique and unfinished-run indexes hold only some runs, so they cannot).
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="runs", db_index=False)
    session = models.ForeignKey(AgentSession, null=True, blank=True, on_delete=models.SET_NULL, related_name="runs")
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    trigger = models.CharField(max_length=16, choices=RunTrigger.choices, default=RunTrigger.API)
    task = models.TextField()
    force_fresh = models.BooleanField(default=False)
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)
    output = models.TextField(blank=True, default="")
    error_code = models.CharField(max_length=64, blank=True, default="")
    error = models.TextField(blank=True, default="")
    model = models.TextField(blank=True, default="")
    message_id = models.CharField(max_length=MESSAGE_ID_MAX_LENGTH, blank=True, default="")
    stop_reason = models.CharField(max_length=STOP_REASON_MAX_LENGTH, blank=True, default="")
    input_tokens = models.PositiveIntegerField(null=True, blank=True)
    output_tokens = models.PositiveIntegerField(null=True, blank=True)
    cache_creation_input_tokens = models.PositiveIntegerField(null=True, blank=True)
    cache_read_input_tokens = models.PositiveIntegerField(null=True, blank=True)
    cost_usd = models.DecimalField(max_digits=20, decimal_places=10, null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_default=Now(), editable=False)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # A run still `running` after this moment is presumed dead (killed worker) and reaped.
    deadline_at = models.DateTimeField(null=True, blank=True)
    # Spend held against budgets while the call is in flight, so that concurrent runs
    # cannot all pass a limit that only one of them fits under.
    reserved_usd = models.DecimalField(max_digits=20, decimal_places=10, default=0)
    warning = models.TextField(blank=True, default="")
    # host:pid of the process running it, so an operator can find (or a test can kill) it.
    claimed_by = models.CharField(max_length=255, blank=True, default="")
    # Scheduled ticks that found this run queued or running and were served by it instead
    # of queueing another run (no pile-up behind a busy agent).
    merged_ticks = models.PositiveIntegerField(default=0, db_default=0)
    # What a runtime reported of its work (Claude Code: turns, tool calls, its own cost
    # figure beside the ledger's); null for a single model call.
    runtime_report = models.JSONField(null=True, blank=True)
    # What the agent's work check printed (or its URL answered), bounded: appended to the
    # task the model sees.
    work_check_output = models.TextField(blank=True, default="", db_default="")
    # The answer was the agent's nothing-to-do marker: billed and shown, never replayed.
    nothing_to_do = models.BooleanField(default=False, db_default=False)
    # Attempts put back in the queue by a provider's quota refusal (`sessions_app.quota`):
    # not failures. `calls_before` is how many calls those attempts billed, so that the
    # next attempt numbers its ledger rows after them (the ledger dedupes by number).
    quota_requeues = models.PositiveSmallIntegerField(default=0, db_default=0)
    calls_before = models.PositiveSmallIntegerField(default=0, db_default=0)
    # Batch delivery (`sessions_app.batches`): the batch the request went in, where it is,
    # the Messages API parameters sent (the answer is committed only to the same request),
    # the answer kept until it is committed, and when the run stops waiting for it.
    # The delivery asked for when the run was queued: an API caller's `delivery`, a
    # scheduled tick's agent configuration; every other run's is direct. `batch_state`
    # says what became of a batch request.
    delivery = models.CharField(
        max_length=16, choices=Delivery.choices, default=Delivery.DIRECT, db_default=Delivery.DIRECT
    )
    batch_id = models.CharField(max_length=128, blank=True, default="", db_default="")
    batch_state = models.CharField(max_length=16, choices=BatchState.choices, blank=True, default="", db_default="")
    batch_request = models.JSONField(null=True, blank=True)
    batch_answer = models.JSONField(null=True, blank=True)
    batch_deadline_at = models.DateTimeField(null=True, blank=True)
    # When a poll took it to send (`submitting`): a poll that dies before writing the batch
    # id leaves the next one to find the batch among those the provider created since.
    batch_submitted_at = models.DateTimeField(null=True, blank=True)
    # `claude-managed`: the remote session this run sent its task to, written before the
    # task is sent, so a session the run created is never lost to a worker's death.
    managed_session_id = models.CharField(max_length=128, null=True, blank=True, default=None)
    # A Managed Agents turn that waits for an operator (`waiting_approval`): what the turn
    # streamed so far, the tool calls waiting, the operator's decision once given; and
    # when the wait ends in `approval_expired` unless someone decides.
    managed_turn = models.JSONField(null=True, blank=True, default=None)
    approval_deadline_at = models.DateTimeField(null=True, blank=True)
    # A summary made after a heartbeat's commit (`compaction_ahead`) does not hold its
    # agent's place while its model call goes on (`calling`), so heartbeats go on beside it;
    # it then waits for the place to commit (`waiting`: no heartbeat is claimed meanwhile)
    # and holds it to its end (NULL, as every other run).
    beside = models.CharField(max_length=8, choices=BesideState.choices, null=True, blank=True, default=None)

    # Set by the claim, not stored: the credential this run was claimed to probe (the one
    # run let through when a hold on it ends), or None; and, when a hold kept it queued,
    # until when (a waiting request is then answered at once, queued).
    quota_probe: str | None = None
    quota_held_until: datetime | None = None

    class Meta:
        db_table = "heartbeat_runs"
        ordering = ["-created_at"]
        indexes = [
            # Runs list of one agent, newest first. Ordered by created_at rather than
            # started_at because a queued run has not started yet and must still list.
            models.Index(fields=["agent", "-created_at"], name="runs_agent_created_idx"),
            # One-writer check and scheduled-tick skip: the agent's unfinished runs; also
            # the reaper's scan. Partial, so it stays tiny however long the history.
            models.Index(
                fields=["agent", "status"],
                name="runs_unfinished_idx",
                condition=Q(status__in=UNFINISHED_RUN_STATUSES),
            ),
            # The console's failed runs of the last day, by error code and by agent
            # (paperclip/console.py): failures only, so it stays a fraction of the table.
            models.Index(fields=["created_at"], name="runs_failed_created_idx", condition=Q(status="failed")),
            # Managed Agents orphans (`managed_orphans_end`): the last day's runs that made a
            # remote session (none for other runtimes).
            models.Index(
                fields=["finished_at"], name="runs_managed_finished_idx", condition=Q(managed_session_id__isnull=False)
            ),
            # The batch poll's scan: only submitted runs.
            models.Index(
                fields=["batch_state", "created_at"], name="runs_submitted_idx", condition=Q(status="submitted")
            ),
            # Whether a batch listed at the provider is one of ours (`batches_recover`): only
            # runs that went in a batch.
            models.Index(fields=["batch_id"], name="runs_batch_id_idx", condition=~Q(batch_id="")),
        ]
        constraints = [
            # One writer per agent: at most one run in flight (running, or submitted in a
            # batch) holding the agent's place, enforced by the database so that any number
            # of web and worker processes on any hosts are safe.
            models.UniqueConstraint(fields=["agent"], condition=HOLDS_AGENT_PLACE, name="runs_one_running_per_agent"),
            # And at most one summary written beside its heartbeats.
            models.UniqueConstraint(
                fields=["agent"],
                condition=Q(status__in=IN_FLIGHT_RUN_STATUSES, beside__isnull=False),
                name="runs_one_beside_per_agent",
            ),
            models.UniqueConstraint(
                fields=["agent", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="runs_idempotency_key_per_agent",
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.id} ({self.status})"

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_RUN_STATUSES


class CredentialHold(models.Model):
    """A provider credential refused by a quota or a rate limit, held until its reset.

    One row per credential, kept after release (`held_until` null) so its history shows.
    Named by a fingerprint (`adapters.rate_limits.credential_fingerprint`), never the key.
    While `held_until` is set no run that would use the credential is claimed, except the
    one probe let through once it has passed (`probe_run`, until `probe_until`); see
    `sessions_app.quota`."""

    credential = models.CharField(max_length=64, unique=True)
    held_until = models.DateTimeField(null=True, blank=True)
    code = models.CharField(max_length=32, blank=True, default="")  # rate_limited, credit_exhausted, usage_limit, paced
    reason = models.TextField(blank=True, default="")
    held_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    # Refusals since the hold began (the first, then each probe refused again).
    refusals = models.PositiveIntegerField(default=0)
    probe_run = models.UUIDField(null=True, blank=True)
    probe_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "credential_holds"
        ordering = ["credential"]
        indexes = [
            # "Is anything held?", asked by every claim in the claim's own query: it reads
            # this index, which holds only the rows of credentials held now.
            models.Index(fields=["credential"], name="holds_active_idx", condition=Q(held_until__isnull=False)),
        ]

    def __str__(self) -> str:
        return f"{self.credential} ({self.status_text})"

    @property
    def status_text(self) -> str:
        """ "held until T, reason" for people (the console, the API, /api/health)."""
        if self.held_until is None:
            return "not held"
        return f"held until {self.held_until.astimezone(UTC).isoformat(timespec='seconds')}, {self.reason}"


class ApiKey(models.Model):
    """A company-scoped API key. Only its SHA-256 is stored; the key is shown once."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200, blank=True, default="")
    prefix = models.CharField(max_length=16, editable=False)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "api_keys"
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name or self.company_id})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class CompactionKind(models.TextChoices):
    SUMMARIZE = "summarize"
    SERVER = "server"
    HANDOFF = "handoff"


class SessionCompaction(models.Model):
    """One compaction of a session: the turns it replaced, kept verbatim, and its summary.

    The archive of a session is the union of its compactions' `archived_messages`; with
    the active history it accounts for every message ever sent, in order (`seq`).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # compactions_session_idx leads with session_id and serves its lookups and cascades.
    session = models.ForeignKey(AgentSession, on_delete=models.CASCADE, related_name="compactions", db_index=False)
    run = models.ForeignKey(HeartbeatRun, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    kind = models.CharField(max_length=16, choices=CompactionKind.choices)
    created_at = models.DateTimeField(default=timezone.now)
    archived_messages = models.JSONField(default=list)
    messages_before = models.PositiveIntegerField(default=0)
    messages_after = models.PositiveIntegerField(default=0)
    tokens_before = models.PositiveIntegerField(default=0)
    tokens_after = models.PositiveIntegerField(default=0)
    summary = models.TextField(blank=True, default="")
    model = models.TextField(blank=True, default="")
    # The summary and its retry when a pinned fact was missing (`sessions_app.pins`).
    cost_usd = models.DecimalField(max_digits=20, decimal_places=10, default=0)
    cost_event_id = models.BigIntegerField(null=True, blank=True)
    # The facts the summary was checked for, each {"text", "source": "pin" | "candidate",
    # "passed": in the model's summary, "via": "summary" | "retry" | "kept_facts" | ""}.
    facts = models.JSONField(default=list, blank=True, db_default=models.Value([], output_field=models.JSONField()))
    summary_attempts = models.PositiveSmallIntegerField(default=1, db_default=1)

    class Meta:
        db_table = "session_compactions"
        ordering = ["created_at"]
        indexes = [
            # A session's archive and compaction records, in order (API, admin page).
            models.Index(fields=["session", "created_at"], name="compactions_session_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} of {self.session_id} at {self.created_at:%Y-%m-%d %H:%M}"


class CliTranscriptEntry(models.Model):
    """One line of a Claude Code transcript, mirrored through the SDK's SessionStore
    (`sessions_app.cli_transcripts`, the `database` store). `scope` is the agent: the
    SDK's keys (project, session, subpath) are unique only within it. The line is kept as
    JSON text, exactly as it round-trips: a tool's output may hold NUL characters, which
    PostgreSQL refuses in jsonb but which JSON text escapes."""

    id = models.BigAutoField(primary_key=True)
    scope = models.UUIDField()
    project_key = models.CharField(max_length=255)
    session_id = models.CharField(max_length=255)
    subpath = models.CharField(max_length=255, blank=True, default="")
    line = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "cli_transcript_entries"
        verbose_name = "CLI transcript entry"
        verbose_name_plural = "CLI transcript entries"
        indexes = [
            models.Index(fields=["scope", "project_key", "session_id", "subpath", "id"], name="cli_transcript_key_idx")
        ]

    def __str__(self) -> str:
        return f"{self.session_id} #{self.id}"


# Limits of pinned facts: each is sent with every summary request and may be carried
# verbatim in every summary, so together they must stay a small part of a session.
MAX_PINS_PER_AGENT = 50
MAX_PIN_CHARS = 500


class PinRefused(RunFailure):
    """A pin cannot be created: `code` is `invalid_pin` (a 400 naming `text`) or
    `too_many_pins` (409)."""


def pin_text_validate(text: object) -> str:
    """The pin's text, stripped; refused when it is not a non-empty string of storable
    Unicode within MAX_PIN_CHARS characters."""
    if not isinstance(text, str) or not text.strip():
        raise PinRefused("invalid_pin", "text must be a non-empty string.")
    if not is_storable(text):
        raise PinRefused("invalid_pin", "text must be valid Unicode without NUL characters.")
    text = text.strip()
    if len(text) > MAX_PIN_CHARS:
        raise PinRefused("invalid_pin", f"text is {len(text)} characters; the limit is {MAX_PIN_CHARS}.")
    return text


class PinnedFact(models.Model):
    """A fact an operator pinned on an agent. Every summary of its sessions (a compaction,
    compact now, a rotation's handoff note) must carry it (`sessions_app.pins`).

    Pinned on the agent rather than a session: a session ends at every rotation, and a fact
    worth pinning is one that must outlive it."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # pins_agent_created_idx leads with agent_id and serves its lookups and cascades.
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="pins", db_index=False)
    text = models.TextField(max_length=MAX_PIN_CHARS)
    created_at = models.DateTimeField(default=timezone.now, db_default=Now(), editable=False)

    class Meta:
        db_table = "pinned_facts"
        ordering = ["created_at"]
        indexes = [
            # The agent's pins, oldest first: every summary request, the API list, the admin inline.
            models.Index(fields=["agent", "created_at"], name="pins_agent_created_idx"),
        ]

    def __str__(self) -> str:
        return self.text[:80]

    def clean(self) -> None:
        try:
            self.text = pin_text_validate(self.text)
        except PinRefused as exc:
            raise ValidationError({"text": exc.message}) from None


class ManagedEndAction(models.TextChoices):
    ARCHIVE = "archive"
    DELETE = "delete"


class ManagedSessionEnd(models.Model):
    """A remote Managed Agents session to archive or delete at Anthropic: written in the
    transaction that ends or deletes the session here, carried out after it
    (`sessions_app.managed_sessions.managed_ends_process`) and retried by the maintenance
    pass until the provider confirms it, so our row and the remote session always end up
    agreeing. A failure is kept and shown (admin, /api/health), never forgotten."""

    id = models.BigAutoField(primary_key=True)
    remote_session_id = models.CharField(max_length=128)
    action = models.CharField(max_length=16, choices=ManagedEndAction.choices)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+", db_index=False)
    # Plain ids: the session row (and, for a hard delete, the agent) may be gone.
    agent_id = models.UUIDField(null=True, blank=True)
    session_id = models.UUIDField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_default=Now(), editable=False)
    attempts = models.PositiveIntegerField(default=0, db_default=0)
    last_error = models.TextField(blank=True, default="", db_default="")
    next_attempt_at = models.DateTimeField(default=timezone.now, db_default=Now())
    done_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "managed_session_ends"
        ordering = ["-created_at"]
        indexes = [
            # The maintenance pass's retries falling due (normally none).
            models.Index(
                fields=["next_attempt_at"], name="managed_ends_pending_idx", condition=Q(done_at__isnull=True)
            ),
            models.Index(fields=["company", "-created_at"], name="managed_ends_company_idx"),
        ]
        constraints = [
            # A remote session is archived at most once and deleted at most once.
            models.UniqueConstraint(fields=["remote_session_id", "action"], name="managed_ends_one_per_action"),
        ]

    def __str__(self) -> str:
        return f"{self.action} {self.remote_session_id}"


class ManagedOutput(models.Model):
    """A file a Managed Agents session produced (its session-scoped Files), copied here when
    the remote session ended and before it was archived or deleted
    (`sessions_app.managed_outputs`): the product's own copy once the provider's is gone.
    Kept with the agent, after its session's row is gone too; deleted with the agent."""

    id = models.BigAutoField(primary_key=True)
    # Indexed for the company's deletion, which cascades here.
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    agent = models.ForeignKey("Agent", on_delete=models.CASCADE, related_name="managed_outputs", db_index=False)
    # A plain id: the session row may be deleted, and its outputs kept.
    session_id = models.UUIDField(null=True, blank=True)
    remote_session_id = models.CharField(max_length=128)
    file_id = models.CharField(max_length=128)
    filename = models.CharField(max_length=255)
    media_type = models.CharField(max_length=255, blank=True, default="")
    size_bytes = models.BigIntegerField()
    sha256 = models.CharField(max_length=64, blank=True, default="", help_text="Empty when not stored.")
    skipped = models.TextField(blank=True, default="", help_text="Why the file was not copied (a size limit).")
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        db_table = "managed_outputs"
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["agent", "-created_at", "-id"], name="managed_outputs_agent_idx")]
        constraints = [
            # An extraction retried after a failure never copies a file twice.
            models.UniqueConstraint(fields=["remote_session_id", "file_id"], name="managed_outputs_one_per_file"),
        ]

    def __str__(self) -> str:
        return self.filename

    @property
    def stored(self) -> bool:
        return not self.skipped


class DeletedManagedOutput(models.Model):
    """A copied output an operator deleted. Its file stays at the provider while its remote
    session lives, and that session can be extracted again (an end retried, or its deletion
    after its archive): this row keeps the file from being copied back. Goes with the agent."""

    id = models.BigAutoField(primary_key=True)
    agent = models.ForeignKey("Agent", on_delete=models.CASCADE, related_name="+")
    remote_session_id = models.CharField(max_length=128)
    file_id = models.CharField(max_length=128)
    deleted_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        db_table = "managed_outputs_deleted"
        constraints = [
            models.UniqueConstraint(
                fields=["remote_session_id", "file_id"], name="managed_outputs_deleted_one_per_file"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.remote_session_id}/{self.file_id}"
