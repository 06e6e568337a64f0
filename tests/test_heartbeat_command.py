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
