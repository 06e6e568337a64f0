"""The usual cast: a company, its stateless and persistent agents, and another company; and the
helpers tests share (a heartbeat run in the test's thread, faults staged in the database)."""

from __future__ import annotations

import errno
import json
import os
import platform
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path

import pytest
from anthropic.types import ModelInfo
from django.db import connection
from django.db.backends.signals import connection_created
from django.utils import timezone

from costs_app.catalogue import catalogue_forget, catalogue_row, catalogue_store
from costs_app.models import CostEvent
from costs_app.pricing import call_price, overrides_forget
from paperclip.env import parse_process_commands
from sessions_app.context import SUMMARY_SYSTEM
from sessions_app.heartbeat import heartbeat_execute
from sessions_app.models import Agent, AgentSession, Company, HeartbeatRun, HistoryStore, RunStatus
from sessions_app.run_queue import heartbeat_enqueue
from sessions_app.stores import store_for
from tests.fake_anthropic import CATALOGUE, FakeAnthropic, plain_messages, plain_system
from tests.fake_managed import FakeManaged

FAKE_API_KEY = "sk-ant-test-0000-secret-never-logged"

# The `postgres` marker on postgres_only tests, and PAPERCLIP_REQUIRE_POSTGRES (.ci/run); the
# `redis` marker on redis_only tests, and PAPERCLIP_REQUIRE_REDIS.
pytest_plugins = ["tests.required_services"]


@pytest.fixture(autouse=True)
def plain_static_files(settings):
    # The hashed manifest exists only after collectstatic (done by the run command).
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    # Django's PBKDF2 takes about 0.6 s of CPU a password on a CI runner, and every test
    # through the admin makes one (pytest-django's `admin_user`): minutes of a suite. What
    # the tests prove never depends on the hash's strength. Servers the tests start in
    # processes of their own keep the real hashers.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def paperclip_home(settings, tmp_path):
    """Each test gets its own sandbox folder for history files."""
    home = tmp_path / "paperclip-home"
    home.mkdir()
    settings.PAPERCLIP_HOME = home
    return home


@pytest.fixture(autouse=True)
def model_catalogue(settings):
    """Each test reads the catalogue its own database holds (none: the price library's
    models), never one an earlier test left in this process's memory; the maintenance pass
    refreshes it only in a test that sets PAPERCLIP_MODELS_REFRESH_MINUTES."""
    settings.PAPERCLIP_MODELS_REFRESH_MINUTES = 0
    catalogue_forget()
    overrides_forget()
    yield
    catalogue_forget()
    overrides_forget()


def catalogue_stored(entries: list[dict] = CATALOGUE, *, now=None) -> None:
    """Store `entries` (as the fake Models API lists them) as the catalogue, as a refresh
    that read them would."""
    catalogue_store([catalogue_row(ModelInfo.model_validate(entry), now=now or timezone.now()) for entry in entries])
    catalogue_forget()


def agent_on_unknown_model(company: Company, model: str, **config) -> Agent:
    """An agent on a model neither the catalogue nor an override knows, as one saved before
    the model checks existed (or written by SQL) is: validation would refuse it now."""
    agent = Agent.objects.create(company=company, name=f"on {model}", adapter_config=config)
    Agent.objects.filter(pk=agent.pk).update(adapter_config={**agent.adapter_config, "model": model})
    agent.refresh_from_db()
    return agent


@pytest.fixture
def postgres_only():
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL (run with DATABASE_URL=postgres://...)")


@pytest.fixture
def refuse_at_commit(transactional_db):
    """Make the COMMIT of a transaction fail when it made a chosen write.

    A deferred check runs only at COMMIT, after every statement succeeded: the failure a
    caller cannot see coming (a deferred constraint). On PostgreSQL a deferred constraint
    trigger raises; SQLite has none, so its trigger leaves a dangling deferred foreign key.
    Call it with a table and a WHEN condition; it is removed after the test (and by calling
    the returned function).
    """
    installed = []

    def install(table: str, *, when: str, event: str = "UPDATE"):
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(
                    "CREATE FUNCTION paperclip_test_refuse_commit() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'refused at commit by a test trigger'; END $$"
                )
                cursor.execute(
                    f"CREATE CONSTRAINT TRIGGER paperclip_test_refuse_commit AFTER {event} ON {table} "
                    f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN ({when}) "
                    "EXECUTE FUNCTION paperclip_test_refuse_commit()"
                )
            else:
                cursor.execute("CREATE TABLE paperclip_test_parent (id INTEGER PRIMARY KEY)")
                cursor.execute(
                    "CREATE TABLE paperclip_test_dangling (parent_id INTEGER "
                    "REFERENCES paperclip_test_parent (id) DEFERRABLE INITIALLY DEFERRED)"
                )
                dangle = "INSERT INTO paperclip_test_dangling VALUES (-1);"
                cursor.execute(
                    f"CREATE TRIGGER paperclip_test_refuse_commit AFTER {event} ON {table} FOR EACH ROW "
                    f"WHEN {when} BEGIN {dangle} END"
                )
        installed.append(table)
        return lambda: remove(table)

    def remove(table: str) -> None:
        if table not in installed:
            return
        installed.remove(table)
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(f"DROP TRIGGER IF EXISTS paperclip_test_refuse_commit ON {table}")
                cursor.execute("DROP FUNCTION IF EXISTS paperclip_test_refuse_commit()")
            else:
                cursor.execute("DROP TRIGGER IF EXISTS paperclip_test_refuse_commit")
                cursor.execute("DROP TABLE IF EXISTS paperclip_test_dangling")
                cursor.execute("DROP TABLE IF EXISTS paperclip_test_parent")

    yield install
    for table in list(installed):
        remove(table)


@pytest.fixture
def company(db):
    return Company.objects.create(name="Acme")


@pytest.fixture
def other_company(db):
    return Company.objects.create(name="Globex")


@pytest.fixture
def stateless_agent(company):
    return Agent.objects.create(
        company=company,
        name="Stateless",
        system_prompt="You are terse.",
        adapter_type="claude-code",
        adapter_config={"model": "claude-opus-4-5"},
    )


@pytest.fixture
def persistent_agent(company):
    return Agent.objects.create(
        company=company,
        name="Persistent",
        system_prompt="You remember.",
        adapter_type="claude-code",
        adapter_config={"model": "claude-opus-4-5", "session_mode": "persistent", "session_ttl_hours": 24},
    )


@pytest.fixture
def other_agent(other_company):
    return Agent.objects.create(
        company=other_company,
        name="Foreign",
        adapter_type="claude-code",
        adapter_config={"model": "claude-haiku-4-5", "session_mode": "persistent"},
    )


@contextmanager
def fake_api(monkeypatch):
    """A fake Messages API on 127.0.0.1 that the real SDK reaches through the environment.

    An error raised by a reply's action (`Reply(before=...)`, `Reply.during`) is raised when
    it closes, unless the test took it (`fake.take_action_errors()`)."""
    fake = FakeAnthropic().start()
    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.base_url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", FAKE_API_KEY)
    try:
        yield fake
    finally:
        fake.stop()
    fake.raise_action_errors()


@pytest.fixture
def fake_anthropic(monkeypatch):
    """`fake_api` for one test: a reply action that broke fails the test."""
    with fake_api(monkeypatch) as fake:
        yield fake


@pytest.fixture
def fake_managed(monkeypatch):
    """The Managed Agents fake on 127.0.0.1, which the real SDK reaches through the environment."""
    fake = FakeManaged().start()
    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.base_url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", FAKE_API_KEY)
    try:
        yield fake
    finally:
        fake.stop()


def managed_agent(company: Company, **config) -> Agent:
    """A `claude-managed` agent (persistent unless `session_mode` says otherwise)."""
    return Agent.objects.create(
        company=company,
        name="Remote",
        system_prompt="You work remotely.",
        adapter_type="claude-managed",
        adapter_config={"model": "claude-sonnet-4-5", "session_mode": "persistent", **config},
    )


def on_own_connection(action):
    """`action` for `Reply.during`: it runs on the fake's thread, with that thread's own
    database connection, closed afterwards (a second actor, as another process would be)."""

    def run():
        try:
            action()
        finally:
            connection.close()

    return run


class Actor(threading.Thread):
    """A second actor: `action` in a thread of its own, on its own database connection
    (closed afterwards), as another process would be. `result()` joins it and returns what
    the action returned, or raises what it raised."""

    def __init__(self, action) -> None:
        super().__init__(daemon=True)
        self.action = action
        self.backend_pid: int | None = None  # PostgreSQL: the server process of its connection
        self.value = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            connection.ensure_connection()
            if connection.vendor == "postgresql":
                self.backend_pid = connection.connection.info.backend_pid
            self.value = self.action()
        except BaseException as exc:  # re-raised by result()
            self.error = exc
        finally:
            connection.close()

    def result(self, timeout: float = 60):
        self.join(timeout)
        assert not self.is_alive(), f"{self.action!r} did not finish in {timeout} s"
        if self.error is not None:
            raise self.error
        return self.value


# The syscalls of a thread asleep (SQLite's busy handler sleeps between its tries).
SLEEP_SYSCALLS = {"x86_64": {"35", "230"}, "aarch64": {"101", "115"}}.get(platform.machine(), set())


def wait_until_blocked(actor: Actor, *, timeout: float = 15) -> None:
    """Return once `actor` waits for a lock another transaction holds: on PostgreSQL, a lock
    of its connection not granted (pg_locks); on SQLite, its thread asleep in the busy
    handler, waiting for the write lock (Linux's /proc: the syscall it is in)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if actor.error is not None or not actor.is_alive():
            raise AssertionError(f"the second actor finished without waiting: {actor.error or actor.value!r}")
        if connection.vendor == "postgresql":
            if actor.backend_pid is not None:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted", [actor.backend_pid])
                    if cursor.fetchone():
                        return
        else:
            try:
                syscall = Path(f"/proc/self/task/{actor.native_id}/syscall").read_text().split()[0]
            except (OSError, IndexError) as exc:
                raise AssertionError(f"cannot see where the second actor's thread waits: {exc}") from None
            if syscall in SLEEP_SYSCALLS:
                return
        time.sleep(0.005)
    raise AssertionError(f"the second actor was not seen waiting for a lock within {timeout} s")


def process_gone(pid: int) -> bool:
    """Whether process `pid` no longer runs: absent from /proc, or a zombie (killed, and not
    yet reaped by a parent that is not ours)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_until_gone(pid: int, *, timeout: float = 10) -> None:
    """Return once process `pid` is gone (a kill is delivered at once, but dying takes a
    moment); fail when it still runs after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not process_gone(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs: an orphan"
        time.sleep(0.01)


class WriteGate:
    """Holds the first write to `table` (`event`, rows matching the SQL condition `when`)
    inside its transaction until the test opens the gate: the moment a second actor must
    arrive at. A trigger waits there: on PostgreSQL for an advisory lock the test holds,
    on SQLite in a function of the test's that waits for `open()`. Leaves no trigger behind.

        with WriteGate("heartbeat_runs", event="INSERT") as gate:
            first = Actor(...); first.start(); gate.wait_entered()
            second = Actor(...); second.start(); wait_until_blocked(second)
            gate.open()
    """

    KEY = 730_124  # PostgreSQL advisory lock key (advisory locks are per database)

    def __init__(self, table: str, *, event: str, when: str | None = None) -> None:
        self.table, self.event, self.when = table, event, when
        self.entered, self.released = threading.Event(), threading.Event()

    def _gate(self) -> int:  # SQLite: the trigger's function, run by the writer's connection
        self.entered.set()
        self.released.wait(60)
        return 0

    def _register(self, sender, connection, **kwargs) -> None:
        if connection.vendor == "sqlite":
            connection.connection.create_function("paperclip_test_gate", 0, self._gate)

    def __enter__(self) -> WriteGate:
        condition = f"WHEN ({self.when}) " if self.when else ""
        connection.ensure_connection()
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SELECT pg_advisory_lock(%s)", [self.KEY])
                cursor.execute(
                    "CREATE FUNCTION paperclip_test_gate() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                    f"PERFORM pg_advisory_lock({self.KEY}); PERFORM pg_advisory_unlock({self.KEY}); RETURN COALESCE(NEW, OLD); END $$"
                )
                cursor.execute(
                    f"CREATE TRIGGER paperclip_test_gate BEFORE {self.event} ON {self.table} FOR EACH ROW "
                    f"{condition}EXECUTE FUNCTION paperclip_test_gate()"
                )
            else:
                connection_created.connect(self._register, weak=False)
                self._register(None, connection)
                cursor.execute(
                    f"CREATE TRIGGER paperclip_test_gate BEFORE {self.event} ON {self.table} FOR EACH ROW "
                    f"{condition}BEGIN SELECT paperclip_test_gate(); END"
                )
        return self

    def wait_entered(self, timeout: float = 15) -> None:
        """Return once a writer is held at the gate, inside its write."""
        if connection.vendor == "postgresql":
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT 1 FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
                        "WHERE l.locktype = 'advisory' AND NOT l.granted AND l.classid = 0 AND l.objid = %s "
                        "AND d.datname = current_database()",
                        [self.KEY],
                    )
                    if cursor.fetchone():
                        return
                time.sleep(0.005)
            raise AssertionError(f"no write to {self.table} reached the gate within {timeout} s")
        assert self.entered.wait(timeout), f"no write to {self.table} reached the gate within {timeout} s"

    def open(self) -> None:
        if self.released.is_set():
            return
        self.released.set()
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [self.KEY])

    def __exit__(self, *exc) -> None:
        self.open()
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(f"DROP TRIGGER IF EXISTS paperclip_test_gate ON {self.table}")
                cursor.execute("DROP FUNCTION IF EXISTS paperclip_test_gate()")
            else:
                cursor.execute("DROP TRIGGER IF EXISTS paperclip_test_gate")
                connection_created.disconnect(self._register)


@pytest.fixture
def file_store(settings):
    """History in files, whatever the database (the default store is the database on PostgreSQL)."""
    settings.PAPERCLIP_SESSION_STORE = HistoryStore.FILE


@pytest.fixture
def commands(settings, tmp_path):
    """The process-command allow-list of `listed_commands`, installed in the settings."""
    settings.PAPERCLIP_PROCESS_COMMANDS = listed_commands(tmp_path)
    return settings.PAPERCLIP_PROCESS_COMMANDS


def beat(agent: Agent, task: str = "go", *, now=None, **kwargs) -> HeartbeatRun:
    """One heartbeat, enqueued and executed in this thread. `now` (the clock when not given) is
    the time of both steps; other keywords (`force_fresh`, `trigger`, ...) go to the enqueue."""
    run, _ = heartbeat_enqueue(agent=agent, task=task, now=now or timezone.now(), **kwargs)
    return heartbeat_execute(run_id=run.id, now=now)


def context_agent(company: Company, **config) -> Agent:
    """A persistent agent with the context settings given (`context_budget_tokens`, ...)."""
    return Agent.objects.create(
        company=company,
        name="long-running",
        system_prompt="You are a long-running agent.",
        adapter_config={"model": "claude-opus-4-5", "session_mode": "persistent", **config},
    )


def compacting_agent(company: Company) -> Agent:
    """Three turns of 400 characters fit its budget; a 2400-character task forces a summary."""
    agent = context_agent(company, context_budget_tokens=1000, keep_recent_turns=1)
    for _ in range(3):
        assert beat(agent, "x" * 400).status == RunStatus.SUCCEEDED
    return agent


def process_agent(company: Company, tmp_path, script: str, **config) -> Agent:
    """A persistent `process` agent whose command runs `script` with this Python."""
    path = tmp_path / "agent.py"
    path.write_text(script)
    return Agent.objects.create(
        company=company,
        name="cli",
        adapter_type="process",
        adapter_config={"command": [sys.executable, str(path)], "session_mode": "persistent", **config},
    )


# Answers with what it was started with: its arguments, directory and environment names.
REPORTER = (
    "import json, os, sys\n"
    "sys.stdin.read()\n"
    "seen = {'args': sys.argv[1:], 'cwd': os.getcwd(), 'env': sorted(os.environ)}\n"
    "print(json.dumps({'text': json.dumps(seen), 'usage': {'input_tokens': 3, 'output_tokens': 1}}))\n"
)


def reporter_script(tmp_path) -> str:
    path = tmp_path / "reporter.py"
    path.write_text(REPORTER)
    return str(path)


def listed_commands(tmp_path, **entries) -> dict:
    """The allow-list as an operator writes it: `reporter` runs REPORTER; more entries may be added."""
    reporter = {
        "argv": [sys.executable, reporter_script(tmp_path)],
        "allowed_args": ["--verbose"],
        "allowed_arg_patterns": ["--topic=[a-z]{1,20}", "--topic=a+"],
        "cwd": str(tmp_path),
    }
    return parse_process_commands(json.dumps({"reporter": reporter, **entries}))


def user_turns(session: AgentSession) -> list:
    """The user turns of a session's history, as its store reads them now."""
    session.refresh_from_db()
    return [m["content"] for m in store_for(session).read(session) if m["role"] == "user"]


def snapshot(agent: Agent) -> tuple:
    """What a failed run must not change: the session's message count and history, and the ledger's size."""
    session = AgentSession.objects.get(agent=agent)
    return session.message_count, store_for(session).read(session), CostEvent.objects.count()


def refuse_writes(table: str, *, when: str, event: str = "UPDATE") -> None:
    """Install a trigger that fails matching writes: a database fault no code path expects.

    Created inside the test's transaction, so it disappears with it.
    """
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "CREATE FUNCTION paperclip_test_refuse() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'refused by a test trigger'; END $$"
            )
            cursor.execute(
                f"CREATE TRIGGER paperclip_test_refuse BEFORE {event} ON {table} FOR EACH ROW "
                f"WHEN ({when}) EXECUTE FUNCTION paperclip_test_refuse()"
            )
        else:
            cursor.execute(
                f"CREATE TRIGGER paperclip_test_refuse BEFORE {event} ON {table} FOR EACH ROW "
                f"WHEN {when} BEGIN SELECT RAISE(ABORT, 'refused by a test trigger'); END"
            )


@contextmanager
def writes_refused(table: str, *, when: str, event: str = "UPDATE"):
    """`refuse_writes` for the block only: the trigger is dropped after it, for tests whose
    transactions commit (where it would otherwise outlive the test)."""
    refuse_writes(table, when=when, event=event)
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            on = f" ON {table}" if connection.vendor == "postgresql" else ""
            cursor.execute(f"DROP TRIGGER paperclip_test_refuse{on}")
            if connection.vendor == "postgresql":
                cursor.execute("DROP FUNCTION paperclip_test_refuse()")


def task_queue_down():
    """The task queue refuses every task, as a Redis that is down would: the database
    broker's INSERT fails, for the block."""
    return writes_refused("django_q_ormq", when="1 = 1", event="INSERT")


def terminate_backend_running(statement_like: str) -> None:
    """Wait until another connection runs a statement like `statement_like`, and kill it (PostgreSQL)."""
    victim = None
    deadline = time.monotonic() + 15
    while victim is None and time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                # Only this test database's: other xdist workers run the same statements.
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE %s "
                "AND state = 'active' AND pid <> pg_backend_pid()",
                [statement_like],
            )
            row = cursor.fetchone()
        victim = row[0] if row else None
        time.sleep(0.05)
    assert victim, f"no connection was seen running {statement_like}"
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [victim])


def is_summary_request(body: dict) -> bool:
    """A request the fake API received asks for a summary of the conversation."""
    return plain_system(body) == SUMMARY_SYSTEM


def summary_text(body: dict) -> str:
    """The conversation text a summary request sends."""
    content = plain_messages(body)[0]["content"]
    return content if isinstance(content, str) else "".join(block["text"] for block in content)


def failing_once(monkeypatch, name: str, error: int = errno.EIO):
    """Make the next `os.<name>` call of the store fail, as a disk or filesystem fault would."""
    real = getattr(os, name)
    calls = []

    def fail_once(*args, **kwargs):
        if not calls:
            calls.append(args)
            raise OSError(error, os.strerror(error))
        return real(*args, **kwargs)

    monkeypatch.setattr(f"sessions_app.stores.os.{name}", fail_once)
    return calls


# Workers in processes of their own, and the ledger against what the fake answered.

ROOT = Path(__file__).resolve().parent.parent


def database_environment(settings) -> dict:
    """What a worker process needs to use the test's database and sandbox."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        url = f"sqlite:///{db['NAME']}"
    else:
        url = f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    return {
        "DATABASE_URL": url,
        "PAPERCLIP_HOME": str(settings.PAPERCLIP_HOME),
        "PAPERCLIP_SESSION_STORE": settings.PAPERCLIP_SESSION_STORE,
    }


def worker_heartbeat(agent, task: str, settings) -> subprocess.Popen:
    """The worker, as another process: `manage.py heartbeat`, on the test's database."""
    return subprocess.Popen(
        [sys.executable, "manage.py", "heartbeat", str(agent.id), "--task", task],
        cwd=ROOT,
        env={**os.environ, **database_environment(settings)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def kill_once_billed(worker: list, *, agent, calls: int, then=None):
    """For the fake's `before` of the request after the `calls`-th: once the worker has
    billed those calls (its ledger rows exist), SIGKILL it, then `then`; the request itself
    is then refused, so that the fake answered exactly `calls` requests."""

    def action():
        deadline = time.monotonic() + 60
        while CostEvent.objects.filter(agent_id=agent.id).count() < calls:
            assert time.monotonic() < deadline, "the worker never billed its answered calls"
            time.sleep(0.02)
        worker[0].kill()
        worker[0].wait(timeout=10)
        if then is not None:
            then()

    return on_own_connection(action)


def answered_usages(fake_anthropic) -> list[tuple[str, dict]]:
    return [(r["body"]["model"], r["usage"]) for r in fake_anthropic.requests if r.get("usage")]


def assert_ledger_holds_exactly(run, answered: list[tuple[str, dict]]) -> None:
    rows = list(CostEvent.objects.filter(run_id=run.id).order_by("call_number"))
    assert [(row.model, row.input_tokens, row.output_tokens, row.cache_read_input_tokens) for row in rows] == [
        (model, usage["input_tokens"], usage["output_tokens"], usage.get("cache_read_input_tokens", 0))
        for model, usage in answered
    ]
    assert all(
        row.cost_usd == call_price(usage=row.raw_usage, model=row.model, at=row.created_at).cost_usd for row in rows
    )
    run.refresh_from_db()
    assert run.cost_usd == sum((row.cost_usd for row in rows), Decimal(0))


def run_queued_tasks(cluster: str | None = None) -> list[str]:
    """What a cluster worker does with each queued task: call its function with its args.
    `cluster`: the tasks sent to that named cluster (the deployment's by default)."""
    from django.utils.module_loading import import_string
    from django_q.brokers import get_broker
    from django_q.signing import SignedPackage

    results = []
    broker = get_broker(cluster)
    for ack_id, payload in dequeued(broker):
        task = SignedPackage.loads(payload)
        results.append(import_string(task["func"])(*task["args"], **task["kwargs"]))
        broker.acknowledge(ack_id)
    return results


def dequeued(broker):
    """Each task the broker holds, as (ack id, payload), until it holds none: asked by its
    size, since the database broker sleeps its poll interval on an empty queue."""
    while broker.queue_size():
        yield from broker.dequeue() or []
