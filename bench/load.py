"""Load benchmark: a live server (gunicorn, several workers, qcluster) on PostgreSQL.

    .venv/bin/python bench/load.py [--seconds 60] [--clients 4] [--skip-mixed] [--skip-scaling] [--skip-memory]
                                   [--skip-storm]

Needs PostgreSQL on 127.0.0.1:5432 (user postgres, trust) and Redis on 127.0.0.1:6379.
It (re)creates the scratch database `paperclip_live_bench`, uses Redis db 7 only, binds
ports 3400-3499, and sends traffic to 127.0.0.1 only. Four parts:

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
4. A tick storm: `--storm-agents` scheduled agents all due at once, two qcluster processes
   on the database broker (PostgreSQL), PAPERCLIP_MAX_CONCURRENT_RUNS=`--storm-cap`, the
   fake answering after `--storm-latency-ms`. django-q2's own schedulers fire the ticks: the
   schedule rows are made due in one transaction, twice (the second wave lands while the
   first one's runs still wait or run). Prints the most runs seen running at once (polled,
   and from the runs' start and finish times), and per agent whether every tick the
   clusters executed became exactly one run or one merge into a run (none lost or doubled).
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

# Another name (PAPERCLIP_BENCH_DB) lets two people on one machine bench at once.
DB_NAME = os.environ.get("PAPERCLIP_BENCH_DB", "paperclip_live_bench")
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


# Part 4: a tick storm under the cap, two clusters


HEARTBEAT_FUNC = "sessions_app.tasks.scheduled_heartbeat"


def storm_arm(agent_ids: list[str]) -> None:
    """Make every agent's tick due now, in one transaction: the schedulers see all or none.
    The first time the rows are created (and the agents configured to match them); then
    they are moved back to now."""
    with psycopg.connect(DB_URL.replace("postgres://", "postgresql://")) as conn:
        for agent_id in agent_ids:
            name = f"heartbeat:{agent_id}"
            moved = conn.execute(
                "UPDATE django_q_schedule SET next_run = now() - interval '1 second' WHERE name = %s", (name,)
            ).rowcount
            if not moved:
                conn.execute(
                    "INSERT INTO django_q_schedule (name, func, args, schedule_type, minutes, repeats, next_run) "
                    "VALUES (%s, %s, %s, 'I', 1440, -1, now() - interval '1 second')",
                    (name, HEARTBEAT_FUNC, repr((agent_id,))),
                )
                conn.execute(
                    "UPDATE agents SET adapter_config = adapter_config || '{\"heartbeat_interval_minutes\": 1440}' "
                    "WHERE id = %s",
                    (agent_id,),
                )


def storm_ticks_taken(agent_ids: list[str]) -> int:
    """How many of the agents' schedule rows the schedulers have fired (moved a day on)."""
    [(taken,)] = sql(
        "SELECT count(*) FROM django_q_schedule WHERE name = ANY(%s) AND next_run > now() + interval '1 hour'",
        ([f"heartbeat:{agent_id}" for agent_id in agent_ids],),
    )
    return taken


def storm_poll(stop_at: float, samples: list[int]) -> None:
    """Count the runs in progress every ~10 ms until `stop_at` (monotonic)."""
    with psycopg.connect(DB_URL.replace("postgres://", "postgresql://"), autocommit=True) as conn:
        while time.monotonic() < stop_at:
            samples.append(conn.execute("SELECT count(*) FROM heartbeat_runs WHERE status = 'running'").fetchone()[0])
            time.sleep(0.01)


def most_overlapping(intervals: list[tuple]) -> int:
    """The most [start, finish) intervals that hold one instant."""
    events = sorted([(start, 1) for start, _ in intervals] + [(finish, -1) for _, finish in intervals])
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


def storm(args) -> None:
    import threading

    fake, fake_url = fake_start(args.storm_latency_ms)
    server = LiveServer(
        database_url=DB_URL,
        secret_key=secrets.token_urlsafe(50),
        home=Path(tempfile.mkdtemp(prefix="pc-live-bench-")),
        anthropic_base_url=fake_url,
        web_workers=2,
        web_threads=4,
        clusters=2,
        q_workers=args.storm_q_workers,
        extra_env={"PAPERCLIP_MAX_CONCURRENT_RUNS": str(args.storm_cap)},
    )
    samples: list[int] = []
    try:
        server.start()
        company, agents = seed(server, agents=args.storm_agents, name="Storm")
        poller = threading.Thread(target=storm_poll, args=(time.monotonic() + 600, samples), daemon=True)
        poller.start()
        started = time.monotonic()
        for wave in (1, 2):
            storm_arm(agents)
            deadline = time.monotonic() + 120
            while storm_ticks_taken(agents) < len(agents):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"wave {wave}: the schedulers fired {storm_ticks_taken(agents)} ticks in 120 s")
                time.sleep(0.2)
            print(f"  wave {wave}: {len(agents)} ticks fired by the schedulers after {time.monotonic() - started:.1f}s")
        deadline = time.monotonic() + 900
        while True:
            [(tasks, unfinished)] = sql(
                "SELECT (SELECT count(*) FROM django_q_task WHERE func = %s), "
                "(SELECT count(*) FROM heartbeat_runs WHERE status IN ('queued', 'running'))",
                (HEARTBEAT_FUNC,),
            )
            if tasks >= 2 * len(agents) and not unfinished:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"storm: {tasks} ticks executed, {unfinished} runs unfinished after 900 s")
            time.sleep(0.5)
        wall = time.monotonic() - started
    finally:
        server.stop()
        fake_stop(fake)
    runs = sql(
        "SELECT agent_id::text, status, merged_ticks, started_at, finished_at FROM heartbeat_runs "
        "WHERE trigger = 'schedule' AND agent_id = ANY(%s::uuid[])",
        (agents,),
    )
    # django-q2 names each task a schedule fires by the schedule (its group).
    ticks = sql('SELECT "group", success, result FROM django_q_task WHERE func = %s', (HEARTBEAT_FUNC,))
    executed = defaultdict(int)
    for group, _success, _result in ticks:
        executed[group.removeprefix("heartbeat:")] += 1
    served = defaultdict(int)
    for agent_id, _status, merged, _start, _finish in runs:
        served[agent_id] += 1 + merged
    statuses = defaultdict(int)
    for row in runs:
        statuses[row[1]] += 1
    mismatched = [agent for agent in agents if executed[agent] != 2 or served[agent] != 2]
    merged_total = sum(row[2] for row in runs)
    overlap = most_overlapping([(row[3], row[4]) for row in runs if row[3] and row[4]])
    print(
        f"storm: {len(agents)} scheduled agents x 2 waves, 2 qcluster x {args.storm_q_workers} workers "
        f"(database broker, PostgreSQL), PAPERCLIP_MAX_CONCURRENT_RUNS={args.storm_cap}, "
        f"fake latency {args.storm_latency_ms} ms, {wall:.1f}s"
    )
    print(
        f"  ticks executed {sum(executed.values())} (tasks failed {sum(1 for t in ticks if not t[1])}); "
        f"runs {len(runs)} ({dict(statuses)}) + merged ticks {merged_total} = {len(runs) + merged_total}"
    )
    print(
        f"  agents whose 2 ticks were not exactly 2 runs-or-merges: {len(mismatched)} (goal 0: no tick lost or doubled)"
    )
    print(
        f"  most runs running at once: {max(samples, default=0)} polled every ~10 ms "
        f"({len(samples)} samples), {overlap} from the runs' start/finish times (goal <= {args.storm_cap})"
    )


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
    parser.add_argument("--storm-agents", type=int, default=50)
    parser.add_argument("--storm-cap", type=int, default=8)
    parser.add_argument("--storm-q-workers", type=int, default=6, help="workers per qcluster (storm part)")
    parser.add_argument("--storm-latency-ms", type=int, default=8000)
    parser.add_argument("--skip-storm", action="store_true")
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
    if not args.skip_storm:
        storm(args)


if __name__ == "__main__":
    main()
