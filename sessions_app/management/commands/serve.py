"""Prepare, then run the web server (gunicorn) and the task cluster (qcluster) under one parent.

1. Reach the database: an unreachable one is one line (`paperclip: configuration error: ...`),
   not a traceback.
2. Check the configuration (Django's system checks, errors only).
3. Migrate, create the cache table, collect static files: each only when there is something
   to do (a migration not applied, no cache table, static files changed since the last
   collection), with one line saying so. A restart of a migrated checkout does none of them.
4. Import the URL configuration (the views and what they use) once, here.
5. Fork the web server and the task cluster from this process: they start with all of it
   imported, instead of importing it again each (bench/RESULTS.md, "Restart").

Each child is the leader of its own session, so Ctrl-C reaches only this parent, which asks
both to stop (SIGTERM), waits, and kills what is left. When either child dies, the other is
stopped too: a web server without its cluster would queue heartbeats that never run.
"""

from __future__ import annotations

import hashlib
import ipaddress
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

from django.conf import settings
from django.core import checks
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connection, connections

STOP_GRACE_SECONDS = 30
# Beside the collected files: the fingerprint of the sources they were collected from.
STATIC_STAMP = ".paperclip-static-sources"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def database_label() -> str:
    """Where the database is, for a message: never its password."""
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        return f"the SQLite file {db['NAME']}"
    host = db.get("HOST") or "localhost"
    port = f":{db['PORT']}" if db.get("PORT") else ""
    return f"PostgreSQL database {db['NAME']!r} at {host}{port}"


def static_sources_fingerprint() -> str:
    """What collectstatic would collect: every source file's path, size and modification time."""
    from django.contrib.staticfiles.finders import get_finders

    digest = hashlib.sha256()
    entries = []
    for finder in get_finders():
        for path, storage in finder.list([]):
            stat = os.stat(storage.path(path))
            entries.append(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}")
    for entry in sorted(entries):
        digest.update(entry.encode("utf-8", "surrogateescape") + b"\n")
    return digest.hexdigest()


class Command(BaseCommand):
    help = (
        "Migrate and collect static files when needed, then serve the API and admin with gunicorn "
        "and run the django-q2 cluster beside it."
    )
    # The checks are step 2, after the database is known to answer.
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument("--host", default=settings.PAPERCLIP_HOST)
        parser.add_argument("--port", type=int, default=settings.PAPERCLIP_PORT)
        parser.add_argument("--workers", type=int, default=settings.PAPERCLIP_WEB_WORKERS)
        # `"wait": true` heartbeats hold a thread for the whole model call; threads keep
        # the other requests of that worker flowing meanwhile.
        parser.add_argument("--threads", type=int, default=settings.PAPERCLIP_WEB_THREADS)
        parser.add_argument("--no-cluster", action="store_true", help="Serve the web only.")

    def handle(self, *args, host: str, port: int, workers: int, threads: int, no_cluster: bool, **options):
        started = time.monotonic()
        if settings.PAPERCLIP_DEPLOYMENT_MODE == "local_trusted" and not is_loopback(host):
            raise CommandError(
                f"refusing to bind {host}: local_trusted mode serves an open API and binds loopback only "
                "(set PAPERCLIP_DEPLOYMENT_MODE=authenticated to listen on other addresses)"
            )
        if not 1 <= port <= 65535:
            raise CommandError(f"port must be in 1..65535, got {port}")
        self.reach_database()
        self.check_configuration()
        self.migrate()
        self.create_cache_table()
        self.collect_static()
        self.load_views()

        web = self.gunicorn(host=host, port=port, workers=max(workers, 1), threads=max(threads, 1))
        children = {"web": self.fork(web)}
        if not no_cluster:
            children["cluster"] = self.fork(self.cluster)
        url = f"http://{'localhost' if is_loopback(host) else host}:{port}"
        workers = None if no_cluster else settings.Q_CLUSTER["workers"]
        self.say(serving_line(url, cluster_workers=workers, seconds=time.monotonic() - started))
        self.supervise(children)

    # 1-4. Preparation, each step only when needed.

    def say(self, line: str) -> None:
        self.stdout.write(f"paperclip: {line}")
        self.stdout.flush()

    def reach_database(self) -> None:
        try:
            connection.ensure_connection()
        except DatabaseError as exc:
            # A configuration mistake as the README promises it: one line, exit 2.
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
            remedy = (
                "its folder must exist and be writable by this user"
                if connection.vendor == "sqlite"
                else "start it, or set DATABASE_URL to one that answers"
            )
            sys.stderr.write(f"paperclip: configuration error: cannot reach {database_label()} ({reason}); {remedy}\n")
            sys.exit(2)

    def check_configuration(self) -> None:
        errors = [message for message in checks.run_checks() if message.is_serious() and not message.is_silenced()]
        if errors:
            raise CommandError("the configuration has errors:\n" + "\n".join(str(error) for error in errors))

    def migrate(self) -> None:
        from django.db.migrations.executor import MigrationExecutor

        executor = MigrationExecutor(connection)
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
        if plan:
            self.say(f"applying {len(plan)} database migration{'s' if len(plan) != 1 else ''}")
            call_command("migrate", interactive=False, verbosity=0)

    def create_cache_table(self) -> None:
        cache = settings.CACHES["default"]
        if (
            cache["BACKEND"].endswith("DatabaseCache")
            and cache["LOCATION"] not in connection.introspection.table_names()
        ):
            self.say("creating the cache table")
            call_command("createcachetable", verbosity=0)

    def collect_static(self) -> None:
        stamp = settings.STATIC_ROOT / STATIC_STAMP
        fingerprint = static_sources_fingerprint()
        try:
            if stamp.read_text() == fingerprint:
                return
        except OSError:
            pass
        self.say("collecting static files (the admin's styles and scripts)")
        call_command("collectstatic", interactive=False, verbosity=0)
        stamp.write_text(fingerprint)

    def load_views(self) -> None:
        from django.core.wsgi import get_wsgi_application
        from django.urls import get_resolver

        self.application = get_wsgi_application()
        get_resolver().url_patterns  # noqa: B018 - imports every view now, once for both children

    # 5. The children.

    def gunicorn(self, *, host: str, port: int, workers: int, threads: int) -> Callable[[], None]:
        from gunicorn.app.base import BaseApplication

        application = self.application
        options = {
            "bind": f"{host}:{port}",
            "workers": workers,
            "worker_class": "gthread",
            "threads": threads,
            "timeout": settings.PAPERCLIP_RUN_TIMEOUT_SECONDS + 60,
            "graceful_timeout": 20,
            "accesslog": "-",
        }

        class Web(BaseApplication):
            """gunicorn serving the application this process has already loaded."""

            def load_config(self) -> None:
                for key, value in options.items():
                    self.cfg.set(key, value)

            def load(self):
                return application

        return lambda: Web().run()

    def cluster(self) -> None:
        call_command("qcluster")
        # `qcluster` returns as soon as its processes have started; what keeps `manage.py
        # qcluster` alive is the interpreter's exit, which joins them (multiprocessing's
        # atexit). A forked child leaves by os._exit, so it joins them here. A SIGTERM is
        # handled by the cluster itself, which stops them, and these joins return.
        for process in multiprocessing.active_children():
            process.join()

    def fork(self, run: Callable[[], None]) -> int:
        """Run `run` in a child process that leads its own session; its pid."""
        sys.stdout.flush()
        sys.stderr.flush()
        # Each child opens its own database connections; none is shared across the fork.
        connections.close_all()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            os.setsid()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            run()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def supervise(self, children: dict[str, int]) -> None:
        stopping = False

        def request_stop(signum, frame):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)

        exit_code = 0
        exited: set[int] = set()
        while not stopping:
            for name, pid in children.items():
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    exited.add(pid)
                    self.stderr.write(f"{name} exited with status {os.waitstatus_to_exitcode(status)}; stopping.")
                    exit_code = 1
                    stopping = True
            time.sleep(0.2)
        self.stop(children, exited=exited)
        if exit_code:
            sys.exit(exit_code)

    def stop(self, children: dict[str, int], *, exited: set[int]) -> None:
        """SIGTERM to each child that is still running (only the leader: it stops its own
        processes), a grace period, then SIGKILL to whatever is left in each child's group,
        the group of one that exited included (its processes may have outlived it)."""
        for pid in set(children.values()) - exited:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for pid in children.values():
            while pid not in exited and time.monotonic() < deadline:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    exited.add(pid)
                else:
                    time.sleep(0.1)
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if pid not in exited:
                os.waitpid(pid, 0)
        self.stdout.write("Stopped.")


def serving_line(url: str, *, cluster_workers: int | None, seconds: float) -> str:
    """What the operator reads once everything answers (`cluster_workers`: None with `--no-cluster`)."""
    if cluster_workers is None:
        return f"serving {url}, started in {seconds:.1f} s; Ctrl-C stops it"
    return (
        f"serving {url} and the task cluster ({cluster_workers} workers), started in {seconds:.1f} s; Ctrl-C stops both"
    )
