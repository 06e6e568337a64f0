"""Files under PAPERCLIP_HOME named by ids from elsewhere, and written so that they survive a
crash once a database row names them."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

logger = logging.getLogger(__name__)


def file_name(key: str) -> str:
    """An id from elsewhere (Claude Code's transcript keys, the provider's file and session
    ids) as one name in a folder: percent-encoded, so "/" cannot leave it, and "." or ".."
    (which quote leaves as they are) with their dots encoded too. `unquote` gives the id back."""
    name = quote(key, safe="")
    return name.replace(".", "%2E") if name.strip(".") == "" else name


def fsync_directory(folder: Path) -> None:
    """Flush a folder's entries: a rename into it is on disk only once this returns, so a
    COMMIT that names the renamed file must come after it."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def folders_make(folder: Path) -> None:
    """`folder` and the folders above it that are missing, each flushed into the one that
    holds it: a file made in it survives a crash once its own folder is flushed too."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for made in reversed(missing):
        made.mkdir(exist_ok=True)
        fsync_directory(made.parent)


def folder_entries(folder: Path, *, folders: bool) -> Iterator[os.DirEntry]:
    """The folders (or regular files) in `folder`, as they are read, never through a
    symbolic link: one in the stores' folders is none of ours, and may point anywhere."""
    if folder.is_symlink() or not folder.is_dir():
        return
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) if folders else entry.is_file(follow_symlinks=False):
                    yield entry
    except FileNotFoundError:
        return  # removed meanwhile (a deletion after its COMMIT)
    except OSError as exc:
        logger.warning("Could not list %s: %s", folder, exc)


def agent_folders_in(root: Path) -> Iterator[tuple[uuid.UUID, Path]]:
    """The folders of `root` named by an agent's id, as the stores name them (`{agent_id}`)."""
    for entry in folder_entries(root, folders=True):
        try:
            agent_id = uuid.UUID(entry.name)
        except ValueError:
            continue  # not a folder the stores make
        if str(agent_id) == entry.name:
            yield agent_id, Path(entry.path)


def path_within(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies in it, symbolic links resolved on both sides."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents
