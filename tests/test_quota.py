"""Quota-aware dispatch (sessions_app/quota.py): a credential refused by a rate limit or a
spent quota is held until its reset; its runs wait queued, one probes at the reset.

Through the real SDK and the fake Messages API; time is passed as `now=`.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.utils import timezone
from django_q.models import Schedule

from costs_app.models import AlertDelivery, AlertEvent, AlertTarget, Budget, CostEvent
from sessions_app.adapters.rate_limits import (
    api_refusal,
    cli_refusal,
    credential_fingerprint,
    headroom_of,
)
from sessions_app.heartbeat import heartbeat_execute
from sessions_app.models import Agent, CredentialHold, HeartbeatRun, RunStatus, RunTrigger
from sessions_app.quota import WAKE_FUNC, quota_hold
from sessions_app.run_queue import claim_run, heartbeat_enqueue
from sessions_app.tasks import DEFAULT_SCHEDULED_TASK
from tests.api.conftest import api  # noqa: F401 F811 (the API tests' JSON client fixture)
from tests.conftest import FAKE_API_KEY, REPORTER, Actor, beat, on_own_connection, process_agent
from tests.fake_anthropic import Reply

RATE_LIMITED = Reply.error(
    429, "Number of request tokens has exceeded your per-minute rate limit", headers={"retry-after": "30"}
)
CREDIT_REFUSED = Reply.error(
    400, "Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing."
)


def agents(company, count: int, **config) -> list[Agent]:
    """`count` agents on the deployment's key, each with a system prompt of its own (the
    fake's requests say whose they are)."""
    return [
        Agent.objects.create(
            company=company,
            name=f"agent {i:02d}",
            system_prompt=f"You are agent {i:02d}.",
            adapter_config={"model": "claude-haiku-4-5", **config},
        )
        for i in range(count)
    ]


def queued(agent: Agent, now: datetime, task: str = "go") -> HeartbeatRun:
    return heartbeat_enqueue(agent=agent, task=task, now=now)[0]


# Refusals, read from what the provider said.


def test_a_429_names_its_reset_by_retry_after_or_by_the_spent_limits_reset():
    now = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    by_seconds = api_refusal(status=429, headers={"retry-after": "30"}, message="slow down", now=now)
    assert (by_seconds.code, by_seconds.reset(now=now)) == ("rate_limited", now + timedelta(seconds=30))
    headers = {
        "anthropic-ratelimit-requests-remaining": "12",
        "anthropic-ratelimit-requests-reset": "2026-12-02T12:00:05Z",
        "anthropic-ratelimit-tokens-remaining": "0",
        "anthropic-ratelimit-tokens-reset": "2026-12-02T12:01:00Z",
    }
    by_limit = api_refusal(status=429, headers=headers, message="", now=now)
    assert by_limit.reset(now=now) == datetime(2026, 12, 2, 12, 1, tzinfo=UTC)  # the spent one, not the nearest
    assert api_refusal(status=429, headers={}, message="", now=now).reset(now=now) is None
    assert api_refusal(status=500, headers={"retry-after": "30"}, message="", now=now) is None


def test_a_credit_refusal_is_a_quota_and_other_400s_are_not():
    now = datetime(2026, 12, 2, tzinfo=UTC)
    refusal = api_refusal(status=400, headers={}, message=CREDIT_REFUSED.error_message, now=now)
    assert (refusal.code, refusal.reset(now=now)) == ("credit_exhausted", None)
    assert api_refusal(status=400, headers={}, message="max_tokens: too large", now=now) is None


def test_claude_codes_usage_limit_names_its_reset_as_an_epoch_or_a_local_time():
    now = datetime(2026, 12, 2, 15, 30, tzinfo=UTC)
    epoch = int(datetime(2026, 12, 2, 17, 0, tzinfo=UTC).timestamp())
    assert cli_refusal(f"Claude AI usage limit reached|{epoch}", now=now).reset_at == datetime(
        2026, 12, 2, 17, 0, tzinfo=UTC
    )
    # 5pm in Berlin (UTC+1 in December) is 16:00 UTC; 9am has passed today, so tomorrow's.
    berlin = cli_refusal("5-hour limit reached ∙ usage limit reached, resets 5pm (Europe/Berlin)", now=now)
    assert berlin.reset_at == datetime(2026, 12, 2, 16, 0, tzinfo=UTC)
    assert cli_refusal("usage limit reached, resets at 9am", now=now).reset_at == datetime(2026, 12, 3, 9, tzinfo=UTC)
    assert cli_refusal("All good", now=now) is None


def test_headroom_is_the_tightest_limit_left():
    headers = {
        "anthropic-ratelimit-requests-limit": "50",
        "anthropic-ratelimit-requests-remaining": "40",
        "anthropic-ratelimit-tokens-limit": "10000",
        "anthropic-ratelimit-tokens-remaining": "500",
        "anthropic-ratelimit-tokens-reset": "2026-12-02T12:01:00Z",
    }
    headroom = headroom_of(headers)
    assert (headroom.kind, headroom.remaining, headroom.left) == ("tokens", 500, 0.05)
    assert headroom_of({}) is None


# The hold, through the engine.


@pytest.mark.django_db
def test_a_429_beyond_the_retry_window_holds_the_key_and_puts_the_run_back_unfailed(fake_anthropic, stateless_agent):
    fake_anthropic.outage = RATE_LIMITED
    now = timezone.now()
    run = beat(stateless_agent, now=now)
    # One request: the SDK did not sleep 30 seconds and retry (its max_retries is 2).
    assert len(fake_anthropic.message_requests) == 1
    assert (run.status, run.error_code, run.quota_requeues) == (RunStatus.QUEUED, "", 1)
    assert run.started_at is None and run.finished_at is None
    hold = CredentialHold.objects.get()
    assert hold.credential == credential_fingerprint(FAKE_API_KEY)
    assert FAKE_API_KEY not in hold.credential + hold.reason
    assert now + timedelta(seconds=29) < hold.held_until < now + timedelta(seconds=35)
    assert (hold.code, hold.refusals) == ("rate_limited", 1)
    assert hold.status_text.startswith("held until ") and "rate limit" in hold.status_text


@pytest.mark.django_db
def test_a_429_within_the_retry_window_is_the_sdks_to_retry(fake_anthropic, stateless_agent):
    fake_anthropic.push(Reply.error(429, "brief", headers={"retry-after": "0.1"}))
    run = beat(stateless_agent)
    assert run.status == RunStatus.SUCCEEDED
    assert len(fake_anthropic.message_requests) == 2
    assert not CredentialHold.objects.exists()


@pytest.mark.django_db
def test_while_held_no_run_of_the_key_is_claimed_and_ticks_merge(fake_anthropic, company):
    first, second = agents(company, 2)
    fake_anthropic.outage = RATE_LIMITED
    now = timezone.now()
    beat(first, now=now)
    later = now + timedelta(seconds=10)
    run = beat(second, now=later)
    assert run.status == RunStatus.QUEUED and run.quota_requeues == 0  # never claimed
    assert len(fake_anthropic.message_requests) == 1
    # A scheduled tick counts itself on the queued run instead of queueing another.
    merged, created = heartbeat_enqueue(agent=second, task="tick", now=later, merge=True, trigger="schedule")
    assert (merged.id, created, merged.merged_ticks) == (run.id, False, 1)


@pytest.mark.django_db
def test_a_run_that_uses_no_held_credential_is_not_held(fake_anthropic, company, tmp_path):
    fake_anthropic.outage = RATE_LIMITED
    now = timezone.now()
    beat(agents(company, 1)[0], now=now)
    assert beat(process_agent(company, tmp_path, REPORTER), now=now).status == RunStatus.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_at_the_reset_exactly_one_run_probes_and_its_success_releases_the_hold(fake_anthropic, company):
    first, second = agents(company, 2)
    fake_anthropic.outage = RATE_LIMITED
    now = timezone.now()
    held_run = beat(first, now=now)
    waiting = queued(second, now)
    reset = CredentialHold.objects.get().held_until + timedelta(seconds=1)
    fake_anthropic.outage = None
    seen = {}

    def second_worker():
        # Another worker claims while the probe's call is in flight: it waits.
        seen["claimed"] = claim_run(run_id=waiting.id, now=reset)[1]

    fake_anthropic.push(Reply.during(on_own_connection(second_worker)))
    probe = heartbeat_execute(run_id=held_run.id, now=reset)
    assert probe.status == RunStatus.SUCCEEDED
    assert seen == {"claimed": False}
    hold = CredentialHold.objects.get()
    assert hold.held_until is None and hold.released_at is not None
    assert heartbeat_execute(run_id=waiting.id, now=reset).status == RunStatus.SUCCEEDED
    assert len(fake_anthropic.message_requests) == 3  # the refusal, the probe, the drained run


@pytest.mark.django_db
def test_a_refused_probe_extends_the_hold_and_the_run_waits_again(fake_anthropic, stateless_agent):
    fake_anthropic.outage = RATE_LIMITED
    now = timezone.now()
    run = beat(stateless_agent, now=now)
    first_until = CredentialHold.objects.get().held_until
    probe = heartbeat_execute(run_id=run.id, now=first_until + timedelta(seconds=1))
    assert (probe.status, probe.quota_requeues) == (RunStatus.QUEUED, 2)
    hold = CredentialHold.objects.get()
    assert hold.held_until > first_until and hold.refusals == 2 and hold.probe_run is None
    assert len(fake_anthropic.message_requests) == 2


@pytest.mark.django_db
def test_a_credit_refusal_holds_for_the_configured_ceiling(fake_anthropic, stateless_agent, settings):
    settings.PAPERCLIP_QUOTA_HOLD_SECONDS = 120
    fake_anthropic.outage = CREDIT_REFUSED
    now = timezone.now()
    run = beat(stateless_agent, now=now)
    assert run.status == RunStatus.QUEUED
    hold = CredentialHold.objects.get()
    assert hold.code == "credit_exhausted"
    # From the refusal, which came a moment after the run's `now`.
    assert now + timedelta(seconds=120) <= hold.held_until < now + timedelta(seconds=125)
    assert not HeartbeatRun.objects.filter(status=RunStatus.FAILED).exists()


@pytest.mark.django_db
def test_billed_calls_stay_billed_and_the_next_attempt_numbers_after_them(fake_anthropic, company):
    agent = Agent.objects.create(
        company=company, name="Notes", adapter_config={"model": "claude-opus-4-5", "memory": True}
    )
    fake_anthropic.push(
        Reply.tool_calls({"command": "create", "path": "/memories/kept.md", "file_text": "kept"}),
        RATE_LIMITED,
    )
    now = timezone.now()
    run = beat(agent, "write, then meet the limit", now=now)
    first_cost = CostEvent.objects.get(run=run).cost_usd
    assert (run.status, run.cost_usd, run.calls_before) == (RunStatus.QUEUED, first_cost, 1)
    reset = CredentialHold.objects.get().held_until + timedelta(seconds=1)
    done = heartbeat_execute(run_id=run.id, now=reset)
    assert done.status == RunStatus.SUCCEEDED
    rows = list(CostEvent.objects.filter(run=run).order_by("call_number"))
    assert [row.call_number for row in rows] == [1, 2]  # the second attempt's call is not deduplicated into the first's
    assert done.cost_usd == sum(row.cost_usd for row in rows)


@pytest.mark.django_db(transaction=True)
def test_two_workers_claiming_as_the_hold_is_set_never_claim_after_it(fake_anthropic, company):
    """The worst moment: a worker has read "nothing held" and is about to write its claim
    when another worker's refusal sets the hold. Its claim's UPDATE checks the hold
    itself, so the run stays queued."""
    first, second = agents(company, 2)
    now = timezone.now()
    waiting = queued(second, now)
    about_to_claim, hold_set = threading.Event(), threading.Event()

    def pause_before_claim(execute, sql, params, many, context):
        if sql.startswith("UPDATE") and "heartbeat_runs" in sql and RunStatus.RUNNING in params:
            about_to_claim.set()
            hold_set.wait(15)
        return execute(sql, params, many, context)

    def claim():
        with connection.execute_wrapper(pause_before_claim):
            return claim_run(run_id=waiting.id, now=now)[1]

    claimer = Actor(claim)
    claimer.start()
    if not about_to_claim.wait(15):
        claimer.result()
    assert about_to_claim.is_set()
    quota_hold(credential=credential_fingerprint(FAKE_API_KEY), code="rate_limited", reason="429", until=None, now=now)
    hold_set.set()
    assert claimer.result() is False
    assert HeartbeatRun.objects.get(id=waiting.id).status == RunStatus.QUEUED
    assert fake_anthropic.message_requests == []


@pytest.mark.django_db(transaction=True)
def test_of_two_workers_at_the_reset_exactly_one_takes_the_probe(company, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", FAKE_API_KEY)
    first, second = agents(company, 2)
    now = timezone.now()
    runs = [queued(first, now), queued(second, now)]
    quota_hold(credential=credential_fingerprint(FAKE_API_KEY), code="rate_limited", reason="429", until=None, now=now)
    reset = CredentialHold.objects.get().held_until + timedelta(seconds=1)
    barrier = threading.Barrier(2)

    def claim(run):
        def attempt():
            barrier.wait(15)
            return claim_run(run_id=run.id, now=reset)[1]

        return attempt

    actors = [Actor(claim(run)) for run in runs]
    for actor in actors:
        actor.start()
    assert sorted(actor.result() for actor in actors) == [False, True]
    assert CredentialHold.objects.get().probe_run in {run.id for run in runs}


@pytest.mark.django_db
def test_a_new_hold_and_its_release_are_sent_once_to_targets_that_asked(fake_anthropic, stateless_agent, company):
    budget = Budget.objects.create(company=company, monthly_limit_usd=100)
    asked = AlertTarget.objects.create(budget=budget, url="http://127.0.0.1:9/q", secret="s" * 16, quota_events=True)
    AlertTarget.objects.create(budget=budget, url="http://127.0.0.1:9/b", secret="s" * 16)
    fake_anthropic.outage = RATE_LIMITED
    now = timezone.now()
    run = beat(stateless_agent, now=now)
    beat(stateless_agent, now=now)  # a second refusal... is not: the run waits, no second call
    assert [event.kind for event in AlertEvent.objects.all()] == ["quota_held"]
    fake_anthropic.outage = None
    reset = CredentialHold.objects.get().held_until + timedelta(seconds=1)
    assert heartbeat_execute(run_id=run.id, now=reset).status == RunStatus.SUCCEEDED
    assert sorted(event.kind for event in AlertEvent.objects.all()) == ["quota_held", "quota_released"]
    assert {delivery.target_id for delivery in AlertDelivery.objects.all()} == {asked.id}
    assert AlertDelivery.objects.count() == 2


# The storm: fifty scheduled agents on one key, the provider refusing everything.

AGENTS = 50


def scheduled_tick(agent: Agent, now: datetime) -> HeartbeatRun:
    """What `tasks.scheduled_heartbeat` does at a tick (merge into an unfinished run, or
    queue one and try it once), at a chosen `now`."""
    run, created = heartbeat_enqueue(
        agent=agent, task=DEFAULT_SCHEDULED_TASK, trigger=RunTrigger.SCHEDULE, now=now, merge=True
    )
    return heartbeat_execute(run_id=run.id, now=now) if created else run


def quota_wake_if_due(now: datetime) -> None:
    """The wake the hold armed for its reset, when it is due: django-q2 fires the ONCE row
    (deleting it) and `tasks.quota_wake` hands each waiting agent's oldest run to a
    worker, which tries it (`dispatch_waiting`), here one after the other at `now`."""
    due = Schedule.objects.filter(name__startswith="quota:", next_run__lte=now, func=WAKE_FUNC)
    if not due.delete()[0]:
        return
    heads = HeartbeatRun.objects.filter(status=RunStatus.QUEUED).order_by("agent_id", "created_at")
    for run in {run.agent_id: run for run in reversed(list(heads))}.values():
        heartbeat_execute(run_id=run.id, now=now)


@pytest.mark.django_db
@pytest.mark.parametrize("outage", [RATE_LIMITED, CREDIT_REFUSED], ids=["429 retry-after 30", "400 credit"])
def test_fifty_scheduled_agents_meet_a_refusing_provider_with_one_call_then_one_probe_per_reset(
    fake_anthropic, company, settings, outage
):
    settings.PAPERCLIP_QUOTA_HOLD_SECONDS = 30  # the credit refusal names no reset
    fleet = agents(company, AGENTS, heartbeat_interval_minutes=1)
    fake_anthropic.outage = outage
    start = timezone.now()
    # Over the next minute every agent's tick comes (a second apart, then each again a
    # minute later): the first one's call is refused, the hold stops the rest.
    ticks = sorted(
        [(start + timedelta(seconds=1.2 * i), agent) for i, agent in enumerate(fleet)]
        + [(start + timedelta(seconds=60 + 1.2 * i), agent) for i, agent in enumerate(fleet)],
        key=lambda tick: tick[0],
    )
    probes = []
    for at, agent in ticks:
        before = len(fake_anthropic.message_requests)
        scheduled_tick(agent, at)
        quota_wake_if_due(at)
        if len(fake_anthropic.message_requests) > before:
            probes.append(at)
    # One call before the hold, then one probe each time the hold (30 s) ran out.
    assert len(probes) == len(fake_anthropic.message_requests)
    assert probes[0] == start
    assert len(probes) >= 4, probes  # 0 s, then after each 30-second hold in the two minutes
    assert all(later - earlier >= timedelta(seconds=30) for earlier, later in zip(probes, probes[1:], strict=False))
    assert len(probes) <= 1 + (ticks[-1][0] - start) // timedelta(seconds=30)
    assert not HeartbeatRun.objects.filter(status=RunStatus.FAILED).exists()
    # One queued run per agent: the second minute's ticks merged into it.
    assert HeartbeatRun.objects.filter(status=RunStatus.QUEUED).count() == AGENTS
    assert HeartbeatRun.objects.count() == AGENTS

    # The provider recovers. At the next reset the probe succeeds and the queue drains.
    fake_anthropic.outage = None
    reset = CredentialHold.objects.get().held_until + timedelta(seconds=1)
    answered = len(fake_anthropic.message_requests)
    for run in HeartbeatRun.objects.filter(status=RunStatus.QUEUED).order_by("created_at"):
        heartbeat_execute(run_id=run.id, now=reset)
    assert CredentialHold.objects.get().held_until is None
    runs = HeartbeatRun.objects.all()
    assert {run.status for run in runs} == {RunStatus.SUCCEEDED}
    assert sorted(run.agent_id for run in runs) == sorted(agent.id for agent in fleet)  # none lost, none doubled
    assert len(fake_anthropic.message_requests) - answered == AGENTS  # each answered once
    assert CostEvent.objects.count() == AGENTS


@pytest.mark.django_db
def test_a_waiting_request_is_answered_queued_at_once_while_its_key_is_held(fake_anthropic, company, api):  # noqa: F811
    first, second = agents(company, 2)
    fake_anthropic.outage = RATE_LIMITED
    beat(first)
    started = time.monotonic()
    response = api.post(f"/api/companies/{company.id}/agents/{second.id}/heartbeat", {"task": "now", "wait": True})
    assert time.monotonic() - started < 5
    assert response.status_code == 202, response.json()
    assert response.json()["status"] == RunStatus.QUEUED
    assert len(fake_anthropic.message_requests) == 1


@pytest.mark.django_db
def test_little_left_of_a_rate_limit_paces_the_claims_before_any_refusal(fake_anthropic, company):
    first, second, third = agents(company, 3)
    now = timezone.now()
    reset = now + timedelta(seconds=60)
    fake_anthropic.answer_headers = {
        "anthropic-ratelimit-requests-limit": "100",
        "anthropic-ratelimit-requests-remaining": "2",
        "anthropic-ratelimit-requests-reset": reset.isoformat(),
    }
    assert beat(first, now=now).status == RunStatus.SUCCEEDED
    # Two requests left for a minute: one claim per 20 seconds.
    hold = CredentialHold.objects.get()
    assert (hold.code, hold.held_until is not None) == ("paced", True)
    assert now + timedelta(seconds=19) < hold.held_until < now + timedelta(seconds=22)
    assert beat(second, now=now + timedelta(seconds=5)).status == RunStatus.QUEUED
    assert AlertEvent.objects.count() == 0  # pacing is no hold to alert on
    later = hold.held_until + timedelta(seconds=1)
    # Its answer says one request is left: the next pace (half the 39 s left) replaces this one.
    fake_anthropic.answer_headers["anthropic-ratelimit-requests-remaining"] = "1"
    assert heartbeat_execute(run_id=HeartbeatRun.objects.get(agent=second).id, now=later).status == RunStatus.SUCCEEDED
    paced = CredentialHold.objects.get()
    assert paced.code == "paced" and later + timedelta(seconds=15) < paced.held_until < later + timedelta(seconds=22)
    assert beat(third, now=later + timedelta(seconds=5)).status == RunStatus.QUEUED
    fake_anthropic.answer_headers = {}
    done = heartbeat_execute(
        run_id=HeartbeatRun.objects.get(agent=third).id, now=paced.held_until + timedelta(seconds=1)
    )
    assert done.status == RunStatus.SUCCEEDED
    assert CredentialHold.objects.get().held_until is None  # plenty left again: no pace


def test_claude_code_stopped_by_its_usage_limit_is_a_refusal_with_its_reset():
    from claude_agent_sdk import RateLimitEvent, RateLimitInfo

    from sessions_app.adapters.claude_cli import Conversation, usage_limit_refusal

    conversation = Conversation()
    resets = int(datetime(2026, 12, 2, 17, tzinfo=UTC).timestamp())
    conversation.messages.append(
        RateLimitEvent(
            rate_limit_info=RateLimitInfo(status="rejected", resets_at=resets, rate_limit_type="five_hour"),
            uuid="u",
            session_id="s",
        )
    )
    refusal = usage_limit_refusal(conversation)
    assert (refusal.code, refusal.reset(now=datetime(2026, 12, 2, tzinfo=UTC))) == (
        "usage_limit",
        datetime(2026, 12, 2, 17, tzinfo=UTC),
    )
    assert usage_limit_refusal(Conversation()) is None
