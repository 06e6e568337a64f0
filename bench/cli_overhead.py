"""Claude Code heartbeats through the engine against the bare CLI, on the same fake API.

1. Stateless: a heartbeat of a `runtime: "cli"` agent (enqueue, claim, the SDK starting
   the CLI through the launcher, commit, ledger) against `claude -p` run directly with the
   same options. Interleaved, one of each per step. Goal: engine/bare >= 0.9.
2. Resume at turn 50: a persistent agent's heartbeat (the transcript loaded from the
   store, materialised by the SDK, the new lines written in the commit) against `claude -p
   --resume` of a local session of as many turns. Goal: engine/bare >= 0.9.

    .venv/bin/python bench/cli_overhead.py            # SQLite in a temporary PAPERCLIP_HOME
    DATABASE_URL=postgres://... .venv/bin/python bench/cli_overhead.py

BENCH_STEPS (default 10) heartbeats are timed for each figure; BENCH_TURNS (50) is the turn
the resume is measured at. Each heartbeat starts a ~400 MB executable: expect minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PAPERCLIP_HOME", tempfile.mkdtemp(prefix="cli-bench-"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.utils import timezone  # noqa: E402

from sessions_app.adapters.claude_cli import DEFAULT_ALLOWED_TOOLS, bundled_cli  # noqa: E402
from sessions_app.heartbeat import heartbeat_start  # noqa: E402
from sessions_app.models import Agent, Company, RunStatus  # noqa: E402
from tests.fake_anthropic import FakeAnthropic  # noqa: E402

STEPS = int(os.environ.get("BENCH_STEPS", "10"))
TURNS = int(os.environ.get("BENCH_TURNS", "50"))
MODEL = "claude-sonnet-4-5"
SYSTEM = "You are the benchmark agent."


def engine_beat(agent: Agent, task: str) -> float:
    started = time.perf_counter()
    run, _ = heartbeat_start(agent=agent, task=task, trigger="api", now=timezone.now(), wait=True)
    elapsed = time.perf_counter() - started
    if run.status != RunStatus.SUCCEEDED:
        raise SystemExit(f"engine heartbeat failed: {run.error_code}: {run.error}")
    return elapsed


def bare_command(task: str, *, resume: str | None = None, session_id: str | None = None) -> list[str]:
    """`claude -p` with the options the engine gives the CLI."""
    tools = ",".join(DEFAULT_ALLOWED_TOOLS)
    command = [str(bundled_cli()), "-p", task, "--output-format", "json", "--model", MODEL]
    command += ["--tools", tools, "--allowedTools", tools, "--permission-mode", "dontAsk", "--max-turns", "25"]
    command += ["--max-budget-usd", "5", "--setting-sources", "", "--strict-mcp-config"]
    command += ["--append-system-prompt", SYSTEM]
    if resume:
        command.append(f"--resume={resume}")
    if session_id:
        command.append(f"--session-id={session_id}")
    return command


def bare_beat(env: dict, workspace: Path, task: str, **kwargs) -> tuple[float, dict]:
    started = time.perf_counter()
    done = subprocess.run(bare_command(task, **kwargs), env=env, cwd=workspace, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"bare CLI failed: {done.stderr[-2000:]}")
    return elapsed, json.loads(done.stdout)


def bare_environment(fake: FakeAnthropic, home: Path) -> dict:
    (home / "config").mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / "config"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "LANG": "C.UTF-8",
        "ANTHROPIC_BASE_URL": fake.base_url,
        "ANTHROPIC_API_KEY": "sk-bench",
    }


def report(name: str, engine: list[float], bare: list[float]) -> None:
    engine_mean, bare_mean = sum(engine) / len(engine), sum(bare) / len(bare)
    print(
        f"{name}: engine {engine_mean * 1000:.0f} ms/heartbeat, bare CLI {bare_mean * 1000:.0f} ms, "
        f"ratio (throughput engine/bare) {bare_mean / engine_mean:.2f}, over {len(engine)} of each",
        flush=True,
    )


def main() -> None:
    call_command("migrate", verbosity=0)
    fake = FakeAnthropic().start()
    os.environ["ANTHROPIC_BASE_URL"] = fake.base_url
    os.environ["ANTHROPIC_API_KEY"] = "sk-bench"
    company = Company.objects.create(name="Bench")
    config = {"runtime": "cli", "model": MODEL, "timeout_seconds": 120}
    stateless = Agent.objects.create(company=company, name="stateless", system_prompt=SYSTEM, adapter_config=config)
    home = Path(os.environ["PAPERCLIP_HOME"]) / "bare"
    workspace = home / "workspace"
    workspace.mkdir(parents=True)
    env = bare_environment(fake, home)
    print(f"database={django.db.connection.vendor} steps={STEPS} turns={TURNS} cli={bundled_cli()}", flush=True)

    engine_beat(stateless, "warm up")  # the first start of the executable reads it from disk
    bare_beat(env, workspace, "warm up")
    engine, bare = [], []
    for step in range(STEPS):
        engine.append(engine_beat(stateless, f"task {step}"))
        bare.append(bare_beat(env, workspace, f"task {step}")[0])
    report("stateless, turn 1", engine, bare)

    persistent = Agent.objects.create(
        company=company,
        name="persistent",
        system_prompt=SYSTEM,
        adapter_config={**config, "session_mode": "persistent", "session_ttl_hours": 48},
    )
    _, first = bare_beat(env, workspace, "turn 1")
    session_id = first["session_id"]
    engine_beat(persistent, "turn 1")
    for turn in range(2, TURNS):
        engine_beat(persistent, f"turn {turn}")
        bare_beat(env, workspace, f"turn {turn}", resume=session_id)
    engine, bare = [], []
    for step in range(STEPS):
        engine.append(engine_beat(persistent, f"turn {TURNS + step}"))
        bare.append(bare_beat(env, workspace, f"turn {TURNS + step}", resume=session_id)[0])
    report(f"persistent, resumed at turn {TURNS}+ (store-backed vs local --resume)", engine, bare)
    fake.stop()


if __name__ == "__main__":
    main()
