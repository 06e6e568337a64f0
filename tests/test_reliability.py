"""Faults, crashes and secrets: nothing is lost, nothing half-written, nothing leaked."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from costs_app.models import CostEvent
from sessions_app.heartbeat import heartbeat_dispatch, heartbeat_enqueue
from sessions_app.maintenance import runs_reap
from sessions_app.models import Agent, AgentSession, HeartbeatRun, RunStatus
from sessions_app.stores import store_for
from tests.conftest import FAKE_API_KEY, beat, snapshot, terminate_backend_running
from tests.fake_anthropic import Reply
from tests.live.server import database_url, wait_until

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("replies", "config", "status", "code", "calls"),
    [
        ([Reply.error(429, "slow down", retry_after_ms=20)], {}, RunStatus.SUCCEEDED, "", 2),
        ([Reply.error(529, "overloaded", 1)] * 2, {}, RunStatus.SUCCEEDED, "", 3),
        ([Reply.error(529, "overloaded", 1)] * 3, {}, RunStatus.FAILED, "model_overloaded", 3),
        ([Reply.error(500, "boom", 1)] * 3, {}, RunStatus.FAILED, "model_server_error", 3),
        ([Reply.delay(3)], {"timeout_seconds": 0.5, "max_retries": 0}, RunStatus.FAILED, "model_timeout", 1),
        ([Reply.reset()], {"max_retries": 0}, RunStatus.FAILED, "model_unreachable", 1),
        ([Reply.malformed()], {}, RunStatus.FAILED, "model_malformed_response", 1),
        ([Reply.error(401, "invalid x-api-key")], {}, RunStatus.FAILED, "model_auth_failed", 1),
    ],
    ids=["429-retry-after", "529-burst-recovers", "529-burst-fails", "500", "timeout", "reset", "malformed", "401"],
)
def test_api_faults_end_every_run_clearly_and_change_nothing_on_failure(
    persistent_agent, fake_anthropic, replies, config, status, code, calls
):
    beat(persistent_agent, "first")
    persistent_agent.adapter_config = {**persistent_agent.adapter_config, **config}
    persistent_agent.save()
    count, history, costs = snapshot(persistent_agent)
    fake_anthropic.reset_log()
    fake_anthropic.push(*replies)

    run = beat(persistent_agent, "second")

    assert (run.status, run.error_code) == (status, code), run.error
    assert run.finished_at is not None
    assert len(fake_anthropic.message_requests) == calls
    if status == RunStatus.FAILED:
        assert snapshot(persistent_agent) == (count, history, costs)
        assert run.error and FAKE_API_KEY not in run.error
    else:
        assert snapshot(persistent_agent)[0] == count + 2
        assert CostEvent.objects.count() == costs + 1


def test_file_store_faults_fail_only_their_own_session(settings, company, fake_anthropic):
    settings.PAPERCLIP_SESSION_STORE = "file"
    agents = [
        Agent.objects.create(company=company, name=f"a{i}", adapter_config={"session_mode": "persistent"})
        for i in range(4)
    ]
    for agent in agents:
        beat(agent, "hello")
    corrupt, missing, readonly, healthy = (AgentSession.objects.get(agent=a) for a in agents)
    store_for(corrupt).path_for(corrupt).write_text('{"messages": [truncated')
    store_for(missing).path_for(missing).unlink()
    folder = store_for(readonly).path_for(readonly).parent
    folder.chmod(0o500)
    try:
        results = [beat(agent, "again") for agent in agents]
    finally:
        folder.chmod(0o700)

    codes = [(r.status, r.error_code) for r in results]
    assert codes[0] == (RunStatus.FAILED, "history_corrupt")
    assert codes[1] == (RunStatus.FAILED, "history_missing")
    if os.geteuid() != 0:  # root ignores directory permissions
        assert codes[2] == (RunStatus.FAILED, "history_unwritable")
        readonly.refresh_from_db()
        assert readonly.message_count == 2
    assert codes[3] == (RunStatus.SUCCEEDED, "")
    healthy.refresh_from_db()
    assert healthy.message_count == 4


def test_unwritable_history_leaves_the_old_file_and_row(settings, company, fake_anthropic, monkeypatch):
    """What root cannot be made to fail by permissions, a full disk does: ENOSPC when the file is flushed."""
    settings.PAPERCLIP_SESSION_STORE = "file"
    agent = Agent.objects.create(company=company, name="full", adapter_config={"session_mode": "persistent"})
    beat(agent, "hello")
    session = AgentSession.objects.get(agent=agent)
    before = store_for(session).path_for(session).read_bytes()
    costs = CostEvent.objects.count()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("sessions_app.stores.os.fsync", disk_full)
    run = beat(agent, "again")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "history_unwritable")
    assert store_for(session).path_for(session).read_bytes() == before
    session.refresh_from_db()
    assert session.message_count == 2
    assert CostEvent.objects.count() == costs + 1  # the call was made and billed: the ledger says so


def test_api_keys_never_reach_logs_history_or_runs(persistent_agent, fake_anthropic, caplog):
    caplog.set_level(logging.DEBUG)
    for name in ("anthropic", "httpx", "httpx2", "httpcore", "sessions_app", "django"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    fake_anthropic.push(Reply.error(401, "invalid x-api-key"))
    beat(persistent_agent, "fails")
    beat(persistent_agent, "works")

    assert FAKE_API_KEY not in caplog.text
    stored = " ".join(
        str(row)
        for row in list(HeartbeatRun.objects.values())
        + list(AgentSession.objects.values())
        + list(CostEvent.objects.values())
    )
    assert FAKE_API_KEY not in stored
    # ...while the SDK did send it, to the fake.
    headers = {k.lower(): v for k, v in fake_anthropic.requests[-1]["headers"].items()}
    assert FAKE_API_KEY in (headers.get("x-api-key") or headers.get("authorization", ""))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("store", ["database", "file"])
def test_terminated_connection_mid_commit_leaves_history_whole_and_still_bills(
    postgres_only, settings, persistent_agent, fake_anthropic, store
):
    settings.PAPERCLIP_SESSION_STORE = store
    beat(persistent_agent, "first")
    count, history, costs = snapshot(persistent_agent)
    with connection.cursor() as cursor:
        # Hold the commit transaction open: the ledger insert sleeps, so it can be killed.
        cursor.execute(
            "CREATE FUNCTION slow_ledger() RETURNS trigger AS $$ BEGIN PERFORM pg_sleep(3); RETURN NEW; END $$ "
            "LANGUAGE plpgsql; CREATE TRIGGER slow_ledger BEFORE INSERT ON cost_events "
            "FOR EACH ROW EXECUTE FUNCTION slow_ledger();"
        )
    outcome = {}

    def run_heartbeat():
        try:
            outcome["run"] = beat(persistent_agent, "second")
        except Exception as exc:  # the connection dies under it
            outcome["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run_heartbeat)
    thread.start()
    try:
        terminate_backend_running('%INSERT INTO "cost_events"%')
        thread.join(timeout=30)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS slow_ledger ON cost_events; DROP FUNCTION IF EXISTS slow_ledger();")

    # Nothing of the answer's commit was written, but the answer was billed: the ledger
    # records it on a new connection.
    assert snapshot(persistent_agent) == (count, history, costs + 1)
    stuck = HeartbeatRun.objects.get(task="second")
    assert CostEvent.objects.get(run=stuck).kind == "message"
    assert stuck.status in (RunStatus.RUNNING, RunStatus.FAILED)
    runs_reap(now=timezone.now() + timedelta(hours=1))
    assert HeartbeatRun.objects.get(task="second").status == RunStatus.FAILED
    assert beat(persistent_agent, "third").status == RunStatus.SUCCEEDED
    assert snapshot(persistent_agent)[0] == count + 2
    assert [m["content"] for m in snapshot(persistent_agent)[1] if m["role"] == "user"] == ["first", "third"]


@pytest.mark.django_db(transaction=True)
def test_connection_terminated_during_the_commit_leaves_the_history_file_whole(
    postgres_only, settings, persistent_agent, fake_anthropic
):
    """Killed in the COMMIT itself, after every statement (and the staged history file)
    succeeded: the transaction never commits, so the file must not move either."""
    settings.PAPERCLIP_SESSION_STORE = "file"
    beat(persistent_agent, "first")
    session = AgentSession.objects.get(agent=persistent_agent)
    before = store_for(session).path_for(session).read_bytes()
    with connection.cursor() as cursor:
        # A deferred constraint trigger runs inside the COMMIT: it holds the COMMIT open.
        cursor.execute(
            "CREATE FUNCTION slow_commit() RETURNS trigger AS $$ BEGIN PERFORM pg_sleep(5); RETURN NULL; END $$ "
            "LANGUAGE plpgsql; CREATE CONSTRAINT TRIGGER slow_commit AFTER UPDATE ON agent_sessions "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.message_count > OLD.message_count) "
            "EXECUTE FUNCTION slow_commit();"
        )
    thread = threading.Thread(target=lambda: (beat(persistent_agent, "second"), connection.close()))
    thread.start()
    try:
        terminate_backend_running("COMMIT%")
        thread.join(timeout=30)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER IF EXISTS slow_commit ON agent_sessions; DROP FUNCTION IF EXISTS slow_commit();"
            )

    assert store_for(session).path_for(session).read_bytes() == before
    session.refresh_from_db()
    assert session.message_count == 2
    runs_reap(now=timezone.now() + timedelta(hours=1))
    assert HeartbeatRun.objects.get(task="second").status == RunStatus.FAILED
    assert beat(persistent_agent, "third").status == RunStatus.SUCCEEDED
    assert [m["content"] for m in snapshot(persistent_agent)[1] if m["role"] == "user"] == ["first", "third"]


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
