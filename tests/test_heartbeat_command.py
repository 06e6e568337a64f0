"""`manage.py heartbeat AGENT_ID --task ...`: the agent is named by its UUID."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from sessions_app.models import HeartbeatRun


def test_an_agent_is_not_named_by_a_session_style_id(persistent_agent, fake_anthropic):
    with pytest.raises(CommandError, match="No agent with id"):
        call_command("heartbeat", f"sess_{persistent_agent.id.hex}", "--task", "hello")
    assert not HeartbeatRun.objects.exists()


def test_an_agent_named_by_its_uuid_runs_once(persistent_agent, fake_anthropic, capsys):
    call_command("heartbeat", str(persistent_agent.id).upper(), "--task", "hello")
    assert HeartbeatRun.objects.get().status == "succeeded"


def test_a_run_skipped_by_its_work_check_is_reported_and_not_an_error(
    stateless_agent, fake_anthropic, tmp_path, capsys
):
    import sys

    script = tmp_path / "none.py"
    script.write_text("raise SystemExit(1)\n")
    stateless_agent.adapter_config = {
        **stateless_agent.adapter_config,
        "work_check": {"command": [sys.executable, str(script)]},
    }
    stateless_agent.save()
    call_command("heartbeat", str(stateless_agent.id), "--task", "anything?")
    assert "skipped: the work check found no work" in capsys.readouterr().out
    assert HeartbeatRun.objects.get().status == "skipped"
    assert fake_anthropic.requests == []
