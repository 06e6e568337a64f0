"""History stores: where a session's turns live.

Two interchangeable backends behind one small interface (`HistoryBackend`), chosen per
session when it is created (`agent_sessions.store`), so changing PAPERCLIP_SESSION_STORE
later never strands existing sessions:
- `database`: the `agent_sessions.history` column (jsonb on PostgreSQL);
- `file`: `PAPERCLIP_HOME/sessions/{agent_id}/{sess_id}.json`.

Every writer follows the same three steps, so that the file and the row never disagree
for good whichever of the two systems fails:
1. `stage()` writes the new history where no reader looks yet (flushed to disk) and sets
   the row fields that name it (`StagedHistory.fields`);
2. the caller saves the row and COMMITs;
3. after the COMMIT, `publish()` puts the history in place, under the row's lock and
   only while the row still names its version (a late rename never lands on a newer
   version or a deleted session); after a failed transaction, `discard()` drops it.
A crash or a failing rename after the COMMIT leaves the row naming a version only the
staged file holds: the next read publishes it. A failed COMMIT leaves the old file.

A missing or unreadable file is an error for that session, never an empty history: an
agent resumed with no memory would silently redo (and re-bill) its work.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError, connection, models, transaction
from django.db.models import F, Func, Value

from sessions_app.adapters.base import HistoryMessage
from sessions_app.durable import folders_make, fsync_directory
from sessions_app.errors import HistoryUnavailable
from sessions_app.history_json import history_dumps, history_loads
from sessions_app.models import AgentSession, HistoryStore

logger = logging.getLogger(__name__)

FILE_FORMAT_VERSION = 1


class JSONAppend(Func):
    """PostgreSQL `jsonb || jsonb`: the array with the new elements at its end."""

    template = "(%(expressions)s)"
    arg_joiner = " || "
    output_field = models.JSONField()


class StagedHistory:
    """A new history that is written but not yet the one readers see.

    `fields` are the row fields `stage()` set; the caller saves them in its transaction.
    `publish()` runs after the COMMIT and never raises (a failure is left for the next
    read to repair); `discard()` runs after a failed transaction.
    """

    fields: tuple[str, ...] = ()
    # The turns the row's own statement appends to its history (`history || new`), when
    # the store writes them so; the row's field then holds that expression.
    appended: list | None = None

    def publish(self) -> None:
        pass

    def discard(self) -> None:
        pass


NOTHING_STAGED = StagedHistory()


class HistoryBackend:
    """What every history store implements, as `SessionBase` is for the backends of
    `django.contrib.sessions`. Stores are stateless: what one stages belongs to the
    `StagedHistory` it returns; on the session it sets only the row fields that name the
    staged history (`StagedHistory.fields`), which the caller saves in its transaction.
    """

    name: str

    def read(self, session: AgentSession) -> list[HistoryMessage]:
        """The session's history; `HistoryUnavailable` when it cannot be read."""
        raise NotImplementedError

    def stage(self, session: AgentSession, history: list[HistoryMessage]) -> StagedHistory:
        """Step 1 of a write: `history` becomes the session's once the caller's COMMIT
        names it and `publish()` has run; `HistoryUnavailable` when it cannot be written."""
        raise NotImplementedError

    def stage_append(
        self, session: AgentSession, history: list[HistoryMessage], new: list[HistoryMessage]
    ) -> StagedHistory:
        """Stage `new` at the end of `history` (what `read` returned). A store that can
        append without rewriting the history overrides this."""
        return self.stage(session, history + new)

    def delete(self, session: AgentSession) -> None:
        """Remove the history kept outside the row (the row itself is the caller's)."""
        raise NotImplementedError


class InRow(StagedHistory):
    """The database store's history travels with the row: the COMMIT is the publication."""

    fields = ("history",)

    def __init__(self, *, appended: list | None = None) -> None:
        self.appended = appended


class DatabaseStore(HistoryBackend):
    name = HistoryStore.DATABASE

    def read(self, session: AgentSession) -> list[HistoryMessage]:
        history = session.history
        if not isinstance(history, list):
            raise HistoryUnavailable("history_corrupt", f"Session {session.public_id} history is not a list.")
        return history

    def stage(self, session: AgentSession, history: list[HistoryMessage]) -> StagedHistory:
        session.history = history
        return InRow()

    def stage_append(
        self, session: AgentSession, history: list[HistoryMessage], new: list[HistoryMessage]
    ) -> StagedHistory:
        """Stage `new` at the end of the history. On PostgreSQL only the new turns travel
        (`history || new`): rewriting a long history from Python on every heartbeat would
        make each turn cost as much as the whole session."""
        if connection.vendor == "postgresql":
            session.history = JSONAppend(F("history"), Value(new, output_field=models.JSONField()))
            return InRow(appended=new)
        session.history = history + new
        return InRow()

    def delete(self, session: AgentSession) -> None:
        pass  # the row (or its cleared column) is the history


class StagedFile(StagedHistory):
    """A history file written beside the session's file under the name of its version."""

    fields = ("history_version",)

    def __init__(self, *, session: AgentSession, version: str, path: Path, target: Path, replaced: Path | None):
        self.session_id = session.pk
        self.public_id = session.public_id
        self.version = version
        self.path = path
        self.target = target
        self.replaced = replaced

    def publish(self) -> None:
        """Rename the staged version into place, only while the row still names it. The
        check and the rename happen under the row's lock, which every writer's COMMIT of
        a newer version (or a deletion) needs: a late publication never replaces a newer
        version, and never gives a deleted session a file. A version the row no longer
        names is superseded for good (versions are never reused), so its file goes."""
        try:
            with transaction.atomic():
                current = AgentSession.objects.select_for_update().filter(
                    pk=self.session_id, history_version=self.version
                )
                if current.exists():
                    os.replace(self.path, self.target)
                    published = True
                else:
                    published = False
        except FileNotFoundError:
            return  # a reader published it first (or the session's files were deleted meanwhile)
        except (OSError, DatabaseError) as exc:
            # The row is committed and names this version; the staged file stays, and the
            # next read puts it in place.
            logger.warning("History of session %s stays staged until its next read: %s", self.public_id, exc)
            return
        if not published:
            _unlink_quietly(self.path)
            return
        try:
            # The rename is durable only once the directory entry is on disk; if it is lost
            # in a crash, the staged file is back and the next read publishes it again.
            fsync_directory(self.target.parent)
        except OSError as exc:
            logger.warning("History of session %s was published but not flushed: %s", self.public_id, exc)
        if self.replaced is not None:
            # The previous version's staged file, left by a publication that failed: the row
            # no longer names it, so no read needs it.
            _unlink_quietly(self.replaced)

    def discard(self) -> None:
        """After a failed transaction. A COMMIT that lost its connection may still have
        committed on the server: the file goes only once the row provably does not name it."""
        try:
            committed = AgentSession.objects.filter(pk=self.session_id, history_version=self.version).exists()
        except DatabaseError:
            logger.warning("History of session %s stays staged: its commit's outcome is unknown", self.public_id)
            return
        if committed:
            self.publish()
        else:
            _unlink_quietly(self.path)


class FileStore(HistoryBackend):
    name = HistoryStore.FILE

    def path_for(self, session: AgentSession) -> Path:
        return Path(settings.PAPERCLIP_HOME) / "sessions" / str(session.agent_id) / f"{session.public_id}.json"

    def staged_path(self, session: AgentSession, version: str) -> Path:
        return self.path_for(session).with_name(f".{session.public_id}.{version}.staged")

    def read(self, session: AgentSession) -> list[HistoryMessage]:
        if session.history_purged_at is not None:
            return []
        path = self.path_for(session)
        current = self._load(session, path)
        if current is not None and _names_row(current, session):
            return current["messages"]
        repaired = self._repair(session, current)
        if repaired is not None:
            return repaired
        if current is None:
            if session.message_count == 0:
                return []  # a new session whose first turn has not been written yet
            raise HistoryUnavailable(
                "history_missing", f"History file of session {session.public_id} is missing ({path})."
            )
        raise HistoryUnavailable(
            "history_mismatch",
            f"History file of session {session.public_id} holds {len(current['messages'])} messages "
            f"(version {current.get('history_version') or 'none'}); the database expects "
            f"{session.message_count} (version {session.history_version or 'none'}).",
        )

    def stage(self, session: AgentSession, history: list[HistoryMessage]) -> StagedHistory:
        """Write the new history beside the real file, flushed to disk, under a new version."""
        version = uuid.uuid4().hex
        path = self.staged_path(session, version)
        try:
            folders_make(path.parent)
            _write_durably(path, _document(session, version, history))
        except OSError as exc:
            _unlink_quietly(path)
            raise HistoryUnavailable(
                "history_unwritable", f"History of session {session.public_id} cannot be written: {exc.strerror}."
            ) from None
        except BaseException:
            _unlink_quietly(path)  # half written: no row will ever name it
            raise
        replaced = self.staged_path(session, session.history_version) if session.history_version else None
        session.history_version = version
        return StagedFile(session=session, version=version, path=path, target=self.path_for(session), replaced=replaced)

    def delete(self, session: AgentSession) -> None:
        path = self.path_for(session)
        path.unlink(missing_ok=True)
        # Versions staged by writes that failed or crashed (and temporary files of old versions).
        for leftover in path.parent.glob(f".{session.public_id}.*"):
            leftover.unlink(missing_ok=True)

    def _load(self, session: AgentSession, path: Path) -> dict | None:
        """The document in `path`, or None when there is no such file."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HistoryUnavailable(
                "history_unreadable", f"History file of session {session.public_id} cannot be read: {exc.strerror}."
            ) from None
        try:
            document = history_loads(raw)
        except ValueError as exc:
            raise self._corrupt(session, f"it is not JSON: {exc}") from None
        if not isinstance(document, dict) or not isinstance(document.get("messages"), list):
            raise self._corrupt(session, 'it holds no "messages" list')
        return document

    @staticmethod
    def _corrupt(session: AgentSession, problem: str) -> HistoryUnavailable:
        return HistoryUnavailable(
            "history_corrupt", f"History file of session {session.public_id} is corrupt: {problem}."
        )

    def _repair(self, session: AgentSession, current: dict | None) -> list[HistoryMessage] | None:
        """The history the row names when the file does not hold it, put back in place;
        None when nothing on disk provably is that history."""
        if not session.history_version:
            return self._drop_uncommitted_turn(session, current)
        staged = StagedFile(
            session=session,
            version=session.history_version,
            path=self.staged_path(session, session.history_version),
            target=self.path_for(session),
            replaced=None,
        )
        document = self._load(session, staged.path)
        if document is not None and _names_row(document, session):
            # Committed but never published (a crash or a failed rename after the COMMIT).
            # `publish` renames it only while the row still names it: a newer version
            # published meanwhile is never replaced.
            staged.publish()
            return document["messages"]
        # Its writer may have published it since the file was first read.
        document = self._load(session, staged.target)
        return document["messages"] if document is not None and _names_row(document, session) else None

    def _drop_uncommitted_turn(self, session: AgentSession, current: dict | None) -> list[HistoryMessage] | None:
        """A file ahead of its row by one turn, as versions before `history_version` left it
        when a heartbeat's COMMIT failed after the rename. The turn's sequence numbers are the
        ones the row still has to give out, so the row never committed it: the file's
        previous version, the row's, is the history without it."""
        if current is None or "history_version" in current:
            return None
        messages = current["messages"]
        extra = messages[session.message_count :]
        seqs = [m.get("seq") if isinstance(m, dict) else None for m in extra]
        if seqs != [session.next_seq, session.next_seq + 1]:
            return None
        kept = messages[: session.message_count]
        path = self.path_for(session)
        temporary = path.with_name(f".{session.public_id}.{uuid.uuid4().hex}.repair")
        try:
            with transaction.atomic():  # as in _repair: never over a version written meanwhile
                if _row_unchanged(session, "history_version", "message_count", "next_seq"):
                    _write_durably(temporary, {**current, "messages": kept})
                    _replace_durably(temporary, path)
                    logger.warning(
                        "History file of session %s was ahead of its row by an uncommitted turn", session.public_id
                    )
        except OSError as exc:
            _unlink_quietly(temporary)
            logger.warning("History file of session %s could not be cut back to its row: %s", session.public_id, exc)
        return kept


def _document(session: AgentSession, version: str, history: list[HistoryMessage]) -> dict:
    return {
        "version": FILE_FORMAT_VERSION,
        "session_id": session.public_id,
        "agent_id": str(session.agent_id),
        "history_version": version,
        "messages": history,
    }


def _row_unchanged(session: AgentSession, *fields: str) -> bool:
    """Lock the session's row and say whether `fields` still hold what `session` read."""
    values = {name: getattr(session, name) for name in fields}
    return AgentSession.objects.select_for_update().filter(pk=session.pk, **values).exists()


def _names_row(document: dict, session: AgentSession) -> bool:
    return (
        document.get("history_version", "") == session.history_version
        and len(document["messages"]) == session.message_count
    )


def _write_durably(path: Path, document: dict) -> None:
    """Create `path` (never over another file) with the document, flushed to disk with its
    directory entry: once the COMMIT names it, a crash cannot take it away."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(history_dumps(document))
        handle.flush()
        os.fsync(handle.fileno())
    fsync_directory(path.parent)


def _replace_durably(source: Path, target: Path) -> None:
    os.replace(source, target)
    # The rename is durable only once the directory entry is on disk.
    fsync_directory(target.parent)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("Could not remove %s: %s", path, exc)


STORES: dict[str, HistoryBackend] = {HistoryStore.DATABASE: DatabaseStore(), HistoryStore.FILE: FileStore()}


def store_for(session: AgentSession) -> HistoryBackend:
    return STORES[HistoryStore(session.store)]


def configured_store_name() -> str:
    return settings.PAPERCLIP_SESSION_STORE
