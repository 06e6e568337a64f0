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
(the bare SDK replays those very requests), and at turns 2+ of a young persistent session,
so that turn 200's figure can be told apart into what keeping a session costs and what its
length adds. FAKE_LATENCY_MS=200 makes the fake answer like a (fast) model would, for the
overhead as an operator sees it.

Each line also prints the overhead per heartbeat: the engine's time per call minus the
bare SDK's, in the same round (median over rounds). The goals (issue 29): at 200 ms,
engine/bare >= 0.95 at turn 1 and turn 200; at 0 ms, turn 1's overhead at most twice the
floor's, and turn 200's at most 1.5 times turn 1's. The last lines say what bounds them:
the cost of a round trip here, measured on the floor's own statements.
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
    from sessions_app.heartbeat import heartbeat_execute
    from sessions_app.models import Agent, AgentSession, Company, HeartbeatRun
    from sessions_app.run_queue import heartbeat_enqueue
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
        # A budget of most of the window: the session replays its whole history (the default,
        # derived from the agent's own turns, would summarise it every few heartbeats).
        adapter_config={
            "model": "claude-haiku-4-5",
            "session_mode": "persistent",
            "session_ttl_hours": 24,
            "context_budget_tokens": 190_000,
        },
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

    bodies: list[dict] = []

    def measure(agent, n: int) -> Figures:
        nonlocal bodies
        engine_rates, bare_rates = [], []
        for _ in range(ROUNDS):
            engine_requests()  # skip what came before this round
            engine_rates.append(engine(agent, n))
            bodies = engine_requests()
            assert len(bodies) == n, len(bodies)
            bare_rates.append(bare_sdk(bodies))
        return Figures(engine_rates, bare_rates)

    # Warm both paths (connections, imports) before measuring; with
    # PAPERCLIP_PG_PREPARED_STATEMENTS, psycopg prepares a statement on its 5th run, in
    # exchanges of its own, so the round trips are counted after that.
    engine(stateless, 10)
    bare_sdk(engine_requests())
    trips = {"stateless": round_trips(lambda: engine(stateless, 1))}
    engine_requests()

    results = {"turn 1 (stateless)": measure(stateless, PER_ROUND)}
    # The floor sends the engine's requests with the task as plain text (the SQL stores it).
    plain = [{**body, "messages": [{"role": "user", "content": f"task {i}"}]} for i, body in enumerate(bodies)]
    floor_rates, bare_rates = [], []
    for _ in range(ROUNDS):
        floor_rates.append(floor(stateless, bare, plain))
        bare_rates.append(bare_sdk(plain))
    floor_label = "turn 1, floor: the fewest statements any engine needs, hand-written SQL"
    results[floor_label] = Figures(floor_rates, bare_rates)
    # A persistent session's early turns: what keeping a session costs before its history
    # is long, so that turn 200's line shows what the history's length adds.
    young = Agent.objects.create(
        company=company, name="young", system_prompt=system, adapter_config=persistent.adapter_config
    )
    engine(young, 1)
    engine_requests()
    results["turn 2+ (persistent, a young session)"] = measure(young, PER_ROUND // 4)
    # Grow the persistent session to 199 turns through the engine itself.
    engine(persistent, HISTORY_TURNS)
    trips["persistent"] = round_trips(lambda: engine(persistent, 1))
    engine_requests()
    session = AgentSession.objects.get(agent=persistent, status="active")
    prior = session.message_count
    results[f"turn {HISTORY_TURNS + 1}+ (persistent, {prior} prior messages)"] = measure(persistent, PER_ROUND // 4)
    latency = float(os.environ.get("FAKE_LATENCY_MS", "0"))
    commit_ms = committed_write_ms()
    idle_commit_ms = committed_write_ms(n=25, idle_seconds=latency / 1000) if latency else None
    fake.terminate()
    fake.wait()

    from django.db import connection

    prepared = "on" if connection.settings_dict.get("OPTIONS", {}).get("server_side_binding") else "off"
    print(
        f"store={store_for(session).name} fake latency={latency:g} ms rounds={ROUNDS} per_round={PER_ROUND} "
        f"prepared statements={prepared}"
    )
    print(
        "database round trips per heartbeat, enqueue to release (counted by libpq's trace): "
        + ", ".join(f"{kind} {count}" for kind, count in trips.items())
    )
    # The restated goals (issue 13): with a model's latency, the engine keeps 0.95 of the
    # bare rate; with none, what it adds per heartbeat is compared with what the floor adds.
    goal = " (goal >= 0.95)" if latency else ""
    for label, figures in results.items():
        ours, theirs = figures.engine, figures.bare
        print(
            f"{label}: engine {ours:.1f}/s, bare SDK {theirs:.1f}/s, ratio {ours / theirs:.3f}"
            f"{'' if 'floor' in label else goal}, overhead {figures.overhead_ms:.2f} ms/heartbeat"
        )
    turn_1, floor_, young_turns, turn_200 = results.values()
    # These two goals are set at zero latency.
    floor_goal, growth_goal = (" (goal <= 2)", " (goal <= 1.5)") if not latency else ("", "")
    print(
        f"overhead: turn 1 {turn_1.overhead_ms:.2f} ms, floor {floor_.overhead_ms:.2f} ms, "
        f"turn 200 {turn_200.overhead_ms:.2f} ms; turn 1 / floor {turn_1.overhead_ms / floor_.overhead_ms:.2f}"
        f"{floor_goal}, turn 200 / turn 1 {turn_200.overhead_ms / turn_1.overhead_ms:.2f}{growth_goal}; "
        f"persistent turn 200 / turn 2+ {turn_200.overhead_ms / young_turns.overhead_ms:.2f}"
    )
    call_ms = 1000 / turn_1.bare
    print(
        f"bound: one committed single-row INSERT takes {commit_ms:.3f} ms, a bare call {call_ms:.3f} ms; "
        f"two such writes (the run before the call, the ledger after) cap any engine at ratio "
        f"{call_ms / (call_ms + 2 * commit_ms):.2f}"
    )
    # The round trips the issue allows (stateless 9, persistent 12), each at what one of the
    # floor's own costs here: the most ratio those statements alone leave any engine.
    per_trip = floor_.overhead_ms / FLOOR_ROUND_TRIPS
    stateless_trips, persistent_trips = trips["stateless"], trips["persistent"]
    turn_200_call_ms = 1000 / turn_200.bare
    print(
        f"per round trip: the floor {per_trip:.2f} ms, turn 1 {turn_1.overhead_ms / stateless_trips:.2f} ms, "
        f"turn 200 {turn_200.overhead_ms / persistent_trips:.2f} ms; at the floor's cost, {stateless_trips} round "
        f"trips cap turn 1 at ratio {call_ms / (call_ms + stateless_trips * per_trip):.3f} and {persistent_trips} "
        f"cap turn 200 at {turn_200_call_ms / (turn_200_call_ms + persistent_trips * per_trip):.3f}"
    )
    if latency:
        # What the 0.95 goal leaves per heartbeat, and why the same statements cost more
        # here than back to back: each one follows the call's idle wait, or a statement
        # that did.
        print(
            f"allowance: ratio 0.95 leaves {call_ms * (1 / 0.95 - 1):.2f} ms beside a {call_ms:.1f} ms call; "
            f"the floor uses {floor_.overhead_ms:.2f} ms of it. The same committed INSERT takes "
            f"{idle_commit_ms:.3f} ms after {latency:g} ms idle (back to back: {commit_ms:.3f} ms)"
        )


class Figures:
    """One line's rounds: heartbeats per second through the engine (or the floor) and the
    bare SDK's replay of the same requests, round by round."""

    def __init__(self, engine_rates: list[float], bare_rates: list[float]) -> None:
        self.engine = statistics.median(engine_rates)
        self.bare = statistics.median(bare_rates)
        # What the engine adds to each call, per round (the same requests, moments apart).
        self.overhead_ms = statistics.median(
            1000 / ours - 1000 / theirs for ours, theirs in zip(engine_rates, bare_rates, strict=True)
        )


def round_trips(action) -> int:
    """The database round trips `action` makes on this thread's connection, counted from
    libpq's own trace of the protocol: every exchange ends with the server's ReadyForQuery
    (BEGIN and COMMIT are exchanges of their own)."""
    import tempfile

    from django.db import connection
    from psycopg import pq

    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    with tempfile.TemporaryFile(mode="w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            action()
        finally:
            pgconn.untrace()
        trace.seek(0)
        return sum(1 for line in trace if "\tReadyForQuery\t" in line)


def committed_write_ms(n: int = 2000, idle_seconds: float = 0) -> float:
    """The cheapest durable write there is: one small row, its own transaction, no ORM.
    With `idle_seconds`, each write follows that long a wait, as the engine's first
    statements after a model call do (the median write; the waits are not counted)."""
    import uuid

    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE bench_commit_probe (id uuid PRIMARY KEY, at timestamptz NOT NULL)")
        try:
            if idle_seconds:
                times = []
                for _ in range(n):
                    time.sleep(idle_seconds)
                    start = time.perf_counter()
                    cursor.execute("INSERT INTO bench_commit_probe VALUES (%s, now())", [uuid.uuid4()])
                    times.append(time.perf_counter() - start)
                return statistics.median(times) * 1000
            start = time.perf_counter()
            for _ in range(n):
                cursor.execute("INSERT INTO bench_commit_probe VALUES (%s, now())", [uuid.uuid4()])
            return (time.perf_counter() - start) / n * 1000
        finally:
            cursor.execute("DROP TABLE bench_commit_probe")


# A lower bound for any engine that keeps the run's state and the ledger in the database:
# one statement claims the run (inserted as running, refused unless the agent is active),
# the call, then one statement records the ledger row, completes the run and looks for
# the agent's next queued run. No session, no budgets, no pricing beyond two token classes.
FLOOR_ROUND_TRIPS = 2  # FLOOR_CLAIM and FLOOR_FINISH, each its own transaction
FLOOR_CLAIM = """
INSERT INTO heartbeat_runs (id, company_id, agent_id, status, trigger, task, force_fresh, output, error_code,
    error, model, message_id, stop_reason, reserved_usd, warning, started_at, claimed_by)
SELECT %s, company_id, id, 'running', 'api', %s, false, '', '', '', '', '', '', 0, '', %s, 'floor'
FROM agents WHERE id = %s AND status = 'active'
RETURNING id
"""
FLOOR_FINISH = """
WITH price AS (
    SELECT input_usd_per_mtok, output_usd_per_mtok FROM model_prices
    WHERE model = %(model)s AND effective_from <= %(day)s ORDER BY effective_from DESC LIMIT 1
), event AS (
    INSERT INTO cost_events (kind, company_id, agent_id, run_id, model, input_tokens, output_tokens,
        cache_creation_input_tokens, cache_creation_5m_input_tokens, cache_creation_1h_input_tokens,
        cache_read_input_tokens, session_seconds, unpriced, cost_usd, message_id, raw_usage, created_at)
    SELECT 'message', %(company)s, %(agent)s, %(run)s, %(model)s, %(input)s, %(output)s, 0, 0, 0, 0, 0, false,
        (%(input)s * input_usd_per_mtok + %(output)s * output_usd_per_mtok) / 1000000, %(message)s, %(usage)s, %(at)s
    FROM price RETURNING cost_usd
), run AS (
    UPDATE heartbeat_runs SET status = 'succeeded', output = %(output_text)s, message_id = %(message)s,
        cost_usd = (SELECT cost_usd FROM event), finished_at = %(at)s
    WHERE id = %(run)s AND status = 'running' RETURNING id
)
SELECT (SELECT count(*) FROM run),
    (SELECT id FROM heartbeat_runs WHERE agent_id = %(agent)s AND status = 'queued' ORDER BY created_at LIMIT 1)
"""


def floor(agent, client, bodies: list[dict]) -> float:
    import uuid

    from django.db import connection
    from django.utils import timezone

    start = time.perf_counter()
    with connection.cursor() as cursor:
        for body in bodies:
            run_id, now = uuid.uuid4(), timezone.now()
            cursor.execute(FLOOR_CLAIM, [run_id, body["messages"][-1]["content"], now, agent.id])
            assert cursor.fetchone()
            message = client.messages.create(**body)
            usage = message.usage.model_dump(mode="json", exclude_none=True)
            text = "".join(block.text for block in message.content if block.type == "text")
            params = {
                "model": message.model,
                "day": now.date(),
                "company": agent.company_id,
                "agent": agent.id,
                "run": run_id,
                "input": usage["input_tokens"],
                "output": usage["output_tokens"],
                "message": message.id,
                "usage": json.dumps(usage),
                "at": now,
                "output_text": text,
            }
            cursor.execute(FLOOR_FINISH, params)
            assert cursor.fetchone()[0] == 1
    return len(bodies) / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
