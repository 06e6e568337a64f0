"""The files a Managed Agents session produced, copied here before the session is ended.

The session's outputs are Files scoped to it at the provider (`files.list(scope_id=...)`),
and they go with the session: so each recorded end (`managed_sessions.managed_end_carry_out`)
first copies them, and archives or deletes the remote session only once every file is here
or recorded as skipped. A failure to copy leaves the end pending, retried with the end.

Each file is written under `PAPERCLIP_HOME/outputs/{agent_id}/{remote_session_id}/` to a
temporary name of its own, flushed to disk and renamed (the rename flushed too) before its row
is written: a row always has its file; a file left without a row (a crash between the two) is overwritten by the retry,
which also removes the temporary files of copies its claim outlived. The
row is written under the agent's row lock, so an agent deleted during the download (its
outputs' rows and folder gone) gets no row and its copy is removed. A
file over `PAPERCLIP_MANAGED_OUTPUT_MAX_BYTES`, or past the session's
`PAPERCLIP_MANAGED_OUTPUT_MAX_SESSION_BYTES`, gets a row saying so and no copy. A copy an
operator deletes leaves a tombstone (`DeletedManagedOutput`): the file is still at the
provider while its session lives, and a later extraction (or a late one whose claim ran out)
must not bring it back.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.db import transaction

from sessions_app.adapters.claude_managed import remote_file_chunks, remote_session_files
from sessions_app.durable import file_name, folders_make, fsync_directory
from sessions_app.models import Agent, DeletedManagedOutput, ManagedOutput, ManagedSessionEnd

logger = logging.getLogger(__name__)


class OutputTooLarge(Exception):
    """A file turned out larger than the limit as it arrived."""


def outputs_root() -> Path:
    return Path(settings.PAPERCLIP_HOME) / "outputs"


def output_path(output: ManagedOutput) -> Path:
    return outputs_root() / str(output.agent_id) / file_name(output.remote_session_id) / file_name(output.file_id)


def outputs_extract(end: ManagedSessionEnd) -> int:
    """Copy the files of the ended remote session that are not copied yet; returns how many
    rows it wrote. Raises OutputsUnavailable when the provider fails to list or serve one."""
    if end.agent_id is None or Agent.is_gone(end.agent_id):
        return 0  # its deletion took its outputs: nothing is kept for it
    files = remote_session_files(end.remote_session_id)
    known = _known_file_ids(end.remote_session_id)
    total = sum(
        ManagedOutput.objects.filter(remote_session_id=end.remote_session_id, skipped="").values_list(
            "size_bytes", flat=True
        )
    )
    written = 0
    for remote in files:
        if remote.id in known:
            continue
        output = ManagedOutput(
            company_id=end.company_id,
            agent_id=end.agent_id,
            session_id=end.session_id,
            remote_session_id=end.remote_session_id,
            file_id=remote.id,
            filename=safe_filename(remote.filename, fallback=remote.id),
            media_type=(remote.mime_type or "").replace("\x00", "")[:255],
            size_bytes=remote.size_bytes,
        )
        output.skipped = _limit_refusal(remote.size_bytes, total)
        if not output.skipped:
            try:
                output.sha256, output.size_bytes = _copy(output, limit=min(_largest(), _session_largest() - total))
            except OutputTooLarge as refusal:
                output.skipped = str(refusal)
            except OSError:
                if not Agent.is_gone(end.agent_id):
                    raise
                # Its deletion removed the folder under the download: nothing to keep.
                _copy_remove(output)
                return written
            else:
                total += output.size_bytes
        if not _output_insert(output):
            _copy_remove(output)
            return written
        written += 1
    return written


def _known_file_ids(remote_session_id: str) -> set[str]:
    """The files copied (or skipped) and the copies an operator deleted since. One statement,
    so one snapshot: a deletion committing meanwhile is seen either as its row or as its
    tombstone, never as neither."""
    copied = ManagedOutput.objects.filter(remote_session_id=remote_session_id).order_by().values_list("file_id")
    deleted = DeletedManagedOutput.objects.filter(remote_session_id=remote_session_id).order_by().values_list("file_id")
    return {file_id for (file_id,) in copied.union(deleted)}


def _output_insert(output: ManagedOutput) -> bool:
    """Insert the copied file's row, unless its agent was deleted during the download: under
    the agent's row lock, which a deletion takes first, so the deletion either committed
    before (False: the caller removes the copy its folder's removal missed) or waits and
    removes this row and file with the agent's others.

    A worker whose claim on the end ran out may copy a file the next worker copied and an
    operator deleted since: its tombstone, read after the insert (which waits for such a
    deletion still committing), undoes the insert and the copy. True in both cases."""
    with transaction.atomic():
        if Agent.is_gone(output.agent_id, lock=True):
            return False
        ManagedOutput.objects.bulk_create([output], ignore_conflicts=True)
        deleted = DeletedManagedOutput.objects.filter(
            remote_session_id=output.remote_session_id, file_id=output.file_id
        ).exists()
        if deleted:
            transaction.set_rollback(True)
    if deleted:
        output_path(output).unlink(missing_ok=True)
    return True


def _copy_remove(output: ManagedOutput) -> None:
    """The copy of a deleted agent's output, and the folders the copy made again."""
    path = output_path(output)
    try:
        path.unlink(missing_ok=True)
        for partial in _partials(path):
            partial.unlink(missing_ok=True)
        for folder in (path.parent, path.parent.parent):
            folder.rmdir()
    except OSError:
        pass  # a folder holding other copies, or gone already


def safe_filename(name: str, *, fallback: str) -> str:
    """The name a download is offered under: no directories, no NUL (PostgreSQL refuses it)."""
    name = PurePosixPath(name.replace("\\", "/").replace("\x00", "")).name.strip()
    return name[-255:] if name not in ("", ".", "..") else fallback


def _largest() -> int:
    return settings.PAPERCLIP_MANAGED_OUTPUT_MAX_BYTES


def _session_largest() -> int:
    return settings.PAPERCLIP_MANAGED_OUTPUT_MAX_SESSION_BYTES


def _limit_refusal(size: int, total_so_far: int) -> str:
    if size > _largest():
        return f"larger than PAPERCLIP_MANAGED_OUTPUT_MAX_BYTES ({size} > {_largest()} bytes)"
    if total_so_far + size > _session_largest():
        return f"past the session's PAPERCLIP_MANAGED_OUTPUT_MAX_SESSION_BYTES ({_session_largest()} bytes)"
    return ""


def _copy(output: ManagedOutput, *, limit: int) -> tuple[str, int]:
    """Download the file to its place; its digest and size as received (a file that grows
    past `limit` as it arrives, whatever its listing said, is refused)."""
    target = output_path(output)
    folders_make(target.parent)
    # A worker whose claim on the end ran out may still be copying this file: sharing one
    # temporary file, its copy and this one could leave a hole in the file renamed into
    # place. Each copy has its own; the others' are those of workers that lost the claim
    # (or died), whose rename then fails, as their claim's writes do.
    for stale in _partials(target):
        stale.unlink(missing_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
    digest, size = hashlib.sha256(), 0
    try:
        with partial.open("wb") as handle:
            for chunk in remote_file_chunks(output.file_id):
                size += len(chunk)
                if size > limit:
                    raise OutputTooLarge(f"larger than its size limit as it arrived (over {limit} bytes)")
                handle.write(chunk)
                digest.update(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, target)
        fsync_directory(target.parent)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return digest.hexdigest(), size


def _partials(target: Path) -> list[Path]:
    """The temporary files of copies of `target` under way, or left by a killed worker."""
    return list(target.parent.glob(f".{glob.escape(target.name)}.*.partial"))


def outputs_delete(*, agent_ids: Iterable) -> int:
    """Delete the outputs of these agents (being deleted in the caller's transaction): the
    rows now, the files once the transaction commits (a rollback keeps both)."""
    agent_ids = list(agent_ids)
    count, _ = ManagedOutput.objects.filter(agent_id__in=agent_ids).delete()
    DeletedManagedOutput.objects.filter(agent_id__in=agent_ids).delete()  # no extraction serves them any more
    transaction.on_commit(lambda: _folders_remove(agent_ids))
    return count


def output_delete(output: ManagedOutput) -> None:
    """One output, its row and then (after the commit) its file, with a tombstone that keeps
    a later extraction of its remote session from copying it back."""
    path = output_path(output)
    with transaction.atomic():
        if ManagedOutput.objects.filter(pk=output.pk).delete()[0]:
            DeletedManagedOutput.objects.bulk_create(
                [
                    DeletedManagedOutput(
                        agent_id=output.agent_id, remote_session_id=output.remote_session_id, file_id=output.file_id
                    )
                ],
                ignore_conflicts=True,
            )
        transaction.on_commit(lambda: path.unlink(missing_ok=True))


def _folders_remove(agent_ids: list) -> None:
    for agent_id in agent_ids:
        folder = outputs_root() / str(agent_id)
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            pass
        except OSError:
            # No row names these files any more: they are unreachable, only disk.
            logger.exception("Could not remove the Managed Agents outputs under %s", folder)
