from __future__ import annotations

import re
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.utils import timezone
from django_q.models import OrmQ

from costs_app.models import CostEvent
from sessions_app.api_keys import api_key_create
from sessions_app.errors import HeartbeatRefused
from sessions_app.models import Agent, AgentStatus, HeartbeatRun, RunStatus
from sessions_app.services import agents_hard_delete
from sessions_app.views import refusal_error, seconds_until_next_utc_month
from tests.api.conftest import Api, agent_url, assert_error, make_run
from tests.conftest import on_own_connection
from tests.fake_anthropic import Reply, canonical_content
from tests.live.server import wait_until

pytestmark = pytest.mark.django_db

RUN_KEYS = {"id", "status", "session_id", "output", "usage", "cost_usd", "error", "started_at", "finished_at"}
USAGE_KEYS = {"input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"}


def test_heartbeat_with_wait_answers_200_with_the_finished_run(api, persistent_agent, fake_anthropic):
    fake_anthropic.push(Reply.message("Done.", usage={"input_tokens": 30, "output_tokens": 4}))
    response = api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "Summarise yesterday", "wait": True})
    assert response.status_code == 200, response.json()
    run = response.json()
    assert RUN_KEYS <= set(run)
    assert set(run["usage"]) >= USAGE_KEYS
    assert run["status"] == "succeeded"
    assert run["output"] == "Done."
    assert run["usage"]["input_tokens"] == 30 and run["usage"]["output_tokens"] == 4
    assert re.fullmatch(r"sess_[0-9a-f]{32}", run["session_id"])
    assert isinstance(run["cost_usd"], str)
    assert run["error"] is None
    assert run["started_at"] and run["finished_at"]
    assert CostEvent.objects.filter(run_id=run["id"]).count() == 1
    sent = fake_anthropic.message_requests
    # The task is the request's last turn (marked for the cache: the next heartbeat's prefix).
    assert canonical_content(sent[-1]["messages"][-1]["content"]) == [{"type": "text", "text": "Summarise yesterday"}]


def test_stateless_heartbeat_has_no_session(api, stateless_agent, fake_anthropic):
    run = api.post(agent_url(stateless_agent, "/heartbeat"), {"task": "hi", "wait": True}).json()
    assert run["status"] == "succeeded"
    assert run["session_id"] is None


def test_heartbeat_whose_model_call_fails_is_200_with_a_failed_run(api, stateless_agent, fake_anthropic):
    fake_anthropic.push(*[Reply.error(400, "bad request")] * 3)
    response = api.post(agent_url(stateless_agent, "/heartbeat"), {"task": "hi", "wait": True})
    assert response.status_code == 200
    run = response.json()
    assert run["status"] == "failed"
    assert run["error"] and run["error_code"]


def test_heartbeat_without_wait_answers_202_and_queues_the_run(
    api, persistent_agent, fake_anthropic, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        response = api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "later"})
    assert response.status_code == 202
    run = response.json()
    assert run["status"] == "queued"
    assert run["finished_at"] is None
    assert response["Location"].endswith(f"/runs/{run['id']}")
    assert OrmQ.objects.count() == 1
    assert fake_anthropic.message_requests == []


def test_same_idempotency_key_returns_the_same_run_and_calls_the_model_once(api, persistent_agent, fake_anthropic):
    body = {"task": "once", "idempotency_key": "k-1", "wait": True}
    first = api.post(agent_url(persistent_agent, "/heartbeat"), body)
    second = api.post(agent_url(persistent_agent, "/heartbeat"), body)
    assert first.status_code == second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    assert len(fake_anthropic.message_requests) == 1
    assert HeartbeatRun.objects.count() == 1


def test_same_idempotency_key_of_an_unfinished_run_is_202_and_not_started(
    api, persistent_agent, fake_anthropic, django_capture_on_commit_callbacks
):
    api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "once", "idempotency_key": "k-2"})
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        again = api.post(
            agent_url(persistent_agent, "/heartbeat"), {"task": "once", "idempotency_key": "k-2", "wait": True}
        )
    assert again.status_code == 202
    assert again.json()["status"] == "queued"
    assert callbacks == []
    assert fake_anthropic.message_requests == []


def test_idempotency_key_reused_for_another_task_is_409(api, persistent_agent, fake_anthropic):
    api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "one", "idempotency_key": "k-3"})
    assert_error(
        api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "two", "idempotency_key": "k-3"}),
        409,
        "idempotency_key_reused",
    )


def test_heartbeat_of_a_paused_agent_is_409(api, persistent_agent):
    persistent_agent.status = AgentStatus.PAUSED
    persistent_agent.save()
    assert_error(api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "hi"}), 409, "agent_paused")


# Stored by SQL or by an older version: no save accepts them, and the enqueue reads each.
UNSAVEABLE_SETTINGS = [
    ("context_budget_tokens", "abc"),
    ("keep_recent_turns", "x"),
    ("summary_model", 5),
]


@pytest.mark.parametrize(("setting", "value"), UNSAVEABLE_SETTINGS, ids=[s for s, _ in UNSAVEABLE_SETTINGS])
def test_heartbeat_of_an_agent_whose_stored_setting_no_save_accepts_is_409_naming_it(
    api, persistent_agent, fake_anthropic, setting, value
):
    Agent.objects.filter(pk=persistent_agent.pk).update(
        adapter_config={**persistent_agent.adapter_config, setting: value}
    )

    error = assert_error(
        api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "hi"}), 409, "agent_config_invalid"
    )

    assert f"adapter_config.{setting}" in error["message"]
    assert not HeartbeatRun.objects.filter(agent=persistent_agent).exists()
    assert fake_anthropic.message_requests == []


def test_a_run_whose_agents_stored_setting_breaks_it_fails_naming_the_setting(api, persistent_agent, fake_anthropic):
    Agent.objects.filter(pk=persistent_agent.pk).update(
        adapter_config={**persistent_agent.adapter_config, "max_tokens": "x"}
    )

    answer = api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "hi", "wait": True})

    assert answer.status_code == 200, answer.content
    run = answer.json()
    assert (run["status"], run["error_code"]) == ("failed", "agent_config_invalid")
    assert "adapter_config.max_tokens" in run["error"]


def test_heartbeat_of_a_deleted_agent_is_404(api, persistent_agent):
    persistent_agent.status = AgentStatus.DELETED
    persistent_agent.save()
    assert_error(api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "hi"}), 404)


@pytest.mark.django_db(transaction=True)
def test_a_waiting_heartbeat_whose_agent_is_removed_entirely_meanwhile_is_404_agent_deleted(
    api, persistent_agent, fake_anthropic
):
    remove = on_own_connection(
        lambda: agents_hard_delete(agents=Agent.objects.filter(pk=persistent_agent.pk), now=timezone.now())
    )
    fake_anthropic.push(Reply.during(remove))

    response = api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "hi", "wait": True})

    assert_error(response, 404, "agent_deleted")
    assert CostEvent.objects.filter(agent_id=persistent_agent.id).count() == 1  # the answered call


def test_task_over_the_limit_is_400(api, persistent_agent, settings):
    settings.PAPERCLIP_MAX_TASK_CHARS = 10
    error = assert_error(api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "x" * 11}), 400, "invalid")
    assert "task" in error["fields"]
    assert not HeartbeatRun.objects.exists()


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "task"),
        ({"task": ""}, "task"),
        ({"task": "   "}, "task"),
        ({"task": 42}, "task"),
        ({"task": ["a"]}, "task"),
        ({"task": "hi", "wait": "yes"}, "wait"),
        ({"task": "hi", "wait": 1}, "wait"),
        ({"task": "hi", "force_fresh": "false"}, "force_fresh"),
        ({"task": "hi", "idempotency_key": 7}, "idempotency_key"),
        ({"task": "hi", "idempotency_key": "k" * 256}, "idempotency_key"),
        ({"task": "hi", "wiat": True}, "wiat"),
    ],
)
def test_heartbeat_body_of_wrong_types_is_400_naming_the_field(api, persistent_agent, body, field):
    error = assert_error(api.post(agent_url(persistent_agent, "/heartbeat"), body), 400, "invalid")
    assert field in error["fields"]


def test_heartbeat_body_that_is_not_an_object_is_400(api, persistent_agent):
    assert_error(api.post(agent_url(persistent_agent, "/heartbeat"), ["task"]), 400)


def test_budget_refusal_is_429_with_retry_after_until_the_month_turns():
    now = datetime(2026, 11, 30, 23, 0, tzinfo=UTC)
    error = refusal_error(HeartbeatRefused("budget_exceeded", "Monthly budget spent."), now)
    assert error.status_code == 429
    assert error.retry_after == 3600 == seconds_until_next_utc_month(now)
    assert seconds_until_next_utc_month(datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC)) == 1


def test_runs_list_is_newest_first_with_a_cursor(api, persistent_agent):
    now = timezone.now()
    runs = [make_run(persistent_agent, created_at=now - timedelta(minutes=i)) for i in range(5)]
    first = api.get(agent_url(persistent_agent, "/runs"), {"limit": 3}).json()
    second = api.get(agent_url(persistent_agent, "/runs"), {"limit": 3, "next": first["next"]}).json()
    assert [r["id"] for r in first["runs"] + second["runs"]] == [str(r.id) for r in runs]
    assert second["next"] is None


def test_runs_list_filters_by_status(api, persistent_agent):
    make_run(persistent_agent, status=RunStatus.SUCCEEDED)
    failed = make_run(persistent_agent, status=RunStatus.FAILED, error="boom", error_code="x")
    body = api.get(agent_url(persistent_agent, "/runs"), {"status": "failed"}).json()
    assert [r["id"] for r in body["runs"]] == [str(failed.id)]
    assert body["runs"][0]["error"] == "boom"
    assert_error(api.get(agent_url(persistent_agent, "/runs"), {"status": "nope"}), 400)


def test_runs_list_queries_do_not_grow_with_runs(api, persistent_agent, django_assert_max_num_queries):
    for _ in range(40):
        make_run(persistent_agent)
    with django_assert_max_num_queries(2):
        response = api.get(agent_url(persistent_agent, "/runs"), {"limit": 200})
    assert len(response.json()["runs"]) == 40


def test_runs_list_and_detail_never_read_a_parked_batch_request(api, persistent_agent):
    from django.test.utils import CaptureQueriesContext

    # A run parked for a batch keeps its whole request (history included) until answered.
    parked = make_run(persistent_agent, status=RunStatus.SUBMITTED, delivery="batch", batch_state="parked")
    history = [{"role": "user", "content": "x" * 1000}] * 50
    HeartbeatRun.objects.filter(pk=parked.pk).update(batch_request={"messages": history}, batch_answer={"message": {}})
    for path in ("/runs", f"/runs/{parked.id}"):
        with CaptureQueriesContext(connection) as queries:
            response = api.get(agent_url(persistent_agent, path))
        assert response.status_code == 200
        assert str(parked.id) in response.content.decode()
        selects = [query["sql"].split(" FROM ")[0] for query in queries]
        assert not [sql for sql in selects if "batch_request" in sql or "batch_answer" in sql], path


def test_run_detail(api, persistent_agent):
    run = make_run(persistent_agent, output="hello", input_tokens=5, merged_ticks=3)
    body = api.get(agent_url(persistent_agent, f"/runs/{run.id}")).json()
    assert body["id"] == str(run.id)
    assert body["output"] == "hello"
    assert body["usage"]["input_tokens"] == 5
    assert body["merged_ticks"] == 3


def test_a_runs_money_is_a_decimal_string_by_one_rule_claude_codes_float_included(api, persistent_agent):
    from decimal import Decimal

    report = {"runtime": "cli", "num_turns": 2, "cli_total_cost_usd": "0.07438860000000001"}
    run = make_run(
        persistent_agent,
        cost_usd=Decimal("0.0743886000"),
        runtime_report={**report, "ledger_cost_usd": "0.0743886000"},
    )
    body = api.get(agent_url(persistent_agent, f"/runs/{run.id}")).json()
    assert body["cost_usd"] == "0.0743886"
    assert body["runtime_report"] == {
        **report,
        "cli_total_cost_usd": "0.0743886",
        "ledger_cost_usd": "0.0743886",
    }


def test_a_managed_runs_list_costs_are_money_by_the_one_rule(api, persistent_agent):
    # The service reports cents: 300 and 30 cents divided by 100 read "3" and "0.3".
    report = {"managed_session_id": "sesn_1", "model_requests": 1, "list_cost_usd": "3", "list_cost_turn_usd": "0.3"}
    run = make_run(persistent_agent, runtime_report={**report, "ledger_cost_usd": "0.3000000000"})
    body = api.get(agent_url(persistent_agent, f"/runs/{run.id}")).json()
    assert body["runtime_report"] == {
        **report,
        "list_cost_usd": "3.00",
        "list_cost_turn_usd": "0.30",
        "ledger_cost_usd": "0.30",
    }
    unreported = make_run(
        persistent_agent, runtime_report={**report, "list_cost_usd": None, "list_cost_turn_usd": None}
    )
    body = api.get(agent_url(persistent_agent, f"/runs/{unreported.id}")).json()
    assert (body["runtime_report"]["list_cost_usd"], body["runtime_report"]["list_cost_turn_usd"]) == (None, None)


def test_run_of_another_agent_is_404(api, persistent_agent, stateless_agent):
    run = make_run(stateless_agent)
    assert_error(api.get(agent_url(persistent_agent, f"/runs/{run.id}")), 404)
    assert_error(api.get(agent_url(persistent_agent, "/runs/not-a-uuid")), 404)


def test_heartbeat_of_an_agent_paused_by_its_budget_is_429_with_retry_after(api, persistent_agent):
    persistent_agent.status = AgentStatus.PAUSED
    persistent_agent.paused_reason = "budget"
    persistent_agent.save()
    response = api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "hi"})
    assert_error(response, 429, "budget_exceeded")
    assert 1 <= int(response["Retry-After"]) <= 31 * 24 * 3600


SEQUENTIAL_HEARTBEATS = 300


def stateless_agents(company, count: int) -> list[Agent]:
    return Agent.objects.bulk_create(
        Agent(
            company=company, name=f"Waker {n}", adapter_type="claude-code", adapter_config={"model": "claude-haiku-4-5"}
        )
        for n in range(count)
    )


@pytest.mark.parametrize("mode", ["local_trusted", "authenticated"])
def test_sequential_waiting_heartbeats_from_one_client_are_never_throttled(
    settings, mode, company, stateless_agent, fake_anthropic
):
    """`"wait": true` heartbeats one after another, on one agent and then over as many
    agents, five times the key's ceiling: each waited for its answer, so none is a 429
    (the ceiling is live: a queued heartbeat after them is one)."""
    settings.PAPERCLIP_DEPLOYMENT_MODE = mode
    settings.PAPERCLIP_HEARTBEAT_RATE = "4/min"
    client = Api(api_key_create(company=company)[1] if mode == "authenticated" else None)
    one_agent = [stateless_agent] * 10
    for agent in one_agent + stateless_agents(company, 10):
        response = client.post(agent_url(agent, "/heartbeat"), {"task": "hi", "wait": True})
        assert response.status_code == 200, response.json()
    assert HeartbeatRun.objects.filter(status=RunStatus.SUCCEEDED).count() == 20
    queued = [client.post(agent_url(stateless_agent, "/heartbeat"), {"task": "later"}) for _ in range(5)]
    expected = [202] * 5 if mode == "local_trusted" else [202] * 4 + [429]
    assert [response.status_code for response in queued] == expected


@pytest.mark.parametrize("mode", ["local_trusted", "authenticated"])
def test_waking_300_agents_without_waiting_from_one_client_is_not_throttled(settings, mode, company):
    settings.PAPERCLIP_DEPLOYMENT_MODE = mode
    client = Api(api_key_create(company=company)[1] if mode == "authenticated" else None)
    for agent in stateless_agents(company, SEQUENTIAL_HEARTBEATS):
        assert client.post(agent_url(agent, "/heartbeat"), {"task": "wake up"}).status_code == 202
    assert HeartbeatRun.objects.filter(status=RunStatus.QUEUED).count() == SEQUENTIAL_HEARTBEATS


def test_a_flood_of_queued_heartbeats_on_one_agent_stops_at_its_queue_bound(api, settings, persistent_agent):
    settings.PAPERCLIP_MAX_QUEUED_RUNS = 100
    for n in range(100):
        assert api.post(agent_url(persistent_agent, "/heartbeat"), {"task": f"job {n}"}).status_code == 202
    response = api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "one too many"})
    error = assert_error(response, 429, "queue_full")
    assert "100" in error["message"]
    assert int(response["Retry-After"]) >= 1
    assert HeartbeatRun.objects.filter(agent=persistent_agent, status=RunStatus.QUEUED).count() == 100
    # A waiting heartbeat joins the same queue, so it is refused alike; a used key still answers.
    assert_error(api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "x", "wait": True}), 429, "queue_full")


def test_heartbeats_of_one_key_have_a_ceiling_in_authenticated_mode(settings, key_api, persistent_agent):
    settings.PAPERCLIP_HEARTBEAT_RATE = "2/min"
    for n in range(2):
        assert key_api.post(agent_url(persistent_agent, "/heartbeat"), {"task": f"{n}"}).status_code == 202
    response = key_api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "third"})
    assert_error(response, 429, "rate_limited")
    assert 1 <= int(response["Retry-After"]) <= 60


@pytest.mark.django_db(transaction=True)
def test_waiting_heartbeats_under_a_cap_answer_while_other_agents_runs_wait_for_a_place(
    settings, company, fake_anthropic
):
    """Six agents under a cap of 2, half the heartbeats `"wait": true`: each waited run that
    finishes wakes the runs waiting for its place through the database broker, whose
    enqueue closes the connection on SQLite (CONN_MAX_AGE=0). Before, the wake iterated a
    query across that close and the finished run's request answered 500 (`Cannot operate
    on a closed database`)."""
    settings.PAPERCLIP_MAX_CONCURRENT_RUNS = 2
    settings.PAPERCLIP_RUN_TIMEOUT_SECONDS = 60
    agents = [
        Agent.objects.create(company=company, name=f"Agent {i}", adapter_config={"model": "claude-opus-4-5"})
        for i in range(6)
    ]
    fake_anthropic.push(*[Reply.delay(0.3) for _ in range(3)])
    answers: dict = {}

    def post(agent, wait: bool):
        try:
            response = Api().post(agent_url(agent, "/heartbeat"), {"task": "go", "wait": wait})
            answers[agent.pk] = (response.status_code, response.json().get("status"))
        except Exception as exc:  # the test client raises what a server answers 500 to
            answers[agent.pk] = (500, repr(exc))
        finally:
            connection.close()

    waiting = [threading.Thread(target=post, args=(agent, True)) for agent in agents[:3]]
    for thread in waiting:
        thread.start()
        time.sleep(0.02)  # created in order: the third waits for a place
    wait_until(lambda: HeartbeatRun.objects.count() == 3, 30, "the three waited runs")
    for agent in agents[3:]:
        post(agent, False)  # queued behind them, for a cluster (none runs here)
    for thread in waiting:
        thread.join(timeout=120)

    assert [answers[agent.pk] for agent in agents] == [(200, "succeeded")] * 3 + [(202, "queued")] * 3
    assert len(fake_anthropic.message_requests) == 3
