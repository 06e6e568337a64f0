"""How long `scripts/run` takes to answer `/api/health` with 200: a first start on an empty
PAPERCLIP_HOME (install checked, migrations, cache table, static files), then restarts of
the same, now migrated, checkout. Each run is stopped with Ctrl-C (SIGINT) once healthy.

    .venv/bin/python bench/restart.py [--root CHECKOUT] [--restarts 3] [--port 3177]

`--root` measures another checkout (for a before/after, a `git archive` of an older commit
with this checkout's .venv linked into it). Uses SQLite under a temporary PAPERCLIP_HOME and
the ORM broker, as `scripts/run` does by default; only loopback is bound.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def time_to_health(root: Path, home: Path, port: int, timeout: float = 600) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "REDIS_URL", "PAPERCLIP_"))}
    env.update({"PAPERCLIP_HOME": str(home), "PAPERCLIP_PORT": str(port)})
    started = time.monotonic()
    with (home / f"run-{int(started)}.log").open("w") as log:
        proc = subprocess.Popen(
            ["scripts/run"], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while not healthy(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"scripts/run exited with {proc.returncode}; see {log.name}")
                if time.monotonic() - started > timeout:
                    raise RuntimeError(f"no health after {timeout:.0f} s")
                time.sleep(0.1)
            return time.monotonic() - started
        finally:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as in a terminal
            proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--port", type=int, default=3177)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="paperclip-restart-"))
    print(f"checkout {args.root}, PAPERCLIP_HOME {home}")
    print(f"first start: {time_to_health(args.root, home, args.port):.1f} s to health")
    for index in range(args.restarts):
        load = os.getloadavg()[0]
        print(f"restart {index + 1}: {time_to_health(args.root, home, args.port):.1f} s to health (load {load:.1f})")


if __name__ == "__main__":
    main()
