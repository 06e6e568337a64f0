"""django-q2 task entry points: thin, they take ids and call the domain functions."""

from __future__ import annotations

from django.db.models import F
from django.utils import timezone

from sessions_app.heartbeat import HeartbeatRefused, heartbeat_execute, heartbeat_start
from sessions_app.models import Agent, AgentStatus, HeartbeatRun, RunStatus, RunTrigger
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
    if merged := tick_merge(agent_id=agent.pk):
        return f"merged into run {merged}"
    task = agent.adapter_config.get("heartbeat_task") or DEFAULT_SCHEDULED_TASK
    try:
        # The tick already runs in a cluster worker: it executes the run here when it can
        # be claimed and otherwise (PAPERCLIP_MAX_CONCURRENT_RUNS reached) leaves it queued
        # for the next dispatch, never holding the worker while it waits.
        run, _ = heartbeat_start(
            agent=agent, task=task, trigger=RunTrigger.SCHEDULE, now=timezone.now(), wait=True, wait_seconds=0
        )
    except HeartbeatRefused as exc:
        return f"skipped: {exc.code}"
    return run.status


def tick_merge(*, agent_id) -> str | None:
    """No pile-up: a tick for an agent with a queued or running run is counted on that run
    (its oldest queued one, else the running one) instead of queueing another. Returns the
    run's id, or None when the agent has no unfinished run.

    The UPDATE re-checks the status, so a run that finished meanwhile is not counted: the
    tick then queues a run of its own."""
    unfinished = HeartbeatRun.objects.filter(agent_id=agent_id)
    for status in (RunStatus.QUEUED, RunStatus.RUNNING):
        oldest = unfinished.filter(status=status).order_by("created_at").values_list("pk", flat=True).first()
        if oldest and HeartbeatRun.objects.filter(pk=oldest, status=status).update(merged_ticks=F("merged_ticks") + 1):
            return str(oldest)
    return None


def maintenance() -> dict:
    from sessions_app.maintenance import maintenance_pass

    return maintenance_pass(now=timezone.now())
