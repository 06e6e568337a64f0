"""An agent's own folders under PAPERCLIP_HOME (its sessions', its Claude Code home and its
default workspace) go with the agent: after the COMMIT that retires or removes it, or with
the maintenance pass when a run was still in flight or the removal failed."""

from __future__ import annotations

import logging
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import transaction
from django.utils import timezone

from sessions_app import agent_files
from sessions_app.agent_files import agent_folders
from sessions_app.maintenance import maintenance_pass
from sessions_app.models import Agent, AgentStatus, HeartbeatRun, RunStatus
from sessions_app.orphan_files import grace
from sessions_app.services import agent_delete, agents_hard_delete
from tests.conftest import Actor

pytestmark = pytest.mark.django_db(transaction=True)


def folders_with_files(agent) -> list[Path]:
    """A file in each of the agent's folders, one a level down, as a run in flight, Claude
    Code and the agent's own commands leave them."""
    folders = agent_folders(agent.pk)
    for folder in folders:
        (folder / "deeper").mkdir(parents=True)
        (folder / "deeper" / "left.txt").write_text("x")
    return folders


def later():
    return timezone.now() + grace() + timedelta(minutes=1)


def test_retiring_an_agent_removes_its_folders_after_the_commit(persistent_agent, other_agent):
    gone = folders_with_files(persistent_agent)
    kept = folders_with_files(other_agent)

    agent_delete(agent=persistent_agent, now=timezone.now())

    assert [folder.exists() for folder in gone] == [False] * 3
    assert [folder.exists() for folder in kept] == [True] * 3
    assert all(folder.parent.is_dir() for folder in gone)  # the roots stay


def test_a_retirement_rolled_back_keeps_the_folders(persistent_agent):
    folders = folders_with_files(persistent_agent)

    with pytest.raises(RuntimeError), transaction.atomic():
        agent_delete(agent=persistent_agent, now=timezone.now())
        raise RuntimeError("the caller's transaction fails after the retirement")

    assert Agent.objects.get(pk=persistent_agent.pk).status == "active"
    assert [(folder / "deeper" / "left.txt").exists() for folder in folders] == [True] * 3


def test_removing_agents_entirely_removes_their_folders(persistent_agent, stateless_agent, other_agent):
    gone = folders_with_files(persistent_agent) + folders_with_files(stateless_agent)
    kept = folders_with_files(other_agent)

    agents_hard_delete(
        agents=Agent.objects.filter(pk__in=[persistent_agent.pk, stateless_agent.pk]), now=timezone.now()
    )

    assert not any(folder.exists() for folder in gone)
    assert all(folder.exists() for folder in kept)


def test_an_operators_own_workspace_is_never_touched(persistent_agent, tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "src").mkdir(parents=True)
    (checkout / "src" / "main.py").write_text("print('kept')")
    persistent_agent.adapter_config = {"model": "claude-opus-4-5", "runtime": "cli", "workspace": str(checkout)}
    persistent_agent.save()
    folders = folders_with_files(persistent_agent)

    agent_delete(agent=persistent_agent, now=timezone.now())

    assert not any(folder.exists() for folder in folders)
    assert (checkout / "src" / "main.py").read_text() == "print('kept')"


def test_a_default_workspace_that_a_live_agent_works_in_stays(persistent_agent, stateless_agent):
    """An operator pointed another agent's `workspace` into this agent's default one."""
    sessions, cli, workspace = folders_with_files(persistent_agent)
    stateless_agent.adapter_config = {
        "model": "claude-opus-4-5",
        "runtime": "cli",
        "workspace": str(workspace / "deeper"),
    }
    stateless_agent.save()

    agent_delete(agent=persistent_agent, now=timezone.now())

    assert (workspace / "deeper" / "left.txt").exists()
    assert not sessions.exists() and not cli.exists()


def test_a_run_in_flight_at_the_retirement_keeps_the_folders_until_the_pass_after_the_grace(
    persistent_agent, paperclip_home, caplog
):
    """The agent's Claude Code is still running when it is retired: its folders stay (the
    run writes there, and its watchdog needs nothing of them), the run writes a file after the
    retirement committed, and ends. The pass leaves the folders while the retirement is
    younger than the grace, then removes everything, the late file included."""
    run = HeartbeatRun.objects.create(
        company=persistent_agent.company,
        agent=persistent_agent,
        task="t",
        status=RunStatus.RUNNING,
        started_at=timezone.now(),
    )
    folders = folders_with_files(persistent_agent)
    workspace = folders[2]

    agent_delete(agent=persistent_agent, now=timezone.now())
    assert all(folder.exists() for folder in folders)

    def run_writes_and_ends():
        (workspace / "written-after.txt").write_text("late")
        HeartbeatRun.objects.filter(pk=run.pk).update(status=RunStatus.FAILED, error_code="agent_deleted")

    actor = Actor(run_writes_and_ends)
    actor.start()
    actor.result()

    assert maintenance_pass(now=timezone.now() + grace() - timedelta(minutes=1))["orphan_files"] == 0
    assert (workspace / "written-after.txt").exists()

    (paperclip_home / ".orphan-files-swept").unlink()  # the next pass sweeps
    with caplog.at_level(logging.INFO, logger="sessions_app.agent_files"):
        assert maintenance_pass(now=later())["orphan_files"] == 4

    assert not any(folder.exists() for folder in folders)
    logged = {record.getMessage() for record in caplog.records if record.name == "sessions_app.agent_files"}
    assert logged == {f"Removed {folder}, the folder of a deleted agent" for folder in folders}


def test_the_pass_removes_the_folders_of_retirements_older_than_the_grace_only(
    persistent_agent, stateless_agent, paperclip_home
):
    """A worker killed right after the retirement's COMMIT: nothing removed its folders."""
    live = folders_with_files(persistent_agent)
    retired = folders_with_files(stateless_agent)
    Agent.objects.filter(pk=stateless_agent.pk).update(status=AgentStatus.DELETED, deleted_at=timezone.now())

    assert maintenance_pass(now=timezone.now() + grace() - timedelta(minutes=1))["orphan_files"] == 0
    assert [folder.exists() for folder in live + retired] == [True] * 6

    (paperclip_home / ".orphan-files-swept").unlink()
    assert maintenance_pass(now=later())["orphan_files"] == 3
    assert all(folder.exists() for folder in live)
    assert not any(folder.exists() for folder in retired)


def test_a_removal_that_fails_is_logged_and_finished_by_the_pass(persistent_agent, monkeypatch, caplog):
    folders = folders_with_files(persistent_agent)
    real = shutil.rmtree

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(agent_files.shutil, "rmtree", refused)
    with caplog.at_level(logging.WARNING, logger="sessions_app.agent_files"):
        agent_delete(agent=persistent_agent, now=timezone.now())

    assert Agent.objects.get(pk=persistent_agent.pk).status == "deleted"
    assert all(folder.exists() for folder in folders)
    assert [record.levelname for record in caplog.records if record.name == "sessions_app.agent_files"] == [
        "WARNING"
    ] * 3

    monkeypatch.setattr(agent_files.shutil, "rmtree", real)
    assert maintenance_pass(now=later())["orphan_files"] == 3
    assert not any(folder.exists() for folder in folders)


def test_no_symbolic_link_is_followed(persistent_agent, tmp_path):
    """A folder that is a link (a workspace on another disk) is left as it is; a link inside
    a folder goes as a link, and what it points at stays."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("kept")
    sessions, cli, workspace = agent_folders(persistent_agent.pk)
    workspace.parent.mkdir(parents=True)
    workspace.symlink_to(outside, target_is_directory=True)
    cli.mkdir(parents=True)
    (cli / "link").symlink_to(outside, target_is_directory=True)

    agent_delete(agent=persistent_agent, now=timezone.now())

    assert not cli.exists()
    assert workspace.is_symlink()
    assert (outside / "precious.txt").read_text() == "kept"
