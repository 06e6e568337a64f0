"""Claude Code transcripts, kept here: the SDK's `SessionStore` over our history stores.

The CLI writes its session as JSONL lines under its config directory; the SDK mirrors
every line to a `SessionStore` and, to resume, loads the session from the store into a
temporary config directory. So the store is the record and the CLI's local copy a cache.

- `DatabaseTranscripts`: rows of `cli_transcript_entries` (the `database` store);
- `FileTranscripts`: `PAPERCLIP_HOME/sessions/{agent_id}/cli/{project}/{session}/` (`file`).

Both are scoped by agent (`scope`): the SDK's keys (project, session, subpath) name a
transcript only within one. They implement the protocol's optional `delete`,
`list_sessions` and `list_subkeys` and pass the SDK's own conformance suite
(`claude_agent_sdk.testing.run_session_store_conformance`).

A heartbeat never hands the SDK these stores directly: the engine hands the runtime a
`SessionTranscripts` for the session it resumes, whose `RunTranscript` serves the
transcript loaded before the run and buffers what the CLI appends. The engine writes the
buffer in the heartbeat's commit (`on_commit`), so the ORM is never used
from the SDK's event loop, no transaction is held across the CLI's run, and a failed
heartbeat leaves the stored transcript as it was.

The file store cannot join the COMMIT, so the row names what it committed, as it names a
history file's version: `AgentSession.cli_transcript_sizes`, the size of each transcript
file the COMMIT covers. A run appends its lines before that COMMIT; until the COMMIT names
their sizes no reader sees them, so a worker killed between the append and the COMMIT
leaves lines nobody resumes from, and the next write cuts them off first.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from decimal import Decimal
from pathlib import Path
from urllib.parse import unquote

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError, transaction

from sessions_app.adapters.cli_home import local_copy_delete
from sessions_app.durable import file_name, folders_make, fsync_directory
from sessions_app.errors import HistoryUnavailable
from sessions_app.models import Agent, AgentSession, CliTranscriptEntry, HistoryStore

logger = logging.getLogger(__name__)

MAX_KEY_CHARS = 255


def _line(entry: dict) -> str:
    # ASCII JSON: NUL and lone surrogates travel as escapes, which both databases store.
    return json.dumps(entry, ensure_ascii=True, separators=(",", ":"))


def _check_key(key: dict) -> tuple[str, str, str]:
    project, session, subpath = key["project_key"], key["session_id"], key.get("subpath") or ""
    for name, value in (("project_key", project), ("session_id", session), ("subpath", subpath)):
        if not isinstance(value, str) or len(value) > MAX_KEY_CHARS or "\x00" in value:
            raise ValueError(f"{name} must be a string of at most {MAX_KEY_CHARS} characters without NUL")
    if not project or not session:
        raise ValueError("project_key and session_id must not be empty")
    return project, session, subpath


class TranscriptStore:
    """The SessionStore protocol's methods as coroutines over synchronous ones (`*_now`),
    which the engine calls directly inside its transactions."""

    def __init__(self, scope) -> None:
        self.scope = scope

    async def append(self, key, entries) -> None:
        await sync_to_async(self.append_now)(key, list(entries))

    async def load(self, key):
        return await sync_to_async(self.load_now)(key)

    async def list_sessions(self, project_key: str):
        return await sync_to_async(self.list_sessions_now)(project_key)

    async def list_subkeys(self, key) -> list[str]:
        return await sync_to_async(self.list_subkeys_now)(key)

    async def delete(self, key) -> None:
        await sync_to_async(self.delete_now)(key)

    def append_now(self, key, entries: list[dict]) -> None:
        raise NotImplementedError

    def load_now(self, key) -> list[dict] | None:
        raise NotImplementedError

    def list_sessions_now(self, project_key: str) -> list[dict]:
        raise NotImplementedError

    def list_subkeys_now(self, key) -> list[str]:
        raise NotImplementedError

    def delete_now(self, key) -> None:
        raise NotImplementedError

    def session_entries(self, session_id: str, *, committed: dict[str, int] | None = None) -> dict[str, list[dict]]:
        """Every transcript of a CLI session in this scope, whatever project it was kept
        under, by subpath ("" for the main one). A workspace path that differs between
        hosts changes the project key, never which session an agent resumes. `committed`
        is the row's `cli_transcript_sizes` (the file store reads only that much)."""
        raise NotImplementedError

    def delete_session(self, session_id: str) -> None:
        """Remove a CLI session's transcripts in this scope, under every project."""
        raise NotImplementedError


class DatabaseTranscripts(TranscriptStore):
    def _rows(self, project: str, session: str):
        return CliTranscriptEntry.objects.filter(scope=self.scope, project_key=project, session_id=session)

    def append_now(self, key, entries: list[dict]) -> None:
        project, session, subpath = _check_key(key)
        if not entries:
            return
        CliTranscriptEntry.objects.bulk_create(
            [
                CliTranscriptEntry(
                    scope=self.scope, project_key=project, session_id=session, subpath=subpath, line=_line(entry)
                )
                for entry in entries
            ]
        )

    def load_now(self, key) -> list[dict] | None:
        project, session, subpath = _check_key(key)
        lines = list(self._rows(project, session).filter(subpath=subpath).order_by("id").values_list("line", flat=True))
        return [json.loads(line) for line in lines] or None

    def list_sessions_now(self, project_key: str) -> list[dict]:
        from django.db.models import Max

        found = (
            CliTranscriptEntry.objects.filter(scope=self.scope, project_key=project_key, subpath="")
            .values("session_id")
            .annotate(last=Max("created_at"))
            .order_by()
        )
        return [{"session_id": row["session_id"], "mtime": int(row["last"].timestamp() * 1000)} for row in found]

    def list_subkeys_now(self, key) -> list[str]:
        project, session, _ = _check_key(key)
        found = self._rows(project, session).exclude(subpath="").values_list("subpath", flat=True).distinct()
        return sorted(found)

    def delete_now(self, key) -> None:
        project, session, subpath = _check_key(key)
        rows = self._rows(project, session)
        (rows.filter(subpath=subpath) if subpath else rows).delete()

    def session_entries(self, session_id: str, *, committed: dict[str, int] | None = None) -> dict[str, list[dict]]:
        # Rows commit with the heartbeat: every row there is committed.
        found: dict[str, list[dict]] = {}
        rows = CliTranscriptEntry.objects.filter(scope=self.scope, session_id=session_id).order_by("id")
        for subpath, line in rows.values_list("subpath", "line"):
            found.setdefault(subpath, []).append(json.loads(line))
        return found

    def delete_session(self, session_id: str) -> None:
        CliTranscriptEntry.objects.filter(scope=self.scope, session_id=session_id).delete()


class FileTranscripts(TranscriptStore):
    """One JSONL file per transcript: `{project}/{session}/main.jsonl` and, for a
    subagent, `{project}/{session}/sub/{subpath}.jsonl`, each name percent-encoded so no
    key can leave the directory."""

    def __init__(self, scope, root: Path | None = None) -> None:
        super().__init__(scope)
        self.root = root or Path(settings.PAPERCLIP_HOME) / "sessions" / str(scope) / "cli"

    def _session_dir(self, project: str, session: str) -> Path:
        return self.root / file_name(project) / file_name(session)

    def path_for(self, key) -> Path:
        project, session, subpath = _check_key(key)
        folder = self._session_dir(project, session)
        return folder / "sub" / f"{file_name(subpath)}.jsonl" if subpath else folder / "main.jsonl"

    def append_now(self, key, entries: list[dict]) -> None:
        path = self.path_for(key)
        if not entries:
            return
        created = not path.exists()
        folders_make(path.parent)
        with open(path, "a", encoding="ascii") as handle:
            handle.write("".join(_line(entry) + "\n" for entry in entries))
            handle.flush()
            os.fsync(handle.fileno())
        if created:
            # A new file is on disk only once its folder is flushed; the COMMIT naming its
            # size comes after.
            fsync_directory(path.parent)

    def load_now(self, key) -> list[dict] | None:
        return _read_jsonl(self.path_for(key))

    def list_sessions_now(self, project_key: str) -> list[dict]:
        folder = self.root / file_name(project_key)
        if not folder.is_dir():
            return []
        found = []
        for main in folder.glob("*/main.jsonl"):
            found.append({"session_id": unquote(main.parent.name), "mtime": main.stat().st_mtime_ns // 1_000_000})
        return found

    def list_subkeys_now(self, key) -> list[str]:
        project, session, _ = _check_key(key)
        folder = self._session_dir(project, session) / "sub"
        return sorted(unquote(path.name[: -len(".jsonl")]) for path in folder.glob("*.jsonl"))

    def delete_now(self, key) -> None:
        project, session, subpath = _check_key(key)
        if subpath:
            self.path_for(key).unlink(missing_ok=True)
        else:
            shutil.rmtree(self._session_dir(project, session), ignore_errors=True)

    def session_files(self, session_id: str) -> list[tuple[str, Path]]:
        """(subpath, file) of every transcript of a CLI session, under every project."""
        found = []
        for folder in self.root.glob(f"*/{file_name(session_id)}"):
            found.append(("", folder / "main.jsonl"))
            found.extend((unquote(sub.name[: -len(".jsonl")]), sub) for sub in (folder / "sub").glob("*.jsonl"))
        return found

    def name_of(self, path: Path) -> str:
        """A transcript file's name in `cli_transcript_sizes`: its path below the root."""
        return path.relative_to(self.root).as_posix()

    def session_sizes(self, session_id: str) -> dict[str, int]:
        """The size of each transcript file of a CLI session, as it is on disk now."""
        return {self.name_of(path): path.stat().st_size for _, path in self.session_files(session_id) if path.exists()}

    def session_entries(self, session_id: str, *, committed: dict[str, int] | None = None) -> dict[str, list[dict]]:
        found: dict[str, list[dict]] = {}
        for subpath, path in self.session_files(session_id):
            if committed is None:  # written before sizes were kept: the whole file
                entries = _read_jsonl(path)
            elif self.name_of(path) in committed:
                entries = _read_jsonl(path, limit=committed[self.name_of(path)])
            else:
                continue  # appended by a run that never committed
            if entries is not None:
                found.setdefault(subpath, []).extend(entries)
        return found

    def delete_session(self, session_id: str) -> None:
        for folder in self.root.glob(f"*/{file_name(session_id)}"):
            shutil.rmtree(folder)


def _read_jsonl(path: Path, *, limit: int | None = None) -> list[dict] | None:
    """The entries of a JSONL file, or of its first `limit` bytes (what a COMMIT named)."""
    try:
        with open(path, "rb") as handle:
            text = handle.read(limit if limit is not None else -1).decode("ascii")
    except FileNotFoundError:
        return None
    # A line cut short by a crash mid-append is the end of what was written.
    entries = []
    for line in text.splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            logger.warning("Ignoring a truncated line in %s", path)
    return entries or None


def transcripts_for(*, agent_id, store: str) -> TranscriptStore:
    return FileTranscripts(agent_id) if store == HistoryStore.FILE else DatabaseTranscripts(agent_id)


class RunTranscript:
    """The SessionStore one heartbeat's CLI sees: the session as loaded before the run
    (whatever project key the SDK asks under), and a buffer for what the CLI appends,
    written by the engine in the heartbeat's commit (`stage`)."""

    def __init__(self, loaded: dict[str, list[dict]] | None = None) -> None:
        self.loaded = loaded or {}
        self.appended: list[tuple[dict, list[dict]]] = []
        # The SDK retries a batch that failed or timed out, and a retry may overlap what
        # already landed: an entry's uuid is its idempotency key (entries without one, such
        # as titles, are appended each time, as the SessionStore protocol asks).
        self._seen = {
            (subpath, entry["uuid"]) for subpath, kept in self.loaded.items() for entry in kept if _uuid_of(entry)
        }

    async def append(self, key, entries) -> None:
        subpath = key.get("subpath") or ""
        fresh = []
        for entry in entries:
            if uuid := _uuid_of(entry):
                if (subpath, uuid) in self._seen:
                    continue
                self._seen.add((subpath, uuid))
            fresh.append(entry)
        if fresh:
            self.appended.append((dict(key), fresh))

    async def load(self, key):
        return list(self.loaded.get(key.get("subpath") or "", [])) or None

    async def list_subkeys(self, key) -> list[str]:
        return sorted(subpath for subpath in self.loaded if subpath)


def _uuid_of(entry) -> str | None:
    uuid = entry.get("uuid") if isinstance(entry, dict) else None
    return uuid if isinstance(uuid, str) and uuid else None


class StagedTranscript:
    """What a heartbeat appended, written inside its commit transaction (`write`). The
    database store's rows commit or roll back with it. The file store appends to its files
    before the COMMIT, first cutting off anything past the sizes the row names (lines of a
    run that died before its COMMIT); `write` returns the files' new sizes, which the
    caller saves on the row in the same transaction: that COMMIT is their publication."""

    def __init__(
        self, store: TranscriptStore, appended: list[tuple[dict, list[dict]]], *, session: AgentSession
    ) -> None:
        self.store = store
        self.appended = appended
        self.session_id = session.pk
        self.cli_session_id = session.cli_session_id
        self.committed = session.cli_transcript_sizes
        self.sizes: dict[str, int] | None = None  # after `write`, what the row is to name

    def write(self) -> dict[str, int] | None:
        """Append the run's entries; for the file store, the size of every file of the
        transcript afterwards (None for the database store)."""
        if not isinstance(self.store, FileTranscripts):
            for key, entries in self.appended:
                self.store.append_now(key, entries)
            return None
        store = self.store
        if self.committed is None:  # kept before sizes were: its files as they are
            self.committed = store.session_sizes(self.cli_session_id)
        committed = self.committed
        # Kept as it grows, so that `discard` cuts back a write that failed half way.
        self.sizes = sizes = dict(committed)
        try:
            for key, entries in self.appended:
                path = store.path_for(key)
                name = store.name_of(path)
                if name not in sizes or (path.exists() and path.stat().st_size != sizes[name]):
                    sizes[name] = committed.get(name, 0)
                    if path.exists():
                        os.truncate(path, sizes[name])  # lines no COMMIT named
                store.append_now(key, entries)
                sizes[name] = path.stat().st_size
        except OSError as exc:
            raise HistoryUnavailable(
                "history_unwritable", f"The Claude Code transcript cannot be written: {exc.strerror or exc}."
            ) from None
        return sizes

    def publish(self) -> None:
        pass  # the COMMIT that names the sizes published the lines

    def discard(self) -> None:
        """After a failed transaction: cut the files back, once the row provably does not
        name their new sizes (a COMMIT that lost its connection may have committed). Lines
        left behind are never read, and the next write cuts them."""
        if self.sizes is None:
            return
        try:
            named = AgentSession.objects.filter(pk=self.session_id).values_list("cli_transcript_sizes", flat=True)
            if list(named) == [self.sizes]:
                return
        except DatabaseError:
            return
        committed = self.committed or {}
        for name, size in self.sizes.items():
            if size == committed.get(name):
                continue
            try:
                os.truncate(self.store.root / name, committed.get(name, 0))
            except OSError as exc:
                logger.warning("Could not cut %s back after a failed heartbeat: %s", name, exc)


def cli_sessions_delete(rows: list[tuple]) -> None:
    """Delete the transcripts of sessions (`(agent_id, cli_session_id)`) everywhere:
    the store and the CLI's local copy under the agent's config directory. Database rows
    go in the caller's transaction; files once it commits."""
    rows = [row for row in rows if row[1]]
    for agent_id, cli_session_id in rows:
        DatabaseTranscripts(agent_id).delete_session(cli_session_id)
    # Read now: an agent deleted with its sessions is gone by the COMMIT.
    away = _pinned_elsewhere({agent_id for agent_id, _ in rows}) if rows else {}

    def delete_files() -> None:
        for agent_id, cli_session_id in rows:
            try:
                FileTranscripts(agent_id).delete_session(cli_session_id)
                if agent_id in away:
                    _local_copy_delete_there(agent_id, cli_session_id, cluster=away[agent_id])
                else:
                    local_copy_delete(agent_id=agent_id, cli_session_id=cli_session_id)
            except OSError:
                logger.exception("Could not delete the transcript files of CLI session %s", cli_session_id)

    transaction.on_commit(delete_files)


def _pinned_elsewhere(agent_ids: set) -> dict:
    """The agents pinned to another task cluster than this process's, by id: the CLI's own
    copy of their sessions is on that cluster's host's disk (`run_queue.run_cluster`)."""
    from sessions_app.run_queue import runs_elsewhere

    configs = Agent.objects.filter(pk__in=agent_ids).values_list("pk", "adapter_config")
    return {pk: cluster for pk, config in configs if (cluster := runs_elsewhere(config or {}))}


def _local_copy_delete_there(agent_id, cli_session_id: str, *, cluster: str) -> None:
    from django_q.tasks import async_task

    try:
        async_task(
            "sessions_app.tasks.cli_local_copy_delete", str(agent_id), cli_session_id, cluster=cluster,
            task_name=f"delete CLI session {cli_session_id}",
        )  # fmt: skip
    except Exception:  # the broker is down: the copy stays on that host, as the log says
        logger.exception("Could not ask cluster %s to delete its copy of CLI session %s", cluster, cli_session_id)


class SessionTranscripts:
    """The engine's handle on the Claude Code session a heartbeat resumes (or starts, when
    `session` is None or has no CLI session yet): the runtime's `OwnSessionStore`. It reads
    the transcript before the run and writes what the run appended in the commit."""

    def __init__(self, session: AgentSession | None, *, agent_id) -> None:
        self.session = session
        self.agent_id = agent_id
        self.resumed_id = session.cli_session_id if session is not None else ""

    def run_transcript(self) -> RunTranscript:
        if not self.resumed_id:
            return RunTranscript()
        store = transcripts_for(agent_id=self.session.agent_id, store=self.session.store)
        return RunTranscript(store.session_entries(self.resumed_id, committed=self.session.cli_transcript_sizes))

    def on_commit(self, transcript: RunTranscript | None, *, session_id: str, report: dict):
        """The `on_commit` of a Claude Code reply: inside the heartbeat's commit, the session
        row gets the CLI's id and the store what the CLI appended; a disagreement over 1%
        between the ledger's cost and the CLI's own figure is logged."""

        def commit(session: AgentSession | None, cost: Decimal | None) -> StagedTranscript | None:
            """`session` None: no session takes this run's transcript (a stateless agent,
            or a nothing-to-do answer, which is never replayed)."""
            cost_check(report, cost)
            if session is None or transcript is None:
                if not self.resumed_id:
                    # A CLI session no row will ever name: not even the CLI's local copy is kept.
                    try:
                        local_copy_delete(agent_id=self.agent_id, cli_session_id=session_id)
                    except OSError as exc:
                        logger.warning("Could not delete the local copy of CLI session %s: %s", session_id, exc)
                return None
            if session.cli_session_id != session_id:  # a new transcript: nothing of it is committed yet
                AgentSession.objects.filter(pk=session.pk).update(cli_session_id=session_id, cli_transcript_sizes={})
                session.cli_session_id, session.cli_transcript_sizes = session_id, {}
            store = transcripts_for(agent_id=session.agent_id, store=session.store)
            staged = StagedTranscript(store, transcript.appended, session=session)
            sizes = staged.write()
            if sizes is not None:
                # Saved here and by the turn's save that follows (which writes every field).
                AgentSession.objects.filter(pk=session.pk).update(cli_transcript_sizes=sizes)
                session.cli_transcript_sizes = sizes
            return staged

        return commit


def cost_check(report: dict, cost: Decimal | None) -> None:
    theirs = report.get("cli_total_cost_usd")
    if cost is None or theirs is None:
        return
    theirs = Decimal(theirs)
    if abs(theirs - cost) > max(cost, theirs) / 100:
        logger.warning(
            "Claude Code reported a cost of $%s for CLI session %s; the ledger priced it at $%s",
            theirs,
            report.get("cli_session_id"),
            cost,
        )
