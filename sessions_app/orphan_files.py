"""Files under PAPERCLIP_HOME that no row names, removed by the maintenance pass.

A deletion removes its rows in a transaction and their files after the COMMIT
(`services.sessions_delete`, the retention purge, `cli_sessions_delete`, `outputs_delete`): a
worker killed between the two, or a removal that failed (only logged), leaves files that no
row names, for ever. So does a write that died before its COMMIT without cleaning up after
itself: a history version staged beside the session's file, a copy's temporary file. This
step removes them. What names a file:

- a history file `sessions/{agent_id}/sess_{hex}.json`: its session's row, while that row
  keeps its history in files and is not purged; a staged version `.sess_{hex}.{version}.staged`
  only while the row names that version (committed, not yet renamed into place); the other
  `.sess_{hex}.*` files (temporary files of a repair) never;
- a Claude Code transcript `sessions/{agent_id}/cli/{project}/{cli session}/...`: a session
  row of that agent (file store, not purged) naming the CLI session, for every file of it.
  Lines or files past what the row's `cli_transcript_sizes` names are left to the next write
  of that transcript, which cuts them before it appends;
- a Managed Agents copy `outputs/{agent_id}/{remote session}/{file id}`: its
  `managed_outputs` row, unless the row says it was skipped. A tombstone
  (`managed_outputs_deleted`) names no file, and a copy's temporary file is named by nothing.

Every store writes its file before the COMMIT that names it, so a file no row names may be a
write in flight: only files older than `grace()` are candidates, and whether a row names one
is read after it was listed, a batch at a time. A writer names only a file it has just
written (a new version, a new CLI session, a copy renamed into place), so an old file that no
row names when it is checked is not about to be named; it is looked at once more just before
it goes, and kept if it was written again since it was listed (a retried copy).

Only the stores' folders of agents this database has a row for are walked, and only names
their stores write are touched; no symbolic link is followed, and PAPERCLIP_HOME and the
stores' folders themselves stay.
Folders go only when nothing can write in them any more: a deleted agent's, and those of a
CLI session no row names once its files are gone. Any other folder stays, even empty: a
writer may be about to make a file in it.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import chain, islice
from pathlib import Path
from typing import TypeVar
from urllib.parse import unquote

from django.conf import settings

from sessions_app.agent_files import retired_agents_folders_remove
from sessions_app.durable import agent_folders_in, file_name, folder_entries
from sessions_app.models import SESSION_ID_PREFIX, Agent, AgentSession, AgentStatus, HistoryStore, ManagedOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")

BATCH = 500
HISTORY = re.compile(rf"{SESSION_ID_PREFIX}(?P<hex>[0-9a-f]{{32}})\.json")
LEFTOVER = re.compile(rf"\.{SESSION_ID_PREFIX}(?P<hex>[0-9a-f]{{32}})\.(?P<rest>.+)")
STAGED = re.compile(r"(?P<version>[0-9a-f]{32})\.staged")


def grace() -> timedelta:
    """How old a file no row names must be before it goes: older than any write still on
    its way to the COMMIT that names it. A history version and a transcript's lines are
    written inside their run's commit transaction, with only that transaction's statements
    left before its COMMIT, and a run's deadline leaves the work around its model call (the
    commit included) PAPERCLIP_RUN_TIMEOUT_SECONDS, 10 minutes by default. A Managed Agents
    copy is renamed into place right before its row is inserted, by a worker that renews
    its 5-minute claim as it downloads; a download that stalls has only a temporary file,
    which is never named (once it is gone the rename fails, and the copy is retried). The
    run timeout six times over, and never under an hour: nothing bounds a COMMIT stuck on a
    lock, but one held back that long is a deployment already failing."""
    return max(timedelta(hours=1), timedelta(seconds=6 * settings.PAPERCLIP_RUN_TIMEOUT_SECONDS))


@dataclass(frozen=True)
class Found:
    """A file as listed: which store's, the row key that would name it, what it was (inode
    and modification time) when it was seen old, and the folder that may go with it (an
    unnamed CLI session's)."""

    path: Path
    kind: str
    agent_id: uuid.UUID
    key: tuple
    seen: tuple[int, int]
    folder: Path | None = None


# Where a pass writes when it last swept this PAPERCLIP_HOME: the sweep stats every file the
# stores keep and asks the database about each old one, too much for every minute's pass.
SWEPT_MARK = ".orphan-files-swept"
SWEEP_EVERY = timedelta(minutes=15)


def orphan_files_sweep(*, now: datetime) -> int:
    """The maintenance pass's step: `orphan_files_remove` once every SWEEP_EVERY in this
    PAPERCLIP_HOME (0 between). The mark is in the folder swept, not the database, as each
    host of a deployment may keep a home of its own. Two passes that both find the sweep due
    both sweep, which removes nothing twice."""
    mark = Path(settings.PAPERCLIP_HOME) / SWEPT_MARK
    if not _sweep_due(mark, now=now):
        return 0
    _sweep_mark(mark, now=now)
    return orphan_files_remove(now=now)


def _sweep_due(mark: Path, *, now: datetime) -> bool:
    try:
        last = datetime.fromisoformat(mark.read_text(encoding="utf-8").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return True  # never swept, or a mark no pass wrote
    if last.tzinfo is None:
        return True  # a mark no pass wrote
    # A mark from the future (a host whose clock ran ahead) would hold every sweep back.
    return not (now - SWEEP_EVERY < last <= now)


def _sweep_mark(mark: Path, *, now: datetime) -> None:
    try:
        partial = mark.with_name(f"{SWEPT_MARK}.{os.getpid()}.partial")
        partial.write_text(now.isoformat(), encoding="utf-8")
        os.replace(partial, mark)
    except OSError as exc:
        # Sweep anyway: a full disk is when removing what no row names helps most.
        logger.warning("Could not mark the sweep for files no row names in %s: %s", mark.parent, exc)


def orphan_files_remove(*, now: datetime) -> int:
    """Remove the files of the stores that no row names and that are older than the grace;
    returns how many. A file that cannot be removed is logged and left for the next pass."""
    home = Path(settings.PAPERCLIP_HOME)
    cutoff_ns = int((now - grace()).timestamp() * 1_000_000_000)
    retired: set[uuid.UUID] = set()
    removed = 0
    for batch in _batches(_old_files(home, cutoff_ns=cutoff_ns, retired=retired)):
        named = _named(batch)
        removed += sum(_remove(found, home) for found in batch if found not in named)
    _retired_folders_remove(home, retired)
    return removed + retired_agents_folders_remove(now=now, grace=grace())


def _batches(items: Iterable[T]) -> Iterator[list[T]]:
    items = iter(items)
    while batch := list(islice(items, BATCH)):
        yield batch


def _old_files(home: Path, *, cutoff_ns: int, retired: set) -> Iterator[Found]:
    """The stores' files modified before the cutoff, folder by folder; `retired` collects
    the deleted agents whose folders were walked."""
    for root, walk in ((home / "sessions", _session_files), (home / "outputs", _output_files)):
        for agent_id, folder in _known_agents_folders(root, retired):
            for found in walk(folder, agent_id):
                if found.seen[1] < cutoff_ns:
                    yield found


def _known_agents_folders(root: Path, retired: set) -> Iterator[tuple[uuid.UUID, Path]]:
    """The folders of agents this database has a row for, live or deleted. Any other may be
    another database's: a deployment sharing PAPERCLIP_HOME, or a DATABASE_URL naming the
    wrong database, where no row names anything and every file would go. An agent removed
    entirely (the admin's delete) leaves its folders to the operator."""
    for chunk in _batches(agent_folders_in(root)):
        statuses = dict(Agent.objects.filter(pk__in=[agent_id for agent_id, _ in chunk]).values_list("pk", "status"))
        for agent_id, folder in chunk:
            if agent_id in statuses:
                if statuses[agent_id] == AgentStatus.DELETED:
                    retired.add(agent_id)
                yield agent_id, folder


def _found(entry: os.DirEntry, kind: str, agent_id: uuid.UUID, key: tuple, folder: Path | None = None) -> Found | None:
    try:
        stat = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None
    return Found(Path(entry.path), kind, agent_id, key, (stat.st_ino, stat.st_mtime_ns), folder)


def _session_files(folder: Path, agent_id: uuid.UUID) -> Iterator[Found]:
    for entry in folder_entries(folder, folders=False):
        if found := _history_file(entry, agent_id):
            yield found
    for project in folder_entries(folder / "cli", folders=True):
        for session in folder_entries(Path(project.path), folders=True):
            yield from _transcript_files(Path(session.path), agent_id)


def _history_file(entry: os.DirEntry, agent_id: uuid.UUID) -> Found | None:
    if match := HISTORY.fullmatch(entry.name):
        return _found(entry, "history", agent_id, (uuid.UUID(match["hex"]), None))
    if match := LEFTOVER.fullmatch(entry.name):
        staged = STAGED.fullmatch(match["rest"])
        if staged is None:
            return _found(entry, "leftover", agent_id, ())
        return _found(entry, "history", agent_id, (uuid.UUID(match["hex"]), staged["version"]))
    return None


def _transcript_files(session: Path, agent_id: uuid.UUID) -> Iterator[Found]:
    cli_session_id = _id_named(session.name)
    if cli_session_id is None:
        return
    main = (entry for entry in folder_entries(session, folders=False) if entry.name == "main.jsonl")
    subagents = (
        entry
        for entry in folder_entries(session / "sub", folders=False)
        if entry.name.endswith(".jsonl") and _id_named(entry.name[: -len(".jsonl")]) is not None
    )
    for entry in chain(main, subagents):
        if found := _found(entry, "transcript", agent_id, (cli_session_id,), folder=session):
            yield found


def _output_files(folder: Path, agent_id: uuid.UUID) -> Iterator[Found]:
    for session in folder_entries(folder, folders=True):
        remote_session_id = _id_named(session.name)
        if remote_session_id is None:
            continue
        for entry in folder_entries(Path(session.path), folders=False):
            # A copy's temporary file (`.{name}.{hex}.partial`) is such a name too, one no
            # row has: the rows' ids are the provider's.
            file_id = _id_named(entry.name)
            if file_id is not None and (found := _found(entry, "output", agent_id, (remote_session_id, file_id))):
                yield found


def _id_named(name: str) -> str | None:
    """The id from elsewhere a name in the stores' folders stands for (`durable.file_name`);
    None when the stores would not have written that name."""
    try:
        key = unquote(name, errors="strict")
    except UnicodeDecodeError:
        return None
    return key if file_name(key) == name else None


def _named(batch: list[Found]) -> set[Found]:
    """The files of the batch that a row names, as the database has it now: after they were
    listed, so a row that committed meanwhile is seen."""
    named: set[Found] = set()
    for kind, names in NAMERS.items():
        of_kind = [found for found in batch if found.kind == kind]
        if of_kind:
            named |= names(of_kind)
    return named


def _histories_named(batch: list[Found]) -> set[Found]:
    rows = AgentSession.objects.filter(
        pk__in={found.key[0] for found in batch}, store=HistoryStore.FILE, history_purged_at__isnull=True
    ).values_list("pk", "agent_id", "history_version")
    versions = {pk: (agent_id, version) for pk, agent_id, version in rows}
    return {
        found
        for found in batch
        if (row := versions.get(found.key[0])) is not None
        and row[0] == found.agent_id
        and found.key[1] in (None, row[1])
    }


def _transcripts_named(batch: list[Found]) -> set[Found]:
    rows = AgentSession.objects.filter(
        agent_id__in={found.agent_id for found in batch},
        cli_session_id__in={found.key[0] for found in batch},
        store=HistoryStore.FILE,
        history_purged_at__isnull=True,
    ).values_list("agent_id", "cli_session_id")
    pairs = set(rows)
    return {found for found in batch if (found.agent_id, found.key[0]) in pairs}


def _outputs_named(batch: list[Found]) -> set[Found]:
    rows = ManagedOutput.objects.filter(
        remote_session_id__in={found.key[0] for found in batch},
        file_id__in={found.key[1] for found in batch},
        skipped="",
    ).values_list("agent_id", "remote_session_id", "file_id")
    triples = set(rows)
    return {found for found in batch if (found.agent_id, *found.key) in triples}


NAMERS: dict[str, Callable[[list[Found]], set[Found]]] = {
    "history": _histories_named,
    "transcript": _transcripts_named,
    "output": _outputs_named,
}


def _remove(found: Found, home: Path) -> bool:
    """Unlink the file unless it was written again since it was listed (a new inode or a
    new modification time: a retried copy renamed over it, lines appended)."""
    shown = found.path.relative_to(home)
    try:
        stat = os.lstat(found.path)
        if (stat.st_ino, stat.st_mtime_ns) != found.seen:
            return False
        os.unlink(found.path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.warning("Could not remove %s, which no row names: %s", shown, exc)
        return False
    logger.info("Removed %s, which no row names", shown)
    if found.folder is not None:
        # No row names its CLI session, and no writer picks an old one up again: a run
        # appends to the session its row names, or to a new one the CLI just started.
        _empty_folders_remove(found.folder)
    return True


def _retired_folders_remove(home: Path, retired: set) -> None:
    """The emptied folders of deleted agents, whose files nothing writes any more (a copy
    under way as its agent is deleted removes what it wrote again, `managed_outputs`)."""
    for agent_id in retired:
        for root in (home / "sessions", home / "outputs"):
            _empty_folders_remove(root / str(agent_id))


def _empty_folders_remove(folder: Path) -> None:
    """`folder` and the folders in it, those that are empty, deepest first."""
    if folder.is_symlink() or not folder.is_dir():
        return
    for path, _, _ in os.walk(folder, topdown=False):
        try:
            os.rmdir(path)
        except OSError:
            pass  # not empty: a file younger than the grace, or one that is not the stores'
