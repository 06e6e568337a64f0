"""`claude-managed`: the agent runs on Claude Managed Agents, through the `anthropic` SDK's
`client.beta` (agents, environments, sessions and their events; the SDK sends the beta
header `managed-agents-2026-04-01` itself).

The session lives at Anthropic: a heartbeat sends its task as a `user.message` event to
the remote session and reads the session's event stream until it is idle again. The
engine keeps the mapping, the mirror of the conversation, the ledger and the session's
end (`sessions_app.managed_sessions`), handed to each run as `request.own_session`: this
module touches no model and no transaction.

- Money: every `span.model_request_end` is billed through the engine's meter the moment it
  arrives, priced like any call; session hours come from the remote session's
  `usage.active_seconds` (what the service prices its runtime on), not our clock.
- A stateless agent's session is made for one heartbeat and archived when it ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Protocol

from sessions_app.adapters.base import (
    Adapter,
    AdapterError,
    AdapterReply,
    AdapterRequest,
    ApprovalNeeded,
    QuotaRefused,
    usage_error,
)
from sessions_app.adapters.claude_cli import api_usage, usage_total
from sessions_app.adapters.claude_code import client_for, error_from_sdk
from sessions_app.adapters.claude_managed_config import (
    CONFIG_KEYS,
    DEFAULT_TIMEOUT_SECONDS,
    RemoteAgent,
    budget_cents,
    digest,
    problems_here,
    remote_sync,
    session_resources,
    validate_managed_config,
)
from sessions_app.adapters.rate_limits import api_credential

# How the remote session's idle states end a run that is not a plain end of turn.
STOP_FAILURES = {
    "budget_reached": ("managed_budget_reached", "The session reached its budget (max_budget_usd)."),
    "retries_exhausted": ("managed_retries_exhausted", "The session gave up after its model retries."),
    "refusal": ("managed_refusal", "The model refused to continue."),
    "requires_action": ("managed_requires_action", "The session waits for a tool confirmation."),
}
RESULT_CHARS = 2000
CHUNK_BYTES = 1 << 16
# One reading of one session in the maintenance pass: a slow provider must not hold the pass.
HEALTH_TIMEOUT_SECONDS = 10.0
MOUNTS_KEY = "paperclip_resources"
# Reads a turn makes beside its own (no database work: the SDK's client is thread-safe).
CURSORS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="managed-cursor")


# --- one heartbeat ------------------------------------------------------------------------


class ManagedSessions(Protocol):
    """What the engine hands this runtime (`request.own_session`): the remote state it keeps
    in this service's database, written the moment the runtime learns it."""

    resumed_id: str  # the remote session the agent's live session maps to; "" for none
    persistent: bool
    # A turn that goes on (`TurnStart.state`): one an operator decided on, or one whose
    # worker died (`resume`).
    continuation: dict | None
    turn_begun: bool  # `turn_started` was called: the task may have reached the session

    def remote(self) -> dict | None: ...

    def remote_record(self, remote: dict) -> None: ...

    def turn_started(self, state: dict) -> None:
        """Where the turn stands before its opening events are sent (`TurnStart.state`,
        with the event cursor and the opening events): kept on the run for a worker that
        continues the turn if this one dies, with the remote session it goes to, so that a
        session the run made is never lost to a worker's death."""

    def session_end_later(self, remote_session_id: str) -> None:
        """A remote session no row will resume: archived after the run, retried until done."""

    def handoff_note(self) -> str:
        """The note a new remote session opens with when it replaces a lost one ("": none)."""

    def turn_time(self, seconds: float) -> None:
        """The remote session's active time in a turn that ended well (what session hours are
        billed on); a failed turn's goes with its `AdapterError`."""

    def list_cost_check(self, report: dict, cost: Decimal | None) -> None:
        """The service's list cost of the turn (`report`) beside the ledger's (`cost`): a
        disagreement is logged and added to the run's warning."""

    def on_commit(self, *, remote_session_id: str):
        """The reply's `on_commit`, or None when the commit has nothing of this runtime's to
        write (the turn went to the remote session the agent's session already names)."""


@dataclass(frozen=True)
class Figures:
    """What a remote session had spent at a moment: its active time and its list cost."""

    active_seconds: float
    list_cost: Decimal | None

    @classmethod
    def of(cls, session) -> Figures:
        cost = session.usage.list_cost  # absent until the service tracks the session's cost
        return cls(
            active_seconds=float(session.usage.active_seconds or 0.0),
            list_cost=Decimal(cost.amount) / 100 if cost is not None and cost.currency == "USD" else None,
        )


@dataclass
class Turn:
    """What one turn of the remote session streamed."""

    blocks: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    billed: list = field(default_factory=list)
    stop: str = ""
    terminated: bool = False
    error: str = ""  # the last error the session reported (it may have recovered since)
    last_event_id: str = ""
    waiting_on: list = field(default_factory=list)  # the events a requires_action stop names

    def pending_tools(self) -> list[dict]:
        """The tool calls the session waits to have confirmed."""
        return [block for block in self.blocks if block["type"] == "tool_use" and block["id"] in self.waiting_on]

    @classmethod
    def of_state(cls, state: dict) -> Turn:
        return cls(blocks=list(state["blocks"]), texts=list(state["texts"]), billed=[tuple(b) for b in state["billed"]])


@dataclass(frozen=True)
class TurnStart:
    """Where a turn began: its remote session, the session's figures then, the session it
    replaced, and whether this run made the session."""

    session_id: str
    before: Figures
    replaced: str
    made_here: bool

    def state(self, turn: Turn, after: Figures, extra: dict) -> dict:
        """The turn so far as JSON, for the run to keep (while it waits for an approval, or
        for the worker that continues it if this one dies), with `extra` (what waits for an
        approval, the decision taken)."""
        return extra | {
            "session": self.session_id,
            "made_here": self.made_here,
            "replaced": self.replaced,
            "before": {"active_seconds": self.before.active_seconds, "list_cost": _decimal_text(self.before.list_cost)},
            "active_seconds": max(after.active_seconds - self.before.active_seconds, 0.0),
            "blocks": turn.blocks,
            "texts": turn.texts,
            "billed": [list(entry) for entry in turn.billed],
        }

    @classmethod
    def of_state(cls, state: dict) -> TurnStart:
        before = state["before"]
        cost = before.get("list_cost")
        return cls(
            session_id=state["session"],
            before=Figures(float(before["active_seconds"]), Decimal(cost) if cost is not None else None),
            replaced=state.get("replaced", ""),
            made_here=bool(state.get("made_here")),
        )


def _decimal_text(value: Decimal | None) -> str | None:
    return str(value) if value is not None else None


class ClaudeManagedAdapter(Adapter):
    type_name = "claude-managed"
    keeps_own_session = True  # the remote session keeps the conversation; the engine sends the new turn
    own_session_store = "managed"
    rotates_own_session = True
    bills_while_running = True  # each model request's usage arrives as its span ends
    config_keys = CONFIG_KEYS

    def validate_config(self, config: dict, errors: dict[str, str]) -> dict:
        return validate_managed_config(config, errors)

    def credential(self, config: dict) -> str | None:
        return api_credential()

    def call_seconds(self, config: dict) -> float:
        return float(config.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS))

    def reservation_usd(self, config: dict) -> Decimal:
        """What a budgeted heartbeat holds before the turn: the remote session's enforced
        budget, the most the session can spend, of which one turn spends at most all (the
        service stops issuing model requests once its list cost reaches it)."""
        cents = budget_cents(config)
        if cents is None:
            # A turn makes as many model requests as the agent wants: nothing else bounds it.
            raise AdapterError(
                "managed_budget_cap_required",
                "A budget applies to this agent: set adapter_config.max_budget_usd, the remote session's "
                "enforced spending cap, so that a turn can be held against the budget.",
            )
        return Decimal(cents) / 100

    def call(self, request: AdapterRequest) -> AdapterReply:
        # Checked again here, with this worker's mode and lists: the row may predate them,
        # or have been written around validation.
        problems = problems_here(request.config)
        if problems:
            detail = "; ".join(f"adapter_config.{key}: {message}" for key, message in problems.items())
            raise AdapterError(
                "managed_not_allowed", f"This agent's Managed Agents settings may not run here: {detail}"
            )
        own: ManagedSessions = request.own_session
        anthropic = _sdk()
        client = client_for({**request.config, "max_retries": 2})
        try:
            return self._call(client, request, own)
        except AdapterError:
            raise
        except anthropic.AnthropicError as exc:
            error = error_from_sdk(exc)
            if isinstance(error, QuotaRefused) and own.turn_begun:
                # The task may have reached the session: putting the run back in the queue
                # would send it again. The run fails; the session keeps what it did.
                error = AdapterError(error.code, error.message)
            raise error from None

    def _call(self, client, request: AdapterRequest, own: ManagedSessions) -> AdapterReply:
        state = own.continuation
        resuming = state is not None and bool(state.get("resume"))  # its worker died: the same turn goes on
        # The resumed session's last event, read while its status is: both before anything is sent.
        cursor_ahead = CURSORS.submit(self._cursor, client, own.resumed_id) if own.resumed_id and not state else None
        if resuming:
            start, turn, opening = TurnStart.of_state(state), Turn.of_state(state), state["opening"]
        else:
            start, turn, opening = self._opening(client, request, own)
        # A stateless run's session ends with it; so does, when the turn fails, a session
        # this run made: no row names it, and the next heartbeat starts afresh. A turn that
        # waits for an approval keeps its session.
        ends_with_run = not own.persistent
        try:
            if resuming:
                cursor = state["cursor"]
            else:
                # Where the session's events stood before this run sent anything: a worker
                # that dies from here on leaves the next one what it needs to find the rest.
                if start.made_here:
                    cursor = ""
                else:
                    cursor = cursor_ahead.result() if cursor_ahead else self._cursor(client, start.session_id)
                own.turn_started(start.state(turn, start.before, state or {}) | {"cursor": cursor, "opening": opening})
            self._turn(client, request, start.session_id, opening, turn, resume_after=cursor if resuming else None)
            after = Figures.of(client.beta.sessions.retrieve(start.session_id))
            if turn.stop == "requires_action" and (pending := turn.pending_tools()):
                ends_with_run = False
                raise ApprovalNeeded(start.state(turn, after, {"pending": pending}))
            if turn.terminated or turn.stop in STOP_FAILURES:
                raise self._failure(start, turn, after)
        except ApprovalNeeded:
            raise
        except BaseException:
            ends_with_run = ends_with_run or start.made_here
            raise
        finally:
            if ends_with_run:
                own.session_end_later(start.session_id)
        report = self._report(start, turn, after)
        own.turn_time(report["active_seconds"])
        own.list_cost_check(report, request.meter.run_cost_usd)
        usage = usage_total(usage for _, usage in turn.billed)
        return AdapterReply(
            text="\n\n".join(turn.texts),
            content=turn.blocks or [{"type": "text", "text": ""}],
            model=request.model,
            requested_model=request.model,
            message_id=turn.last_event_id,
            stop_reason="end_turn",
            usage=usage,
            usage_by_model={request.model: usage} if usage is not None else None,
            runtime_report=report,
            active_seconds=report["active_seconds"],
            on_commit=own.on_commit(remote_session_id=start.session_id),
        )

    def _failure(self, start: TurnStart, turn: Turn, after: Figures) -> AdapterError:
        report = self._report(start, turn, after)
        code, message = STOP_FAILURES.get(turn.stop, ("", ""))
        if turn.terminated:
            code, message = "managed_session_terminated", turn.error or "The service terminated the session."
        return AdapterError(code, message, runtime_report=report, active_seconds=report["active_seconds"])

    def _opening(self, client, request: AdapterRequest, own: ManagedSessions) -> tuple[TurnStart, Turn, list]:
        """Where the turn begins and what it sends first: a turn that waited for an approval
        goes on with the operator's decision; any other sends its task, to the agent's remote
        session or a new one."""
        if own.continuation is not None:
            state = own.continuation
            return TurnStart.of_state(state), Turn.of_state(state), confirmations(state)
        stored = RemoteAgent.of(own.remote())
        remote = remote_sync(client, request, stored, name=f"paperclip {request.metadata.get('agent_id', '')}")
        if remote != stored:
            own.remote_record(remote.as_json())
        session, replaced, note = self._session(client, request, own, remote)
        start = TurnStart(session.id, Figures.of(session), replaced, made_here=session.id != own.resumed_id)
        content = _content(request.messages[-1]["content"])
        if note:
            content = [{"type": "text", "text": note}, *content]
        return start, Turn(), [{"type": "user.message", "content": content}]

    def _cursor(self, client, session_id: str) -> str:
        """The id of the session's last event so far ("" for none)."""
        for event in client.beta.sessions.events.list(session_id, order="desc", limit=1):
            return event.id
        return ""

    def _session(self, client, request: AdapterRequest, own: ManagedSessions, remote: RemoteAgent):
        """The remote session this turn goes to, as it was before the turn, the one it
        replaces ("" for none) and the note a new one opens with ("" for none): the resumed
        one, unless it ended at the provider (lost) or was made from an older version of the
        agent; otherwise a new one. A new one is recorded on the run with the turn's start
        (`turn_started`), before its task is sent; nothing that can fail comes between its
        creation and that record (the note is made first)."""
        anthropic = _sdk()
        lost = False
        mounts = session_resources(request.config)
        if own.resumed_id:
            try:
                session = client.beta.sessions.retrieve(own.resumed_id)
            except anthropic.NotFoundError:
                session = None
            lost = session is None or session.status == "terminated" or session.archived_at is not None
            if not lost and session.agent.version == remote.version and _mounts_current(session, mounts):
                # Recorded on the run with the turn's start (`turn_started`): the row names it already.
                return session, "", ""
            if session is not None:
                own.session_end_later(own.resumed_id)
        note = own.handoff_note() if lost or not own.resumed_id else ""
        params: dict[str, Any] = {
            "agent": {"type": "agent", "id": remote.agent_id, "version": remote.version},
            "environment_id": remote.environment_id,
            "metadata": {
                "paperclip_agent": request.metadata.get("agent_id", ""),
                "paperclip_run": request.metadata.get("run_id", ""),
                # A session's mounts are fixed when it is made: a change of them needs a new one.
                MOUNTS_KEY: digest(mounts),
            },
        }
        if mounts:
            params["resources"] = mounts
        if (cents := budget_cents(request.config)) is not None:
            params["budget"] = {"type": "limit", "max_list_cost": {"amount": str(cents), "currency": "USD"}}
        try:
            session = client.beta.sessions.create(**params)
        except anthropic.NotFoundError as exc:
            # Not a missing model: a file to mount (or the remote agent) the provider does not hold.
            mounted = ", ".join(resource["file_id"] for resource in mounts)
            raise AdapterError(
                "managed_session_not_created",
                f"The service could not create the session ({error_from_sdk(exc).message})"
                + (f"; adapter_config.resources mounts {mounted}" if mounted else ""),
            ) from None
        return session, own.resumed_id, note

    def _turn(
        self,
        client,
        request: AdapterRequest,
        session_id: str,
        opening: list[dict],
        turn: Turn,
        *,
        resume_after: str | None = None,
    ) -> Turn:
        """Send the turn's opening events (the task, or the confirmations a waiting turn
        needed) and read the session's events until it is idle again (or ended). The stream
        is opened first, so no event of the turn is missed.

        `resume_after`: the turn was begun by a worker that died, after this event. What the
        session has done since is read back first; the opening events are sent only if they
        never arrived, so a task is never sent twice (requests it billed are not billed again)."""
        timeout = float(request.config.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS))
        deadline = time.monotonic() + timeout
        with client.beta.sessions.events.stream(session_id, timeout=timeout) as stream:
            seen: set[str] = set()
            if resume_after is not None:
                done = self._events_after(client, session_id, resume_after)
                seen = {event.id for event in done}
                if not any(event.type == opening[0]["type"] for event in done):
                    client.beta.sessions.events.send(session_id, events=opening)
                for event in done:
                    if self._see(event, turn, request):
                        return turn
            else:
                client.beta.sessions.events.send(session_id, events=opening)
            for event in stream:
                if event.id in seen:
                    continue  # read back already
                if self._see(event, turn, request):
                    return turn
                if time.monotonic() > deadline:
                    break
        client.beta.sessions.events.send(session_id, events=[{"type": "user.interrupt"}])
        raise AdapterError("managed_timeout", f"The session did not finish its turn within {timeout:g} s.")

    def _events_after(self, client, session_id: str, cursor: str) -> list:
        """The session's events after `cursor` ("": all of them), oldest first: read newest
        first, so only the turn's own events are read."""
        events = []
        for event in client.beta.sessions.events.list(session_id, order="desc", limit=100):
            if event.id == cursor:
                break
            events.append(event)
        return events[::-1]

    def _see(self, event, turn: Turn, request: AdapterRequest) -> bool:
        """Record one event; True once the turn is over."""
        kind = event.type
        turn.last_event_id = event.id
        if kind == "agent.message":
            text = "".join(block.text for block in event.content if block.type == "text")
            turn.texts.append(text)
            turn.blocks.append({"type": "text", "text": text})
        elif kind in ("agent.tool_use", "agent.mcp_tool_use", "agent.custom_tool_use"):
            turn.blocks.append({"type": "tool_use", "id": event.id, "name": event.name, "input": event.input})
        elif kind in ("agent.tool_result", "agent.mcp_tool_result"):
            turn.blocks.append({"type": "tool_result", "tool_use_id": event.tool_use_id, "content": _result(event)})
        elif kind == "agent.thread_context_compacted":
            turn.blocks.append({"type": "text", "text": "[the session compacted its context]"})
        elif kind == "span.model_request_end":
            self._bill(event, turn, request)
        elif kind == "session.error":
            turn.error = _error_message(event)
        elif kind == "session.status_terminated":
            turn.terminated = True
            return True
        elif kind == "session.status_idle":
            turn.stop = event.stop_reason.type
            if turn.stop == "requires_action":
                turn.waiting_on = list(event.stop_reason.event_ids)
            return True
        return False

    def _bill(self, event, turn: Turn, request: AdapterRequest) -> None:
        reported = event.model_usage
        usage = api_usage(
            {
                "input_tokens": reported.input_tokens,
                "output_tokens": reported.output_tokens,
                "cache_read_input_tokens": reported.cache_read_input_tokens,
                "cache_creation_input_tokens": reported.cache_creation_input_tokens,
            },
            {},
        )
        if problem := usage_error(usage):
            raise AdapterError("managed_error", f"The session reported an impossible usage: {problem}")
        request.meter.bill(usage=usage, model=request.model, message_id=event.id)
        turn.billed.append((event.id, usage))

    def _report(self, start: TurnStart, turn: Turn, after: Figures) -> dict:
        before = start.before
        return {
            "managed_session_id": start.session_id,
            "model_requests": len(turn.billed),
            "active_seconds": max(after.active_seconds - before.active_seconds, 0.0),
            "stop_reason": "terminated" if turn.terminated else turn.stop,
            "list_cost_usd": str(after.list_cost) if after.list_cost is not None else None,
            "list_cost_turn_usd": str(after.list_cost - (before.list_cost or 0))
            if after.list_cost is not None
            else None,
        } | ({"replaced_session": start.replaced} if start.replaced else {})


def _mounts_current(session, mounts: list[dict]) -> bool:
    """Whether a remote session was made with these resources mounted (one made before the
    digest was kept had none)."""
    return (session.metadata or {}).get(MOUNTS_KEY, digest([])) == digest(mounts)


def remote_session_end(remote_session_id: str, *, action: str) -> str | None:
    """Archive or delete a remote session; None once done (or already gone), else why not."""
    anthropic = _sdk()
    try:
        sessions = client_for({}).beta.sessions
        if action == "delete":
            sessions.delete(remote_session_id)
        else:
            sessions.archive(remote_session_id)
    except anthropic.NotFoundError:
        return None
    except (anthropic.AnthropicError, AdapterError) as exc:
        return error_from_sdk(exc).message if isinstance(exc, anthropic.AnthropicError) else exc.message
    return None


@dataclass(frozen=True)
class RemoteHealth:
    """One reading of a remote session: `lost` when it ended at the provider (terminated,
    archived, or unknown to it), `unreachable` when it could not be read, else neither."""

    lost: bool = False
    unreachable: bool = False
    problem: str = ""


def remote_session_health(remote_session_id: str) -> RemoteHealth:
    """Read a remote session's status once (no retries: the next maintenance pass is the retry)."""
    anthropic = _sdk()
    try:
        client = client_for({"max_retries": 0, "timeout_seconds": HEALTH_TIMEOUT_SECONDS})
        session = client.beta.sessions.retrieve(remote_session_id)
    except anthropic.NotFoundError:
        return RemoteHealth(lost=True, problem="The service no longer knows the session.")
    except anthropic.AnthropicError as exc:
        return RemoteHealth(unreachable=True, problem=error_from_sdk(exc).message)
    except AdapterError as exc:  # no credential configured
        return RemoteHealth(unreachable=True, problem=exc.message)
    if session.status == "terminated":
        return RemoteHealth(lost=True, problem="The service terminated the session.")
    if session.archived_at is not None:
        return RemoteHealth(lost=True, problem="The session was archived at the service.")
    return RemoteHealth()


class OutputsUnavailable(Exception):
    """The provider did not give the session's files: the end waits for them."""


def remote_session_files(remote_session_id: str) -> list:
    """The files a remote session produced (the Files API's, scoped to it), every page."""
    anthropic = _sdk()
    try:
        return list(client_for({}).beta.files.list(scope_id=remote_session_id, limit=100))
    except anthropic.AnthropicError as exc:
        raise OutputsUnavailable(f"Could not list the session's files: {error_from_sdk(exc).message}") from None


def remote_file_chunks(file_id: str) -> Iterator[bytes]:
    """A file's content as it arrives."""
    anthropic = _sdk()
    try:
        with client_for({}).beta.files.with_streaming_response.download(file_id) as response:
            yield from response.iter_bytes(CHUNK_BYTES)
    except anthropic.AnthropicError as exc:
        raise OutputsUnavailable(f"Could not download file {file_id}: {error_from_sdk(exc).message}") from None


def remote_turn_interrupt(remote_session_id: str) -> str | None:
    """Stop a remote session's turn (one whose approval expired); None once sent, else why not."""
    anthropic = _sdk()
    try:
        client_for({}).beta.sessions.events.send(remote_session_id, events=[{"type": "user.interrupt"}])
    except anthropic.NotFoundError:
        return None
    except anthropic.AnthropicError as exc:
        return error_from_sdk(exc).message
    return None


def confirmations(state: dict) -> list[dict]:
    """The operator's decision on each tool call a waiting turn stopped at."""
    decision = state["decision"]
    deny = decision["result"] == "deny"
    return [
        {
            "type": "user.tool_confirmation",
            "tool_use_id": tool["id"],
            "result": decision["result"],
            **({"deny_message": decision["reason"]} if deny and decision.get("reason") else {}),
        }
        for tool in state["pending"]
    ]


def _content(content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": block.get("text", "")} for block in content if block.get("type") == "text"]


def _result(event) -> str:
    text = "".join(block.text for block in event.content or [] if block.type == "text")
    return (
        text if len(text) <= RESULT_CHARS else text[:RESULT_CHARS] + f"... [{len(text) - RESULT_CHARS} more characters]"
    )


def _error_message(event) -> str:
    message = event.error.message
    return f"The session reported an error: {message}" if message else "The session reported an error."


def _sdk():
    import anthropic

    return anthropic
