"""Fifty heartbeats at once, from several processes, through the HTTP API of a live server
(gunicorn with three gthread workers and a qcluster) on one persistent agent.

PostgreSQL only: the server processes and the test share the test database.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid

import pytest
from django_q.models import OrmQ

from costs_app.models import CostEvent
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus
from sessions_app.stores import store_for
from tests.fake_anthropic import FakeAnthropic
from tests.live.server import LiveServer, call, database_url, fire_batch, wait_until

HEARTBEATS = 50
CLIENT_PROCESSES = 5
FAKE_LATENCY_SECONDS = 0.075  # calls overlap with request handling and each other's polling
TERMINAL = {RunStatus.SUCCEEDED, RunStatus.FAILED}


def text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content if isinstance(block, dict))


@pytest.mark.django_db(transaction=True)
def test_fifty_concurrent_heartbeats_through_a_live_server_lose_nothing_and_run_once(postgres_only, settings, tmp_path):
    fake = FakeAnthropic(latency=FAKE_LATENCY_SECONDS).start()
    server = LiveServer(
        database_url=database_url(),
        secret_key=settings.SECRET_KEY,
        home=tmp_path / "server",
        anthropic_base_url=fake.base_url,
        web_workers=3,
        web_threads=4,
        clusters=1,
        q_workers=2,
    )
    try:
        server.start()
        api = f"{server.base_url}/api"
        status, company = call("POST", f"{api}/companies", {"name": "Live"})
        assert status == 201, company
        status, agent = call(
            "POST",
            f"{api}/companies/{company['id']}/agents",
            {
                "name": "Busy",
                "system_prompt": "You remember.",
                "adapter_type": "claude-code",
                # A budget these 50 short turns never reach: no summary, the history stays whole.
                "adapter_config": {
                    "model": "claude-opus-4-5",
                    "session_mode": "persistent",
                    "session_ttl_hours": 24,
                    "context_budget_tokens": 100_000,
                },
            },
        )
        assert status == 201, agent
        agent_api = f"{api}/companies/{company['id']}/agents/{agent['id']}"

        tag = uuid.uuid4().hex[:8]
        bodies = [
            {"task": f"task {i:02d} {tag}", "idempotency_key": f"key-{i:02d}-{tag}", "wait": i % 2 == 0}
            for i in range(HEARTBEATS)
        ]
        # Five keys are also sent a second time inside the storm, from another process,
        # so that the two requests race to create the run.
        racing = [dict(bodies[i], wait=not bodies[i]["wait"]) for i in (3, 10, 17, 24, 31)]
        groups = [bodies[i::CLIENT_PROCESSES] for i in range(CLIENT_PROCESSES)]
        groups = [group + racing[i : i + 1] for i, group in enumerate(groups)]
        start_at = time.time() + 4  # every client process is up and its threads wait
        started = time.monotonic()
        with multiprocessing.get_context("spawn").Pool(CLIENT_PROCESSES) as pool:
            answers = pool.starmap(fire_batch, [(f"{agent_api}/heartbeat", group, start_at) for group in groups])
        sent = [body for group in groups for body in group]
        replies = [reply for group in answers for reply in group]

        # Every request was answered: wait=true with the finished run, wait=false queued.
        run_of_key: dict[str, str] = {}
        for body, (status, run) in zip(sent, replies, strict=True):
            assert status in (200, 202), (body, status, run)
            if body["wait"] and status == 200:
                assert run["status"] == RunStatus.SUCCEEDED, run
            assert run_of_key.setdefault(body["idempotency_key"], run["id"]) == run["id"], "one key, two runs"
        assert len(run_of_key) == HEARTBEATS

        # The queued rest is worked off by the cluster (and the gunicorn waiters).
        wait_until(lambda: not HeartbeatRun.objects.exclude(status__in=TERMINAL).exists(), 180, "every run to finish")
        elapsed = time.monotonic() - started
        status, page = call("GET", f"{agent_api}/runs?limit=200")
        assert status == 200
        assert len(page["runs"]) == HEARTBEATS
        assert {run["status"] for run in page["runs"]} == {RunStatus.SUCCEEDED}, [
            (run["status"], run["error_code"]) for run in page["runs"] if run["status"] != RunStatus.SUCCEEDED
        ]
        assert {run["id"] for run in page["runs"]} == set(run_of_key.values())

        # Exactly 100 messages in the one session, alternating, each task once, in pairs.
        assert AgentSession.objects.filter(agent_id=agent["id"]).count() == 1
        session = AgentSession.objects.get(agent_id=agent["id"])
        history = store_for(session).read(session)
        assert session.message_count == len(history) == 2 * HEARTBEATS
        assert [m["role"] for m in history] == ["user", "assistant"] * HEARTBEATS
        user_texts = [text_of(m["content"]) for m in history if m["role"] == "user"]
        assert sorted(user_texts) == sorted(body["task"] for body in bodies)
        assert [m["seq"] for m in history] == list(range(2 * HEARTBEATS))
        for user, answer in zip(history[::2], history[1::2], strict=True):
            assert user["run_id"] == answer["run_id"]
            assert text_of(user["content"]) in text_of(answer["content"])  # the fake echoes the task
        status, listed = call("GET", f"{agent_api}/sessions")
        assert [s["message_count"] for s in listed["sessions"]] == [2 * HEARTBEATS]

        # One model call per run, each seeing every earlier turn; one ledger row per call.
        calls = fake.message_requests
        assert len(calls) == HEARTBEATS
        assert sorted(len(body["messages"]) for body in calls) == list(range(1, 2 * HEARTBEATS, 2))
        assert CostEvent.objects.filter(agent_id=agent["id"]).count() == HEARTBEATS
        assert set(CostEvent.objects.values_list("run_id", flat=True)) == {uuid.UUID(r) for r in run_of_key.values()}
        # Several processes did the work (gunicorn workers for `wait`, cluster workers for the rest).
        assert len(set(HeartbeatRun.objects.values_list("claimed_by", flat=True))) >= 2

        # Resending used keys, after the fact, returns the finished run and calls nothing.
        for body in bodies[:6]:
            status, run = call("POST", f"{agent_api}/heartbeat", body)
            assert status == 200, run
            assert (run["id"], run["status"]) == (run_of_key[body["idempotency_key"]], RunStatus.SUCCEEDED)
        # A stray dispatch would be in the task queue before its answer was sent (the
        # request's COMMIT hands it over): once the queue is empty, the cluster has run it.
        wait_until(lambda: not OrmQ.objects.exists(), 60, "the task queue to drain")
        assert HeartbeatRun.objects.count() == HEARTBEATS
        assert len(fake.message_requests) == HEARTBEATS
        assert CostEvent.objects.count() == HEARTBEATS
        assert not HeartbeatRun.objects.filter(status__in=[RunStatus.QUEUED, RunStatus.RUNNING]).exists()
        print(f"\n{HEARTBEATS} heartbeats (+5 racing duplicates) through the live server in {elapsed:.1f}s")
    finally:
        server.stop()
        fake.stop()
