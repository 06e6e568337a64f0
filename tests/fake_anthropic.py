"""A small fake of the Anthropic Messages API, served over real HTTP on 127.0.0.1.

The real `anthropic` SDK reaches it through ANTHROPIC_BASE_URL, so tests exercise the SDK's
own request building, retries and response parsing. Every request is recorded. Scripted
replies (`fake.push(...)`) are served first, in order; then the default reply, which
answers each task and reports usage estimated from the request size.

Scripted reply kinds:
- Reply.error(status, message, retry_after_ms=None, headers=None): an API error body (with
  `headers`, e.g. {"retry-after": "30"});
- Reply.delay(seconds): the default reply after a pause (timeouts);
- Reply.malformed(): status 200 with a body that is not JSON;
- Reply.reset(): headers, half a body, then the connection is dropped;
- Reply.message(text=..., usage=..., content=..., message_id=...): a chosen answer;
- Reply.no_usage(): an answer without a `usage` object;
- Reply.during(action): the default answer, with `action` as its `before`;
- `mid_stream=action` on a reply: a streamed answer calls `action` after its first event,
  before the rest (an answer still streaming when something happens to the client);
- Reply.tool_use(name, input, text=None): an answer that calls one tool; Reply.tool_calls(*inputs,
  name="memory"): an answer asking for calls of one tool (stop_reason
  tool_use), one tool_use block per input.

Tools: a request offering the memory tool (`memory_20250818`) gets scripted tool calls by
default, so that the engine's tool loop runs for real: a task saying "remember" is answered
with a `create` of /memories/facts/<digest>.md holding the task; a task saying "recall" with
a `view` of /memories/facts, then a `view` of every file the listing shows; a request ending
in tool results is answered with text. Tool definitions count as input tokens, and so does
the tool-use system prompt the API adds to any request offering tools
(`fake.tool_prompt_tokens`), in usage and count_tokens alike. The
`clear_tool_uses_20250919` edit clears the oldest tool results past its trigger and reports
it in `context_management`, as the API does. As the API does, it refuses (400) a tool_use
not answered by a tool_result in the next message.

`fake.system_answers` ({text: answer}) picks the default answer by the system prompt: a
request whose system prompt contains a key is answered with its value (an idle agent that
says "NOTHING_TO_DO" in a benchmark); FAKE_SYSTEM_ANSWERS sets it as JSON when run alone.

The Models API: `GET /v1/models` pages `fake.models` (CATALOGUE by default: the 5.x
generation and the 4.x models the tests use, some deprecated, one retired) as the API does,
`GET /v1/models/{id}` answers one.

Quotas: `fake.outage = Reply.error(429, ..., headers={"retry-after": "30"})` answers every
Messages request with that reply until it is set back to None (the provider recovers);
`fake.answer_headers` are sent with every successful answer (`anthropic-ratelimit-*`).

Message Batches (`client.messages.batches`): create, retrieve, list (newest first, paged by
`limit`, `after_id` and `before_id`), results as JSONL and cancel, as the API serves them;
`created_at` is wall time, and a test may change a batch's (`fake.batches[id]`). A batch stays `in_progress` for `fake.batch_seconds` (on
`clock` when set, else wall time; 0 by default: it has ended by the first retrieve), then
answers every request as a direct request would be answered (the cache included), its usage
reporting `service_tier: "batch"`, as the API reports a batch's half-price tokens.
`fake.batch_outcomes` scripts results by position: "errored" or "expired" (an entry is
taken per request answered, in order; "succeeded" otherwise). A cancelled batch answers
its unprocessed requests `canceled` and ends. `fake.batch_answers` are the answered
(succeeded) requests' model and usage, for billing checks; `fake.batch_creates` counts
create requests and `fake.batch_lists` are the list requests' queries;
`fake.batch_create_error` (a status) refuses creates, `fake.batch_create_answer_lost` (a
status) answers one with it after making the batch; `fake.batch_before` runs when one
arrives, `fake.batch_results_before` when a request for results does.

Any reply may carry `before=callable`: it runs in the fake's thread when the request
arrives, before the answer, so a test can put a second actor (the reaper, an expiry, an
operator, a delete) at the moment a call is in flight. An exception from it is kept in
`fake.action_errors`, not sent to the client, and fails the test: the `fake_anthropic`
fixture re-raises it when the test ends (`raise_action_errors`). A test that expects one
takes it with `take_action_errors()` and checks it itself.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

# How often a test server's loop looks whether it was shut down: shutdown() waits for it.
SHUTDOWN_POLL_SECONDS = 0.05


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
            # Claude Code puts its own reminders before the prompt: the answer quotes the prompt.
            texts = [b.get("text", "") for b in content if isinstance(b, dict)]
            return " ".join(t for t in texts if not t.startswith("<system-reminder>"))
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
    # Streamed: called after the first event is sent, before the rest (an answer still
    # streaming when something happens client-side).
    mid_stream: Callable[[], None] | None = None
    headers: dict = field(default_factory=dict)  # sent with the answer (an error's retry-after, rate limits)

    @classmethod
    def error(
        cls, status: int, message: str = "fake error", retry_after_ms: int | None = None, headers: dict | None = None
    ) -> Reply:
        return cls(
            kind="error", status=status, error_message=message, retry_after_ms=retry_after_ms, headers=headers or {}
        )

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

    @classmethod
    def tool_use(cls, name: str, tool_input: dict, *, text: str | None = None, **kwargs) -> Reply:
        """An answer that calls a tool (what an agent runtime such as Claude Code executes
        before it asks again with the result); `text` comes before the call."""
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:20]}", "name": name, "input": tool_input}
        content = ([{"type": "text", "text": text}] if text else []) + [block]
        return cls(kind="message", content=content, **kwargs)

    @classmethod
    def tool_calls(cls, *inputs: dict, name: str = "memory", **kwargs) -> Reply:
        """An answer of one or more calls of the same tool (the memory tool by default)."""
        blocks = [
            {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:20]}", "name": name, "input": tool_input}
            for tool_input in inputs
        ]
        return cls(kind="message", content=blocks, extra={"stop_reason": "tool_use"}, **kwargs)


def model_entry(
    model_id: str,
    display_name: str,
    line: str,
    released: str,
    *,
    max_input_tokens: int = 1_000_000,
    max_tokens: int = 64_000,
    lifecycle: str = "active",
    deprecated_at: str | None = None,
    retires_at: str | None = None,
) -> dict:
    """One model as the Models API lists it (`ModelInfo`)."""
    return {
        "type": "model",
        "id": model_id,
        "display_name": display_name,
        "line": line,
        "created_at": f"{released}T00:00:00Z",
        "lifecycle": lifecycle,
        "max_input_tokens": max_input_tokens,
        "max_tokens": max_tokens,
        "deprecated_at": f"{deprecated_at}T00:00:00Z" if deprecated_at else None,
        "retires_at": f"{retires_at}T00:00:00Z" if retires_at else None,
    }


# What `GET /v1/models` lists by default: the 5.x generation, and the 4.x models the tests
# use (two deprecated with a retirement date, one retired), newest first as the API lists.
CATALOGUE = sorted(
    [
        model_entry("claude-opus-5-5", "Claude Opus 5.5", "opus", "2026-11-18", max_tokens=128_000),
        model_entry("claude-sonnet-5-5", "Claude Sonnet 5.5", "sonnet", "2026-11-18"),
        model_entry("claude-haiku-5-5", "Claude Haiku 5.5", "haiku", "2026-11-25"),
        model_entry("claude-fable-5-1", "Claude Fable 5.1", "fable", "2026-10-01", max_tokens=128_000),
        model_entry("claude-opus-5", "Claude Opus 5", "opus", "2026-07-01", max_tokens=128_000),
        model_entry("claude-sonnet-5", "Claude Sonnet 5", "sonnet", "2026-06-15"),
        model_entry("claude-opus-4-6", "Claude Opus 4.6", "opus", "2026-02-05", max_tokens=128_000),
        model_entry("claude-sonnet-4-6", "Claude Sonnet 4.6", "sonnet", "2026-02-17"),
        model_entry(
            "claude-opus-4-5",
            "Claude Opus 4.5",
            "opus",
            "2025-11-24",
            max_input_tokens=200_000,
            lifecycle="deprecated",
            deprecated_at="2026-11-01",
            retires_at="2027-02-01",
        ),
        model_entry(
            "claude-sonnet-4-5",
            "Claude Sonnet 4.5",
            "sonnet",
            "2025-09-29",
            max_input_tokens=200_000,
            lifecycle="deprecated",
            deprecated_at="2026-11-01",
            retires_at="2027-03-01",
        ),
        model_entry("claude-haiku-4-5", "Claude Haiku 4.5", "haiku", "2025-10-15", max_input_tokens=200_000),
        model_entry(
            "claude-opus-4-1",
            "Claude Opus 4.1",
            "opus",
            "2025-08-05",
            max_input_tokens=200_000,
            max_tokens=32_000,
            lifecycle="retired",
            deprecated_at="2026-04-01",
            retires_at="2026-10-01",
        ),
    ],
    key=lambda entry: entry["created_at"],
    reverse=True,
)


def models_page(models: list[dict], query: dict[str, list[str]], *, default_limit: int) -> dict:
    """`GET /v1/models` as the API pages it: `limit` (1..1000), `after_id` or `before_id`,
    `lifecycle` (active and deprecated unless asked; retired only when asked)."""
    lifecycles = query.get("lifecycle[]") or query.get("lifecycle") or ["active", "deprecated"]
    return id_page([model for model in models if model["lifecycle"] in lifecycles], query, default_limit=default_limit)


def id_page(listed: list[dict], query: dict[str, list[str]], *, default_limit: int) -> dict:
    """One page of a list the API pages by id: `limit`, `after_id` (the page after that
    object, further down the list) or `before_id` (the page before it)."""
    ids = [item["id"] for item in listed]
    limit = int((query.get("limit") or [default_limit])[0])
    if "after_id" in query:
        start = ids.index(query["after_id"][0]) + 1
        page = listed[start : start + limit]
        has_more = start + limit < len(listed)
    elif "before_id" in query:
        end = ids.index(query["before_id"][0])
        page = listed[max(end - limit, 0) : end]
        has_more = end - limit > 0
    else:
        page = listed[:limit]
        has_more = limit < len(listed)
    return {
        "data": page,
        "has_more": has_more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }


BATCH_MAX_REQUESTS = 100_000
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def api_error(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


class QuietServer(ThreadingHTTPServer):
    """A client that hung up before its answer (a timeout under test, a killed worker) is
    what many tests do on purpose; its broken pipe is not printed into the test run's log."""

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


class FakeAnthropic:
    def __init__(self, *, latency: float = 0.0) -> None:
        # Seconds every default (unscripted) answer waits, like a model thinking.
        self.latency = latency
        # How the fake counts tokens, for usage and count_tokens alike.
        self.tokens: Callable[[Any], int] = estimate_tokens
        # The tool-use system prompt the API adds to a request offering tools: billed as
        # input (and counted by count_tokens) but never in the request's bytes. Anthropic's
        # table lists 290-804 tokens by model and tool_choice; this is Claude Opus 4.6's
        # `auto` figure.
        self.tool_prompt_tokens = 497
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
        # As a model following the memory tool's own advice would: view /memories/facts at
        # the start of every task, not only when it says "recall" (benchmarks' worst case).
        self.memory_view_always = False
        self.system_answers: dict[str, str] = {}
        # Benchmarks: the text of a default answer as a function of the request body (None
        # from it: the usual answer), e.g. a summariser; and output tokens counted from the
        # answer's text, as the API counts them, instead of a flat 12.
        self.writer: Callable[[dict], str | None] | None = None
        self.count_output = False
        self.action_errors: list[BaseException] = []
        # The Models API: what `GET /v1/models` lists, and its page size when no limit is
        # asked (the API's default is 20).
        self.models: list[dict] = [dict(entry) for entry in CATALOGUE]
        self.models_page_size = 20
        # Runs in the fake's thread when a models request arrives, before the answer (as a
        # reply's `before`): a second actor at the moment a catalogue refresh is in flight.
        self.models_before: Callable[[], None] | None = None
        # An HTTP status every models request is answered with instead (None: the list).
        self.models_error: int | None = None
        # A provider outage: while set, every Messages request is answered with this reply
        # (a 429 with its retry-after, a 400 credit refusal), scripted replies included.
        self.outage: Reply | None = None
        # Headers every successful Messages answer carries (`anthropic-ratelimit-*`).
        self.answer_headers: dict[str, str] = {}
        # Message Batches (module doc): batches by id, how long one processes, scripted
        # outcomes by position, and what was answered.
        self.batches: dict[str, dict] = {}
        self.batch_seconds = 0.0
        self.batch_outcomes: list[str] = []
        self.batch_answers: list[dict] = []
        # A status every batch create is answered with instead (None: created), and actions
        # run in the fake's thread when a create, or a request for results, arrives (as a
        # reply's `before`).
        self.batch_create_error: int | None = None
        # A status a create is answered with after the batch was made (an answer lost on its
        # way back: the client cannot know whether it exists).
        self.batch_create_answer_lost: int | None = None
        self.batch_before: Callable[[], None] | None = None
        self.batch_results_before: Callable[[], None] | None = None
        self.server = QuietServer(("127.0.0.1", 0), self._handler_class())
        self.server.daemon_threads = True
        # shutdown() waits for the loop's next look (0.5 s by default), in the teardown of
        # every test that uses the fake.
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_SECONDS}, daemon=True
        )

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

    def take_action_errors(self) -> list[BaseException]:
        """The errors the reply actions raised so far, which the test now answers for."""
        with self.lock:
            errors, self.action_errors = self.action_errors, []
        return errors

    def raise_action_errors(self) -> None:
        """Re-raise the first error a reply action raised that no one took: an action that
        broke means the second actor never acted, and the test proved nothing."""
        errors = self.take_action_errors()
        if errors:
            raise AssertionError(
                f"{len(errors)} reply action(s) of the fake API raised; the first: {errors[0]!r}"
            ) from errors[0]

    def push(self, *replies: Reply) -> None:
        with self.lock:
            self.scripted.extend(replies)

    def reset_log(self) -> None:
        with self.lock:
            self.requests.clear()

    @property
    def models_requests(self) -> list[dict]:
        """The query of each `GET /v1/models` request, in order."""
        with self.lock:
            return [r["query"] for r in self.requests if r["path"] == "/v1/models"]

    @property
    def message_requests(self) -> list[dict]:
        with self.lock:
            return [r["body"] for r in self.requests if r["path"] == "/v1/messages"]

    def _next_reply(self) -> Reply:
        with self.lock:
            if self.outage is not None:
                return self.outage
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
        total = self.tokens({"system": system, "messages": messages}) + self.tools_tokens(body)
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

    def tools_tokens(self, body: dict) -> int:
        """The input a request's tools add: their definitions and the hidden tool-use prompt."""
        tools = body.get("tools")
        return self.tokens(tools) + self.tool_prompt_tokens if tools else 0

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
        if reply.text is None and self.system_answers:
            system = plain_system(body)
            text = next((answer for key, answer in self.system_answers.items() if key in system), text)
        if reply.kind == "default" and self.writer is not None:
            text = self.writer(body) or text
        compaction = self.server_compaction(body) if reply.kind == "default" else None
        cleared = clear_tool_uses(body, self.tokens)
        scripted = (
            memory_tool_calls(body, view_always=self.memory_view_always)
            if reply.kind == "default" and compaction is None
            else None
        )
        message = {
            "id": reply.message_id or f"msg_{self.id_prefix}_{number:06d}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", "claude-test"),
            "content": reply.content if reply.content is not None else [{"type": "text", "text": text}],
            "stop_reason": "end_turn",  # "tool_use" when the content calls a tool (below)
            "stop_sequence": None,
            "usage": reply.usage if reply.usage is not None else self.default_usage(body),
        }
        if compaction is not None:
            blocks, usage = compaction
            message["content"] = blocks + message["content"]
            message["usage"] = usage
        if body.get("inference_geo") and message["usage"] is not None:
            # Where it ran, as the API reports it for a request that names a geo.
            message["usage"] = {**message["usage"], "inference_geo": body["inference_geo"]}
        if scripted:
            message["content"], message["stop_reason"] = scripted, "tool_use"
        if any(block.get("type") == "tool_use" for block in message["content"]):
            message["stop_reason"] = "tool_use"
        if cleared is not None:
            message["context_management"] = {"applied_edits": [cleared]}
            if reply.usage is None and compaction is None:
                usage = message["usage"]
                usage["input_tokens"] = max(usage["input_tokens"] - cleared["cleared_input_tokens"], 1)
        if self.count_output and reply.usage is None:
            message["usage"]["output_tokens"] = self.tokens(text)
            limit = body.get("max_tokens")
            if limit and message["usage"]["output_tokens"] > limit and isinstance(text, str):
                # The API stops at max_tokens: that much of the answer, billed as that much.
                message["usage"]["output_tokens"] = limit
                message["content"] = [{"type": "text", "text": text[: 4 * limit]}]
                message["stop_reason"] = "max_tokens"
        if reply.kind == "no_usage":
            message.pop("usage")
        message.update(reply.extra)
        return message

    def _now(self) -> float:
        return self.clock() if self.clock is not None else time.monotonic()

    @property
    def batch_creates(self) -> int:
        with self.lock:
            return sum(1 for r in self.requests if r["path"] == "/v1/messages/batches" and r["body"] is not None)

    @property
    def batch_lists(self) -> list[dict]:
        """The query of each list request (one per page)."""
        with self.lock:
            return [r["query"] for r in self.requests if r["path"] == "/v1/messages/batches" and r["body"] is None]

    def batch_create(self, body: dict) -> tuple[int, dict]:
        self._batch_action(self.batch_before)
        if self.batch_create_error is not None:
            return self.batch_create_error, api_error(self.batch_create_error, "batch not created")
        requests = body.get("requests")
        if not isinstance(requests, list) or not 1 <= len(requests) <= BATCH_MAX_REQUESTS:
            return 400, api_error(400, f"requests: must hold 1..{BATCH_MAX_REQUESTS} requests")
        ids = [r.get("custom_id") if isinstance(r, dict) else None for r in requests]
        if not all(isinstance(i, str) and CUSTOM_ID.fullmatch(i) for i in ids):
            return 400, api_error(400, "requests: custom_id must match ^[a-zA-Z0-9_-]{1,64}$")
        if len(set(ids)) != len(ids):
            return 400, api_error(400, "requests: custom_id values must be unique within a batch")
        with self.lock:
            batch_id = f"msgbatch_{self.id_prefix}_{next(self.ids):06d}"
            self.batches[batch_id] = {
                "id": batch_id,
                "requests": [dict(r) for r in requests],
                "created": self._now(),
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "cancelled": False,
                "results": None,
            }
        if self.batch_create_answer_lost is not None:
            return self.batch_create_answer_lost, api_error(self.batch_create_answer_lost, "internal error")
        return 200, self.batch_view(batch_id)

    def _batch_action(self, action: Callable[[], None] | None) -> None:
        if action is not None:
            try:
                action()
            except BaseException as exc:  # reported to the test, not to the client
                with self.lock:
                    self.action_errors.append(exc)

    def _batch_end(self, batch: dict) -> None:
        """Answer the batch's requests (cancelled: those not answered are `canceled`)."""
        results = []
        for request in batch["requests"]:
            custom_id, params = request["custom_id"], request.get("params") or {}
            if batch["cancelled"]:
                results.append({"custom_id": custom_id, "result": {"type": "canceled"}})
                continue
            with self.lock:
                outcome = self.batch_outcomes.pop(0) if self.batch_outcomes else "succeeded"
            if outcome == "expired":
                results.append({"custom_id": custom_id, "result": {"type": "expired"}})
            elif outcome == "errored" or (problem := content_error(params.get("messages"))):
                message = "fake batch error" if outcome == "errored" else problem
                results.append(
                    {"custom_id": custom_id, "result": {"type": "errored", "error": api_error(400, message)}}
                )
            else:
                message = self.answer(params, Reply())
                message["usage"] = {**message["usage"], "service_tier": "batch"}
                with self.lock:
                    self.batch_answers.append(
                        {"custom_id": custom_id, "model": params.get("model"), "usage": message["usage"]}
                    )
                results.append({"custom_id": custom_id, "result": {"type": "succeeded", "message": message}})
        batch["results"] = results
        batch["ended_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def batch_view(self, batch_id: str) -> dict | None:
        """A batch as the API shows it; one whose processing time has passed ends here."""
        batch = self.batches.get(batch_id)
        if batch is None:
            return None
        if batch["results"] is None and (batch["cancelled"] or self._now() - batch["created"] >= self.batch_seconds):
            self._batch_end(batch)
        counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        if batch["results"] is None:
            counts["processing"] = len(batch["requests"])
        else:
            for line in batch["results"]:
                counts[line["result"]["type"]] += 1
        ended = batch["results"] is not None
        return {
            "id": batch_id,
            "type": "message_batch",
            "processing_status": "ended" if ended else ("canceling" if batch["cancelled"] else "in_progress"),
            "request_counts": counts,
            "created_at": batch["created_at"],
            "expires_at": batch["created_at"],
            "ended_at": batch.get("ended_at"),
            "cancel_initiated_at": batch["created_at"] if batch["cancelled"] else None,
            "archived_at": None,
            "results_url": f"{self.base_url}/v1/messages/batches/{batch_id}/results" if ended else None,
        }

    def batches_page(self, query: dict[str, list[str]]) -> tuple[int, dict]:
        """`GET /v1/messages/batches`: newest first, `limit` 1..1000 (20 unless asked)."""
        if not 1 <= int((query.get("limit") or ["20"])[0]) <= 1000:
            return 400, api_error(400, "limit: must be between 1 and 1000")
        with self.lock:
            newest_first = list(reversed(self.batches))
        cursor = (query.get("after_id") or query.get("before_id") or [None])[0]
        if cursor is not None and cursor not in self.batches:
            return 404, api_error(404, f"batch {cursor} not found")
        page = id_page([{"id": batch_id} for batch_id in newest_first], query, default_limit=20)
        return 200, {**page, "data": [self.batch_view(item["id"]) for item in page["data"]]}

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
                path, _, query = self.path.partition("?")
                if path == "/v1/models" or path.startswith("/v1/models/"):
                    self._models(path, parse_qs(query))
                    return
                if path.startswith("/v1/messages/batches"):
                    self._batches_get(path, parse_qs(query))
                    return
                # For benchmarks running the fake in its own process: the Messages request
                # bodies it received, from index `after` on, so a baseline can replay them.
                if path != "/_fake/message_requests":
                    self._send_json(404, {"type": "error", "error": {"type": "not_found_error", "message": path}})
                    return
                after = int(query.partition("after=")[2] or 0)
                self._send_json(200, {"bodies": fake.message_requests[after:]})

            def _batches_get(self, path: str, query: dict[str, list[str]]) -> None:
                with fake.lock:
                    fake.requests.append({"path": path, "headers": dict(self.headers), "body": None, "query": query})
                parts = path.strip("/").split("/")  # v1 messages batches [id [results]]
                if len(parts) == 3:
                    self._send_json(*fake.batches_page(query))
                    return
                view = fake.batch_view(parts[3])
                if view is None:
                    self._send_json(404, api_error(404, f"batch {parts[3]} not found"))
                elif len(parts) == 4:
                    self._send_json(200, view)
                elif view["processing_status"] != "ended":
                    self._send_json(400, api_error(400, "results are available once the batch has ended"))
                else:
                    fake._batch_action(fake.batch_results_before)
                    lines = fake.batches[parts[3]]["results"]
                    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/binary")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

            def _batches_post(self, path: str, body: dict) -> None:
                parts = path.strip("/").split("/")
                if len(parts) == 3:
                    self._send_json(*fake.batch_create(body))
                    return
                batch = fake.batches.get(parts[3]) if len(parts) == 5 and parts[4] == "cancel" else None
                if batch is None:
                    self._send_json(404, api_error(404, path))
                    return
                # One whose processing time has passed has ended: nothing left to cancel.
                if fake.batch_view(parts[3])["processing_status"] == "in_progress":
                    batch["cancelled"] = True
                self._send_json(200, fake.batch_view(parts[3]))

            def _models(self, path: str, query: dict[str, list[str]]) -> None:
                with fake.lock:
                    fake.requests.append({"path": path, "query": query, "headers": dict(self.headers), "body": None})
                    models = list(fake.models)
                if fake.models_before is not None:
                    try:
                        fake.models_before()
                    except BaseException as exc:  # reported to the test, not to the client
                        fake.action_errors.append(exc)
                if fake.models_error is not None:
                    error_type = ERROR_TYPES.get(fake.models_error, "api_error")
                    self._send_json(
                        fake.models_error, {"type": "error", "error": {"type": error_type, "message": "down"}}
                    )
                    return
                if path == "/v1/models":
                    self._send_json(200, models_page(models, query, default_limit=fake.models_page_size))
                    return
                found = next((model for model in models if model["id"] == path.rsplit("/", 1)[1]), None)
                if found is None:
                    self._send_json(404, {"type": "error", "error": {"type": "not_found_error", "message": path}})
                else:
                    self._send_json(200, found)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {"_unparsed": raw.decode(errors="replace")}
                path = self.path.split("?")[0]
                record = {"path": path, "headers": dict(self.headers), "body": body, "at": time.monotonic()}
                with fake.lock:
                    fake.requests.append(record)
                if path == "/v1/messages/count_tokens":
                    size = fake.tokens({"system": body.get("system"), "messages": body.get("messages")})
                    size += fake.tools_tokens(body)
                    self._send_json(200, {"input_tokens": size})
                    return
                if path.startswith("/v1/messages/batches"):
                    self._batches_post(path, body)
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
                        with fake.lock:
                            fake.action_errors.append(exc)
                record["status"] = reply.status if reply.kind == "error" else 200
                if reply.kind == "error":
                    headers = dict(reply.headers)
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
                message = fake.answer(body, reply)
                record["usage"] = message.get("usage")  # what this answer reported, for ledger checks
                if body.get("stream"):
                    self._send_stream(message, mid_stream=reply.mid_stream)
                else:
                    self._send_json(200, message, {**fake.answer_headers, **reply.headers})

            def _send_stream(self, message: dict, *, mid_stream: Callable[[], None] | None = None) -> None:
                events = [
                    f"event: {name}\ndata: {json.dumps(event)}\n\n".encode() for name, event in stream_events(message)
                ]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(sum(len(event) for event in events)))
                self.send_header("request-id", f"req_fake_{time.monotonic_ns()}")
                self.end_headers()
                if mid_stream is not None:
                    self.wfile.write(events[0])
                    self.wfile.flush()
                    mid_stream()
                    events = events[1:]
                self.wfile.write(b"".join(events))

        return Handler


def stream_events(message: dict) -> list[tuple[str, dict]]:
    """A message as the API streams it (`stream: true`): its blocks as deltas, the input
    usage at the start and the output usage at the end."""
    usage = dict(message.get("usage") or {})
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    events: list[tuple[str, dict]] = [("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(message["content"]):
        events += block_events(index, block)
    delta_usage = {"output_tokens": usage.get("output_tokens", 0)}
    events.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message.get("stop_reason"), "stop_sequence": None},
                "usage": delta_usage,
            },
        )
    )
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def block_events(index: int, block: dict) -> list[tuple[str, dict]]:
    kind = block.get("type")
    if kind == "text":
        empty, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": block["text"]}]
    elif kind == "tool_use":
        empty = {**block, "input": {}}
        deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block.get("input", {}))}]
    elif kind == "thinking":
        empty = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [
            {"type": "thinking_delta", "thinking": block.get("thinking", "")},
            {"type": "signature_delta", "signature": block.get("signature", "")},
        ]
    else:
        empty, deltas = block, []
    events = [("content_block_start", {"type": "content_block_start", "index": index, "content_block": empty})]
    events += [("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}) for d in deltas]
    events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    return events


def serve_forever() -> None:
    """`python -m tests.fake_anthropic`: run the fake alone (benchmarks, live servers).

    Prints its base URL on the first line. FAKE_LATENCY_MS delays every default answer;
    FAKE_SYSTEM_ANSWERS (JSON) sets `system_answers`.
    """
    import os
    import signal

    fake = FakeAnthropic(latency=float(os.environ.get("FAKE_LATENCY_MS", "0")) / 1000)
    fake.system_answers = json.loads(os.environ.get("FAKE_SYSTEM_ANSWERS") or "{}")
    print(fake.base_url, flush=True)

    def stop(*args):
        raise KeyboardInterrupt  # shutdown() from the serving thread itself would deadlock

    signal.signal(signal.SIGTERM, stop)
    try:
        fake.server.serve_forever()
    except KeyboardInterrupt:
        fake.server.server_close()


def memory_tool_calls(body: dict, *, view_always: bool = False) -> list[dict] | None:
    """The tool_use blocks the fake model asks for, when offered the memory tool (module doc)."""
    if not any(tool.get("type") == "memory_20250818" for tool in body.get("tools") or []):
        return None
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    content = last.get("content")
    results = [b for b in content if b.get("type") == "tool_result"] if isinstance(content, list) else []
    if results:
        # After a listing of /memories/facts, read every file in it; otherwise answer.
        listing = next((r for r in results if "Here're the files" in str(r.get("content"))), None)
        if listing is None or listing.get("is_error"):
            return None
        paths = [line.split("\t", 1)[1] for line in str(listing["content"]).splitlines()[1:] if "\t" in line]
        files = [path for path in paths if not path.endswith("/")]
        return [tool_block({"command": "view", "path": path}) for path in files] or None
    task = last_user_text(messages)
    lowered = task.lower()
    if "remember" in lowered:
        digest = hashlib.sha256(task.encode()).hexdigest()[:12]
        return [tool_block({"command": "create", "path": f"/memories/facts/{digest}.md", "file_text": task})]
    if "recall" in lowered or view_always:
        return [tool_block({"command": "view", "path": "/memories/facts"})]
    return None


def tool_block(tool_input: dict, name: str = "memory") -> dict:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:20]}", "name": name, "input": tool_input}


def clear_tool_uses(body: dict, tokens) -> dict | None:
    """The `clear_tool_uses_20250919` edit: past its trigger, the results of all but the
    newest `keep` tool uses are cleared; what it cleared, as the API reports it."""
    edits = (body.get("context_management") or {}).get("edits") or []
    edit = next((e for e in edits if e.get("type") == "clear_tool_uses_20250919"), None)
    if edit is None:
        return None
    messages = body.get("messages", [])
    trigger = (edit.get("trigger") or {}).get("value") or 100_000
    if tokens({"system": body.get("system"), "messages": messages}) < trigger:
        return None
    keep = (edit.get("keep") or {}).get("value", 3)
    results = [
        block
        for message in messages
        if isinstance(message.get("content"), list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]
    cleared = results[: max(len(results) - keep, 0)]
    return {
        "type": "clear_tool_uses_20250919",
        "cleared_tool_uses": len(cleared),
        "cleared_input_tokens": sum(tokens(block.get("content")) for block in cleared),
    }


def tool_pairing_error(messages: list) -> str | None:
    """Every tool_use must be answered by a tool_result in the next (user) message."""
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if message.get("role") != "assistant" or not isinstance(content, list):
            continue
        ids = {b.get("id") for b in content if isinstance(b, dict) and b.get("type") == "tool_use"}
        if not ids:
            continue
        following = messages[index + 1] if index + 1 < len(messages) else None
        answered = following.get("content") if following else None
        answered_ids = (
            {b.get("tool_use_id") for b in answered if isinstance(b, dict) and b.get("type") == "tool_result"}
            if isinstance(answered, list)
            else set()
        )
        if not ids <= answered_ids:
            return (
                f"messages.{index + 1}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                + ", ".join(sorted(ids - answered_ids))
            )
    return None


def content_error(messages) -> str | None:
    """The real API's content rules, with its messages: what it refuses with a 400."""
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    if problem := tool_pairing_error(messages):
        return problem
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
