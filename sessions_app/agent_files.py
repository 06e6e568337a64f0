"""An agent's own folders under PAPERCLIP_HOME, removed with the agent.

Three are named by its id and hold what only the agent names: `sessions/` (history files and
Claude Code transcripts, and what a run in flight at the delete staged there), `cli/` (Claude
Code's HOME and config directory: its caches, the per-session state it keeps beside a
transcript, what the agent's commands write to `~`) and `workspaces/` (a `cli` agent's
default workspace: the files it worked on). Deleting the sessions removes the files their
rows name; the folders go with the agent:

- retired (`services.agent_delete`) or removed entirely (`services.agents_hard_delete`):
  after the COMMIT, unless a run of the agent is still in flight (its Claude Code may be
  writing there); then with the maintenance pass's sweep;
- the sweep (`retired_agents_folders_remove`, with `orphan_files`) removes the folders of
  agents retired longer ago than the grace: what a run in flight at the delete wrote after
  it, and what a worker killed after the COMMIT, or a removal that failed, left behind.

`outputs/{agent_id}` (Managed Agents copies) goes with `managed_outputs.outputs_delete`,
which removes it even under a copy in flight (the copy removes what it wrote again). An
operator's own `workspace` (any path other than the default) is never touched, and a
default workspace that a live agent names as its `workspace` stays. No symbolic link is
followed: a folder that is one is left as it is. The folders of an agent this database has
no row for are left alone (the sweep's reasons, `orphan_files`): only a removal after the
COMMIT that failed leaves an agent removed entirely with folders, and it is logged.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from itertools import islice
from pathlib import Path

from django.conf import settings
from django.db import transaction

from sessions_app.durable import agent_folders_in, path_within
from sessions_app.models import IN_FLIGHT_RUN_STATUSES, Agent, AgentStatus, HeartbeatRun

logger = logging.getLogger(__name__)

ROOTS = ("sessions", "cli", "workspaces")
BATCH = 500


def agent_folders(agent_id) -> list[Path]:
    home = Path(settings.PAPERCLIP_HOME)
    return [home / root / str(agent_id) for root in ROOTS]


def agents_folders_remove_after_commit(agent_ids: list) -> None:
    """Inside the transaction that retires or removes the agents: their folders go once it
    has committed (a rollback keeps them, with the rows that name their files). A failure
    there is logged, never raised to the deletion's caller, whose deletion stands: the
    maintenance pass removes a retired agent's folders later."""
    ids = list(agent_ids)
    if ids:
        transaction.on_commit(lambda: agents_folders_remove(ids), robust=True)


def agents_folders_remove(agent_ids: list) -> int:
    """Remove the folders of these agents, those of agents with no run in flight; returns
    how many files went. A folder that cannot be removed is logged and left."""
    busy = set(
        HeartbeatRun.objects.filter(agent_id__in=agent_ids, status__in=IN_FLIGHT_RUN_STATUSES).values_list(
            "agent_id", flat=True
        )
    )
    named = _workspaces_named_by_live_agents(exclude=agent_ids)
    removed = 0
    for agent_id in agent_ids:
        if agent_id in busy:
            continue
        for folder in agent_folders(agent_id):
            if any(path_within(path, folder) for path in named):
                logger.info("Kept %s: a live agent's workspace is in it", folder)
                continue
            removed += _folder_remove(folder)
    return removed


def retired_agents_folders_remove(*, now: datetime, grace: timedelta) -> int:
    """The sweep's part: the folders of agents retired before `now - grace`; returns how
    many files went."""
    cutoff = now - grace
    removed = 0
    for chunk in _batches(_folder_agent_ids()):
        retired = list(
            Agent.objects.filter(pk__in=chunk, status=AgentStatus.DELETED, deleted_at__lt=cutoff).values_list(
                "pk", flat=True
            )
        )
        if retired:
            removed += agents_folders_remove(retired)
    return removed


def _folder_agent_ids() -> Iterator[uuid.UUID]:
    """The ids named by the folders of the roots, each once."""
    seen: set[uuid.UUID] = set()
    home = Path(settings.PAPERCLIP_HOME)
    for root in ROOTS:
        for agent_id, _ in agent_folders_in(home / root):
            if agent_id not in seen:
                seen.add(agent_id)
                yield agent_id


def _batches(items: Iterable) -> Iterator[list]:
    items = iter(items)
    while batch := list(islice(items, BATCH)):
        yield batch


def _workspaces_named_by_live_agents(*, exclude: list) -> list[Path]:
    """The `workspace` paths of the other agents that are not retired."""
    paths = (
        Agent.objects.exclude(pk__in=exclude)
        .exclude(status=AgentStatus.DELETED)
        .filter(adapter_config__has_key="workspace")
        .values_list("adapter_config__workspace", flat=True)
    )
    return [Path(path) for path in paths if isinstance(path, str) and path]


def _folder_remove(folder: Path) -> int:
    """Remove `folder` and everything in it, never through a symbolic link (one inside is
    removed as a link); how many files went."""
    if folder.is_symlink() or not folder.is_dir():
        return 0
    files = sum(len(names) for _, _, names in os.walk(folder))
    try:
        shutil.rmtree(folder)
    except FileNotFoundError:
        pass  # removed meanwhile, by another pass
    except OSError as exc:
        logger.warning("Could not remove %s, the folder of a deleted agent: %s", folder, exc)
        return 0
    logger.info("Removed %s, the folder of a deleted agent", folder)
    return files
