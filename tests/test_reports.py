"""Cost rollups over the ledger: the input-growth signal."""

from __future__ import annotations

from django.utils import timezone

from costs_app.reports import Growth
from sessions_app.models import Agent
from tests.conftest import beat, context_agent


def test_growth_signal_flags_a_session_that_accumulates_history(company, fake_anthropic):
    from costs_app.reports import daily_input_growth, input_growth

    growing = context_agent(company, context_strategy="none", prompt_caching=False)
    for i in range(10):
        beat(growing, f"step {i} " + "detail " * 400)
    flat = Agent.objects.create(company=company, name="flat", adapter_config={"model": "claude-opus-4-5"})
    for i in range(10):
        beat(flat, f"step {i} " + "detail " * 400)

    window = 200_000 - 4096
    assert input_growth(agent_id=growing.id).is_growing(ceiling_tokens=window)
    assert input_growth(agent_id=growing.id).slope_tokens_per_run > 400
    assert not input_growth(agent_id=flat.id).is_growing(ceiling_tokens=window)
    today = daily_input_growth(agent_id=growing.id, now=timezone.now())
    assert len(today["days"]) == 1 and today["days"][0]["input_tokens_per_call"] > 0


def growth(runs: int, first: int, last: int) -> Growth:
    return Growth(
        agent_id=None,
        runs=runs,
        slope_tokens_per_run=(last - first) / max(runs - 1, 1),
        first_input_tokens=first,
        last_input_tokens=last,
    )


def test_growth_needs_enough_calls_and_a_slope_that_matters_against_the_ceiling():
    window = 200_000 - 4096
    assert not growth(6, 12, 119).is_growing(ceiling_tokens=window)  # a few calls: noise
    assert not growth(30, 12, 600).is_growing(ceiling_tokens=window)  # 20 tokens a run: 1,000 in 50 runs
    assert growth(12, 1_000, 10_000).is_growing(ceiling_tokens=window)  # 818 a run: 41k in 50 runs
    assert not growth(9, 1_000, 10_000).is_growing(ceiling_tokens=window)  # too few calls yet
    assert growth(12, 12, 243).is_growing(ceiling_tokens=1_000)  # 21 a run against a 1,000-token budget
    assert not growth(12, 10_000, 1_000).is_growing(ceiling_tokens=1_000)  # shrinking
