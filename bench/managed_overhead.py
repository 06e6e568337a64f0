"""Managed Agents heartbeats through the engine vs the same events sent with the bare SDK.

Both sides talk HTTP to the Managed Agents fake (tests/fake_managed.py) in its own process,
in the same run, round by round. A heartbeat of the engine is `heartbeat_enqueue` and
`heartbeat_execute` of a `claude-managed` agent (the ledger row of each model request,
the mirrored history, the run's completion). The bare SDK sends what a careful client
needs for the same turn: it opens the session's event stream, sends the task as a
`user.message` and reads until the session is idle; a stateless turn also creates its
session and archives it afterwards (the engine's archive is a task after the run, so it is
neither timed nor counted on the engine's side).

    FAKE_LATENCY_MS=200 DATABASE_URL=postgres://postgres@127.0.0.1:5432/paperclip_bench \\
        .venv/bin/python bench/managed_overhead.py

Without DATABASE_URL the embedded SQLite database under PAPERCLIP_HOME is used. The goal
(issue 25): at 200 ms per model request, engine/bare >= 0.95. A second line per agent
compares the engine with a bare client that also makes the provider requests the engine's
guarantees need, so the ratio is the engine's own work alone. Each line also prints the
provider requests per heartbeat on each side, counted by the fake, and the database round
trips of one engine heartbeat (PostgreSQL only, counted by libpq's trace).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
os.environ.setdefault("PAPERCLIP_HOME", str(ROOT / ".paperclip" / "bench"))

from bench.heartbeat_overhead import ensure_database, round_trips  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
PER_ROUND = int(os.environ.get("BENCH_PER_ROUND", "10"))


def main() -> None:
    postgres = os.environ.get("DATABASE_URL", "").startswith("postgres")
    if postgres:
        ensure_database()
    else:
        Path(os.environ["PAPERCLIP_HOME"]).mkdir(parents=True, exist_ok=True)
    import django

    django.setup()
    import logging

    from django.core.management import call_command

    logging.getLogger("django-q").setLevel(logging.WARNING)  # an enqueue per stateless run's archive
    call_command("migrate", verbosity=0)
    latency = os.environ.get("FAKE_LATENCY_MS", "200")
    fake = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_managed"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "FAKE_LATENCY_MS": latency},
    )
    base_url = fake.stdout.readline().strip()
    os.environ["ANTHROPIC_BASE_URL"] = base_url
    os.environ["ANTHROPIC_API_KEY"] = "sk-ant-bench"
    try:
        results, trips = measure_all(base_url, postgres=postgres)
    finally:
        fake.terminate()
        fake.wait()
    database = "postgresql" if postgres else "sqlite"
    print(f"database={database} fake latency={latency} ms per model request rounds={ROUNDS} per_round={PER_ROUND}")
    for label, figures in results.items():
        print(
            f"{label}: engine {figures.engine:.2f}/s, bare SDK {figures.bare:.2f}/s, "
            f"ratio {figures.engine / figures.bare:.3f} (goal >= 0.95), "
            f"overhead {figures.overhead_ms:.1f} ms/heartbeat; provider requests per heartbeat: "
            f"engine {figures.engine_requests:g}, bare {figures.bare_requests:g}"
            + (f"; database round trips {trips[label]}" if label in trips else "")
        )


def measure_all(base_url: str, *, postgres: bool) -> tuple[dict, dict]:
    import anthropic
    from django.utils import timezone

    from costs_app.models import CostEvent
    from sessions_app.heartbeat import heartbeat_execute
    from sessions_app.models import Agent, AgentSession, Company, HeartbeatRun
    from sessions_app.run_queue import heartbeat_enqueue

    CostEvent.objects.all().delete()
    HeartbeatRun.objects.all().delete()
    AgentSession.objects.all().delete()
    Agent.objects.all().delete()
    company = Company.objects.create(name="bench")
    config = {"model": "claude-haiku-4-5", "tools": ["read"]}
    agents = {
        "stateless": Agent.objects.create(
            company=company, name="stateless", adapter_type="claude-managed", adapter_config=config
        ),
        "persistent": Agent.objects.create(
            company=company,
            name="persistent",
            adapter_type="claude-managed",
            adapter_config={**config, "session_mode": "persistent", "session_ttl_hours": 24},
        ),
    }
    bare = anthropic.Anthropic(max_retries=2, timeout=600)
    remote = bare.beta.agents.create(name="bare", model="claude-haiku-4-5")
    environment = bare.beta.environments.create(name="bare", config={"type": "cloud"})
    persistent_session = bare.beta.sessions.create(agent=remote.id, environment_id=environment.id).id

    def engine(agent, n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            run, _ = heartbeat_enqueue(agent=agent, task=f"task {i}", now=timezone.now())
            finished = heartbeat_execute(run_id=run.id)
            assert finished.status == "succeeded", finished.error
        return n / (time.perf_counter() - start)

    def bare_turns(kind: str, n: int, *, as_engine: bool = False) -> float:
        """`as_engine`: with the requests the engine's guarantees cost it (the resumed
        session's status, the event cursor, the figures after the turn) and its archive left
        to later, as the engine's is: what remains between the two is the engine's own work."""
        start = time.perf_counter()
        for i in range(n):
            if kind == "stateless":
                session_id = bare.beta.sessions.create(agent=remote.id, environment_id=environment.id).id
            else:
                session_id = persistent_session
                if as_engine:
                    bare.beta.sessions.retrieve(session_id)
                    next(iter(bare.beta.sessions.events.list(session_id, order="desc", limit=1)), None)
            bare_turn(bare, session_id, f"task {i}")
            if as_engine:
                bare.beta.sessions.retrieve(session_id)
            elif kind == "stateless":
                bare.beta.sessions.archive(session_id)
        return n / (time.perf_counter() - start)

    results, trips = {}, {}
    for kind, agent in agents.items():
        engine(agent, 2)  # the remote agent and environment made, connections warm
        bare_turns(kind, 2)
        if postgres:
            trips[kind] = round_trips(lambda agent=agent: engine(agent, 1))
        engine_rates, bare_rates, engine_requests, bare_requests = [], [], [], []
        like_rates, like_requests = [], []
        for _ in range(ROUNDS):
            before = fake_stats(base_url)["requests"]
            engine_rates.append(engine(agent, PER_ROUND))
            middle = fake_stats(base_url)["requests"]
            bare_rates.append(bare_turns(kind, PER_ROUND))
            after = fake_stats(base_url)["requests"]
            like_rates.append(bare_turns(kind, PER_ROUND, as_engine=True))
            last = fake_stats(base_url)["requests"]
            engine_requests.append((middle - before) / PER_ROUND)
            bare_requests.append((after - middle) / PER_ROUND)
            like_requests.append((last - after) / PER_ROUND)
        results[kind] = Figures(engine_rates, bare_rates, engine_requests, bare_requests)
        results[f"{kind}, bare SDK making the engine's provider requests"] = Figures(
            engine_rates, like_rates, engine_requests, like_requests
        )
    return results, trips


def bare_turn(client, session_id: str, task: str) -> None:
    """One turn as a client of the SDK sends it: stream opened first, the task sent, the
    events read until the session is idle again."""
    with client.beta.sessions.events.stream(session_id) as stream:
        client.beta.sessions.events.send(
            session_id, events=[{"type": "user.message", "content": [{"type": "text", "text": task}]}]
        )
        for event in stream:
            if event.type in ("session.status_idle", "session.status_terminated"):
                return


def fake_stats(base_url: str) -> dict:
    with urllib.request.urlopen(f"{base_url}/_fake/stats") as response:
        return json.load(response)


class Figures:
    """Heartbeats per second through the engine and the bare SDK, round by round (medians)."""

    def __init__(self, engine_rates, bare_rates, engine_requests, bare_requests) -> None:
        self.engine = statistics.median(engine_rates)
        self.bare = statistics.median(bare_rates)
        self.overhead_ms = statistics.median(
            1000 / ours - 1000 / theirs for ours, theirs in zip(engine_rates, bare_rates, strict=True)
        )
        self.engine_requests = statistics.median(engine_requests)
        self.bare_requests = statistics.median(bare_requests)


if __name__ == "__main__":
    main()
