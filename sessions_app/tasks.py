"""django-q2 task entry points: thin, they take ids and call the domain functions."""

from __future__ import annotations

from django.utils import timezone

from sessions_app.errors import HeartbeatRefused
from sessions_app.heartbeat import heartbeat_execute, heartbeat_start
from sessions_app.models import Agent, AgentStatus, RunTrigger
from sessions_app.schedules import agent_schedule_sync
from sessions_app.wakes import HeartbeatPlan

DEFAULT_SCHEDULED_TASK = "Heartbeat: review your assigned work and continue where you left off."


def execute_run(run_id: str) -> str:
    return heartbeat_execute(run_id=run_id).status


def scheduled_heartbeat(agent_id: str) -> str:
    agent = Agent.objects.filter(id=agent_id, status=AgentStatus.ACTIVE).first()
    if agent is None:
        return "skipped: agent not active"
    # A cron schedule fires once: its next wake is armed before anything here can fail.
    if (plan := HeartbeatPlan.of(agent.adapter_config)) and plan.cron:
        agent_schedule_sync(agent=agent, now=timezone.now(), fired=True)
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


def maintenance() -> dict:
    from sessions_app.maintenance import maintenance_pass

    return maintenance_pass(now=timezone.now())
