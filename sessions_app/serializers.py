"""Request and response shapes of the API (documented in docs/api.md).

Input fields are strict: a number is not a string, "yes" is not a boolean, and an unknown
key is an error (a typo such as `"wiat": true` must not silently queue a run).
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from costs_app.models import Delivery
from costs_app.money import MoneyField, usd
from sessions_app.adapters import adapter_for
from sessions_app.agent_health import agent_health, facts_of, with_health_facts
from sessions_app.approvals import approval_pending
from sessions_app.keep_warm import keep_warm_report
from sessions_app.model_checks import agent_model_info
from sessions_app.models import (
    MAX_PIN_CHARS,
    Agent,
    AgentSession,
    AgentStatus,
    BatchState,
    Company,
    HeartbeatRun,
    PinnedFact,
    RunStatus,
    session_public_id,
)
from sessions_app.pins import PinRefused, pin_text_validate
from sessions_app.quota import hold_json, holds_now
from sessions_app.work_checks import agent_backoff


class StrictCharField(serializers.CharField):
    default_error_messages = {"invalid": "Must be a string."}

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    default_error_messages = {"invalid": "Must be true or false."}

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


@extend_schema_field({"type": "object", "additionalProperties": True})
class StrictDictField(serializers.JSONField):
    default_error_messages = {"invalid": "Must be a JSON object."}

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            self.fail("invalid")
        return data


class StrictIntegerField(serializers.IntegerField):
    default_error_messages = {"invalid": "Must be a whole number."}

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class NoUnknownFieldsMixin:
    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ["The body must be a JSON object."]})
        writable = {name for name, field in self.fields.items() if not field.read_only}
        unknown = sorted(set(data) - writable)
        if unknown:
            raise serializers.ValidationError({name: ["Unknown field."] for name in unknown})
        return super().to_internal_value(data)


# Companies


AGENT_MODEL_INFO_SCHEMA = {
    "type": "object",
    "nullable": True,
    "properties": {
        "model": {"type": "string"},
        "display_name": {"type": "string", "nullable": True},
        "lifecycle": {"type": "string", "enum": ["active", "deprecated", "retired", "unknown"]},
        "deprecated_at": {"type": "string", "format": "date-time", "nullable": True},
        "retires_at": {"type": "string", "format": "date-time", "nullable": True},
        "max_input_tokens": {"type": "integer", "nullable": True},
        "max_tokens": {"type": "integer", "nullable": True},
        "warning": {"type": "string"},
    },
}


HEALTH_SCHEMA = {
    "type": "object",
    "properties": {
        "state": {"type": "string", "enum": ["ok", "late", "down", "failing"]},
        "reason": {"type": "string"},
        "due_at": {"type": "string", "format": "date-time", "nullable": True},
        "down_at": {"type": "string", "format": "date-time", "nullable": True},
    },
}
QUOTA_SCHEMA = {
    "type": "object",
    "nullable": True,
    "properties": {
        "credential": {"type": "string"},
        "held_until": {"type": "string", "format": "date-time"},
        "code": {"type": "string", "enum": ["rate_limited", "credit_exhausted", "usage_limit", "paced"]},
        "reason": {"type": "string"},
        "status": {"type": "string"},
        "held_at": {"type": "string", "format": "date-time", "nullable": True},
        "refusals": {"type": "integer"},
        "probing": {"type": "boolean"},
    },
}


class CompanySerializer(NoUnknownFieldsMixin, serializers.ModelSerializer):
    name = StrictCharField(max_length=200, allow_blank=False, trim_whitespace=True)

    class Meta:
        model = Company
        fields = ["id", "name", "created_at"]
        read_only_fields = ["id", "created_at"]


# Agents


def json_merge_patch(target: object, patch: object) -> object:
    """RFC 7386: `patch` applied to `target`. An object patch merges into an object key by
    key, recursively, a null removing its key; anything else replaces the target whole."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = json_merge_patch(merged.get(key), value)
    return merged


class AgentSerializer(NoUnknownFieldsMixin, serializers.ModelSerializer):
    company_id = serializers.UUIDField(read_only=True)
    name = StrictCharField(max_length=200, allow_blank=False)
    system_prompt = StrictCharField(allow_blank=True, required=False, trim_whitespace=False)
    adapter_type = StrictCharField(required=False, max_length=64)
    adapter_config = StrictDictField(
        required=False,
        help_text="Adapter settings, e.g. {'session_mode': 'persistent', 'session_ttl_hours': 24}; `model` names "
        "a model of the catalogue (or one with an override price; unset: the default model). Validated when "
        "saved (after a PATCH, the merged result); a bad value is a 400 naming `adapter_config.<key>`. PATCH "
        "merges it into the agent's (RFC 7386 JSON merge patch: a key set to null is removed) unless it changes "
        "`adapter_type`; PUT replaces it. A `process` agent names a command of the operator's "
        "PAPERCLIP_PROCESS_COMMANDS (`command`, with `args` its entry allows).",
    )
    status = serializers.ChoiceField(
        choices=[AgentStatus.ACTIVE, AgentStatus.PAUSED],
        required=False,
        help_text="`paused` stops scheduled and API heartbeats (409) until set back to `active`.",
    )
    idle_streak = serializers.IntegerField(
        read_only=True, help_text="Runs in a row that found no work (skipped, or a nothing-to-do answer)."
    )
    backoff_factor = serializers.SerializerMethodField(
        help_text="How many times the heartbeat interval is stretched by the back-off (1: none); "
        "a cron agent wakes on every n-th time of its expression."
    )
    health = serializers.SerializerMethodField(
        help_text="The agent's health now (docs/operations.md): `state` is `ok`, `late` (a run is overdue), "
        "`down` (overdue past the grace) or `failing` (its last runs failed); with `reason`, and for a scheduled "
        "agent `due_at` and `down_at`."
    )
    quota = serializers.SerializerMethodField(
        help_text="Null, or the provider quota holding the credential this agent's calls use: `credential` (a "
        'fingerprint, never the key), `held_until`, `code`, `reason` and `status` ("held until T, reason"). '
        "Its runs wait queued until then."
    )
    model_info = serializers.SerializerMethodField(
        help_text="What the model catalogue says of `adapter_config.model`: `lifecycle` (active, deprecated, "
        "retired, or unknown when the catalogue does not list it), `deprecated_at`, `retires_at`, "
        "`max_input_tokens`, `max_tokens`, and a `warning` naming a deprecation or retirement; null without a model."
    )

    class Meta:
        model = Agent
        fields = [
            "id",
            "company_id",
            "name",
            "system_prompt",
            "adapter_type",
            "adapter_config",
            "status",
            "paused_reason",
            "idle_streak",
            "backoff_factor",
            "health",
            "quota",
            "model_info",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "company_id", "paused_reason", "idle_streak", "created_at", "updated_at"]

    def get_backoff_factor(self, agent: Agent) -> int:
        return agent_backoff(agent.adapter_config, agent.idle_streak)

    def _holds(self) -> dict:
        # Read once per response, a list's included: the holds in force now (few rows).
        holds = self.context.get("credential_holds")
        if holds is None:
            holds = self.context["credential_holds"] = {hold.credential: hold for hold in holds_now()}
        return holds

    @extend_schema_field(HEALTH_SCHEMA)
    def get_health(self, agent: Agent) -> dict:
        if not hasattr(agent, "health_last_ok"):  # one agent, not read by a list's query
            agent = with_health_facts(Agent.objects.filter(pk=agent.pk)).first() or agent
        facts = facts_of(agent, held_credentials=frozenset(self._holds()))
        return agent_health(facts, now=self.context.get("now") or timezone.now()).as_json()

    @extend_schema_field(QUOTA_SCHEMA)
    def get_quota(self, agent: Agent) -> dict | None:
        adapter = adapter_for(agent.adapter_type, agent.adapter_config)
        hold = self._holds().get(adapter.credential(agent.adapter_config)) if adapter is not None else None
        return hold_json(hold) if hold is not None else None

    @extend_schema_field(AGENT_MODEL_INFO_SCHEMA)
    def get_model_info(self, agent: Agent) -> dict | None:
        info = agent_model_info(agent.adapter_config)
        if info is None:
            return None
        return {**info, "deprecated_at": iso_time(info["deprecated_at"]), "retires_at": iso_time(info["retires_at"])}

    def validate(self, attrs: dict) -> dict:
        # A PATCH is a merge patch of the configuration the agent has (RFC 7386), unless it
        # changes the adapter type: a configuration belongs to its type, and the old one's
        # keys (and defaults) would be unknown to the new. Changing only the type gives the
        # new type's defaults (as a PUT leaving it out), never the old type's keys, which the
        # new one would refuse. The type compared is the cleaned one: " claude-code " sent
        # for a claude-code agent changes nothing, and must not replace its configuration.
        # The model validates the result.
        agent = self.instance
        if not self.partial or agent is None:
            return attrs
        if attrs.get("adapter_type", agent.adapter_type) != agent.adapter_type:
            attrs.setdefault("adapter_config", Agent._meta.get_field("adapter_config").get_default())
        elif "adapter_config" in attrs:
            attrs["adapter_config"] = json_merge_patch(agent.adapter_config, attrs["adapter_config"])
        return attrs


# Sessions


# The sessions list serves up to 200 rows a page from tables of many thousands; DRF's
# per-field machinery costs ~0.4 ms a row, more than the query. So the list reads plain
# values (never `history`) and builds the same JSON as SessionSerializer by hand; a test
# holds the two to identical output.
SESSION_LIST_COLUMNS = (
    "id",
    "agent_id",
    "status",
    "message_count",
    "created_at",
    "last_used",
    "expires_at",
    "store",
    "adapter_type",
    "model",
    "last_input_tokens",
    "total_input_tokens",
    "total_output_tokens",
    "total_cost_usd",
    "ended_at",
    "end_reason",
    "history_purged_at",
    "turn_count",
    "archived_message_count",
    "compaction_count",
    "compaction_error",
    "compaction_error_at",
    "predecessor_id",
)


class SessionSerializer(serializers.ModelSerializer):
    """A session without its history: every column read here is on the row itself."""

    id = serializers.SerializerMethodField(help_text="`sess_` + 32 hex digits.")
    agent_id = serializers.UUIDField(read_only=True)
    predecessor_id = serializers.SerializerMethodField()
    total_cost_usd = MoneyField(read_only=True, help_text="USD, as a decimal string.")

    class Meta:
        model = AgentSession
        fields = list(SESSION_LIST_COLUMNS)
        read_only_fields = fields

    def get_id(self, session: AgentSession) -> str:
        return session.public_id

    def get_predecessor_id(self, session: AgentSession) -> str | None:
        return session_public_id(session.predecessor_id)


def iso_time(value: datetime | None) -> str | None:
    """As DRF's DateTimeField renders it: ISO 8601 in UTC, with a Z."""
    if value is None:
        return None
    text = value.astimezone(UTC).isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def session_list_item(row: dict) -> dict:
    return {
        "id": session_public_id(row["id"]),
        "agent_id": str(row["agent_id"]),
        "status": row["status"],
        "message_count": row["message_count"],
        "created_at": iso_time(row["created_at"]),
        "last_used": iso_time(row["last_used"]),
        "expires_at": iso_time(row["expires_at"]),
        "store": row["store"],
        "adapter_type": row["adapter_type"],
        "model": row["model"],
        "last_input_tokens": row["last_input_tokens"],
        "total_input_tokens": row["total_input_tokens"],
        "total_output_tokens": row["total_output_tokens"],
        "total_cost_usd": usd(row["total_cost_usd"]),
        "ended_at": iso_time(row["ended_at"]),
        "end_reason": row["end_reason"],
        "history_purged_at": iso_time(row["history_purged_at"]),
        "turn_count": row["turn_count"],
        "archived_message_count": row["archived_message_count"],
        "compaction_count": row["compaction_count"],
        "compaction_error": row["compaction_error"],
        "compaction_error_at": iso_time(row["compaction_error_at"]),
        "predecessor_id": session_public_id(row["predecessor_id"]),
    }


class HistoryMessageSerializer(serializers.Serializer):
    role = serializers.CharField(help_text="`user` or `assistant`.")
    content = serializers.JSONField(help_text="Text, or a list of Messages API content blocks.")
    at = serializers.CharField(required=False, help_text="When the turn was recorded (ISO 8601).")
    run_id = serializers.CharField(required=False)
    usage = serializers.DictField(required=False)


@extend_schema_field(HistoryMessageSerializer(many=True))
class HistoryField(serializers.Field):
    """The turns exactly as stored (read through the session's store by the view)."""

    def to_representation(self, value):
        return value


class SessionDetailSerializer(SessionSerializer):
    history = HistoryField(read_only=True)
    manifest = serializers.JSONField(read_only=True, help_text="Artifacts the agent reported, kept across compactions.")

    cli_session_id = serializers.CharField(
        read_only=True, help_text='Claude Code\'s own id of the session (`runtime: "cli"`); empty otherwise.'
    )

    managed_session_id = serializers.SerializerMethodField(
        help_text="The Managed Agents session this one is at Anthropic (`claude-managed`); empty otherwise."
    )

    keep_warm = serializers.SerializerMethodField(
        help_text="Keep-warm: the last decision whether to refresh the cached prompt before the next wake "
        "(its figures in USD, from the price source), when the next refresh is due, and what the "
        "refreshes sent so far cost and saved (from the ledger: the prefix the wakes after them read instead of "
        "writing again, at the write price less the read price, less their cost). Null when keep-warm never applied."
    )

    class Meta(SessionSerializer.Meta):
        fields = [
            *SessionSerializer.Meta.fields,
            "manifest",
            "cli_session_id",
            "managed_session_id",
            "keep_warm",
            "history",
        ]
        read_only_fields = fields

    def get_managed_session_id(self, session) -> str:
        return session.managed_session_id or ""

    def get_keep_warm(self, session) -> dict | None:
        return keep_warm_report(session)


class SessionListSerializer(serializers.Serializer):
    sessions = SessionSerializer(many=True)
    next = serializers.CharField(allow_null=True, help_text="Cursor of the next page; null on the last page.")


# Heartbeat runs


class UsageSerializer(serializers.Serializer):
    input_tokens = serializers.IntegerField(allow_null=True)
    output_tokens = serializers.IntegerField(allow_null=True)
    cache_creation_input_tokens = serializers.IntegerField(allow_null=True)
    cache_read_input_tokens = serializers.IntegerField(allow_null=True)


class ToolLoopSerializer(serializers.Serializer):
    rounds = serializers.IntegerField(help_text="Rounds of tool calls carried out (at most max_tool_rounds).")
    tool_calls = serializers.IntegerField()
    tool_errors = serializers.IntegerField(help_text="Tool calls answered with an error result.")
    cleared_tool_uses = serializers.IntegerField(help_text="Tool uses cleared by clear_tool_uses.")
    cleared_input_tokens = serializers.IntegerField(help_text="Input tokens cleared by clear_tool_uses.")


class RuntimeReportField(serializers.JSONField):
    """A runtime's report as stored, its cost figures as money by the one rule (Claude Code
    reports its own as a float: 0.07438860000000001 is "0.0743886"; Managed Agents report
    cents, so 30 cents is stored as "0.3")."""

    MONEY_KEYS = ("cli_total_cost_usd", "list_cost_usd", "list_cost_turn_usd", "ledger_cost_usd")

    def to_representation(self, value):
        if not isinstance(value, dict):
            return value
        money = {}
        for key in self.MONEY_KEYS:
            try:
                money[key] = usd(value[key])
            except (KeyError, TypeError, ValueError, ArithmeticError):
                pass  # absent, null, or not a number: as stored
        return {**value, **money}


class RunSerializer(serializers.ModelSerializer):
    status = serializers.ChoiceField(
        choices=RunStatus.choices,
        help_text="`skipped`: no model call, nothing billed; the work check found no work, or a queued "
        "compaction found its session changed since the commit that asked for it.",
    )
    work_check_output = serializers.CharField(
        help_text="What the agent's work check printed (or its URL answered), appended to the task; bounded."
    )
    nothing_to_do = serializers.BooleanField(
        help_text="The answer was the agent's nothing_to_do_marker: billed and shown, never replayed."
    )
    session_id = serializers.SerializerMethodField(help_text="`sess_` + 32 hex digits; null for stateless runs.")
    agent_id = serializers.UUIDField()
    usage = serializers.SerializerMethodField()
    error = serializers.SerializerMethodField()
    error_code = serializers.SerializerMethodField()
    warning = serializers.SerializerMethodField(help_text="e.g. a budget close to its limit; null when none.")
    cost_usd = MoneyField(allow_null=True, help_text="USD, as a decimal string; null until the call answered.")
    runtime_report = RuntimeReportField(
        allow_null=True,
        help_text='Claude Code (`runtime: "cli"`): its session id, turns, tool calls, and its own cost figure '
        "beside the ledger's; null for a Messages API call.",
    )
    delivery = serializers.ChoiceField(
        choices=Delivery.choices,
        help_text="What was asked when the run was queued: the API caller's `delivery`, or a scheduled run's agent's "
        "`delivery`; `batch_state` says what became of a batch request.",
    )
    batch_id = serializers.SerializerMethodField(
        help_text='The Message Batches batch its request went in (`delivery: "batch"`); null when none.'
    )
    batch_state = serializers.SerializerMethodField(
        help_text="Where a `submitted` run's request is: parked, submitting, in_batch, answered (committed by the "
        "next poll) or direct (sent direct instead); null for a run never batched."
    )
    tool_loop = serializers.SerializerMethodField(
        help_text="What the run's tool loop did (memory tool rounds, context editing); null when nothing."
    )
    approval = serializers.SerializerMethodField(
        help_text="A Managed Agents turn that stopped at a tool that asks first: the tool calls waiting "
        "(`id`, `name`, `input`), until when (`expires_at`), and the decision once taken; null when none."
    )

    class Meta:
        model = HeartbeatRun
        fields = [
            "id",
            "status",
            "session_id",
            "output",
            "usage",
            "cost_usd",
            "error",
            "error_code",
            "warning",
            "started_at",
            "finished_at",
            "created_at",
            "agent_id",
            "task",
            "trigger",
            "force_fresh",
            "idempotency_key",
            "model",
            "message_id",
            "stop_reason",
            "merged_ticks",
            "delivery",
            "batch_id",
            "batch_state",
            "runtime_report",
            "tool_loop",
            "approval",
            "work_check_output",
            "nothing_to_do",
        ]
        read_only_fields = fields

    def get_approval(self, run: HeartbeatRun) -> dict | None:
        return approval_pending(run)

    def get_session_id(self, run: HeartbeatRun) -> str | None:
        return session_public_id(run.session_id)

    @extend_schema_field(UsageSerializer)
    def get_usage(self, run: HeartbeatRun) -> dict:
        return {
            "input_tokens": run.input_tokens,
            "output_tokens": run.output_tokens,
            "cache_creation_input_tokens": run.cache_creation_input_tokens,
            "cache_read_input_tokens": run.cache_read_input_tokens,
        }

    def get_error(self, run: HeartbeatRun) -> str | None:
        return run.error or None

    def get_error_code(self, run: HeartbeatRun) -> str | None:
        return run.error_code or None

    def get_warning(self, run: HeartbeatRun) -> str | None:
        return run.warning or None

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_batch_id(self, run: HeartbeatRun) -> str | None:
        # While a poll creates the batch the column holds that poll's token, not an id.
        return run.batch_id if run.batch_id and run.batch_state != BatchState.SUBMITTING else None

    @extend_schema_field(serializers.ChoiceField(choices=BatchState.choices, allow_null=True))
    def get_batch_state(self, run: HeartbeatRun) -> str | None:
        return run.batch_state or None

    @extend_schema_field(ToolLoopSerializer(allow_null=True))
    def get_tool_loop(self, run: HeartbeatRun) -> dict | None:
        loop = getattr(run, "tool_loop", None)  # a missing row is an AttributeError: None
        if loop is None:
            return None
        return ToolLoopSerializer(loop).data


class RunListSerializer(serializers.Serializer):
    runs = RunSerializer(many=True)
    next = serializers.CharField(allow_null=True, help_text="Cursor of the next page; null on the last page.")


class AgentListSerializer(serializers.Serializer):
    agents = AgentSerializer(many=True)
    next = serializers.CharField(allow_null=True, help_text="Cursor of the next page; null on the last page.")


class HeartbeatRequestSerializer(NoUnknownFieldsMixin, serializers.Serializer):
    task = StrictCharField(
        allow_blank=False,
        trim_whitespace=False,
        # Its length and content are checked once, where every path checks them
        # (`heartbeat.validate_task`); the view reports a refusal as this field's error.
        help_text="What the agent should do now. At most PAPERCLIP_MAX_TASK_CHARS characters.",
    )
    idempotency_key = StrictCharField(
        required=False,
        allow_null=True,
        max_length=255,
        help_text="Repeating a key returns the run it started, which never runs twice.",
    )
    force_fresh = StrictBooleanField(
        required=False, default=False, help_text="Start a new session instead of resuming."
    )
    wait = StrictBooleanField(
        required=False,
        default=False,
        help_text="true: run now and answer 200 with the finished run; false: 202 with the queued run.",
    )
    delivery = serializers.ChoiceField(
        choices=Delivery.choices,
        required=False,
        default=Delivery.DIRECT,
        help_text="`batch`: the answer call goes in a Message Batch, at half price, answered within the agent's "
        "`batch_max_wait_minutes` (default 60); not with `wait` true, and only for a runtime with a batch API "
        '(not `runtime: "cli"`, not `process`). Default `direct`.',
    )

    def validate(self, attrs: dict) -> dict:
        # A caller holding its request open for the answer would hold it for the batch.
        if attrs["wait"] and attrs["delivery"] == Delivery.BATCH:
            raise serializers.ValidationError({"delivery": '"batch" cannot be asked with "wait": true.'})
        return attrs


# Errors (documentation of the one shape every error takes)


class ErrorDetailSerializer(serializers.Serializer):
    code = serializers.CharField(help_text="Stable, machine-readable: `invalid`, `not_found`, `agent_paused`...")
    message = serializers.CharField()
    fields = serializers.DictField(
        child=serializers.CharField(), required=False, help_text="What is wrong with each offending field."
    )


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


__all__ = [
    "AgentListSerializer",
    "AgentSerializer",
    "CompanySerializer",
    "ErrorSerializer",
    "HeartbeatRequestSerializer",
    "RunListSerializer",
    "RunSerializer",
    "SessionDetailSerializer",
    "SessionListSerializer",
    "SessionSerializer",
]


class CompactRequestSerializer(NoUnknownFieldsMixin, serializers.Serializer):
    keep_recent_turns = StrictIntegerField(
        required=False,
        min_value=1,
        max_value=1000,
        help_text="Turns kept verbatim after the summary (1-1000); the agent's `keep_recent_turns` when absent.",
    )


# Pinned facts


class PinSerializer(NoUnknownFieldsMixin, serializers.ModelSerializer):
    text = StrictCharField(
        max_length=MAX_PIN_CHARS,
        allow_blank=False,
        trim_whitespace=True,
        help_text=f"The fact every summary must keep verbatim (1-{MAX_PIN_CHARS} characters, no NUL).",
    )

    class Meta:
        model = PinnedFact
        fields = ["id", "text", "created_at"]
        read_only_fields = ["id", "created_at"]

    def validate_text(self, value: str) -> str:
        try:
            return pin_text_validate(value)
        except PinRefused as exc:
            raise serializers.ValidationError(exc.message) from None
