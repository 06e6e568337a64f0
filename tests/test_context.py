"""Context policy against the fake API: where a summary splits, what it is sent, measuring
requests, caching markers, the artifact manifest, empty answers replayed."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest
from django.utils import timezone

from costs_app.models import CostEvent
from sessions_app.adapters import AdapterRequest
from sessions_app.context import (
    ANTHROPIC_TOOL_TOKENS,
    TOOL_USE_SYSTEM_PROMPT_TOKENS,
    context_settings,
    estimate_tokens,
    input_tokens_bound,
    model_window,
    replayed_messages,
    request_tokens_bound,
    summary_input_chars,
)
from sessions_app.context_defaults import budget_ceiling
from sessions_app.models import Agent, AgentSession, RunStatus, SessionCompaction
from tests.conftest import beat, catalogue_stored, context_agent, is_summary_request, summary_text
from tests.fake_anthropic import Reply, plain_messages, strip_markers


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


def test_count_tokens_measures_requests_near_the_budget(company, fake_anthropic):
    agent = context_agent(company, context_budget_tokens=1000)
    for _ in range(6):
        beat(agent, "w" * 600)
    assert any(r["path"] == "/v1/messages/count_tokens" for r in fake_anthropic.requests)


def test_cache_markers_are_sent_and_cache_reads_are_priced_at_a_tenth(company, fake_anthropic):
    agent = context_agent(company)
    for i in range(3):
        beat(agent, f"turn {i}")
    third = fake_anthropic.message_requests[2]
    assert third["system"][0]["cache_control"] == {"type": "ephemeral"}
    # The request's end is marked (the next heartbeat's prefix), not the turns before it.
    assert third["messages"][-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in str(third["messages"][:-1])

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


def test_an_artifact_line_nested_too_deep_is_ignored(persistent_agent, fake_anthropic):
    fake_anthropic.push(Reply.message('done\nARTIFACT {"name": "deep", "kind": ' + "[" * 100000 + "}"))

    run = beat(persistent_agent, "go")

    assert (run.status, AgentSession.objects.get(agent=persistent_agent).manifest) == (RunStatus.SUCCEEDED, [])


@pytest.mark.parametrize(
    "answer",
    [Reply.message(content=[]), Reply.message("  \n "), Reply.message(content=[{"type": "text", "text": ""}])],
    ids=["no-content", "whitespace", "empty-text-block"],
)
def test_an_empty_answer_does_not_break_the_session(persistent_agent, fake_anthropic, answer):
    # The API refuses empty messages and blank text blocks in earlier turns, yet models do
    # answer with no content (stop_reason end_turn, content []); replayed as stored, such a
    # turn would fail every later heartbeat of the session with a 400.
    fake_anthropic.push(answer)
    assert beat(persistent_agent, "first").status == RunStatus.SUCCEEDED

    second = beat(persistent_agent, "second")
    third = beat(persistent_agent, "third")

    assert [second.status, third.status] == [RunStatus.SUCCEEDED, RunStatus.SUCCEEDED], second.error
    replayed = strip_markers(fake_anthropic.message_requests[-1]["messages"][1]["content"])
    assert replayed in ("(no content)", [{"type": "text", "text": "(no content)"}])
    session = AgentSession.objects.get(agent=persistent_agent)
    assert session.message_count == 6  # the empty answer is kept as the model gave it


def test_a_1m_token_model_has_its_whole_window(company):
    """The context window is the catalogue's max_input_tokens: a 1M-token model is not a 200k one."""
    agent = Agent.objects.create(company=company, name="long", adapter_config={"model": "claude-sonnet-5-5"})
    assert model_window("claude-sonnet-5-5") == 1_000_000
    assert budget_ceiling(agent) == 1_000_000 - 4096
    assert context_settings(agent).budget_tokens == 500_000
    catalogue_stored()  # the Models API says so too
    assert model_window("claude-sonnet-5-5[1m]") == 1_000_000
    assert model_window("claude-opus-4-5") == 200_000
    assert model_window("claude-unknown-1") == 200_000  # unknown: the common window


@pytest.mark.parametrize(
    ("model", "summary_model"),
    [
        ("claude-opus-5-5", "claude-haiku-5-5"),
        ("claude-fable-5-1", "claude-haiku-5-5"),
        ("claude-haiku-5-5", "claude-haiku-5-5"),
        ("claude-sonnet-4-6", "claude-haiku-4-5"),
    ],
)
def test_summaries_are_written_by_the_cheapest_active_model_of_the_agents_line(company, model, summary_model):
    catalogue_stored()
    agent = context_agent(company, model=model)
    assert context_settings(agent, now=timezone.now()).summary_model == summary_model
    pinned = context_agent(company, model=model, summary_model="claude-sonnet-5-5")
    assert context_settings(pinned).summary_model == "claude-sonnet-5-5"


def test_a_1m_token_summary_model_reads_half_its_window(company, fake_anthropic):
    agent = context_agent(company, model="claude-opus-5-5", context_budget_tokens=1000)
    assert summary_input_chars(context_settings(agent)) == 1_000_000 * 2  # Haiku 5.5: 1M tokens


def test_the_input_bound_holds_what_the_api_adds_for_the_tools_offered():
    # The largest tool-use system prompt Anthropic publishes (Claude Opus 4.7, any/tool).
    assert TOOL_USE_SYSTEM_PROMPT_TOKENS >= 804
    # Above the largest Anthropic-defined tool figure published (computer use, 735 + 499).
    assert ANTHROPIC_TOOL_TOKENS >= 735 + 499
    plain = AdapterRequest(model="claude-opus-4-5", system="s", messages=[{"role": "user", "content": "hi"}], config={})
    custom = {"name": "lookup", "input_schema": {"type": "object"}}
    memory = {"type": "memory_20250818", "name": "memory"}

    def sent(tools):
        return input_tokens_bound({"system": "s", "messages": plain.messages, "tools": tools})

    assert request_tokens_bound(plain) == sent(None)
    assert request_tokens_bound(replace(plain, tools=[custom])) == sent([custom]) + TOOL_USE_SYSTEM_PROMPT_TOKENS
    assert (
        request_tokens_bound(replace(plain, tools=[memory]))
        == sent([memory]) + TOOL_USE_SYSTEM_PROMPT_TOKENS + ANTHROPIC_TOOL_TOKENS
    )


def test_a_history_replayed_again_with_turns_added_has_only_its_new_turns_made_again():
    history = [
        {"role": "user", "content": "first", "seq": 0},
        {"role": "assistant", "content": [{"type": "text", "text": " "}], "seq": 1},  # replayed as "(no content)"
    ]
    first = replayed_messages(history)
    longer = [*history, {"role": "user", "content": "second", "seq": 2}]

    again = replayed_messages(longer)

    assert again[0] is first[0] and again[1] is first[1]
    assert again == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "(no content)"},
        {"role": "user", "content": "second"},
    ]
    # The same first message, then another: the rest is made from the history given.
    other = [history[0], {"role": "assistant", "content": "another", "seq": 1}]
    assert replayed_messages(other)[1] == {"role": "assistant", "content": "another"}
    assert replayed_messages(history)[1] == {"role": "assistant", "content": "(no content)"}
