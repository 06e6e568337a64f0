"""`claude-managed` heartbeats through the real SDK against the Managed Agents fake: the
remote agent, environment and session made and mapped, the conversation kept at the
provider and mirrored here, every model request billed as it ends, session hours from the
remote session's own measure."""

from __future__ import annotations

from decimal import Decimal

import pytest

from costs_app.models import CostEvent, CostKind
from costs_app.pricing import call_price, session_hour_rate, session_hours_cost
from sessions_app.models import AgentSession, ManagedSessionEnd, RunStatus
from tests.conftest import beat, managed_agent, run_queued_tasks, user_turns

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_persistent_agent_keeps_its_context_at_the_provider_across_heartbeats(company, fake_managed):
    agent = managed_agent(company)

    first = beat(agent, "remember the word heron")
    second = beat(agent, "which word?")

    assert (first.status, second.status) == (RunStatus.SUCCEEDED, RunStatus.SUCCEEDED), (first.error, second.error)
    session = AgentSession.objects.get(agent=agent)
    (remote,) = fake_managed.sessions.values()
    assert session.managed_session_id == remote["id"] == second.managed_session_id
    # The fake numbers each answer by the user messages its session has received.
    assert (first.output, second.output) == ("reply 1: remember the word heron", "reply 2: which word?")
    assert fake_managed.user_messages[remote["id"]] == ["remember the word heron", "which word?"]
    assert user_turns(session) == ["remember the word heron", "which word?"]
    agent.refresh_from_db()
    assert agent.managed_remote["agent_id"] in fake_managed.agents
    assert agent.managed_remote["environment_id"] in fake_managed.environments
    assert set(fake_managed.beta_headers) == {"managed-agents-2026-04-01"}


def test_every_model_request_is_a_ledger_row_priced_as_it_ends_and_session_hours_are_the_remote_measure(
    company, fake_managed
):
    agent = managed_agent(company)
    usage = {
        "input_tokens": 1200,
        "output_tokens": 80,
        "cache_read_input_tokens": 3000,
        "cache_creation_input_tokens": 400,
    }
    fake_managed.script(None, [("message", "looking", usage), ("message", "done", {**usage, "output_tokens": 30})])
    fake_managed.active_seconds_per_turn = 95.5

    run = beat(agent, "work")

    assert run.status == RunStatus.SUCCEEDED, run.error
    rows = list(CostEvent.objects.filter(run_id=run.id, kind=CostKind.MESSAGE).order_by("call_number"))
    assert [
        (r.input_tokens, r.output_tokens, r.cache_read_input_tokens, r.cache_creation_input_tokens) for r in rows
    ] == [
        (1200, 80, 3000, 400),
        (1200, 30, 3000, 400),
    ]
    assert all(r.cost_usd == call_price(usage=r.raw_usage, model=r.model, at=r.created_at).cost_usd for r in rows)
    assert run.cost_usd == sum((r.cost_usd for r in rows), Decimal(0))
    assert run.runtime_report["model_requests"] == 2
    session = AgentSession.objects.get(agent=agent)
    assert session.unbilled_active_seconds == 95.5  # the provider's measure, not our clock
    assert run.output == "looking\n\ndone"


def test_a_stateless_agent_gets_a_session_per_heartbeat_archived_when_it_ends(company, fake_managed):
    agent = managed_agent(company, session_mode="stateless")
    fake_managed.active_seconds_per_turn = 36.0

    runs = [beat(agent, "one"), beat(agent, "two")]
    run_queued_tasks()

    assert [run.status for run in runs] == [RunStatus.SUCCEEDED] * 2
    assert [run.output for run in runs] == ["reply 1: one", "reply 1: two"]  # no shared context
    assert len(fake_managed.sessions) == 2
    assert all(remote["archived_at"] for remote in fake_managed.sessions.values())
    assert not AgentSession.objects.filter(agent=agent).exists()
    hours = CostEvent.objects.filter(agent=agent, kind=CostKind.SESSION_HOURS)
    assert [row.session_seconds for row in hours] == [36, 36]
    assert all(row.cost_usd == session_hours_cost(36.0, rate=session_hour_rate()) for row in hours)


def test_a_changed_configuration_makes_a_new_agent_version_and_a_new_remote_session(company, fake_managed):
    agent = managed_agent(company)
    beat(agent, "one")
    first_remote = AgentSession.objects.get(agent=agent).managed_session_id

    agent.system_prompt = "You work remotely, in French."
    agent.save()  # a form read before the first heartbeat: it never writes back the remote ids
    run = beat(agent, "two")
    run_queued_tasks()

    assert run.status == RunStatus.SUCCEEDED, run.error
    agent.refresh_from_db()
    assert len(fake_managed.agents) == 1  # updated, not made again
    remote_agent = fake_managed.agents[agent.managed_remote["agent_id"]]
    assert (remote_agent["version"], remote_agent["system"]) == (2, "You work remotely, in French.")
    session = AgentSession.objects.get(agent=agent)
    assert session.managed_session_id != first_remote
    assert fake_managed.sessions[session.managed_session_id]["agent"]["version"] == 2
    assert fake_managed.sessions[first_remote]["archived_at"] is not None
    assert run.runtime_report["replaced_session"] == first_remote
    assert len(fake_managed.environments) == 1  # the environment did not change


@pytest.mark.parametrize(
    ("step", "code"),
    [
        (("budget_reached",), "managed_budget_reached"),
        (("retries_exhausted",), "managed_retries_exhausted"),
        (("refusal",), "managed_refusal"),
        (("terminate", "container lost"), "managed_session_terminated"),
    ],
)
def test_a_turn_that_does_not_end_normally_fails_the_run_and_keeps_what_it_billed(company, fake_managed, step, code):
    agent = managed_agent(company)
    fake_managed.script(None, [("message", "partial", {"input_tokens": 500, "output_tokens": 10}), step])
    fake_managed.active_seconds_per_turn = 42.0

    run = beat(agent, "work")
    run_queued_tasks()

    assert (run.status, run.error_code) == (RunStatus.FAILED, code)
    assert CostEvent.objects.filter(run_id=run.id, kind=CostKind.MESSAGE).count() == 1
    # No session row will bill the remote session's time: it is billed at once.
    (hours,) = CostEvent.objects.filter(agent=agent, kind=CostKind.SESSION_HOURS)
    assert (hours.session_id, hours.session_seconds) == (None, 42)
    (remote,) = fake_managed.sessions.values()
    assert remote["archived_at"] is not None  # no session row names it: the next heartbeat starts afresh
    assert ManagedSessionEnd.objects.get(remote_session_id=remote["id"]).done_at is not None
    if code == "managed_session_terminated":
        assert "container lost" in run.error


def test_a_failed_turn_on_a_resumed_session_counts_the_providers_time_not_our_clock(company, fake_managed):
    agent = managed_agent(company)
    fake_managed.active_seconds_per_turn = 30.0
    beat(agent, "one")
    fake_managed.script(None, [("message", "partial", {"input_tokens": 5, "output_tokens": 1}), ("refusal",)])

    run = beat(agent, "two")

    assert run.error_code == "managed_refusal"
    session = AgentSession.objects.get(agent=agent)
    assert session.unbilled_active_seconds == 60.0  # both turns, as the provider measured them
    assert session.managed_session_id == run.managed_session_id  # resumed, and kept
    assert not ManagedSessionEnd.objects.exists()


def test_force_fresh_and_rotation_start_a_new_remote_session_and_archive_the_old(company, fake_managed):
    agent = managed_agent(company, rotate_after_turns=2)
    beat(agent, "one")
    first = AgentSession.objects.get(agent=agent).managed_session_id

    fresh = beat(agent, "two", force_fresh=True)
    second = AgentSession.objects.get(agent=agent, status="active").managed_session_id
    beat(agent, "three")
    rotated = beat(agent, "four")  # the live session has had its two turns
    run_queued_tasks()

    assert fresh.status == rotated.status == RunStatus.SUCCEEDED
    third = AgentSession.objects.get(agent=agent, status="active").managed_session_id
    assert len({first, second, third}) == 3
    assert fake_managed.sessions[first]["archived_at"] and fake_managed.sessions[second]["archived_at"]
    assert fake_managed.sessions[third]["archived_at"] is None
    assert fake_managed.user_messages[second] == ["two", "three"]
    assert rotated.output == "reply 1: four"  # the new remote session starts afresh


def test_a_rescheduled_session_is_waited_out(company, fake_managed):
    agent = managed_agent(company)
    fake_managed.script(None, [("reschedule", 0.3), ("message", "back", {"input_tokens": 10, "output_tokens": 2})])

    run = beat(agent, "work")

    assert (run.status, run.output) == (RunStatus.SUCCEEDED, "back"), run.error


def test_under_a_budget_the_sessions_cap_is_reserved_before_anything_is_sent(company, fake_managed):
    from costs_app.models import Budget

    Budget.objects.create(company=company, monthly_limit_usd=Decimal("1"))
    uncapped = managed_agent(company)
    over = managed_agent(company, max_budget_usd=2)

    assert beat(uncapped, "go").error_code == "managed_budget_cap_required"
    assert beat(over, "go").error_code == "budget_exceeded"
    assert fake_managed.requests == []  # nothing reached the provider

    capped = managed_agent(company, max_budget_usd=0.5)
    run = beat(capped, "go")
    assert run.status == RunStatus.SUCCEEDED, run.error
    (remote,) = fake_managed.sessions.values()
    assert remote["budget"]["max_list_cost"] == {"amount": "50", "currency": "USD"}


def test_a_resumed_session_the_service_terminates_fails_the_run_and_the_next_heartbeat_starts_afresh(
    company, fake_managed
):
    agent = managed_agent(company)
    beat(agent, "one")
    first_remote = AgentSession.objects.get(agent=agent).managed_session_id
    fake_managed.script(None, [("terminate", "the container ran out of memory")])

    failed = beat(agent, "two")
    after = beat(agent, "three")
    run_queued_tasks()

    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "managed_session_terminated")
    assert "the container ran out of memory" in failed.error
    assert after.status == RunStatus.SUCCEEDED, after.error
    session = AgentSession.objects.get(agent=agent)
    assert session.managed_session_id not in ("", first_remote)
    assert after.runtime_report["replaced_session"] == first_remote
    [sent] = fake_managed.user_messages[session.managed_session_id]
    # The new session opens with our record of the lost one; the failed task is never sent again.
    assert sent.startswith("[Handoff note: your previous session ended at the service")
    assert "[user]\none\n\n[assistant]\nreply 1: one" in sent
    assert sent.endswith("three") and "two" not in sent


def test_the_files_an_agent_mounts_are_in_each_new_session_and_a_change_of_them_starts_a_new_one(company, fake_managed):
    data, notes = fake_managed.upload("data.csv", b"a,b\n"), fake_managed.upload("notes.md", b"# notes\n")
    agent = managed_agent(company, resources=[{"file_id": data, "mount_path": "/mnt/data/data.csv"}])

    first, same = beat(agent, "one"), beat(agent, "two")
    agent.adapter_config = {**agent.adapter_config, "resources": [{"file_id": data}, {"file_id": notes}]}
    agent.save()
    changed = beat(agent, "three")
    run_queued_tasks()

    assert {first.status, same.status, changed.status} == {RunStatus.SUCCEEDED}, changed.error
    assert first.managed_session_id == same.managed_session_id != changed.managed_session_id
    mounted = fake_managed.sessions[first.managed_session_id]["resources"]
    assert [(r["file_id"], r["mount_path"]) for r in mounted] == [(data, "/mnt/data/data.csv")]
    mounted = fake_managed.sessions[changed.managed_session_id]["resources"]
    assert [(r["file_id"], r["mount_path"]) for r in mounted] == [
        (data, f"/mnt/session/uploads/{data}"),
        (notes, f"/mnt/session/uploads/{notes}"),
    ]
    assert changed.runtime_report["replaced_session"] == first.managed_session_id
    assert fake_managed.sessions[first.managed_session_id]["archived_at"] is not None
    assert fake_managed.user_messages[changed.managed_session_id] == ["three"]  # replaced, not lost: no note


def test_a_file_the_provider_does_not_hold_fails_the_run_with_its_message(company, fake_managed):
    agent = managed_agent(company, resources=[{"file_id": "file_9999"}])

    run = beat(agent, "read it")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "managed_session_not_created")
    assert "no file file_9999 to mount" in run.error and "adapter_config.resources" in run.error
