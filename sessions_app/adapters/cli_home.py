"""Where a Claude Code agent's files live under PAPERCLIP_HOME: the CLI's config directory
(its local copy of each session's transcript, a cache of the store's) and the workspace it
acts in. Shared by the runtime and by the deletes that remove a session everywhere."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from django.conf import settings


def agent_home(agent_id) -> Path:
    return Path(settings.PAPERCLIP_HOME) / "cli" / str(agent_id)


def config_dir(agent_id) -> Path:
    return agent_home(agent_id) / "config"


def workspace_for(agent_id, config: dict) -> Path:
    return Path(config.get("workspace") or Path(settings.PAPERCLIP_HOME) / "workspaces" / str(agent_id))


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
