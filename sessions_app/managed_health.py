"""The health of remote Managed Agents sessions.

The maintenance pass reads the status of each live session's remote session, least
recently checked first and a bounded batch per pass, with no transaction or lock open
while it waits for the provider. What it finds is written by a conditional UPDATE that
names the remote session it read and skips a session a run has in flight, so a session in
use is never marked (its run reads the status itself) and a session whose heartbeat moved
it to a new remote session meanwhile is never marked for the old one.

- lost (terminated, archived, or unknown to the provider): `managed_lost_at` is set; the
  next heartbeat retires the row (`remote_lost`) and opens a new remote session whose
  first message carries a handoff note made from this service's mirror of the
  conversation (`lost_session_note`: no model call, so nothing to pay or to fail).
- unreachable (any other failure): counted on the row, shown, read again next time.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, F, Q

from sessions_app.adapters.claude_managed import RemoteHealth, remote_session_health
from sessions_app.context import summary_input_text
from sessions_app.models import IN_FLIGHT_RUN_STATUSES, LIVE_SESSION_STATUSES, AgentSession, HeartbeatRun
from sessions_app.pins import pinned_texts
from sessions_app.stores import store_for

logger = logging.getLogger(__name__)
BATCH = 50
# Readings in a row that could not reach the provider before a pass stops reading: each
# may take the whole timeout, and the steps after this one must not wait on an outage.
GIVE_UP_AFTER = 3
# About 5,000 tokens: the end of the lost conversation, not all of it.
HANDOFF_CHARS = 20_000
LOST_NOTE_HEADING = (
    "[Handoff note: your previous session ended at the service before this task arrived. "
    "This is the end of that conversation as it was recorded, and the facts pinned for you. "
    "Continue the work from here.]"
)


def _in_flight_session_ids():
    return HeartbeatRun.objects.filter(status__in=IN_FLIGHT_RUN_STATUSES, session__isnull=False).values("session_id")


def managed_health_check(*, now: datetime) -> int:
    """Read the remote status of the live sessions due a check; returns how many it found lost."""
    every = timedelta(seconds=settings.PAPERCLIP_MANAGED_HEALTH_INTERVAL_SECONDS)
    due = (
        AgentSession.objects.filter(
            status__in=LIVE_SESSION_STATUSES, managed_session_id__isnull=False, managed_lost_at__isnull=True
        )
        .filter(Q(managed_checked_at__isnull=True) | Q(managed_checked_at__lte=now - every))
        .exclude(id__in=_in_flight_session_ids())
        .order_by(F("managed_checked_at").asc(nulls_first=True))
        .values_list("id", "managed_session_id", "managed_check_failures")[:BATCH]
    )
    lost = unreachable_in_a_row = 0
    for session_id, remote_id, failures in list(due):
        reading = remote_session_health(remote_id)
        lost += reading_record(session_id, remote_id, reading, failures=failures, now=now)
        unreachable_in_a_row = unreachable_in_a_row + 1 if reading.unreachable else 0
        if unreachable_in_a_row == GIVE_UP_AFTER:
            break  # the provider is down, not these sessions: the rest wait for the next pass
    return lost


def reading_record(session_id, remote_id: str, reading: RemoteHealth, *, failures: int | None, now: datetime) -> int:
    """Write one reading to the row, if it still maps the remote session read and no run
    has taken it since; 1 when it marked the session lost."""
    unchanged = AgentSession.objects.filter(
        pk=session_id, managed_session_id=remote_id, status__in=LIVE_SESSION_STATUSES, managed_lost_at__isnull=True
    ).exclude(id__in=_in_flight_session_ids())
    if reading.lost:
        marked = unchanged.update(
            managed_lost_at=now, managed_checked_at=now, managed_problem=reading.problem, managed_check_failures=None
        )
        if marked:
            logger.warning("Managed Agents session %s is lost: %s", remote_id, reading.problem)
        return marked
    unchanged.update(
        managed_checked_at=now,
        managed_problem=reading.problem or None,
        managed_check_failures=(failures or 0) + 1 if reading.unreachable else None,
    )
    return 0


def managed_health_state() -> dict:
    """The live sessions whose remote session is lost, and those the last check could not reach."""
    return AgentSession.objects.filter(status__in=LIVE_SESSION_STATUSES, managed_session_id__isnull=False).aggregate(
        sessions_lost=Count("id", filter=Q(managed_lost_at__isnull=False)),
        sessions_unreachable=Count("id", filter=Q(managed_lost_at__isnull=True, managed_check_failures__gt=0)),
    )


def lost_session_note(session: AgentSession) -> str:
    """The note a new remote session opens with when it replaces `session`'s lost one: the
    end of the conversation this service mirrored, and the agent's pinned facts (a pin is
    never left behind with the session that held it)."""
    recorded = summary_input_text(store_for(session).read(session))
    if len(recorded) > HANDOFF_CHARS:
        recorded = "[...]\n" + recorded[-HANDOFF_CHARS:]
    parts = [LOST_NOTE_HEADING, recorded or "(The session had recorded no turns.)"]
    if pins := pinned_texts(session.agent):
        parts.append("[Pinned facts]\n" + "\n".join(f"- {pin}" for pin in pins))
    return "\n\n".join(parts)
