"""Cost rollups over the ledger: the input-growth signal."""

from __future__ import annotations

from django.utils import timezone

from sessions_app.models import Agent
from tests.conftest import beat, context_agent


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
