"""Idle agents: model calls and dollars in one simulated day, with and without work checks.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/paperclip_idle_bench .venv/bin/python bench/idle.py

100 persistent agents wake every 30 minutes (`BENCH_INTERVAL_MINUTES`) for one simulated
day; 10 of them have work at every wake, 90 never do (and answer "NOTHING_TO_DO" when
asked: the fake says so for their system prompt). Three times, on emptied tables:

1. without work checks: every wake is a model call, as today, and each idle answer is
   replayed in the agent's later turns;
2. with a work check on every agent: an HTTP GET to a server on 127.0.0.1 that answers
   200 with a line of work for the 10 and 204 for the 90; the default back-off
   (PAPERCLIP_BACKOFF_AFTER_RUNS=3, PAPERCLIP_BACKOFF_MAX_FACTOR=8) stretches the idle
   agents' schedules;
3. no work check, but `nothing_to_do_marker: "NOTHING_TO_DO"`: the idle answers are billed
   but not replayed, and they back the schedules off the same way.

The day is simulated, not waited: the script plays django-q2's scheduler over the agents'
real schedule rows (the earliest `next_run` fires and moves on by the row's `minutes`, as
with catch_up off), and each wake runs the engine's heartbeat with that time as `now`.
Model calls are counted by the fake Messages API (tests/fake_anthropic.py, its own
process, answering at once); dollars are the ledger's sum (claude-haiku-4-5 list price).
The database named in DATABASE_URL is created when missing and migrated; its tables are
emptied first. Goal (issue 16): calls only for the 10 agents with work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
os.environ.setdefault("PAPERCLIP_HOME", str(ROOT / ".paperclip" / "bench-idle"))

AGENTS = int(os.environ.get("BENCH_AGENTS", "100"))
WITH_WORK = int(os.environ.get("BENCH_WITH_WORK", "10"))
INTERVAL_MINUTES = int(os.environ.get("BENCH_INTERVAL_MINUTES", "30"))
DAY = timedelta(days=1)
START = datetime(2026, 12, 1, tzinfo=UTC)


def ensure_database() -> None:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith("postgres"):
        sys.exit("Set DATABASE_URL to a PostgreSQL database (it is created when missing).")
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


class WorkServer:
    """GET /agent/<n>: 200 with a line of work for the first WITH_WORK agents, 204 for the rest."""

    def __init__(self) -> None:
        self.hits = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format, *args):
                pass

            def do_GET(self):
                server.hits += 1
                index = int(self.path.rsplit("/", 1)[1])
                body = f"ticket {index}-{server.hits}: needs an answer\n".encode() if index < WITH_WORK else b""
                self.send_response(200 if body else 204)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def fake_calls(base_url: str) -> int:
    with urllib.request.urlopen(f"{base_url}/_fake/message_requests?after=0") as response:
        return len(json.load(response)["bodies"])


IDLE_PROMPT = "You are a triage agent. Answer NOTHING_TO_DO when your queue is empty. (idle)"
WORKING_PROMPT = "You are a triage agent. Answer NOTHING_TO_DO when your queue is empty."


def simulate(*, work_checks: bool, marker: bool, work_server: WorkServer, fake_url: str) -> dict:
    from django.db.models import Count, Sum
    from django_q.models import Schedule

    from costs_app.models import CostEvent
    from sessions_app.heartbeat import heartbeat_execute
    from sessions_app.models import Agent, AgentSession, Company, HeartbeatRun, RunTrigger
    from sessions_app.run_queue import heartbeat_enqueue
    from sessions_app.schedules import agent_schedule_sync, schedule_name

    for model in (CostEvent, HeartbeatRun, AgentSession, Agent, Company):
        model.objects.all().delete()
    Schedule.objects.filter(name__startswith="heartbeat:").delete()
    company = Company.objects.create(name="idle bench")
    agents = []
    for index in range(AGENTS):
        config = {
            "model": "claude-haiku-4-5",
            "session_mode": "persistent",
            "session_ttl_hours": 48,
            "heartbeat_interval_minutes": INTERVAL_MINUTES,
        }
        if work_checks:
            config["work_check"] = {"url": f"{work_server.base}/agent/{index}", "timeout_seconds": 10}
        if marker:
            config["nothing_to_do_marker"] = "NOTHING_TO_DO"
        agent = Agent.objects.create(
            company=company,
            name=f"agent {index:03d}",
            system_prompt=WORKING_PROMPT if index < WITH_WORK else IDLE_PROMPT,
            adapter_config=config,
        )
        agent_schedule_sync(agent=agent, now=START)
        agents.append(agent)
    Schedule.objects.filter(name__startswith="heartbeat:").update(next_run=START)
    by_name = {schedule_name(agent.pk): agent for agent in agents}
    calls_before, hits_before = fake_calls(fake_url), work_server.hits
    wakes = 0
    started = time.perf_counter()
    while True:
        # django-q2's scheduler, played: the earliest due row fires and moves on one step.
        row = Schedule.objects.filter(name__startswith="heartbeat:").order_by("next_run", "name").first()
        now = row.next_run
        if now >= START + DAY:
            break
        Schedule.objects.filter(pk=row.pk).update(next_run=now + timedelta(minutes=row.minutes))
        agent = Agent.objects.get(pk=by_name[row.name].pk)
        run, _ = heartbeat_enqueue(
            agent=agent, task="Heartbeat: check your queue.", now=now, trigger=RunTrigger.SCHEDULE
        )
        heartbeat_execute(run_id=run.id, now=now)
        wakes += 1
    wall = time.perf_counter() - started
    statuses = dict(HeartbeatRun.objects.values_list("status").annotate(n=Count("id")).order_by())
    idle_agents = Agent.objects.filter(name__gte=f"agent {WITH_WORK:03d}")
    working = {agent.pk for agent in agents[:WITH_WORK]}
    called_agents = set(HeartbeatRun.objects.filter(status="succeeded").values_list("agent_id", flat=True).distinct())
    idle_messages = AgentSession.objects.filter(agent__in=idle_agents).aggregate(n=Sum("message_count"))["n"] or 0
    return {
        "wakes": wakes,
        "runs": statuses,
        "calls": fake_calls(fake_url) - calls_before,
        "checks": work_server.hits - hits_before,
        "dollars": CostEvent.objects.aggregate(total=Sum("cost_usd"))["total"] or 0,
        "called_idle_agents": len(called_agents - working),
        "called_working_agents": len(called_agents & working),
        "max_idle_streak": max(idle_agents.values_list("idle_streak", flat=True), default=0),
        "idle_messages": idle_messages,
        "wall": wall,
    }


def main() -> None:
    ensure_database()
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    fake = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_anthropic"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "FAKE_LATENCY_MS": "0", "FAKE_SYSTEM_ANSWERS": json.dumps({"(idle)": "NOTHING_TO_DO"})},
    )
    fake_url = fake.stdout.readline().strip()
    os.environ["ANTHROPIC_BASE_URL"] = fake_url
    os.environ["ANTHROPIC_API_KEY"] = "sk-ant-bench"
    work_server = WorkServer()
    try:
        print(
            f"{AGENTS} persistent agents ({WITH_WORK} with work at every wake), every {INTERVAL_MINUTES} min, "
            f"one simulated day; claude-haiku-4-5; fake API answering at once"
        )
        results = {}
        scenarios = (
            ("without work checks", False, False),
            ("with work checks", True, False),
            ("with the marker only", False, True),
        )
        for label, checks, marker in scenarios:
            result = simulate(work_checks=checks, marker=marker, work_server=work_server, fake_url=fake_url)
            results[label] = result
            print(
                f"{label:20}: wakes {result['wakes']:5d}, runs {result['runs']}, model calls {result['calls']:5d}, "
                f"${result['dollars']:.4f}; agents called: {result['called_working_agents']} with work, "
                f"{result['called_idle_agents']} idle; checks {result['checks']}; "
                f"longest idle streak {result['max_idle_streak']}; idle agents' session messages "
                f"{result['idle_messages']}; {result['wall']:.1f}s"
            )
        before, after, marked = (results[label] for label, _, _ in scenarios)
        working_calls = WITH_WORK * (DAY // timedelta(minutes=INTERVAL_MINUTES))
        print(
            f"calls {after['calls']} vs {before['calls']} ({after['calls'] / before['calls']:.3f}x), "
            f"dollars {after['dollars'] / before['dollars']:.3f}x; goal: calls only for the {WITH_WORK} with work "
            f"({working_calls} wakes): {'met' if after['calls'] == working_calls and not after['called_idle_agents'] else 'NOT met'}"
        )
        print(
            f"marker only: calls {marked['calls']} vs {before['calls']} ({marked['calls'] / before['calls']:.3f}x), "
            f"dollars {marked['dollars'] / before['dollars']:.3f}x"
        )
    finally:
        fake.terminate()
        fake.wait()
        work_server.httpd.shutdown()


if __name__ == "__main__":
    main()
