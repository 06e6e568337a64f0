"""Heartbeats without work cost nothing: the engine's side of `work_checks`.

- `check_for_work`, a heartbeat's first step after its claim: the agent's work check runs
  outside any transaction, before any model call. No work: `run_skip` ends the run
  `skipped` (no model call, no ledger row, the session neither resumed nor touched, its TTL
  clock unchanged). A check that cannot tell fails the run `work_check_failed` (or
  `work_check_not_allowed`): no model call either, and nothing is guessed, since guessing
  "work" spends money and guessing "none" hides a broken check; the failure shows on the run.
- `idle_streak_record`: a run that found no work (skipped, or answered with the
  nothing-to-do marker) adds one to the agent's idle streak, a run with work resets it;
  when that changes the back-off factor, the agent's schedule is re-armed
  (`schedules.agent_schedule_sync`, which stretches the interval or skips cron wakes).
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from django.db.models import F

from sessions_app.errors import RunAbandoned
from sessions_app.models import Agent, HeartbeatRun, RunStatus
from sessions_app.schedules import agent_schedule_sync
from sessions_app.wakes import HeartbeatPlan
from sessions_app.work_checks import Found, agent_backoff, task_with_output, work_check_run


def check_for_work(*, run: HeartbeatRun, agent: Agent) -> str | None:
    """The task the model is to see, with what the check found appended; None when the
    check found no work. Raises `WorkCheckFailed` when it cannot tell. Without a check,
    the run's task as it is."""
    check = agent.adapter_config.get("work_check")
    if not check:
        return run.task
    found: Found = work_check_run(check)
    if not found.work:
        return None
    # The check may have outlived the run's deadline: a reaped run calls no model. What the
    # check found is kept on the run (shown by the API and the admin); the task itself
    # stays as asked, so that an idempotent retry still matches it.
    if not HeartbeatRun.objects.filter(id=run.id, status=RunStatus.RUNNING).update(work_check_output=found.output):
        raise RunAbandoned("run_timeout", "The run was reaped while its work check ran; no model was called.")
    run.work_check_output = found.output
    return task_with_output(run.task, found.output)


def continued_task(run: HeartbeatRun) -> str:
    """The task of a run that goes on from an earlier attempt, as the model saw it then
    (with what its work check found, which is not run again)."""
    return task_with_output(run.task, run.work_check_output) if run.work_check_output else run.task


def run_skip(*, run: HeartbeatRun, finished: datetime) -> bool:
    """End a running run `skipped`; False when it was no longer running (reaped meanwhile)."""
    return bool(
        HeartbeatRun.objects.filter(id=run.id, status=RunStatus.RUNNING).update(
            status=RunStatus.SKIPPED, finished_at=finished, reserved_usd=Decimal(0)
        )
    )


def idle_streak_record(*, agent: Agent, idle: bool, now: datetime) -> int:
    """Count a finished run on the agent's idle streak; returns the streak.

    `agent` is the row the run's claim read. Only one run of an agent runs at a time and a
    save of the agent never writes the streak (`models.ENGINE_FIELDS`), so that read is
    the stored value, and a run with work by an agent that was not idle writes nothing."""
    before = agent.idle_streak
    if idle:
        Agent.objects.filter(pk=agent.pk).update(idle_streak=F("idle_streak") + 1)
    elif before:
        Agent.objects.filter(pk=agent.pk).update(idle_streak=0)
    after = before + 1 if idle else 0
    agent.idle_streak = after
    config = agent.adapter_config
    if HeartbeatPlan.of(config) and agent_backoff(config, before) != agent_backoff(config, after):
        agent_schedule_sync(agent=agent, now=now)
    return after


def heartbeat_skip(*, run: HeartbeatRun, agent: Agent, finished: datetime, now: datetime) -> bool:
    """The check found no work: the run ends `skipped` and the agent's idle streak grows.
    Returns False: the run's row changed under `run` (the heartbeat reads it back)."""
    if run_skip(run=run, finished=finished):
        idle_streak_record(agent=agent, idle=True, now=now)
    return False
