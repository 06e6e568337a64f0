"""A bad environment stops start-up with one clear line, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_check(tmp_path, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "PAPERCLIP_", "DJANGO_"))}
    environment.update({"PAPERCLIP_HOME": str(tmp_path), **env})
    return subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("env", "mentions"),
    [
        ({"DATABASE_URL": "garbage"}, "DATABASE_URL"),
        ({"DATABASE_URL": "nosuchdb://x/y"}, "DATABASE_URL"),
        ({"PAPERCLIP_PORT": "eighty"}, "PAPERCLIP_PORT"),
        ({"PAPERCLIP_DEPLOYMENT_MODE": "authenticated"}, "DJANGO_SECRET_KEY"),
        ({"PAPERCLIP_DEPLOYMENT_MODE": "open"}, "PAPERCLIP_DEPLOYMENT_MODE"),
        ({"PAPERCLIP_SESSION_STORE": "s3"}, "PAPERCLIP_SESSION_STORE"),
        ({"PAPERCLIP_HOST": "0.0.0.0"}, "PAPERCLIP_HOST"),
    ],
)
def test_bad_configuration_stops_with_one_clear_line(tmp_path, env, mentions):
    result = run_check(tmp_path, **env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("paperclip: configuration error:")
    assert mentions in lines[0]


@pytest.mark.parametrize(
    "commands",
    [
        "sh -c id",
        '["sh", "-c", "id"]',
        '{"agent": "sh -c id"}',
        '{"agent": {"argv": ["/opt/agent"], "allowed_arg_patterns": ["[a-"]}}',
        '{"agent": {"argv": ["/opt/agent"], "env": "ANTHROPIC_API_KEY"}}',
        '{"agent": {"argv": ["/opt/agent"], "cwd": "agents"}}',
    ],
)
def test_a_bad_process_command_list_stops_with_one_clear_line(tmp_path, commands):
    result = run_check(tmp_path, PAPERCLIP_PROCESS_COMMANDS=commands)
    assert result.returncode == 2
    assert result.stderr.startswith("paperclip: configuration error: PAPERCLIP_PROCESS_COMMANDS")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_process_command_list_as_an_operator_writes_it_is_accepted(tmp_path):
    commands = '{"researcher": {"argv": ["/opt/agents/researcher"], "allowed_args": ["--fast"], "env": ["TOKEN"]}}'
    result = run_check(tmp_path, PAPERCLIP_PROCESS_COMMANDS=commands)
    assert result.returncode == 0, result.stderr


def test_secret_key_is_generated_once_in_local_trusted_mode(tmp_path):
    assert run_check(tmp_path).returncode == 0
    key = (tmp_path / "secret_key").read_text()
    assert run_check(tmp_path).returncode == 0
    assert (tmp_path / "secret_key").read_text() == key
    assert oct((tmp_path / "secret_key").stat().st_mode)[-3:] == "600"


def test_deploy_checks_are_clean_with_production_settings(tmp_path):
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "PAPERCLIP_", "DJANGO_"))}
    environment.update(
        {
            "PAPERCLIP_HOME": str(tmp_path),
            "PAPERCLIP_DEPLOYMENT_MODE": "authenticated",
            "DJANGO_SECRET_KEY": "x" * 20 + "-production-secret-key-with-enough-entropy-0123456789",
            "DJANGO_ALLOWED_HOSTS": "paperclip.example.com",
        }
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout
