"""Per-agent heartbeat schedules in django-q2, kept in step with the agent row.

Created, updated and removed idempotently by name whenever an agent is saved, paused or
deleted; never from AppConfig.ready(). `catch_up` is off in settings, so a cluster that was
down does not replay every missed tick at once.
"""

from __future__ import annotations

from django_q.models import Schedule

from sessions_app.models import Agent, AgentStatus


def schedule_name(agent_id) -> str:
    return f"heartbeat:{agent_id}"


def agent_schedule_sync(*, agent: Agent) -> None:
    interval = (agent.adapter_config or {}).get("heartbeat_interval_minutes") if agent.adapter_config else None
    name = schedule_name(agent.id)
    if agent.status != AgentStatus.ACTIVE or not interval:
        Schedule.objects.filter(name=name).delete()
        return
    Schedule.objects.update_or_create(
        name=name,
        defaults={
            "func": "sessions_app.tasks.scheduled_heartbeat",
            "args": repr((str(agent.id),)),
            "schedule_type": Schedule.MINUTES,
            "minutes": int(interval),
            "repeats": -1,
        },
    )
