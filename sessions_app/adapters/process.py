"""`process`: a command-line agent. The request goes to its stdin as JSON; it answers on
stdout with `{"text": "...", "usage": {...}, "model": "...", "message_id": "..."}`.

What may run is the operator's choice, not the agent's: an agent names a command of
PAPERCLIP_PROCESS_COMMANDS and adds only the arguments its entry allows. A raw argv list is
accepted in local_trusted mode only, where whoever reaches the API is the machine's operator.
The rule is checked when an agent is saved and again before every call, so a row written
before the list existed (or by raw SQL) cannot run what the list does not allow.
"""

from __future__ import annotations

import json
import os
import re
import select
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from sessions_app.adapters.base import (
    Adapter,
    AdapterError,
    AdapterReply,
    AdapterRequest,
    usage_error,
    validate_timeout,
)
from sessions_app.text import MESSAGE_ID_MAX_LENGTH, STOP_REASON_MAX_LENGTH

DEFAULT_TIMEOUT_SECONDS = 600
STDERR_TAIL_BYTES = 4000
READ_CHUNK_BYTES = 65536
FIELD_LENGTHS = {"message_id": MESSAGE_ID_MAX_LENGTH, "stop_reason": STOP_REASON_MAX_LENGTH}
# What every agent command gets from the worker's environment; its entry's `env` adds more.
# Never the worker's secrets (DJANGO_SECRET_KEY, DATABASE_URL, REDIS_URL, ANTHROPIC_API_KEY).
BASE_ENVIRONMENT = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
# Bounds what an operator's pattern is matched against, and stays far below the kernel's
# limits on one argument and on the whole argv.
MAX_EXTRA_ARGS = 64
MAX_ARG_CHARS = 4096


class OutputTooLarge(Exception):
    pass


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    cwd: str | None
    env: dict[str, str]


def command_problems(config: dict, *, mode: str, commands: Mapping[str, dict]) -> dict[str, str]:
    """What in `config` may not run in this deployment, by adapter_config key; empty when it may."""
    command = config.get("command")
    if isinstance(command, list):
        return raw_command_problems(config, mode=mode, commands=commands)
    if not isinstance(command, str) or command not in commands:
        what = f"{quoted(command)} is not listed" if isinstance(command, str) else "must be a command's name"
        return {"command": f"{what}; {listed_hint(commands, mode=mode)}"}
    problems = {}
    if problem := args_problem(config.get("args", []), name=command, entry=commands[command]):
        problems["args"] = problem
    if "cwd" in config:
        problems["cwd"] = "a listed command runs in the directory its PAPERCLIP_PROCESS_COMMANDS entry names"
    return problems


def raw_command_problems(config: dict, *, mode: str, commands: Mapping[str, dict]) -> dict[str, str]:
    """A raw argv list: the local_trusted operator's own command, refused anywhere else."""
    problems = {}
    if "args" in config:
        problems["args"] = "only with a listed command's name; a command list carries its own arguments"
    if mode != "local_trusted":
        problems["command"] = f"a command list runs only in local_trusted mode; {listed_hint(commands, mode=mode)}"
        if "cwd" in config:
            problems["cwd"] = "only in local_trusted mode, with a command list"
        return problems
    command = config["command"]
    if not command or not all(isinstance(part, str) and part and "\x00" not in part for part in command):
        problems["command"] = 'must be a non-empty list of strings, e.g. ["python", "agent.py"]'
    if "cwd" in config and not (isinstance(config["cwd"], str) and config["cwd"] and "\x00" not in config["cwd"]):
        problems["cwd"] = f"must be a directory path, got {quoted(config['cwd'])}"
    return problems


def args_problem(args: object, *, name: str, entry: dict) -> str | None:
    if not isinstance(args, list) or not all(isinstance(arg, str) and "\x00" not in arg for arg in args):
        return "must be a list of strings"
    if len(args) > MAX_EXTRA_ARGS or any(len(arg) > MAX_ARG_CHARS for arg in args):
        return f"at most {MAX_EXTRA_ARGS} arguments of at most {MAX_ARG_CHARS} characters"
    for arg in args:
        if arg not in entry["allowed_args"] and not any(
            re.fullmatch(pattern, arg) for pattern in entry["allowed_arg_patterns"]
        ):
            allowed = [*map(repr, entry["allowed_args"]), *(f"/{p}/" for p in entry["allowed_arg_patterns"])]
            return f"{quoted(arg)} is not allowed for {name!r}; " + (
                f"allowed: {', '.join(allowed)}" if allowed else "it takes no added arguments"
            )
    return None


def listed_hint(commands: Mapping[str, dict], *, mode: str) -> str:
    if not commands:
        return "PAPERCLIP_PROCESS_COMMANDS lists no commands: the operator lists the ones agents may run"
    names = ", ".join(sorted(commands))
    hint = f"name a command of PAPERCLIP_PROCESS_COMMANDS: {names}"
    return hint + (', or give an argv list such as ["python", "agent.py"]' if mode == "local_trusted" else "")


def quoted(value: object, longest: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= longest else text[: longest - 3] + "..."


def command_launch(config: dict, *, commands: Mapping[str, dict], environ: Mapping[str, str]) -> Launch:
    """How to start the command of a `config` that has no command_problems()."""
    command = config["command"]
    if isinstance(command, list):
        names, argv, cwd = BASE_ENVIRONMENT, list(command), config.get("cwd") or None
    else:
        entry = commands[command]
        names, argv, cwd = (*BASE_ENVIRONMENT, *entry["env"]), [*entry["argv"], *config.get("args", [])], entry["cwd"]
    return Launch(argv=argv, cwd=cwd, env={name: environ[name] for name in names if name in environ})


class ProcessAdapter(Adapter):
    type_name = "process"
    config_keys = {"command", "args", "timeout_seconds", "model", "cwd"}

    def validate_config(self, config: dict, errors: dict[str, str]) -> dict:
        clean: dict[str, Any] = {"command": config.get("command")}
        for key in ("args", "cwd"):
            if key in config:
                clean[key] = config[key]
        errors.update(
            command_problems(
                config, mode=settings.PAPERCLIP_DEPLOYMENT_MODE, commands=settings.PAPERCLIP_PROCESS_COMMANDS
            )
        )
        model = config.get("model", "")
        if not isinstance(model, str):
            errors["model"] = f"must be a string, got {model!r}"
        clean["model"] = model
        validate_timeout(config, errors, clean, default=DEFAULT_TIMEOUT_SECONDS)
        if config.get("context_strategy") == "server":
            errors["context_strategy"] = "'server' compaction needs the claude-code adapter"
        return clean

    def call_seconds(self, config: dict) -> float:
        return float(config.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS))

    def call(self, request: AdapterRequest) -> AdapterReply:
        payload = json.dumps(
            {
                "model": request.model,
                "system": request.system,
                "messages": request.messages,
                "metadata": request.metadata,
            }
        ).encode()
        timeout = float(request.config.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS))
        limit = settings.PAPERCLIP_PROCESS_MAX_OUTPUT_BYTES
        launch = self.launch(request.config)
        try:
            proc = launch_start(launch)
        except OSError as exc:
            raise AdapterError("process_start_failed", f"Could not start the agent command: {exc}") from None
        try:
            raw_stdout, raw_stderr = exchange(proc, payload, timeout=timeout, limit=limit)
        except subprocess.TimeoutExpired:
            raise AdapterError(
                "process_timeout", f"The agent command ran longer than {timeout:g} s and was killed."
            ) from None
        except OutputTooLarge:
            raise AdapterError(
                "process_output_too_large",
                f"The agent command printed more than {limit} bytes (PAPERCLIP_PROCESS_MAX_OUTPUT_BYTES) and was killed.",
            ) from None
        finally:
            stop(proc)
        # An agent's bytes are not always UTF-8; a bad byte becomes U+FFFD, not a crash.
        stdout = raw_stdout.decode("utf-8", errors="replace")
        if proc.returncode != 0:
            tail = raw_stderr.decode("utf-8", errors="replace").strip()
            raise AdapterError("process_failed", f"The agent command exited with status {proc.returncode}: {tail}")
        try:
            answer = json.loads(stdout)
        except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
            raise AdapterError("process_malformed_response", "The agent command did not print a JSON object.") from None
        if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
            raise AdapterError("process_malformed_response", 'The agent command must print {"text": "...", ...}.')
        usage = answer.get("usage")
        if usage is not None and not isinstance(usage, dict):
            raise AdapterError("process_malformed_response", "`usage` must be an object.")
        if problem := usage_error(usage):
            raise AdapterError("process_malformed_response", problem)
        for key, longest in FIELD_LENGTHS.items():
            if len(str(answer.get(key) or "")) > longest:
                raise AdapterError("process_malformed_response", f"`{key}` must be at most {longest} characters.")
        artifacts = answer.get("artifacts") or []
        if not isinstance(artifacts, list):
            raise AdapterError("process_malformed_response", "`artifacts` must be a list.")
        return AdapterReply(
            text=answer["text"],
            content=answer["text"],
            model=str(answer.get("model") or request.model),
            requested_model=request.model,
            message_id=str(answer.get("message_id") or ""),
            stop_reason=str(answer.get("stop_reason") or "end_turn"),
            usage=usage,
            artifacts=artifacts,
        )

    def launch(self, config: dict) -> Launch:
        # Checked again here, with the list and mode of this worker: the row may predate
        # them, or have been written around validation.
        commands = settings.PAPERCLIP_PROCESS_COMMANDS
        problems = command_problems(config, mode=settings.PAPERCLIP_DEPLOYMENT_MODE, commands=commands)
        if problems:
            detail = "; ".join(f"adapter_config.{key}: {message}" for key, message in problems.items())
            raise AdapterError("process_command_not_allowed", f"This agent's command may not run here: {detail}")
        return command_launch(config, commands=commands, environ=os.environ)


def launch_start(launch: Launch) -> subprocess.Popen:
    """The command started with pipes, in a session of its own, so that on timeout the whole
    process group is killed: a shell wrapper's children must not outlive the run."""
    return subprocess.Popen(
        launch.argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=launch.cwd,
        env=launch.env,
        start_new_session=True,
    )


def exchange(proc: subprocess.Popen, payload: bytes, *, timeout: float, limit: int) -> tuple[bytes, bytes]:
    """What `proc.communicate(payload, timeout)` does, in bounded memory.

    stdout over `limit` bytes raises OutputTooLarge instead of growing this worker until it
    is killed, with every other run it holds; of stderr only the tail is kept, for the
    error message. Raises subprocess.TimeoutExpired past `timeout`.
    """
    deadline = time.monotonic() + timeout
    stdout, stderr = bytearray(), bytearray()
    written = 0
    with selectors.DefaultSelector() as selector:
        if payload:
            selector.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            for key, _ in selector.select(remaining):
                if key.fileobj is proc.stdin:
                    try:
                        # A pipe that selects writable takes PIPE_BUF bytes without blocking.
                        written += os.write(key.fd, payload[written : written + select.PIPE_BUF])
                    except BrokenPipeError:
                        written = len(payload)  # the command does not read its request
                    if written >= len(payload):
                        selector.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, READ_CHUNK_BYTES)
                if not chunk:
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
                elif key.fileobj is proc.stdout:
                    stdout += chunk
                    if len(stdout) > limit:
                        raise OutputTooLarge
                else:
                    stderr += chunk
                    del stderr[:-STDERR_TAIL_BYTES]
    # Both pipes closed; the command may still be finishing (or ignoring them).
    proc.wait(timeout=max(deadline - time.monotonic(), 0))
    return bytes(stdout), bytes(stderr)


def stop(proc: subprocess.Popen) -> None:
    """Leave nothing behind: the process group killed if still running, the pipes closed."""
    if proc.poll() is None:
        kill_group(proc)
        proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
