"""Session events for the Managed Agents fake: send, list, the SSE stream and the turn runs.

Mixed into `tests.fake_managed.FakeManaged`, whose module docstring documents the scripting
API. A turn runs in a background thread that appends events to the session's log under the
fake's lock and notifies `_changed`, so stream handlers wake as events happen. Pauses (the
latency, reschedules, sleeps) wait on that condition, releasing the lock so requests go on.
"""

from __future__ import annotations

import base64
import itertools
import json
import mimetypes
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal

USAGE_KEYS = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
PRICE_OF = {
    "input_tokens": "input",
    "output_tokens": "output",
    "cache_read_input_tokens": "cache_read",
    "cache_creation_input_tokens": "cache_write",
}
STREAM_PATH_PARTS = 5  # v1 / sessions / {id} / events / stream
PING = b'event: ping\ndata: {"type": "ping"}\n\n'


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def error_body(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


def first(query: dict, key: str) -> str | None:
    values = query.get(key)
    return values[0] if values else None


def paginate(items: list, query: dict, default_limit: int = 20) -> dict:
    """One page of `items` under the API's opaque `page` cursor (an offset, encoded so that
    callers cannot lean on its form)."""
    limit = int(first(query, "limit") or default_limit)
    cursor = first(query, "page")
    start = int(base64.urlsafe_b64decode(cursor[5:]).decode()) if cursor else 0
    end = start + limit
    next_page = None
    if end < len(items):
        next_page = "page_" + base64.urlsafe_b64encode(str(end).encode()).decode()
    return {"data": items[start:end], "next_page": next_page}


def model_usage(given: dict | None) -> dict:
    return {key: int((given or {}).get(key, 0)) for key in USAGE_KEYS}


def default_steps(n: int, text: str) -> list[tuple]:
    usage = {"input_tokens": 100 * n, "output_tokens": 20}
    return [("message", f"reply {n}: {text}", usage)]


def message_text(event: dict) -> str:
    return "".join(block.get("text", "") for block in event.get("content", []) if block.get("type") == "text")


def sse(event: dict) -> bytes:
    return f"id: {event['id']}\nevent: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def parse_time(value: str) -> datetime:
    stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)


class SessionGone(Exception):
    """The session was deleted while its turn ran."""


@dataclass
class Pending:
    """An `always_ask` tool use waiting for the user's confirmation."""

    tool_use_id: str
    name: str
    result_text: str | None
    steps: list


@dataclass
class Job:
    steps: list
    resume: tuple[Pending, dict] | None = None


@dataclass
class Run:
    active: bool = False
    interrupted: bool = False
    queue: deque = field(default_factory=deque)
    pending: Pending | None = None


class EventsMixin:
    def _init_events(self) -> None:
        self.events: dict[str, list[dict]] = {}
        self._scripts: defaultdict[str | None, deque] = defaultdict(deque)
        self._runs: defaultdict[str, Run] = defaultdict(Run)
        self._event_ids = itertools.count(1)

    def script(self, session_id: str | None, steps: list[tuple]) -> None:
        with self._lock:
            self._scripts[session_id].append(list(steps))

    def _next_script(self, session_id: str) -> list | None:
        for key in (session_id, None):
            if self._scripts[key]:
                return self._scripts[key].popleft()
        return None

    def emit(self, session_id: str, event: dict) -> dict:
        if session_id not in self.sessions:
            raise SessionGone(session_id)
        event = {"id": f"sevt_{next(self._event_ids):04d}", **event, "processed_at": now_iso()}
        self.events[session_id].append(event)
        self._changed.notify_all()
        return event

    # Send

    def send_events(self, session: dict, body: dict) -> tuple[int, dict]:
        if session["status"] == "terminated":
            return 400, error_body("invalid_request_error", f"session {session['id']} is terminated")
        events = body.get("events") or []
        run = self._runs[session["id"]]
        for event in events:
            if event.get("type") == "user.tool_confirmation" and not self._awaits(run, event):
                return 400, error_body("invalid_request_error", f"no tool use {event.get('tool_use_id')} awaits")
        recorded = [self._receive(session["id"], event) for event in events]
        return 200, {"data": recorded}

    def _awaits(self, run: Run, event: dict) -> bool:
        return run.pending is not None and run.pending.tool_use_id == event.get("tool_use_id")

    def _receive(self, session_id: str, event: dict) -> dict:
        recorded = self.emit(session_id, dict(event))
        run = self._runs[session_id]
        kind = event.get("type")
        if kind == "user.message":
            text = message_text(event)
            self.user_messages[session_id].append(text)
            n = len(self.user_messages[session_id])
            self._enqueue(session_id, Job(self._next_script(session_id) or default_steps(n, text)))
        elif kind == "user.tool_confirmation":
            pending, run.pending = run.pending, None
            self._enqueue(session_id, Job(pending.steps, resume=(pending, event)))
        elif kind == "user.interrupt":
            # An interrupt drops the work in hand and what was queued behind it.
            run.interrupted = run.active
            run.pending = None
            run.queue.clear()
            self._changed.notify_all()
        return recorded

    def _enqueue(self, session_id: str, job: Job) -> None:
        run = self._runs[session_id]
        run.queue.append(job)
        if not run.active:
            run.active = True
            threading.Thread(target=self._run_loop, args=(session_id,), daemon=True).start()

    # Turn runs

    def _run_loop(self, session_id: str) -> None:
        with self._changed:
            run = self._runs[session_id]
            try:
                while run.queue:
                    self._run_job(session_id, run.queue.popleft())
            except SessionGone:
                run.queue.clear()
            finally:
                run.active = run.interrupted = False

    def _run_job(self, session_id: str, job: Job) -> None:
        run = self._runs[session_id]
        run.interrupted = False
        self._set_status(session_id, "running")
        self.emit(session_id, {"type": "session.status_running"})
        if job.resume:
            self._confirmed(session_id, *job.resume)
        steps = deque(job.steps)
        while steps and not run.interrupted:
            kind, *args = steps.popleft()
            if getattr(self, f"_step_{kind}")(session_id, steps, *args):
                return
        self._idle(session_id, {"type": "end_turn"})

    def _model_request(self, session_id: str, outputs: list[dict], usage: dict | None) -> list[dict]:
        start = self.emit(session_id, {"type": "span.model_request_start"})
        self._pause(session_id, self.latency)
        emitted = [self.emit(session_id, output) for output in outputs]
        billed = model_usage(usage)
        self._bill(session_id, billed)
        end = {"type": "span.model_request_end", "is_error": False, "model_request_start_id": start["id"]}
        self.emit(session_id, {**end, "model_usage": billed})
        return emitted

    def _step_message(self, session_id: str, steps: deque, text: str, usage: dict | None = None) -> bool:
        content = [{"type": "text", "text": text}]
        self._model_request(session_id, [{"type": "agent.message", "content": content}], usage)
        return False

    def _step_tool(self, session_id: str, steps: deque, name: str, tool_input: dict, policy: str, result=None) -> bool:
        use = {
            "type": "agent.tool_use",
            "name": name,
            "input": tool_input,
            "evaluated_permission": "allow" if policy == "always_allow" else "ask",
            "evaluation": {"type": policy},
        }
        (event,) = self._model_request(session_id, [use], None)
        if policy == "always_allow":
            self._tool_result(session_id, event["id"], result or f"{name}: done", is_error=False)
            return False
        self._runs[session_id].pending = Pending(event["id"], name, result, list(steps))
        self._idle(session_id, {"type": "requires_action", "event_ids": [event["id"]]})
        return True

    def _confirmed(self, session_id: str, pending: Pending, confirmation: dict) -> None:
        if confirmation.get("result") == "allow":
            self._tool_result(session_id, pending.tool_use_id, pending.result_text or f"{pending.name}: done", False)
        else:
            reason = confirmation.get("deny_message") or "no reason given"
            self._tool_result(session_id, pending.tool_use_id, f"Tool use denied by the user: {reason}", True)

    def _tool_result(self, session_id: str, tool_use_id: str, text: str, is_error: bool) -> None:
        content = [{"type": "text", "text": text}]
        result = {"type": "agent.tool_result", "tool_use_id": tool_use_id, "content": content, "is_error": is_error}
        self.emit(session_id, result)

    def _step_budget_reached(self, session_id: str, steps: deque) -> bool:
        self._idle(session_id, {"type": "budget_reached"})
        return True

    def _step_retries_exhausted(self, session_id: str, steps: deque) -> bool:
        self._idle(session_id, {"type": "retries_exhausted"})
        return True

    def _step_refusal(self, session_id: str, steps: deque) -> bool:
        self._idle(session_id, {"type": "refusal"}, stop_details={"type": "refusal"})
        return True

    def _step_reschedule(self, session_id: str, steps: deque, seconds: float) -> bool:
        self._set_status(session_id, "rescheduling")
        self.emit(session_id, {"type": "session.status_rescheduled"})
        self._pause(session_id, seconds)
        self._set_status(session_id, "running")
        self.emit(session_id, {"type": "session.status_running"})
        return False

    def _step_terminate(self, session_id: str, steps: deque, message: str) -> bool:
        error = {"type": "unknown_error", "message": message, "retry_status": {"type": "terminal"}}
        self.emit(session_id, {"type": "session.error", "error": error})
        self._add_active(session_id)
        self._set_status(session_id, "terminated")
        self._runs[session_id].queue.clear()
        self.emit(session_id, {"type": "session.status_terminated"})
        return True

    def _step_file(self, session_id: str, steps: deque, filename: str, data: bytes, mime_type=None) -> bool:
        guessed = mimetypes.guess_type(filename)[0] or "application/octet-stream"
        self.add_file(session_id, filename, data, mime_type or guessed)
        return False

    def _step_sleep(self, session_id: str, steps: deque, seconds: float) -> bool:
        self._pause(session_id, seconds)
        return False

    def _pause(self, session_id: str, seconds: float) -> None:
        """Wait, releasing the lock; an interrupt, a deletion or the fake's stop cut it short."""
        deadline = time.monotonic() + seconds
        run = self._runs[session_id]
        while (left := deadline - time.monotonic()) > 0:
            if run.interrupted or self._stopping or session_id not in self.sessions:
                break
            self._changed.wait(left)
        if session_id not in self.sessions:
            raise SessionGone(session_id)

    def _idle(self, session_id: str, stop_reason: dict, stop_details: dict | None = None) -> None:
        # The session's totals are final before the idle event, so that a client reading it
        # and then retrieving the session sees this run's usage.
        self._add_active(session_id)
        self._set_status(session_id, "idle")
        event = {"type": "session.status_idle", "stop_reason": stop_reason}
        if stop_details:
            event["stop_details"] = stop_details
        self.emit(session_id, event)

    def _set_status(self, session_id: str, status: str) -> None:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionGone(session_id)
        session["status"] = status
        session["updated_at"] = now_iso()

    def _add_active(self, session_id: str) -> None:
        session = self.sessions[session_id]
        session["usage"]["active_seconds"] += self.active_seconds_per_turn
        session["stats"]["active_seconds"] += self.active_seconds_per_turn
        self.charged_seconds[session_id] += self.active_seconds_per_turn

    def _bill(self, session_id: str, usage: dict) -> None:
        totals = self.sessions[session_id]["usage"]
        totals["input_tokens"] += usage["input_tokens"]
        totals["output_tokens"] += usage["output_tokens"]
        totals["cache_read_input_tokens"] += usage["cache_read_input_tokens"]
        totals["cache_creation"]["ephemeral_5m_input_tokens"] += usage["cache_creation_input_tokens"]
        if self.list_price is None:
            return
        cost = sum((Decimal(self.list_price[PRICE_OF[key]]) * usage[key] for key in USAGE_KEYS), Decimal(0))
        # Kept exact, shown as the API shows it: whole cents ("50" is fifty cents).
        self.list_costs[session_id] = self.list_costs.get(session_id, Decimal(0)) + cost
        cents = (self.list_costs[session_id] * 100).quantize(Decimal(1), rounding=ROUND_HALF_UP)
        totals["list_cost"] = {"amount": str(int(cents)), "currency": "USD"}

    # List

    def list_events(self, session_id: str, query: dict) -> dict:
        events = list(self.events[session_id])
        if types := query.get("types[]"):
            events = [e for e in events if e["type"] in types]
        for op, keep in (("gt", "__gt__"), ("gte", "__ge__"), ("lt", "__lt__"), ("lte", "__le__")):
            if bound := query.get(f"created_at[{op}]"):
                limit = parse_time(bound[0])
                events = [e for e in events if getattr(parse_time(e["processed_at"]), keep)(limit)]
        if (query.get("order") or ["asc"])[0] == "desc":
            events.reverse()
        return paginate(events, query)

    # Stream

    def stream_session_id(self, method: str, path: str) -> str | None:
        parts = path.split("?")[0].strip("/").split("/")
        is_stream = (
            len(parts) == STREAM_PATH_PARTS and parts[:2] == ["v1", "sessions"] and parts[3:] == ["events", "stream"]
        )
        return parts[2] if method == "GET" and is_stream else None

    def serve_stream(self, handler, session_id: str, beta: str | None) -> None:
        """The session's events from the moment of connecting, kept open (with pings) until
        the client goes away, the session is deleted or the fake stops: the SDK's `Stream`
        has no end-of-stream event, a reader stops at the event it waits for."""
        with self._lock:
            self.requests.append(("GET", handler.path))
            self.beta_headers.append(beta)
            if session_id not in self.sessions:
                return handler._send(
                    404, json.dumps(error_body("not_found_error", "no such session")).encode(), "application/json"
                )
            cursor = len(self.events[session_id])
        handler.close_connection = True
        handler.send_response(200)
        handler.send_header("content-type", "text/event-stream")
        handler.send_header("cache-control", "no-cache")
        handler.send_header("connection", "close")
        handler.end_headers()
        try:
            self._pump(handler, session_id, cursor)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading: the normal end of a stream

    def _pump(self, handler, session_id: str, cursor: int) -> None:
        log = self.events[session_id]
        while True:
            with self._changed:
                self._changed.wait_for(
                    lambda seen=cursor: len(log) > seen or self._stopping or session_id not in self.sessions,
                    timeout=self.ping_interval,
                )
                fresh = log[cursor:]
                cursor += len(fresh)
                over = self._stopping or session_id not in self.sessions
            handler.wfile.write(b"".join(sse(event) for event in fresh) or (b"" if over else PING))
            handler.wfile.flush()
            if over:
                return
