"""Files under PAPERCLIP_HOME that no row names: the maintenance pass removes them once they
are older than the grace, and never a file a row names or is about to name."""

from __future__ import annotations

import errno
import logging
import os
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from sessions_app import orphan_files
from sessions_app.cli_transcripts import FileTranscripts
from sessions_app.durable import folders_make
from sessions_app.maintenance import maintenance_pass
from sessions_app.managed_outputs import output_delete, output_path
from sessions_app.models import Agent, AgentSession, HistoryStore, ManagedOutput, SessionStatus
from sessions_app.orphan_files import grace, orphan_files_remove
from sessions_app.services import agent_delete, agents_hard_delete, session_delete
from sessions_app.stores import store_for
from tests.conftest import Actor

pytestmark = pytest.mark.usefixtures("file_store")

TURNS = [
    {"role": "user", "content": "a", "seq": 0},
    {"role": "assistant", "content": "b", "seq": 1},
    {"role": "user", "content": "c", "seq": 2},
    {"role": "assistant", "content": "d", "seq": 3},
]


def later(**extra):
    """The time of a pass past the grace of every file written so far."""
    return timezone.now() + grace() + timedelta(minutes=1, **extra)


def files(home: Path) -> set[str]:
    """The files of the stores, by path below PAPERCLIP_HOME."""
    return {
        path.relative_to(home).as_posix()
        for root in (home / "sessions", home / "outputs")
        for path in root.rglob("*")
        if path.is_file()
    }


def session_with_files(agent, *, cli_session_id: str | None = None) -> AgentSession:
    """A file-store session as a crash after a COMMIT leaves it: its history file, a newer
    version committed (the row names it) but never renamed into place, and a Claude Code
    transcript, main and a subagent's, whose sizes the row names."""
    session = AgentSession.objects.create(
        agent=agent, company=agent.company, store=HistoryStore.FILE, cli_session_id=cli_session_id or str(uuid.uuid4())
    )
    store = store_for(session)
    staged = store.stage(session, TURNS[:2])
    session.message_count = 2
    session.save()
    staged.publish()
    store.stage(session, TURNS)
    session.message_count = 4
    session.save()  # ...and the process dies before the rename
    transcripts = FileTranscripts(agent.id)
    key = {"project_key": "p", "session_id": session.cli_session_id}
    transcripts.append_now(key, [{"type": "user", "n": 1}])
    transcripts.append_now({**key, "subpath": "subagents/agent-1"}, [{"type": "user", "n": 2}])
    session.cli_transcript_sizes = transcripts.session_sizes(session.cli_session_id)
    session.save()
    return session


def output_copy(agent, *, file_id: str = "file_1", row: bool = True) -> ManagedOutput:
    """A Managed Agents output copied here: its file, and (`row`) its row."""
    output = ManagedOutput(
        company=agent.company,
        agent=agent,
        remote_session_id="sesn_1",
        file_id=file_id,
        filename="out.txt",
        size_bytes=3,
        sha256="x" * 64,
    )
    path = output_path(output)
    folders_make(path.parent)
    path.write_bytes(b"abc")
    if row:
        output.save()
    return output


def files_of(session: AgentSession, home: Path) -> set[str]:
    """A session's history files and transcript files, by path below PAPERCLIP_HOME."""
    found = set(store_for(session).path_for(session).parent.glob(f"*{session.public_id}*"))
    found |= {path for _, path in FileTranscripts(session.agent_id).session_files(session.cli_session_id)}
    return {path.relative_to(home).as_posix() for path in found if path.is_file()}


def test_files_a_deletion_killed_after_its_commit_left_are_removed_once_older_than_the_grace(
    persistent_agent, other_agent, paperclip_home, caplog
):
    """The deletions commit and their workers die before removing the files (no on-commit
    callback runs here): a session's history, its staged version and its transcript, and an
    output an operator deleted. They stay while younger than the grace, then the maintenance
    pass removes them, logging each by its path below PAPERCLIP_HOME; another agent's files,
    which rows name, stay."""
    deleted = session_with_files(persistent_agent)
    output = output_copy(persistent_agent)
    kept = session_with_files(other_agent)
    kept_output = output_copy(other_agent, file_id="file_2")
    left = files_of(deleted, paperclip_home) | {output_path(output).relative_to(paperclip_home).as_posix()}
    assert len(left) == 5
    before = files(paperclip_home)
    session_delete(session=deleted, now=timezone.now())
    output_delete(output)
    assert files(paperclip_home) == before

    assert orphan_files_remove(now=timezone.now() + grace() - timedelta(minutes=1)) == 0
    assert files(paperclip_home) == before

    with caplog.at_level(logging.INFO, logger="sessions_app.orphan_files"):
        assert maintenance_pass(now=later())["orphan_files"] == 5

    assert files(paperclip_home) == before - left
    assert len(files_of(kept, paperclip_home)) == 4 and output_path(kept_output).exists()
    logged = {record.getMessage() for record in caplog.records if record.name == "sessions_app.orphan_files"}
    assert logged == {f"Removed {path}, which no row names" for path in left}
    cli = FileTranscripts(persistent_agent.id).root / "p"
    assert list(cli.iterdir()) == []  # the CLI session's folder went with its files
    assert paperclip_home.is_dir() and (paperclip_home / "sessions" / str(persistent_agent.id)).is_dir()


def test_a_retired_agent_whose_file_removals_failed_loses_its_files_and_folders_to_the_pass(
    persistent_agent, paperclip_home, monkeypatch, django_capture_on_commit_callbacks, caplog
):
    """The retirement commits; removing the files after it fails (EIO, only logged). The
    pass removes them and then the agent's folders, and leaves the stores' own."""
    session_with_files(persistent_agent)
    output_copy(persistent_agent)

    def fails(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("sessions_app.stores.FileStore.delete", fails)
    monkeypatch.setattr("sessions_app.cli_transcripts.FileTranscripts.delete_session", fails)
    monkeypatch.setattr("sessions_app.managed_outputs.shutil.rmtree", fails)
    with django_capture_on_commit_callbacks(execute=True):
        agent_delete(agent=persistent_agent, now=timezone.now())
    monkeypatch.undo()
    assert "Could not delete the history file" in caplog.text
    assert len(files(paperclip_home)) == 5

    assert orphan_files_remove(now=later()) == 5

    assert files(paperclip_home) == set()
    assert not (paperclip_home / "sessions" / str(persistent_agent.id)).exists()
    assert not (paperclip_home / "outputs" / str(persistent_agent.id)).exists()
    assert (paperclip_home / "sessions").is_dir() and (paperclip_home / "outputs").is_dir()


def test_the_files_a_purge_killed_after_its_commit_left_are_removed_and_the_outputs_stay(
    persistent_agent, paperclip_home
):
    """A retention purge marks the row purged and commits; its worker dies before the files
    go. The row no longer names them (a purged session reads as empty); its outputs are
    kept with the agent after the purge, so they stay."""
    session = session_with_files(persistent_agent)
    output = output_copy(persistent_agent)
    left = files_of(session, paperclip_home)
    AgentSession.objects.filter(pk=session.pk).update(
        status=SessionStatus.EXPIRED, ended_at=timezone.now(), history=[], history_purged_at=timezone.now()
    )

    assert orphan_files_remove(now=later()) == 4

    assert files(paperclip_home) == {output_path(output).relative_to(paperclip_home).as_posix()}
    assert not left & files(paperclip_home)


def test_a_fresh_file_no_row_names_is_left_as_a_write_in_flight(persistent_agent, paperclip_home):
    """Files written before the COMMIT that will name them: a history version staged for a
    live session, a new Claude Code session's transcript, an output copied and not yet
    recorded. Younger than the grace, they stay; past it (their writers died before the
    COMMIT) they go, and the session still reads the history its row names."""
    session = session_with_files(persistent_agent)
    named = files(paperclip_home)
    store_for(session).stage(AgentSession.objects.get(pk=session.pk), TURNS + TURNS)  # never committed
    FileTranscripts(persistent_agent.id).append_now({"project_key": "p", "session_id": "new"}, [{"type": "user"}])
    output_copy(persistent_agent, row=False)
    in_flight = files(paperclip_home) - named
    assert len(in_flight) == 3

    assert orphan_files_remove(now=timezone.now()) == 0
    assert orphan_files_remove(now=timezone.now() + grace() - timedelta(minutes=1)) == 0
    assert files(paperclip_home) == named | in_flight

    assert orphan_files_remove(now=later()) == 3
    assert files(paperclip_home) == named
    fresh = AgentSession.objects.get(pk=session.pk)
    assert store_for(fresh).read(fresh) == TURNS


def test_no_file_a_row_names_is_ever_removed(persistent_agent, paperclip_home):
    """Every kind of named file, however old: a live session's history file and the newer
    version its row names (committed, never renamed into place), the transcript the row
    names with lines and a subagent's file the row's sizes do not name yet (a run that died
    before its COMMIT; the next write cuts them), an ended session's files, an output copy.
    The staged version is still whole: the next read puts it in place."""
    ended = session_with_files(persistent_agent)
    AgentSession.objects.filter(pk=ended.pk).update(status=SessionStatus.EXPIRED, ended_at=timezone.now())
    live = session_with_files(persistent_agent)
    transcripts = FileTranscripts(persistent_agent.id)
    key = {"project_key": "p", "session_id": live.cli_session_id}
    transcripts.append_now({**key, "subpath": "subagents/agent-2"}, [{"type": "dead"}])
    transcripts.append_now(key, [{"type": "dead"}])
    output_copy(persistent_agent)
    named = files(paperclip_home)
    assert len(named) == 10

    assert orphan_files_remove(now=later(days=365)) == 0

    assert files(paperclip_home) == named
    fresh = AgentSession.objects.get(pk=live.pk)
    assert store_for(fresh).read(fresh) == TURNS
    assert transcripts.session_entries(live.cli_session_id, committed=fresh.cli_transcript_sizes) == {
        "": [{"type": "user", "n": 1}],
        "subagents/agent-1": [{"type": "user", "n": 2}],
    }


def test_only_the_stores_files_are_touched_and_no_link_is_followed(
    persistent_agent, other_agent, paperclip_home, tmp_path
):
    """Old files no row names, but not the stores': elsewhere in PAPERCLIP_HOME, with names
    the stores never write, in a folder that is not an agent's, or behind a symbolic link
    (to a folder or a file outside, in place of an agent's folder, a CLI session's, a remote
    session's, or a file). None is removed, and nothing outside is reached."""
    outside = tmp_path / "outside"
    outside.mkdir()
    stray = f"sess_{uuid.uuid4().hex}.json"
    (outside / stray).write_text("{}")
    (outside / "file_1").write_text("x")
    agent = paperclip_home / "sessions" / str(persistent_agent.id)
    folders_make(agent / "cli" / "p")
    (paperclip_home / "notes.txt").write_text("x")
    folders_make(paperclip_home / "cli" / str(persistent_agent.id))
    (paperclip_home / "cli" / str(persistent_agent.id) / "main.jsonl").write_text("x")
    (agent / "notes.txt").write_text("x")
    (agent / f"sess_{uuid.uuid4().hex}.json.bak").write_text("x")
    folders_make(paperclip_home / "sessions" / "not-an-agent")
    (paperclip_home / "sessions" / "not-an-agent" / stray).write_text("x")
    (paperclip_home / "sessions" / str(other_agent.id)).symlink_to(outside)
    (agent / stray).symlink_to(outside / stray)
    (agent / "cli" / "p" / "linked").symlink_to(outside)
    folders_make(paperclip_home / "outputs" / str(persistent_agent.id))
    (paperclip_home / "outputs" / str(persistent_agent.id) / "sesn_1").symlink_to(outside)
    everything = {path for path in paperclip_home.rglob("*") if path.is_file() or path.is_symlink()}
    everything |= set(outside.iterdir())

    assert orphan_files_remove(now=later(days=365)) == 0

    assert everything == {path for path in paperclip_home.rglob("*") if path.is_file() or path.is_symlink()} | set(
        outside.iterdir()
    )


def test_the_folders_of_an_agent_this_database_has_no_row_for_are_left_alone(persistent_agent, paperclip_home):
    """An agent removed entirely (the admin's delete) whose worker died before removing its
    files: the database has no row for it any more, so its folders are left alone, however
    old, as those of another deployment sharing PAPERCLIP_HOME would be, or every agent's
    if DATABASE_URL named the wrong database (where no row names anything)."""
    session_with_files(persistent_agent)
    output_copy(persistent_agent)
    left = files(paperclip_home)
    agents_hard_delete(agents=Agent.objects.filter(pk=persistent_agent.pk), now=timezone.now())
    assert len(left) == 5 and not Agent.objects.exists()

    assert orphan_files_remove(now=later(days=365)) == 0

    assert files(paperclip_home) == left


def listed_then(monkeypatch, action) -> list:
    """Run `action` on a connection of its own (another worker) once the pass has listed
    the files and before it asks which ones rows name: the worst moment for a COMMIT that
    names one. Returns what was listed."""
    real = orphan_files._old_files
    listed: list = []

    def listing(*args, **kwargs):
        listed.extend(real(*args, **kwargs))
        second = Actor(action)
        second.start()
        second.result()
        yield from listed

    monkeypatch.setattr(orphan_files, "_old_files", listing)
    return listed


def history_named_late(agent):
    """A version staged and flushed, whose COMMIT comes past the grace."""
    session = session_with_files(agent)
    staged = store_for(session).stage(AgentSession.objects.get(pk=session.pk), TURNS + TURNS[:2])

    def commit():
        AgentSession.objects.filter(pk=session.pk).update(history_version=staged.version, message_count=6)

    def check():
        fresh = AgentSession.objects.get(pk=session.pk)
        assert store_for(fresh).read(fresh) == TURNS + TURNS[:2]

    return staged.path, commit, check


def transcript_named_late(agent):
    """A Claude Code session's files, whose row names them only now."""
    session = session_with_files(agent)
    transcripts = FileTranscripts(agent.id)
    transcripts.append_now({"project_key": "p", "session_id": "late"}, [{"type": "user"}])
    path = transcripts.root / "p" / "late" / "main.jsonl"

    def commit():
        sizes = {"p/late/main.jsonl": path.stat().st_size}
        AgentSession.objects.filter(pk=session.pk).update(cli_session_id="late", cli_transcript_sizes=sizes)

    def check():
        assert transcripts.session_entries("late", committed={"p/late/main.jsonl": path.stat().st_size})

    return path, commit, check


def output_named_late(agent):
    """A copy renamed into place, whose row is inserted only now."""
    output = output_copy(agent, row=False)

    def commit():
        output.save()

    def check():
        assert output_path(ManagedOutput.objects.get()).read_bytes() == b"abc"

    return output_path(output), commit, check


def output_copied_again(agent):
    """A copy left by a worker that died before its row: a retry renames its own copy over
    it, and inserts its row after the pass has looked for one."""
    output = output_copy(agent, row=False)
    path = output_path(output)

    def commit():
        fresh = path.with_name(".retry.partial")
        fresh.write_bytes(b"abc")
        os.replace(fresh, path)

    def check():
        output.save()
        assert path.read_bytes() == b"abc"

    return path, commit, check


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "written",
    [history_named_late, transcript_named_late, output_named_late, output_copied_again],
    ids=lambda f: f.__name__,
)
def test_a_file_named_or_written_again_between_the_listing_and_the_check_is_kept(
    persistent_agent, paperclip_home, monkeypatch, written
):
    """The file is old and no row names it when the pass lists it; then another worker's
    COMMIT names it (or a retry writes it again, to name it once the pass has looked). The
    pass reads the rows after listing, and looks at the file once more before removing it:
    the file stays, and the row that names it finds it whole."""
    path, commit, check = written(persistent_agent)
    listed = listed_then(monkeypatch, commit)

    orphan_files_remove(now=later())

    assert path in {found.path for found in listed}
    assert path.exists()
    check()


def test_the_maintenance_pass_sweeps_once_every_interval_and_a_mark_from_the_future_holds_nothing_back(
    persistent_agent, paperclip_home
):
    """The pass runs every minute; the sweep, which stats every file the stores keep, runs
    once every SWEEP_EVERY in this home. A mark written by a host whose clock ran ahead, or
    one no pass wrote, does not hold it back."""
    first = later()
    assert maintenance_pass(now=first)["orphan_files"] == 0
    orphan = output_copy(persistent_agent, row=False)
    old = (timezone.now() - grace() - timedelta(hours=1)).timestamp()
    os.utime(output_path(orphan), (old, old))

    assert maintenance_pass(now=first + timedelta(minutes=1))["orphan_files"] == 0
    assert maintenance_pass(now=first + orphan_files.SWEEP_EVERY - timedelta(seconds=1))["orphan_files"] == 0
    assert output_path(orphan).exists()
    assert maintenance_pass(now=first + orphan_files.SWEEP_EVERY)["orphan_files"] == 1
    assert not output_path(orphan).exists()

    mark = paperclip_home / orphan_files.SWEPT_MARK
    for written in ((first + timedelta(days=1)).isoformat(), "2026-01-01T00:00:00", "not a time"):
        mark.write_text(written, encoding="utf-8")
        orphan = output_copy(persistent_agent, file_id=f"file_{len(written)}", row=False)
        os.utime(output_path(orphan), (old, old))
        assert maintenance_pass(now=first + orphan_files.SWEEP_EVERY * 2)["orphan_files"] == 1, written
