"""The `process` adapter: commands come from the operator's allow-list, are re-checked when
they run, and get only the environment they need."""

from __future__ import annotations

import json
import os
import sys

import pytest

from costs_app.models import CostEvent
from paperclip.env import parse_process_commands
from sessions_app.adapters import AgentConfigError, validate_agent_config
from sessions_app.models import Agent, AgentSession, RunStatus
from tests.conftest import beat, listed_commands, process_agent, reporter_script, wait_until_gone

SECRETS = {
    "DJANGO_SECRET_KEY": "django-secret",
    "DATABASE_URL": "postgres://user:password@db/paperclip",
    "REDIS_URL": "redis://:password@cache:6379/0",
    "ANTHROPIC_API_KEY": "sk-ant-secret",
}


def seen(run) -> dict:
    assert run.status == RunStatus.SUCCEEDED, (run.error_code, run.error)
    return json.loads(run.output)


def raw_argv_agent(company, tmp_path) -> tuple[Agent, object]:
    """A process agent saved with a raw argv in local_trusted mode; running it creates `marker`."""
    marker = tmp_path / "ran"
    script = tmp_path / "touch.py"
    script.write_text(
        f'import pathlib, sys\npathlib.Path({str(marker)!r}).touch()\nsys.stdin.read()\nprint(\'{{"text": "ran"}}\')\n'
    )
    agent = Agent.objects.create(
        company=company, name="raw", adapter_type="process", adapter_config={"command": [sys.executable, str(script)]}
    )
    return agent, marker


def test_a_raw_command_saved_before_authenticated_mode_does_not_run(company, tmp_path, settings):
    agent, marker = raw_argv_agent(company, tmp_path)
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"

    run = beat(agent)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "process_command_not_allowed")
    assert "adapter_config.command" in run.error
    assert not marker.exists()
    assert not CostEvent.objects.filter(agent_id=agent.id).exists()


def test_a_command_written_by_raw_sql_is_checked_when_it_runs(company, commands, settings, tmp_path):
    _, marker = raw_argv_agent(company, tmp_path)
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    agent = Agent.objects.create(
        company=company, name="listed", adapter_type="process", adapter_config={"command": "reporter"}
    )
    touch = [sys.executable, str(tmp_path / "touch.py")]
    # Each row bypasses validation as raw SQL would.
    for config, field in [
        ({"command": touch}, "command"),
        ({"command": "reporter", "args": ["--topic=Evil; rm -rf /"]}, "args"),
        ({"command": "reporter", "cwd": "/"}, "cwd"),
        ({"command": "nobody-listed-this"}, "command"),
        ({"command": 42}, "command"),
    ]:
        Agent.objects.filter(id=agent.id).update(adapter_config=config)
        run = beat(agent)
        assert (run.status, run.error_code) == (RunStatus.FAILED, "process_command_not_allowed"), config
        assert f"adapter_config.{field}" in run.error
    assert not marker.exists()


def test_a_command_removed_from_the_list_no_longer_runs(company, commands, settings):
    agent = Agent.objects.create(
        company=company, name="listed", adapter_type="process", adapter_config={"command": "reporter"}
    )
    assert beat(agent).status == RunStatus.SUCCEEDED
    settings.PAPERCLIP_PROCESS_COMMANDS = {}

    run = beat(agent)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "process_command_not_allowed")
    assert "reporter" in run.error and "PAPERCLIP_PROCESS_COMMANDS" in run.error


def test_a_listed_command_runs_its_entry_with_the_allowed_args_in_its_cwd(company, commands, settings, tmp_path):
    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    agent = Agent.objects.create(
        company=company,
        name="listed",
        adapter_type="process",
        adapter_config={"command": "reporter", "args": ["--topic=cats", "--verbose"]},
    )

    started = seen(beat(agent))

    assert started["args"] == ["--topic=cats", "--verbose"]
    assert started["cwd"] == str(tmp_path)


def test_the_command_gets_only_the_base_environment_and_what_its_entry_names(company, settings, tmp_path, monkeypatch):
    for name, value in {**SECRETS, "RESEARCH_TOKEN": "t", "UNRELATED": "u"}.items():
        monkeypatch.setenv(name, value)
    settings.PAPERCLIP_PROCESS_COMMANDS = listed_commands(
        tmp_path, researcher={"argv": [sys.executable, reporter_script(tmp_path)], "env": ["RESEARCH_TOKEN"]}
    )
    listed = Agent.objects.create(
        company=company, name="listed", adapter_type="process", adapter_config={"command": "researcher"}
    )
    raw = Agent.objects.create(
        company=company,
        name="raw",
        adapter_type="process",
        adapter_config={"command": [sys.executable, reporter_script(tmp_path)]},
    )

    listed_env = set(seen(beat(listed))["env"])
    raw_env = set(seen(beat(raw))["env"])

    assert "RESEARCH_TOKEN" in listed_env and "PATH" in listed_env
    assert "PATH" in raw_env and "RESEARCH_TOKEN" not in raw_env
    for env in (listed_env, raw_env):
        assert not env & (set(SECRETS) | {"UNRELATED"}), env


def test_an_entry_may_pass_a_secret_when_the_operator_says_so(company, settings, tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-for-the-agent")
    settings.PAPERCLIP_PROCESS_COMMANDS = listed_commands(
        tmp_path, claude={"argv": [sys.executable, reporter_script(tmp_path)], "env": ["ANTHROPIC_API_KEY"]}
    )
    agent = Agent.objects.create(
        company=company, name="listed", adapter_type="process", adapter_config={"command": "claude"}
    )
    assert "ANTHROPIC_API_KEY" in seen(beat(agent))["env"]


@pytest.mark.parametrize("mode", ["local_trusted", "authenticated"])
@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"command": "unknown"}, "command"),
        ({"command": ""}, "command"),
        ({"command": "reporter", "args": ["--force"]}, "args"),
        ({"command": "reporter", "args": ["--topic=UPPER"]}, "args"),
        ({"command": "reporter", "args": "--verbose"}, "args"),
        ({"command": "reporter", "args": ["--verbose"] * 65}, "args"),
        ({"command": "reporter", "args": ["--topic=" + "a" * 5000]}, "args"),
        ({"command": "reporter", "cwd": "/tmp"}, "cwd"),
        ({"command": ["python3", "agent.py"], "args": ["--verbose"]}, "args"),
    ],
)
def test_validation_names_the_field_that_is_not_allowed(commands, settings, mode, config, field):
    settings.PAPERCLIP_DEPLOYMENT_MODE = mode
    with pytest.raises(AgentConfigError) as caught:
        validate_agent_config("process", config)
    assert f"adapter_config.{field}" in caught.value.fields, caught.value.fields


def test_raw_argv_and_its_cwd_are_for_local_trusted_mode_only(commands, settings):
    config = {"command": ["python3", "agent.py"], "cwd": "/srv/agents"}
    assert validate_agent_config("process", config)["command"] == ["python3", "agent.py"]

    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    with pytest.raises(AgentConfigError) as caught:
        validate_agent_config("process", config)
    assert set(caught.value.fields) == {"adapter_config.command", "adapter_config.cwd"}
    assert "reporter" in caught.value.fields["adapter_config.command"]  # says what may be named


@pytest.mark.parametrize(
    ("raw", "mentions"),
    [
        ("not json", "JSON"),
        ('["sh"]', "object"),
        ('{"": ["sh"]}', "name"),
        ('{"bad name": ["sh"]}', "name"),
        ('{"a": []}', "argv"),
        ('{"a": {"argv": "sh -c x"}}', "argv"),
        ('{"a": {"argv": ["sh", ""]}}', "argv"),
        ('{"a": {"argv": ["sh"], "allowed_args": "x"}}', "allowed_args"),
        ('{"a": {"argv": ["sh"], "allowed_arg_patterns": ["("]}}', "allowed_arg_patterns"),
        ('{"a": {"argv": ["sh"], "env": ["NOT-A-NAME"]}}', "env"),
        ('{"a": {"argv": ["sh"], "cwd": "relative/dir"}}', "cwd"),
        ('{"a": {"argv": ["sh"], "argz": []}}', "argz"),
    ],
)
def test_a_bad_allow_list_is_a_configuration_error(raw, mentions):
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured) as caught:
        parse_process_commands(raw)
    assert "PAPERCLIP_PROCESS_COMMANDS" in str(caught.value)
    assert mentions in str(caught.value)


def test_an_allow_list_entry_may_be_just_its_argv():
    assert parse_process_commands('{"echo": ["/bin/echo", "hi"]}') == {
        "echo": {"argv": ["/bin/echo", "hi"], "allowed_args": [], "allowed_arg_patterns": [], "env": [], "cwd": None}
    }
    assert parse_process_commands("") == {}


def test_a_system_check_names_agents_whose_command_may_no_longer_run(company, commands, settings, tmp_path):
    from sessions_app.checks import check_process_commands

    raw, _ = raw_argv_agent(company, tmp_path)
    Agent.objects.create(company=company, name="listed", adapter_type="process", adapter_config={"command": "reporter"})
    assert check_process_commands(None) == []

    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"

    (warning,) = check_process_commands(None)
    assert warning.id == "paperclip.W004"
    assert "'raw'" in warning.msg and str(raw.id) in warning.msg and "adapter_config.command" in warning.msg


@pytest.mark.parametrize(
    "usage",
    [
        {"input_tokens": 10**20, "output_tokens": 1},
        {"input_tokens": -5, "output_tokens": 1},
        {"input_tokens": 1, "output_tokens": "many"},
        {"input_tokens": 1, "output_tokens": 1, "iterations": [{"type": "compaction", "input_tokens": 10**12}]},
        {"input_tokens": 1, "output_tokens": 1, "iterations": "all of them"},
    ],
    ids=["overflow", "negative", "not-a-number", "iteration-overflow", "iterations-not-a-list"],
)
def test_an_impossible_usage_report_fails_the_run_clearly(company, tmp_path, usage):
    assert_refused_as_malformed(company, tmp_path, {"text": "done", "usage": usage}, "usage")


@pytest.mark.parametrize("field", ["message_id", "stop_reason"])
def test_an_identifier_longer_than_its_column_fails_the_run_clearly(company, tmp_path, field):
    answer = {"text": "done", "usage": {"input_tokens": 1, "output_tokens": 1}, field: "x" * 300}
    assert_refused_as_malformed(company, tmp_path, answer, field)


def test_an_answer_nested_too_deep_to_parse_fails_the_run_clearly(company, tmp_path):
    agent = process_agent(company, tmp_path, "import sys\nsys.stdin.read()\nprint('[' * 100000)\n")

    run = beat(agent, "go")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "process_malformed_response")


def assert_refused_as_malformed(company, tmp_path, answer: dict, mentioned: str) -> None:
    answer = json.dumps(answer)
    agent = process_agent(company, tmp_path, f"import sys\nsys.stdin.read()\nprint({answer!r})\n")

    run = beat(agent, "go")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "process_malformed_response")
    assert mentioned in run.error
    assert not CostEvent.objects.exists()
    assert not AgentSession.objects.filter(agent=agent, message_count__gt=0).exists()


def test_an_agent_command_that_prints_without_end_is_killed_at_the_output_limit(settings, company, tmp_path):
    settings.PAPERCLIP_PROCESS_MAX_OUTPUT_BYTES = 200_000
    pid_file = tmp_path / "pid"
    agent = process_agent(
        company,
        tmp_path,
        f"import os, sys\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "while True:\n    sys.stdout.write('x' * 65536)\n",
    )

    run = beat(agent, "go")

    assert (run.status, run.error_code) == (RunStatus.FAILED, "process_output_too_large")
    assert "PAPERCLIP_PROCESS_MAX_OUTPUT_BYTES" in run.error
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_an_agent_command_printing_bytes_that_are_not_utf8_is_read_with_replacement_marks(company, tmp_path):
    agent = process_agent(
        company,
        tmp_path,
        "import sys\nsys.stdin.read()\n"
        'sys.stdout.buffer.write(b\'{"text": "caf\\xe9", "usage": {"input_tokens": 1, "output_tokens": 1}}\')\n',
    )

    run = beat(agent, "go")

    assert (run.status, run.output) == (RunStatus.SUCCEEDED, "caf\ufffd")


def test_a_request_larger_than_a_pipe_reaches_a_slow_reader_whole(company, tmp_path):
    agent = process_agent(
        company,
        tmp_path,
        "import json, sys, time\ntime.sleep(0.3)\nrequest = json.load(sys.stdin)\n"
        "print(json.dumps({'text': str(len(request['messages'][-1]['content']))}))\n",
    )

    run = beat(agent, "y" * 90_000)  # over the 64 KiB a pipe holds

    assert (run.status, run.output) == (RunStatus.SUCCEEDED, "90000")


def test_process_adapter_runs_a_command_with_the_request_on_stdin(company, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, sys\n"
        "request = json.load(sys.stdin)\n"
        "last = request['messages'][-1]['content']\n"
        "print(json.dumps({'text': f'echo {len(request[\"messages\"])}: ' + last,\n"
        "                  'usage': {'input_tokens': 10, 'output_tokens': 2}, 'message_id': 'proc-1'}))\n"
    )
    agent = Agent.objects.create(
        company=company,
        name="cli",
        adapter_type="process",
        adapter_config={"command": ["python3", str(script)], "model": "claude-haiku-4-5", "session_mode": "persistent"},
    )
    beat(agent, "ping")
    run = beat(agent, "pong")
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.output == "echo 3: pong"
    # Both calls reported the same message id: two calls all the same, two ledger rows.
    assert CostEvent.objects.filter(agent_id=agent.id).count() == 2


def test_process_adapter_kills_its_process_group_on_timeout(company, tmp_path):
    child_pid = tmp_path / "child.pid"
    script = tmp_path / "slow.sh"
    # A background child that records its pid; the command waits for it, then hangs.
    script.write_text(
        f"#!/bin/sh\nsh -c 'echo $$ > {child_pid}.tmp; mv {child_pid}.tmp {child_pid}; exec sleep 30' &\n"
        f"while [ ! -s {child_pid} ]; do sleep 0.01; done\nsleep 30\n"
    )
    script.chmod(0o755)
    agent = Agent.objects.create(
        company=company,
        name="slow",
        adapter_type="process",
        adapter_config={"command": [str(script)], "timeout_seconds": 2},
    )
    run = beat(agent, "hang")
    assert (run.status, run.error_code) == (RunStatus.FAILED, "process_timeout")

    assert child_pid.exists(), "the child never started under the command"
    wait_until_gone(int(child_pid.read_text()))
