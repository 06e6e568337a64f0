"""One heartbeat, start to finish. (Interface; implementation lands in the next commit.)"""

from __future__ import annotations

from datetime import datetime

from sessions_app.models import Agent, HeartbeatRun, RunTrigger


class HeartbeatRefused(Exception):
    """The heartbeat cannot even be queued. `code` maps to an API status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def heartbeat_enqueue(
    *,
    agent: Agent,
    task: str,
    now: datetime,
    idempotency_key: str | None = None,
    force_fresh: bool = False,
    trigger: str = RunTrigger.API,
) -> tuple[HeartbeatRun, bool]:
    """Create a queued run, or return the earlier run with the same idempotency key
    (second value False). Raises HeartbeatRefused for a paused/deleted agent."""
    raise NotImplementedError


def heartbeat_execute(*, run_id, now: datetime | None = None) -> HeartbeatRun:
    """Run a queued run to a terminal state (or leave it queued when the agent is busy)."""
    raise NotImplementedError


def heartbeat_dispatch(*, run: HeartbeatRun) -> None:
    """Hand a queued run to the django-q2 cluster after the current transaction commits."""
    raise NotImplementedError
