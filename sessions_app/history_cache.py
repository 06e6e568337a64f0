"""The histories this process last wrote, so that the next heartbeat of the same session
need not read its whole history back (PostgreSQL, `database` store).

A persistent heartbeat reads its session's history in full, and on PostgreSQL the server's
conversion of a long `jsonb` history to text, its transfer and its decoding were most of
what a heartbeat's cost grew by as the session grew (a 400-message history: about 2 ms of
server time and 0.8 ms of decoding, bench/RESULTS.md). The heartbeat that wrote a turn
already holds the history as it committed it. Kept here under the session's id and
`history_rev`, the next claim sends that key with its read of the live session, and the
server sends the history only when the row's key is another
(`sessions_app.plan.LiveSessionRead`).

`history_rev` is moved by PostgreSQL itself: a trigger adds one to it in every UPDATE that
sets `history`, whoever sends it (migration 0037), so a row holds the history kept under its
key or has another key. A heartbeat keeps the history it wrote only when its commit moved
the revision by exactly one from the one its plan read: then the row held the plan's
history when the turn was appended to it.

Entries are the histories as PostgreSQL gives them back (`as_stored`: `jsonb` orders an
object's keys), shared, never changed in place (the heartbeat builds new lists and dicts
from a history, it never edits one). Each process keeps at most
PAPERCLIP_HISTORY_CACHE_SESSIONS of them, the least recently used going first, each for at
most an hour. A database restored from a backup under running workers could hold an older
history under a key a worker kept: restore with the workers stopped (docs/operations.md).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from decimal import Decimal

from django.conf import settings

from paperclip.recently_used import RecentlyUsed

# A row's key, as `key_of` writes it.
HISTORY_KEY_SQL = '"agent_sessions"."id"::text || \':\' || "agent_sessions"."history_rev"::text'

# An entry older than this is dropped.
MAX_AGE_SECONDS = 3600


@dataclass(frozen=True)
class Kept:
    key: str
    history: list
    kept_at: float


# Agent id -> Kept.
_kept = RecentlyUsed(lambda: settings.PAPERCLIP_HISTORY_CACHE_SESSIONS)


def key_of(session_id, history_rev: int) -> str:
    return f"{session_id}:{history_rev}"


def kept(agent_id) -> Kept | None:
    """The history kept for the agent's live session, if any."""
    entry = _kept.get(agent_id)
    if entry is not None and time.monotonic() - entry.kept_at > MAX_AGE_SECONDS:
        _kept.pop(agent_id)
        return None
    return entry


def keep(agent_id, *, session_id, history_rev: int, history: list) -> None:
    """Keep `history` (already `as_stored`) as the agent's session holds it at `history_rev`."""
    _kept.put(agent_id, Kept(key_of(session_id, history_rev), history, time.monotonic()))


def forget_all() -> None:
    _kept.clear()


def as_stored(value):
    """`value` (JSON's types) as a `jsonb` column gives it back: each object's keys in
    `jsonb`'s order (shorter first, then by their bytes), tuples as lists, and a whole
    float written with an exponent (`1e+23`) as the integer `numeric` prints it as."""
    if isinstance(value, dict):
        return {key: as_stored(value[key]) for key in sorted(value, key=_jsonb_key_order)}
    if isinstance(value, list | tuple):
        return [as_stored(item) for item in value]
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and "e" in repr(value):
        return int(Decimal(repr(value)))
    return value


def _jsonb_key_order(key: str) -> tuple[int, bytes]:
    encoded = key.encode("utf-8", "surrogatepass")
    return len(encoded), encoded
