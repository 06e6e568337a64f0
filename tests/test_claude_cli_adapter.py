"""`claude-code` with `runtime: "cli"`: the real bundled Claude Code CLI against the fake
Messages API. Kept few: each starts the CLI (about half a second)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest
from django.utils import timezone

from costs_app.models import CostEvent
from costs_app.pricing import call_cost
from sessions_app.adapters import AgentConfigError
from sessions_app.adapters.claude_cli import config_dir
from sessions_app.models import Agent, AgentSession, CliTranscriptEntry, RunStatus
from sessions_app.services import session_delete
from sessions_app.stores import store_for
from tests.conftest import beat
from tests.fake_anthropic import Reply


def cli_agent(company, **config) -> Agent:
    return Agent.objects.create(
        company=company,
        name="Coder",
        system_prompt="You are the release engineer.",
        adapter_type="claude-code",
        adapter_config={"runtime": "cli", "timeout_seconds": 60, **config},
    )


def workspace(agent: Agent) -> Path:
    from django.conf import settings

    return Path(settings.PAPERCLIP_HOME) / "workspaces" / str(agent.id)


def test_the_agent_writes_a_file_in_its_workspace_and_the_ledger_matches_the_fakes_usage(company, fake_anthropic):
    agent = cli_agent(company)
    target = workspace(agent) / "notes.txt"
    fake_anthropic.push(
        Reply.tool_use("Write", {"file_path": str(target), "content": "shipped\n"}),
        Reply.message("I wrote notes.txt."),
    )

    run = beat(agent, "write the release notes")

    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    assert target.read_text() == "shipped\n"
    assert run.output == "I wrote notes.txt."
    assert run.runtime_report["num_turns"] == 2
    assert run.runtime_report["tool_calls"] == [
        {"name": "Write", "input": {"file_path": str(target), "content": "shipped\n"}}
    ]
    # What the CLI sent: a stream, our system prompt appended to Claude Code's, the safe tools.
    bodies = fake_anthropic.message_requests
    assert all(body["stream"] for body in bodies)
    assert "You are the release engineer." in str(bodies[0]["system"])
    assert sorted(tool["name"] for tool in bodies[0]["tools"]) == ["Bash", "Edit", "Glob", "Grep", "Read", "Write"]
    # The ledger, to the token: the usage the fake reported over both requests.
    usages = [r["usage"] for r in fake_anthropic.requests if r["path"] == "/v1/messages"]
    assert len(usages) == 2
    (event,) = CostEvent.objects.filter(run=run)
    assert event.model == "claude-sonnet-4-5"
    assert event.input_tokens == sum(u["input_tokens"] for u in usages)
    assert event.output_tokens == sum(u["output_tokens"] for u in usages)
    assert event.cache_creation_5m_input_tokens == sum(u["cache_creation_input_tokens"] for u in usages)
    assert event.cache_read_input_tokens == sum(u["cache_read_input_tokens"] for u in usages)
    assert run.cost_usd == event.cost_usd == call_cost(usage=event.raw_usage, model=event.model, at=event.created_at)
    assert Decimal(run.runtime_report["cli_total_cost_usd"]).quantize(Decimal("0.000001")) == event.cost_usd.quantize(
        Decimal("0.000001")
    )
    # Stateless: no CLI session is kept, here or in the CLI's own directory.
    assert not AgentSession.objects.filter(agent=agent).exists()
    assert not list(config_dir(agent.id).glob("projects/*/*.jsonl"))


def test_configuration_is_validated_when_the_agent_is_saved(company):
    with pytest.raises(AgentConfigError) as caught:
        cli_agent(
            company,
            allowed_tools="Bash",
            permission_mode="yolo",
            max_turns=0,
            max_budget_usd=-1,
            workspace="relative/dir",
            effort="huge",
            thinking={"type": "enabled"},
            max_tokens=100,
        )
    assert set(caught.value.fields) == {
        f"adapter_config.{key}"
        for key in (
            "allowed_tools",
            "permission_mode",
            "max_turns",
            "max_budget_usd",
            "workspace",
            "effort",
            "thinking",
            "max_tokens",
        )
    }
    agent = cli_agent(company)
    assert agent.adapter_config["allowed_tools"] == ["Read", "Edit", "Write", "Glob", "Grep", "Bash"]
    assert agent.adapter_config["permission_mode"] == "dontAsk"
    with pytest.raises(AgentConfigError) as caught:
        Agent.objects.create(company=company, name="x", adapter_config={"runtime": "shell"})
    assert set(caught.value.fields) == {"adapter_config.runtime"}


def test_the_cli_sees_no_secret_of_the_service(company, fake_anthropic, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://secret@db/prod")
    monkeypatch.setenv("DJANGO_SECRET_KEY", "very-secret")
    monkeypatch.setenv("REDIS_URL", "redis://secret@cache:6379/0")
    agent = cli_agent(company)
    fake_anthropic.push(Reply.tool_use("Bash", {"command": "env", "description": "probe"}), Reply.message("probed"))

    run = beat(agent, "show the environment")

    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    second = fake_anthropic.message_requests[1]
    (result,) = [
        block
        for message in second["messages"]
        if isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]
    output = str(result["content"])
    assert "ANTHROPIC_BASE_URL=" in output  # the probe did run `env`
    for secret in ("DATABASE_URL", "DJANGO_SECRET_KEY", "REDIS_URL", "very-secret", "secret@"):
        assert secret not in output
    assert f"CLAUDE_CONFIG_DIR={config_dir(agent.id)}" in output


def test_persistent_sessions_resume_from_the_store_after_the_local_copy_is_gone(company, fake_anthropic):
    agent = cli_agent(company, session_mode="persistent")

    first = beat(agent, "remember the codeword heron")
    session = AgentSession.objects.get(agent=agent)
    assert first.status == RunStatus.SUCCEEDED, (first.error_code, first.error)
    assert session.cli_session_id
    # The CLI's own copy goes; the store is the record.
    for path in config_dir(agent.id).glob("projects/*/*.jsonl"):
        path.unlink()
    fake_anthropic.reset_log()

    second = beat(agent, "what was the codeword?")

    assert second.status == RunStatus.SUCCEEDED, (second.error_code, second.error)
    session.refresh_from_db()
    assert second.session_id == first.session_id == session.id
    assert second.runtime_report["cli_session_id"] == session.cli_session_id
    (body,) = fake_anthropic.message_requests
    assert "remember the codeword heron" in str(body["messages"])
    assert session.message_count == 4
    assert [m["role"] for m in store_for(session).read(session)] == ["user", "assistant", "user", "assistant"]


@pytest.mark.parametrize("store", ["database", "file"])
def test_deleting_the_session_removes_its_transcript_from_the_store_and_disk(
    company, fake_anthropic, settings, store, django_capture_on_commit_callbacks
):
    settings.PAPERCLIP_SESSION_STORE = store
    agent = cli_agent(company, session_mode="persistent")
    beat(agent, "one")
    session = AgentSession.objects.get(agent=agent)
    cli_id = session.cli_session_id
    stored = CliTranscriptEntry.objects.filter(session_id=cli_id)
    files = lambda: list(session_store_root(agent).rglob("*.jsonl"))  # noqa: E731
    assert (stored.exists(), bool(files())) == (store == "database", store == "file")
    assert list(config_dir(agent.id).rglob(f"{cli_id}.jsonl"))  # the CLI's local copy

    with django_capture_on_commit_callbacks(execute=True):
        session_delete(session=session, now=timezone.now())

    assert not stored.exists()
    assert not files()
    assert not list(config_dir(agent.id).rglob(f"*{cli_id}*"))


def session_store_root(agent) -> Path:
    from django.conf import settings

    return Path(settings.PAPERCLIP_HOME) / "sessions" / str(agent.id) / "cli"
