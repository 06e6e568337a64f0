"""POST .../sessions/{id}/compact: compact a session now, with a heartbeat's rules."""

from __future__ import annotations

from decimal import Decimal

import pytest

from costs_app.models import Budget, CostEvent, CostKind
from sessions_app.models import Agent, AgentSession, HeartbeatRun, RunStatus, RunTrigger
from tests.api.conftest import agent_url, assert_error, make_run, make_session
from tests.conftest import beat, context_agent, is_summary_request

pytestmark = pytest.mark.django_db


def talked(company, turns: int = 3):
    agent = context_agent(company, keep_recent_turns=1)
    for i in range(turns):
        assert beat(agent, f"step {i}: " + "x" * 400).status == RunStatus.SUCCEEDED
    return agent, AgentSession.objects.get(agent=agent)


def compact_url(agent, session) -> str:
    return agent_url(agent, f"/sessions/{session.public_id}/compact")


def test_compact_now_of_an_agent_whose_stored_setting_no_save_accepts_is_409_and_starts_no_run(
    api, company, fake_anthropic
):
    agent, session = talked(company)
    runs, sent = HeartbeatRun.objects.count(), len(fake_anthropic.message_requests)
    Agent.objects.filter(pk=agent.pk).update(adapter_config={**agent.adapter_config, "session_ttl_hours": "x"})

    error = assert_error(api.post(compact_url(agent, session)), 409, "agent_config_invalid")

    assert "adapter_config.session_ttl_hours" in error["message"]
    assert (HeartbeatRun.objects.count(), len(fake_anthropic.message_requests)) == (runs, sent)


def test_compact_now_summarises_the_older_turns_and_answers_the_record(api, company, fake_anthropic):
    agent, session = talked(company)
    sent = len(fake_anthropic.message_requests)

    response = api.post(compact_url(agent, session))

    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["kind"], body["messages_before"], body["messages_after"]) == ("summarize", 6, 4)
    assert [is_summary_request(r) for r in fake_anthropic.message_requests[sent:]] == [True]
    session.refresh_from_db()
    assert (session.compaction_count, session.message_count) == (1, 4)
    run = HeartbeatRun.objects.get(id=body["run"])
    assert (run.status, run.trigger, run.reserved_usd) == (RunStatus.SUCCEEDED, RunTrigger.API, 0)
    event = CostEvent.objects.get(run=run)
    assert event.kind == CostKind.COMPACTION
    assert Decimal(body["cost_usd"]) == event.cost_usd > 0


def test_keep_recent_turns_chooses_what_stays_verbatim(api, company, fake_anthropic):
    agent, session = talked(company, turns=4)
    response = api.post(compact_url(agent, session), {"keep_recent_turns": 3})
    assert response.status_code == 200, response.content
    assert (response.json()["messages_before"], response.json()["messages_after"]) == (8, 8)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"keep_recent_turns": "2"}, "keep_recent_turns"),
        ({"keep_recent_turns": 0}, "keep_recent_turns"),
        ({"keep_recent_turns": 1001}, "keep_recent_turns"),
        ({"keep_recent_turns": True}, "keep_recent_turns"),
        ({"keep": 1}, "keep"),
    ],
)
def test_bad_input_is_400_naming_the_field(api, company, fake_anthropic, body, field):
    agent, session = talked(company)
    error = assert_error(api.post(compact_url(agent, session), body), 400)
    assert field in error["fields"]
    assert AgentSession.objects.get(pk=session.pk).compaction_count == 0


def test_a_foreign_or_unknown_session_is_404(api, company, other_agent, fake_anthropic):
    agent, session = talked(company)
    assert_error(api.post(agent_url(other_agent, f"/sessions/{session.public_id}/compact")), 404)
    assert_error(api.post(agent_url(agent, "/sessions/sess_" + "0" * 32 + "/compact")), 404)
    assert_error(api.post(agent_url(agent, "/sessions/nonsense/compact")), 404)


def test_a_running_heartbeat_makes_it_409_session_busy(api, company, fake_anthropic):
    agent, session = talked(company)
    make_run(agent, status=RunStatus.RUNNING)
    sent = len(fake_anthropic.message_requests)
    assert_error(api.post(compact_url(agent, session)), 409, "session_busy")
    assert fake_anthropic.message_requests[sent:] == []


def test_a_full_cap_on_runs_in_progress_makes_it_429_run_cap_reached(api, settings, company, fake_anthropic):
    agent, session = talked(company)
    other, _ = talked(company)
    settings.PAPERCLIP_MAX_CONCURRENT_RUNS = 1
    make_run(other, status=RunStatus.RUNNING)  # another agent's heartbeat in progress
    sent = len(fake_anthropic.message_requests)

    response = api.post(compact_url(agent, session))

    assert_error(response, 429, "run_cap_reached")
    assert int(response["Retry-After"]) > 0
    assert fake_anthropic.message_requests[sent:] == []
    assert HeartbeatRun.objects.filter(status=RunStatus.RUNNING).count() == 1
    make_run(agent, status=RunStatus.RUNNING)  # its own heartbeat holds a place: that says more
    assert_error(api.post(compact_url(agent, session)), 409, "session_busy")


def test_a_session_with_nothing_to_compact_is_409(api, company, fake_anthropic):
    agent, session = talked(company, turns=1)
    assert_error(api.post(compact_url(agent, session)), 409, "nothing_to_compact")
    run = HeartbeatRun.objects.filter(agent=agent).latest("created_at")
    assert (run.status, run.error_code) == (RunStatus.FAILED, "nothing_to_compact")


def test_a_history_with_an_entry_that_is_not_a_turn_is_409_naming_it(api, company, fake_anthropic):
    agent = context_agent(company, keep_recent_turns=1)
    session = make_session(agent, messages=8)
    damaged = [*session.history[:2], 42, *session.history[2:]]  # as a hand-edited history may hold
    AgentSession.objects.filter(pk=session.pk).update(history=damaged, message_count=len(damaged))

    error = assert_error(api.post(compact_url(agent, session)), 409, "history_malformed")

    assert "entry 3 is not a turn" in error["message"]


def test_an_ended_session_is_409(api, persistent_agent):
    session = make_session(persistent_agent, messages=8, status="ended")
    assert_error(api.post(compact_url(persistent_agent, session)), 409, "session_not_live")


def test_a_budget_too_small_for_the_summary_is_429_before_any_request(api, company, fake_anthropic):
    agent, session = talked(company)
    Budget.objects.create(company=company, agent=agent, lifetime_limit_usd=Decimal("0.0001"))
    sent = len(fake_anthropic.message_requests)

    assert_error(api.post(compact_url(agent, session)), 429, "budget_exceeded")

    assert fake_anthropic.message_requests[sent:] == []
    assert AgentSession.objects.get(pk=session.pk).compaction_count == 0


def test_a_failed_summary_call_is_503_whatever_the_runtime(api, company):
    # A process agent's summary call is its command; one that prints no JSON failed as a
    # model call that failed does, and answers as one: the dependency's 503, not a conflict.
    agent = Agent.objects.create(
        company=company,
        name="Script",
        adapter_type="process",
        adapter_config={"command": ["true"], "session_mode": "persistent"},
    )
    session = make_session(agent, messages=6)

    error = assert_error(api.post(compact_url(agent, session)), 503, "compaction_process_malformed_response")

    assert error["message"].startswith("Summarising the session failed")
    assert AgentSession.objects.get(pk=session.pk).compaction_count == 0


def test_compact_answers_only_post(api, company, fake_anthropic):
    agent, session = talked(company)
    assert_error(api.get(compact_url(agent, session)), 405, "method_not_allowed")
    assert_error(api.delete(compact_url(agent, session)), 405, "method_not_allowed")
    assert AgentSession.objects.filter(pk=session.pk).exists()


def test_a_summary_refused_by_the_providers_quota_is_429_until_its_reset_and_holds_the_key(
    api, company, fake_anthropic
):
    from sessions_app.models import CredentialHold
    from tests.fake_anthropic import Reply

    agent, session = talked(company)
    fake_anthropic.outage = Reply.error(429, "rate limited", headers={"retry-after": "40"})
    response = api.post(compact_url(agent, session))
    assert_error(response, 429, "rate_limited")
    assert 39 <= int(response["Retry-After"]) <= 41
    assert CredentialHold.objects.get().held_until is not None
