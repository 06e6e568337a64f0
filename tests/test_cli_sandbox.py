"""Claude Code in its bubblewrap sandbox (`PAPERCLIP_CLI_SANDBOX`): the real bundled CLI
against the fake Messages API, its agent's `Bash` probing what the worker's user can read."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from django.db import connection

from sessions_app.checks import check_cli_sandbox
from sessions_app.models import RunStatus
from tests.conftest import beat
from tests.fake_anthropic import Reply
from tests.test_claude_cli_adapter import cli_agent, workspace

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)")


@pytest.fixture(autouse=True)
def worker_home(monkeypatch):
    """The worker's user's home directory, where credentials live (`Path.home()` reads HOME):
    in /var/tmp, since the sandbox hides all of the host's /tmp anyway."""
    home = Path(tempfile.mkdtemp(prefix="paperclip-worker-home-", dir="/var/tmp"))
    monkeypatch.setenv("HOME", str(home))
    yield home
    shutil.rmtree(home, ignore_errors=True)


def tool_output(fake, request: int = 1) -> str:
    """What the agent's one tool printed, as the request after it sent it back."""
    (result,) = [
        block
        for message in fake.message_requests[request]["messages"]
        if isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]
    return str(result["content"])


def probe(company, fake, paperclip_home: Path):
    """Files the worker's user can read, and the command that looks for them: a file in
    PAPERCLIP_HOME (the secret key's place), one in the user's home directory (`~/.pgpass`'s),
    another agent's workspace, this database's file (SQLite), the worker's processes; and a
    file the agent writes in its own workspace."""
    (paperclip_home / "secret-probe.txt").write_text("top secret\n")
    (Path.home() / ".pgpass").write_text("db:5432:*:paperclip:the-database-password\n")
    other = cli_agent(company)
    workspace(other).mkdir(parents=True)
    (workspace(other) / "theirs.txt").write_text("another agent's work\n")
    database = connection.settings_dict["NAME"] if connection.vendor == "sqlite" else "/dev/null"
    command = (
        f"cat {paperclip_home}/secret-probe.txt; cat {Path.home()}/.pgpass; cat {workspace(other)}/theirs.txt; "
        f"head -c 15 {database}; echo; ls /proc | grep -c '^[0-9]'; "
        "echo mine > ours.txt && cat ours.txt"
    )
    fake.push(Reply.tool_use("Bash", {"command": command, "description": "probe"}), Reply.message("probed"))
    agent = cli_agent(company, session_mode="persistent")
    return agent


def test_an_agents_commands_see_none_of_the_services_files_and_write_their_workspace(
    company, fake_anthropic, settings, paperclip_home
):
    settings.PAPERCLIP_CLI_SANDBOX = "bwrap"
    agent = probe(company, fake_anthropic, paperclip_home)

    run = beat(agent, "look around")

    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    output = tool_output(fake_anthropic)
    assert "mine" in output  # the probe ran, and wrote its own workspace
    assert (workspace(agent) / "ours.txt").read_text() == "mine\n"
    for secret in ("top secret", "the-database-password", "another agent's work", "SQLite format"):
        assert secret not in output
    # Only the run's own processes are in /proc: bubblewrap's, the CLI and the command's shell.
    process_count = int([line for line in output.splitlines() if line.strip().isdigit()][0])
    assert process_count < 10, output


def test_a_workspace_that_holds_paperclip_home_still_shows_none_of_it(
    company, fake_anthropic, settings, paperclip_home
):
    """An operator's workspace around PAPERCLIP_HOME (a checkout whose `.paperclip` it is):
    mounted writable, it would show PAPERCLIP_HOME again, so that is hidden after it."""
    settings.PAPERCLIP_CLI_SANDBOX = "bwrap"
    (paperclip_home / "secret-probe.txt").write_text("top secret\n")
    around = paperclip_home.parent
    command = f"cat {paperclip_home}/secret-probe.txt; echo mine > {around}/ours.txt && cat {around}/ours.txt"
    fake_anthropic.push(Reply.tool_use("Bash", {"command": command, "description": "probe"}), Reply.message("probed"))

    run = beat(cli_agent(company, workspace=str(around)), "look around")

    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    output = tool_output(fake_anthropic)
    assert "mine" in output and (around / "ours.txt").read_text() == "mine\n"
    assert "top secret" not in output


def test_without_the_sandbox_the_same_commands_read_them(company, fake_anthropic, settings, paperclip_home):
    """The probe can fail: unsandboxed, it reads all of it."""
    settings.PAPERCLIP_CLI_SANDBOX = "off"
    agent = probe(company, fake_anthropic, paperclip_home)

    run = beat(agent, "look around")

    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    output = tool_output(fake_anthropic)
    assert "top secret" in output and "another agent's work" in output and "the-database-password" in output
    if connection.vendor == "sqlite":
        assert "SQLite format" in output


def test_a_session_resumes_in_the_sandbox(company, fake_anthropic, settings):
    """The SDK puts a resumed session's transcript in a config directory of its own, which
    the launcher mounts into the sandbox."""
    settings.PAPERCLIP_CLI_SANDBOX = "bwrap"
    agent = cli_agent(company, session_mode="persistent")
    fake_anthropic.push(Reply.message("first"), Reply.message("second"))

    first = beat(agent, "remember the word plum")
    second = beat(agent, "which word?")

    assert (first.status, second.status) == (RunStatus.SUCCEEDED, RunStatus.SUCCEEDED), (
        second.error_code,
        second.error,
    )
    assert first.session_id == second.session_id
    sent = str(fake_anthropic.message_requests[-1]["messages"])
    assert "remember the word plum" in sent  # the resumed transcript reached the model


def test_a_required_sandbox_that_cannot_be_made_fails_the_run_before_anything_is_sent(
    company, fake_anthropic, settings, monkeypatch
):
    settings.PAPERCLIP_CLI_SANDBOX = "bwrap"
    monkeypatch.setenv("PATH", "/nonexistent")  # no bubblewrap to be found

    run = beat(cli_agent(company), "go")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "cli_sandbox_unavailable")
    assert "apt-get install bubblewrap" in run.error
    assert fake_anthropic.message_requests == []


@pytest.mark.parametrize("mode", ["auto", "bwrap"])
def test_the_system_check_names_a_host_where_claude_code_agents_cannot_be_sandboxed(
    company, settings, monkeypatch, mode
):
    settings.PAPERCLIP_CLI_SANDBOX = mode
    assert check_cli_sandbox(None) == []  # no Claude Code agent
    cli_agent(company)
    assert check_cli_sandbox(None) == []  # bubblewrap works here

    monkeypatch.setenv("PATH", "/nonexistent")
    (warning,) = check_cli_sandbox(None)

    assert warning.id == "paperclip.W008"
    outcome = "without their sandbox" if mode == "auto" else "not at all (cli_sandbox_unavailable)"
    assert warning.msg == (
        f"Claude Code agents run {outcome} on this host: bubblewrap is not installed on this host "
        "(Debian: apt-get install bubblewrap)."
    )
    settings.PAPERCLIP_CLI_SANDBOX = "off"
    assert check_cli_sandbox(None) == []
