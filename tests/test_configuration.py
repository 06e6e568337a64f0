"""A bad environment stops start-up with one clear line, not a traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def clean_environment(**env) -> dict:
    """This process's environment without any setting of ours, then `env`."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "PAPERCLIP_", "DJANGO_"))}
    return {**environment, **env}


def manage(*args, environment: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60
    )


def shell_said(script: str, environment: dict) -> str:
    """The last line `script` printed in `manage.py shell` (Django's shell may first say
    what it imported)."""
    result = manage("shell", "-c", script, environment=environment)
    assert result.stdout.strip(), (result.stdout, result.stderr)
    return result.stdout.strip().splitlines()[-1]


def run_check(tmp_path, **env):
    return manage("check", environment=clean_environment(PAPERCLIP_HOME=str(tmp_path), **env))


@pytest.mark.parametrize(
    ("env", "mentions"),
    [
        ({"DATABASE_URL": "garbage"}, "DATABASE_URL"),
        ({"DATABASE_URL": "nosuchdb://x/y"}, "DATABASE_URL"),
        ({"PAPERCLIP_PORT": "eighty"}, "PAPERCLIP_PORT"),
        ({"PAPERCLIP_DEPLOYMENT_MODE": "authenticated"}, "DJANGO_SECRET_KEY"),
        ({"PAPERCLIP_DEPLOYMENT_MODE": "open"}, "PAPERCLIP_DEPLOYMENT_MODE"),
        ({"PAPERCLIP_SESSION_STORE": "s3"}, "PAPERCLIP_SESSION_STORE"),
        ({"PAPERCLIP_HISTORY_CACHE_SESSIONS": "-1"}, "PAPERCLIP_HISTORY_CACHE_SESSIONS"),
        ({"PAPERCLIP_HOST": "0.0.0.0"}, "PAPERCLIP_HOST"),
        ({"PAPERCLIP_PUBLIC_URL": "paperclip.example.com"}, "PAPERCLIP_PUBLIC_URL"),
        ({"PAPERCLIP_TRUST_X_FORWARDED_PROTO": "maybe"}, "PAPERCLIP_TRUST_X_FORWARDED_PROTO"),
        ({"PAPERCLIP_ALERT_HOSTS": "hooks.example:99999"}, "PAPERCLIP_ALERT_HOSTS"),
        ({"PAPERCLIP_WORK_CHECK_HOSTS": "tracker.example,api:http"}, "PAPERCLIP_WORK_CHECK_HOSTS"),
        ({"PAPERCLIP_WORK_CHECK_HOSTS": "https://tracker.example"}, "PAPERCLIP_WORK_CHECK_HOSTS"),
        ({"PAPERCLIP_CLUSTER_NAME": "two words"}, "PAPERCLIP_CLUSTER_NAME"),
        ({"PAPERCLIP_DEPLOYMENT_CLUSTER_NAME": "-dash"}, "PAPERCLIP_DEPLOYMENT_CLUSTER_NAME"),
        ({"PAPERCLIP_WEB_WORKERS": "many"}, "PAPERCLIP_WEB_WORKERS"),
        ({"PAPERCLIP_PG_PREPARED_STATEMENTS": "sometimes"}, "PAPERCLIP_PG_PREPARED_STATEMENTS"),
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
    "url",
    [
        "postgres://paperclip:hunter2-pw@db.internal:5432/",  # no database name
        "postgres://paperclip:hunter2-pw@db.internal/",
    ],
)
def test_a_database_url_refused_at_start_up_is_said_without_its_password(tmp_path, url):
    """The line goes to the console, so to whatever collects the service's logs."""
    result = run_check(tmp_path, DATABASE_URL=url)
    assert result.returncode == 2
    assert result.stderr.startswith("paperclip: configuration error: DATABASE_URL"), result.stderr
    assert "hunter2-pw" not in result.stderr
    assert "db.internal" in result.stderr  # still says which URL it is


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
    result = deploy_check(tmp_path, host="paperclip.example.com", public_url="https://paperclip.example.com")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def deploy_check(home, *, host: str, public_url: str) -> subprocess.CompletedProcess:
    """`check --deploy` of an authenticated deployment served at `public_url`."""
    environment = clean_environment(
        PAPERCLIP_HOME=str(home),
        PAPERCLIP_DEPLOYMENT_MODE="authenticated",
        DJANGO_SECRET_KEY="x" * 20 + "-production-secret-key-with-enough-entropy-0123456789",
        DJANGO_ALLOWED_HOSTS=host,
        PAPERCLIP_PUBLIC_URL=public_url,
    )
    return manage("check", "--deploy", "--fail-level", "WARNING", environment=environment)


def test_deploy_checks_say_once_that_plain_http_has_no_https_protections(tmp_path):
    result = deploy_check(tmp_path, host="10.0.0.5", public_url="http://10.0.0.5:3100")
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "paperclip.W003" in output and "no HTTPS redirect" in output
    assert "security.W0" not in output, output


TRANSPORT_PROBE = """
import django, json, os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
django.setup()
from django.test import Client
answers = {}
for name, secure, headers in (("http", False, {}), ("https", True, {}), ("forwarded", False, {"X-Forwarded-Proto": "https"})):
    client = Client(HTTP_HOST="localhost", headers=headers)
    company = client.get("/api/companies/00000000-0000-0000-0000-000000000001", secure=secure)
    schema = client.get("/api/schema/", secure=secure)
    answers[name] = {
        "company": company.status_code,
        "schema": schema.status_code,
        "location": company.get("Location"),
        "hsts": schema.get("Strict-Transport-Security"),
    }
print(json.dumps(answers))
"""


def transport(tmp_path, **env):
    """How the real settings answer plain HTTP, HTTPS, and HTTP claiming to be forwarded HTTPS."""
    import json

    environment = clean_environment(
        PAPERCLIP_HOME=str(tmp_path),
        PAPERCLIP_DEPLOYMENT_MODE="authenticated",
        DJANGO_SECRET_KEY="a-test-secret-key-that-is-long-enough-0123456789-abcdefghij",
        **env,
    )
    result = subprocess.run(
        [sys.executable, "-c", TRANSPORT_PROBE],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_authenticated_mode_over_plain_http_answers_401_and_200_not_a_redirect(tmp_path):
    answers = transport(tmp_path)
    assert answers["http"] == {"company": 401, "schema": 200, "location": None, "hsts": None}
    # Without an https:// public URL nothing claims HTTPS: no HSTS, and the proxy header is not trusted.
    assert answers["https"]["hsts"] is None
    assert answers["forwarded"] == answers["http"]


def test_an_https_public_url_turns_on_the_redirect_and_a_plain_hsts(tmp_path):
    answers = transport(tmp_path, PAPERCLIP_PUBLIC_URL="https://paperclip.example.com")
    assert answers["http"]["company"] == 301
    assert answers["http"]["location"] == "https://localhost/api/companies/00000000-0000-0000-0000-000000000001"
    assert answers["https"] == {"company": 401, "schema": 200, "location": None, "hsts": "max-age=31536000"}
    # X-Forwarded-Proto comes from anyone until the operator says a proxy sets it.
    assert answers["forwarded"]["company"] == 301


def test_a_trusted_proxy_header_marks_forwarded_requests_secure(tmp_path):
    answers = transport(
        tmp_path,
        PAPERCLIP_PUBLIC_URL="https://paperclip.example.com",
        PAPERCLIP_TRUST_X_FORWARDED_PROTO="true",
        DJANGO_HSTS_INCLUDE_SUBDOMAINS="true",
        DJANGO_HSTS_PRELOAD="true",
    )
    assert answers["forwarded"] == {
        "company": 401,
        "schema": 200,
        "location": None,
        "hsts": "max-age=31536000; includeSubDomains; preload",
    }


@pytest.mark.parametrize(
    ("database_url", "mentions"),
    [
        ("postgres://postgres:not-shown-pw@127.0.0.1:1/paperclip", "PostgreSQL database 'paperclip' at 127.0.0.1:1"),
        ("sqlite:////nonexistent-folder/paperclip.sqlite3", "the SQLite file /nonexistent-folder/paperclip.sqlite3"),
    ],
)
def test_the_run_command_without_its_database_stops_with_one_clear_line(tmp_path, database_url, mentions):
    environment = clean_environment(PAPERCLIP_HOME=str(tmp_path), DATABASE_URL=database_url, PAPERCLIP_PORT="3499")
    result = subprocess.run(["scripts/run"], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("paperclip: configuration error: cannot reach"), lines[0]
    assert mentions in lines[0] and "not-shown-pw" not in lines[0]


# A variable the code reads: env_int("NAME", ...), env_str("NAME", ...), os.environ.get("NAME"), ...
READ = re.compile(r"""(?:\benv_\w+\(|os\.environ\.get\(|os\.environ\[|os\.getenv\()\s*["']([A-Z][A-Z0-9_]+)["']""")
# A row of the reference: the first cell names one variable or several, each in backticks.
DOCUMENTED = re.compile(r"^\| ((?:`[A-Z][A-Z0-9_]+`(?:, )?)+) \|", re.M)
# Read by the libraries themselves (the anthropic SDK), documented all the same.
READ_BY_LIBRARIES = {"ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"}


def test_every_setting_the_code_reads_is_in_the_configuration_reference():
    read = set()
    for module in ("paperclip/settings.py", "paperclip/env.py", "paperclip/telemetry.py"):
        read |= set(READ.findall((ROOT / module).read_text()))
    reference = (ROOT / "docs" / "configuration.md").read_text()
    documented = {name for row in DOCUMENTED.findall(reference) for name in re.findall(r"`([A-Z0-9_]+)`", row)}
    assert read, "the pattern found no variable: is it still how settings read the environment?"
    assert sorted(read - documented) == [], "read but not in docs/configuration.md"
    assert sorted(documented - read - READ_BY_LIBRARIES) == [], "documented but never read"


def test_the_task_queue_is_named_by_the_setting_so_two_deployments_can_share_a_redis(tmp_path):
    environment = clean_environment(PAPERCLIP_HOME=str(tmp_path), PAPERCLIP_CLUSTER_NAME="staging")
    script = "from django_q.conf import Conf; print(Conf.PREFIX, Conf.CLUSTER_NAME)"
    assert shell_said(script, environment).split() == ["staging", "staging"]


SIGNED = (
    "from django_q.signing import SignedPackage; print(SignedPackage.dumps({'func': 'sessions_app.tasks.execute_run'}))"
)
READ_SIGNED = (
    "from django_q.conf import Conf; from django_q.signing import SignedPackage; "
    "print(Conf.PREFIX, Conf.CLUSTER_NAME, SignedPackage.loads({task!r})['func'])"
)


def test_a_hosts_own_cluster_reads_the_tasks_the_deployment_sends_it(tmp_path):
    # django-q2 signs a task with the name its cluster is configured under. Before, that was
    # PAPERCLIP_CLUSTER_NAME, so a pinned host's cluster (another name) could read no task
    # the deployment sent it: each was dropped as a bad signature and its run stayed queued.
    shared = {"PAPERCLIP_HOME": str(tmp_path), "DJANGO_SECRET_KEY": "one-key-for-the-deployment"}
    task = shell_said(SIGNED, clean_environment(**shared, PAPERCLIP_CLUSTER_NAME="staging"))
    pinned_host = clean_environment(
        **shared, PAPERCLIP_CLUSTER_NAME="worker-b", PAPERCLIP_DEPLOYMENT_CLUSTER_NAME="staging"
    )
    assert shell_said(READ_SIGNED.format(task=task), pinned_host).split() == [
        "staging",
        "worker-b",
        "sessions_app.tasks.execute_run",
    ]


# A statement run six times on one connection, then what that connection has prepared.
PREPARED_COUNT = (
    "from django.db import connection\n"
    "with connection.cursor() as cursor:\n"
    "    for i in range(6):\n"
    "        cursor.execute('SELECT %s + 1', [i])\n"
    "    cursor.execute('SELECT count(*) FROM pg_prepared_statements')\n"
    "    print('prepared', cursor.fetchone()[0])"
)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("asked", "prepared"), [("", 0), ("false", 0), ("true", 1)])
def test_prepared_statements_only_when_asked_for(postgres_only, settings, asked, prepared):
    from tests.conftest import database_environment

    environment = clean_environment(**database_environment(settings), PAPERCLIP_PG_PREPARED_STATEMENTS=asked)
    assert shell_said(PREPARED_COUNT, environment) == f"prepared {prepared}"


SANDBOX_PROBE = """
import django, os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
django.setup()
from django.conf import settings
print(settings.PAPERCLIP_CLI_SANDBOX)
"""


@pytest.mark.parametrize(
    ("mode", "set_to", "sandbox"),
    [("local_trusted", None, "auto"), ("authenticated", None, "bwrap"), ("authenticated", "auto", "auto")],
)
def test_claude_code_never_runs_unsandboxed_in_authenticated_mode_unless_the_operator_says_so(
    tmp_path, mode, set_to, sandbox
):
    environment = clean_environment(
        PAPERCLIP_HOME=str(tmp_path),
        PAPERCLIP_DEPLOYMENT_MODE=mode,
        DJANGO_SECRET_KEY="a-test-secret-key-that-is-long-enough-0123456789-abcdefghij",
        **({"PAPERCLIP_CLI_SANDBOX": set_to} if set_to else {}),
    )
    result = subprocess.run(
        [sys.executable, "-c", SANDBOX_PROBE], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == sandbox
