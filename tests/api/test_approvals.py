"""Approvals: a Managed Agents turn that stops at a tool that asks first waits
`waiting_approval`; an operator approves or denies it through the API and the next worker
continues the same turn, against the fake through the real SDK."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from costs_app.pricing import session_hour_rate, session_hours_cost
from sessions_app.approvals import ApprovalRefused, approval_decide, approvals_dispatch, approvals_expire
from sessions_app.maintenance import maintenance_pass, sessions_expire
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus
from sessions_app.run_queue import heartbeat_enqueue
from sessions_app.services import session_clear_history, session_expire
from sessions_app.stores import store_for
from tests.api.conftest import agent_url, assert_error
from tests.conftest import beat, managed_agent, run_queued_tasks, task_queue_down

pytestmark = pytest.mark.django_db(transaction=True)

ASKING = [
    ("message", "I will look first.", {"input_tokens": 300, "output_tokens": 12}),
    ("tool", "bash", {"command": "rm -rf build"}, "always_ask", "removed"),
    ("message", "Cleaned up.", {"input_tokens": 420, "output_tokens": 8}),
]


def asking_agent(company, **config):
    return managed_agent(company, tools=["read", {"name": "bash", "permission": "always_ask"}], **config)


def test_an_approved_tool_call_continues_the_same_turn(api, company, fake_managed):
    agent = asking_agent(company)
    fake_managed.script(None, ASKING)

    waiting = beat(agent, "clean the build")

    assert waiting.status == RunStatus.WAITING_APPROVAL
    shown = api.get(agent_url(agent, f"/runs/{waiting.id}")).json()
    (call,) = shown["approval"]["tool_calls"]
    assert (call["name"], call["input"]) == ("bash", {"command": "rm -rf build"})
    assert shown["approval"]["decision"] is None and shown["approval"]["expires_at"]
    # The agent's next heartbeat waits behind it: nobody sends the session a task meanwhile.
    later, _ = heartbeat_enqueue(agent=agent, task="next", now=timezone.now())
    assert HeartbeatRun.objects.get(pk=later.pk).status == RunStatus.QUEUED

    approved = api.post(agent_url(agent, f"/runs/{waiting.id}/approve"), {"reason": "fine"})
    assert approved.status_code == 200, approved.content
    assert approved.json()["approval"]["decision"]["result"] == "allow"
    run_queued_tasks()

    run = HeartbeatRun.objects.get(pk=waiting.pk)
    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    assert run.output == "I will look first.\n\nCleaned up."
    (remote_id,) = fake_managed.user_messages
    assert fake_managed.user_messages[remote_id][0] == "clean the build"  # sent once, before the wait
    confirmations = [e for e in fake_managed.events[remote_id] if e["type"] == "user.tool_confirmation"]
    assert [(e["result"], e["tool_use_id"]) for e in confirmations] == [("allow", call["id"])]
    rows = CostEvent.objects.filter(run_id=run.id, kind=CostKind.MESSAGE).order_by("call_number")
    assert [(r.call_number, r.input_tokens) for r in rows if r.input_tokens] == [(1, 300), (3, 420)]
    session = AgentSession.objects.get(agent=agent)
    turn = next(t for t in store_for(session).read(session) if t["role"] == "assistant")
    assert [block["type"] for block in turn["content"]] == ["text", "tool_use", "tool_result", "text"]
    assert HeartbeatRun.objects.get(pk=later.pk).status == RunStatus.SUCCEEDED  # then the next one ran


def test_a_denied_tool_call_tells_the_agent_why_and_the_turn_goes_on(api, company, fake_managed):
    agent = asking_agent(company)
    fake_managed.script(None, ASKING)
    waiting = beat(agent, "clean the build")

    denied = api.post(agent_url(agent, f"/runs/{waiting.id}/deny"), {"reason": "not on a Friday"})
    assert denied.status_code == 200, denied.content
    run_queued_tasks()

    run = HeartbeatRun.objects.get(pk=waiting.pk)
    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    (remote_id,) = fake_managed.user_messages
    results = [e for e in fake_managed.events[remote_id] if e["type"] == "agent.tool_result"]
    assert "not on a Friday" in str(results[-1]["content"])
    assert api.get(agent_url(agent, f"/runs/{waiting.id}")).json()["approval"]["decision"]["result"] == "deny"


def test_a_decision_the_task_queue_refuses_is_kept_and_the_maintenance_pass_hands_the_run_over(
    api, company, fake_managed
):
    agent = asking_agent(company)
    fake_managed.script(None, ASKING)
    waiting = beat(agent, "clean the build")

    with task_queue_down():
        error = assert_error(api.post(agent_url(agent, f"/runs/{waiting.id}/approve")), 503, "queue_unavailable")
    assert "recorded" in error["message"]
    # The decision stands: it is not taken again, and the expiry leaves the decided run alone.
    assert_error(api.post(agent_url(agent, f"/runs/{waiting.id}/deny")), 409, "run_not_waiting_approval")
    assert approvals_expire(now=timezone.now() + timedelta(days=1)) == 0
    run_queued_tasks()
    assert HeartbeatRun.objects.get(pk=waiting.pk).status == RunStatus.WAITING_APPROVAL  # nothing was queued

    # Two passes before any worker takes the run: two tasks, one claim.
    assert approvals_dispatch() == 1
    assert approvals_dispatch() == 1
    run_queued_tasks()

    run = HeartbeatRun.objects.get(pk=waiting.pk)
    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    assert run.output == "I will look first.\n\nCleaned up."
    (remote_id,) = fake_managed.user_messages
    assert [e["type"] for e in fake_managed.events[remote_id]].count("user.tool_confirmation") == 1
    rows = CostEvent.objects.filter(run_id=run.id, kind=CostKind.MESSAGE)
    assert [r.input_tokens for r in rows.order_by("call_number") if r.input_tokens] == [300, 420]
    assert approvals_dispatch() == 0


def test_a_decision_is_taken_once(api, company, fake_managed):
    agent = asking_agent(company)
    fake_managed.script(None, ASKING)
    waiting = beat(agent, "clean the build")

    assert api.post(agent_url(agent, f"/runs/{waiting.id}/approve")).status_code == 200
    assert_error(api.post(agent_url(agent, f"/runs/{waiting.id}/deny")), 409, "run_not_waiting_approval")
    run_queued_tasks()
    assert_error(api.post(agent_url(agent, f"/runs/{waiting.id}/approve")), 409, "run_not_waiting_approval")
    done = beat(agent, "a run that never waited")
    assert_error(api.post(agent_url(agent, f"/runs/{done.id}/approve")), 409, "run_not_waiting_approval")


def test_an_unanswered_approval_expires_and_the_remote_turn_is_interrupted(api, company, fake_managed):
    agent = asking_agent(company, approval_timeout_minutes=5)
    fake_managed.script(None, ASKING)
    waiting = beat(agent, "clean the build")

    assert approvals_expire(now=timezone.now()) == 0  # not yet
    assert approvals_expire(now=timezone.now() + timedelta(minutes=6)) == 1

    run = HeartbeatRun.objects.get(pk=waiting.pk)
    assert (run.status, run.error_code) == (RunStatus.FAILED, "approval_expired")
    (remote_id,) = fake_managed.user_messages
    assert "user.interrupt" in [e["type"] for e in fake_managed.events[remote_id]]
    assert_error(api.post(agent_url(agent, f"/runs/{waiting.id}/approve")), 409, "run_not_waiting_approval")


def a_turn_waiting_on_its_second_turn(company, fake_managed):
    """A persistent agent whose second turn (30 remote seconds each) waits for an approval:
    the agent, the waiting run and its session."""
    agent = asking_agent(company)
    fake_managed.active_seconds_per_turn = 30.0
    assert beat(agent, "look around").status == RunStatus.SUCCEEDED
    fake_managed.script(None, ASKING)
    waiting = beat(agent, "clean the build")
    session = AgentSession.objects.get(agent=agent)
    assert (waiting.status, waiting.managed_session_id) == (RunStatus.WAITING_APPROVAL, session.managed_session_id)
    return agent, waiting, session


def test_an_approval_after_the_history_is_cleared_is_refused_and_sends_nothing(api, company, fake_managed):
    """The clear archives the remote session the turn waits on: the waiting run ends with
    it, in the clear's transaction, so an operator's approval afterwards answers what the
    run is (409) and nothing reaches the provider (before: the approval was taken, the
    confirmation sent to the archived session and the rest of the turn paid for, only for
    its commit to fail `session_conflict`)."""
    agent, waiting, session = a_turn_waiting_on_its_second_turn(company, fake_managed)
    remote_id = session.managed_session_id

    assert session_clear_history(session=session)

    run = HeartbeatRun.objects.get(pk=waiting.pk)
    assert (run.status, run.error_code) == (RunStatus.FAILED, "session_conflict")
    assert "history was cleared" in run.error
    assert_error(api.post(agent_url(agent, f"/runs/{waiting.id}/approve")), 409, "run_not_waiting_approval")
    assert_error(api.post(agent_url(agent, f"/runs/{waiting.id}/deny")), 409, "run_not_waiting_approval")
    assert approvals_dispatch() == 0
    run_queued_tasks()

    events = [e["type"] for e in fake_managed.events[remote_id]]
    assert events.count("user.tool_confirmation") == 0
    assert fake_managed.sessions[remote_id]["archived_at"] is not None
    assert HeartbeatRun.objects.get(pk=waiting.pk).status == RunStatus.FAILED
    billed = CostEvent.objects.filter(run_id=run.id, kind=CostKind.MESSAGE, input_tokens__gt=0)
    assert list(billed.values_list("input_tokens", flat=True)) == [300]  # only the part before the wait
    # The turn's time up to the wait is the row's, billed once by the clear with the first turn's.
    (hours,) = CostEvent.objects.filter(agent=agent, kind=CostKind.SESSION_HOURS)
    assert fake_managed.sessions[remote_id]["usage"]["active_seconds"] == 60.0
    assert hours.cost_usd == session_hours_cost(60.0, rate=session_hour_rate())
    session.refresh_from_db()
    assert (session.managed_session_id, session.unbilled_active_seconds) == (None, 0)


def _delete_by_api(api, agent, session):
    assert api.delete(agent_url(agent, f"/sessions/{session.public_id}")).status_code == 204


def _expire_by_operator(api, agent, session):
    # The maintenance pass leaves it: a session whose run waits is in flight, whatever its TTL.
    AgentSession.objects.filter(pk=session.pk).update(expires_at=timezone.now() - timedelta(hours=1))
    assert sessions_expire(now=timezone.now()) == 0
    assert session_expire(session=session, now=timezone.now())


def _retire_agent_by_api(api, agent, session):
    assert api.delete(agent_url(agent)).status_code == 204


ENDINGS = {
    "session deleted": (_delete_by_api, "session_deleted", "session was deleted", (409, "run_not_waiting_approval")),
    "session expired by the operator": (
        _expire_by_operator,
        "session_ended",
        "session was expired",
        (409, "run_not_waiting_approval"),
    ),
    # A retired agent's runs are no longer the API's (404); the admin's decision is refused below.
    "agent retired": (_retire_agent_by_api, "agent_deleted", "agent was deleted", (404, "not_found")),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_an_approval_after_the_session_ends_is_refused_and_sends_nothing(api, company, fake_managed, ending):
    """A delete, an operator's expiry or the agent's retirement ends the remote session the
    turn waits on: the waiting run ends with it, in the same transaction, so an operator's
    approval afterwards is refused and nothing reaches the provider, and the turn's time
    so far is billed once, with the row's (before: the run kept waiting, an approval sent
    `user.tool_confirmation` to the remote session being ended and paid for the rest of the
    turn, whose commit then failed)."""
    end, code, said, refused = ENDINGS[ending]
    agent, waiting, session = a_turn_waiting_on_its_second_turn(company, fake_managed)
    remote_id = session.managed_session_id
    remote_seconds = fake_managed.sessions[remote_id]["usage"]["active_seconds"]
    assert remote_seconds == 60.0
    events = fake_managed.events[remote_id]  # kept after the fake deletes the session

    end(api, agent, session)

    assert_error(api.post(agent_url(agent, f"/runs/{waiting.id}/approve")), *refused)
    assert_error(api.post(agent_url(agent, f"/runs/{waiting.id}/deny")), *refused)
    run = HeartbeatRun.objects.get(pk=waiting.pk)
    with pytest.raises(ApprovalRefused, match="does not wait"):  # the admin's action
        approval_decide(run, allow=True, by="admin", now=timezone.now())
    assert (run.status, run.error_code) == (RunStatus.FAILED, code)
    assert said in run.error
    assert approvals_dispatch() == 0
    run_queued_tasks()
    maintenance_pass(now=timezone.now())
    run_queued_tasks()

    assert [e["type"] for e in events].count("user.tool_confirmation") == 0
    assert HeartbeatRun.objects.get(pk=waiting.pk).status == RunStatus.FAILED
    billed = CostEvent.objects.filter(run_id=run.id, kind=CostKind.MESSAGE, input_tokens__gt=0)
    assert list(billed.values_list("input_tokens", flat=True)) == [300]  # only the part before the wait
    # Both turns' remote time, once: the row's, billed as it ended, the waiting turn's with it.
    hours = CostEvent.objects.filter(agent=agent, kind=CostKind.SESSION_HOURS)
    assert [h.cost_usd for h in hours] == [session_hours_cost(remote_seconds, rate=session_hour_rate())]
    assert not AgentSession.objects.filter(unbilled_active_seconds__gt=0).exists()


def test_a_stateless_turn_waiting_when_its_agent_is_retired_ends_billed_and_its_session_is_archived(
    api, company, fake_managed
):
    """No row holds a stateless turn's time: the retirement bills it at once, and the maintenance
    pass archives its remote session as any ended run's that no row names."""
    agent = asking_agent(company, session_mode="stateless")
    fake_managed.active_seconds_per_turn = 30.0
    fake_managed.script(None, ASKING)
    waiting = beat(agent, "clean the build")
    (remote,) = fake_managed.sessions.values()

    assert api.delete(agent_url(agent)).status_code == 204

    run = HeartbeatRun.objects.get(pk=waiting.pk)
    assert (run.status, run.error_code) == (RunStatus.FAILED, "agent_deleted")
    with pytest.raises(ApprovalRefused, match="does not wait"):
        approval_decide(run, allow=True, by="admin", now=timezone.now())
    maintenance_pass(now=timezone.now())
    run_queued_tasks()
    assert [e["type"] for e in fake_managed.events[remote["id"]]].count("user.tool_confirmation") == 0
    assert fake_managed.sessions[remote["id"]]["archived_at"] is not None
    (hours,) = CostEvent.objects.filter(agent=agent, kind=CostKind.SESSION_HOURS)
    assert (hours.session_id, remote["usage"]["active_seconds"]) == (None, 30.0)
    assert hours.cost_usd == session_hours_cost(30.0, rate=session_hour_rate())


def test_a_decision_after_the_deadline_is_refused_even_before_the_expiry_runs(api, company, fake_managed):
    agent = asking_agent(company, approval_timeout_minutes=1)
    fake_managed.script(None, ASKING)
    waiting = beat(agent, "clean the build")
    HeartbeatRun.objects.filter(pk=waiting.pk).update(approval_deadline_at=timezone.now() - timedelta(seconds=1))

    assert_error(api.post(agent_url(agent, f"/runs/{waiting.id}/approve")), 409, "run_not_waiting_approval")
    assert approvals_expire(now=timezone.now()) == 1


def test_a_wait_true_heartbeat_answers_at_once_with_the_waiting_run(api, company, fake_managed):
    agent = asking_agent(company)
    fake_managed.script(None, ASKING)

    answer = api.post(agent_url(agent, "/heartbeat"), {"task": "clean the build", "wait": True})

    assert answer.status_code == 202, answer.content  # not finished: an operator decides
    assert answer.json()["status"] == "waiting_approval"
    assert answer.json()["approval"]["tool_calls"][0]["name"] == "bash"


def test_a_stateless_agents_session_is_kept_while_it_waits_and_archived_after(api, company, fake_managed):
    agent = asking_agent(company, session_mode="stateless")
    fake_managed.script(None, ASKING)
    waiting = beat(agent, "clean the build")
    run_queued_tasks()
    (remote,) = fake_managed.sessions.values()
    assert remote["archived_at"] is None

    api.post(agent_url(agent, f"/runs/{waiting.id}/approve"))
    run_queued_tasks()
    run_queued_tasks()  # the archive the run's end recorded

    assert HeartbeatRun.objects.get(pk=waiting.pk).status == RunStatus.SUCCEEDED
    assert fake_managed.sessions[remote["id"]]["archived_at"] is not None


@pytest.mark.parametrize(
    ("decision", "body", "field"),
    [
        ("deny", {"reason": "x" * 3000}, "reason"),
        ("deny", {"reason": 12345}, "reason"),
        ("deny", {"reasn": "never run rm -rf"}, "reasn"),  # a reason lost to a typo would not reach the agent
        ("approve", {"allow": False, "reason": "NO"}, "allow"),  # the path decides, and says so
    ],
    ids=["too-long", "not-text", "misspelt", "a-decision-in-the-body"],
)
def test_a_decision_the_api_cannot_take_as_sent_is_a_400_naming_the_field(
    api, company, fake_managed, decision, body, field
):
    agent = asking_agent(company)
    fake_managed.script(None, ASKING)
    waiting = beat(agent, "clean the build")

    error = assert_error(api.post(agent_url(agent, f"/runs/{waiting.id}/{decision}"), body), 400)

    assert field in error["fields"]
    assert HeartbeatRun.objects.get(pk=waiting.pk).status == RunStatus.WAITING_APPROVAL


def test_an_operator_approves_from_the_admin_and_sees_the_waiting_call(admin_client, company, fake_managed):
    from django.urls import reverse

    agent = asking_agent(company)
    fake_managed.script(None, ASKING)
    waiting = beat(agent, "clean the build")

    page = admin_client.get(reverse("admin:sessions_app_heartbeatrun_change", args=[waiting.pk])).content.decode()
    assert "bash" in page and "rm -rf build" in page and "waiting, until" in page
    changelist = reverse("admin:sessions_app_heartbeatrun_changelist")
    answer = admin_client.post(changelist, {"action": "approve_tool_calls", "_selected_action": [str(waiting.pk)]})
    assert answer.status_code == 302
    run_queued_tasks()

    run = HeartbeatRun.objects.get(pk=waiting.pk)
    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    assert run.managed_turn["decision"]["by"] == "admin admin"


def test_an_admin_decision_the_task_queue_refuses_is_said_on_the_page_and_kept(admin_client, company, fake_managed):
    from django.contrib.messages import get_messages
    from django.urls import reverse

    agent = asking_agent(company)
    fake_managed.script(None, ASKING)
    waiting = beat(agent, "clean the build")

    changelist = reverse("admin:sessions_app_heartbeatrun_changelist")
    with task_queue_down():
        answer = admin_client.post(changelist, {"action": "deny_tool_calls", "_selected_action": [str(waiting.pk)]})
    assert answer.status_code == 302
    said = [str(message) for message in get_messages(answer.wsgi_request)]
    assert any("task queue is unavailable" in line and "recorded" in line for line in said), said
    assert HeartbeatRun.objects.get(pk=waiting.pk).managed_turn["decision"]["result"] == "deny"
    assert approvals_dispatch() == 1
    run_queued_tasks()
    assert HeartbeatRun.objects.get(pk=waiting.pk).status == RunStatus.SUCCEEDED
