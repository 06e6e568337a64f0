"""Benchmark: the cost reports through the API versus the plain GROUP BY over the ledger.

A company with 1,000,000 ledger rows (10 agents, 3 models, spread over the last 30 UTC
days), on PostgreSQL. Times `GET .../costs/daily` and `GET .../costs/summary`, for the
company and for one agent, through the full stack (Django test client: middleware, DRF,
the key lookup of `authenticated` mode, serialization, JSON), and in the same run the plain
GROUP BY over cost_events that answers the same question, written by hand; prints p50/p95
and the ratio API / GROUP BY (goal: at most 1.2). Before timing, it checks that the API
answers what the GROUP BY does and that cost_days equals the ledger; after, what the
rollup's trigger adds to one ledger insert.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/paperclip_bench PAPERCLIP_HOME=/tmp/pc-bench \\
        .venv/bin/python bench/rollups.py [--rows 1000000] [--agents 10] [--days 30] [--rounds 30]

The database is migrated and the bench's own company (and its ledger rows) replaced on
every run; the rows are written through the ledger's triggers, as every write is.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.test import Client  # noqa: E402
from django.utils import timezone  # noqa: E402

from costs_app.reports import window_start  # noqa: E402
from sessions_app.api_keys import api_key_create  # noqa: E402
from sessions_app.models import Agent, Company  # noqa: E402

BENCH_COMPANY = "bench: rollups"
MODELS = ("claude-opus-4-5", "claude-sonnet-4-5", "claude-haiku-4-5")
CHUNK = 100_000

# The plain GROUP BYs: what each report is, asked of the ledger directly. The same sums and
# the same UTC days as the API; served by cost_events_company_day_idx / _agent_day_idx.
SUMS = (
    "SUM(input_tokens), SUM(output_tokens), SUM(cache_creation_input_tokens), "
    "SUM(cache_read_input_tokens), SUM(cost_usd), COUNT(*)"
)
DAILY_SQL = (
    f"SELECT (created_at AT TIME ZONE 'UTC')::date AS day, {SUMS} FROM cost_events "  # noqa: S608 (constant)
    "WHERE company_id = %s {agent} AND created_at >= %s GROUP BY 1 ORDER BY 1 DESC"
)
SUMMARY_SQL = (
    f"SELECT agent_id, model, {SUMS} FROM cost_events "  # noqa: S608 (constant)
    "WHERE company_id = %s {agent} AND created_at >= %s GROUP BY agent_id, model ORDER BY agent_id, model"
)
KEY_SQL = "SELECT id, company_id, revoked_at, last_used_at, key_hash FROM api_keys WHERE key_hash = %s"

# cost_days against the ledger's GROUP BY, both ways: no row in one that the other lacks.
ROLLUP_COLUMNS = (
    "agent_id, day, model, kind, company_id, input_tokens, output_tokens, cache_creation_input_tokens, "
    "cache_creation_5m_input_tokens, cache_creation_1h_input_tokens, cache_read_input_tokens, session_seconds, "
    "cost_usd, events"
)
LEDGER_GROUPED = (
    "SELECT agent_id, (created_at AT TIME ZONE 'UTC')::date, model, kind, company_id, SUM(input_tokens), "
    "SUM(output_tokens), SUM(cache_creation_input_tokens), SUM(cache_creation_5m_input_tokens), "
    "SUM(cache_creation_1h_input_tokens), SUM(cache_read_input_tokens), SUM(session_seconds), SUM(cost_usd), "
    "COUNT(*) FROM cost_events WHERE company_id = %s GROUP BY 1, 2, 3, 4, 5"
)
ROLLUP_ROWS = f"SELECT {ROLLUP_COLUMNS} FROM cost_days WHERE company_id = %s"  # noqa: S608 (constant)
DIFFERENCE_SQL = (
    f"SELECT count(*) FROM (({LEDGER_GROUPED} EXCEPT {ROLLUP_ROWS}) "  # noqa: S608 (constant)
    f"UNION ALL ({ROLLUP_ROWS} EXCEPT {LEDGER_GROUPED})) AS difference"
)

# One ledger row, as RunCalls.bill's insert writes it (for the trigger's cost per insert).
INSERT_SQL = (
    "INSERT INTO cost_events (kind, company_id, agent_id, model, input_tokens, output_tokens, "
    "cache_creation_input_tokens, cache_creation_5m_input_tokens, cache_creation_1h_input_tokens, "
    "cache_read_input_tokens, session_seconds, cost_usd, unpriced, price_source, delivery, created_at) "
    "VALUES ('message', %s, %s, 'claude-opus-4-5', 1200, 300, 790, 700, 90, 5000, 0, 0.0123456789, false, "
    "'library', 'direct', now())"
)


def seed(*, rows: int, agents: int, days: int, now) -> tuple[Company, list[Agent], float]:
    """The bench company and its ledger, written in chunks through the triggers."""
    old = list(Company.objects.filter(name=BENCH_COMPANY).values_list("id", flat=True))
    with connection.cursor() as cursor:
        for company_id in old:
            cursor.execute("DELETE FROM cost_events WHERE company_id = %s", [company_id])
    Company.objects.filter(id__in=old).delete()
    company = Company.objects.create(name=BENCH_COMPANY)
    members = [
        Agent.objects.create(company=company, name=f"bench agent {i}", adapter_config={"model": MODELS[i % 3]})
        for i in range(agents)
    ]
    agent_ids = [str(agent.id) for agent in members]
    started = time.perf_counter()
    span = days * 86_400
    with connection.cursor() as cursor:
        for first in range(0, rows, CHUNK):
            # Row n: agent n mod agents, model n mod 3, every 97th a compaction, spread evenly
            # (to the microsecond) from `span` seconds before now to now.
            cursor.execute(
                """
                INSERT INTO cost_events (kind, company_id, agent_id, model, input_tokens, output_tokens,
                    cache_creation_input_tokens, cache_creation_5m_input_tokens, cache_creation_1h_input_tokens,
                    cache_read_input_tokens, session_seconds, cost_usd, unpriced, price_source, delivery,
                    created_at)
                SELECT CASE WHEN n %% 97 = 0 THEN 'compaction' ELSE 'message' END, %s,
                    (%s::uuid[])[1 + n %% %s], (%s::text[])[1 + n %% 3],
                    1000 + n %% 5000, 50 + n %% 700, n %% 900, n %% 900, 0, 4000 + n %% 20000, 0,
                    round((n %% 10007) * 0.0000123456, 10), false, 'library', 'direct',
                    %s - (n::double precision / %s * %s) * interval '1 second'
                FROM generate_series(%s, %s) AS n
                """,
                [company.id, agent_ids, agents, list(MODELS), now, rows, span, first, min(first + CHUNK, rows) - 1],
            )
        cursor.execute("VACUUM ANALYZE cost_events")
        cursor.execute("VACUUM ANALYZE cost_days")
    return company, members, time.perf_counter() - started


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def sql_rows(sql: str, params: list) -> list:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def cases(company: Company, agent: Agent, now) -> list[tuple[str, str, dict, str, list]]:
    """(name, API path, query, plain SQL, its params) of each report timed."""
    since = window_start(now=now, days=30)
    month = now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    base = f"/api/companies/{company.id}/costs"
    mine = "AND agent_id = %s"
    return [
        ("daily, company", f"{base}/daily", {}, DAILY_SQL.format(agent=""), [company.id, since]),
        (
            "daily, agent",
            f"{base}/daily",
            {"agent_id": str(agent.id)},
            DAILY_SQL.format(agent=mine),
            [company.id, agent.id, since],
        ),
        ("summary, company", f"{base}/summary", {}, SUMMARY_SQL.format(agent=""), [company.id, month]),
        (
            "summary, agent",
            f"{base}/summary",
            {"agent_id": str(agent.id)},
            SUMMARY_SQL.format(agent=mine),
            [company.id, agent.id, month],
        ),
    ]


def same_answer(name: str, body: dict, rows: list) -> None:
    """The API's report is the GROUP BY's, row for row (totals and events)."""
    listed = body["daily"] if "daily" in body else body["rows"]
    assert len(listed) == len(rows), (name, len(listed), len(rows))
    for item, row in zip(listed, rows, strict=True):
        assert (item["input_tokens"], item["output_tokens"], item["events"]) == (row[-6], row[-5], row[-1]), name
        assert Decimal(item["cost_usd"]) == row[-2], (name, item["cost_usd"], row[-2])


def trigger_cost(company: Company, agent: Agent, inserts: int = 2000) -> tuple[float, float]:
    """Mean time of one ledger insert with the rollup's trigger and without it (ms), each
    batch in a transaction rolled back, so the ledger and rollup are left as they were."""
    times = {}
    for label, disable in (("with", False), ("without", True)):
        with transaction.atomic(), connection.cursor() as cursor:
            if disable:
                cursor.execute("ALTER TABLE cost_events DISABLE TRIGGER cost_days_insert")
            started = time.perf_counter()
            for _ in range(inserts):
                cursor.execute(INSERT_SQL, [company.id, agent.id])
            times[label] = (time.perf_counter() - started) / inserts * 1000
            transaction.set_rollback(True)
    return times["with"], times["without"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--days", type=int, default=30, help="the rows span this many days up to now")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if connection.vendor != "postgresql":
        sys.exit("bench/rollups.py needs PostgreSQL: set DATABASE_URL=postgres://...")

    call_command("migrate", verbosity=0)
    call_command("createcachetable", verbosity=0)
    now = timezone.now()
    company, agents, seconds = seed(rows=args.rows, agents=args.agents, days=args.days, now=now)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM cost_days WHERE company_id = %s", [company.id])
        totals = cursor.fetchone()[0]
        cursor.execute(DIFFERENCE_SQL, [company.id, company.id, company.id, company.id])
        differences = cursor.fetchone()[0]
        cursor.execute(
            "SELECT pg_size_pretty(pg_total_relation_size('cost_events')), "
            "pg_size_pretty(pg_total_relation_size('cost_days'))"
        )
        sizes = cursor.fetchone()
    print(
        f"seeded {args.rows} ledger rows ({args.agents} agents, {len(MODELS)} models, {args.days} days) in "
        f"{seconds:.1f}s through the triggers (PostgreSQL {connection.cursor().connection.info.server_version}); "
        f"cost_events {sizes[0]}, cost_days {sizes[1]} ({totals} totals)"
    )
    assert differences == 0, f"cost_days differs from the ledger's GROUP BY in {differences} rows"
    print("cost_days equals the ledger's GROUP BY: yes (EXCEPT both ways, 0 rows)")

    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.ALLOWED_HOSTS = ["testserver", *settings.ALLOWED_HOSTS]
    _, key = api_key_create(company=company, name="bench")
    headers = {"Authorization": f"Bearer {key}"}
    client = Client()
    agent = agents[0]
    timed = cases(company, agent, now)
    for name, path, query, sql, params in timed:
        response = client.get(path, query, headers=headers)
        assert response.status_code == 200, response.content[:300]
        same_answer(name, response.json(), sql_rows(sql, params))
    print("API answers = GROUP BY answers: yes (every row's tokens, cost and events)")

    times: dict[str, dict[str, list[float]]] = {name: {"api": [], "sql": []} for name, *_ in timed}

    def api(path, query):
        response = client.get(path, query, headers=headers)
        assert response.status_code == 200

    for round_ in range(args.rounds + 3):  # the first three warm every path up
        for name, path, query, sql, params in timed:  # interleaved: the same machine load for both
            actions = (
                ("api", lambda path=path, query=query: api(path, query)),
                ("sql", lambda sql=sql, params=params: sql_rows(sql, params)),
            )
            for kind, action in actions:
                started = time.perf_counter()
                action()
                if round_ >= 3:
                    times[name][kind].append(time.perf_counter() - started)

    print(
        f"\n{'report':<18}{'API p50':>10}{'API p95':>10}{'SQL p50':>10}{'SQL p95':>10}{'p50 ratio':>11}{'p95 ratio':>11}"
    )
    for name, *_ in timed:

        def ms(kind: str, fraction: float, name=name) -> float:
            return percentile(times[name][kind], fraction) * 1000

        print(
            f"{name:<18}{ms('api', 0.5):>8.2f}ms{ms('api', 0.95):>8.2f}ms{ms('sql', 0.5):>8.2f}ms"
            f"{ms('sql', 0.95):>8.2f}ms{ms('api', 0.5) / ms('sql', 0.5):>10.3f}x"
            f"{ms('api', 0.95) / ms('sql', 0.95):>10.3f}x"
        )
    with_trigger, without = trigger_cost(company, agent)
    print(
        f"\n{args.rounds} rounds; SQL = the plain GROUP BY over cost_events for the same report (daily: the last "
        "30 UTC days; summary: this UTC month); API = the full request, reading cost_days. Goal: ratio <= 1.2."
    )
    print(
        f"one ledger insert (in a transaction): {with_trigger:.3f} ms with the rollup trigger, {without:.3f} ms "
        f"without (+{with_trigger - without:.3f} ms, no extra round trip)"
    )


if __name__ == "__main__":
    main()
