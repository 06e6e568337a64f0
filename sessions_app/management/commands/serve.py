"""Run the web server (gunicorn) and the task cluster (qcluster) under one parent.

Each child gets its own process group, so Ctrl-C reaches only this parent, which asks both
to stop (SIGTERM), waits, and kills what is left. When either child dies, the other is
stopped too: a web server without its cluster would queue heartbeats that never run.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

STOP_GRACE_SECONDS = 30


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Command(BaseCommand):
    help = "Serve the API and admin with gunicorn, and run the django-q2 cluster beside it."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=settings.PAPERCLIP_HOST)
        parser.add_argument("--port", type=int, default=settings.PAPERCLIP_PORT)
        parser.add_argument("--workers", type=int, default=int(os.environ.get("PAPERCLIP_WEB_WORKERS", "2")))
        # `"wait": true` heartbeats hold a thread for the whole model call; threads keep
        # the other requests of that worker flowing meanwhile.
        parser.add_argument("--threads", type=int, default=int(os.environ.get("PAPERCLIP_WEB_THREADS", "8")))
        parser.add_argument("--no-cluster", action="store_true", help="Serve the web only.")

    def handle(self, *args, host: str, port: int, workers: int, threads: int, no_cluster: bool, **options):
        if settings.PAPERCLIP_DEPLOYMENT_MODE == "local_trusted" and not is_loopback(host):
            raise CommandError(
                f"refusing to bind {host}: local_trusted mode serves an open API and binds loopback only "
                "(set PAPERCLIP_DEPLOYMENT_MODE=authenticated to listen on other addresses)"
            )
        if not 1 <= port <= 65535:
            raise CommandError(f"port must be in 1..65535, got {port}")
        web = [
            sys.executable,
            "-m",
            "gunicorn",
            "paperclip.wsgi:application",
            "--bind",
            f"{host}:{port}",
            "--workers",
            str(max(workers, 1)),
            "--worker-class",
            "gthread",
            "--threads",
            str(max(threads, 1)),
            "--timeout",
            str(settings.PAPERCLIP_RUN_TIMEOUT_SECONDS + 60),
            "--graceful-timeout",
            "20",
            "--access-logfile",
            "-",
        ]
        children = {"web": self.spawn(web)}
        if not no_cluster:
            children["cluster"] = self.spawn([sys.executable, "manage.py", "qcluster"])
        self.stdout.write(f"Paperclip Sessions on http://{'localhost' if is_loopback(host) else host}:{port}")

        stopping = False

        def request_stop(signum, frame):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)

        exit_code = 0
        while not stopping:
            for name, proc in children.items():
                if proc.poll() is not None:
                    self.stderr.write(f"{name} exited with status {proc.returncode}; stopping.")
                    exit_code = 1
                    stopping = True
            time.sleep(0.2)
        self.stop(children)
        if exit_code:
            sys.exit(exit_code)

    def spawn(self, command: list[str]) -> subprocess.Popen:
        return subprocess.Popen(command, cwd=settings.BASE_DIR, start_new_session=True)

    def stop(self, children: dict[str, subprocess.Popen]) -> None:
        for proc in children.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for proc in children.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.stdout.write("Stopped.")
