"""A small fake of the Anthropic Messages API, served over real HTTP on 127.0.0.1.

The real `anthropic` SDK reaches it through ANTHROPIC_BASE_URL, so tests exercise the SDK's
own request building, retries and response parsing. Every request is recorded. Scripted
replies (`fake.push(...)`) are served first, in order; then the default reply, which
answers each task and reports usage estimated from the request size.

Scripted reply kinds:
- Reply.error(status, message, retry_after_ms=None): an API error body;
- Reply.delay(seconds): the default reply after a pause (timeouts);
- Reply.malformed(): status 200 with a body that is not JSON;
- Reply.reset(): headers, half a body, then the connection is dropped;
- Reply.message(text=..., usage=..., content=..., message_id=...): a chosen answer;
- Reply.no_usage(): an answer without a `usage` object;
- Reply.during(action): the default answer, with `action` as its `before`.

Any reply may carry `before=callable`: it runs in the fake's thread when the request
arrives, before the answer, so a test can put a second actor (the reaper, an expiry, an
operator, a delete) at the moment a call is in flight. An exception from it is kept in
`fake.action_errors`, not sent to the client.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def estimate_tokens(payload: Any) -> int:
    """The fake's tokenizer: four characters of JSON per token (the engine estimates alike)."""
    return len(json.dumps(payload, ensure_ascii=False)) // 4 + 1


def dense_tokens(payload: Any) -> int:
    """A tokenizer for text denser than English, as real ones are for CJK: four ASCII
    characters per token, one token for every other character."""
    text = json.dumps(payload, ensure_ascii=False)
    wide = sum(1 for char in text if not char.isascii())
    return (len(text) - wide) // 4 + wide + 1


def strip_markers(value):
    if isinstance(value, list):
        return [strip_markers(v) for v in value]
    if isinstance(value, dict):
        return {k: strip_markers(v) for k, v in value.items() if k != "cache_control"}
    return value


def marker_ttl(value) -> str | None:
    """The lifetime of the first cache_control marker in `value` (None without one)."""
    if isinstance(value, list):
        return next((ttl for ttl in map(marker_ttl, value) if ttl), None)
    if isinstance(value, dict):
        if isinstance(value.get("cache_control"), dict):
            return value["cache_control"].get("ttl") or "5m"
        return next((ttl for ttl in map(marker_ttl, value.values()) if ttl), None)
    return None


CACHE_SECONDS = {"5m": 300.0, "1h": 3600.0}


def cache_alive(entry: tuple[float | None, float] | None, now: float | None) -> bool:
    """Whether a cache entry is there to read at `now` (None: no clock, nothing expires)."""
    if entry is None:
        return False
    return entry[0] is None or now is None or entry[0] > now


def has_marker(value) -> bool:
    if isinstance(value, list):
        return any(has_marker(v) for v in value)
    if isinstance(value, dict):
        return "cache_control" in value or any(has_marker(v) for v in value.values())
    return False


def effective_messages(messages: list[dict]) -> list[dict]:
    """What the API reads: everything before the last compaction block is ignored."""
    for index in range(len(messages) - 1, -1, -1):
        content = messages[index].get("content")
        if isinstance(content, list) and content and content[0].get("type") == "compaction":
            return messages[index:]
    return messages


def last_user_text(messages: list[dict]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            return " ".join(b.get("text", "") for b in content if isinstance(b, dict))
    return ""


@dataclass
class Reply:
    kind: str = "default"
    status: int = 200
    error_message: str = ""
    retry_after_ms: int | None = None
    seconds: float = 0.0
    text: str | None = None
    usage: dict | None = None
    content: list | None = None
    message_id: str | None = None
    extra: dict = field(default_factory=dict)
    before: Callable[[], None] | None = None

    @classmethod
    def error(cls, status: int, message: str = "fake error", retry_after_ms: int | None = None) -> Reply:
        return cls(kind="error", status=status, error_message=message, retry_after_ms=retry_after_ms)

    @classmethod
    def delay(cls, seconds: float) -> Reply:
        return cls(kind="delay", seconds=seconds)

    @classmethod
    def malformed(cls) -> Reply:
        return cls(kind="malformed")

    @classmethod
    def reset(cls) -> Reply:
        return cls(kind="reset")

    @classmethod
    def no_usage(cls) -> Reply:
        return cls(kind="no_usage")

    @classmethod
    def during(cls, action) -> Reply:
        return cls(before=action)

    @classmethod
    def message(cls, text: str | None = None, **kwargs) -> Reply:
        return cls(kind="message", text=text, **kwargs)


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


class FakeAnthropic:
    def __init__(self, *, latency: float = 0.0) -> None:
        # Seconds every default (unscripted) answer waits, like a model thinking.
        self.latency = latency
        # How the fake counts tokens, for usage and count_tokens alike.
        self.tokens: Callable[[Any], int] = estimate_tokens
        self.requests: list[dict] = []
        self.scripted: list[Reply] = []
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        # Message ids are unique across fake instances, as the real API's are.
        self.id_prefix = uuid.uuid4().hex[:12]
        # Prompt cache: hashes of request prefixes written at cache_control breakpoints,
        # each with the moment it expires (by `clock`; None: never, the default) and its lifetime.
        self.cache: dict[str, tuple[float | None, float]] = {}
        # Seconds since any origin, read when a request arrives: set it (a simulated clock)
        # to make cached prefixes expire after their lifetime (5 minutes or 1 hour) unless
        # read again, as the API's do.
        self.clock: Callable[[], float] | None = None
        self.answer_padding = ""
        # Benchmarks: the text of a default answer as a function of the request body (None
        # from it: the usual answer), e.g. a summariser; and output tokens counted from the
        # answer's text, as the API counts them, instead of a flat 12.
        self.writer: Callable[[dict], str | None] | None = None
        self.count_output = False
        self.action_errors: list[BaseException] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeAnthropic:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def push(self, *replies: Reply) -> None:
        with self.lock:
            self.scripted.extend(replies)

    def reset_log(self) -> None:
        with self.lock:
            self.requests.clear()

    @property
    def message_requests(self) -> list[dict]:
        with self.lock:
            return [r["body"] for r in self.requests if r["path"] == "/v1/messages"]

    def _next_reply(self) -> Reply:
        with self.lock:
            if self.scripted:
                return self.scripted.pop(0)
        return Reply.delay(self.latency) if self.latency else Reply()

    def default_usage(self, body: dict) -> dict:
        """Usage as the API would report it, with prompt caching simulated: the longest
        prefix written earlier at a breakpoint is read from the cache, and the prefix up to
        this request's last breakpoint is written."""
        system = body.get("system")
        messages = effective_messages(body.get("messages", []))
        segments = ([system] if system else []) + messages
        sizes = [self.tokens(strip_markers(segment)) for segment in segments]
        # The cache compares content as the API reads it: a string is its one text block.
        keys = [segment if segment is system else canonical_message(segment) for segment in segments]
        total = self.tokens({"system": system, "messages": messages})
        breakpoints = [i for i, segment in enumerate(segments) if has_marker(segment)]
        read = 0
        written_by_ttl = {"5m": 0, "1h": 0}
        if breakpoints:
            digest = hashlib.sha256()
            prefixes = []
            for key in keys:
                digest.update(json.dumps(strip_markers(key), sort_keys=True).encode())
                prefixes.append(digest.copy().hexdigest())
            last = breakpoints[-1]
            now = self.clock() if self.clock is not None else None
            with self.lock:
                hit = max((i for i in range(last + 1) if cache_alive(self.cache.get(prefixes[i]), now)), default=-1)
                if hit >= 0 and now is not None:  # a read restarts the entry's lifetime
                    self.cache[prefixes[hit]] = (now + self.cache[prefixes[hit]][1], self.cache[prefixes[hit]][1])
                for i in breakpoints:
                    seconds = CACHE_SECONDS[marker_ttl(segments[i])]
                    self.cache[prefixes[i]] = (None if now is None else now + seconds, seconds)
            read = sum(sizes[: hit + 1])
            # Each segment is written at the lifetime of the breakpoint that closes it.
            for i in range(hit + 1, last + 1):
                ttl = marker_ttl(segments[min(b for b in breakpoints if b >= i)])
                written_by_ttl[ttl] += sizes[i]
        written = sum(written_by_ttl.values())
        uncached = max(total - read - written, 1)
        return {
            "input_tokens": uncached,
            "output_tokens": 12,
            "cache_creation_input_tokens": written,
            "cache_creation": {
                "ephemeral_5m_input_tokens": written_by_ttl["5m"],
                "ephemeral_1h_input_tokens": written_by_ttl["1h"],
            },
            "cache_read_input_tokens": read,
        }

    def server_compaction(self, body: dict) -> tuple[list, dict] | None:
        """The `compact_20260112` edit: past the trigger, summarise and answer after it."""
        edits = (body.get("context_management") or {}).get("edits") or []
        edit = next((e for e in edits if e.get("type") == "compact_20260112"), None)
        if edit is None:
            return None
        trigger = ((edit.get("trigger") or {}).get("value")) or 150_000
        messages = effective_messages(body.get("messages", []))
        before = self.tokens({"system": body.get("system"), "messages": messages})
        if before < trigger:
            return None
        block = {"type": "compaction", "content": f"Summary of {len(messages)} earlier messages."}
        after = self.tokens({"system": body.get("system"), "messages": [block, messages[-1]]})
        usage = {
            "input_tokens": after,
            "output_tokens": 12,
            "iterations": [
                {"type": "compaction", "input_tokens": before, "output_tokens": 100},
                {"type": "message", "input_tokens": after, "output_tokens": 12},
            ],
        }
        return [block], usage

    def answer(self, body: dict, reply: Reply) -> dict:
        number = next(self.ids)
        text = (
            reply.text
            if reply.text is not None
            else f"answer {number}: {last_user_text(body.get('messages', []))[:80]}"
        )
        if reply.text is None and self.answer_padding:
            text += " " + self.answer_padding
        if reply.kind == "default" and self.writer is not None:
            text = self.writer(body) or text
        compaction = self.server_compaction(body) if reply.kind == "default" else None
        message = {
            "id": reply.message_id or f"msg_{self.id_prefix}_{number:06d}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", "claude-test"),
            "content": reply.content if reply.content is not None else [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": reply.usage if reply.usage is not None else self.default_usage(body),
        }
        if compaction is not None:
            blocks, usage = compaction
            message["content"] = blocks + message["content"]
            message["usage"] = usage
        if self.count_output and reply.usage is None:
            message["usage"]["output_tokens"] = self.tokens(text)
        if reply.kind == "no_usage":
            message.pop("usage")
        message.update(reply.extra)
        return message

    def _handler_class(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out as separate writes; without this, Nagle and delayed
            # ACKs add 40 ms to every answer.
            disable_nagle_algorithm = True

            def log_message(self, format, *args):  # keep test output quiet
                pass

            def _send_json(self, status: int, payload: dict, headers: dict | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("request-id", f"req_fake_{time.monotonic_ns()}")
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                # For benchmarks running the fake in its own process: the Messages request
                # bodies it received, from index `after` on, so a baseline can replay them.
                path, _, query = self.path.partition("?")
                if path != "/_fake/message_requests":
                    self._send_json(404, {"type": "error", "error": {"type": "not_found_error", "message": path}})
                    return
                after = int(query.partition("after=")[2] or 0)
                self._send_json(200, {"bodies": fake.message_requests[after:]})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {"_unparsed": raw.decode(errors="replace")}
                path = self.path.split("?")[0]
                with fake.lock:
                    fake.requests.append({"path": path, "headers": dict(self.headers), "body": body})
                if path == "/v1/messages/count_tokens":
                    size = fake.tokens({"system": body.get("system"), "messages": body.get("messages")})
                    self._send_json(200, {"input_tokens": size})
                    return
                if path != "/v1/messages":
                    self._send_json(404, {"type": "error", "error": {"type": "not_found_error", "message": path}})
                    return
                if problem := content_error(body.get("messages")):
                    self._send_json(
                        400, {"type": "error", "error": {"type": "invalid_request_error", "message": problem}}
                    )
                    return
                reply = fake._next_reply()
                if reply.before is not None:
                    try:
                        reply.before()
                    except BaseException as exc:  # reported to the test, not to the client
                        fake.action_errors.append(exc)
                if reply.kind == "error":
                    headers = {}
                    if reply.retry_after_ms is not None:
                        headers["retry-after-ms"] = str(reply.retry_after_ms)
                    error_type = ERROR_TYPES.get(reply.status, "api_error")
                    self._send_json(
                        reply.status,
                        {"type": "error", "error": {"type": error_type, "message": reply.error_message}},
                        headers,
                    )
                    return
                if reply.kind == "delay":
                    time.sleep(reply.seconds)
                if reply.kind == "malformed":
                    data = b"<html>this is not json"
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if reply.kind == "reset":
                    data = json.dumps(fake.answer(body, Reply())).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self._send_json(200, fake.answer(body, reply))

        return Handler


def serve_forever() -> None:
    """`python -m tests.fake_anthropic`: run the fake alone (benchmarks, live servers).

    Prints its base URL on the first line. FAKE_LATENCY_MS delays every default answer.
    """
    import os
    import signal

    fake = FakeAnthropic(latency=float(os.environ.get("FAKE_LATENCY_MS", "0")) / 1000)
    print(fake.base_url, flush=True)

    def stop(*args):
        raise KeyboardInterrupt  # shutdown() from the serving thread itself would deadlock

    signal.signal(signal.SIGTERM, stop)
    try:
        fake.server.serve_forever()
    except KeyboardInterrupt:
        fake.server.server_close()


def content_error(messages) -> str | None:
    """The real API's content rules, with its messages: what it refuses with a 400."""
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        final_assistant = index == len(messages) - 1 and message.get("role") == "assistant"
        if content in ("", []) and not final_assistant:
            return (
                f"messages.{index}: all messages must have non-empty content "
                "except for the optional final assistant message"
            )
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        for block in blocks:
            if isinstance(block, dict) and block.get("type") == "text" and not final_assistant:
                if block.get("text") == "":
                    return "messages: text content blocks must be non-empty"
                if not str(block.get("text")).strip():
                    return "messages: text content blocks must contain non-whitespace text"
    return None


def canonical_content(content) -> list:
    """Message content as a list of blocks without cache markers: a string and the marked
    text block made from it compare equal, as the API treats them."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{k: v for k, v in block.items() if k != "cache_control"} for block in content]


def canonical_message(message) -> Any:
    if not isinstance(message, dict) or "content" not in message:
        return message
    return {**message, "content": canonical_content(message["content"])}


def plain_messages(body: dict) -> list[dict]:
    return [{"role": m["role"], "content": canonical_content(m["content"])} for m in body["messages"]]


def plain_system(body: dict) -> str:
    system = body.get("system")
    if isinstance(system, list):
        return "".join(block.get("text", "") for block in system)
    return system or ""


def text_turn(role: str, text: str) -> dict:
    return {"role": role, "content": [{"type": "text", "text": text}]}


# Last, so that every function the server calls is defined when it runs as a script.
if __name__ == "__main__":
    serve_forever()
