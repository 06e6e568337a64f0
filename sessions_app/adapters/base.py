"""What every adapter shares: the request it receives, the reply it returns, config rules."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, ClassVar, Protocol, TypedDict

from django.core.exceptions import ValidationError

from sessions_app.errors import RunFailure
from sessions_app.text import storable
from sessions_app.wakes import cron_error, zone_error

DEFAULT_SESSION_TTL_HOURS = 24
MAX_SESSION_TTL_HOURS = 24 * 366
# Beyond this `now - timedelta(hours=...)` leaves the datetime range (year 1) and the
# heartbeat would fail; ten years is already "never" for a rotation.
MAX_ROTATE_AFTER_HOURS = 24 * 366 * 10


class HistoryMessage(TypedDict, total=False):
    role: str  # "user" or "assistant"
    content: Any  # str, or a list of Messages API content blocks
    at: str  # ISO 8601 time the turn was recorded
    run_id: str
    usage: dict


class UsageRecord(TypedDict, total=False):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    cache_creation: dict
    iterations: list


class OwnSessionStore(Protocol):
    """What the engine hands a runtime that keeps its own session (`keeps_own_session`):
    the session it resumes, kept in this service's stores, without the runtime touching
    a model or a transaction."""

    resumed_id: str  # the runtime's own id of the session it resumes; "" for a new one

    def run_transcript(self) -> Any:
        """The store this run's runtime reads and appends to: the resumed session as it was
        loaded before the run, and a buffer for what the run adds."""

    def on_commit(self, transcript: Any, *, session_id: str, report: dict) -> Callable:
        """The reply's `on_commit`: writes what the run added, in the heartbeat's commit."""


class CallMeter(Protocol):
    """What the engine hands a runtime that makes several model requests in one call and
    reports each one's usage as it goes (`bills_while_running`): each report is billed to
    the ledger at once, so a run cut short keeps what it spent."""

    def bill(self, *, usage: dict, model: str, message_id: str = "") -> Decimal:
        """Bill one model request now; returns its cost. A message id this call reported
        before is billed once (a runtime may report one request in parts)."""

    @property
    def billed_usd(self) -> Decimal:
        """What this call has billed so far."""

    @property
    def run_cost_usd(self) -> Decimal | None:
        """What the run's calls have billed so far, this one's and an earlier attempt's of
        the same run included (None while none reported usage): the run's ledger cost."""


@dataclass
class AdapterRequest:
    model: str
    system: str
    messages: list[dict]
    config: dict
    metadata: dict = field(default_factory=dict)
    system_blocks: list | None = None  # the system prompt as content blocks (cache markers)
    max_tokens: int | None = None  # overrides the agent's max_tokens (summaries)
    # For a runtime that keeps its own session: the engine's handle on it (`OwnSessionStore`).
    own_session: OwnSessionStore | None = None
    tools: list | None = None  # tool definitions the model may call (the tool loop)
    # For a runtime that `bills_while_running`: where it reports each model request's usage.
    meter: CallMeter | None = None


@dataclass
class AdapterReply:
    text: str
    content: Any  # what is stored as the assistant turn: the API's content blocks, or text
    model: str
    message_id: str = ""
    stop_reason: str = ""
    usage: dict | None = None  # the raw usage as the API returned it; None when it gave none
    artifacts: list = field(default_factory=list)  # artifacts the agent reported creating
    # The model the request named: what the call is priced by. `model` is what the answer
    # says, which may be a dated snapshot of it (or anything an agent command prints).
    requested_model: str = ""
    # What the engine billed for this call the moment it returned (`sessions_app.run_calls`):
    # its cost (None when no usage was reported) and, for a single model request, its row.
    cost_usd: Decimal | None = None
    cost_event_id: int | None = None
    # A runtime that calls several models in one reply (Claude Code) reports each one's
    # usage: the ledger gets a row per model, `usage` is their sum.
    usage_by_model: dict | None = None
    # What the run records of a runtime's work (turns, tool calls, its own cost figure).
    runtime_report: dict | None = None
    # Called in the commit transaction with the session the answer goes to (None when
    # stateless); may return a staged write (publish/discard) that goes with the commit.
    on_commit: Any = None
    # What context editing cleared from the request (the API's `context_management`).
    context_management: dict | None = None
    # The tool loop's turns before this answer (assistant tool_use, user tool_result, ...),
    # recorded with it in the session's history, and its rounds.
    exchanges: list = field(default_factory=list)
    tool_rounds: int = 0
    # What the provider said is left of its rate limits (`rate_limits.Headroom`), if it did.
    headroom: Any = None
    # The session's active time this call by the provider's own measure (Managed Agents'
    # `usage.active_seconds`), which its session hours are priced on; None: the run's clock.
    active_seconds: float | None = None

    @property
    def priced_model(self) -> str:
        """The model the ledger prices and records this call by: the one requested (an
        agent command configured with none is priced by the model it reports)."""
        return self.requested_model or self.model

    def __post_init__(self) -> None:
        # Every reply is made storable where it enters the engine, so that no later write
        # (history, run output, summaries, the ledger's raw usage) can fail on it.
        self.text = storable(self.text)
        self.content = storable(self.content)
        self.model = storable(self.model)
        self.message_id = storable(self.message_id)
        self.stop_reason = storable(self.stop_reason)
        self.usage = storable(self.usage)
        self.artifacts = storable(self.artifacts)
        self.usage_by_model = storable(self.usage_by_model)
        self.runtime_report = storable(self.runtime_report)


# No single call reads or writes anywhere near this many tokens (the largest context
# windows hold about a million); a count beyond it is a broken report, and it would not
# fit the ledger's integer columns.
MAX_TOKENS_PER_CALL = 100_000_000


def usage_error(usage: dict | None) -> str | None:
    """Why a reported usage cannot be recorded as it is, or None when it can."""
    if usage is None:
        return None
    entries = [("usage", usage)]
    if isinstance(usage.get("cache_creation"), dict):
        entries.append(("usage.cache_creation", usage["cache_creation"]))
    iterations = usage.get("iterations")
    if iterations is not None and not isinstance(iterations, list):
        return "`usage.iterations` must be a list."
    for index, iteration in enumerate(iterations or []):
        if isinstance(iteration, dict):
            entries.append((f"usage.iterations.{index}", iteration))
    for where, entry in entries:
        for key, value in entry.items():
            if (
                key.endswith("tokens")
                and value is not None
                and not (is_int(value) and 0 <= value <= MAX_TOKENS_PER_CALL)
            ):
                return f"`{where}.{key}` must be a whole number of tokens in 0..{MAX_TOKENS_PER_CALL}, got {value!r}."
    return None


@dataclass(frozen=True)
class BatchResult:
    """One request's result in an ended batch: `succeeded` with the answer's message (as
    JSON), or `errored`, `expired` or `canceled` with what the provider said."""

    kind: str
    message: dict | None = None
    error: str = ""


@dataclass(frozen=True)
class ListedBatch:
    """A batch as the provider lists it: enough to tell whether it may hold a request of
    ours (when it was created, how many requests) and whether its results can be read."""

    id: str
    created_at: datetime
    ended: bool
    requests: int


@dataclass(frozen=True)
class BatchListing:
    """The batches created since a moment, newest first; `complete` False when the page
    bound stopped the listing before it reached that moment."""

    batches: list[ListedBatch]
    complete: bool


class AdapterError(RunFailure):
    """A model call that failed. `code` is stable and stored on the run for operators."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retryable: bool = False,
        runtime_report: dict | None = None,
        active_seconds: float | None = None,
    ) -> None:
        super().__init__(code, message)
        self.retryable = retryable
        # What a runtime stopped short (at one of its caps, its timeout) reports of the work
        # it did: kept on the failed run, as on a succeeded one.
        self.runtime_report = runtime_report
        # The session's active time during the failed call by the provider's measure
        # (`AdapterReply.active_seconds`); None: the run's clock.
        self.active_seconds = active_seconds


class ApprovalNeeded(AdapterError):
    """Not a failure: the runtime's turn waits for an operator to approve its tool calls
    (`sessions_app.approvals`). `state` is what the runtime needs to continue the same turn
    once someone decided (JSON: kept on the run meanwhile)."""

    def __init__(self, state: dict) -> None:
        super().__init__("approval_needed", "The turn waits for an operator to approve a tool call.")
        self.state = state


class QuotaRefused(AdapterError):
    """The provider refused the call for a spent quota, or a rate limit whose reset lies
    beyond the retry window (`adapters.rate_limits`). Not a failure of the run: the engine
    holds the credential the call used until the reset and puts the run back in the queue
    (`sessions_app.quota`). The reset is `wait` from the refusal (a `retry-after`, counted
    on the run's own clock) or the moment `reset_at`; neither: the provider named none."""

    def __init__(
        self, code: str, message: str, *, reset_at: datetime | None = None, wait: timedelta | None = None
    ) -> None:
        super().__init__(code, message, retryable=True)
        self.reset_at = reset_at
        self.wait = wait

    def reset(self, *, now: datetime) -> datetime | None:
        """When the refusal says the credential may be used again, seen from `now`."""
        return now + self.wait if self.wait is not None else self.reset_at


class Adapter:
    """What every adapter is. The optional abilities are declared here, absent by default,
    and an adapter that has one says so: callers read the declaration, never probe."""

    type_name: ClassVar[str]
    config_keys: ClassVar[set[str]]
    # False: the engine keeps the session's history and replays it with every request
    # (planned, rotated, compacted to fit). True: the runtime resumes a session it keeps
    # itself; the engine sends only the new turn and records the turn it reports back.
    keeps_own_session: ClassVar[bool] = False
    # Where the engine keeps such a session: "cli_transcripts" (Claude Code's transcript,
    # `sessions_app.cli_transcripts`) or "managed" (the remote session's id and mirror,
    # `sessions_app.managed_sessions`).
    own_session_store: ClassVar[str] = ""
    # True: such a session is still rotated by the agent's `rotate_after_*` settings (the
    # old one ended, a new one started, with no handoff note: Managed Agents); False: never
    # (Claude Code compacts its own and resumes it for as long as it lives).
    rotates_own_session: ClassVar[bool] = False
    # True: one call may make several model requests, whose usage the runtime reports to
    # `request.meter` as each ends (Claude Code); the engine bills the reply's usage otherwise.
    bills_while_running: ClassVar[bool] = False
    # True: `count_tokens` measures a request's input exactly.
    counts_tokens: ClassVar[bool] = False
    # True: a request may go through the provider's batch API at its batch price, to be
    # answered within hours (`sessions_app.batches`): `batch_params` .. `batch_reply`.
    delivers_batch: ClassVar[bool] = False

    def validate_config(self, config: dict, errors: dict[str, str]) -> dict:
        raise NotImplementedError

    def call(self, request: AdapterRequest) -> AdapterReply:
        raise NotImplementedError

    def call_seconds(self, config: dict) -> float:
        """The longest one call (or token count) with this configuration may take, its
        retries and the waits between them included: the run's deadline covers it."""
        raise NotImplementedError

    def count_tokens(self, request: AdapterRequest) -> int:
        """The request's input tokens (only where `counts_tokens`)."""
        raise NotImplementedError

    def batch_params(self, request: AdapterRequest) -> dict | None:
        """The request as one batch entry's parameters (JSON); None when this request cannot
        go in a batch (only where `delivers_batch`)."""
        raise NotImplementedError

    def batch_send(self, config: dict, entries: list[tuple[str, dict]]) -> str:
        """Create one batch of `(custom_id, params)` entries; returns its id."""
        raise NotImplementedError

    def batch_read(self, config: dict, batch_id: str) -> dict[str, BatchResult] | None:
        """A batch's results by custom id once it has ended; None while it processes."""
        raise NotImplementedError

    def batch_cancel(self, config: dict, batch_id: str) -> None:
        """Ask the provider to stop a batch: requests not yet answered end `canceled`."""
        raise NotImplementedError

    def batch_reply(self, request: AdapterRequest, message: dict) -> AdapterReply:
        """A succeeded batch result's message as the reply a direct call would return."""
        raise NotImplementedError

    def batch_list(self, config: dict, *, since: datetime, pages: int) -> BatchListing:
        """The provider's batches created at or after `since`, newest first, reading at most
        `pages` pages (only where `delivers_batch`)."""
        raise NotImplementedError

    def batch_custom_ids(self, config: dict, batch_id: str) -> Iterator[str]:
        """The custom ids of an ended batch's results, streamed: a batch may hold 100,000
        (only where `delivers_batch`)."""
        raise NotImplementedError

    def reservation_usd(self, config: dict) -> Decimal | None:
        """What a budgeted heartbeat holds before the call, for a runtime with a spending cap
        of its own that covers the whole call; None: each request is sized and reserved."""
        return None

    def credential(self, config: dict) -> str | None:
        """The fingerprint of the provider credential this configuration's calls use
        (`adapters.rate_limits.credential_fingerprint`, never the secret itself), which a
        quota refusal holds; None: the adapter uses none this service knows of."""
        return None

    def for_config(self, config: dict) -> Adapter:
        """The adapter an agent's configuration selects (an adapter type with runtimes)."""
        return self


class AgentConfigError(ValidationError):
    """Invalid agent configuration; `fields` maps `adapter_config.<key>` to what is wrong."""

    def __init__(self, fields: dict[str, str]) -> None:
        self.fields = fields
        grouped: dict[str, list[str]] = {}
        for name, message in fields.items():
            top, _, key = name.partition(".")
            grouped.setdefault(top, []).append(f"{key}: {message}" if key else message)
        super().__init__(grouped)


# The keys every adapter accepts; each adapter adds its own.
COMMON_KEYS = {
    "session_mode",
    "session_ttl_hours",
    "heartbeat_interval_minutes",
    "heartbeat_cron",
    "heartbeat_timezone",
    "heartbeat_task",
    "idle_pause_minutes",
    # Context management (sessions_app/context.py)
    "context_strategy",
    "context_budget_tokens",
    "summary_model",
    "keep_recent_turns",
    "rotate_after_turns",
    "rotate_after_input_tokens",
    "rotate_after_hours",
    # No-work heartbeats (sessions_app/work_checks.py, sessions_app/no_work.py)
    "work_check",
    "nothing_to_do_marker",
    "backoff_after_runs",
    "backoff_max_factor",
    # Health (sessions_app/agent_health.py)
    "health_grace_minutes",
    "health_failing_after_runs",
    # Delivery (sessions_app/batches.py) and the prompt cache kept warm (sessions_app/keep_warm.py)
    "delivery",
    "batch_max_wait_minutes",
    "cache_keep_warm",
    # The task cluster the agent's runs execute in (sessions_app/run_queue.py: run_cluster)
    "cluster",
}
# What PAPERCLIP_CLUSTER_NAME may be (paperclip/settings.py).
CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
DELIVERIES = ("direct", "batch")
DEFAULT_BATCH_MAX_WAIT_MINUTES = 60
# The Message Batches API answers every batch within 24 hours.
MAX_BATCH_MAX_WAIT_MINUTES = 24 * 60
KEEP_WARM_CHOICES = ("auto", "off")
CONTEXT_STRATEGIES = ("none", "summarize", "server")


def is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    # JSON integers are unbounded: math.isfinite(10**400) raises OverflowError (a 500 on
    # save). Integers are exact, so the range checks that follow bound them instead.
    return isinstance(value, int) or math.isfinite(value)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_common(config: dict, errors: dict[str, str]) -> dict:
    clean: dict[str, Any] = {}
    mode = config.get("session_mode", "stateless")
    if mode not in ("stateless", "persistent"):
        errors["session_mode"] = f"must be 'stateless' or 'persistent', got {mode!r}"
    clean["session_mode"] = mode
    ttl = config.get("session_ttl_hours", DEFAULT_SESSION_TTL_HOURS)
    if not is_number(ttl) or ttl <= 0:
        errors["session_ttl_hours"] = f"must be a positive number of hours, got {ttl!r}"
    elif ttl > MAX_SESSION_TTL_HOURS:
        errors["session_ttl_hours"] = f"must be at most {MAX_SESSION_TTL_HOURS} hours, got {ttl!r}"
    clean["session_ttl_hours"] = ttl
    if "heartbeat_interval_minutes" in config:
        interval = config["heartbeat_interval_minutes"]
        if interval is not None and (not is_int(interval) or not 1 <= interval <= 60 * 24 * 31):
            errors["heartbeat_interval_minutes"] = (
                f"must be a whole number of minutes (1..44640) or null, got {interval!r}"
            )
        clean["heartbeat_interval_minutes"] = interval
    validate_cron(config, errors, clean)
    validate_context(config, errors, clean)
    _optional_int(config, "idle_pause_minutes", errors, clean, low=1, high=60 * 24 * 366)
    _optional_int(config, "health_grace_minutes", errors, clean, low=1, high=60 * 24 * 366)
    _optional_int(config, "health_failing_after_runs", errors, clean, low=1, high=1000)
    validate_delivery(config, errors, clean)
    if "heartbeat_task" in config:
        task = config["heartbeat_task"]
        if task is not None and (not isinstance(task, str) or not task.strip() or "\x00" in task):
            errors["heartbeat_task"] = "must be the text of the scheduled task, or null"
        clean["heartbeat_task"] = task
    if "cluster" in config:
        cluster = config["cluster"]
        if cluster is not None and (not isinstance(cluster, str) or not CLUSTER_NAME.fullmatch(cluster)):
            errors["cluster"] = (
                "must be the PAPERCLIP_CLUSTER_NAME of the task cluster its runs execute in (letters, digits, "
                f"'.', '_', '-'; at most 64), or null, got {cluster!r}"
            )
        clean["cluster"] = cluster
    return clean


def validate_delivery(config: dict, errors: dict[str, str], clean: dict) -> None:
    """`delivery` of scheduled heartbeats ("direct", or "batch" answered within
    `batch_max_wait_minutes`) and `cache_keep_warm`; whether the runtime can deliver by
    batch is the adapter's to say (`validate_agent_config`)."""
    if "delivery" in config:
        if config["delivery"] not in DELIVERIES:
            errors["delivery"] = f"must be 'direct' or 'batch', got {config['delivery']!r}"
        clean["delivery"] = config["delivery"]
    _optional_int(config, "batch_max_wait_minutes", errors, clean, low=1, high=MAX_BATCH_MAX_WAIT_MINUTES)
    if "cache_keep_warm" in config:
        if config["cache_keep_warm"] not in KEEP_WARM_CHOICES:
            errors["cache_keep_warm"] = f"must be 'auto' or 'off', got {config['cache_keep_warm']!r}"
        clean["cache_keep_warm"] = config["cache_keep_warm"]


def validate_cron(config: dict, errors: dict[str, str], clean: dict) -> None:
    """`heartbeat_cron` read in `heartbeat_timezone`: instead of an interval, never with one.
    A zone without an expression is refused rather than ignored: it would look like it
    shifts an interval, which it cannot."""
    cron = config.get("heartbeat_cron")
    if "heartbeat_cron" in config:
        if cron is not None and (message := cron_error(cron)):
            errors["heartbeat_cron"] = message
        elif cron is not None and config.get("heartbeat_interval_minutes") is not None:
            errors["heartbeat_cron"] = "cannot be combined with heartbeat_interval_minutes: set one of them"
        clean["heartbeat_cron"] = cron
    if "heartbeat_timezone" in config:
        zone = config["heartbeat_timezone"]
        if zone is not None and (message := zone_error(zone)):
            errors["heartbeat_timezone"] = message
        elif zone is not None and cron is None:
            errors["heartbeat_timezone"] = "applies only to heartbeat_cron: set a cron expression, or remove it"
        clean["heartbeat_timezone"] = zone


def validate_model(config: dict, errors: dict[str, str], clean: dict) -> None:
    """`model` is a model id (whether the catalogue knows it is checked when the agent is
    saved: sessions_app.model_checks, which also fills in the default model)."""
    if "model" not in config:
        return
    model = config["model"]
    if not isinstance(model, str) or not model.strip() or len(model) > 200:
        errors["model"] = f"must be a model id from the model catalogue (manage.py prices), got {model!r}"
    clean["model"] = model


def validate_timeout(config: dict, errors: dict[str, str], clean: dict, *, default: float) -> None:
    timeout = config.get("timeout_seconds", default)
    if not is_number(timeout) or not 0 < timeout <= 3600:
        errors["timeout_seconds"] = f"must be a number of seconds in (0, 3600], got {timeout!r}"
    clean["timeout_seconds"] = timeout


def _optional_int(config: dict, key: str, errors: dict[str, str], clean: dict, *, low: int, high: int) -> None:
    if key not in config:
        return
    value = config[key]
    if value is not None and (not is_int(value) or not low <= value <= high):
        errors[key] = f"must be a whole number in {low}..{high} or null, got {value!r}"
    clean[key] = value


def validate_context(config: dict, errors: dict[str, str], clean: dict) -> None:
    if "context_strategy" in config:
        strategy = config["context_strategy"]
        if strategy not in CONTEXT_STRATEGIES:
            errors["context_strategy"] = f"must be one of {', '.join(CONTEXT_STRATEGIES)}, got {strategy!r}"
        clean["context_strategy"] = strategy
    _optional_int(config, "context_budget_tokens", errors, clean, low=1000, high=2_000_000)
    _optional_int(config, "keep_recent_turns", errors, clean, low=1, high=1000)
    _optional_int(config, "rotate_after_turns", errors, clean, low=1, high=1_000_000)
    _optional_int(config, "rotate_after_input_tokens", errors, clean, low=1000, high=2_000_000)
    if "rotate_after_hours" in config:
        hours = config["rotate_after_hours"]
        if hours is not None and (not is_number(hours) or not 0 < hours <= MAX_ROTATE_AFTER_HOURS):
            errors["rotate_after_hours"] = (
                f"must be a positive number of hours (at most {MAX_ROTATE_AFTER_HOURS}) or null, got {hours!r}"
            )
        clean["rotate_after_hours"] = hours
    if "summary_model" in config:
        model = config["summary_model"]
        if model is not None and (not isinstance(model, str) or not model.strip()):
            errors["summary_model"] = f"must be a model name or null, got {model!r}"
        clean["summary_model"] = model
