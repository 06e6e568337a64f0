"""Compaction inside a heartbeat: fitting the request into the budget by summaries, handoff
notes of rotated sessions, the server-side compaction block, and compaction steps racing the
rest of the world (a reaper, a delete, a failing COMMIT or rename, a refused write): a failure
leaves the session whole and every billed call in the ledger. The policy (splitting, prompts,
caching) is tested in test_context.py."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.utils import timezone

from costs_app.models import Budget, CostEvent, CostKind
from sessions_app.context import SUMMARY_KINDS, estimate_tokens
from sessions_app.maintenance import runs_reap
from sessions_app.models import Agent, AgentSession, HeartbeatRun, RunStatus, SessionCompaction, SessionStatus
from sessions_app.services import session_delete
from sessions_app.stores import store_for
from tests.admin.conftest import conversation, make_session
from tests.conftest import (
    beat,
    compacting_agent,
    context_agent,
    failing_once,
    is_summary_request,
    on_own_connection,
    refuse_writes,
    summary_text,
    user_turns,
)
from tests.fake_anthropic import Reply, plain_messages, plain_system


@pytest.mark.django_db(transaction=True)
def test_a_compaction_whose_commit_fails_leaves_the_old_file_and_the_next_heartbeat_compacts_again(
    file_store, company, fake_anthropic, refuse_at_commit
):
    agent = compacting_agent(company)
    session = AgentSession.objects.get(agent=agent)
    path = store_for(session).path_for(session)
    before = path.read_bytes()
    allow = refuse_at_commit("agent_sessions", when="NEW.compaction_count > OLD.compaction_count")

    failed = beat(agent, "y" * 2400)

    assert (failed.status, failed.error_code) == (RunStatus.FAILED, "internal_error")
    assert path.read_bytes() == before
    session.refresh_from_db()
    assert (session.compaction_count, session.message_count) == (0, 6)
    allow()
    run = beat(agent, "z" * 2400)
    assert (run.status, run.error_code) == (RunStatus.SUCCEEDED, ""), run.error
    session.refresh_from_db()
    assert session.compaction_count == 1
    assert user_turns(session)[-1] == "z" * 2400


def test_a_compaction_whose_rename_fails_after_the_commit_loses_nothing(
    file_store, company, fake_anthropic, monkeypatch
):
    agent = compacting_agent(company)
    session = AgentSession.objects.get(agent=agent)
    failures = failing_once(monkeypatch, "replace")

    run = beat(agent, "y" * 2400)

    assert (run.status, run.error_code) == (RunStatus.SUCCEEDED, ""), run.error
    assert failures, "the compaction's rename was never attempted"
    session.refresh_from_db()
    assert session.compaction_count == 1
    history = store_for(session).read(session)
    assert len(history) == session.message_count
    assert json.loads(store_for(session).path_for(session).read_text())["messages"] == history
    assert history[-2]["content"] == "y" * 2400
    assert [p.name for p in store_for(session).path_for(session).parent.iterdir()] == [f"{session.public_id}.json"]
    assert beat(agent, "again").status == RunStatus.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_a_run_reaped_during_its_summary_commits_nothing_and_still_bills_it(file_store, company, fake_anthropic):
    agent = Agent.objects.create(
        company=company,
        name="long-running",
        adapter_config={
            "model": "claude-opus-4-5",
            "session_mode": "persistent",
            "context_budget_tokens": 1000,
            "keep_recent_turns": 1,
        },
    )
    for i in range(3):
        assert beat(agent, f"step {i}: " + "w" * 1200).status == RunStatus.SUCCEEDED
    session = AgentSession.objects.get(agent=agent)
    history = store_for(session).read(session)
    sent = len(fake_anthropic.message_requests)

    def reaper():
        runs_reap(now=timezone.now() + timedelta(days=1))
        connection.close()

    # This turn needs a summary first; the reaper fails the run while it is written.
    fake_anthropic.push(Reply(before=reaper))
    run = beat(agent, "step 3: " + "w" * 1200)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "run_timeout")
    after = AgentSession.objects.get(pk=session.pk)
    assert (after.message_count, after.compaction_count) == (session.message_count, session.compaction_count)
    assert store_for(after).read(after) == history
    assert len(fake_anthropic.message_requests) == sent + 1  # the summary, never the answer
    summary = CostEvent.objects.get(run=run)
    assert (summary.kind, summary.call_number) == (CostKind.COMPACTION, 1)
    assert HeartbeatRun.objects.get(id=run.id).error_code == "run_timeout"


@pytest.mark.django_db(transaction=True)
def test_a_session_deleted_during_its_summary_call_fails_the_run_as_session_deleted(
    file_store, company, fake_anthropic, paperclip_home
):
    agent = compacting_agent(company)
    session = AgentSession.objects.get(agent=agent)
    fake_anthropic.push(Reply.during(on_own_connection(lambda: session_delete(session=session, now=timezone.now()))))

    run = beat(agent, "y" * 2400)

    assert fake_anthropic.action_errors == []
    assert (run.status, run.error_code) == (RunStatus.FAILED, "session_deleted")
    assert not AgentSession.objects.filter(agent=agent).exists()
    assert list(paperclip_home.rglob("*.json*")) == []  # no history file, no staged one
    assert CostEvent.objects.get(run=run).kind == CostKind.COMPACTION  # the summary was billed
    assert beat(agent, "again").status == RunStatus.SUCCEEDED


def rotating_agent(company) -> Agent:
    return Agent.objects.create(
        company=company,
        name="rotating",
        adapter_config={"model": "claude-opus-4-5", "session_mode": "persistent", "rotate_after_turns": 2},
    )


def test_a_handoff_note_is_recorded_when_the_new_session_cannot_be_written(company, fake_anthropic):
    agent = rotating_agent(company)
    for i in range(2):
        assert beat(agent, f"turn {i}").status == RunStatus.SUCCEEDED
    refuse_writes("agent_sessions", when="1 = 1", event="INSERT")
    sent = len(fake_anthropic.message_requests)

    run = beat(agent, "turn 2")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "internal_error")
    assert len(fake_anthropic.message_requests) == sent + 2  # the handoff note, then the turn
    assert sorted(CostEvent.objects.filter(run=run).values_list("kind", flat=True)) == sorted(
        [CostKind.COMPACTION, CostKind.MESSAGE]
    )
    assert AgentSession.objects.filter(agent=agent).count() == 1


def test_a_handoff_note_is_recorded_when_the_run_breaks_before_its_turn_is_sent(company, fake_anthropic):
    agent = rotating_agent(company)
    for i in range(2):
        assert beat(agent, f"turn {i}").status == RunStatus.SUCCEEDED
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("100"))
    # The note is billed; releasing its reservation (and any later reservation) breaks.
    refuse_writes("heartbeat_runs", when="OLD.reserved_usd > 0 AND NEW.reserved_usd > 0")
    sent = len(fake_anthropic.message_requests)

    run = beat(agent, "turn 2")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "internal_error")
    assert len(fake_anthropic.message_requests) == sent + 1  # the note only
    assert list(CostEvent.objects.filter(run=run).values_list("kind", flat=True)) == [CostKind.COMPACTION]


def test_a_summary_whose_compaction_cannot_be_written_is_still_in_the_ledger(company, fake_anthropic):
    agent = compacting_agent(company)
    session = AgentSession.objects.get(agent=agent)
    before = store_for(session).read(session)
    refuse_writes("session_compactions", when="1 = 1", event="INSERT")
    sent = len(fake_anthropic.message_requests)

    run = beat(agent, "y" * 2400)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "internal_error")
    assert len(fake_anthropic.message_requests) == sent + 1  # the summary; the turn was never sent
    assert list(CostEvent.objects.filter(run=run).values_list("kind", flat=True)) == [CostKind.COMPACTION]
    session.refresh_from_db()
    assert (session.compaction_count, store_for(session).read(session)) == (0, before)


def full_record(session):
    """Archive, then active history, without summary turns: every message ever sent."""
    archived = [m for c in session.compactions.order_by("created_at") for m in c.archived_messages]
    active = store_for(session).read(session)
    return [m for m in archived + active if m.get("kind") not in SUMMARY_KINDS]


def test_300_heartbeats_never_exceed_the_budget_and_lose_nothing(company, fake_anthropic):
    budget = 2000
    agent = context_agent(company, context_budget_tokens=budget, keep_recent_turns=3)
    tasks = [f"step {i}: continue the migration of module {i % 17}" for i in range(300)]

    for task in tasks:
        run = beat(agent, task)
        assert run.status == RunStatus.SUCCEEDED, (task, run.error_code, run.error)

    answered = [b for b in fake_anthropic.message_requests if plain_system(b) == agent.system_prompt]
    # One call per heartbeat, each task sent once (what else reached the fake is shown).
    assert len(answered) == 300, [
        (plain_system(b)[:80], str(b["messages"][-1])[:200])
        for b in fake_anthropic.message_requests
        if not is_summary_request(b) and b not in answered
    ]
    sizes = [estimate_tokens({"system": b["system"], "messages": b["messages"]}) for b in answered]
    assert max(sizes) <= budget
    session = AgentSession.objects.get(agent=agent)
    assert session.compaction_count > 0
    record = full_record(session)
    assert [m["seq"] for m in record] == list(range(600))
    assert [m["content"] for m in record if m["role"] == "user"] == tasks
    assert (
        session.archived_message_count
        + sum(1 for m in store_for(session).read(session) if m.get("kind") not in SUMMARY_KINDS)
        == 600
    )
    compaction = session.compactions.first()
    assert compaction.tokens_before > budget >= compaction.tokens_after
    # Written by the cheapest model of the agent's family line, priced as such.
    assert compaction.summary and compaction.model == "claude-haiku-4-5"
    assert CostEvent.objects.filter(kind=CostKind.COMPACTION, session=session).count() == session.compaction_count


def test_failing_summary_changes_nothing(company, fake_anthropic):
    agent = context_agent(company, context_budget_tokens=1000, keep_recent_turns=1)
    for _ in range(3):
        beat(agent, "x" * 400)
    session = AgentSession.objects.get(agent=agent)
    assert session.compaction_count == 0
    before = store_for(session).read(session)
    costs = CostEvent.objects.count()
    fake_anthropic.push(Reply.error(400, "summary refused"))

    run = beat(agent, "y" * 2400)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "compaction_model_bad_request")
    session.refresh_from_db()
    assert store_for(session).read(session) == before
    assert session.message_count == len(before)
    assert session.compactions.count() == 0
    assert CostEvent.objects.count() == costs


def test_a_task_that_cannot_fit_fails_clearly_instead_of_looping(company, fake_anthropic):
    agent = context_agent(company, context_budget_tokens=1000)
    run = beat(agent, "z" * 8000)
    assert (run.status, run.error_code) == (RunStatus.FAILED, "context_budget_exceeded")
    assert "context_budget_tokens" in run.error
    assert fake_anthropic.message_requests == []


def test_a_task_too_big_for_the_budget_pays_for_no_summary(company, fake_anthropic):
    agent = context_agent(company, context_budget_tokens=1000, keep_recent_turns=1)
    for i in range(3):
        beat(agent, f"step {i}")
    sent = len(fake_anthropic.message_requests)

    run = beat(agent, "z" * 8000)  # no summary of the history could make room for this

    assert (run.status, run.error_code) == (RunStatus.FAILED, "context_budget_exceeded")
    assert fake_anthropic.message_requests[sent:] == []
    assert AgentSession.objects.get(agent=agent).compaction_count == 0


def test_rotation_starts_a_linked_session_with_a_handoff_note(company, fake_anthropic):
    agent = context_agent(company, rotate_after_turns=3)
    for i in range(3):
        beat(agent, f"turn {i}")
    first = AgentSession.objects.get(agent=agent)
    fake_anthropic.push(Reply.message("State: three turns done. Open: turn 3."))

    run = beat(agent, "turn 3")

    assert run.status == RunStatus.SUCCEEDED, run.error
    first.refresh_from_db()
    assert (first.status, first.end_reason) == (SessionStatus.ENDED, "rotated")
    second = AgentSession.objects.get(agent=agent, status=SessionStatus.ACTIVE)
    assert second.predecessor_id == first.id
    history = store_for(second).read(second)
    assert history[0]["kind"] == "handoff" and "State: three turns done." in history[0]["content"]
    request = plain_messages(fake_anthropic.message_requests[-1])
    assert "Handoff note" in request[0]["content"][0]["text"]
    assert len(request) == 3
    handoff = SessionCompaction.objects.get(session=second)
    assert handoff.kind == "handoff" and handoff.cost_usd > 0


def test_a_rotation_from_a_history_with_an_entry_that_is_not_a_turn_fails_before_the_note_is_paid_for(
    company, fake_anthropic
):
    agent = context_agent(company, rotate_after_turns=3)
    history = [*conversation(6), {"role": "user", "content": 7}]  # as a hand-edited history holds it
    session = make_session(agent, history=history, status=SessionStatus.ACTIVE, turn_count=3)

    run = beat(agent, "turn 3")

    assert (run.status, run.error_code, run.error) == (
        RunStatus.FAILED,
        "history_malformed",
        "The session's history cannot be summarised into a handoff note: "
        "entry 7 is not a turn (its content is not a text or a list of blocks).",
    )
    assert fake_anthropic.message_requests == []
    session.refresh_from_db()
    assert (session.status, store_for(session).read(session)) == (SessionStatus.ACTIVE, history)
    assert not AgentSession.objects.exclude(pk=session.pk).exists()


def test_server_strategy_sends_the_compaction_edit_and_round_trips_the_block(settings, company, fake_anthropic):
    settings.PAPERCLIP_MAX_TASK_CHARS = 400_000
    agent = context_agent(company, context_strategy="server", compaction_trigger_tokens=50_000)
    beat(agent, "small one")
    big = beat(agent, "data " * 45_000)
    assert big.status == RunStatus.SUCCEEDED, big.error

    first_call = fake_anthropic.requests[0]
    assert first_call["body"]["context_management"] == {
        "edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50_000}}]
    }
    assert "compact-2026-01-12" in first_call["headers"].get("anthropic-beta", "")
    beat(agent, "after compaction")

    last = plain_messages(fake_anthropic.message_requests[-1])
    assert len(last) == 3
    assert last[1]["content"][0] == {"type": "compaction", "content": "Summary of 3 earlier messages."}
    session = AgentSession.objects.get(agent=agent)
    compaction = session.compactions.get()
    assert compaction.kind == "server" and len(compaction.archived_messages) == 2
    assert [m["seq"] for m in full_record(session)] == list(range(6))
    event = CostEvent.objects.get(run=big)
    assert event.input_tokens > 50_000  # the compaction iteration is billed


def test_an_answer_bigger_than_the_budget_is_summarised_instead_of_blocking_the_session(company, fake_anthropic):
    agent = context_agent(company, context_budget_tokens=1000, keep_recent_turns=2)
    beat(agent, "first")
    fake_anthropic.push(Reply.message("report line\n" * 2000))  # ~6,000 tokens, in the newest turn
    assert beat(agent, "write the report").status == RunStatus.SUCCEEDED
    sent = len(fake_anthropic.message_requests)

    runs = [beat(agent, f"follow-up {i}") for i in range(3)]

    assert [run.status for run in runs] == [RunStatus.SUCCEEDED] * 3, runs[0].error
    summaries = [body for body in fake_anthropic.message_requests[sent:] if is_summary_request(body)]
    assert len(summaries) == 1  # straight to summarising everything: no pointless partial pass
    assert "report line" in summary_text(summaries[0])
    session = AgentSession.objects.get(agent=agent, status=SessionStatus.ACTIVE)
    assert [m.get("kind") for m in store_for(session).read(session)[:2]] == ["summary", "summary"]
    assert len(full_record(session)) == 2 + 2 + 2 * 3  # every turn kept, in the archive or live


@pytest.mark.django_db(transaction=True)
def test_a_summary_that_does_not_shrink_the_session_fails_the_run_and_is_paid_once(company, fake_anthropic):
    agent = compacting_agent(company)
    session = AgentSession.objects.get(agent=agent)
    before = store_for(session).read(session)
    sent = len(fake_anthropic.message_requests)
    fake_anthropic.push(Reply.message("s" * 6000))  # longer than the turns it replaces

    run = beat(agent, "y" * 2400)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "compaction_not_shrinking")
    assert [is_summary_request(r) for r in fake_anthropic.message_requests[sent:]] == [True]
    assert CostEvent.objects.filter(run=run, kind=CostKind.COMPACTION).count() == 1
    session.refresh_from_db()
    assert store_for(session).read(session) == before
    assert (session.compaction_count, session.compaction_error) == (0, "compaction_not_shrinking")
    assert session.compaction_error_at is not None


@pytest.mark.django_db(transaction=True)
def test_the_same_refused_summary_is_never_paid_for_again_until_the_session_changes(company, fake_anthropic):
    agent = compacting_agent(company)
    fake_anthropic.push(Reply.message("s" * 6000))
    assert beat(agent, "y" * 2400).error_code == "compaction_not_shrinking"
    sent = len(fake_anthropic.message_requests)

    # The next heartbeats would summarise the same turns: none is sent, none is billed.
    again = [beat(agent, "y" * 2400), beat(agent, "z" * 2400)]

    assert [(run.status, run.error_code) for run in again] == [(RunStatus.FAILED, "compaction_not_shrinking")] * 2
    assert "not asked for again" in again[0].error
    assert fake_anthropic.message_requests[sent:] == []
    assert not CostEvent.objects.filter(run__in=again).exists()

    # A turn that fits without a summary changes the session: the next summary is asked for.
    assert beat(agent, "short").status == RunStatus.SUCCEEDED
    assert beat(agent, "z" * 2400).status == RunStatus.SUCCEEDED  # this summary shrinks it
    session = AgentSession.objects.get(agent=agent)
    assert (session.compaction_count, session.compaction_error, session.compaction_error_at) == (1, "", None)
    assert (session.compaction_error_next_seq, session.compaction_error_replaced) == (None, None)
