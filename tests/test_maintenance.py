"""Idle pauses, expiry, the reaper (SIGKILLed workers included), retention, schedules and the
commands that drive them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone
from django_q.models import Schedule

from costs_app.models import CostEvent, CostKind
from sessions_app.maintenance import histories_purge, maintenance_pass, runs_reap, sessions_expire, sessions_pause_idle
from sessions_app.models import Agent, AgentSession, HeartbeatRun, HistoryStore, RunStatus, SessionStatus
from sessions_app.run_queue import heartbeat_dispatch, heartbeat_enqueue
from sessions_app.schedules import agent_schedule_sync, schedule_name
from sessions_app.services import agent_delete, agent_pause, agent_resume
from sessions_app.stores import store_for
from sessions_app.tasks import scheduled_heartbeat
from tests.conftest import beat, on_own_connection, refuse_writes, writes_refused
from tests.fake_anthropic import Reply
from tests.live.server import database_url, wait_until

ROOT = Path(__file__).resolve().parent.parent


def make_session(agent, *, last_used, ttl_hours=24, store=HistoryStore.DATABASE, messages=None):
    session = AgentSession.objects.create(
        agent=agent,
        company=agent.company,
        last_used=last_used,
        expires_at=last_used + timedelta(hours=ttl_hours),
        store=store,
        model=agent.model_name,
        adapter_type=agent.adapter_type,
    )
    if messages:
        staged = store_for(session).stage(session, messages)
        session.message_count = len(messages)
        session.save()
        staged.publish()
    return session


def test_expire_sessions_ends_stale_sessions_and_keeps_fresh_ones(persistent_agent, other_agent):
    now = timezone.now()
    stale = make_session(persistent_agent, last_used=now - timedelta(hours=25))
    fresh = make_session(other_agent, last_used=now - timedelta(hours=1))

    assert sessions_expire(now=now) == 1

    stale.refresh_from_db()
    fresh.refresh_from_db()
    assert stale.status == SessionStatus.EXPIRED and stale.ended_at == stale.expires_at
    assert fresh.status == SessionStatus.ACTIVE
    assert AgentSession.objects.filter(status=SessionStatus.ACTIVE).count() == 1


def test_expire_sessions_command_reports_what_it_did(persistent_agent, capsys):
    make_session(persistent_agent, last_used=timezone.now() - timedelta(days=2))
    call_command("expire_sessions")
    out = capsys.readouterr().out
    assert "expired 1 session(s)" in out and "removed 0 file(s) no row named" in out


def test_reaper_fails_runs_stuck_past_their_deadline(persistent_agent, stateless_agent):
    now = timezone.now()
    stuck = HeartbeatRun.objects.create(
        company=persistent_agent.company,
        agent=persistent_agent,
        task="t",
        status=RunStatus.RUNNING,
        started_at=now - timedelta(minutes=11),
        deadline_at=now - timedelta(minutes=1),
    )
    alive = HeartbeatRun.objects.create(
        company=stateless_agent.company,
        agent=stateless_agent,
        task="t",
        status=RunStatus.RUNNING,
        started_at=now,
        deadline_at=now + timedelta(minutes=10),
    )
    assert runs_reap(now=now) == [persistent_agent.id]
    stuck.refresh_from_db()
    alive.refresh_from_db()
    assert (stuck.status, stuck.error_code) == (RunStatus.FAILED, "run_timeout")
    assert stuck.finished_at == now
    assert alive.status == RunStatus.RUNNING


def test_retention_purges_history_of_long_ended_sessions_only(settings, persistent_agent, other_agent):
    settings.PAPERCLIP_RETENTION_DAYS = 30
    now = timezone.now()
    old = make_session(
        persistent_agent,
        last_used=now - timedelta(days=40),
        store=HistoryStore.FILE,
        messages=[{"role": "user", "content": "x"}],
    )
    recent = make_session(
        other_agent,
        last_used=now - timedelta(days=3),
        store=HistoryStore.FILE,
        messages=[{"role": "user", "content": "y"}],
    )
    sessions_expire(now=now)
    old_path, recent_path = store_for(old).path_for(old), store_for(recent).path_for(recent)

    assert histories_purge(now=now) == 1

    old.refresh_from_db()
    assert old.history_purged_at == now and not old_path.exists()
    assert store_for(old).read(old) == []
    assert old.message_count == 1  # the record of what it was stays
    assert recent_path.exists()


def test_maintenance_pass_runs_everything(persistent_agent):
    result = maintenance_pass(now=timezone.now())
    assert set(result) == {
        "expiry_set",
        "paused",
        "expired",
        "billed",
        "reaped_agents",
        "cli_orphans_killed",
        "purged",
        "orphan_files",
        "unstuck",
        "budget_resumed",
        "alerts_queued",
        "schedules_armed",
        "health_alerts",
        "models_refreshed",
        "cache_refreshes",
        "batches",
        "approvals_expired",
        "approvals_dispatched",
        "managed_orphans",
        "managed_health",
        "managed_session_ends",
    }
    assert result["batches"] == {"submitted": 0, "read": 0, "committed": 0}


def test_maintenance_schedule_exists_after_migrate(db):
    schedule = Schedule.objects.get(name="paperclip:maintenance")
    assert schedule.func == "sessions_app.tasks.maintenance"
    assert schedule.repeats == -1


def test_agent_schedule_follows_the_agent(persistent_agent):
    persistent_agent.adapter_config = {**persistent_agent.adapter_config, "heartbeat_interval_minutes": 15}
    persistent_agent.save()
    agent_schedule_sync(agent=persistent_agent)
    agent_schedule_sync(agent=persistent_agent)  # idempotent
    schedule = Schedule.objects.get(name=schedule_name(persistent_agent.id))
    assert (schedule.minutes, schedule.func) == (15, "sessions_app.tasks.scheduled_heartbeat")

    agent_pause(agent=persistent_agent)
    assert not Schedule.objects.filter(name=schedule_name(persistent_agent.id)).exists()
    agent_resume(agent=persistent_agent)
    assert Schedule.objects.filter(name=schedule_name(persistent_agent.id)).count() == 1
    agent_delete(agent=persistent_agent, now=timezone.now())
    assert not Schedule.objects.filter(name=schedule_name(persistent_agent.id)).exists()


def test_scheduled_tick_runs_a_heartbeat(persistent_agent, fake_anthropic):
    assert scheduled_heartbeat(str(persistent_agent.id)) == RunStatus.SUCCEEDED
    assert HeartbeatRun.objects.get().trigger == "schedule"


def test_heartbeat_command_prints_output_and_usage(persistent_agent, fake_anthropic, capsys):
    call_command("heartbeat", str(persistent_agent.id), "--task", "hello there")
    out = capsys.readouterr().out
    assert "answer 1: hello there" in out
    assert "input" in out and "cost $" in out


def test_heartbeat_command_errors_are_clear(persistent_agent, fake_anthropic):
    with pytest.raises(CommandError, match="No agent"):
        call_command("heartbeat", "not-a-uuid", "--task", "x")
    fake_anthropic.push(Reply.error(400, "nope"))
    with pytest.raises(CommandError, match="model_bad_request"):
        call_command("heartbeat", str(persistent_agent.id), "--task", "x")
    # Bytes that are not UTF-8 on the command line arrive as lone surrogates, which no
    # database can store: refused before anything is written.
    with pytest.raises(CommandError, match="invalid_task: task must be valid Unicode"):
        call_command("heartbeat", str(persistent_agent.id), "--task", "caf\udce9")
    with pytest.raises(CommandError, match="invalid_idempotency_key"):
        call_command("heartbeat", str(persistent_agent.id), "--task", "x", "--idempotency-key", "k\udce9")
    with pytest.raises(CommandError, match="invalid_idempotency_key"):
        call_command("heartbeat", str(persistent_agent.id), "--task", "x", "--idempotency-key", "k" * 256)
    assert not HeartbeatRun.objects.filter(task__startswith="caf").exists()


@pytest.mark.django_db(transaction=True)
def test_an_in_use_session_is_not_expired_and_its_ttl_counts_from_the_end_of_the_run(company, fake_anthropic):
    """A TTL shorter than a call (0.05 h is valid): the sweep runs while the model answers."""
    agent = Agent.objects.create(
        company=company, name="brief", adapter_config={"session_mode": "persistent", "session_ttl_hours": 0.05}
    )
    start = timezone.now()
    first = beat(agent, "one", now=start)
    during = start + timedelta(minutes=2)
    results = []
    fake_anthropic.push(
        Reply.during(on_own_connection(lambda: results.append(maintenance_pass(now=during + timedelta(minutes=8)))))
    )

    second = beat(agent, "two", now=during)

    assert fake_anthropic.action_errors == []
    assert results[0]["expired"] == 0 and results[0]["paused"] == 0
    assert (second.status, second.error_code, second.session_id) == (RunStatus.SUCCEEDED, "", first.session_id)
    session = AgentSession.objects.get(id=first.session_id)
    assert (session.status, session.message_count) == (SessionStatus.ACTIVE, 4)
    assert session.expires_at == second.finished_at + timedelta(hours=0.05)


@pytest.mark.django_db(transaction=True)
def test_a_failed_run_leaves_its_session_a_full_ttl_from_its_end(company, fake_anthropic):
    agent = Agent.objects.create(
        company=company, name="brief", adapter_config={"session_mode": "persistent", "session_ttl_hours": 0.05}
    )
    start = timezone.now()
    first = beat(agent, "one", now=start)
    during = start + timedelta(minutes=2)
    fake_anthropic.push(Reply.error(400, "refused"))

    second = beat(agent, "two", now=during)

    assert (second.status, second.session_id) == (RunStatus.FAILED, first.session_id)
    session = AgentSession.objects.get(id=first.session_id)
    assert session.expires_at == second.finished_at + timedelta(hours=0.05)
    assert session.expires_at == session.last_used + timedelta(hours=0.05)  # the contract's formula
    assert sessions_expire(now=second.finished_at + timedelta(minutes=2)) == 0


def test_a_reaped_run_restarts_its_sessions_ttl_from_its_end_and_its_time_is_active(settings, company, fake_anthropic):
    """A worker died mid-run (the row as it left it: running, linked to the session). The
    reaper ends the run at its deadline; the session's 3-minute TTL counts from that end,
    as after a failed run, and the run's time is active time, billed when the session ends."""
    settings.PAPERCLIP_SESSION_HOUR_USD = Decimal("0.08")
    agent = Agent.objects.create(
        company=company, name="brief", adapter_config={"session_mode": "persistent", "session_ttl_hours": 0.05}
    )
    start = timezone.now()
    first = beat(agent, "one", now=start)
    active = AgentSession.objects.get(id=first.session_id).active_seconds
    HeartbeatRun.objects.create(
        company=company,
        agent=agent,
        session_id=first.session_id,
        task="two",
        status=RunStatus.RUNNING,
        started_at=start + timedelta(minutes=1),
        deadline_at=start + timedelta(minutes=41),
    )
    reaped = start + timedelta(minutes=42)

    assert maintenance_pass(now=reaped)["reaped_agents"] == 1

    session = AgentSession.objects.get(id=first.session_id)
    assert (session.last_used, session.expires_at) == (reaped, reaped + timedelta(hours=0.05))
    assert session.active_seconds == pytest.approx(active + 41 * 60)
    assert maintenance_pass(now=reaped + timedelta(minutes=2))["expired"] == 0
    assert maintenance_pass(now=reaped + timedelta(minutes=4))["expired"] == 1
    session.refresh_from_db()
    assert (session.status, session.ended_at) == (SessionStatus.EXPIRED, reaped + timedelta(minutes=3))
    (hours,) = CostEvent.objects.filter(session_id=session.id, kind=CostKind.SESSION_HOURS)
    assert hours.session_seconds == round(active + 41 * 60)


def test_an_undeletable_history_file_skips_only_its_own_session(settings, persistent_agent, other_agent, caplog):
    """The history path is a directory: unlink fails (as a read-only folder would, for a
    user who is not root), the rest of the pass runs, and the next pass retries it."""
    settings.PAPERCLIP_RETENTION_DAYS = 30
    now = timezone.now()
    long_ago = now - timedelta(days=40)
    stuck = make_session(persistent_agent, last_used=long_ago, store=HistoryStore.FILE, messages=[{"role": "user"}])
    fine = make_session(other_agent, last_used=long_ago, store=HistoryStore.FILE, messages=[{"role": "user"}])
    sessions_expire(now=now)
    stuck_path = store_for(stuck).path_for(stuck)
    stuck_path.unlink()
    stuck_path.mkdir()
    queued, _ = heartbeat_enqueue(agent=other_agent, task="waiting", now=now)

    result = maintenance_pass(now=now)

    assert (result["purged"], result["unstuck"]) == (1, 1)
    assert "Could not delete the history file" in caplog.text
    assert AgentSession.objects.get(id=fine.id).history_purged_at == now
    assert AgentSession.objects.get(id=stuck.id).history_purged_at is None
    stuck_path.rmdir()
    assert maintenance_pass(now=now)["purged"] == 1


def test_a_purge_whose_write_is_refused_leaves_the_history_readable_and_the_next_pass_purges_it(
    settings, persistent_agent, caplog
):
    """The purge's UPDATE of the row is refused (a trigger): the ended session still reads
    its history (before: its file was deleted first, and it answered `history_missing`
    until a pass could write the row); the next pass purges it."""
    settings.PAPERCLIP_RETENTION_DAYS = 30
    now = timezone.now()
    messages = [{"role": "user", "content": "kept until the row says purged"}]
    session = make_session(
        persistent_agent, last_used=now - timedelta(days=40), store=HistoryStore.FILE, messages=messages
    )
    sessions_expire(now=now)
    path = store_for(session).path_for(session)
    with writes_refused("agent_sessions", when="NEW.history_purged_at IS NOT NULL"):
        assert maintenance_pass(now=now)["purged"] is None

    assert "Maintenance step 'purged' failed" in caplog.text
    ended = AgentSession.objects.get(pk=session.pk)
    assert ended.history_purged_at is None
    assert store_for(ended).read(ended) == messages
    assert histories_purge(now=now) == 1
    assert not path.exists()


def test_a_failing_maintenance_step_does_not_stop_the_others(settings, persistent_agent, other_agent, caplog):
    """A database fault in one step (the expiry refused by a trigger) is logged; the steps
    after it still run."""
    settings.PAPERCLIP_RETENTION_DAYS = 30
    now = timezone.now()
    make_session(persistent_agent, last_used=now - timedelta(days=2))
    make_session(other_agent, last_used=now - timedelta(days=40), store=HistoryStore.FILE, messages=[{"role": "u"}])
    AgentSession.objects.filter(agent=other_agent).update(
        status=SessionStatus.EXPIRED, ended_at=now - timedelta(days=39)
    )
    heartbeat_enqueue(agent=other_agent, task="waiting", now=now)
    refuse_writes("agent_sessions", when="NEW.status = 'expired' AND OLD.status = 'active'")

    result = maintenance_pass(now=now)

    assert result["expired"] is None
    assert (result["purged"], result["unstuck"]) == (1, 1)
    assert "Maintenance step 'expired' failed" in caplog.text
    assert AgentSession.objects.get(agent=persistent_agent).status == SessionStatus.ACTIVE


@pytest.mark.django_db(transaction=True)
def test_sigkilled_cluster_workers_leave_no_run_running(
    postgres_only, settings, persistent_agent, fake_anthropic, tmp_path
):
    kills = int(os.environ.get("RELIABILITY_KILLS", "20"))
    fake_anthropic.push(*[Reply.delay(1.5) for _ in range(kills)])
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "PAPERCLIP_HOME": str(tmp_path),
        # Queued tasks are signed: the cluster must share this process's key.
        "DJANGO_SECRET_KEY": settings.SECRET_KEY,
        "PAPERCLIP_RUN_TIMEOUT_SECONDS": "5",
        "PAPERCLIP_Q_WORKERS": "2",
    }
    env.pop("REDIS_URL", None)
    cluster = subprocess.Popen(
        [sys.executable, "manage.py", "qcluster"],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=(tmp_path / "qcluster.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        for _ in range(kills):
            run, _ = heartbeat_enqueue(agent=persistent_agent, task="doomed", now=timezone.now())
            heartbeat_dispatch(run=run)
            running = wait_until(
                lambda run=run: (
                    HeartbeatRun.objects.filter(id=run.id, status=RunStatus.RUNNING).exclude(claimed_by="").first()
                ),
                60,
                "a worker to claim the run",
            )
            os.kill(int(running.claimed_by.rsplit(":", 1)[1]), signal.SIGKILL)
            # The reaper, past the run's deadline (its call's limit, 3 x 600 s with the
            # waits between attempts, plus the 5 s run timeout), fails what the dead worker
            # left behind.
            runs_reap(now=timezone.now() + timedelta(hours=1))
        assert not HeartbeatRun.objects.filter(status=RunStatus.RUNNING).exists()
        assert set(HeartbeatRun.objects.values_list("error_code", flat=True)) == {"run_timeout"}

        run, _ = heartbeat_enqueue(agent=persistent_agent, task="survivor", now=timezone.now())
        heartbeat_dispatch(run=run)
        done = wait_until(
            lambda: HeartbeatRun.objects.filter(id=run.id, status__in=[RunStatus.SUCCEEDED, RunStatus.FAILED]).first(),
            60,
            "the survivor run",
        )
        assert done.status == RunStatus.SUCCEEDED, done.error
        session = AgentSession.objects.get(agent=persistent_agent)
        history = store_for(session).read(session)
        assert [m["content"] for m in history if m["role"] == "user"] == ["survivor"]
        assert CostEvent.objects.count() == 1
    finally:
        # SIGTERM to the cluster's parent only: it stops its own workers. (Signalling the
        # whole group makes django-q2 hang in shutdown.)
        cluster.terminate()
        try:
            cluster.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(cluster.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
        cluster.wait()


def test_idle_session_pauses_and_resumes_on_its_next_heartbeat(persistent_agent, fake_anthropic):
    start = timezone.now()
    first = beat(persistent_agent, "one", now=start)
    session = AgentSession.objects.get(id=first.session_id)
    assert session.pause_at == session.last_used + timedelta(minutes=30)

    assert sessions_pause_idle(now=start + timedelta(minutes=29)) == 0
    assert sessions_pause_idle(now=start + timedelta(minutes=31)) == 1
    session.refresh_from_db()
    assert (session.status, session.paused_at) == (SessionStatus.PAUSED, start + timedelta(minutes=31))

    second = beat(persistent_agent, "two", now=start + timedelta(hours=2))

    assert second.session_id == session.id
    session.refresh_from_db()
    assert session.status == SessionStatus.ACTIVE and session.paused_at is None
    assert session.message_count == 4


def test_a_paused_session_past_its_ttl_expires_instead(persistent_agent, fake_anthropic):
    start = timezone.now()
    first = beat(persistent_agent, "one", now=start)
    maintenance_pass(now=start + timedelta(hours=1))
    maintenance_pass(now=start + timedelta(hours=25))
    assert AgentSession.objects.get(id=first.session_id).status == SessionStatus.EXPIRED
    assert beat(persistent_agent, "two", now=start + timedelta(hours=26)).session_id != first.session_id
