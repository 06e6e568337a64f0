"""A session's history turned into turns an operator can read (the admin's session page).

History is untrusted text: nothing here builds HTML. The template renders every value with
autoescape on, so a turn containing `<script>` shows as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.utils.dateparse import parse_datetime

from sessions_app.adapters.base import HistoryMessage

USAGE_KEYS = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


@dataclass
class Part:
    """One piece of a turn's content: plain text, or a labelled JSON block (tool use...)."""

    kind: str  # "text", or the content block's type
    text: str
    label: str = ""


@dataclass
class Turn:
    index: int
    role: str
    at: datetime | None
    at_raw: str
    kind: str
    run_id: str
    parts: list[Part] = field(default_factory=list)
    seq: int | None = None
    usage: dict[str, int] = field(default_factory=dict)
    cost_usd: Decimal | None = None


def _as_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def content_parts(content: Any) -> list[Part]:
    """Text blocks as text; tool calls, tool results and unknown blocks as labelled JSON."""
    if content is None:
        return []
    if isinstance(content, str):
        return [Part("text", content)]
    if not isinstance(content, list):
        return [Part("json", _as_json(content), label="content")]
    parts: list[Part] = []
    for block in content:
        if isinstance(block, str):
            parts.append(Part("text", block))
            continue
        if not isinstance(block, dict):
            parts.append(Part("json", _as_json(block), label="content"))
            continue
        block_type = str(block.get("type", ""))
        if block_type == "text":
            parts.append(Part("text", str(block.get("text", ""))))
        elif block_type == "compaction":
            parts.append(Part("compaction", str(block.get("content") or ""), label="compaction (summary by the API)"))
        elif block_type == "compaction_boundary":
            before = block.get("pre_tokens")
            text = f"Claude Code compacted its context ({block.get('trigger') or 'auto'}"
            text += f", {before} tokens before)" if before else ")"
            parts.append(Part("compaction", text, label="compaction boundary (Claude Code)"))
        elif block_type == "thinking":
            parts.append(Part("thinking", str(block.get("thinking", "")), label="thinking"))
        elif block_type == "tool_use":
            parts.append(Part("tool_use", _as_json(block.get("input")), label=f"tool call: {block.get('name', '?')}"))
        elif block_type in ("image", "document"):
            # Base64 payloads are unreadable and can be megabytes: say what it is instead.
            source = block.get("source") if isinstance(block.get("source"), dict) else {}
            size = len(str(source.get("data", ""))) if source.get("data") else 0
            detail = ", ".join(str(x) for x in (source.get("media_type"), source.get("url")) if x)
            description = block_type + (f": {detail}" if detail else "")
            if size:
                description += f", {size} base64 characters"
            parts.append(Part(block_type, f"[{description}]", label=block_type))
        elif block_type == "tool_result":
            inner = block.get("content")
            text = (
                "\n".join(p.text for p in content_parts(inner)) if isinstance(inner, (str, list)) else _as_json(inner)
            )
            parts.append(Part("tool_result", text, label="tool result" + (" (error)" if block.get("is_error") else "")))
        else:
            parts.append(Part("json", _as_json(block), label=block_type or "block"))
    return parts


def _usage(message: dict) -> dict[str, int]:
    usage = message.get("usage")
    if not isinstance(usage, dict):
        return {}
    return {key: usage[key] for key in USAGE_KEYS if isinstance(usage.get(key), int) and usage[key]}


def _cost(message: dict) -> Decimal | None:
    for holder in (message, message.get("usage") if isinstance(message.get("usage"), dict) else {}):
        value = holder.get("cost_usd")
        if value is not None:
            try:
                return Decimal(str(value))
            except ArithmeticError:
                return None
    return None


def transcript(history: list[HistoryMessage], *, run_costs: dict[str, Decimal] | None = None) -> list[Turn]:
    """Readable turns. The cost of an assistant turn comes from the message when it carries
    one, else from the ledger's cost for its run (`run_costs`, keyed by run id as text)."""
    run_costs = run_costs or {}
    turns = []
    for index, message in enumerate(history, start=1):
        if not isinstance(message, dict):
            turns.append(Turn(index, "?", None, "", "", "", [Part("json", _as_json(message), label="unreadable turn")]))
            continue
        at_raw = str(message.get("at") or "")
        try:
            at = parse_datetime(at_raw) if at_raw else None
        except ValueError:
            at = None
        run_id = str(message.get("run_id") or "")
        role = str(message.get("role") or "?")
        cost = _cost(message)
        if cost is None and role == "assistant" and run_id in run_costs:
            cost = run_costs[run_id]
        turns.append(
            Turn(
                index=index,
                role=role,
                at=at,
                at_raw=at_raw,
                kind=str(message.get("kind") or ""),
                run_id=run_id,
                parts=content_parts(message.get("content")),
                usage=_usage(message),
                cost_usd=cost,
                seq=message["seq"] if isinstance(message.get("seq"), int) else None,
            )
        )
    return turns
