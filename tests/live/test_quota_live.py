"""A provider refusing every call, met by fifty scheduled agents on one key through a live
deployment: gunicorn and two task clusters on PostgreSQL, a cap on runs in progress.

The test plays the scheduler (each agent's tick is the task django-q2's scheduler would
queue) and the maintenance pass (which dispatches waiting queues, as the hold's wake
does at its reset); the clusters do the rest. Holds are two seconds (`retry-after: 2`,
with a retry window of 0), so the storm is over in seconds.
"""

from __future__ import annotations

import time

import pytest
from django_q.tasks import async_task

from sessions_app.models import Company, CredentialHold, HeartbeatRun, RunStatus
from sessions_app.run_queue import dispatch_waiting
from tests.fake_anthropic import FakeAnthropic, Reply, plain_system
from tests.live.server import LiveServer, database_url, wait_until
from tests.test_quota import agents

AGENTS = 50
HOLD_SECONDS = 2


def refused(fake) -> list[dict]:
    with fake.lock:
        return [r for r in fake.requests if r["path"] == "/v1/messages" and r.get("status") == 429]


def probes_and_in_flight(times: list[float]) -> tuple[list[float], list[float]]:
    """Split sorted refusal times into probes and calls claimed before the first hold: a
    refusal is a probe when it came a whole hold after the first refusal and after the last
    probe. Taking the earliest such call each time finds the most probes, so the calls left
    in flight are as few as the times allow."""
    probes, in_flight = [], [times[0]]
    for at in times[1:]:
        last = probes[-1] if probes else times[0]
        (probes if at - last >= HOLD_SECONDS - 0.1 else in_flight).append(at)
    return probes, in_flight


def probes_seen(fake) -> list[float]:
    return probes_and_in_flight(sorted(r["at"] for r in refused(fake)))[0]


def answered(fake) -> list[dict]:
    with fake.lock:
        return [r for r in fake.requests if r["path"] == "/v1/messages" and r.get("status") == 200]


@pytest.mark.django_db(transaction=True)
def test_fifty_agents_on_a_refusing_key_through_two_clusters_wait_then_each_run_once(postgres_only, settings, tmp_path):
    # This process plays the deployment's maintenance pass: under the deployment's cap. (Without
    # it each pass woke all fifty queues, and the probe waited behind the workers' backlog.)
    settings.PAPERCLIP_MAX_CONCURRENT_RUNS = 3
    fake = FakeAnthropic().start()
    fake.outage = Reply.error(429, "rate limited", headers={"retry-after": str(HOLD_SECONDS)})
    server = LiveServer(
        database_url=database_url(),
        secret_key=settings.SECRET_KEY,
        home=tmp_path / "server",
        anthropic_base_url=fake.base_url,
        clusters=2,
        q_workers=2,
        extra_env={
            "PAPERCLIP_QUOTA_RETRY_WINDOW_SECONDS": "0",
            "PAPERCLIP_MAX_CONCURRENT_RUNS": str(settings.PAPERCLIP_MAX_CONCURRENT_RUNS),
        },
    )
    company = Company.objects.create(name="Storm")
    fleet = agents(company, AGENTS, heartbeat_interval_minutes=1)
    try:
        server.start()
        # Every agent's tick, twice, over five seconds: the second finds its run queued.
        for _ in range(2):
            for agent in fleet:
                async_task("sessions_app.tasks.scheduled_heartbeat", str(agent.id))
            time.sleep(2.5)
        # Holds run out and are probed for a while; the maintenance pass dispatches. The
        # storm is timed from the first refusal (a loaded machine may start the clusters late),
        # and lasts until two holds were probed: a starved worker may send a probe late, and
        # the spacing of probes is what is checked, not how soon they came.
        wait_until(lambda: refused(fake), 60, "the first refusal", poll=0.1)
        first = refused(fake)[0]["at"]
        storm_end, give_up = first + 4 * HOLD_SECONDS + 1, first + 60
        while time.monotonic() < storm_end or (len(probes_seen(fake)) < 2 and time.monotonic() < give_up):
            dispatch_waiting()
            time.sleep(0.3)
        assert not HeartbeatRun.objects.filter(status=RunStatus.FAILED).exists()
        times = sorted(r["at"] for r in refused(fake))
        # Before the first hold was written at most one run per place under the cap was
        # claimed; a loaded worker may send its call any time later, even after the reset.
        # The others are probes, one per reset: each at least a hold after the last.
        probes, in_flight = probes_and_in_flight(times)
        assert 1 <= len(in_flight) <= settings.PAPERCLIP_MAX_CONCURRENT_RUNS, times
        assert len(probes) >= 2, times
        assert len(probes) <= (times[-1] - times[0]) / HOLD_SECONDS + 1, times
        assert answered(fake) == []
        assert HeartbeatRun.objects.count() == AGENTS  # the second ticks merged

        # The provider recovers: the next probe succeeds and the queue drains under the cap.
        fake.outage = None

        def drained() -> bool:
            dispatch_waiting()
            return not HeartbeatRun.objects.exclude(status__in=[RunStatus.SUCCEEDED, RunStatus.FAILED]).exists()

        wait_until(drained, 60, "every run to finish", poll=0.3)
        runs = list(HeartbeatRun.objects.all())
        assert {run.status for run in runs} == {RunStatus.SUCCEEDED}, [(r.status, r.error_code) for r in runs]
        assert sorted(run.agent_id for run in runs) == sorted(agent.id for agent in fleet)
        answers = [plain_system(r["body"]) for r in answered(fake)]
        assert sorted(answers) == sorted(agent.system_prompt for agent in fleet)  # each once
        assert CredentialHold.objects.get().held_until is None
    finally:
        server.stop()
        fake.stop()
