"""Each Claude Code run in a bubblewrap sandbox: the agent's commands see the host read-only
and nothing of the service's own files.

An agent allowed `Bash` runs commands as the worker's user, who can read the database of the
embedded default, the secret key, every agent's histories, transcripts, homes and workspaces
under PAPERCLIP_HOME. In the sandbox (`bwrap`, Debian's `bubblewrap`, unprivileged):

- the host's filesystem is mounted read-only; PAPERCLIP_HOME and the worker's user's home
  directory (its credentials: `~/.pgpass`, `~/.ssh`) are empty tmpfs, and an SQLite
  database kept outside them is hidden (each of its files that exists, behind /dev/null);
- in it, only the agent's own home (Claude Code's config directory) and workspace are
  mounted back, writable, and the session's config directory the SDK makes to resume one
  (`claude_cli_launch.sh` adds it: only the SDK knows its path);
- `/tmp` is a tmpfs of the run's own, `/dev` a minimal one, and `/proc` shows only the
  run's processes (a pid namespace), never the worker's or another agent's;
- the network is the host's (Claude Code calls the API from inside).

`PAPERCLIP_CLI_SANDBOX`: `auto` (the default in `local_trusted` mode) runs each CLI in the
sandbox where bubblewrap works on this host, and without it, with a warning once per
process, where it does not; `bwrap` (the default in `authenticated` mode) requires it (a run
fails `cli_sandbox_unavailable` rather than run unsandboxed); `off` never uses it. The check
runs bubblewrap once per worker process.
"""

from __future__ import annotations

import functools
import logging
import shutil
import subprocess
from pathlib import Path

from django.conf import settings
from django.db import connections

from sessions_app.adapters.base import AdapterError
from sessions_app.durable import path_within

logger = logging.getLogger(__name__)

# The mounts every sandbox starts with; the rest follow them (a later mount covers an earlier).
BASE = [
    *("--die-with-parent", "--unshare-pid", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"),
    *("--tmpfs", "/tmp"),  # noqa: S108 - the run's own /tmp in the sandbox, not a file in the host's
]
SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")


def sandbox_arguments(*, home: Path, workspace: Path, cli: Path) -> list[str]:
    """bubblewrap's command line for one run, up to the CLI's own (the launcher adds the
    session's config directory and `--`); [] to run the CLI as it is."""
    mode = settings.PAPERCLIP_CLI_SANDBOX
    if mode == "off":
        return []
    if (why := sandbox_unavailable()) is not None:
        if mode == "bwrap":
            raise AdapterError("cli_sandbox_unavailable", f"PAPERCLIP_CLI_SANDBOX is bwrap, and bubblewrap {why}")
        _warn_unsandboxed(why)
        return []
    paperclip_home = Path(settings.PAPERCLIP_HOME)
    hidden = _hidden_folders(paperclip_home)
    arguments = [str(shutil.which("bwrap")), *BASE]
    # Each mount covers what an earlier one showed at its place: the hidden folders are
    # emptied after the workspace is mounted (an operator's workspace may hold one: a
    # checkout whose `.paperclip` it is), then what the run needs inside them is mounted
    # back, and the database's files are hidden last, wherever they are.
    arguments += ["--bind", str(workspace), str(workspace)]
    for folder in hidden:
        arguments += ["--tmpfs", str(folder)]
    arguments += ["--ro-bind", str(cli), str(cli)]
    for writable in (home, workspace):
        if any(path_within(writable, folder) for folder in hidden):
            arguments += ["--bind", str(writable), str(writable)]
    for database_file in _sqlite_files_outside(paperclip_home):
        arguments += ["--ro-bind", "/dev/null", str(database_file)]
    return arguments


def _hidden_folders(paperclip_home: Path) -> list[Path]:
    """PAPERCLIP_HOME, and the worker's user's home directory (credentials: `~/.pgpass`,
    `~/.ssh`, a cloud CLI's), shallowest first so that neither covers the other's tmpfs."""
    folders = [paperclip_home.resolve()]
    try:
        user_home = Path.home().resolve()
    except (KeyError, RuntimeError):
        user_home = None  # a user without a home: nothing of it to hide
    if user_home is not None and user_home != Path("/") and user_home.is_dir():
        folders.append(user_home)
    return sorted(set(folders), key=lambda folder: len(folder.parts))


def sandbox_unavailable() -> str | None:
    """Why bubblewrap cannot sandbox a run on this host, or None when it can."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "is not installed on this host (Debian: apt-get install bubblewrap)"
    if not _works(bwrap):
        return "cannot make a sandbox on this host (are unprivileged user namespaces allowed?)"
    return None


@functools.cache
def _works(bwrap: str) -> bool:
    """Whether bubblewrap makes a sandbox here, as the runs' sandboxes are made."""
    try:
        done = subprocess.run([bwrap, *BASE, "true"], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    if done.returncode != 0:
        logger.warning("bubblewrap cannot make a sandbox here: %s", done.stderr.decode(errors="replace").strip())
    return done.returncode == 0


@functools.cache
def _warn_unsandboxed(why: str) -> None:
    logger.warning(
        "Claude Code runs without a sandbox on this host: bubblewrap %s. Its agents' commands can read what the "
        "worker's user can; install bubblewrap, or set PAPERCLIP_CLI_SANDBOX=bwrap to refuse such runs.",
        why,
    )


def _sqlite_files_outside(home: Path) -> list[Path]:
    """The files of the SQLite databases this service uses that lie outside `home` (the
    tmpfs hides those inside), those that exist now."""
    found = []
    for alias in connections:
        database = connections[alias].settings_dict
        if database["ENGINE"] != "django.db.backends.sqlite3":
            continue
        name = Path(str(database["NAME"])).resolve()
        if path_within(name, home):
            continue
        found += [path for suffix in SQLITE_SUFFIXES if (path := name.with_name(name.name + suffix)).exists()]
    return found
