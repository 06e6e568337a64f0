"""The files a Managed Agents session produced, copied here before the remote session is
archived or deleted, through the real SDK against the fake (whose Files API keeps them
scoped to the session)."""

from __future__ import annotations

import hashlib
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from sessions_app.managed_outputs import output_delete, output_path, outputs_extract, outputs_root
from sessions_app.managed_sessions import managed_ends_process
from sessions_app.models import Agent, DeletedManagedOutput, ManagedOutput, ManagedSessionEnd, RunStatus
from sessions_app.services import agent_delete, agents_hard_delete, session_delete, session_expire
from tests.api.conftest import make_session
from tests.conftest import beat, managed_agent, on_own_connection, run_queued_tasks
from tests.test_managed_sessions import remote_session

pytestmark = pytest.mark.django_db(transaction=True)

REPORT = b"region,total\nnorth,12\nsouth,30\n"


def managed_session(company, fake_managed):
    """A Managed Agents agent, a remote session at the fake and the session row naming it."""
    agent = managed_agent(company)
    remote_id = remote_session(fake_managed)
    return agent, remote_id, make_session(agent, managed_session_id=remote_id)


def archived_then_deleted_output(company, fake_managed):
    """An agent whose session was archived with one file copied, that copy deleted since."""
    agent, remote_id, session = managed_session(company, fake_managed)
    fake_managed.add_file(remote_id, "notes.txt", b"notes", "text/plain")
    session_expire(session=session, now=timezone.now())
    run_queued_tasks()
    output = ManagedOutput.objects.get(agent=agent)
    output_delete(output)
    return agent, remote_id, session, output


def deleted_with_a_failing_download(company, fake_managed, *, failing: str, other: str):
    """An agent's session deleted while the provider fails to serve one of its two files
    (`failing`, then `other`): the end waits for its retry."""
    agent, remote_id, session = managed_session(company, fake_managed)
    produced = fake_managed.add_file(remote_id, failing, failing[:4].encode(), "text/plain")
    fake_managed.add_file(remote_id, other, other[:4].encode(), "text/plain")
    fake_managed.fail_next(500, times=10, path_prefix=f"/v1/files/{produced['id']}/content")
    session_delete(session=session, now=timezone.now())
    run_queued_tasks()
    return agent, remote_id


def requested(fake_managed, method: str, path: str) -> int:
    """Where in the fake's request log a request was made (it must have been)."""
    return fake_managed.requests.index((method, path))


def test_a_deleted_sessions_files_are_copied_before_the_remote_session_is_deleted(company, fake_managed):
    agent, remote_id, session = managed_session(company, fake_managed)
    produced = fake_managed.add_file(remote_id, "report.csv", REPORT, "text/csv")

    session_delete(session=session, now=timezone.now())
    run_queued_tasks()

    (output,) = ManagedOutput.objects.filter(agent=agent)
    assert (output.filename, output.media_type, output.size_bytes) == ("report.csv", "text/csv", len(REPORT))
    assert (output.session_id, output.remote_session_id, output.file_id) == (session.pk, remote_id, produced["id"])
    assert output.sha256 == hashlib.sha256(REPORT).hexdigest()
    assert output_path(output).read_bytes() == REPORT
    assert remote_id not in fake_managed.sessions  # deleted at the provider...
    content = requested(fake_managed, "GET", f"/v1/files/{produced['id']}/content")
    assert content < requested(fake_managed, "DELETE", f"/v1/sessions/{remote_id}")  # ...after the copy


def test_a_session_expired_by_its_ttl_has_its_files_copied_before_it_is_archived(company, fake_managed):
    agent, remote_id, session = managed_session(company, fake_managed)
    produced = [fake_managed.add_file(remote_id, f"part-{n}.txt", b"x" * n, "text/plain") for n in (1, 2, 3)]

    session_expire(session=session, now=timezone.now())
    run_queued_tasks()

    assert fake_managed.sessions[remote_id]["archived_at"] is not None
    outputs = ManagedOutput.objects.filter(session_id=session.pk)
    assert sorted(outputs.values_list("filename", "size_bytes")) == [
        ("part-1.txt", 1),
        ("part-2.txt", 2),
        ("part-3.txt", 3),
    ]
    last_copy = max(requested(fake_managed, "GET", f"/v1/files/{f['id']}/content") for f in produced)
    assert last_copy < requested(fake_managed, "POST", f"/v1/sessions/{remote_id}/archive")


def test_a_stateless_runs_files_are_copied_when_its_session_ends_with_it(company, fake_managed):
    agent = managed_agent(company, session_mode="stateless")
    fake_managed.script(None, [("file", "summary.md", b"# Done\n"), ("message", "written")])

    run = beat(agent, "write the summary")
    run_queued_tasks()

    assert run.status == RunStatus.SUCCEEDED, run.error
    (output,) = ManagedOutput.objects.filter(agent=agent)
    assert (output.filename, output.session_id, output.remote_session_id) == (
        "summary.md",
        None,
        run.managed_session_id,
    )
    assert output_path(output).read_bytes() == b"# Done\n"
    assert fake_managed.sessions[run.managed_session_id]["archived_at"] is not None


def test_a_file_over_a_limit_is_listed_as_skipped_and_never_silently_dropped(company, fake_managed, settings):
    settings.PAPERCLIP_MANAGED_OUTPUT_MAX_BYTES = 10
    settings.PAPERCLIP_MANAGED_OUTPUT_MAX_SESSION_BYTES = 15
    agent, remote_id, session = managed_session(company, fake_managed)
    for name, size in (("big.bin", 11), ("first.txt", 9), ("second.txt", 9)):
        fake_managed.add_file(remote_id, name, b"z" * size, "application/octet-stream")

    session_expire(session=session, now=timezone.now())
    run_queued_tasks()

    outputs = {output.filename: output for output in ManagedOutput.objects.filter(agent=agent)}
    assert set(outputs) == {"big.bin", "first.txt", "second.txt"}
    assert "PAPERCLIP_MANAGED_OUTPUT_MAX_BYTES" in outputs["big.bin"].skipped
    assert not output_path(outputs["big.bin"]).exists()
    copied = [o for o in outputs.values() if o.stored]
    skipped_for_session = [o for o in outputs.values() if "MAX_SESSION_BYTES" in o.skipped]
    assert len(copied) == len(skipped_for_session) == 1  # 9 bytes fit the session's 15, 18 would not
    assert output_path(copied[0]).read_bytes() == b"z" * 9
    assert fake_managed.sessions[remote_id]["archived_at"] is not None


def test_a_failed_download_ends_nothing_and_the_retry_copies_each_file_once(company, fake_managed):
    _, remote_id = deleted_with_a_failing_download(company, fake_managed, failing="kept.txt", other="late.txt")

    end = ManagedSessionEnd.objects.get(remote_session_id=remote_id)
    assert end.done_at is None and end.attempts == 1
    assert "Could not download file" in end.last_error
    assert remote_id in fake_managed.sessions  # not deleted: its files would have gone with it
    assert ("DELETE", f"/v1/sessions/{remote_id}") not in fake_managed.requests
    copied_before = set(ManagedOutput.objects.values_list("filename", flat=True))

    fake_managed.recover()
    assert managed_ends_process(now=timezone.now() + timedelta(hours=2)) == 1

    assert remote_id not in fake_managed.sessions
    assert sorted(ManagedOutput.objects.values_list("filename", flat=True)) == ["kept.txt", "late.txt"]
    assert copied_before <= {"late.txt"}  # what the first attempt copied is not copied again
    assert all(output_path(o).read_bytes() == o.filename[:4].encode() for o in ManagedOutput.objects.all())


def test_a_deleted_agent_takes_its_outputs_and_their_files_with_it(company, fake_managed):
    agent, remote_id, session = managed_session(company, fake_managed)
    fake_managed.add_file(remote_id, "notes.txt", b"notes", "text/plain")
    session_expire(session=session, now=timezone.now())
    run_queued_tasks()
    (output,) = ManagedOutput.objects.filter(agent=agent)
    path = output_path(output)
    assert path.exists()

    agent_delete(agent=agent, now=timezone.now())

    assert not ManagedOutput.objects.filter(agent=agent).exists()
    assert not path.exists()


def test_a_name_from_the_provider_is_only_a_name(company, fake_managed):
    agent, remote_id, session = managed_session(company, fake_managed)
    fake_managed.add_file(remote_id, "../../etc/passwd\x00.txt", b"data", "text/plain")

    session_expire(session=session, now=timezone.now())
    run_queued_tasks()

    (output,) = ManagedOutput.objects.filter(agent=agent)
    assert output.filename == "passwd.txt"
    assert output_path(output).parent.parent.parent.name == "outputs"


def test_a_file_id_from_the_provider_that_is_not_a_plain_id_is_copied_inside_its_sessions_folder(
    company, fake_managed, settings
):
    agent, remote_id, session = managed_session(company, fake_managed)
    produced = fake_managed.add_file(remote_id, "escape.txt", b"escaped", "text/plain")
    odd_id = "../../../escaped"
    fake_managed.files[odd_id] = {**fake_managed.files.pop(produced["id"]), "id": odd_id}
    fake_managed.file_contents[odd_id] = fake_managed.file_contents.pop(produced["id"])

    session_expire(session=session, now=timezone.now())
    run_queued_tasks()

    (output,) = ManagedOutput.objects.filter(agent=agent)
    assert output.file_id == odd_id
    assert output_path(output).parent == outputs_root() / str(agent.pk) / remote_id
    assert output_path(output).read_bytes() == b"escaped"
    assert not any(Path(settings.PAPERCLIP_HOME).rglob("escaped"))
    assert fake_managed.sessions[remote_id]["archived_at"] is not None

    output_delete(output)
    assert not output_path(output).exists()


@pytest.mark.parametrize("remote_session_id", ["..", "../elsewhere", "a/b"])
def test_no_session_id_from_the_provider_names_a_folder_outside_the_agents(company, remote_session_id):
    output = ManagedOutput(agent_id=uuid.uuid4(), remote_session_id=remote_session_id, file_id="..")

    relative = output_path(output).relative_to(outputs_root() / str(output.agent_id))

    assert len(relative.parts) == 2 and ".." not in relative.parts


@pytest.mark.parametrize("deletion", ["retire", "remove"])
def test_an_agent_deleted_while_its_files_are_copied_keeps_no_output_row_or_file(company, fake_managed, deletion):
    agent, remote_id, session = managed_session(company, fake_managed)
    produced = fake_managed.add_file(remote_id, "notes.txt", b"notes", "text/plain")

    def delete_agent():
        if deletion == "retire":
            agent_delete(agent=agent, now=timezone.now())
        else:
            agents_hard_delete(agents=Agent.objects.filter(pk=agent.pk), now=timezone.now())

    # The worst moment: the copy has listed the files and is downloading one when the
    # agent's deletion commits (its own connection), removing its outputs' rows and folder.
    fake_managed.before_next("GET", f"/v1/files/{produced['id']}/content", on_own_connection(delete_agent))
    session_expire(session=session, now=timezone.now())
    run_queued_tasks()

    assert not ManagedOutput.objects.filter(agent_id=agent.pk).exists()
    folder = outputs_root() / str(agent.pk)
    assert not folder.exists() or not any(path.is_file() for path in folder.rglob("*"))
    ends = ManagedSessionEnd.objects.filter(remote_session_id=remote_id)
    assert ends.exists() and not ends.filter(done_at__isnull=True).exists()  # the remote session still ends


@pytest.mark.parametrize("moment", ["before the retry", "as the retry lists the files"])
def test_an_output_deleted_while_its_end_is_retried_is_not_copied_back(company, fake_managed, moment):
    agent, remote_id = deleted_with_a_failing_download(company, fake_managed, failing="failing.txt", other="secret.txt")
    (secret,) = ManagedOutput.objects.filter(agent=agent)  # copied before the other file failed
    path = output_path(secret)

    # An operator deletes the copy while the end waits for its retry, or (its own connection)
    # once the retry has listed the files at the provider and not yet read what is copied.
    if moment == "before the retry":
        output_delete(secret)
    else:
        fake_managed.before_next("GET", "/v1/files", on_own_connection(lambda: output_delete(secret)))
    fake_managed.recover()
    assert managed_ends_process(now=timezone.now() + timedelta(hours=2)) == 1

    assert remote_id not in fake_managed.sessions  # the end completed...
    assert list(ManagedOutput.objects.filter(agent=agent).values_list("filename", flat=True)) == ["failing.txt"]
    assert not path.exists()  # ...without bringing the deleted copy back


def test_an_output_deleted_after_its_sessions_archive_stays_deleted_when_the_session_is_deleted(company, fake_managed):
    agent, remote_id, session, output = archived_then_deleted_output(company, fake_managed)

    session_delete(session=session, now=timezone.now())  # the archived remote session, and its file, go now
    run_queued_tasks()

    assert remote_id not in fake_managed.sessions
    assert not ManagedOutput.objects.filter(agent=agent).exists()
    assert not output_path(output).exists()


def test_an_agents_deletion_takes_the_tombstones_of_its_deleted_outputs(company, fake_managed):
    agent, *_ = archived_then_deleted_output(company, fake_managed)
    assert DeletedManagedOutput.objects.filter(agent=agent).exists()

    agent_delete(agent=agent, now=timezone.now())

    assert not DeletedManagedOutput.objects.filter(agent=agent).exists()


def test_a_copy_its_claim_outlived_neither_mixes_into_the_next_copy_nor_is_left_behind(company, fake_managed):
    agent, remote_id, session = managed_session(company, fake_managed)
    produced = fake_managed.add_file(remote_id, "report.csv", REPORT, "text/csv")
    folder = outputs_root() / str(agent.pk) / remote_id
    folder.mkdir(parents=True)
    killed = folder / f".{produced['id']}.{'1' * 32}.partial"
    killed.write_bytes(REPORT[:5])  # a worker killed mid-download
    # A worker whose claim ran out, still downloading the same file: it writes on while the
    # worker now holding the end copies it.
    with (folder / f".{produced['id']}.{'2' * 32}.partial").open("wb") as outlived:
        outlived.write(REPORT[:10])
        outlived.flush()

        def outlived_writes_on():
            outlived.write(b"garbage" * 1000)
            outlived.flush()

        fake_managed.before_next("GET", f"/v1/files/{produced['id']}/content", outlived_writes_on)
        session_expire(session=session, now=timezone.now())
        run_queued_tasks()

    output = ManagedOutput.objects.get(agent=agent)
    assert output_path(output).read_bytes() == REPORT
    assert output.sha256 == hashlib.sha256(REPORT).hexdigest()
    assert [path.name for path in folder.iterdir()] == [produced["id"]]


def test_a_copy_its_claim_outlived_does_not_bring_back_an_output_deleted_meanwhile(company, fake_managed):
    """A worker whose claim on the end ran out read what was copied before the worker now
    holding the end copied the file; while it downloads, the copy is deleted by an operator
    (own connection). Its late insert finds the tombstone (before: the row and the file
    came back, the deleted copy listed and served again)."""
    agent, remote_id, session = managed_session(company, fake_managed)
    produced = fake_managed.add_file(remote_id, "report.csv", REPORT, "text/csv")
    session_expire(session=session, now=timezone.now())
    end = ManagedSessionEnd.objects.get(remote_session_id=remote_id)
    copied = ManagedOutput(
        company=company,
        agent=agent,
        session_id=end.session_id,
        remote_session_id=remote_id,
        file_id=produced["id"],
        filename="report.csv",
        size_bytes=len(REPORT),
    )

    def copied_by_the_next_worker_then_deleted():
        output_path(copied).write_bytes(REPORT)
        copied.save()
        output_delete(copied)

    fake_managed.before_next(
        "GET", f"/v1/files/{produced['id']}/content", on_own_connection(copied_by_the_next_worker_then_deleted)
    )
    outputs_extract(end)

    assert not ManagedOutput.objects.filter(agent=agent).exists()
    assert not output_path(copied).exists()
    assert [path.name for path in output_path(copied).parent.iterdir()] == []


def test_a_copy_whose_rename_cannot_be_flushed_gets_no_row_and_the_retry_copies_it(company, fake_managed, monkeypatch):
    """The rename into place is on disk only once its folder is flushed: until then a crash
    can take the file back while a committed row names it. A flush that fails (EIO) leaves
    no row and the end pending (before: the folder was never flushed, and the row was
    written), and the retry copies the file."""
    import os
    import stat

    agent, remote_id, session = managed_session(company, fake_managed)
    fake_managed.add_file(remote_id, "report.csv", REPORT, "text/csv")
    flushed_folders = []
    real_fsync = os.fsync

    def folder_flush_fails(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            flushed_folders.append(fd)
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", folder_flush_fails)
    session_expire(session=session, now=timezone.now())
    run_queued_tasks()

    assert flushed_folders, "the folder of the renamed copy was never flushed"
    assert not ManagedOutput.objects.filter(agent=agent).exists()
    assert remote_id in fake_managed.sessions  # not archived: its file is not here yet
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert managed_ends_process(now=timezone.now() + timedelta(hours=2)) == 1
    (output,) = ManagedOutput.objects.filter(agent=agent)
    assert output_path(output).read_bytes() == REPORT


def test_a_copy_whose_new_folder_cannot_be_flushed_gets_no_row(company, fake_managed, monkeypatch, settings):
    """The folders made for a copy (the agent's, the remote session's) are on disk only once
    each is flushed into the one holding it: a flush of `outputs/` that fails (EIO) leaves
    no row (before: it was never flushed, and the row was written)."""
    import os

    agent, remote_id, session = managed_session(company, fake_managed)
    fake_managed.add_file(remote_id, "report.csv", REPORT, "text/csv")
    outputs = outputs_root().resolve()
    outputs.mkdir(parents=True, exist_ok=True)
    real_fsync = os.fsync

    def outputs_flush_fails(fd):
        if Path(os.readlink(f"/proc/self/fd/{fd}")) == outputs:
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", outputs_flush_fails)
    session_expire(session=session, now=timezone.now())
    run_queued_tasks()

    assert not ManagedOutput.objects.filter(agent=agent).exists()
    assert ManagedSessionEnd.objects.get(remote_session_id=remote_id).done_at is None
