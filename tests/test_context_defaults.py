"""The settings an agent leaves unset: a budget derived from its own turns (so a session is
summarised every few heartbeats, whatever the model's window), a cache lifetime chosen from
how often it wakes and what the ledger shows, and growth advice naming the setting to change."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.apps import apps
from django.utils import timezone

from costs_app.models import CostEvent
from sessions_app.context import (
    DEFAULT_KEEP_RECENT_TURNS,
    SUMMARY_KINDS,
    SUMMARY_SYSTEM,
    context_settings,
    estimate_tokens,
)
from sessions_app.context_defaults import (
    GROWTH_TURNS,
    budget_ceiling,
    chosen_cache_ttl,
    derived_budget,
    growth_advice,
    typical_turn_tokens,
)
from sessions_app.models import Agent, AgentSession, HeartbeatRun, RunStatus
from sessions_app.stores import store_for
from tests.conftest import beat, context_agent
from tests.fake_anthropic import plain_system

pytestmark = pytest.mark.django_db

PROMPT = "You run operations. " * 100  # ~2,000 characters


def plain_agent(company, **config) -> Agent:
    """A persistent agent with no context settings at all."""
    return Agent.objects.create(
        company=company,
        name="defaults",
        system_prompt=PROMPT,
        adapter_config={"model": "claude-opus-4-5", "session_mode": "persistent", **config},
    )


def sent_tokens(body: dict) -> int:
    return estimate_tokens({"system": body.get("system"), "messages": body["messages"]})


def test_with_no_settings_a_session_is_summarised_every_few_turns_keeping_the_last_ones(company, fake_anthropic):
    agent = plain_agent(company)
    for i in range(40):
        assert beat(agent, f"task {i}: " + "check the queue and report. " * 28).status == RunStatus.SUCCEEDED

    session = AgentSession.objects.get(agent=agent)
    # 40 turns, a summary every GROWTH_TURNS or so once the first has room: several, not one.
    assert session.compaction_count >= 40 // (GROWTH_TURNS + DEFAULT_KEEP_RECENT_TURNS + 2)
    history = store_for(session).read(session)
    verbatim = [m for m in history if m.get("kind") not in SUMMARY_KINDS]
    assert history[0]["kind"] == "summary"
    assert verbatim[-2]["content"].startswith("task 39:")
    assert len(verbatim) >= 2 * DEFAULT_KEEP_RECENT_TURNS
    # What any request carried stayed within a dozen turns, far under half the window.
    assert max(sent_tokens(body) for body in fake_anthropic.message_requests) < 12_000


def test_under_the_defaults_the_last_exchange_is_always_replayed_verbatim(company, fake_anthropic):
    agent = plain_agent(company)
    outputs = []
    for i in range(30):
        run = beat(agent, f"task {i}: " + "check the queue and report. " * 28)
        assert run.status == RunStatus.SUCCEEDED
        outputs.append(run.output)

    answers = [body for body in fake_anthropic.message_requests if plain_system(body) != SUMMARY_SYSTEM]
    assert AgentSession.objects.get(agent=agent).compaction_count >= 2
    for i, body in enumerate(answers[1:], start=1):
        # Right after a summary too: the previous task and its answer, then this task.
        previous_task, previous_answer = body["messages"][-3:-1]
        assert text_of(previous_task).startswith(f"task {i - 1}:")
        assert text_of(previous_answer) == outputs[i - 1]


def text_of(message: dict) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(block.get("text", "") for block in content)


def test_the_budget_counts_the_prompt_the_task_the_summary_and_the_turns_kept_and_to_come(company):
    agent = plain_agent(company)
    turn = [{"role": "user", "content": "x" * 400}, {"role": "assistant", "content": "y" * 800}]
    history = turn * 5
    settings_ = context_settings(agent)

    budget = derived_budget(agent, settings_, history=history, user_content="z" * 400)

    per_turn = estimate_tokens("x" * 400) + estimate_tokens("y" * 800)
    expected = (
        estimate_tokens(PROMPT)
        + estimate_tokens("z" * 400)
        + 500
        + (settings_.keep_recent_turns + GROWTH_TURNS) * per_turn
    )
    assert budget == expected


def test_one_huge_answer_does_not_set_the_typical_turn():
    small = [{"role": "user", "content": "q" * 400}, {"role": "assistant", "content": "a" * 400}]
    huge = [{"role": "user", "content": "q" * 400}, {"role": "assistant", "content": "a" * 400_000}]
    assert typical_turn_tokens(small * 4 + huge) == typical_turn_tokens(small * 4)


def test_the_window_stays_the_ceiling(company):
    agent = plain_agent(company)
    agent.system_prompt = "p" * 2_000_000
    assert derived_budget(agent, context_settings(agent), history=[], user_content="go") == budget_ceiling(agent)
    assert budget_ceiling(agent) == 200_000 - 4096


def test_a_budget_that_is_set_is_kept(company, fake_anthropic):
    agent = context_agent(company, context_budget_tokens=50_000)
    for i in range(12):
        beat(agent, f"task {i}: " + "x" * 800)
    assert AgentSession.objects.get(agent=agent).compaction_count == 0


# --- the cache lifetime -------------------------------------------------------------------


def woken(agent, *, every: timedelta, times: int = 4) -> None:
    start = timezone.now() - every * times
    for i in range(times):
        assert beat(agent, f"wake {i}", now=start + every * i).status == RunStatus.SUCCEEDED


def markers(body: dict) -> set:
    found = set()
    for block in body["system"] if isinstance(body.get("system"), list) else []:
        if "cache_control" in block:
            found.add(block["cache_control"].get("ttl", "5m"))
    return found


@pytest.mark.parametrize(
    ("every", "expected"),
    [(timedelta(minutes=2), {"5m"}), (timedelta(minutes=30), {"1h"}), (timedelta(hours=2), set())],
)
def test_the_cache_lifetime_follows_how_often_the_agent_wakes(company, fake_anthropic, every, expected):
    agent = plain_agent(company)
    woken(agent, every=every)
    assert markers(fake_anthropic.message_requests[-1]) == expected


def test_before_three_wakes_the_five_minute_cache_is_used(company, fake_anthropic):
    agent = plain_agent(company)
    woken(agent, every=timedelta(hours=3), times=2)
    assert markers(fake_anthropic.message_requests[-1]) == {"5m"}


def test_a_set_lifetime_or_caching_turned_on_is_kept(company, fake_anthropic):
    fixed = plain_agent(company, cache_ttl="5m")
    woken(fixed, every=timedelta(minutes=30))
    assert markers(fake_anthropic.message_requests[-1]) == {"5m"}
    kept_on = plain_agent(company, prompt_caching=True)
    woken(kept_on, every=timedelta(hours=2))
    assert markers(fake_anthropic.message_requests[-1]) == {"5m"}


def ledger_calls(agent, now, *, read: int, written: int, calls: int = 3) -> None:
    CostEvent.objects.bulk_create(
        CostEvent(
            company_id=agent.company_id,
            agent_id=agent.id,
            kind="message",
            model=agent.model_name,
            cache_read_input_tokens=read,
            cache_creation_1h_input_tokens=written,
            cache_creation_input_tokens=written,
            created_at=now - timedelta(minutes=30 * i),
        )
        for i in range(calls)
    )


def wakes(agent, now, every: timedelta) -> None:
    HeartbeatRun.objects.bulk_create(
        HeartbeatRun(company_id=agent.company_id, agent=agent, task="t", status="succeeded", created_at=now - every * i)
        for i in range(4)
    )


def test_the_one_hour_cache_is_dropped_when_the_ledger_shows_it_does_not_pay(company):
    agent = plain_agent(company)
    now = timezone.now()
    wakes(agent, now, timedelta(minutes=30))
    ledger_calls(agent, now, read=0, written=5_000)  # written each time, never read back
    assert chosen_cache_ttl(agent, now=now) == "none"


def test_the_one_hour_cache_is_kept_when_its_reads_pay_for_its_writes(company):
    agent = plain_agent(company)
    now = timezone.now()
    wakes(agent, now, timedelta(minutes=30))
    ledger_calls(agent, now, read=8_000, written=600)
    assert chosen_cache_ttl(agent, now=now) == "1h"


def test_the_one_hour_cache_is_tried_before_it_is_judged(company):
    agent = plain_agent(company)
    now = timezone.now()
    wakes(agent, now, timedelta(minutes=30))
    ledger_calls(agent, now, read=0, written=5_000, calls=2)
    assert chosen_cache_ttl(agent, now=now) == "1h"


# --- the growth signal and the stored defaults --------------------------------------------


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ({"session_mode": "stateless"}, "system prompt"),
        ({"context_strategy": "none"}, "set rotate_after_turns to 20"),
        ({"context_budget_tokens": 80_000}, "context_budget_tokens is 80000: each run carries up to that much"),
        ({"context_budget_tokens": 80_000}, "Lower it to 40000"),
        ({"keep_recent_turns": 12}, "keep_recent_turns is 12"),
        ({"keep_recent_turns": 12}, "Set it to 1 (the default)"),
        ({"cache_ttl": "1h"}, "cache_ttl is fixed at 1h: remove it"),
        ({"context_strategy": "server"}, "set compaction_trigger_tokens to 75000"),
        ({"context_strategy": "server", "compaction_trigger_tokens": 60_000}, "to 50000"),
        ({}, "set rotate_after_turns to 20"),
    ],
)
def test_growth_advice_names_the_setting_to_change_and_to_what(company, config, names):
    agent = plain_agent(company, **config)
    assert names in growth_advice(agent)


def test_growth_advice_sizes_a_rotation_to_the_slope(company):
    from costs_app.reports import Growth

    agent = plain_agent(company, context_strategy="none")
    growth = Growth(agent_id=agent.id, runs=20, slope_tokens_per_run=1000, first_input_tokens=1, last_input_tokens=2)
    # A quarter of the window (195,904 // 4 = 48,976 tokens) at 1,000 tokens a run.
    assert "set rotate_after_turns to 48." in growth_advice(agent, growth)


def test_the_migration_forgets_the_cache_defaults_agents_stored(company):
    from importlib import import_module

    migration = import_module("sessions_app.migrations.0016_pinned_facts")
    old = plain_agent(company)
    Agent.objects.filter(pk=old.pk).update(
        adapter_config={"model": "claude-opus-4-5", "prompt_caching": True, "cache_ttl": "5m"}
    )
    chosen = plain_agent(company)
    Agent.objects.filter(pk=chosen.pk).update(
        adapter_config={"model": "claude-opus-4-5", "prompt_caching": False, "cache_ttl": "1h"}
    )

    migration.forget_stored_cache_defaults(apps, None)

    old.refresh_from_db()
    chosen.refresh_from_db()
    assert old.adapter_config == {"model": "claude-opus-4-5"}
    assert chosen.adapter_config == {"model": "claude-opus-4-5", "prompt_caching": False, "cache_ttl": "1h"}
