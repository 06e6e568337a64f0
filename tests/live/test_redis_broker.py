"""The production configuration, live: gunicorn and two task clusters queueing through Redis
(`REDIS_URL`) on PostgreSQL. One is the deployment's cluster, the other a host's own cluster
under another name, as docs/deployment.md pins an agent to it.

Every other live test queues through the database. Each test here names its clusters
uniquely (the Redis keys are named by the cluster) and deletes only those keys: CI's two
suites, their xdist workers and the benchmarks share the one Redis.
"""

from __future__ import annotations

import os
import uuid

import pytest
import redis
from django_q.models import OrmQ

from costs_app.models import CostEvent
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus, RunTrigger
from sessions_app.stores import store_for
from tests.fake_anthropic import FakeAnthropic, plain_system
from tests.live.server import LiveServer, call, database_url, wait_until

QUEUED_HEARTBEATS = 6
TERMINAL = {RunStatus.SUCCEEDED, RunStatus.FAILED}
# django-q2's sentinel runs the scheduler every 30 s of its guard loop, first 30 s after it
# starts: a schedule due at once is taken by then, give or take a loaded machine.
SCHEDULER_SECONDS = 30


def text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content if isinstance(block, dict))


def redis_keys(client: redis.Redis, *clusters: str) -> list[bytes]:
    return sorted(key for name in clusters for key in client.scan_iter(match=f"django_q:{name}:*"))


def group_of(claimed_by: str) -> int:
    """The process group of the process that claimed a run (`host:pid`, run_queue.worker_id):
    each server process leads its own group, so this names the cluster or the web."""
    return os.getpgid(int(claimed_by.rsplit(":", 1)[1]))


def finished(agent_id) -> bool:
    return not HeartbeatRun.objects.filter(agent_id=agent_id).exclude(status__in=TERMINAL).exists()


@pytest.mark.django_db(transaction=True)
def test_heartbeats_pinned_runs_health_and_a_schedule_through_redis(postgres_only, redis_only, settings, tmp_path):
    tag = uuid.uuid4().hex[:12]
    deployment, host = f"live-redis-{tag}", f"live-redis-{tag}-b"
    client = redis.Redis.from_url(redis_only)
    fake = FakeAnthropic(latency=0.05).start()
    server = LiveServer(
        database_url=database_url(),
        secret_key=settings.SECRET_KEY,
        home=tmp_path / "server",
        anthropic_base_url=fake.base_url,
        web_workers=2,
        clusters=2,
        q_workers=2,
        redis_url=redis_only,
        # The web and the first cluster are the deployment; the second is the pinned host's,
        # started as docs/deployment.md says (its own name, the deployment's beside it).
        extra_env={"PAPERCLIP_CLUSTER_NAME": deployment, "PAPERCLIP_DEPLOYMENT_CLUSTER_NAME": deployment},
        cluster_names=[deployment, host],
    )
    try:
        server.start()
        api = f"{server.base_url}/api"
        status, company = call("POST", f"{api}/companies", {"name": "Redis"})
        assert status == 201, company
        agents_api = f"{api}/companies/{company['id']}/agents"

        def agent(name: str, **config) -> dict:
            body = {
                "name": name,
                "system_prompt": f"You are {name}.",
                "adapter_type": "claude-code",
                "adapter_config": {"model": "claude-opus-4-5", **config},
            }
            status, created = call("POST", agents_api, body)
            assert status == 201, created
            return created

        # First, so that its wake is due when the scheduler first runs: an interval schedule
        # counts from when it is made.
        ticking = agent("Ticking", heartbeat_interval_minutes=1, heartbeat_task="tick")
        busy = agent("Busy", session_mode="persistent", session_ttl_hours=24, context_budget_tokens=100_000)
        pinned = agent("Pinned", cluster=host)

        # The health probe sees both clusters of the deployment through Redis (each saves its
        # statistics there every half second; the server was healthy with the first alone).
        def health_now() -> dict:
            status, health = call("GET", f"{api}/health")
            assert status == 200, health
            return health

        health = wait_until(lambda: (h := health_now())["queue"]["clusters"] == 2 and h, 15, "both clusters seen")
        assert health["status"] == "ok"
        assert health["queue"] == {"broker": "redis", "ok": True, "clusters": 2, "cluster_name": deployment}

        # Queued heartbeats reach the cluster only through Redis (its broker); the waited one
        # is the web's own, once the agent's current run ends.
        busy_api = f"{agents_api}/{busy['id']}"
        tasks = [f"task {i} {tag}" for i in range(QUEUED_HEARTBEATS)]
        queued = []
        for task in tasks:
            status, run = call("POST", f"{busy_api}/heartbeat", {"task": task})
            assert status == 202 and run["status"] == RunStatus.QUEUED, (status, run)
            queued.append(run["id"])
        status, waited = call("POST", f"{busy_api}/heartbeat", {"task": f"waited {tag}", "wait": True})
        assert status == 200 and waited["status"] == RunStatus.SUCCEEDED, (status, waited)

        # The pinned agent's heartbeats go to its host's cluster, waited for or not.
        pinned_api = f"{agents_api}/{pinned['id']}"
        status, pinned_queued = call("POST", f"{pinned_api}/heartbeat", {"task": f"pinned {tag}"})
        assert status == 202, pinned_queued
        status, pinned_waited = call("POST", f"{pinned_api}/heartbeat", {"task": f"pinned wait {tag}", "wait": True})
        assert status == 200 and pinned_waited["status"] == RunStatus.SUCCEEDED, (status, pinned_waited)

        wait_until(lambda: finished(busy["id"]) and finished(pinned["id"]), 60, "the queued runs to finish")
        runs = list(HeartbeatRun.objects.filter(agent_id=busy["id"]).order_by("created_at"))
        assert [str(run.id) for run in runs] == [*queued, waited["id"]]
        assert {run.status for run in runs} == {RunStatus.SUCCEEDED}, [(r.status, r.error_code) for r in runs]

        # One ledger row per call, one call per run.
        calls = [body for body in fake.message_requests if plain_system(body).startswith("You are Busy.")]
        assert len(calls) == len(runs)
        assert sorted(CostEvent.objects.filter(agent_id=busy["id"]).values_list("run_id", flat=True)) == sorted(
            run.id for run in runs
        )
        # The persistent history holds each run's turn once, in the order the runs ran: the
        # queued ones in the order they were sent (the waiting request runs its own run as
        # soon as the agent's current one ends, so it may come before older queued ones).
        session = AgentSession.objects.get(agent_id=busy["id"])
        history = store_for(session).read(session)
        assert [m["role"] for m in history] == ["user", "assistant"] * len(runs)
        assert [m["run_id"] for m in history[::2]] == [str(run.id) for run in sorted(runs, key=lambda r: r.started_at)]
        asked = [text_of(m["content"]) for m in history[::2]]
        assert [text for text in asked if text in tasks] == tasks
        assert sorted(asked) == sorted([*tasks, f"waited {tag}"])

        deployment_cluster = server.procs["cluster0"].pid
        host_cluster = server.procs["cluster1"].pid
        assert {group_of(run.claimed_by) for run in runs if str(run.id) in queued} == {deployment_cluster}

        pinned_runs = list(HeartbeatRun.objects.filter(agent_id=pinned["id"]))
        assert len(pinned_runs) == 2
        assert {run.status for run in pinned_runs} == {RunStatus.SUCCEEDED}, [
            (r.status, r.error_code) for r in pinned_runs
        ]
        assert {group_of(run.claimed_by) for run in pinned_runs} == {host_cluster}
        assert CostEvent.objects.filter(agent_id=pinned["id"]).count() == 2

        # The deployment's cluster's scheduler ticks the scheduled agent (not the pinned
        # host's: the agent is not pinned), and the tick runs there, from Redis.
        def ticked():
            return HeartbeatRun.objects.filter(
                agent_id=ticking["id"], trigger=RunTrigger.SCHEDULE, status__in=TERMINAL
            ).first()

        tick = wait_until(ticked, SCHEDULER_SECONDS + 30, "the scheduled tick", poll=0.5)
        assert tick.status == RunStatus.SUCCEEDED, (tick.status, tick.error_code)
        assert group_of(tick.claimed_by) == deployment_cluster
        assert CostEvent.objects.filter(run_id=tick.id).count() == 1

        # Nothing is left queued in Redis, and nothing went through the database's queue.
        assert client.llen(f"django_q:{deployment}:q") == 0 and client.llen(f"django_q:{host}:q") == 0
        assert not OrmQ.objects.exists()
        assert health_now()["runs"] == {"oldest_queued_seconds": None, "past_deadline": 0}
    finally:
        server.stop()
        fake.stop()
        for key in redis_keys(client, deployment, host):
            client.delete(key)
    assert redis_keys(client, deployment, host) == []
