"""django-q2 task entry points: thin, they take ids and call the domain functions."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone

from sessions_app.errors import HeartbeatRefused, RunRemoved
from sessions_app.heartbeat import heartbeat_execute, heartbeat_start
from sessions_app.models import Agent, AgentStatus, RunTrigger
from sessions_app.run_queue import heartbeat_dispatch
from sessions_app.schedules import agent_schedule_sync
from sessions_app.wakes import HeartbeatPlan

DEFAULT_SCHEDULED_TASK = "Heartbeat: review your assigned work and continue where you left off."


def execute_run(run_id: str) -> str:
    try:
        run = heartbeat_execute(run_id=run_id)
    except RunRemoved as exc:
        return f"skipped: {exc.code}"  # removed with its agent: nothing is left to run or record
    if run.runs_in is not None:
        # Sent here before its agent was pinned to a cluster, or by hand: passed on to it.
        heartbeat_dispatch(run=run)
        return f"sent to cluster {run.runs_in}"
    return run.status


def scheduled_heartbeat(agent_id: str, wake_at: str | None = None, step_minutes: int | None = None) -> str:
    """A scheduled wake of the agent. A ONCE row (a cron agent's, or a long interval's,
    which passes the wake it was armed for, `wake_at`, and its step, `step_minutes`, read
    back by the arming) fires once: its next wake is armed before anything here can fail."""
    agent = Agent.objects.filter(id=agent_id, status=AgentStatus.ACTIVE).first()
    if agent is None:
        return "skipped: agent not active"
    if (plan := HeartbeatPlan.of(agent.adapter_config)) and (plan.cron or wake_at):
        fired = datetime.fromisoformat(wake_at) if wake_at else None
        agent_schedule_sync(agent=agent, now=timezone.now(), fired=True, wake_at=fired)
    task = agent.adapter_config.get("heartbeat_task") or DEFAULT_SCHEDULED_TASK
    try:
        # The tick already runs in a cluster worker: it executes the run here when it can
        # be claimed and otherwise (PAPERCLIP_MAX_CONCURRENT_RUNS reached) leaves it queued
        # for the next dispatch, never holding the worker while it waits. An agent with a
        # run queued or running gets no other: the tick is counted on it (`tick_merge`).
        run, created = heartbeat_start(
            agent=agent,
            task=task,
            trigger=RunTrigger.SCHEDULE,
            now=timezone.now(),
            wait=True,
            wait_seconds=0,
            merge=True,
        )
    except HeartbeatRefused as exc:
        return f"skipped: {exc.code}"
    return run.status if created else f"merged into run {run.id}"


def cli_local_copy_delete(agent_id: str, cli_session_id: str) -> str:
    """On the host of the cluster an agent is pinned to: the CLI's own copy of a deleted
    session (`sessions_app.cli_transcripts.cli_sessions_delete`)."""
    from sessions_app.adapters.cli_home import local_copy_delete

    local_copy_delete(agent_id=agent_id, cli_session_id=cli_session_id)
    return "deleted"


def compact_ahead(session_id: str, message_count: int, compaction_count: int) -> str:
    from sessions_app.compact_now import session_compact_ahead

    return session_compact_ahead(session_id=session_id, seen=(message_count, compaction_count))


def quota_wake() -> int:
    """A credential's hold reaches its reset (`sessions_app.quota`): wake the waiting runs."""
    from sessions_app.run_queue import dispatch_waiting

    return dispatch_waiting()


def maintenance() -> dict:
    from sessions_app.maintenance import maintenance_pass

    return maintenance_pass(now=timezone.now())


def cache_refresh(session_id: str) -> str:
    from sessions_app.cache_refresh import session_cache_refresh

    return session_cache_refresh(session_id=session_id)


def managed_ends() -> int:
    from sessions_app.managed_sessions import managed_ends_process

    return managed_ends_process(now=timezone.now())
