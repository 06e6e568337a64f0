"""Session-hour metering (seed 003, "pay for active time only").

A session accrues active seconds only while one of its runs is in progress; they are
billed as `session_hours` cost events when the session pauses, expires or ends, at
PAPERCLIP_SESSION_HOUR_USD per hour (0 turns metering off).
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from django.conf import settings
from django.db import transaction

from costs_app.models import CostEvent, CostKind
from sessions_app.models import AgentSession

SECONDS_PER_HOUR = Decimal(3600)


def hourly_rate() -> Decimal:
    return Decimal(str(settings.PAPERCLIP_SESSION_HOUR_USD))


def session_hours_bill(*, session_ids, now: datetime, statuses=None) -> int:
    """Write one session_hours event per session with unbilled active time (of those in
    `statuses`, when given). Billing zeroes the unbilled time under the row's lock, so
    every path that ends a session can call this and each second is billed once."""
    rate = hourly_rate()
    billed = 0
    with transaction.atomic():
        sessions = AgentSession.objects.select_for_update().filter(
            id__in=list(session_ids), unbilled_active_seconds__gt=0
        )
        if statuses is not None:
            sessions = sessions.filter(status__in=statuses)
        sessions = sessions.only("id", "agent_id", "company_id", "unbilled_active_seconds", "total_cost_usd")
        for session in sessions:
            seconds = Decimal(str(session.unbilled_active_seconds))
            cost = (seconds / SECONDS_PER_HOUR * rate).quantize(Decimal("0.0000000001"))
            if rate > 0:
                CostEvent.objects.create(
                    kind=CostKind.SESSION_HOURS,
                    company_id=session.company_id,
                    agent_id=session.agent_id,
                    session_id=session.id,
                    model="",
                    session_seconds=round(session.unbilled_active_seconds),
                    cost_usd=cost,
                    created_at=now,
                )
                billed += 1
            AgentSession.objects.filter(id=session.id).update(
                unbilled_active_seconds=0, total_cost_usd=session.total_cost_usd + (cost if rate > 0 else 0)
            )
    return billed
