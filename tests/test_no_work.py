"""Heartbeats without work: a work check (a command or a URL) before any model call, the
nothing-to-do marker, and the back-off of a schedule that keeps finding nothing."""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.utils import timezone
from django_q.models import Schedule

from costs_app.models import CostEvent
from sessions_app.adapters import AgentConfigError
from sessions_app.models import Agent, AgentSession, HeartbeatRun, RunStatus
from sessions_app.schedules import agent_next_wakes, agent_schedule_sync, schedule_name
from sessions_app.stores import store_for
from tests.conftest import beat, listed_commands, on_own_connection
from tests.fake_anthropic import SHUTDOWN_POLL_SECONDS, Reply, last_user_text, plain_messages, text_turn
from tests.webhook_receiver import TricklingServer

pytestmark = pytest.mark.django_db


def check_script(tmp_path, body: str, name: str = "check.py") -> list[str]:
    """A work check command (local_trusted: a raw argv) that runs `body` with this Python."""
    path = tmp_path / name
    path.write_text("import os, sys, time\n" + body)
    return [sys.executable, str(path)]


def with_config(agent: Agent, **config) -> Agent:
    agent.adapter_config = {**agent.adapter_config, **config}
    agent.save()
    return agent


def utc(*args) -> datetime:
    return datetime(*args, tzinfo=UTC)


# The command check.


def test_a_skipped_run_makes_no_model_call_writes_no_ledger_row_and_leaves_the_session_alone(
    persistent_agent, fake_anthropic, tmp_path
):
    first = beat(persistent_agent, "start")
    assert first.status == RunStatus.SUCCEEDED, first.error
    session = AgentSession.objects.get(agent=persistent_agent)
    fake_anthropic.reset_log()
    ledger = CostEvent.objects.count()
    with_config(persistent_agent, work_check={"command": check_script(tmp_path, "sys.exit(1)")})

    later = timezone.now() + timedelta(hours=1)
    run = beat(persistent_agent, "anything new?", now=later)

    assert run.status == RunStatus.SKIPPED, (run.error_code, run.error)
    assert run.is_finished and run.finished_at is not None and run.session_id is None
    assert fake_anthropic.requests == []  # no request of any kind: not even a token count
    assert CostEvent.objects.count() == ledger
    after = AgentSession.objects.get(pk=session.pk)
    # Not resumed, not touched: its clocks (TTL, idle pause) and history are as they were.
    for field in ("last_used", "expires_at", "pause_at", "message_count", "turn_count", "active_seconds"):
        assert getattr(after, field) == getattr(session, field), field
    persistent_agent.refresh_from_db()
    assert persistent_agent.idle_streak == 1


def test_a_check_that_finds_work_appends_its_output_to_the_task(stateless_agent, fake_anthropic, tmp_path):
    command = check_script(tmp_path, "print('ticket 7: fix the login page')\nsys.exit(0)")
    with_config(stateless_agent, work_check={"command": command, "timeout_seconds": 5})

    run = beat(stateless_agent, "Work on your tickets.")

    assert run.status == RunStatus.SUCCEEDED, run.error
    (request,) = fake_anthropic.message_requests
    sent = last_user_text(request["messages"])
    assert sent.startswith("Work on your tickets.")
    assert "ticket 7: fix the login page" in sent
    assert run.work_check_output.strip() == "ticket 7: fix the login page"
    assert run.task == "Work on your tickets."  # the task as asked: an idempotent retry still matches
    assert CostEvent.objects.filter(run_id=run.id).count() == 1


def test_a_check_that_exits_otherwise_fails_the_run_without_a_model_call(stateless_agent, fake_anthropic, tmp_path):
    command = check_script(tmp_path, "print('boom', file=sys.stderr)\nsys.exit(3)")
    with_config(stateless_agent, work_check={"command": command})

    run = beat(stateless_agent)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "work_check_failed")
    assert "status 3" in run.error and "boom" in run.error
    assert fake_anthropic.requests == [] and not CostEvent.objects.exists()
    stateless_agent.refresh_from_db()
    assert stateless_agent.idle_streak == 0  # a broken check is not "no work"


def test_a_check_past_its_timeout_is_killed_with_its_children(stateless_agent, fake_anthropic, tmp_path):
    pid_file = tmp_path / "child.pid"
    body = (
        "import subprocess\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    with_config(stateless_agent, work_check={"command": check_script(tmp_path, body), "timeout_seconds": 1})

    started = time.monotonic()
    run = beat(stateless_agent)

    assert time.monotonic() - started < 10
    assert (run.status, run.error_code) == (RunStatus.FAILED, "work_check_failed")
    assert "longer than 1 s" in run.error
    assert fake_anthropic.requests == []
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is sent; the child is reaped by init shortly after
        if not os.path.exists(f"/proc/{child}") or "Z" in open(f"/proc/{child}/stat").read().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the check's child outlived its timeout")


def test_a_check_command_gets_only_the_base_environment(stateless_agent, fake_anthropic, tmp_path, monkeypatch):
    monkeypatch.setenv("DATABASE_URL_FOR_TEST", "postgres://user:secret@db/x")
    monkeypatch.setenv("DJANGO_SECRET_KEY", "django-secret")
    command = check_script(tmp_path, "print(' '.join(sorted(os.environ)))\n")
    with_config(stateless_agent, work_check={"command": command})

    run = beat(stateless_agent)

    assert run.status == RunStatus.SUCCEEDED, run.error
    names = set(run.work_check_output.split())
    assert "PATH" in names
    assert not names & {"DATABASE_URL_FOR_TEST", "DJANGO_SECRET_KEY", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"}


def test_authenticated_mode_runs_only_a_listed_check_command(company, settings, tmp_path, fake_anthropic):
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.PAPERCLIP_PROCESS_COMMANDS = listed_commands(
        tmp_path, **{"has-work": {"argv": check_script(tmp_path, "sys.exit(1)"), "allowed_args": ["--queue=a"]}}
    )
    config = {"model": "claude-opus-4-5"}
    with pytest.raises(AgentConfigError) as refused:
        Agent.objects.create(company=company, name="raw", adapter_config={**config, "work_check": {"command": ["ls"]}})
    assert "adapter_config.work_check.command" in refused.value.fields
    with pytest.raises(AgentConfigError) as refused:
        Agent.objects.create(
            company=company,
            name="args",
            adapter_config={**config, "work_check": {"command": "has-work", "args": ["-x"]}},
        )
    assert "adapter_config.work_check.args" in refused.value.fields

    agent = Agent.objects.create(
        company=company,
        name="listed",
        adapter_config={**config, "work_check": {"command": "has-work", "args": ["--queue=a"]}},
    )
    assert beat(agent).status == RunStatus.SKIPPED


def test_a_raw_check_command_saved_in_local_trusted_mode_does_not_run_when_authenticated(
    stateless_agent, settings, tmp_path, fake_anthropic
):
    marker = tmp_path / "ran"
    with_config(stateless_agent, work_check={"command": check_script(tmp_path, f"open({str(marker)!r}, 'w')\n")})
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"

    run = beat(stateless_agent)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "work_check_not_allowed")
    assert "adapter_config.work_check.command" in run.error
    assert not marker.exists() and fake_anthropic.requests == []


# The URL check, against a server on 127.0.0.1.


class WorkServer:
    """Answers GET /work with the scripted (status, body, delay) and counts requests."""

    def __init__(self) -> None:
        self.answer = (204, b"", 0.0)
        self.before_answer = None  # a second actor, run before the answer is sent
        self.hits = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format, *args):
                pass

            def do_GET(self):
                server.hits += 1
                status, body, delay = server.answer
                if server.before_answer is not None:
                    server.before_answer()
                time.sleep(delay)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                if status in (301, 302):
                    self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
                self.end_headers()
                if body:
                    self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/work"
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_SECONDS}, daemon=True
        ).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def work_server():
    server = WorkServer()
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("answer", "status", "code"),
    [
        ((204, b"", 0.0), RunStatus.SKIPPED, ""),
        ((200, b"  \n", 0.0), RunStatus.SKIPPED, ""),
        ((200, b"issue 12 is open", 0.0), RunStatus.SUCCEEDED, ""),
        ((500, b"oops", 0.0), RunStatus.FAILED, "work_check_failed"),
        ((302, b"", 0.0), RunStatus.FAILED, "work_check_failed"),  # a redirect is not followed
        ((200, b"late", 3.0), RunStatus.FAILED, "work_check_failed"),  # past timeout_seconds
    ],
)
def test_a_url_check_reads_its_answer(stateless_agent, fake_anthropic, work_server, answer, status, code):
    work_server.answer = answer
    with_config(stateless_agent, work_check={"url": work_server.url, "timeout_seconds": 1})

    run = beat(stateless_agent, "Any issues?")

    assert (run.status, run.error_code) == (status, code), run.error
    assert work_server.hits == 1
    if status == RunStatus.SUCCEEDED:
        (request,) = fake_anthropic.message_requests
        assert "issue 12 is open" in last_user_text(request["messages"])
        assert run.work_check_output == "issue 12 is open"
    else:
        assert fake_anthropic.requests == [] and not CostEvent.objects.exists()


def test_a_url_check_trickling_its_headers_is_stopped_at_its_timeout(stateless_agent, fake_anthropic):
    """A header line every 0.5 s never trips a per-read timeout of 1 s: the whole request is
    bounded (before, a 1-second check of 12 lines took 6 s, and an endless trickle held the
    worker and a place under the cap until the reaper)."""
    server = TricklingServer(every=0.5, lines=120)
    try:
        with_config(stateless_agent, work_check={"url": server.url, "timeout_seconds": 1})
        started = time.monotonic()

        run = beat(stateless_agent, "Any issues?")

        elapsed = time.monotonic() - started
    finally:
        server.stop()
    assert (run.status, run.error_code) == (RunStatus.FAILED, "work_check_failed"), run.error
    assert "no answer within 1 s" in run.error
    assert 1 <= elapsed < 3, elapsed
    assert fake_anthropic.requests == []


def test_a_long_url_answer_is_cut_to_the_bound(stateless_agent, fake_anthropic, work_server, settings):
    settings.PAPERCLIP_WORK_CHECK_MAX_OUTPUT_BYTES = 1024
    work_server.answer = (200, b"x" * 100_000, 0.0)
    with_config(stateless_agent, work_check={"url": work_server.url})

    run = beat(stateless_agent)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.work_check_output == "x" * 1024


def test_a_command_printing_past_the_bound_fails_the_check(stateless_agent, fake_anthropic, tmp_path, settings):
    settings.PAPERCLIP_WORK_CHECK_MAX_OUTPUT_BYTES = 1024
    with_config(stateless_agent, work_check={"command": check_script(tmp_path, "print('x' * 100000)")})

    run = beat(stateless_agent)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "work_check_failed")
    assert "PAPERCLIP_WORK_CHECK_MAX_OUTPUT_BYTES" in run.error
    assert fake_anthropic.requests == []


@pytest.mark.parametrize(
    ("check", "field"),
    [
        ("https://x", "adapter_config.work_check"),
        ({}, "adapter_config.work_check"),
        ({"url": "http://a", "command": "x"}, "adapter_config.work_check"),
        ({"url": "ftp://host/x"}, "adapter_config.work_check.url"),
        ({"url": "http:///nohost"}, "adapter_config.work_check.url"),
        ({"url": "http://user:pw@host/x"}, "adapter_config.work_check.url"),
        ({"url": "http://host:99999/x"}, "adapter_config.work_check.url"),
        ({"url": "http://host/a b"}, "adapter_config.work_check.url"),
        ({"url": "http://host/x", "timeout_seconds": 0}, "adapter_config.work_check.timeout_seconds"),
        ({"url": "http://host/x", "timeout_seconds": 301}, "adapter_config.work_check.timeout_seconds"),
        ({"url": "http://host/x", "headers": {}}, "adapter_config.work_check.headers"),
        ({"command": "unlisted"}, "adapter_config.work_check.command"),
    ],
)
def test_a_bad_work_check_names_its_field(company, check, field):
    with pytest.raises(AgentConfigError) as refused:
        Agent.objects.create(
            company=company, name="x", adapter_config={"model": "claude-haiku-4-5", "work_check": check}
        )
    assert field in refused.value.fields


def test_authenticated_mode_asks_only_listed_hosts(company, settings):
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.PAPERCLIP_WORK_CHECK_HOSTS = frozenset({"tracker.example"})
    with pytest.raises(AgentConfigError) as refused:
        Agent.objects.create(
            company=company,
            name="x",
            adapter_config={"model": "claude-haiku-4-5", "work_check": {"url": "http://169.254.169.254/"}},
        )
    assert "PAPERCLIP_WORK_CHECK_HOSTS" in refused.value.fields["adapter_config.work_check.url"]
    Agent.objects.create(
        company=company,
        name="y",
        adapter_config={"model": "claude-haiku-4-5", "work_check": {"url": "https://tracker.example/w"}},
    )


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("https://tracker.example/w", True),
        ("https://tracker.example:443/w", True),
        ("http://tracker.example/w", True),
        ("https://tracker.example:5432/w", False),  # a listed host on another port
        ("http://tracker.example:443/w", False),
        ("http://api.internal:8080/w", True),
        ("http://api.internal/w", False),  # listed with a port: only that one
    ],
)
def test_authenticated_mode_asks_a_listed_host_only_on_its_port(company, settings, url, allowed):
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.PAPERCLIP_WORK_CHECK_HOSTS = frozenset({"tracker.example", "api.internal:8080"})
    config = {"model": "claude-opus-4-5", "work_check": {"url": url}}
    if allowed:
        Agent.objects.create(company=company, name="x", adapter_config=config)
        return
    with pytest.raises(AgentConfigError) as refused:
        Agent.objects.create(company=company, name="x", adapter_config=config)
    assert "PAPERCLIP_WORK_CHECK_HOSTS" in refused.value.fields["adapter_config.work_check.url"]


# The nothing-to-do marker.


def test_a_nothing_to_do_answer_is_billed_shown_and_never_replayed(persistent_agent, fake_anthropic):
    with_config(persistent_agent, nothing_to_do_marker="NOTHING_TO_DO")
    fake_anthropic.push(
        Reply.message("did task 1"), Reply.message("NOTHING_TO_DO: the queue is empty"), Reply.message("did 3")
    )

    first = beat(persistent_agent, "task 1")
    idle = beat(persistent_agent, "task 2")
    third = beat(persistent_agent, "task 3")

    assert idle.status == RunStatus.SUCCEEDED and idle.nothing_to_do and not first.nothing_to_do
    assert idle.output == "NOTHING_TO_DO: the queue is empty"
    assert CostEvent.objects.filter(run_id=idle.id).count() == 1  # billed
    assert idle.session_id == first.session_id  # the call was made in the session
    assert plain_messages(fake_anthropic.message_requests[2]) == [
        text_turn("user", "task 1"),
        text_turn("assistant", "did task 1"),
        text_turn("user", "task 3"),
    ]
    session = AgentSession.objects.get(pk=third.session_id)
    assert session.message_count == 4 and session.turn_count == 2 and session.next_seq == 4
    assert [m["seq"] for m in store_for(session).read(session)] == [0, 1, 2, 3]
    # The session's money includes the idle answer's.
    assert session.total_cost_usd == first.cost_usd + idle.cost_usd + third.cost_usd
    persistent_agent.refresh_from_db()
    assert persistent_agent.idle_streak == 0  # task 3 had work


def test_a_stateless_agent_may_answer_nothing_to_do(stateless_agent, fake_anthropic):
    with_config(stateless_agent, nothing_to_do_marker="IDLE")
    fake_anthropic.push(Reply.message("IDLE"))
    run = beat(stateless_agent)
    assert run.status == RunStatus.SUCCEEDED and run.nothing_to_do
    stateless_agent.refresh_from_db()
    assert stateless_agent.idle_streak == 1


# The back-off of a scheduled agent.


def interval_row(agent) -> Schedule:
    return Schedule.objects.get(name=schedule_name(agent.pk))


def test_an_interval_doubles_after_n_idle_runs_up_to_its_cap_and_resets_on_work(
    stateless_agent, fake_anthropic, tmp_path
):
    has_work = tmp_path / "has-work"
    command = check_script(tmp_path, f"sys.exit(0 if os.path.exists({str(has_work)!r}) else 1)\n")
    with_config(
        stateless_agent,
        heartbeat_interval_minutes=60,
        backoff_after_runs=2,
        backoff_max_factor=4,
        work_check={"command": command},
    )
    agent_schedule_sync(agent=stateless_agent)
    steps = []
    for _ in range(5):
        assert beat(stateless_agent, trigger="schedule").status == RunStatus.SKIPPED
        steps.append(interval_row(stateless_agent).minutes)
    assert steps == [60, 120, 240, 240, 240]  # after 2 in a row, doubled; capped at 4x
    stateless_agent.refresh_from_db()
    assert stateless_agent.idle_streak == 5
    wakes = agent_next_wakes(agent=stateless_agent, now=timezone.now(), count=2)
    assert wakes[1] - wakes[0] == timedelta(minutes=240)

    has_work.touch()
    before = interval_row(stateless_agent)
    assert beat(stateless_agent, trigger="schedule").status == RunStatus.SUCCEEDED
    row = interval_row(stateless_agent)
    assert row.minutes == 60
    # The next wake moves back too: the interval counts from the last wake.
    assert row.next_run == max(before.next_run - timedelta(minutes=180), row.next_run)
    assert row.next_run <= before.next_run - timedelta(minutes=180) + timedelta(seconds=5)
    stateless_agent.refresh_from_db()
    assert stateless_agent.idle_streak == 0


def test_a_cron_agent_backs_off_by_skipping_wakes(stateless_agent, fake_anthropic):
    with_config(
        stateless_agent,
        heartbeat_cron="0 * * * *",
        backoff_after_runs=1,
        nothing_to_do_marker="NOTHING",
    )
    now = utc(2026, 5, 1, 12, 30)
    agent_schedule_sync(agent=stateless_agent, now=now)
    assert interval_row(stateless_agent).next_run == utc(2026, 5, 1, 13)

    fake_anthropic.push(Reply.message("NOTHING"), Reply.message("NOTHING"), Reply.message("worked"))
    assert beat(stateless_agent, now=now).nothing_to_do
    assert interval_row(stateless_agent).next_run == utc(2026, 5, 1, 14)  # every 2nd hour
    stateless_agent.refresh_from_db()
    assert agent_next_wakes(agent=stateless_agent, now=now, count=3) == [
        utc(2026, 5, 1, 14),
        utc(2026, 5, 1, 16),
        utc(2026, 5, 1, 18),
    ]
    assert beat(stateless_agent, now=now).nothing_to_do
    assert interval_row(stateless_agent).next_run == utc(2026, 5, 1, 16)  # every 4th
    assert not beat(stateless_agent, now=now).nothing_to_do
    assert interval_row(stateless_agent).next_run == utc(2026, 5, 1, 13)  # back to every hour


def test_backoff_after_runs_zero_never_backs_off(stateless_agent, fake_anthropic, tmp_path):
    with_config(
        stateless_agent,
        heartbeat_interval_minutes=30,
        backoff_after_runs=0,
        work_check={"command": check_script(tmp_path, "sys.exit(1)")},
    )
    agent_schedule_sync(agent=stateless_agent)
    for _ in range(4):
        beat(stateless_agent)
    assert interval_row(stateless_agent).minutes == 30


def test_saving_the_agent_does_not_put_back_a_stale_idle_streak(stateless_agent, fake_anthropic, tmp_path):
    with_config(stateless_agent, work_check={"command": check_script(tmp_path, "sys.exit(1)")})
    form_copy = Agent.objects.get(pk=stateless_agent.pk)  # an admin form opened now
    beat(stateless_agent)
    beat(stateless_agent)
    form_copy.name = "renamed"
    form_copy.save()
    stateless_agent.refresh_from_db()
    assert (stateless_agent.name, stateless_agent.idle_streak) == ("renamed", 2)


def test_a_skipped_run_is_terminal_everywhere(stateless_agent, fake_anthropic, tmp_path):
    from paperclip.health import run_state
    from sessions_app.maintenance import runs_reap

    with_config(stateless_agent, work_check={"command": check_script(tmp_path, "sys.exit(1)")})
    run = beat(stateless_agent)
    assert run.status == RunStatus.SKIPPED
    # Not reaped, not counted as queued or past its deadline, and the next run can start.
    assert runs_reap(now=timezone.now() + timedelta(days=1)) == []
    assert run_state(now=timezone.now() + timedelta(days=1)) == {"oldest_queued_seconds": None, "past_deadline": 0}
    assert HeartbeatRun.objects.get(pk=run.pk).status == RunStatus.SKIPPED
    assert beat(stateless_agent).status == RunStatus.SKIPPED


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("answer", [(204, b"", 0.0), (200, b"work", 0.0)])
def test_a_run_reaped_while_its_check_runs_is_neither_skipped_nor_sent(stateless_agent, fake_anthropic, answer):
    """The reaper (another process) fails the run while the check's URL is answering."""
    from sessions_app.maintenance import runs_reap

    server = WorkServer()
    server.answer = answer
    server.before_answer = on_own_connection(lambda: runs_reap(now=timezone.now() + timedelta(days=1)))
    try:
        with_config(stateless_agent, work_check={"url": server.url})
        run = beat(stateless_agent)
    finally:
        server.stop()

    assert (run.status, run.error_code) == (RunStatus.FAILED, "run_timeout")
    assert fake_anthropic.requests == [] and not CostEvent.objects.exists()
    stateless_agent.refresh_from_db()
    assert stateless_agent.idle_streak == 0


@pytest.mark.django_db(transaction=True)
def test_no_transaction_is_open_while_the_check_runs(stateless_agent, fake_anthropic):
    from django.db import connections

    heartbeat_connection = connections["default"]  # this thread's: the one the heartbeat uses
    seen = []
    server = WorkServer()
    server.answer = (200, b"work", 0.0)
    server.before_answer = lambda: seen.append(heartbeat_connection.in_atomic_block)
    try:
        with_config(stateless_agent, work_check={"url": server.url})
        assert beat(stateless_agent).status == RunStatus.SUCCEEDED
    finally:
        server.stop()
    assert seen == [False]


def test_a_system_check_names_agents_whose_work_check_may_no_longer_run(stateless_agent, settings, tmp_path):
    from sessions_app.checks import check_work_checks

    with_config(stateless_agent, work_check={"command": check_script(tmp_path, "sys.exit(1)")})
    assert check_work_checks(None) == []

    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"

    (warning,) = check_work_checks(None)
    assert warning.id == "paperclip.W005"
    assert str(stateless_agent.id) in warning.msg and "adapter_config.work_check.command" in warning.msg
