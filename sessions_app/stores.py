"""History stores: where a session's turns live.

Two interchangeable backends behind one small interface, chosen per session when it is
created (`agent_sessions.store`), so changing PAPERCLIP_SESSION_STORE later never strands
existing sessions:
- `database`: the `agent_sessions.history` column (jsonb on PostgreSQL);
- `file`: `PAPERCLIP_HOME/sessions/{agent_id}/{sess_id}.json`, replaced atomically.

A missing or unreadable file is an error for that session, never an empty history: an
agent resumed with no memory would silently redo (and re-bill) its work.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from django.conf import settings

from sessions_app.adapters.base import HistoryMessage
from sessions_app.models import AgentSession, HistoryStore

FILE_FORMAT_VERSION = 1


class HistoryUnavailable(Exception):
    """A session's history cannot be read or written. `code` is stored on the failed run."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class DatabaseStore:
    name = HistoryStore.DATABASE

    def read(self, session: AgentSession) -> list[HistoryMessage]:
        history = session.history
        if not isinstance(history, list):
            raise HistoryUnavailable("history_corrupt", f"Session {session.public_id} history is not a list.")
        return history

    def prepare(self, session: AgentSession, history: list[HistoryMessage]) -> None:
        """Stage a new history on the row; the caller saves the row in its transaction."""
        session.history = history

    def commit(self, session: AgentSession) -> None:
        pass

    def discard(self, session: AgentSession) -> None:
        pass

    def delete(self, session: AgentSession) -> None:
        pass  # the row (or its cleared column) is the history


class FileStore:
    name = HistoryStore.FILE

    def path_for(self, session: AgentSession) -> Path:
        return Path(settings.PAPERCLIP_HOME) / "sessions" / str(session.agent_id) / f"{session.public_id}.json"

    def read(self, session: AgentSession) -> list[HistoryMessage]:
        path = self.path_for(session)
        if session.history_purged_at is not None:
            return []
        if session.message_count == 0 and not path.exists():
            return []  # a new session whose first turn has not been written yet
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise HistoryUnavailable(
                "history_missing", f"History file of session {session.public_id} is missing ({path})."
            ) from None
        except OSError as exc:
            raise HistoryUnavailable(
                "history_unreadable", f"History file of session {session.public_id} cannot be read: {exc.strerror}."
            ) from None
        try:
            document = json.loads(raw)
            messages = document["messages"]
            if not isinstance(messages, list):
                raise TypeError("messages is not a list")
        except (ValueError, KeyError, TypeError) as exc:
            raise HistoryUnavailable(
                "history_corrupt", f"History file of session {session.public_id} is corrupt ({exc})."
            ) from None
        if len(messages) != session.message_count:
            raise HistoryUnavailable(
                "history_mismatch",
                f"History file of session {session.public_id} holds {len(messages)} messages; "
                f"the database expects {session.message_count}.",
            )
        return messages

    def prepare(self, session: AgentSession, history: list[HistoryMessage]) -> None:
        """Write the new history to a temporary file beside the real one, flushed to disk."""
        path = self.path_for(session)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(
                    {
                        "version": FILE_FORMAT_VERSION,
                        "session_id": session.public_id,
                        "agent_id": str(session.agent_id),
                        "messages": history,
                    },
                    handle,
                    ensure_ascii=False,
                )
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise HistoryUnavailable(
                "history_unwritable", f"History of session {session.public_id} cannot be written: {exc.strerror}."
            ) from None
        session._staged_history_file = temp_name

    def commit(self, session: AgentSession) -> None:
        """Swap the staged file in. A crash before this leaves the old file whole."""
        temp_name = getattr(session, "_staged_history_file", None)
        if not temp_name:
            return
        path = self.path_for(session)
        os.replace(temp_name, path)
        session._staged_history_file = None
        # The rename is durable only once the directory entry is on disk.
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def discard(self, session: AgentSession) -> None:
        temp_name = getattr(session, "_staged_history_file", None)
        if temp_name:
            Path(temp_name).unlink(missing_ok=True)
            session._staged_history_file = None

    def delete(self, session: AgentSession) -> None:
        self.path_for(session).unlink(missing_ok=True)


STORES = {HistoryStore.DATABASE: DatabaseStore(), HistoryStore.FILE: FileStore()}


def store_for(session: AgentSession) -> DatabaseStore | FileStore:
    return STORES[HistoryStore(session.store)]


def configured_store_name() -> str:
    return settings.PAPERCLIP_SESSION_STORE
