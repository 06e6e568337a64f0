"""Benchmark: the sessions list through the API versus the same query in raw SQL.

One agent with 10,000 sessions of 50 messages each (history in the `database` store, so
every row carries a real jsonb history), on PostgreSQL. Times the first page and the next
few cursor pages through the full stack (Django test client: middleware, DRF, the key
lookup of `authenticated` mode, serialization, JSON) and the equivalent raw SQL in the same
run, then prints p50/p95 and their ratio. Also asserts that no API query selects `history`.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/paperclip_api PAPERCLIP_HOME=/tmp/pc-bench \
        .venv/bin/python bench/api_list.py [--sessions 10000] [--messages 50] [--rounds 200]

The database is migrated and the bench's own company is replaced on every run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.utils import timezone  # noqa: E402

from sessions_app.api_keys import api_key_create  # noqa: E402
from sessions_app.models import Agent, AgentSession, Company  # noqa: E402

BENCH_COMPANY = "bench: api_list"
PAGES = 4  # the first page and three cursor pages
LIMIT = 50

# The SQL the API's list runs, written by hand: the same columns (all but `history`), the
# same keyset predicate and order, served by sessions_agent_last_used_idx.
COLUMNS = (
    "id, agent_id, company_id, created_at, last_used, expires_at, status, message_count, store, adapter_type, "
    "model, last_input_tokens, total_input_tokens, total_output_tokens, total_cost_usd, ended_at, end_reason, "
    "history_purged_at, turn_count, archived_message_count, compaction_count, predecessor_id"
)
FIRST_PAGE_SQL = f"SELECT {COLUMNS} FROM agent_sessions WHERE agent_id = %s ORDER BY last_used DESC, id DESC LIMIT %s"  # noqa: S608 (constant columns)
NEXT_PAGE_SQL = (
    f"SELECT {COLUMNS} FROM agent_sessions WHERE agent_id = %s AND (last_used < %s OR (last_used = %s AND id < %s)) "  # noqa: S608
    "ORDER BY last_used DESC, id DESC LIMIT %s"
)


def seed(*, sessions: int, messages: int) -> tuple[Company, Agent]:
    Company.objects.filter(name=BENCH_COMPANY).delete()
    company = Company.objects.create(name=BENCH_COMPANY)
    agent = Agent.objects.create(
        company=company,
        name="bench agent",
        adapter_config={"model": "claude-opus-4-5", "session_mode": "persistent"},
    )
    now = timezone.now()
    history = [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": f"Turn {i}: " + "the quick brown fox jumps over the lazy dog. " * 4,
            "at": now.isoformat(),
        }
        for i in range(messages)
    ]
    batch = []
    for index in range(sessions):
        last_used = now - timedelta(minutes=index)
        batch.append(
            AgentSession(
                agent=agent,
                company=company,
                history=history,
                message_count=messages,
                # All but the newest are ended: one live session per agent.
                status="active" if index == 0 else "ended",
                store="database",
                created_at=last_used - timedelta(hours=1),
                last_used=last_used,
                expires_at=last_used + timedelta(hours=24),
                model="claude-opus-4-5",
                adapter_type="claude-code",
            )
        )
        if len(batch) == 1000:
            AgentSession.objects.bulk_create(batch)
            batch = []
    AgentSession.objects.bulk_create(batch)
    with connection.cursor() as cursor:
        # Reclaims the previous run's rows too, so repeated runs measure the same table.
        cursor.execute("VACUUM ANALYZE agent_sessions")
    return company, agent


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def api_walk(client: Client, url: str, headers: dict) -> list[float]:
    """Times of the first page and the next cursor pages, in seconds."""
    times = []
    cursor = None
    for _ in range(PAGES):
        params = {"limit": LIMIT, **({"next": cursor} if cursor else {})}
        started = time.perf_counter()
        response = client.get(url, params, headers=headers)
        body = response.json()
        times.append(time.perf_counter() - started)
        assert response.status_code == 200, response.content[:300]
        assert len(body["sessions"]) == LIMIT
        cursor = body["next"]
    return times


KEY_SQL = "SELECT id, company_id, revoked_at, last_used_at, key_hash FROM api_keys WHERE key_hash = %s"


def sql_walk(agent_id: uuid.UUID, key_hash: str | None = None) -> list[float]:
    """The page query alone; with `key_hash`, also the key lookup every API request makes."""
    times = []
    last = None
    with connection.cursor() as cursor:
        for _ in range(PAGES):
            started = time.perf_counter()
            if key_hash:
                cursor.execute(KEY_SQL, [key_hash])
                cursor.fetchone()
            if last is None:
                cursor.execute(FIRST_PAGE_SQL, [agent_id, LIMIT + 1])
            else:
                cursor.execute(NEXT_PAGE_SQL, [agent_id, last[0], last[0], last[1], LIMIT + 1])
            rows = cursor.fetchall()
            times.append(time.perf_counter() - started)
            assert len(rows) == LIMIT + 1
            page = rows[:LIMIT]
            last = (page[-1][4], page[-1][0])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--messages", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=200, help="walks of the first page and the next three")
    args = parser.parse_args()
    if connection.vendor != "postgresql":
        sys.exit("bench/api_list.py needs PostgreSQL: set DATABASE_URL=postgres://...")

    call_command("migrate", verbosity=0)
    call_command("createcachetable", verbosity=0)
    started = time.perf_counter()
    company, agent = seed(sessions=args.sessions, messages=args.messages)
    print(
        f"seeded {args.sessions} sessions x {args.messages} messages in {time.perf_counter() - started:.1f}s "
        f"(PostgreSQL {connection.cursor().connection.info.server_version})"
    )
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_size_pretty(pg_total_relation_size('agent_sessions'))")
        print(f"agent_sessions size: {cursor.fetchone()[0]}")
        cursor.execute("EXPLAIN " + FIRST_PAGE_SQL, [agent.id, LIMIT + 1])
        print("plan:", " | ".join(row[0].strip() for row in cursor.fetchall()[:3]))

    # The production configuration: authenticated mode, so every request also looks up its key.
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.ALLOWED_HOSTS = ["testserver", *settings.ALLOWED_HOSTS]
    api_key, key = api_key_create(company=company, name="bench")
    headers = {"Authorization": f"Bearer {key}"}
    client = Client()
    url = f"/api/companies/{company.id}/agents/{agent.id}/sessions"

    # No API query reads the history column.
    with CaptureQueriesContext(connection) as queries:
        api_walk(client, url, headers)
    session_sql = [q["sql"] for q in queries if "agent_sessions" in q["sql"]]
    # A word match, whatever the quoting or alias (history_purged_at is another column).
    assert session_sql and not any(re.search(r"\bhistory\b", sql) for sql in session_sql), session_sql
    print(f"queries per page: {len(queries) / PAGES:.1f}; history selected: no")

    for _ in range(10):  # warm up every path
        api_walk(client, url, headers)
        sql_walk(agent.id)
        sql_walk(agent.id, api_key.key_hash)
    times: dict[str, dict[str, list[float]]] = {name: {"first": [], "next": []} for name in ("api", "sql", "sql+key")}
    for _ in range(args.rounds):  # interleaved, so all see the same machine load
        for name, walk in (
            ("api", lambda: api_walk(client, url, headers)),
            ("sql", lambda: sql_walk(agent.id)),
            ("sql+key", lambda: sql_walk(agent.id, api_key.key_hash)),
        ):
            first, *rest = walk()
            times[name]["first"].append(first)
            times[name]["next"].extend(rest)

    def ms(name: str, page: str, fraction: float) -> float:
        return percentile(times[name][page], fraction) * 1000

    print(
        f"\n{'page':<7}{'API p50':>9}{'API p95':>9}{'SQL p50':>9}{'SQL p95':>9}{'p95 ratio':>10}"
        f"{'SQL+key p95':>13}{'ratio':>7}"
    )
    for page in ("first", "next"):
        print(
            f"{page:<7}{ms('api', page, 0.5):>7.2f}ms{ms('api', page, 0.95):>7.2f}ms"
            f"{ms('sql', page, 0.5):>7.2f}ms{ms('sql', page, 0.95):>7.2f}ms"
            f"{ms('api', page, 0.95) / ms('sql', page, 0.95):>9.1f}x"
            f"{ms('sql+key', page, 0.95):>11.2f}ms{ms('api', page, 0.95) / ms('sql+key', page, 0.95):>6.1f}x"
        )
    print(
        f"\n{args.rounds} rounds; 'next' = pages 2..{PAGES} by cursor; limit {LIMIT}. SQL = the page query "
        "alone; SQL+key = also the API key lookup that every authenticated request makes."
    )
    print(f"median API time per first page: {statistics.median(times['api']['first']) * 1000:.2f}ms")


if __name__ == "__main__":
    main()
