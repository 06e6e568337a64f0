"""Pinned facts: every summary (a compaction, compact now, a handoff note) keeps an agent's
pins, asking once more for a summary that left one out and carrying it verbatim when the
retry leaves it out too; the candidates found in the replaced turns are checked and recorded."""

from __future__ import annotations

from decimal import Decimal

import pytest

from costs_app.models import Budget, CostEvent, CostKind
from sessions_app.compact_now import session_compact
from sessions_app.context import SUMMARY_KINDS
from sessions_app.models import AgentSession, HeartbeatRun, PinnedFact, RunStatus, SessionCompaction
from sessions_app.pins import (
    KEPT_FACTS_HEADING,
    PinRefused,
    fact_candidates,
    facts_missing,
    pin_create,
    pin_text_validate,
)
from sessions_app.stores import store_for
from tests.conftest import beat, context_agent, is_summary_request, on_own_connection
from tests.fake_anthropic import Reply

pytestmark = pytest.mark.django_db

PINS = ["Customer ACME-42 renews on 2027-03-01", "Never deploy on Fridays"]


def pinned_agent(company, **config):
    agent = context_agent(company, **{"context_budget_tokens": 1000, "keep_recent_turns": 1, **config})
    for text in PINS:
        pin_create(agent=agent, text=text)
    return agent


def talk_until_compacted(agent, times: int, start: int = 0) -> int:
    """Heartbeats of ~400 characters until the session was compacted `times` times; returns
    the next step's number."""
    for step in range(start, start + 40):
        assert beat(agent, f"step {step}: see https://ci.example.com/b/{step} " + "x" * 400).status == "succeeded"
        if AgentSession.objects.get(agent=agent).compaction_count >= times:
            return step + 1
    raise AssertionError("no compaction happened")


def summary_turn(agent) -> str:
    session = AgentSession.objects.get(agent=agent, status__in=["active", "paused"])
    history = store_for(session).read(session)
    assert history[0]["kind"] in SUMMARY_KINDS
    return history[0]["content"]


def summary_requests(fake) -> list[dict]:
    return [body for body in fake.message_requests if is_summary_request(body)]


def request_text(body: dict) -> str:
    content = body["messages"][0]["content"]
    return content if isinstance(content, str) else "".join(block["text"] for block in content)


def test_pinned_facts_survive_two_compactions_of_a_summariser_that_drops_them(company, fake_anthropic):
    agent = pinned_agent(company)

    step = talk_until_compacted(agent, 1)
    talk_until_compacted(agent, 2, start=step)

    assert all(text in summary_turn(agent) for text in PINS)
    beat(agent, "what do we know?")  # ...and so in the request the next heartbeat sends
    last = fake_anthropic.message_requests[-1]
    assert all(text in str(last["messages"]) for text in PINS)
    records = list(SessionCompaction.objects.filter(session__agent=agent).order_by("created_at"))
    assert len(records) == 2
    for record in records:
        pins = [fact for fact in record.facts if fact["source"] == "pin"]
        assert [(f["text"], f["passed"], f["via"]) for f in pins] == [(t, False, "kept_facts") for t in PINS]
        assert record.summary_attempts == 2
        assert KEPT_FACTS_HEADING in record.summary


def test_each_summary_request_names_the_pins_and_a_retry_names_the_missing_ones(company, fake_anthropic):
    agent = pinned_agent(company)
    talk_until_compacted(agent, 1)

    first, retry = summary_requests(fake_anthropic)
    assert "[Pinned facts]" in request_text(first) and all(text in request_text(first) for text in PINS)
    assert "[Missing from your previous summary]" in request_text(retry)
    assert request_text(retry).split("[Missing from your previous summary]")[1].count("- ") == len(PINS)


def test_a_summary_that_keeps_the_pins_is_asked_for_once(company, fake_anthropic):
    agent = pinned_agent(company)
    fake_anthropic.writer = lambda body: ("Work so far. " + "; ".join(PINS)) if is_summary_request(body) else None

    talk_until_compacted(agent, 1)

    assert len(summary_requests(fake_anthropic)) == 1
    record = SessionCompaction.objects.get(session__agent=agent)
    assert record.summary_attempts == 1
    assert KEPT_FACTS_HEADING not in record.summary
    assert [(f["passed"], f["via"]) for f in record.facts if f["source"] == "pin"] == [(True, "summary")] * 2
    assert CostEvent.objects.filter(agent_id=agent.id, kind=CostKind.COMPACTION).count() == 1


def test_a_retry_that_keeps_them_is_kept_and_both_calls_are_billed_once(company, fake_anthropic):
    agent = pinned_agent(company)
    for i in range(3):
        assert beat(agent, f"step {i}: " + "x" * 400).status == RunStatus.SUCCEEDED
    fake_anthropic.push(Reply.message("A summary without them."), Reply.message("Again: " + " and ".join(PINS)))

    assert beat(agent, "y" * 2400).status == RunStatus.SUCCEEDED

    record = SessionCompaction.objects.get(session__agent=agent)
    assert (record.summary_attempts, record.summary) == (2, "Again: " + " and ".join(PINS))
    assert [f["via"] for f in record.facts if f["source"] == "pin"] == ["retry", "retry"]
    events = CostEvent.objects.filter(agent_id=agent.id, kind=CostKind.COMPACTION)
    assert events.count() == 2
    assert record.cost_usd == sum(e.cost_usd for e in events)
    session = AgentSession.objects.get(agent=agent)
    assert session.total_cost_usd == sum(e.cost_usd for e in CostEvent.objects.filter(agent_id=agent.id))


@pytest.mark.django_db(transaction=True)
def test_the_first_attempt_is_in_the_ledger_and_the_retry_reserved_before_the_retry_is_sent(company, fake_anthropic):
    agent = pinned_agent(company)
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("100"))
    for i in range(3):
        assert beat(agent, f"step {i}: " + "x" * 400).status == RunStatus.SUCCEEDED
    seen = {}

    def look():
        run = HeartbeatRun.objects.get(agent=agent, status=RunStatus.RUNNING)
        seen["ledger"] = CostEvent.objects.filter(run=run, kind=CostKind.COMPACTION).count()
        seen["reserved"] = run.reserved_usd

    fake_anthropic.push(Reply.message("Nothing pinned here."), Reply.during(on_own_connection(look)))

    assert beat(agent, "y" * 2400).status == RunStatus.SUCCEEDED

    assert fake_anthropic.action_errors == []
    assert seen["ledger"] == 1 and seen["reserved"] > 0


def test_candidates_from_the_replaced_turns_are_checked_and_recorded(company, fake_anthropic):
    agent = pinned_agent(company)
    talk_until_compacted(agent, 1)

    record = SessionCompaction.objects.get(session__agent=agent)
    candidates = {f["text"]: f for f in record.facts if f["source"] == "candidate"}
    assert "https://ci.example.com/b/0" in candidates
    # The fake's summary quotes the start of what it was given: the first URL, not the others.
    assert candidates["https://ci.example.com/b/0"]["passed"] is True
    assert candidates["https://ci.example.com/b/1"] == {
        "text": "https://ci.example.com/b/1",
        "source": "candidate",
        "passed": False,
        "via": "",
    }


def test_compact_now_keeps_the_pins_too(company, fake_anthropic):
    agent = pinned_agent(company, context_budget_tokens=100_000)
    for i in range(4):
        beat(agent, f"step {i}")

    record = session_compact(session=AgentSession.objects.get(agent=agent), now=HeartbeatRun.objects.first().created_at)

    assert all(text in record.summary for text in PINS)
    assert record.summary_attempts == 2


def test_a_rotation_carries_the_pins_into_the_handoff_note(company, fake_anthropic):
    agent = pinned_agent(company, rotate_after_turns=2, context_budget_tokens=100_000)
    for i in range(3):
        assert beat(agent, f"step {i}").status == RunStatus.SUCCEEDED

    live = AgentSession.objects.get(agent=agent, status="active")
    assert live.predecessor_id is not None
    assert all(text in summary_turn(agent) for text in PINS)
    handoff = SessionCompaction.objects.get(session=live, kind="handoff")
    assert [(f["passed"], f["via"]) for f in handoff.facts if f["source"] == "pin"] == [(False, "kept_facts")] * 2


def test_pins_belong_to_the_agent_and_outlive_its_sessions(company, fake_anthropic):
    agent = pinned_agent(company)
    beat(agent, "one")
    AgentSession.objects.filter(agent=agent).delete()
    assert PinnedFact.objects.filter(agent=agent).count() == len(PINS)


# --- the pieces ------------------------------------------------------------------------


def test_a_fact_is_found_whatever_its_case_and_spacing():
    assert facts_missing("We never  deploy\non FRIDAYS.", ["Never deploy on Fridays", "ACME-42"]) == ["ACME-42"]


def test_candidates_are_urls_paths_ids_and_numbers_once_each():
    text = (
        "See https://example.com/a/b?x=1. Fix src/app/main.py and /etc/nginx/nginx.conf, ticket PAP-1234 "
        "at commit 3f2a9bc1, cost $1,200.50 for 42 users in 7 days; PAP-1234 again."
    )
    assert fact_candidates(text) == [
        "https://example.com/a/b?x=1",
        "src/app/main.py",
        "/etc/nginx/nginx.conf",
        "PAP-1234",
        "3f2a9bc1",
        "$1,200.50",
        "42",
    ]


@pytest.mark.parametrize("text", ["", "   ", None, 42, "a\x00b", "x" * 501, "\ud800"])
def test_bad_pin_text_is_refused(text):
    with pytest.raises(PinRefused):
        pin_text_validate(text)


def test_an_agent_has_at_most_fifty_pins(company):
    agent = context_agent(company)
    PinnedFact.objects.bulk_create(PinnedFact(agent=agent, text=f"fact {i}") for i in range(50))
    with pytest.raises(PinRefused) as refused:
        pin_create(agent=agent, text="one more")
    assert refused.value.code == "too_many_pins"
