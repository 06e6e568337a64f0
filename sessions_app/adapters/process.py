"""`process`: any command-line agent. The request goes to its stdin as JSON; it answers on
stdout with `{"text": "...", "usage": {...}, "model": "...", "message_id": "..."}`."""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import time
from typing import Any

from django.conf import settings

from sessions_app.adapters.base import AdapterError, AdapterReply, AdapterRequest, usage_error, validate_timeout
from sessions_app.models import HeartbeatRun

DEFAULT_TIMEOUT_SECONDS = 600
STDERR_TAIL_BYTES = 4000
READ_CHUNK_BYTES = 65536
# The run columns these go to (the ledger's message_id is as long); PostgreSQL refuses
# longer values at commit time.
FIELD_LENGTHS = {name: HeartbeatRun._meta.get_field(name).max_length for name in ("message_id", "stop_reason")}


class OutputTooLarge(Exception):
    pass


class ProcessAdapter:
    type_name = "process"
    config_keys = {"command", "timeout_seconds", "model", "cwd"}

    def validate_config(self, config: dict, errors: dict[str, str]) -> dict:
        clean: dict[str, Any] = {}
        command = config.get("command")
        if (
            not isinstance(command, list)
            or not command
            or not all(isinstance(part, str) and part and "\x00" not in part for part in command)
        ):
            errors["command"] = 'must be a non-empty list of strings, e.g. ["python", "agent.py"]'
        clean["command"] = command
        model = config.get("model", "")
        if not isinstance(model, str):
            errors["model"] = f"must be a string, got {model!r}"
        clean["model"] = model
        if "cwd" in config:
            cwd = config["cwd"]
            if not isinstance(cwd, str) or not cwd:
                errors["cwd"] = f"must be a directory path, got {cwd!r}"
            clean["cwd"] = cwd
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
        try:
            # A session of its own, so that on timeout we kill the whole process group:
            # a shell wrapper's children must not outlive the run.
            proc = subprocess.Popen(
                request.config["command"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=request.config.get("cwd") or None,
                start_new_session=True,
            )
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
