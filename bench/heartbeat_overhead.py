"""Heartbeats per second through the engine vs the bare SDK, against the same fake API.

Both sides talk HTTP to the fake Messages API (tests/fake_anthropic.py) answering at once,
in the same run, and send byte-for-byte the same requests: after each round of engine
heartbeats the bare SDK replays the request bodies the engine sent (system blocks, cache
markers, history and all), so the fake does the same work for both and the ratio isolates
what the engine adds: claiming the run, reading and writing history, pricing, the ledger
row and the run's completion.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/paperclip_bench .venv/bin/python bench/heartbeat_overhead.py

The database named in DATABASE_URL is created when missing and migrated; its tables are
emptied first. Measured at turn 1 (stateless) and at turns 200+ of a persistent session
(the bare SDK replays those very requests). FAKE_LATENCY_MS=200 makes the fake
answer like a (fast) model would, for the overhead as an operator sees it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
os.environ.setdefault("PAPERCLIP_HOME", str(ROOT / ".paperclip" / "bench"))

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
PER_ROUND = int(os.environ.get("BENCH_PER_ROUND", "40"))
HISTORY_TURNS = 199


def ensure_database() -> None:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith("postgres"):
        sys.exit("Set DATABASE_URL to a PostgreSQL database (it is created when missing).")
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def main() -> None:
    ensure_database()
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    import subprocess

    import anthropic
    from django.utils import timezone

    from costs_app.models import CostEvent
    from sessions_app.heartbeat import heartbeat_enqueue, heartbeat_execute
    from sessions_app.models import Agent, AgentSession, Company, HeartbeatRun
    from sessions_app.stores import store_for

    # The fake runs in its own process so it does not compete for this one's GIL.
    fake = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_anthropic"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "FAKE_LATENCY_MS": os.environ.get("FAKE_LATENCY_MS", "0")},
    )
    base_url = fake.stdout.readline().strip()
    os.environ["ANTHROPIC_BASE_URL"] = base_url
    os.environ["ANTHROPIC_API_KEY"] = "sk-ant-bench"
    bare = anthropic.Anthropic(max_retries=2, timeout=600)

    CostEvent.objects.all().delete()
    HeartbeatRun.objects.all().delete()
    AgentSession.objects.all().delete()
    Agent.objects.all().delete()
    company = Company.objects.create(name="bench")
    system = "You are a benchmark agent."
    stateless = Agent.objects.create(
        company=company, name="stateless", system_prompt=system, adapter_config={"model": "claude-haiku-4-5"}
    )
    persistent = Agent.objects.create(
        company=company,
        name="persistent",
        system_prompt=system,
        adapter_config={"model": "claude-haiku-4-5", "session_mode": "persistent", "session_ttl_hours": 24},
    )

    def engine(agent, n):
        start = time.perf_counter()
        for i in range(n):
            run, _ = heartbeat_enqueue(agent=agent, task=f"task {i}", now=timezone.now())
            assert heartbeat_execute(run_id=run.id).status == "succeeded"
        return n / (time.perf_counter() - start)

    sent = 0

    def engine_requests() -> list[dict]:
        """The request bodies the engine sent since the last call, as the fake received them."""
        nonlocal sent
        with urllib.request.urlopen(f"{base_url}/_fake/message_requests?after={sent}") as response:
            bodies = json.load(response)["bodies"]
        sent += len(bodies)
        return bodies

    def bare_sdk(bodies: list[dict]) -> float:
        start = time.perf_counter()
        for body in bodies:
            bare.messages.create(**body)
        return len(bodies) / (time.perf_counter() - start)

    def measure(agent, n: int) -> tuple[float, float]:
        engine_rates, bare_rates = [], []
        for _ in range(ROUNDS):
            engine_requests()  # skip what came before this round
            engine_rates.append(engine(agent, n))
            bodies = engine_requests()
            assert len(bodies) == n, len(bodies)
            bare_rates.append(bare_sdk(bodies))
        return statistics.median(engine_rates), statistics.median(bare_rates)

    # Warm both paths (connections, imports) before measuring.
    engine(stateless, 5)
    bare_sdk(engine_requests())

    results = {"turn 1 (stateless)": measure(stateless, PER_ROUND)}
    # Grow the persistent session to 199 turns through the engine itself.
    engine(persistent, HISTORY_TURNS)
    session = AgentSession.objects.get(agent=persistent, status="active")
    prior = session.message_count
    results[f"turn {HISTORY_TURNS + 1}+ (persistent, {prior} prior messages)"] = measure(persistent, PER_ROUND // 4)
    fake.terminate()
    fake.wait()

    latency = os.environ.get("FAKE_LATENCY_MS", "0")
    print(f"store={store_for(session).name} fake latency={latency} ms rounds={ROUNDS} per_round={PER_ROUND}")
    for label, (ours, theirs) in results.items():
        print(f"{label}: engine {ours:.1f}/s, bare SDK {theirs:.1f}/s, ratio {ours / theirs:.2f} (goal >= 0.80)")


if __name__ == "__main__":
    main()
