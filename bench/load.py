"""Load benchmark: a live server (gunicorn, several workers, qcluster) on PostgreSQL.

    .venv/bin/python bench/load.py [--seconds 60] [--clients 4] [--skip-mixed] [--skip-scaling] [--skip-memory]

Needs PostgreSQL on 127.0.0.1:5432 (user postgres, trust) and Redis on 127.0.0.1:6379.
It (re)creates the scratch database `paperclip_live_bench`, uses Redis db 7 only, binds
ports 3400-3499, and sends traffic to 127.0.0.1 only. Three parts:

1. Mixed traffic for `--seconds` from `--clients` client processes (closed loop, one
   request at a time each, bounded by time and by `--max-requests`): list sessions,
   heartbeats with `"wait": true` against a fake Messages API answering after 200 ms, and
   cost reports (daily, summary). Prints throughput, p50/p99 per endpoint and errors
   (any status >= 400, connection error, or a heartbeat that did not succeed).
2. Heartbeat throughput through the cluster on the Redis broker, with 1 and then 2
   qcluster processes (each with PAPERCLIP_Q_WORKERS workers): `"wait": false` heartbeats
   over many agents, timed from the first run's start to the last run's finish.
3. Memory of a qcluster worker (RSS, from /proc) after 100 and after 1,000 heartbeats:
   one cluster with one worker, django-q2's worker recycling turned off so that the same
   process serves all 1,000 (production recycles every 500 tasks, django-q2's default).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from tests.live.server import LiveServer, call, rss_kib  # noqa: E402

DB_NAME = "paperclip_live_bench"
DB_URL = f"postgres://postgres@127.0.0.1:5432/{DB_NAME}"
REDIS_URL = "redis://127.0.0.1:6379/7"
PERSISTENT = {"model": "claude-sonnet-4-5", "session_mode": "persistent", "session_ttl_hours": 24}


# Set-up


def database_create() -> None:
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB_NAME}")
    env = {**os.environ, "DATABASE_URL": DB_URL, "PAPERCLIP_HOME": tempfile.mkdtemp(prefix="pc-live-bench-")}
    env.pop("REDIS_URL", None)
    for command in (["migrate", "--no-input", "-v0"], ["createcachetable"]):
        subprocess.run([sys.executable, "manage.py", *command], cwd=ROOT, env=env, check=True)


def redis_flush() -> None:
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()  # db 7 is this benchmark's own


def fake_start(latency_ms: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_anthropic"],
        cwd=ROOT,
        env={**os.environ, "FAKE_LATENCY_MS": str(latency_ms)},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return proc, proc.stdout.readline().strip()


def fake_stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def sql(query: str, params: tuple = ()) -> list[tuple]:
    with psycopg.connect(DB_URL.replace("postgres://", "postgresql://")) as conn:
        return conn.execute(query, params).fetchall()


def seed(server: LiveServer, *, agents: int, name: str) -> tuple[str, list[str]]:
    api = f"{server.base_url}/api"
    status, company = call("POST", f"{api}/companies", {"name": name})
    assert status == 201, company
    ids = []
    for i in range(agents):
        status, agent = call(
            "POST",
            f"{api}/companies/{company['id']}/agents",
            {"name": f"agent {i:03d}", "system_prompt": "You are brief.", "adapter_config": PERSISTENT},
        )
        assert status == 201, agent
        ids.append(agent["id"])
    return company["id"], ids


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


# Part 1: mixed traffic


def client_loop(base: str, company: str, agents: list[str], seconds: float, max_requests: int, seed_: int) -> list:
    """One client process: a closed loop of mixed requests. Returns (endpoint, ms, ok, detail)."""
    rng = random.Random(seed_)
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(out) < max_requests:
        agent = rng.choice(agents)
        roll = rng.random()
        started = time.perf_counter()
        try:
            if roll < 0.45:
                endpoint = "GET sessions"
                status, body = call("GET", f"{base}/api/companies/{company}/agents/{agent}/sessions", timeout=60)
                ok = status == 200
            elif roll < 0.75:
                endpoint = "POST heartbeat wait"
                status, body = call(
                    "POST",
                    f"{base}/api/companies/{company}/agents/{agent}/heartbeat",
                    {"task": f"load {uuid.uuid4().hex[:8]}", "wait": True},
                    timeout=120,
                )
                ok = status == 200 and body.get("status") == "succeeded"
            elif roll < 0.9:
                endpoint = "GET costs/daily"
                status, body = call("GET", f"{base}/api/companies/{company}/costs/daily?days=30", timeout=60)
                ok = status == 200
            else:
                endpoint = "GET costs/summary"
                status, body = call("GET", f"{base}/api/companies/{company}/costs/summary", timeout=60)
                ok = status == 200
        except OSError as exc:
            status, body, ok = 0, repr(exc), False
        elapsed_ms = (time.perf_counter() - started) * 1000
        out.append((endpoint, elapsed_ms, ok, "" if ok else f"{status} {str(body)[:200]}"))
    return out


def mixed(args) -> None:
    fake, fake_url = fake_start(200)
    server = LiveServer(
        database_url=DB_URL,
        secret_key=secrets.token_urlsafe(50),
        home=Path(tempfile.mkdtemp(prefix="pc-live-bench-")),
        anthropic_base_url=fake_url,
        web_workers=args.web_workers,
        web_threads=args.web_threads,
        clusters=1,
    )
    try:
        server.start()
        company, agents = seed(server, agents=args.agents, name="Mixed load")
        # A little history first, so that lists and reports have rows to show.
        for agent in agents:
            call(
                "POST",
                f"{server.base_url}/api/companies/{company}/agents/{agent}/heartbeat",
                {"task": "warm up", "wait": True},
                timeout=60,
            )
        started = time.monotonic()
        with multiprocessing.get_context("spawn").Pool(args.clients) as pool:
            results = pool.starmap(
                client_loop,
                [(server.base_url, company, agents, args.seconds, args.max_requests, i) for i in range(args.clients)],
            )
        wall = time.monotonic() - started
    finally:
        server.stop()
        fake_stop(fake)
    rows = [row for client in results for row in client]
    by_endpoint = defaultdict(list)
    errors = [row for row in rows if not row[2]]
    for endpoint, ms, _ok, _detail in rows:
        by_endpoint[endpoint].append(ms)
    print(
        f"mixed: {args.clients} client processes, {wall:.1f}s, gunicorn {args.web_workers} workers x "
        f"{args.web_threads} threads, 1 qcluster, {args.agents} persistent agents, fake latency 200 ms"
    )
    print(f"  requests {len(rows)}  throughput {len(rows) / wall:.1f} req/s  errors {len(errors)}")
    print(f"  {'endpoint':22} {'count':>6} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8}")
    for endpoint in sorted(by_endpoint):
        values = by_endpoint[endpoint]
        print(
            f"  {endpoint:22} {len(values):6d} {len(values) / wall:7.1f} "
            f"{statistics.median(values):8.1f} {percentile(values, 0.99):8.1f}"
        )
    for row in errors[:10]:
        print(f"  error: {row[0]}: {row[3]}")


# Part 2: cluster scaling on Redis


def heartbeats_submit(server: LiveServer, company: str, agents: list[str], count: int, tag: str) -> None:
    """`"wait": false` heartbeats, round robin over the agents, from a few threads."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        agent = agents[i % len(agents)]
        status, body = call(
            "POST",
            f"{server.base_url}/api/companies/{company}/agents/{agent}/heartbeat",
            {"task": f"{tag} {i}", "idempotency_key": f"{tag}-{i}", "wait": False},
        )
        assert status == 202, (status, body)
        return status

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(count)))


def runs_wait(tag: str, count: int, timeout: float = 900) -> tuple[int, int, float]:
    """Wait until `count` runs tagged `tag` are terminal; (succeeded, failed, seconds from
    the first start to the last finish)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        [(done, ok, span)] = sql(
            "SELECT count(*) FILTER (WHERE status IN ('succeeded', 'failed')), "
            "count(*) FILTER (WHERE status = 'succeeded'), "
            "extract(epoch FROM max(finished_at) - min(started_at)) "
            "FROM heartbeat_runs WHERE task LIKE %s",
            (f"{tag} %",),
        )
        if done >= count:
            return ok, done - ok, float(span)
        time.sleep(0.5)
    raise RuntimeError(f"runs {tag}: only {done} of {count} finished in {timeout}s")


def scaling(args) -> None:
    fake, fake_url = fake_start(200)
    figures = {}
    try:
        for clusters in (1, 2):
            redis_flush()
            server = LiveServer(
                database_url=DB_URL,
                secret_key=secrets.token_urlsafe(50),
                home=Path(tempfile.mkdtemp(prefix="pc-live-bench-")),
                anthropic_base_url=fake_url,
                web_workers=2,
                web_threads=8,
                clusters=clusters,
                q_workers=args.q_workers,
                redis_url=REDIS_URL,
            )
            try:
                server.start()
                company, agents = seed(server, agents=args.scaling_agents, name=f"Scaling {clusters}")
                tag = f"scale{clusters}-{uuid.uuid4().hex[:6]}"
                heartbeats_submit(server, company, agents, args.scaling_heartbeats, tag)
                ok, failed, span = runs_wait(tag, args.scaling_heartbeats)
            finally:
                server.stop()
            figures[clusters] = args.scaling_heartbeats / span
            print(
                f"cluster scaling: {clusters} qcluster x {args.q_workers} workers (Redis broker): "
                f"{args.scaling_heartbeats} heartbeats over {len(agents)} agents in {span:.1f}s = "
                f"{figures[clusters]:.1f} heartbeats/s (succeeded {ok}, failed {failed})"
            )
    finally:
        fake_stop(fake)
    print(f"  2 vs 1 qcluster: {figures[2] / figures[1]:.2f}x (goal >= 1.7x)")


# Part 3: worker memory


def memory(args) -> None:
    fake, fake_url = fake_start(args.memory_latency_ms)
    home = Path(tempfile.mkdtemp(prefix="pc-live-bench-"))
    # The same settings with django-q2's worker recycling off: one process serves all.
    (home / "bench_settings.py").write_text(
        "from paperclip.settings import *  # noqa\nQ_CLUSTER = {**Q_CLUSTER, 'recycle': 1_000_000}\n"
    )
    server = LiveServer(
        database_url=DB_URL,
        secret_key=secrets.token_urlsafe(50),
        home=home / "server",
        anthropic_base_url=fake_url,
        web_workers=2,
        web_threads=8,
        clusters=1,
        q_workers=1,
        redis_url=REDIS_URL,
        extra_env={"DJANGO_SETTINGS_MODULE": "bench_settings", "PYTHONPATH": f"{home}:{ROOT}"},
    )
    redis_flush()
    readings = []
    try:
        server.start()
        company, agents = seed(server, agents=10, name="Memory")
        tag = f"mem-{uuid.uuid4().hex[:6]}"
        done = 0
        for target in (args.memory_first, args.memory_last):
            batch = f"{tag}-{target}"
            heartbeats_submit(server, company, agents, target - done, batch)
            runs_wait(batch, target - done)
            done = target
            [(claimed,)] = sql(
                "SELECT claimed_by FROM heartbeat_runs WHERE task LIKE %s ORDER BY finished_at DESC LIMIT 1",
                (f"{batch} %",),
            )
            workers = {
                row[0] for row in sql("SELECT DISTINCT claimed_by FROM heartbeat_runs WHERE task LIKE %s", (f"{tag}%",))
            }
            pid = int(claimed.rsplit(":", 1)[1])
            readings.append((target, pid, rss_kib(pid), len(workers)))
    finally:
        server.stop()
        fake_stop(fake)
    for target, pid, rss, workers in readings:
        print(
            f"memory: worker {pid} after {target:5d} heartbeats: RSS {rss / 1024:.1f} MiB ({workers} worker pid(s) so far)"
        )
    (_, _, first, _), (_, _, last, _) = readings
    print(f"  {args.memory_last} vs {args.memory_first} heartbeats: {last / first:.3f}x (goal <= 1.1x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-requests", type=int, default=20_000, help="per client process")
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--web-workers", type=int, default=3)
    parser.add_argument("--web-threads", type=int, default=8)
    parser.add_argument("--q-workers", type=int, default=2, help="workers per qcluster (scaling part)")
    parser.add_argument("--scaling-agents", type=int, default=40)
    parser.add_argument("--scaling-heartbeats", type=int, default=200)
    parser.add_argument("--memory-first", type=int, default=100)
    parser.add_argument("--memory-last", type=int, default=1000)
    parser.add_argument("--memory-latency-ms", type=int, default=10)
    parser.add_argument("--skip-mixed", action="store_true")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()

    database_create()
    print(
        f"database {DB_NAME} (PostgreSQL), {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    if not args.skip_mixed:
        mixed(args)
    if not args.skip_scaling:
        scaling(args)
    if not args.skip_memory:
        memory(args)


if __name__ == "__main__":
    main()
