"""Reading and writing memory: paths, mounts, limits and versions.

Every write runs in one short transaction that locks its store's row first, so writes to
a store happen one at a time on every host: a write reads the content it changes under
the lock (a str_replace of one run and an insert of another both land), and the store's
size limit is checked against a total no concurrent write can move. A run's write also
locks its run's row and is made only while the run is running. No lock is ever held
across a model call: the tool loop calls these between calls.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models.functions import Substr
from django.utils import timezone

from memory_app.models import (
    DEFAULT_STORE,
    MemoryAccess,
    MemoryFile,
    MemoryStore,
    MemoryStoreShare,
    MemoryVersion,
    MemoryWriter,
)
from sessions_app.errors import RunAbandoned
from sessions_app.models import Agent, AgentStatus, HeartbeatRun, RunStatus
from sessions_app.text import holds_control_character, is_storable

ROOT = "/memories"
MAX_PATH_CHARS = 512


class MemoryFault(Exception):
    """A memory operation refused: `code` is stable (API errors), `message` is what the model
    or the operator reads."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Writer:
    """Who writes: a run's tool call, or an operator (admin or API)."""

    run_id: object = None
    operator: str = ""

    @property
    def kind(self) -> str:
        return MemoryWriter.RUN if self.run_id else MemoryWriter.OPERATOR


@dataclass(frozen=True)
class Mount:
    """A store as an agent sees it: the agent's own default store at /memories, every
    other store at /memories/<name>/."""

    store: MemoryStore
    prefix: str  # "" or "<name>/"
    writable: bool
    owned: bool


# --- paths ------------------------------------------------------------------------------


def clean_path(path: object, *, directory_ok: bool = True) -> str:
    """The path relative to /memories ("" for /memories itself), or a `memory_path_invalid`
    fault: the path must be /memories or below it, without `..`, `.`, empty segments, NUL
    or other control characters."""
    if not isinstance(path, str) or not is_storable(path):
        raise MemoryFault("memory_path_invalid", "The path must be text without NUL characters.")
    if holds_control_character(path) or "\\" in path:
        raise MemoryFault("memory_path_invalid", f"The path {path!r} holds a control character or a backslash.")
    if len(path) > MAX_PATH_CHARS:
        raise MemoryFault("memory_path_invalid", f"The path is longer than {MAX_PATH_CHARS} characters.")
    if path != ROOT and not path.startswith(ROOT + "/"):
        raise MemoryFault("memory_path_invalid", f"Paths must start with {ROOT}, got: {path}")
    relative = path[len(ROOT) :].strip("/")
    if relative and path.rstrip("/") != posixpath.join(ROOT, relative):
        raise MemoryFault("memory_path_invalid", f"The path {path} has empty segments.")
    parts = relative.split("/") if relative else []
    if any(part in ("", ".", "..") for part in parts):
        raise MemoryFault("memory_path_invalid", f"The path {path} would escape {ROOT}: no '.' or '..' segments.")
    if not directory_ok and not relative:
        raise MemoryFault("memory_path_invalid", f"{ROOT} is a directory; name a file below it.")
    return relative


def shown(mount: Mount, relative: str) -> str:
    """A path inside a mount's store as the agent names it: below /memories, with the mount's
    folder (what every message naming a path must say: a named store's `a.md` is
    /memories/team/a.md, not the default store's /memories/a.md)."""
    return posixpath.join(ROOT, mount.prefix + relative).rstrip("/")


# --- mounts -----------------------------------------------------------------------------


def memory_store_names(agent: Agent) -> list[str]:
    """The stores the agent's configuration names: `memory: true` is its default store;
    a list names more stores (its own, or shared with it) beside the default."""
    wanted = agent.adapter_config.get("memory")
    if not wanted:
        return []
    names = [DEFAULT_STORE]
    if isinstance(wanted, list):
        names += [name for name in wanted if name != DEFAULT_STORE]
    return names


def store_own(agent: Agent, name: str = DEFAULT_STORE) -> MemoryStore:
    """The agent's own store of that name; one not made yet is an unsaved placeholder
    (`_state.adding`), which the first write that succeeds makes (`_store_made`)."""
    store = MemoryStore.objects.filter(agent=agent, name=name).first()
    return store or MemoryStore(agent=agent, company_id=agent.company_id, name=name)


def mounts_for(agent: Agent, names: list[str] | None = None) -> list[Mount]:
    """The agent's mounts, the default store first. A name that is neither the agent's own
    store nor one shared with it is a store of the agent's own, made by its first write."""
    names = memory_store_names(agent) if names is None else names
    if not names:
        return []
    own = {store.name: store for store in MemoryStore.objects.filter(agent=agent, name__in=names)}
    shares = {
        share.store.name: share
        for share in MemoryStoreShare.objects.filter(
            agent=agent, store__name__in=names, store__company_id=agent.company_id
        ).select_related("store")
    }
    mounts = []
    for name in names:
        prefix = "" if name == DEFAULT_STORE else f"{name}/"
        if name in own:
            mounts.append(Mount(own[name], prefix, writable=True, owned=True))
        elif name in shares:
            share = shares[name]
            mounts.append(Mount(share.store, prefix, writable=share.access == MemoryAccess.WRITE, owned=False))
        else:
            mounts.append(Mount(store_own(agent, name), prefix, writable=True, owned=True))
    return mounts


def mounted_store(mount: Mount) -> MemoryStore | None:
    """The mount's store as it is now; None for a store of the agent's own that no write has
    made yet. A placeholder is looked up each time: a run keeps its mounts for its whole
    loop, and its own first write (or another writer's) may make the store meanwhile."""
    if not mount.store._state.adding:
        return mount.store
    return MemoryStore.objects.filter(agent_id=mount.store.agent_id, name=mount.store.name).first()


def resolve(mounts: list[Mount], relative: str) -> tuple[Mount, str]:
    """The mount a path falls in, and the path inside its store."""
    for mount in mounts[1:]:
        name = mount.prefix.rstrip("/")
        if relative == name or relative.startswith(mount.prefix):
            return mount, relative[len(mount.prefix) :]
    if not mounts:
        raise MemoryFault("memory_not_configured", "This agent has no memory.")
    return mounts[0], relative


# --- reads ------------------------------------------------------------------------------


def files_under(store: MemoryStore, directory: str):
    """Live files of the store at or below `directory` ("" for all), without content."""
    files = MemoryFile.objects.filter(store=store, deleted=False).defer("content").order_by("path")
    if directory:
        files = below(files, directory.rstrip("/") + "/")
    return files


def below(files, prefix: str):
    """The files whose path starts with `prefix`, letter case included. Django's
    `__startswith` is SQLite's LIKE, which ignores ASCII case (`Notes/` matched `notes/a.md`),
    so the prefix is also compared exactly; LIKE narrows first (PostgreSQL's is exact)."""
    return files.filter(path__startswith=prefix).alias(head=Substr("path", 1, len(prefix))).filter(head=prefix)


# --- writes -----------------------------------------------------------------------------


def utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_content(text: object, name: str = "content") -> str:
    if not isinstance(text, str) or not is_storable(text):
        raise MemoryFault("memory_content_invalid", f"{name} must be text without NUL characters.")
    return text


def file_write(
    mount: Mount,
    path: str,
    change: Callable[[str | None], str | None],
    *,
    operation: str,
    writer: Writer,
    expected_version: int | None = None,
) -> MemoryFile:
    """Change one file in one short transaction: `change` gets the current content (None
    when there is no such file) and returns the new one (None deletes the file), or raises
    a `MemoryFault`. The write is a new version; limits are checked first.
    `expected_version` (operators) refuses the write when the file moved on meanwhile."""
    if not mount.writable:
        raise MemoryFault("memory_read_only", f"The store {mount.store.name!r} is shared with this agent read-only.")
    if not path:
        raise MemoryFault("memory_path_invalid", f"{shown(mount, path)} is a directory; name a file below it.")
    with transaction.atomic():
        store = _store_locked(mount, writer)
        return _write_locked(mount, store, path, change, operation=operation, writer=writer, expected=expected_version)


def _store_locked(mount: Mount, writer: Writer) -> MemoryStore:
    """The mount's store, locked for a write, once the writer may write to it. An agent's
    deletion removes its stores: one that committed first leaves no store (or, for a store
    made as it ran, an owner deleted), and nothing is written; one still open waits for
    this write's lock on the store and then removes what it wrote."""
    store_id = _store_made(mount.store, writer) if mount.store._state.adding else mount.store.pk
    store = MemoryStore.objects.select_for_update(of=("self",)).select_related("agent").filter(pk=store_id)
    store = store.first()
    _writer_check(writer)
    if store is None or store.agent.status == AgentStatus.DELETED:
        raise MemoryFault("agent_deleted", "The agent was deleted, and its memory with it.")
    return store


def _store_made(placeholder: MemoryStore, writer: Writer):
    """The id of the store a placeholder stands for, made now when no write has made it yet.
    Made inside the write's transaction: a write refused after this (a limit, a bad path, a
    missing file) rolls the store back with it, so a refused write leaves no empty store."""
    mine = MemoryStore.objects.filter(agent_id=placeholder.agent_id, name=placeholder.name)
    found = mine.values_list("pk", flat=True).first()
    if found is not None:
        return found
    # Made under the agent's row lock: never for an agent whose deletion committed.
    if Agent.is_gone(placeholder.agent_id, lock=True):
        _writer_check(writer)  # a run's write fails its run, as for a store that exists
        raise MemoryFault("agent_deleted", "The agent was deleted, and its memory with it.")
    try:
        with transaction.atomic():
            made = MemoryStore.objects.create(
                agent_id=placeholder.agent_id, company_id=placeholder.company_id, name=placeholder.name
            )
            return made.pk
    except IntegrityError:  # a concurrent first write made it
        return mine.values_list("pk", flat=True).get()


def _writer_check(writer: Writer) -> None:
    """A run writes only while it is running and its agent is not deleted: a reaped run, or
    one whose agent went while the model answered, commits nothing. Its row stays locked
    until the write commits, so the reaper (an UPDATE of that row) waits for a write that
    found the run running, and a write after the reaper's COMMIT sees it failed."""
    if writer.run_id is None:
        return
    running = HeartbeatRun.objects.select_for_update(no_key=True, of=("self",)).filter(
        id=writer.run_id, status=RunStatus.RUNNING
    )
    agent_status = running.values_list("agent__status", flat=True).first()
    if agent_status is None:
        raise RunAbandoned("run_timeout", "The run was reaped as timed out; its memory write was not made.")
    if agent_status == AgentStatus.DELETED:
        raise RunAbandoned(
            "agent_deleted", "The agent was deleted while the model answered; its memory write was not made."
        )


def _write_locked(mount, store, path, change, *, operation, writer, expected) -> MemoryFile:
    """The write of `file_write`, on `store` (the mount's, locked). `mount` names the path in
    messages."""
    found = MemoryFile.objects.filter(store=store, path=path).first()
    current = None if found is None or found.deleted else found.content
    if expected is not None and expected not in _versions_now(found):
        raise MemoryFault(
            "memory_version_conflict",
            f"{shown(mount, path)} is at version {found.version if found else 0}, not {expected}: it changed meanwhile.",
        )
    new = change(current)
    if new is None and current is None:
        raise MemoryFault("memory_not_found", f"The path {shown(mount, path)} does not exist.")
    if new is not None:
        check_content(new)
        if _prefix_clash(store, path):
            raise MemoryFault("memory_path_invalid", f"{shown(mount, path)} is a directory or lies inside a file.")
    size = utf8_size(new) if new is not None else 0
    limits_check(store, shown(mount, path), size=size, old_size=found.size if found and not found.deleted else 0)
    now = timezone.now()
    if found is None:
        found = MemoryFile(store=store, path=path)
    found.content, found.size, found.deleted = new or "", size, new is None
    found.version += 1
    found.updated_at = now
    found.save()
    MemoryVersion.objects.create(
        file=found,
        number=found.version,
        content=new,
        operation=operation,
        written_by=writer.kind,
        run_id=writer.run_id,
        operator=writer.operator[:150],
        created_at=now,
    )
    kept = settings.PAPERCLIP_MEMORY_VERSIONS_KEPT
    if found.version > kept:
        MemoryVersion.objects.filter(file=found, number__lte=found.version - kept).delete()
    store.bytes_used = store.bytes_used - _old_size(current) + size
    MemoryStore.objects.filter(pk=store.pk).update(bytes_used=store.bytes_used)
    if new is None:
        _deleted_files_prune(store)
    return found


def _deleted_files_prune(store: MemoryStore) -> None:
    """A deleted file keeps its row and versions, so that it can be reverted or created
    again with its numbering; the store's byte limit counts live files only, so without a
    bound create/delete cycles over new paths would grow the versions for ever. A store
    keeps its PAPERCLIP_MEMORY_DELETED_FILES_KEPT most recently deleted files; older ones
    go with their versions. Under the store's lock, like every write."""
    kept = settings.PAPERCLIP_MEMORY_DELETED_FILES_KEPT
    deleted = MemoryFile.objects.filter(store=store, deleted=True).order_by("-updated_at", "-id")
    stale = list(deleted.values_list("id", flat=True)[kept:])
    if stale:
        MemoryVersion.objects.filter(file_id__in=stale).delete()
        MemoryFile.objects.filter(id__in=stale).delete()


def _versions_now(found: MemoryFile | None) -> tuple[int, ...]:
    """The versions a conditional write may name for the file as it is: its number, or 0
    when there is no file. A deleted file is no file (a reader gets 404 and may create it
    with 0), and its deletion's number still names it (the admin's form, read before)."""
    if found is None:
        return (0,)
    return (0, found.version) if found.deleted else (found.version,)


def _old_size(current: str | None) -> int:
    return utf8_size(current) if current is not None else 0


def _prefix_clash(store: MemoryStore, path: str) -> bool:
    """A file may not share its path with a directory (other files below it), nor sit below
    another file."""
    parents = [path.rsplit("/", depth)[0] for depth in range(1, path.count("/") + 1)]
    inside = below(MemoryFile.objects.filter(store=store, deleted=False), path + "/").exists()
    return inside or MemoryFile.objects.filter(store=store, deleted=False, path__in=parents).exists()


def limits_check(store: MemoryStore, name: str, *, size: int, old_size: int) -> None:
    """Refuse a write of `size` bytes over `old_size` to the file the agent names `name`."""
    file_limit = settings.PAPERCLIP_MEMORY_MAX_FILE_BYTES
    if size > file_limit:
        raise MemoryFault(
            "memory_file_too_large",
            f"{name} would be {size} bytes; a memory file may hold at most {file_limit} bytes "
            "(PAPERCLIP_MEMORY_MAX_FILE_BYTES). Write less, or split it.",
        )
    store_limit = settings.PAPERCLIP_MEMORY_MAX_STORE_BYTES
    total = store.bytes_used - old_size + size
    if size > old_size and total > store_limit:
        raise MemoryFault(
            "memory_store_full",
            f"The store {store.name!r} would hold {total} bytes; its limit is {store_limit} bytes "
            "(PAPERCLIP_MEMORY_MAX_STORE_BYTES). Delete or shorten files first.",
        )


def tree_delete(mount: Mount, path: str, *, writer: Writer) -> int:
    """Delete a file, or every file below a directory; each deletion is a version."""
    if not path:
        raise MemoryFault("memory_path_invalid", f"Cannot delete the {shown(mount, path)} directory itself.")
    store = mounted_store(mount)
    if store is None:
        raise MemoryFault("memory_not_found", f"The path {shown(mount, path)} does not exist.")
    paths = _paths_at(mount, store, path)
    for each in paths:
        file_write(mount, each, lambda current: None, operation="delete", writer=writer)
    return len(paths)


def tree_rename(mount: Mount, old: str, new: str, *, writer: Writer) -> int:
    """Move a file, or a directory's files, within one store: the new path is created (a
    version) before the old one is deleted (a version), in one transaction."""
    if not mount.writable:
        raise MemoryFault("memory_read_only", f"The store {mount.store.name!r} is shared with this agent read-only.")
    if not old:
        raise MemoryFault("memory_path_invalid", f"Cannot rename the {shown(mount, old)} directory itself.")
    if not new:  # the store's own folder, there as long as the store is mounted
        raise MemoryFault("memory_exists", f"The destination {shown(mount, new)} already exists.")
    if new == old or new.startswith(old + "/"):
        raise MemoryFault(
            "memory_path_invalid",
            f"Cannot rename {shown(mount, old)} to {shown(mount, new)}: a path cannot be moved into itself.",
        )
    with transaction.atomic():
        store = _store_locked(mount, writer)
        paths = _paths_at(mount, store, old)
        moves = [(each, new + each[len(old) :]) for each in paths]
        for _, target in moves:
            # Each path named was within the limit; a folder's file moved below a longer
            # name may not be (the column would refuse it, or store a path no one can name).
            if len(shown(mount, target)) > MAX_PATH_CHARS:
                raise MemoryFault(
                    "memory_path_invalid",
                    f"Renaming would make the path {shown(mount, target)[:80]}... longer than {MAX_PATH_CHARS} "
                    "characters. Choose a shorter name.",
                )
        taken = MemoryFile.objects.filter(store=store, deleted=False, path__in=[to for _, to in moves])
        if taken.exists():
            raise MemoryFault("memory_exists", f"The destination {shown(mount, taken.first().path)} already exists.")
        for source, target in moves:
            content = MemoryFile.objects.get(store=store, path=source).content
            _write_locked(mount, store, source, lambda current: None, operation="rename", writer=writer, expected=None)
            _write_locked(
                mount, store, target, lambda current, c=content: c, operation="rename", writer=writer, expected=None
            )
    return len(moves)


def _paths_at(mount: Mount, store: MemoryStore, path: str) -> list[str]:
    """The live file at `path`, or the live files below it; a fault (naming the path as the
    mount shows it) when there are none."""
    if MemoryFile.objects.filter(store=store, path=path, deleted=False).exists():
        return [path]
    paths = list(files_under(store, path).values_list("path", flat=True))
    if not paths:
        raise MemoryFault("memory_not_found", f"The path {shown(mount, path)} does not exist.")
    return paths


def version_revert(mount: Mount, version: MemoryVersion, *, writer: Writer) -> MemoryFile:
    """Write a version's content back as the file's newest version (a deletion version
    reverts to no file)."""
    path = version.file.path
    content = version.content
    return file_write(mount, path, lambda current: content, operation="revert", writer=writer)


def agent_memory_delete(*, agent_ids) -> int:
    """Delete the memory of agents that are being deleted: their stores, files and versions
    (and shares of those stores with other agents). Returns how many stores went."""
    agent_ids = list(agent_ids)
    MemoryStoreShare.objects.filter(agent_id__in=agent_ids).delete()
    # The stores first, as every write locks them before their files: a write under way
    # commits before its files are deleted, and a later one finds its store gone.
    stores = MemoryStore.objects.select_for_update().filter(agent_id__in=agent_ids).order_by("pk")
    list(stores.values_list("pk", flat=True))
    _, deleted = MemoryStore.objects.filter(agent_id__in=agent_ids).delete()
    return deleted.get("memory_app.MemoryStore", 0)
