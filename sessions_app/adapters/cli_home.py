"""Where a Claude Code agent's files live under PAPERCLIP_HOME: the CLI's config directory
(its local copy of each session's transcript, a cache of the store's) and the workspace it
acts in. Shared by the runtime and by the deletes that remove a session everywhere.

A workspace is its own git repository, and git is fenced at it: PAPERCLIP_HOME defaults to
`.paperclip` inside the service's own checkout, and without both an agent allowed Bash
would find that repository by walking up from its workspace (`git log` showed the
service's commits; `git reset` could rewrite them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from django.conf import settings


def agent_home(agent_id) -> Path:
    return Path(settings.PAPERCLIP_HOME) / "cli" / str(agent_id)


def config_dir(agent_id) -> Path:
    return agent_home(agent_id) / "config"


def workspace_for(agent_id, config: dict) -> Path:
    return Path(config.get("workspace") or Path(settings.PAPERCLIP_HOME) / "workspaces" / str(agent_id))


def git_fence(workspace: Path) -> dict[str, str]:
    """Environment that stops git's search for a repository at the workspace: git never
    moves up into the folder that holds it, so a subfolder without a repository of its own
    finds the workspace's, and nothing finds one around it."""
    return {"GIT_CEILING_DIRECTORIES": str(workspace.parent)}


def workspace_prepare(workspace: Path, *, home: Path) -> None:
    """Create the workspace, as a git repository of its own unless it is one already (an
    operator's `workspace` may be a checkout the agent is meant to work in). Without git on
    the worker there is nothing to fence. Raises OSError when it cannot be made."""
    workspace.mkdir(parents=True, exist_ok=True)
    git = shutil.which("git")
    if git is None or (workspace / ".git").exists():
        return
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "LANG": "C.UTF-8",
        **git_fence(workspace),
    }
    done = subprocess.run(
        [git, "-c", "init.defaultBranch=main", "init", "--quiet", str(workspace)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        raise OSError(f"git init failed in {workspace}: {done.stderr.strip()[-500:]}")


def local_copy_delete(*, agent_id, cli_session_id: str) -> None:
    """Remove the CLI's own files of a session from the agent's config directory: its
    transcript and the per-session state Claude Code keeps beside it."""
    if not cli_session_id or not re.fullmatch(r"[0-9a-fA-F-]{8,64}", cli_session_id):
        return
    root = config_dir(agent_id)
    for found in [*root.glob(f"*/{cli_session_id}*"), *root.glob(f"projects/*/{cli_session_id}*")]:
        if found.is_dir() and not found.is_symlink():
            shutil.rmtree(found, ignore_errors=True)
        else:
            found.unlink(missing_ok=True)
