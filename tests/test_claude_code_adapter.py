"""The `claude-code` adapter through the real SDK and the fake Messages API: every API fault
ends the run with a stable code and changes nothing, and the API key reaches no log or row."""

from __future__ import annotations

import logging

import pytest

from costs_app.models import CostEvent
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus
from tests.conftest import FAKE_API_KEY, beat, snapshot
from tests.fake_anthropic import Reply


@pytest.mark.parametrize(
    ("replies", "config", "status", "code", "calls"),
    [
        ([Reply.error(429, "slow down", retry_after_ms=20)], {}, RunStatus.SUCCEEDED, "", 2),
        ([Reply.error(529, "overloaded", 1)] * 2, {}, RunStatus.SUCCEEDED, "", 3),
        ([Reply.error(529, "overloaded", 1)] * 3, {}, RunStatus.FAILED, "model_overloaded", 3),
        ([Reply.error(500, "boom", 1)] * 3, {}, RunStatus.FAILED, "model_server_error", 3),
        ([Reply.delay(3)], {"timeout_seconds": 0.5, "max_retries": 0}, RunStatus.FAILED, "model_timeout", 1),
        ([Reply.reset()], {"max_retries": 0}, RunStatus.FAILED, "model_unreachable", 1),
        ([Reply.malformed()], {}, RunStatus.FAILED, "model_malformed_response", 1),
        ([Reply.error(401, "invalid x-api-key")], {}, RunStatus.FAILED, "model_auth_failed", 1),
    ],
    ids=["429-retry-after", "529-burst-recovers", "529-burst-fails", "500", "timeout", "reset", "malformed", "401"],
)
def test_api_faults_end_every_run_clearly_and_change_nothing_on_failure(
    persistent_agent, fake_anthropic, replies, config, status, code, calls
):
    beat(persistent_agent, "first")
    persistent_agent.adapter_config = {**persistent_agent.adapter_config, **config}
    persistent_agent.save()
    count, history, costs = snapshot(persistent_agent)
    fake_anthropic.reset_log()
    fake_anthropic.push(*replies)

    run = beat(persistent_agent, "second")

    assert (run.status, run.error_code) == (status, code), run.error
    assert run.finished_at is not None
    assert len(fake_anthropic.message_requests) == calls
    if status == RunStatus.FAILED:
        assert snapshot(persistent_agent) == (count, history, costs)
        assert run.error and FAKE_API_KEY not in run.error
    else:
        assert snapshot(persistent_agent)[0] == count + 2
        assert CostEvent.objects.count() == costs + 1


def test_api_keys_never_reach_logs_history_or_runs(persistent_agent, fake_anthropic, caplog):
    caplog.set_level(logging.DEBUG)
    for name in ("anthropic", "httpx", "httpx2", "httpcore", "sessions_app", "django"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    fake_anthropic.push(Reply.error(401, "invalid x-api-key"))
    beat(persistent_agent, "fails")
    beat(persistent_agent, "works")

    assert FAKE_API_KEY not in caplog.text
    stored = " ".join(
        str(row)
        for row in list(HeartbeatRun.objects.values())
        + list(AgentSession.objects.values())
        + list(CostEvent.objects.values())
    )
    assert FAKE_API_KEY not in stored
    # ...while the SDK did send it, to the fake.
    headers = {k.lower(): v for k, v in fake_anthropic.requests[-1]["headers"].items()}
    assert FAKE_API_KEY in (headers.get("x-api-key") or headers.get("authorization", ""))


def test_rate_limit_is_retried_by_the_sdk_then_succeeds(persistent_agent, fake_anthropic):
    fake_anthropic.push(Reply.error(429, "slow down", retry_after_ms=10), Reply.error(529, "overloaded", 10))
    run = beat(persistent_agent, "hello")
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert len(fake_anthropic.message_requests) == 3
    assert CostEvent.objects.count() == 1


def test_missing_credentials_fail_the_run_clearly(stateless_agent, fake_anthropic, monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    run = beat(stateless_agent, "hello")
    assert (run.status, run.error_code) == (RunStatus.FAILED, "adapter_not_configured")
    assert "ANTHROPIC_API_KEY" in run.error
    assert fake_anthropic.message_requests == []
