"""The commands the documentation gives, run verbatim: the README's quickstart against
`scripts/run`, and the several-hosts recipe of docs/deployment.md, each on a fresh
PAPERCLIP_HOME with SQLite (whatever database the suite runs on) and the fake Messages API.

A block is the fenced shell block after the HTML comment naming this file; it is run by bash
with `-e -o pipefail`, so the first command that fails fails the test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import FAKE_API_KEY
from tests.fake_anthropic import FakeAnthropic
from tests.live.server import ROOT, call, free_port, wait_until

# First starts migrate a fresh SQLite database: allow for a loaded machine.
START_TIMEOUT = 300


def documented_block(path: Path) -> str:
    """The shell block the page marks as run by this file."""
    text = path.read_text()
    match = re.search(r"<!-- tests/live/test_\w+\.py runs this block[^>]*-->\s*```sh\n(.*?)```", text, re.S)
    assert match, f"{path.name} has no block marked for tests/live/"
    return match.group(1)


def environment(home: Path, port: int, fake: FakeAnthropic) -> dict:
    """A fresh deployment's environment: the defaults, but for the home, the port and the API."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DATABASE_URL", "REDIS_URL", "PAPERCLIP_", "DJANGO_", "ANTHROPIC_"))
    }
    env.update(
        {
            "PAPERCLIP_HOME": str(home),
            "PAPERCLIP_PORT": str(port),
            "ANTHROPIC_BASE_URL": fake.base_url,
            "ANTHROPIC_API_KEY": FAKE_API_KEY,
        }
    )
    return env


def healthy(port: int) -> bool:
    try:
        return call("GET", f"http://127.0.0.1:{port}/api/health", timeout=5)[0] == 200
    except OSError:
        return False


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> int:
    """Ctrl-C (to the whole group, as a terminal sends it); what is left is killed."""
    try:
        os.killpg(proc.pid, sig)
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        return -1
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


@pytest.fixture
def fake():
    fake = FakeAnthropic().start()
    yield fake
    fake.stop()


def test_the_readme_quickstart_runs_as_pasted(tmp_path, fake):
    port = free_port()
    env = environment(tmp_path / "home", port, fake)
    log = (tmp_path / "run.log").open("w")
    server = subprocess.Popen(
        ["scripts/run"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_until(lambda: healthy(port) or server.poll() is not None, START_TIMEOUT, "scripts/run to be healthy")
        assert server.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
        # The user's second terminal: their own environment, with the port the server has.
        shell_env = {key: value for key, value in os.environ.items() if not key.startswith("PAPERCLIP_")}
        shell_env["PAPERCLIP_PORT"] = str(port)
        result = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", documented_block(ROOT / "README.md")],
            cwd=tmp_path,
            env=shell_env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        server_log = (tmp_path / "run.log").read_text()[-3000:]
        assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:], server_log)
        lines = result.stdout.splitlines()
        documents = [json.loads(line) for line in lines if line.startswith("{")]

        # Three heartbeats reached the model; the second persistent one carried the first turn.
        requests = fake.message_requests
        assert len(requests) == 3
        assert [len(body["messages"]) for body in requests] == [1, 1, 3]
        assert "the launch is on Friday" in json.dumps(requests[2]["messages"][0])
        # The session as the API showed it: its four messages; then its deletion.
        session = next(document for document in documents if "history" in document)
        assert session["id"].startswith("sess_") and len(session["history"]) == 4
        assert "204" in lines
        # The costs of the day: the three calls' tokens.
        costs = documents[-1]
        assert costs["totals"]["input_tokens"] > 0 and len(costs["daily"]) == 1, costs
        assert stop(server) == 0, (tmp_path / "run.log").read_text()[-3000:]  # Ctrl-C stops it cleanly
    finally:
        if server.poll() is None:
            stop(server)


def test_the_deployment_recipe_serves_the_admin_and_the_api(tmp_path, fake):
    """The several-hosts recipe on one host: after it, the admin's login page is styled and
    answers 200 (without collectstatic it was a 500), and a heartbeat is run by the cluster."""
    port = free_port()
    env = environment(tmp_path / "home", port, fake)
    (tmp_path / "home").mkdir()
    log = (tmp_path / "recipe.log").open("w")
    recipe = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", documented_block(ROOT / "docs" / "deployment.md")],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(port) or recipe.poll() is not None, START_TIMEOUT, "the recipe's server")
        assert recipe.poll() is None, (tmp_path / "recipe.log").read_text()[-3000:]
        status, _ = call("GET", f"{base}/admin/login/")
        assert status == 200
        page = subprocess.run(["curl", "-s", f"{base}/admin/login/"], capture_output=True, text=True).stdout
        stylesheet = re.search(r'href="(/static/admin/css/base[^"]*\.css)"', page).group(1)
        assert subprocess.run(["curl", "-sf", "-o", "/dev/null", f"{base}{stylesheet}"]).returncode == 0

        status, company = call("POST", f"{base}/api/companies", {"name": "Recipe"})
        assert status == 201
        status, agent = call(
            "POST", f"{base}/api/companies/{company['id']}/agents", {"name": "a", "adapter_config": {}}
        )
        status, run = call(
            "POST", f"{base}/api/companies/{company['id']}/agents/{agent['id']}/heartbeat", {"task": "hi"}
        )
        assert status == 202
        run_url = f"{base}/api/companies/{company['id']}/agents/{agent['id']}/runs/{run['id']}"
        wait_until(lambda: call("GET", run_url)[1]["status"] == "succeeded", 60, "the cluster to run it")
    finally:
        # Not a clean stop (each process has its own in production): the whole group at once.
        stop(recipe, signal.SIGKILL)
