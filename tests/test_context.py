"""Context management against the fake API: budgets, archive, rotation, caching, server compaction."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from sessions_app.context import SUMMARY_KINDS, SUMMARY_SYSTEM, estimate_tokens
from sessions_app.models import Agent, AgentSession, RunStatus, SessionCompaction, SessionStatus
from sessions_app.stores import store_for
from tests.conftest import beat, context_agent
from tests.fake_anthropic import Reply, plain_messages, plain_system


def is_summary_request(body):
    return plain_system(body) == SUMMARY_SYSTEM


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

    answered = [b for b in fake_anthropic.message_requests if not is_summary_request(b)]
    assert len(answered) == 300
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
    assert compaction.summary and compaction.model == "claude-opus-4-5"
    assert CostEvent.objects.filter(kind=CostKind.COMPACTION, session=session).count() == session.compaction_count


def test_summary_never_splits_a_tool_call_from_its_result():
    from sessions_app.context import choose_split

    history = [
        {"role": "user", "content": "u0"},
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"},
        {"role": "assistant", "content": "a3"},
    ]
    # Keeping two turns would start the tail at the tool result: the split moves back to u1.
    assert choose_split(history, keep_recent_turns=2) == 2
    assert choose_split(history, keep_recent_turns=1) == 6
    assert choose_split(history, keep_recent_turns=4) is None


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


def test_count_tokens_measures_requests_near_the_budget(company, fake_anthropic):
    agent = context_agent(company, context_budget_tokens=1000)
    for _ in range(6):
        beat(agent, "w" * 600)
    assert any(r["path"] == "/v1/messages/count_tokens" for r in fake_anthropic.requests)


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


def test_cache_markers_are_sent_and_cache_reads_are_priced_at_a_tenth(company, fake_anthropic):
    agent = context_agent(company)
    for i in range(3):
        beat(agent, f"turn {i}")
    third = fake_anthropic.message_requests[2]
    assert third["system"][0]["cache_control"] == {"type": "ephemeral"}
    assert third["messages"][-2]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in str(third["messages"][-1])

    event = CostEvent.objects.order_by("-created_at").first()
    assert event.cache_read_input_tokens > 0 and event.cache_creation_input_tokens > 0
    expected = (
        Decimal(event.input_tokens) * 5
        + Decimal(event.output_tokens) * 25
        + Decimal(event.cache_creation_5m_input_tokens) * Decimal("6.25")
        + Decimal(event.cache_read_input_tokens) * Decimal("0.5")
    ) / 1_000_000
    assert event.cost_usd == expected


def test_one_hour_cache_is_requested_and_priced_at_twice_input(company, fake_anthropic):
    agent = context_agent(company, cache_ttl="1h")
    usage = {
        "input_tokens": 10,
        "output_tokens": 0,
        "cache_creation_input_tokens": 1000,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 1000},
        "cache_read_input_tokens": 0,
    }
    fake_anthropic.push(Reply.message("ok", usage=usage))
    beat(agent, "hello")
    assert fake_anthropic.message_requests[0]["system"][0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    assert CostEvent.objects.get().cost_usd == (Decimal(10) * 5 + Decimal(1000) * 10) / 1_000_000


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


def test_reported_artifacts_form_a_manifest_sent_with_every_request(company, fake_anthropic):
    agent = context_agent(company)
    fake_anthropic.push(
        Reply.message('Wrote it.\nARTIFACT {"name": "report.md", "kind": "file", "checksum": "sha256:abc"}')
    )
    beat(agent, "write the report")
    session = AgentSession.objects.get(agent=agent)
    assert session.manifest[0]["name"] == "report.md" and session.manifest[0]["checksum"] == "sha256:abc"

    beat(agent, "next")

    user_turn = plain_messages(fake_anthropic.message_requests[-1])[-1]
    assert "Sandbox manifest" in user_turn["content"][0]["text"]
    assert "report.md (file) sha256:abc" in user_turn["content"][0]["text"]
    assert user_turn["content"][1]["text"] == "next"


@pytest.mark.parametrize("strategy", ["none"])
def test_strategy_none_replays_everything(company, fake_anthropic, strategy):
    agent = context_agent(company, context_strategy=strategy, context_budget_tokens=1000)
    for _ in range(6):
        assert beat(agent, "v" * 400).status == RunStatus.SUCCEEDED
    assert not SessionCompaction.objects.exists()
    assert len(fake_anthropic.message_requests[-1]["messages"]) == 11


def test_growth_signal_flags_a_session_that_accumulates_history(company, fake_anthropic):
    from costs_app.reports import daily_input_growth, input_growth

    growing = context_agent(company, context_strategy="none", prompt_caching=False)
    for i in range(8):
        beat(growing, f"step {i} " + "detail " * 40)
    flat = Agent.objects.create(company=company, name="flat", adapter_config={"model": "claude-opus-4-5"})
    for i in range(8):
        beat(flat, f"step {i} " + "detail " * 40)

    assert input_growth(agent_id=growing.id).is_growing
    assert input_growth(agent_id=growing.id).slope_tokens_per_run > 50
    assert not input_growth(agent_id=flat.id).is_growing
    today = daily_input_growth(agent_id=growing.id, now=timezone.now())
    assert len(today["days"]) == 1 and today["days"][0]["input_tokens_per_call"] > 0


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


def test_a_summary_request_never_exceeds_the_summary_model_window(company, fake_anthropic):
    agent = context_agent(company, context_budget_tokens=1000, summary_model="claude-haiku-4-5")
    beat(agent, "first")
    fake_anthropic.push(Reply.message("x" * 1_000_000))  # ~250,000 tokens: over any model's window
    beat(agent, "dump everything")

    assert beat(agent, "next").status == RunStatus.SUCCEEDED

    summary = next(body for body in fake_anthropic.message_requests if is_summary_request(body))
    text = summary_text(summary)
    assert "characters of the conversation left out" in text
    assert estimate_tokens(text) < 200_000 // 2 + 100  # half of claude-haiku-4-5's window
    assert text.startswith("[user]\nfirst") and text.endswith("x" * 1000)  # the beginning and the end


def summary_text(body) -> str:
    content = plain_messages(body)[0]["content"]
    return content if isinstance(content, str) else "".join(block["text"] for block in content)
