"""A worker's environment is out of reach of the commands its agents run as its user
(paperclip/process_privacy.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

SECRET = "postgres://paperclip:not-for-agents@db/paperclip"


def test_a_process_that_loads_django_is_not_dumpable():
    script = (
        "import django; django.setup();"
        "from paperclip.process_privacy import environment_hidden; print(environment_hidden())"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "paperclip.settings"}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_DUMPABLE) is Linux's")
@pytest.mark.parametrize("hidden", [False, True])
def test_another_process_of_the_same_user_reads_the_environment_only_of_a_process_that_does_not_hide_it(hidden):
    """What an agent's command does to reach the worker's secrets: `cat /proc/{pid}/environ`
    as the worker's user. Root reads any process's, so as root both run as `nobody`."""
    python, user = sys.executable, None
    if os.geteuid() == 0:
        python, user = shutil.which("python3", path="/usr/bin:/bin"), "nobody"
        if python is None:
            pytest.skip("no system python3 to run as nobody")
    with tempfile.TemporaryDirectory() as name:  # in /tmp: pytest's own are closed to other users
        folder = Path(name)
        folder.chmod(0o755)
        shutil.copy(Path(ROOT) / "paperclip" / "process_privacy.py", folder)
        command = _read_environment(folder, python=python, user=user, hidden=hidden)
    if hidden:
        assert command.returncode != 0 and "Permission denied" in command.stderr
        assert SECRET not in command.stdout
    else:
        assert SECRET in command.stdout


def _read_environment(folder: Path, *, python: str, user: str | None, hidden: bool):
    """A worker holding SECRET, hidden or not, and a command of its user reading its environment."""
    script = (
        "import sys, time; import process_privacy;"
        f"{'process_privacy.environment_hide();' if hidden else ''}"
        "print(process_privacy.environment_hidden(), flush=True); time.sleep(30)"
    )
    env = {"DATABASE_URL": SECRET, "PYTHONPATH": str(folder), "PATH": os.defpath}
    worker = subprocess.Popen([python, "-c", script], env=env, cwd=folder, stdout=subprocess.PIPE, text=True, user=user)
    try:
        assert worker.stdout.readline().strip() == str(hidden)
        command = subprocess.run(
            ["cat", f"/proc/{worker.pid}/environ"], cwd=folder, capture_output=True, text=True, user=user
        )
    finally:
        worker.kill()
        worker.wait()
    return command


def test_the_parent_of_a_gunicorn_started_from_the_checkout_hides_its_environment():
    """gunicorn's parent never loads Django: the configuration gunicorn reads from its
    working directory (the checkout, in docs/deployment.md's recipe) hides it as it starts."""
    script = (
        "import runpy; runpy.run_path('gunicorn.conf.py')['on_starting'](None);"
        "from paperclip.process_privacy import environment_hidden; print(environment_hidden())"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
