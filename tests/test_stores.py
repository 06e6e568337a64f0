"""The history stores, and the file store against the database COMMIT.

A file rename and a COMMIT are never one transaction: whichever of the two fails (or a
crash between them), the file and the row must agree, or the next read must put them back
in agreement by itself, never by losing or inventing a turn.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import OperationalError, connection
from django.utils import timezone

from costs_app.models import CostEvent
from sessions_app.maintenance import runs_reap
from sessions_app.models import Agent, AgentSession, HeartbeatRun, HistoryStore, RunStatus
from sessions_app.services import session_clear_history, session_delete
from sessions_app.stores import STORES, HistoryUnavailable, store_for
from tests.conftest import beat, failing_once, snapshot, terminate_backend_running, user_turns

pytestmark = pytest.mark.usefixtures("file_store")


def file_messages(session) -> list:
    return json.loads(store_for(session).path_for(session).read_text())["messages"]


def write(store, session, history: list) -> None:
    """A history written as every writer does: staged, its row saved, then published."""
    staged = store.stage(session, history)
    session.message_count = len(history)
    session.save()
    staged.publish()


@pytest.mark.django_db(transaction=True)
def test_clearing_a_history_whose_commit_fails_leaves_the_file(persistent_agent, fake_anthropic, refuse_at_commit):
    beat(persistent_agent, "one")
    session = AgentSession.objects.get(agent=persistent_agent)
    refuse_at_commit("agent_sessions", when="NEW.message_count < OLD.message_count")

    with pytest.raises(Exception, match="refused at commit|FOREIGN KEY"):
        session_clear_history(session=session)

    assert user_turns(session) == ["one"]
    assert len(file_messages(session)) == 2


def test_clearing_a_history_whose_session_was_deleted_since_it_was_read_clears_nothing(
    persistent_agent, fake_anthropic, django_capture_on_commit_callbacks
):
    beat(persistent_agent, "one")
    read = AgentSession.objects.get(agent=persistent_agent)  # an operator's page, or an action's list
    with django_capture_on_commit_callbacks(execute=True):  # the file goes after the COMMIT
        session_delete(session=AgentSession.objects.get(pk=read.pk), now=timezone.now())

    assert session_clear_history(session=read) is False
    assert not AgentSession.objects.filter(pk=read.pk).exists()
    if store_for(read).name == "file":
        assert not store_for(read).path_for(read).exists()  # no empty history written for it


def test_a_clear_whose_rename_fails_after_the_commit_is_repaired_by_the_next_read(
    persistent_agent, fake_anthropic, monkeypatch
):
    beat(persistent_agent, "one")
    session = AgentSession.objects.get(agent=persistent_agent)
    failed = failing_once(monkeypatch, "replace")

    session_clear_history(session=session)

    assert failed, "the rename was never attempted"
    session.refresh_from_db()
    assert session.message_count == 0
    assert store_for(session).read(session) == []
    assert file_messages(session) == []
    assert beat(persistent_agent, "two").status == RunStatus.SUCCEEDED
    assert user_turns(session) == ["two"]


def test_a_file_ahead_of_its_row_by_a_failed_heartbeat_commit_is_cut_back_to_the_row(persistent_agent, fake_anthropic):
    """The state the previous version left behind: its heartbeat renamed the file with the new
    turn, then its COMMIT failed. The turn was never committed (the row's next_seq did not
    move past it), so the file's previous version is the row's: the turn is dropped."""
    beat(persistent_agent, "one")
    session = AgentSession.objects.get(agent=persistent_agent)
    path = store_for(session).path_for(session)
    document = json.loads(path.read_text())
    document.pop("history_version", None)
    seq = session.next_seq
    document["messages"] += [
        {"role": "user", "content": "lost", "seq": seq},
        {"role": "assistant", "content": "never committed", "seq": seq + 1},
    ]
    path.write_text(json.dumps(document))
    AgentSession.objects.filter(pk=session.pk).update(history_version="")

    assert user_turns(session) == ["one"]
    assert len(file_messages(session)) == 2
    run = beat(persistent_agent, "two")
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert user_turns(session) == ["one", "two"]
    assert [m["seq"] for m in store_for(session).read(session)] == [0, 1, 2, 3]


def test_a_file_ahead_of_its_row_by_turns_the_row_already_counted_is_not_cut(persistent_agent, fake_anthropic):
    """Extra turns whose sequence numbers the row has already given out are not an
    uncommitted append: nothing proves which version is right, so the read refuses."""
    beat(persistent_agent, "one")
    beat(persistent_agent, "two")
    session = AgentSession.objects.get(agent=persistent_agent)
    AgentSession.objects.filter(pk=session.pk).update(message_count=2, history_version="")
    path = store_for(session).path_for(session)
    document = json.loads(path.read_text())
    document.pop("history_version", None)
    path.write_text(json.dumps(document))
    session.refresh_from_db()

    with pytest.raises(HistoryUnavailable) as failure:
        store_for(session).read(session)

    assert failure.value.code == "history_mismatch"
    assert len(file_messages(session)) == 4


def test_a_version_staged_and_committed_but_never_published_is_published_by_the_next_read(persistent_agent):
    """A crash between the COMMIT and the rename: the row names a version only the staged
    file holds."""
    session = AgentSession.objects.create(
        agent=persistent_agent, company=persistent_agent.company, store=HistoryStore.FILE
    )
    store = store_for(session)
    first = [{"role": "user", "content": "a", "seq": 0}, {"role": "assistant", "content": "b", "seq": 1}]
    write(store, session, first)
    second = first + [{"role": "user", "content": "c", "seq": 2}, {"role": "assistant", "content": "d", "seq": 3}]
    staged = store.stage(session, second)
    session.message_count = 4
    session.save()
    # ...the process dies here: the row is committed, the rename never happened.
    del staged
    assert len(file_messages(session)) == 2

    fresh = AgentSession.objects.get(pk=session.pk)
    assert store.read(fresh) == second
    assert file_messages(session) == second
    assert not list(store.path_for(session).parent.glob(f".{session.public_id}.*"))


def test_a_version_staged_but_never_committed_is_ignored_and_removed_with_its_session(
    persistent_agent, django_capture_on_commit_callbacks
):
    """A crash before the COMMIT: the staged file names a version no row has."""
    session = AgentSession.objects.create(
        agent=persistent_agent, company=persistent_agent.company, store=HistoryStore.FILE
    )
    store = store_for(session)
    first = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    write(store, session, first)
    store.stage(AgentSession.objects.get(pk=session.pk), first + first)  # ...and the process dies

    fresh = AgentSession.objects.get(pk=session.pk)
    assert store.read(fresh) == first
    folder = store.path_for(session).parent
    assert len(list(folder.glob(f".{session.public_id}.*"))) == 1

    with django_capture_on_commit_callbacks(execute=True):
        session_delete(session=fresh, now=timezone.now())
    assert list(folder.iterdir()) == []


def test_the_database_store_keeps_the_history_in_its_row(persistent_agent):
    session = AgentSession.objects.create(
        agent=persistent_agent, company=persistent_agent.company, store=HistoryStore.DATABASE
    )
    history = [{"role": "user", "content": "a"}]

    write(STORES[HistoryStore.DATABASE], session, history)

    fresh = AgentSession.objects.get(pk=session.pk)
    assert (fresh.history, fresh.history_version) == (history, "")
    assert store_for(fresh).read(fresh) == history


def test_a_reader_with_an_older_row_never_publishes_over_a_newer_version(persistent_agent):
    """A reader read the row while it named a version still staged; by the time it repairs,
    a writer has committed and published the next one. The stale version must not land on
    top of it (the writer would lose its history for good)."""
    session = AgentSession.objects.create(
        agent=persistent_agent, company=persistent_agent.company, store=HistoryStore.FILE
    )
    store = store_for(session)
    first = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    write(store, session, first)
    store.stage(session, first + first)
    session.message_count = 4
    session.save()  # committed; its publication crashed
    stale = AgentSession.objects.get(pk=session.pk)
    writer = AgentSession.objects.get(pk=session.pk)
    third = [{"role": "user", "content": "cleared and started again"}]
    staged = store.stage(writer, third)
    writer.message_count = 1
    writer.save()
    os.replace(staged.path, staged.target)  # the writer's publication, half done

    assert store.read(stale) == first + first  # what the stale row named, as it was

    assert store.read(AgentSession.objects.get(pk=session.pk)) == third
    assert file_messages(session) == third


def held_back_publications(monkeypatch) -> tuple[list, object]:
    """Hold back the next publication (the writer's COMMIT is done, its rename delayed: a
    slow disk, a descheduled worker); later ones run. Returns the held ones and the real
    `publish`, to let one land when the test chooses."""
    from sessions_app.stores import StagedFile

    real = StagedFile.publish
    held: list = []
    monkeypatch.setattr(StagedFile, "publish", lambda staged: real(staged) if held else held.append(staged))
    return held, real


def test_a_late_publish_never_replaces_a_newer_version_cleared_meanwhile(persistent_agent, fake_anthropic, monkeypatch):
    """A heartbeat commits its turn and is delayed before its rename; meanwhile the admin's
    "clear history" commits an empty history and renames it into place, and the late rename
    lands right after that one. It must not put its version back on top: the row says 0
    messages, so must the file, and the next heartbeat works."""
    beat(persistent_agent, "one")
    session = AgentSession.objects.get(agent=persistent_agent)
    held, publish = held_back_publications(monkeypatch)
    assert beat(persistent_agent, "two").status == RunStatus.SUCCEEDED
    assert len(held) == 1 and len(file_messages(session)) == 2  # committed, not renamed
    real_replace = os.replace

    def then_the_late_rename(source, target):
        real_replace(source, target)  # the clear's own rename
        while held:
            publish(held.pop())

    monkeypatch.setattr("sessions_app.stores.os.replace", then_the_late_rename)
    session_clear_history(session=session)
    assert not held, "the late rename never ran"

    session.refresh_from_db()
    assert session.message_count == 0
    assert file_messages(session) == []
    assert store_for(session).read(session) == []
    assert not list(store_for(session).path_for(session).parent.glob(f".{session.public_id}.*"))
    run = beat(persistent_agent, "three")
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert user_turns(session) == ["three"]


def test_a_late_publish_never_gives_a_deleted_session_a_file(persistent_agent, fake_anthropic, monkeypatch):
    """A heartbeat starts a session, commits and is delayed before its rename; meanwhile the
    session's deletion commits, and its process dies before removing files (they go after
    its COMMIT). The late rename must not leave the deleted session a history file."""
    held, publish = held_back_publications(monkeypatch)
    assert beat(persistent_agent, "one").status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=persistent_agent)
    folder = store_for(session).path_for(session).parent
    session_delete(session=session, now=timezone.now())  # its file removal never runs

    publish(held.pop())

    assert not AgentSession.objects.filter(pk=session.pk).exists()
    assert list(folder.iterdir()) == []


def test_every_store_implements_the_history_backend_interface():
    from sessions_app.stores import HistoryBackend

    for name, store in STORES.items():
        assert isinstance(store, HistoryBackend) and store.name == name
        for operation in ("read", "stage", "delete"):
            assert getattr(type(store), operation) is not getattr(HistoryBackend, operation), (name, operation)


def refuse_creating_files_in(monkeypatch, folder: Path) -> None:
    """What a folder without write permission answers any user but root: EACCES when the
    store creates a file in it. Root ignores directory permissions, and CI runs as root."""
    real = os.open

    def guarded(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).parent == folder:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr("sessions_app.stores.os.open", guarded)


def test_file_store_faults_fail_only_their_own_session(settings, company, fake_anthropic, monkeypatch):
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
    if os.geteuid() == 0:
        refuse_creating_files_in(monkeypatch, folder)
    try:
        results = [beat(agent, "again") for agent in agents]
    finally:
        folder.chmod(0o700)

    codes = [(r.status, r.error_code) for r in results]
    assert codes[0] == (RunStatus.FAILED, "history_corrupt")
    assert codes[1] == (RunStatus.FAILED, "history_missing")
    assert codes[2] == (RunStatus.FAILED, "history_unwritable")
    readonly.refresh_from_db()
    assert readonly.message_count == 2
    assert codes[3] == (RunStatus.SUCCEEDED, "")
    healthy.refresh_from_db()
    assert healthy.message_count == 4


def test_a_new_agents_first_history_is_named_by_no_row_until_its_folder_is_flushed(
    settings, company, fake_anthropic, monkeypatch
):
    """A new agent's first history file is in a folder made for it: the file is on disk only
    once the folder holding that folder is flushed too. A flush of it that fails (EIO)
    fails the run before the COMMIT (before: it was never flushed, so a crash after the
    COMMIT could take the folder back and the session failed `history_missing`)."""
    settings.PAPERCLIP_SESSION_STORE = "file"
    agent = Agent.objects.create(company=company, name="first", adapter_config={"session_mode": "persistent"})
    sessions = (Path(settings.PAPERCLIP_HOME) / "sessions").resolve()
    sessions.mkdir(parents=True, exist_ok=True)
    real_fsync = os.fsync

    def sessions_flush_fails(fd):
        if Path(os.readlink(f"/proc/self/fd/{fd}")) == sessions:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", sessions_flush_fails)
    run = beat(agent, "hello")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "history_unwritable")
    assert not AgentSession.objects.filter(agent=agent).exists()


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


@pytest.mark.django_db(transaction=True)
def test_connection_terminated_during_the_commit_leaves_the_history_file_whole(
    postgres_only, settings, persistent_agent, fake_anthropic
):
    """Killed at the commit's very end, after the statement (and the staged history file)
    succeeded: on PostgreSQL a resumed session's turn and the run's outcome are one
    statement (`hot_sql.turn_and_outcome_run`), its COMMIT sent with it, held open here
    by a deferred trigger, which runs as it commits. It never commits, so the file must not
    move either."""
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
    lost = []

    def second_heartbeat():
        try:
            beat(persistent_agent, "second")
        except OperationalError as exc:  # the worker's connection is gone: it dies, as a worker would
            lost.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=second_heartbeat)
    thread.start()
    try:
        terminate_backend_running("COMMIT")  # the statement ran; its COMMIT runs the trigger
        thread.join(timeout=30)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER IF EXISTS slow_commit ON agent_sessions; DROP FUNCTION IF EXISTS slow_commit();"
            )

    assert lost, "the commit's connection was never terminated"
    assert store_for(session).path_for(session).read_bytes() == before
    session.refresh_from_db()
    assert session.message_count == 2
    runs_reap(now=timezone.now() + timedelta(hours=1))
    assert HeartbeatRun.objects.get(task="second").status == RunStatus.FAILED
    assert beat(persistent_agent, "third").status == RunStatus.SUCCEEDED
    assert [m["content"] for m in snapshot(persistent_agent)[1] if m["role"] == "user"] == ["first", "third"]


@pytest.mark.parametrize("store", ["file", "database"])
def test_history_round_trips_through_each_store(settings, persistent_agent, fake_anthropic, store):
    settings.PAPERCLIP_SESSION_STORE = store
    beat(persistent_agent, "one")
    run = beat(persistent_agent, "two")
    session = AgentSession.objects.get(id=run.session_id)
    assert session.store == store
    history = store_for(session).read(session)
    assert [m["content"] for m in history if m["role"] == "user"] == ["one", "two"]
    if store == "file":
        path = store_for(session).path_for(session)
        assert path == settings.PAPERCLIP_HOME / "sessions" / str(persistent_agent.id) / f"{session.public_id}.json"
        assert json.loads(path.read_text())["messages"] == history
        assert session.history == []
    else:
        assert session.history == history


def test_crash_between_write_and_rename_leaves_the_old_file_whole(settings, persistent_agent, fake_anthropic):
    settings.PAPERCLIP_SESSION_STORE = "file"
    run = beat(persistent_agent, "one")
    session = AgentSession.objects.get(id=run.session_id)
    store = store_for(session)
    before = store.path_for(session).read_bytes()

    store.stage(session, [{"role": "user", "content": "half-written"}])  # staged file written
    # ...the process dies here: no COMMIT, no rename.

    assert store.path_for(session).read_bytes() == before
    assert [m["content"] for m in store.read(AgentSession.objects.get(pk=session.pk))][0] == "one"


def test_corrupt_history_file_fails_the_heartbeat_clearly_without_calling_the_model(
    settings, persistent_agent, fake_anthropic
):
    settings.PAPERCLIP_SESSION_STORE = "file"
    run = beat(persistent_agent, "one")
    session = AgentSession.objects.get(id=run.session_id)
    store_for(session).path_for(session).write_text("{not json")
    fake_anthropic.reset_log()

    failed = beat(persistent_agent, "two")

    assert failed.status == RunStatus.FAILED
    assert failed.error_code == "history_corrupt"
    assert failed.error.startswith(f"History file of session {session.public_id} is corrupt: it is not JSON")
    assert fake_anthropic.message_requests == []


@pytest.mark.parametrize("document", ["null", "[]", '{"version": 1}', '{"messages": {}}'])
def test_a_history_file_of_json_without_its_messages_list_is_said_to_be_so(
    settings, persistent_agent, fake_anthropic, document
):
    settings.PAPERCLIP_SESSION_STORE = "file"
    session = AgentSession.objects.get(id=beat(persistent_agent, "one").session_id)
    store_for(session).path_for(session).write_text(document)

    failed = beat(persistent_agent, "two")

    # Before: the exception's own text ("'NoneType' object is not subscriptable", "'messages'").
    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "history_corrupt")
    assert failed.error == f'History file of session {session.public_id} is corrupt: it holds no "messages" list.'


def test_missing_history_file_is_an_error_not_an_empty_history(settings, persistent_agent, fake_anthropic):
    settings.PAPERCLIP_SESSION_STORE = "file"
    run = beat(persistent_agent, "one")
    session = AgentSession.objects.get(id=run.session_id)
    store_for(session).path_for(session).unlink()

    failed = beat(persistent_agent, "two")

    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "history_missing")
    assert len(fake_anthropic.message_requests) == 1
