"""A live Paperclip server as production runs it: gunicorn (several gthread workers) and
one or more `manage.py qcluster` processes, each in its own process group, on one database.

Shared by the live tests (`tests/live/`) and the load benchmark (`bench/load.py`). Only
loopback is ever bound or called.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
HOST = "127.0.0.1"


def database_url() -> str:
    """The URL of the database this test process uses (the test database), for servers."""
    from django.db import connection

    db = connection.settings_dict
    return f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def wait_until(predicate, timeout: float, what: str, *, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def free_port() -> int:
    """A port no process is bound to, chosen by the kernel: CI runs the SQLite and the
    PostgreSQL suites side by side, and a scan from a fixed start gave both the same port
    (one suite's shell then talked to the other's server)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def call(
    method: str, url: str, body: object = None, *, timeout: float = 60, headers: dict | None = None
) -> tuple[int, object]:
    """One HTTP request with urllib; returns (status, parsed JSON or None). Never raises on
    an HTTP error status; connection errors are raised."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    for key, value in (headers or {}).items():
        request.add_header(key, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        status = exc.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, {"unparsed": raw[:500].decode(errors="replace")}


@dataclass
class LiveServer:
    """gunicorn + qcluster(s) on `database_url`. Use as a context manager, or start()/stop()."""

    database_url: str
    secret_key: str
    home: Path
    anthropic_base_url: str
    web_workers: int = 3
    web_threads: int = 4
    clusters: int = 1
    q_workers: int = 2
    redis_url: str = ""
    extra_env: dict = field(default_factory=dict)
    # PAPERCLIP_CLUSTER_NAME of each qcluster, by index (a host's own cluster beside the
    # deployment's); a cluster without one takes the environment's, as the web does.
    cluster_names: list[str] = field(default_factory=list)
    port: int = 0
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def env(self) -> dict:
        env = {
            **os.environ,
            "DATABASE_URL": self.database_url,
            # Queued tasks are signed: web, clusters and the caller share one key.
            "DJANGO_SECRET_KEY": self.secret_key,
            "PAPERCLIP_HOME": str(self.home),
            "PAPERCLIP_DEPLOYMENT_MODE": "local_trusted",
            "PAPERCLIP_Q_WORKERS": str(self.q_workers),
            "ANTHROPIC_BASE_URL": self.anthropic_base_url,
            "ANTHROPIC_API_KEY": "sk-ant-live-test",
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        env.pop("REDIS_URL", None)
        if self.redis_url:
            env["REDIS_URL"] = self.redis_url
        return env

    def spawn(self, name: str, command: list[str], env: dict | None = None) -> subprocess.Popen:
        log = (self.home / f"{name}.log").open("w")
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**self.env(), **(env or {})},
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs[name] = proc
        return proc

    def start(self, timeout: float = 60) -> LiveServer:
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        try:
            self.spawn(
                "web",
                [
                    sys.executable,
                    "-m",
                    "gunicorn",
                    "paperclip.wsgi:application",
                    "--workers",
                    str(self.web_workers),
                    "--worker-class",
                    "gthread",
                    "--threads",
                    str(self.web_threads),
                    "--bind",
                    f"{HOST}:{self.port}",
                    "--timeout",
                    "300",
                    "--graceful-timeout",
                    "5",
                ],
            )
            for index in range(self.clusters):
                self.start_cluster(index)
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_cluster(self, index: int) -> subprocess.Popen:
        named = self.cluster_names[index] if index < len(self.cluster_names) else ""
        env = {"PAPERCLIP_CLUSTER_NAME": named} if named else None
        return self.spawn(f"cluster{index}", [sys.executable, "manage.py", "qcluster"], env)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {self.log_tail(name)}")
            try:
                status, body = call("GET", f"{self.base_url}/api/health", timeout=5)
                last = (status, body)
                if status == 200:
                    return
            except OSError as exc:
                last = exc
            time.sleep(0.2)
        raise RuntimeError(f"the server did not become healthy: {last}; {self.log_tail('web')}")

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self, grace: float = 15) -> None:
        """SIGTERM each leader (gunicorn master, qcluster parent), wait, then SIGKILL
        whatever is left in its process group.

        Only the leader is asked: a SIGTERM to the whole qcluster group reaches its worker,
        pusher and monitor processes behind the sentinel's back, and the cluster then hangs
        in its stop sequence (> 30 s; observed with django-q2 1.11) instead of stopping in ~1 s.
        """
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            # The group may outlive its leader (children of a killed parent): kill it whole.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        self.procs.clear()

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def rss_kib(pid: int) -> int | None:
    """Resident set size of a process from /proc (Linux), or None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def fire_batch(url: str, bodies: list[dict], start_at: float, timeout: float = 300) -> list[tuple[int, object]]:
    """POST every body to `url`, each from its own thread, all released together at
    `start_at` (wall clock, so that several client processes fire at once)."""
    import threading

    go = threading.Event()
    results: list = [None] * len(bodies)

    def post(index: int, body: dict) -> None:
        go.wait()
        try:
            results[index] = call("POST", url, body, timeout=timeout)
        except OSError as exc:
            results[index] = (0, {"error": {"code": "connection", "message": repr(exc)}})

    threads = [threading.Thread(target=post, args=(i, b)) for i, b in enumerate(bodies)]
    for thread in threads:
        thread.start()
    time.sleep(max(start_at - time.time(), 0))
    go.set()
    for thread in threads:
        thread.join()
    return results
