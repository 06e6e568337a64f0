"""Context management: keep a persistent session inside its token budget, cheaply.

- Accounting: the request's size is estimated from its text, and measured with the API's
  free `count_tokens` endpoint when the estimate comes near the budget.
- `summarize` (default for persistent agents): when the next request would pass
  `context_budget_tokens`, the oldest turns are summarised by the model into one summary
  turn; recent turns stay verbatim and a tool call is never split from its result. The
  replaced turns move, verbatim, to `session_compactions` (nothing is lost).
- `server`: Anthropic's compaction edit; the returned compaction block is kept verbatim.
- Rotation: past per-agent thresholds the session ends and a new one starts with a
  handoff note (summary, open threads, the artifact manifest), linked to its predecessor.
- Prompt caching: `cache_control` on the system prompt and on the last replayed turn, so
  each heartbeat pays cache-read prices for what it already sent.
- Manifest: artifacts the agent reports (`ARTIFACT {"name": ..., "kind": ..., "checksum": ...}`
  lines, or a process adapter's `artifacts`) are kept on the session and sent each time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.utils import timezone

from costs_app.catalogue import catalogue
from paperclip.recently_used import RecentlyUsed
from sessions_app.adapters import AdapterError, AdapterRequest
from sessions_app.errors import HistoryUnavailable
from sessions_app.history_json import json_length, json_size
from sessions_app.models import Agent, AgentSession

# The context window of a model the catalogue does not know (or gives none for); the
# catalogue's `max_input_tokens` otherwise (costs_app.catalogue).
DEFAULT_CONTEXT_WINDOW = 200_000
# One turn verbatim at each compaction, and every turn since (up to GROWTH_TURNS more): each
# turn kept is written to the cache again after the summary that precedes it. The bench
# (bench/RESULTS.md, `defaults`) measured 1.47x stateless with one kept and 1.54x with two.
DEFAULT_KEEP_RECENT_TURNS = 1
SUMMARY_MAX_TOKENS = 2048
# Measure exactly (count_tokens) once the estimate passes this share of the budget.
MEASURE_ABOVE = 0.8
SUMMARY_KINDS = ("summary", "handoff")

SUMMARY_SYSTEM = (
    "You compress the earlier part of a long-running agent's conversation so that the agent "
    "can continue without it. Keep every fact, decision, name, number, file and artifact, "
    "every open question and unfinished task, and what the user asked for. Drop pleasantries "
    "and repetition. Write plain prose and short lists; no preamble."
)
HANDOFF_SYSTEM = (
    "This agent session is being rotated: a fresh session will continue the work. Write the "
    "handoff note for it: 1) a summary of the state of the work, 2) open threads and next "
    "steps, 3) decisions and constraints to respect. Be complete but brief; no preamble."
)
ARTIFACT_LINE = re.compile(r"^\s*ARTIFACT\s+(\{.*\})\s*$", re.MULTILINE)


@dataclass(frozen=True)
class ContextSettings:
    strategy: str
    budget_tokens: int
    summary_model: str
    keep_recent_turns: int
    caching: bool
    cache_ttl: str
    rotate_after_turns: int | None
    rotate_after_input_tokens: int | None
    rotate_after_hours: float | None


def model_window(model: str) -> int:
    """The most input tokens `model` takes: the catalogue's `max_input_tokens`."""
    entry = catalogue().get(model)
    return entry.max_input_tokens if entry is not None and entry.max_input_tokens else DEFAULT_CONTEXT_WINDOW


def default_summary_model(model: str, *, now: datetime) -> str:
    """Summaries are written by the cheapest active model of the agent's family line (its
    generation in the catalogue: Haiku 5.5 for an Opus 5.5 or Fable 5.1 agent) unless
    `summary_model` says otherwise: they read every replaced turn at full input price, and
    at Opus prices they were a third of what a persistent session cost beyond a stateless
    one (bench/RESULTS.md, `defaults`). A model the catalogue does not know summarises
    itself. Pinned facts are checked whichever model writes them (`sessions_app.pins`)."""
    return catalogue().cheapest_of_generation(model, at=now) or model


def context_settings(agent: Agent, *, now: datetime | None = None) -> ContextSettings:
    config = agent.adapter_config
    window = model_window(agent.model_name)
    default_strategy = "summarize" if agent.is_persistent else "none"
    summary_model = config.get("summary_model")
    if not summary_model and agent.is_persistent:
        summary_model = default_summary_model(agent.model_name, now=now or timezone.now())
    return ContextSettings(
        strategy=config.get("context_strategy") or default_strategy,
        budget_tokens=int(config.get("context_budget_tokens") or window // 2),
        summary_model=summary_model or agent.model_name,
        keep_recent_turns=int(config.get("keep_recent_turns") or DEFAULT_KEEP_RECENT_TURNS),
        caching=agent.adapter_type == "claude-code" and bool(config.get("prompt_caching", True)),
        cache_ttl=config.get("cache_ttl") or "5m",
        rotate_after_turns=config.get("rotate_after_turns"),
        rotate_after_input_tokens=config.get("rotate_after_input_tokens"),
        rotate_after_hours=config.get("rotate_after_hours"),
    )


def estimate_tokens(payload: object) -> int:
    """About four characters of JSON per token: cheap, and errs on the large side for prose.
    Every persistent heartbeat measures its whole request so (`history_json.json_length`)."""
    return json_length(payload) // 4 + 1


def input_tokens_bound(payload: object) -> int:
    """The most tokens `payload` can be: no token covers less than one byte of UTF-8 (the
    JSON's keys and quotes more than pay for the few tokens the API adds per message).
    About four times the estimate for English; exact enough to reserve against. A float
    may be counted a byte shorter than `json.dumps` writes it (`1e20` for `1e+20`), which
    the keys and quotes around it more than pay for (`history_json.json_size`)."""
    return json_size(payload)


# Input the API bills for a request that offers tools but that is not in its bytes, so no
# byte bound covers it. A tool-use system prompt comes with any tool: Anthropic's tool-use
# pricing table (platform.claude.com/docs/en/agents-and-tools/tool-use/overview#pricing)
# lists 290 to 804 tokens by model and tool_choice, the most Claude Opus 4.7's 804 with
# `any`/`tool`. Rounded up: each model family has moved it (Opus 4.6 497 -> 4.7 675 with
# `auto`), and a family newer than the table must not be under-held by a few tokens.
TOOL_USE_SYSTEM_PROMPT_TOKENS = 1_000
# An Anthropic-defined tool (one with a `type`, as the memory tool `memory_20250818`) is
# sent as its name; the API adds its schema and instructions. Published figures: the text
# editor 700 tokens, computer use 735 plus a 466-499 token system prompt. The memory tool
# has none published; its six commands outnumber the text editor's and the API adds its
# memory protocol to the system prompt, so it is held at well above the largest figure.
ANTHROPIC_TOOL_TOKENS = 2_000


def hidden_tool_tokens(tools: list[dict] | None) -> int:
    """The most input tokens the API adds, unseen in the request, for offering `tools`."""
    if not tools:
        return 0
    defined = sum(1 for tool in tools if tool.get("type") not in (None, "custom"))
    return TOOL_USE_SYSTEM_PROMPT_TOKENS + defined * ANTHROPIC_TOOL_TOKENS


def request_tokens_bound(request: AdapterRequest) -> int:
    """The most input tokens `request` can be billed: its bytes and what its tools add."""
    sent = {"system": request.system_blocks or request.system, "messages": request.messages, "tools": request.tools}
    return input_tokens_bound(sent) + hidden_tool_tokens(request.tools)


def request_size(adapter, request: AdapterRequest, budget: int) -> int:
    estimate = estimate_tokens({"system": request.system_blocks or request.system, "messages": request.messages})
    if estimate < MEASURE_ABOVE * budget or not adapter.counts_tokens:
        return estimate
    try:
        return adapter.count_tokens(request)
    except AdapterError:
        return estimate  # counting is advisory; the estimate is conservative


# --- building the request -------------------------------------------------------------


def cache_marker(settings: ContextSettings) -> dict:
    marker = {"type": "ephemeral"}
    if settings.cache_ttl == "1h":
        marker["ttl"] = "1h"
    return marker


def as_blocks(content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [dict(block) for block in content]


def manifest_text(manifest: list) -> str:
    lines = [
        f"- {a['name']} ({a.get('kind', 'file')}){' ' + a['checksum'] if a.get('checksum') else ''}" for a in manifest
    ]
    return (
        "Sandbox manifest: artifacts this session has created so far. Check it before creating "
        "anything again.\n" + "\n".join(lines)
    )


def user_turn_content(task: str, manifest: list):
    if not manifest:
        return task
    return [{"type": "text", "text": manifest_text(manifest)}, {"type": "text", "text": task}]


# What an earlier turn with no content is replayed as.
EMPTY_TURN = "(no content)"


def replayable(content):
    """A stored turn's content as the Messages API accepts it in an earlier turn.

    The API refuses empty messages and empty or whitespace-only text blocks there, yet a
    model can answer with no content at all (stop_reason end_turn, content []). History
    keeps what the model gave; the request drops the blank blocks, and a turn left with
    nothing says so, the same way every time so that the cached prefix stays valid.
    """
    if isinstance(content, str):
        return content if content.strip() else EMPTY_TURN
    kept = [block for block in content if not is_blank_text(block)]
    return kept or EMPTY_TURN


def is_blank_text(block) -> bool:
    return isinstance(block, dict) and block.get("type") == "text" and not str(block.get("text") or "").strip()


# The id of a history's first message -> that history and its messages as a request sends them.
_replayed = RecentlyUsed(lambda: 16)


def replayed_messages(history: list) -> list:
    """`history`'s messages as a request replays them. A history replayed again with turns
    added (a persistent session's next heartbeat: the same message objects,
    `sessions_app.history_cache`) has only its new turns made again.

    What was made is kept by the identity of each history's first message and checked
    message by message by identity: the messages kept are referenced, so no other object
    can have their identity, and neither a history nor a request's message is ever changed
    in place."""
    if not history:
        return []
    sources, replayed = _replayed.get(id(history[0])) or ((), ())
    same = len(sources) <= len(history) and all(a is b for a, b in zip(sources, history, strict=False))
    done = len(sources) if same else 0
    messages = [
        *replayed[:done],
        *({"role": m["role"], "content": replayable(m["content"])} for m in history[done:]),
    ]
    _replayed.put(id(history[0]), (list(history), messages))
    return list(messages)


def build_request(
    *, agent: Agent, history: list, user_content, settings: ContextSettings, model: str | None = None
) -> AdapterRequest:
    messages = replayed_messages(history)
    system_blocks = None
    if settings.caching:
        marker = cache_marker(settings)
        if agent.system_prompt:
            system_blocks = [{"type": "text", "text": agent.system_prompt, "cache_control": marker}]
    messages.append({"role": "user", "content": user_content})
    if settings.caching and agent.is_persistent:
        # This whole request is the next heartbeat's prefix: its end is marked, so the next
        # one reads it from the cache, and the task is written once now rather than sent
        # uncached now and written next time (bench/RESULTS.md, `defaults`).
        last = messages[-1]
        blocks = as_blocks(last["content"])
        blocks[-1] = {**blocks[-1], "cache_control": cache_marker(settings)}
        messages[-1] = {"role": last["role"], "content": blocks}
    return AdapterRequest(
        model=model or agent.model_name,
        system=agent.system_prompt,
        system_blocks=system_blocks,
        messages=messages,
        config={**agent.adapter_config, "context_strategy": settings.strategy},
    )


# --- summarize ---------------------------------------------------------------------------


def is_tool_result_turn(message: dict) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content)


def choose_split(history: list, keep_recent_turns: int) -> int | None:
    """Index where the verbatim tail starts; everything before it is summarised.

    The tail starts at a user turn that is not a tool result, so a tool call and its
    result stay together. None when there is nothing worth summarising.
    """
    split = len(history) - 2 * keep_recent_turns
    while 0 < split < len(history) and (history[split]["role"] != "user" or is_tool_result_turn(history[split])):
        split -= 1
    if split <= 0:
        return None
    if all(m.get("kind") in SUMMARY_KINDS for m in history[:split]):
        return None  # only an earlier summary would be replaced: no progress
    return split


TURN_ROLES = ("user", "assistant")
JSON_TYPES = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", type(None): "null"}


def history_problem(history: list) -> str | None:
    """Why a stored history cannot be read as turns (`HistoryMessage`: an object with a
    role and a content), naming its first entry that is not one, numbered from 1 as the
    session's page numbers its turns; None when every entry is one. A damaged or hand-edited
    history can hold any JSON: what reads it turn by turn refuses it by this, up front."""
    for number, message in enumerate(history, start=1):
        if not isinstance(message, dict):
            why = f"a JSON {JSON_TYPES.get(type(message), 'value')}, not an object"
        elif message.get("role") not in TURN_ROLES:
            why = "its role is not 'user' or 'assistant'"
        elif not isinstance(message.get("content"), (str, list)):
            why = "its content is not a text or a list of blocks"
        else:
            continue
        return f"entry {number} is not a turn ({why})"
    return None


@contextmanager
def read_as_turns(history: list, *, to: str) -> Iterator[None]:
    """Runs a step that reads `history` turn by turn, and names the entry that is not a turn
    (`history_malformed`) when the step trips over one. A damaged or hand-edited history is
    diagnosed only once it fails: checking every entry of a long history up front would cost
    each heartbeat more than the rest of its request's building."""
    try:
        yield
    except (AttributeError, KeyError, TypeError) as exc:
        problem = history_problem(history)
        if problem is None:
            raise  # a well-formed history: the error is ours, and stays `internal_error`
        raise HistoryUnavailable("history_malformed", f"The session's history cannot be {to}: {problem}.") from exc


def summary_input_text(messages: list) -> str:
    """The turns a summary replaces, as the text the summary model reads (turns as
    `history_problem` accepts them; a block that is not a readable text goes as JSON)."""
    lines = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            text = content
        else:
            parts = []
            for block in content:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "text" and isinstance(block.get("text"), str):
                    parts.append(block["text"])
                elif kind == "compaction" and isinstance(block.get("content") or "", str):
                    parts.append(block.get("content") or "")
                else:
                    parts.append(json.dumps(block, ensure_ascii=False))
            text = "\n".join(parts)
        label = "Summary of earlier conversation" if message.get("kind") in SUMMARY_KINDS else message["role"]
        lines.append(f"[{label}]\n{text}")
    return "\n\n".join(lines)


def summary_input_chars(settings: ContextSettings) -> int:
    # About half the summary model's window at four characters a token: the summary call
    # must fit, whatever the session holds (a huge answer, a long session handed off).
    return model_window(settings.summary_model) * 2


def clipped(text: str, limit: int) -> str:
    """`text` within about `limit` characters: its beginning and its end, the middle left out."""
    if len(text) <= limit:
        return text
    head = limit // 3
    tail = limit - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n\n[... {omitted:,} characters of the conversation left out ...]\n\n{text[-tail:]}"


def summary_request(
    *, agent: Agent, settings: ContextSettings, messages: list, system: str, instructions: str = ""
) -> AdapterRequest:
    """The request for a summary of `messages`; `instructions` (the pinned facts, a retry's
    missing ones) follow the conversation, where clipping cannot cut them."""
    text = clipped(summary_input_text(messages), summary_input_chars(settings)) + instructions
    return AdapterRequest(
        model=settings.summary_model,
        system=system,
        messages=[{"role": "user", "content": text}],
        config={**agent.adapter_config, "context_strategy": "none"},
        max_tokens=SUMMARY_MAX_TOKENS,
    )


def summary_pair(summary: str, *, kind: str, at: datetime) -> list[dict]:
    heading = (
        "[Summary of the earlier conversation, written when this session was compacted]"
        if kind == "summary"
        else "[Handoff note from the previous session of this agent]"
    )
    return [
        {"role": "user", "content": f"{heading}\n\n{summary}", "kind": kind, "at": at.isoformat()},
        {"role": "assistant", "content": "Understood. I will continue from here.", "kind": kind, "at": at.isoformat()},
    ]


# --- rotation and manifest --------------------------------------------------------------


def rotation_due(session: AgentSession, settings: ContextSettings, now: datetime) -> bool:
    if settings.rotate_after_turns and session.turn_count >= settings.rotate_after_turns:
        return True
    if (
        settings.rotate_after_input_tokens
        and session.last_input_tokens
        and session.last_input_tokens >= settings.rotate_after_input_tokens
    ):
        return True
    if settings.rotate_after_hours and session.created_at <= now - timedelta(hours=settings.rotate_after_hours):
        return True
    return False


def reported_artifacts(text: str, structured: list) -> list[dict]:
    found = list(structured)
    for match in ARTIFACT_LINE.finditer(text or ""):
        try:
            found.append(json.loads(match.group(1)))
        except (ValueError, RecursionError):
            continue
    clean = []
    for item in found:
        if isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"].strip():
            clean.append(
                {
                    "name": item["name"].strip()[:500],
                    "kind": str(item.get("kind") or "file")[:100],
                    "checksum": str(item.get("checksum") or "")[:200],
                }
            )
    return clean


def manifest_merge(manifest: list, artifacts: list[dict], *, at: datetime) -> list:
    by_name = {a["name"]: a for a in manifest}
    for artifact in artifacts:
        by_name[artifact["name"]] = {**artifact, "at": at.isoformat()}
    return list(by_name.values())
