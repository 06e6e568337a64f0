"""Heartbeat time with a 1-second model: summaries between heartbeats vs in band.

A persistent agent at defaults (no context settings; the workload of `context_growth.py
defaults`: an 8,000-character system prompt, ~800-character tasks, ~1,200-character answers)
is woken 100 times, each `"wait": true` as an API caller would (`heartbeat_start`), one wake
every GAP seconds after the last answer. The fake Messages API answers every call, summaries
included, after LATENCY seconds.

Two runs in the same process, one after the other:
- baseline: no task cluster, so every summary is made in band, inside the heartbeat that
  needs it (what happened before compaction moved after the commit);
- cluster: a worker thread runs the queued tasks as a django-q2 worker would, so the
  summary a commit queues is made while the agent waits for its next wake.

Prints p50, p99 and max of the heartbeat time for each run, their p99/p50 (goal for the
cluster run: <= 1.2) and the summaries made in band and between heartbeats.

    .venv/bin/python bench/latency.py                       # SQLite in a temporary folder
    DATABASE_URL=postgres://... .venv/bin/python bench/latency.py
    BENCH_HEARTBEATS=100 BENCH_LATENCY_S=1 BENCH_GAP_S=1.5 .venv/bin/python bench/latency.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
os.environ.setdefault("PAPERCLIP_HOME", tempfile.mkdtemp(prefix="paperclip-bench-"))

HEARTBEATS = int(os.environ.get("BENCH_HEARTBEATS", "100"))
LATENCY = float(os.environ.get("BENCH_LATENCY_S", "1"))
GAP = float(os.environ.get("BENCH_GAP_S", "1.5"))


class ClusterWorker(threading.Thread):
    """Runs the queued tasks as a cluster worker does (on its own connection)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stopping = threading.Event()

    def run(self) -> None:
        from django.db import connection
        from django.utils.module_loading import import_string
        from django_q.brokers import get_broker
        from django_q.signing import SignedPackage

        broker = get_broker()
        while not self.stopping.is_set():
            tasks = broker.dequeue()
            for ack_id, payload in tasks or ():
                task = SignedPackage.loads(payload)
                import_string(task["func"])(*task["args"], **task["kwargs"])
                broker.acknowledge(ack_id)
            if not tasks:
                time.sleep(0.05)
        connection.close()


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def one_run(company, label: str, *, cluster: bool) -> dict:
    from django.utils import timezone
    from django_q.models import OrmQ

    from bench.context_growth import DEFAULTS_MODEL, DEFAULTS_PROMPT, defaults_task
    from sessions_app.heartbeat import heartbeat_start
    from sessions_app.models import Agent, HeartbeatRun, RunTrigger

    OrmQ.objects.all().delete()
    agent = Agent.objects.create(
        company=company,
        name=label,
        system_prompt=DEFAULTS_PROMPT,
        adapter_config={"model": DEFAULTS_MODEL, "session_mode": "persistent"},
    )
    worker = ClusterWorker() if cluster else None
    if worker:
        worker.start()
    times = []
    try:
        for i in range(1, HEARTBEATS + 1):
            started = time.monotonic()
            run, _ = heartbeat_start(
                agent=agent, task=defaults_task(i), trigger=RunTrigger.API, now=timezone.now(), wait=True
            )
            times.append(time.monotonic() - started)
            assert run.status == "succeeded", (label, i, run.status, run.error_code, run.error)
            time.sleep(GAP)
    finally:
        if worker:
            worker.stopping.set()
            worker.join()
    compaction_runs = HeartbeatRun.objects.filter(agent=agent, trigger=RunTrigger.COMPACTION)
    in_band = sum(1 for c in agent.sessions.first().compactions.all() if c.run.trigger != RunTrigger.COMPACTION)
    return {
        "p50": statistics.median(times),
        "p99": percentile(times, 0.99),
        "max": max(times),
        "in_band": in_band,
        "between": compaction_runs.filter(status="succeeded").count(),
    }


def warm_up(company) -> None:
    """One heartbeat first, so that neither run pays the process's first call (the model
    catalogue, the SDK's client)."""
    from django.utils import timezone

    from bench.context_growth import DEFAULTS_MODEL
    from sessions_app.heartbeat import heartbeat_start
    from sessions_app.models import Agent, RunTrigger

    agent = Agent.objects.create(company=company, name="warm-up", adapter_config={"model": DEFAULTS_MODEL})
    heartbeat_start(agent=agent, task="warm up", trigger=RunTrigger.API, now=timezone.now(), wait=True)


def main() -> None:
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from django.utils import timezone

    from bench.context_growth import defaults_answer, keeping_summariser
    from sessions_app.context import SUMMARY_SYSTEM
    from sessions_app.models import Company
    from tests.fake_anthropic import FakeAnthropic, plain_system

    fake = FakeAnthropic(latency=LATENCY).start()
    fake.count_output = True
    fake.writer = lambda body: (
        keeping_summariser(body) if plain_system(body) == SUMMARY_SYSTEM else defaults_answer(body)
    )
    os.environ["ANTHROPIC_BASE_URL"] = fake.base_url
    os.environ["ANTHROPIC_API_KEY"] = "sk-ant-bench"
    company = Company.objects.create(name=f"bench latency {timezone.now():%H%M%S}")
    warm_up(company)
    try:
        results = {
            "baseline (in band)": one_run(company, "in band", cluster=False),
            "cluster (between heartbeats)": one_run(company, "between", cluster=True),
        }
    finally:
        fake.stop()
    print(f"{HEARTBEATS} persistent heartbeats at defaults, model latency {LATENCY:g} s, {GAP:g} s between them")
    for label, r in results.items():
        print(
            f"{label:30s} p50 {r['p50']:.3f} s, p99 {r['p99']:.3f} s, max {r['max']:.3f} s, "
            f"p99/p50 {r['p99'] / r['p50']:.2f}; summaries in band {r['in_band']}, between heartbeats {r['between']}"
        )
    cluster = results["cluster (between heartbeats)"]
    print(f"cluster p99/p50: {cluster['p99'] / cluster['p50']:.2f} (goal <= 1.20)")


if __name__ == "__main__":
    main()
