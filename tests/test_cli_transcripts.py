"""Claude Code transcripts kept here: both stores pass the SDK's own conformance suite."""

from __future__ import annotations

import uuid

import pytest
from asgiref.sync import async_to_sync
from claude_agent_sdk.testing import run_session_store_conformance

from sessions_app.adapters import AdapterReply
from sessions_app.adapters.base import Adapter
from sessions_app.cli_transcripts import DatabaseTranscripts, FileTranscripts, RunTranscript, StagedTranscript
from sessions_app.models import AgentSession

pytestmark = pytest.mark.django_db


def conformance(make_store) -> None:
    # async_to_sync runs the suite on an event loop in another thread; the stores'
    # sync_to_async calls come back to this thread, and so to the test's connection.
    async_to_sync(run_session_store_conformance)(make_store)


@pytest.mark.parametrize("kind", [DatabaseTranscripts, FileTranscripts])
def test_the_sdk_conformance_suite_passes_with_delete_list_sessions_and_list_subkeys(kind):
    # Each contract gets a store of its own scope (an agent of its own), as it requires.
    conformance(lambda: kind(uuid.uuid4()))


@pytest.mark.parametrize("kind", [DatabaseTranscripts, FileTranscripts])
def test_a_transcript_round_trips_nul_and_lone_surrogates_exactly(kind):
    store = kind(uuid.uuid4())
    key = {"project_key": "p", "session_id": "s"}
    entries = [{"type": "user", "text": "a\x00b", "odd": "\ud800", "n": [1, {"x": None}]}]
    store.append_now(key, entries)
    assert store.load_now(key) == entries
    assert store.session_entries("s") == {"": entries}


@pytest.mark.parametrize("kind", [DatabaseTranscripts, FileTranscripts])
def test_keys_cannot_leave_the_store(kind, tmp_path):
    store = kind(uuid.uuid4())
    with pytest.raises(ValueError):
        store.append_now({"project_key": "p", "session_id": "x" * 300}, [{"type": "x"}])
    if kind is FileTranscripts:
        path = store.path_for({"project_key": "../..", "session_id": "../../etc", "subpath": "../../../x"})
        assert path.resolve().is_relative_to(store.root.resolve())


@pytest.mark.parametrize("dots", [".", ".."])
def test_a_key_part_of_dots_alone_names_a_file_of_its_own_not_a_folder_above(dots):
    # quote() leaves dots alone: ".." had named the parent folder, and deleting that session
    # had removed every transcript of the agent.
    store = FileTranscripts(uuid.uuid4())
    neighbour = {"project_key": "p", "session_id": "kept"}
    store.append_now(neighbour, [{"type": "user", "n": 1}])
    key = {"project_key": dots, "session_id": dots, "subpath": dots}
    store.append_now(key, [{"type": "user", "n": 2}])
    store.append_now({"project_key": "p", "session_id": dots}, [{"type": "user", "n": 3}])

    assert store.path_for(key).resolve().parent.parent.parent.parent == store.root.resolve()
    assert store.list_subkeys_now(key) == [dots]
    assert {found["session_id"] for found in store.list_sessions_now("p")} == {"kept", dots}

    store.delete_session(dots)
    store.delete_now({"project_key": "p", "session_id": dots})

    assert store.load_now(neighbour) == [{"type": "user", "n": 1}]
    assert store.load_now(key) is None


def test_a_failed_heartbeat_cuts_the_file_back_to_what_it_was():
    store = FileTranscripts(uuid.uuid4())
    key = {"project_key": "p", "session_id": "s"}
    store.append_now(key, [{"type": "a"}])
    session = AgentSession(id=uuid.uuid4(), cli_session_id="s")  # a row that never committed
    staged = StagedTranscript(store, [(key, [{"type": "b"}, {"type": "c"}])], session=session)
    staged.write()
    assert len(store.load_now(key)) == 3
    staged.discard()
    assert store.load_now(key) == [{"type": "a"}]


def test_lines_past_the_sizes_the_row_names_are_never_read_and_the_next_write_cuts_them():
    """A worker killed between its append and its COMMIT: its lines are on disk, its sizes
    are not on the row."""
    store = FileTranscripts(uuid.uuid4())
    main = {"project_key": "p", "session_id": "s"}
    sub = {**main, "subpath": "subagents/agent-1"}
    session = AgentSession(id=uuid.uuid4(), cli_session_id="s", cli_transcript_sizes={})
    session.cli_transcript_sizes = StagedTranscript(store, [(main, [{"type": "a"}])], session=session).write()
    StagedTranscript(store, [(main, [{"type": "dead"}]), (sub, [{"type": "dead"}])], session=session).write()
    assert len(store.load_now(main)) == 2  # ...and the worker dies: no COMMIT, no discard

    assert store.session_entries("s", committed=session.cli_transcript_sizes) == {"": [{"type": "a"}]}
    assert store.session_entries("s") == {
        "": [{"type": "a"}, {"type": "dead"}],
        "subagents/agent-1": [{"type": "dead"}],
    }

    sizes = StagedTranscript(store, [(main, [{"type": "b"}]), (sub, [{"type": "c"}])], session=session).write()
    assert store.load_now(main) == [{"type": "a"}, {"type": "b"}]
    assert store.load_now(sub) == [{"type": "c"}]
    assert store.session_entries("s", committed=sizes) == {
        "": [{"type": "a"}, {"type": "b"}],
        "subagents/agent-1": [{"type": "c"}],
    }


def test_a_run_sees_the_loaded_session_under_any_project_key():
    run = RunTranscript({"": [{"type": "a"}], "subagents/agent-1": [{"type": "b"}]})
    load = async_to_sync(run.load)
    assert load({"project_key": "elsewhere", "session_id": "s"}) == [{"type": "a"}]
    assert async_to_sync(run.list_subkeys)({"project_key": "x", "session_id": "s"}) == ["subagents/agent-1"]
    async_to_sync(run.append)({"project_key": "x", "session_id": "s"}, [{"type": "c"}])
    assert run.appended == [({"project_key": "x", "session_id": "s"}, [{"type": "c"}])]


def test_a_retried_batch_keeps_each_entry_once_by_its_uuid():
    key = {"project_key": "x", "session_id": "s"}
    run = RunTranscript({"": [{"type": "user", "uuid": "u1"}]})
    append = async_to_sync(run.append)

    append(key, [{"type": "user", "uuid": "u1"}, {"type": "assistant", "uuid": "u2"}])  # u1 was loaded
    append(key, [{"type": "assistant", "uuid": "u2"}, {"type": "title"}])  # a retry overlapping the last
    append(key, [{"type": "title"}])  # no uuid: appended each time
    append({**key, "subpath": "subagents/a"}, [{"type": "user", "uuid": "u2"}])  # another transcript

    assert run.appended == [
        (key, [{"type": "assistant", "uuid": "u2"}]),
        (key, [{"type": "title"}]),
        (key, [{"type": "title"}]),
        ({**key, "subpath": "subagents/a"}, [{"type": "user", "uuid": "u2"}]),
    ]


@pytest.mark.parametrize("store", ["database", "file"])
def test_retention_purges_an_ended_sessions_transcript(
    persistent_agent, store, settings, django_capture_on_commit_callbacks
):
    from datetime import timedelta

    from django.utils import timezone

    from sessions_app.maintenance import histories_purge
    from sessions_app.models import AgentSession, CliTranscriptEntry

    now = timezone.now()
    cli_id = str(uuid.uuid4())
    ended = now - timedelta(days=settings.PAPERCLIP_RETENTION_DAYS + 1)
    session = AgentSession.objects.create(
        agent=persistent_agent,
        company=persistent_agent.company,
        store=store,
        cli_session_id=cli_id,
        status="ended",
        ended_at=ended,
    )
    kept = DatabaseTranscripts(persistent_agent.id) if store == "database" else FileTranscripts(persistent_agent.id)
    kept.append_now({"project_key": "p", "session_id": cli_id}, [{"type": "user"}])
    other = {"project_key": "p", "session_id": str(uuid.uuid4())}
    kept.append_now(other, [{"type": "user"}])

    with django_capture_on_commit_callbacks(execute=True):
        assert histories_purge(now=now) == 1

    assert kept.session_entries(cli_id) == {}
    assert kept.load_now(other) == [{"type": "user"}]  # another session's transcript stays
    session.refresh_from_db()
    assert session.history_purged_at is not None
    assert CliTranscriptEntry.objects.filter(session_id=cli_id).count() == 0


def test_a_transcript_kept_before_sizes_were_is_read_whole_and_its_next_write_names_every_file():
    store = FileTranscripts(uuid.uuid4())
    main = {"project_key": "p", "session_id": "s"}
    sub = {**main, "subpath": "subagents/agent-1"}
    store.append_now(main, [{"type": "a"}])
    store.append_now(sub, [{"type": "b"}])
    session = AgentSession(id=uuid.uuid4(), cli_session_id="s", cli_transcript_sizes=None)

    assert store.session_entries("s", committed=None) == {"": [{"type": "a"}], "subagents/agent-1": [{"type": "b"}]}
    sizes = StagedTranscript(store, [(main, [{"type": "c"}])], session=session).write()

    assert store.session_entries("s", committed=sizes) == {
        "": [{"type": "a"}, {"type": "c"}],
        "subagents/agent-1": [{"type": "b"}],
    }


def test_a_write_that_fails_half_way_is_cut_back_by_the_failed_heartbeat():
    """The main transcript is appended, then a subagent's cannot be (its folder is a file):
    the heartbeat fails `history_unwritable`, and its discard cuts the main one back, even
    for a transcript kept before sizes were (read whole)."""
    from sessions_app.errors import HistoryUnavailable

    store = FileTranscripts(uuid.uuid4())
    main = {"project_key": "p", "session_id": "s"}
    store.append_now(main, [{"type": "a"}])
    (store.path_for(main).parent / "sub").write_text("in the way")
    session = AgentSession(id=uuid.uuid4(), cli_session_id="s", cli_transcript_sizes=None)
    staged = StagedTranscript(
        store, [(main, [{"type": "b"}]), ({**main, "subpath": "subagents/x"}, [{"type": "c"}])], session=session
    )

    with pytest.raises(HistoryUnavailable) as failure:
        staged.write()
    staged.discard()

    assert failure.value.code == "history_unwritable"
    assert store.session_entries("s") == {"": [{"type": "a"}]}


class TranscriptKeepingAdapter(Adapter):
    """Claude Code's runtime without the CLI (whose start alone takes seconds): it keeps
    its session in the engine's transcript stores, each call appending one line to the
    transcript it resumes."""

    type_name = "claude-code"
    keeps_own_session = True
    own_session_store = "cli_transcripts"
    config_keys = frozenset({"model", "runtime"})

    def validate_config(self, config, errors):
        return {"model": config["model"], "runtime": "cli"}

    def for_config(self, config):
        return self

    def call_seconds(self, config) -> float:
        return 5

    def call(self, request):
        own = request.own_session
        cli_id = own.resumed_id or str(uuid.uuid4())
        transcript = own.run_transcript()
        line = {"type": "user", "uuid": str(uuid.uuid4()), "text": request.messages[-1]["content"]}
        async_to_sync(transcript.append)({"project_key": "p", "session_id": cli_id}, [line])
        return AdapterReply(
            text="done",
            content="done",
            model=request.model,
            usage={"input_tokens": 7, "output_tokens": 3},
            on_commit=own.on_commit(transcript, session_id=cli_id, report={}),
        )


@pytest.mark.django_db(transaction=True)
def test_a_session_deleted_while_a_heartbeat_commits_its_transcript_keeps_no_line(company, monkeypatch, settings):
    from django.utils import timezone

    from sessions_app.adapters import ADAPTERS
    from sessions_app.models import Agent, CliTranscriptEntry, RunStatus
    from sessions_app.services import session_delete
    from tests.conftest import Actor, WriteGate, beat, wait_until_blocked

    settings.PAPERCLIP_SESSION_STORE = "database"  # the file store deletes after the COMMIT
    adapter = TranscriptKeepingAdapter()
    monkeypatch.setitem(ADAPTERS, adapter.type_name, adapter)
    agent = Agent.objects.create(
        company=company,
        name="Coder",
        adapter_type=adapter.type_name,
        adapter_config={"runtime": "cli", "session_mode": "persistent", "model": "claude-haiku-4-5"},
    )
    assert beat(agent, "first").status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)

    # The worst moment: the second heartbeat's commit has locked the session and written
    # its transcript line, and its COMMIT is held, when the session's deletion begins.
    with WriteGate("heartbeat_runs", event="UPDATE", when="NEW.status = 'succeeded'") as gate:
        heartbeat = Actor(lambda: beat(agent, "second"))
        heartbeat.start()
        gate.wait_entered()
        deletion = Actor(lambda: session_delete(session=session, now=timezone.now()))
        deletion.start()
        wait_until_blocked(deletion)
        gate.open()
        assert heartbeat.result().status == RunStatus.SUCCEEDED
        deletion.result()

    assert not AgentSession.objects.filter(agent=agent).exists()
    assert not CliTranscriptEntry.objects.filter(scope=agent.id).exists()  # the second run's line too


@pytest.mark.parametrize("store", ["database", "file"])
def test_a_cleared_session_resumes_none_of_its_claude_code_transcript(
    persistent_agent, store, django_capture_on_commit_callbacks
):
    """The transcript is what the CLI resumes from: clearing the history clears it too, or
    the next heartbeat's CLI is handed every cleared turn (before: it was, while the
    session showed an empty history)."""
    from sessions_app.cli_transcripts import SessionTranscripts, transcripts_for
    from sessions_app.services import session_clear_history

    cli_id = str(uuid.uuid4())
    session = AgentSession.objects.create(
        agent=persistent_agent, company=persistent_agent.company, store=store, cli_session_id=cli_id
    )
    kept = transcripts_for(agent_id=persistent_agent.id, store=store)
    key = {"project_key": "p", "session_id": cli_id}
    session.cli_transcript_sizes = StagedTranscript(kept, [(key, [{"type": "user"}])], session=session).write()
    session.save(update_fields=["cli_transcript_sizes"])
    assert SessionTranscripts(session, agent_id=persistent_agent.id).run_transcript().loaded == {"": [{"type": "user"}]}

    with django_capture_on_commit_callbacks(execute=True):
        assert session_clear_history(session=session)

    session.refresh_from_db()
    assert session.message_count == 0
    assert SessionTranscripts(session, agent_id=persistent_agent.id).run_transcript().loaded == {}
    assert kept.session_entries(cli_id) == {}


def test_a_new_transcript_file_whose_folder_cannot_be_flushed_is_never_named_by_a_row(monkeypatch):
    """A new file is on disk only once its folder (and the folders made for it) is flushed:
    until then a crash can take it back while a committed row names its size. A flush
    that fails (EIO) fails the write before the row is given sizes (before: the folders
    were never flushed, and the write returned sizes naming the file)."""
    import os
    import stat

    from sessions_app.errors import HistoryUnavailable

    store = FileTranscripts(uuid.uuid4())
    key = {"project_key": "p", "session_id": "s"}
    session = AgentSession(id=uuid.uuid4(), cli_session_id="s", cli_transcript_sizes={})
    real_fsync = os.fsync

    def folder_flush_fails(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", folder_flush_fails)
    with pytest.raises(HistoryUnavailable) as failed:
        StagedTranscript(store, [(key, [{"type": "user"}])], session=session).write()
    assert failed.value.code == "history_unwritable"
