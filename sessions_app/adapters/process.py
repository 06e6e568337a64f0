"""`process`: any command-line agent. The request goes to its stdin as JSON; it answers on
stdout with `{"text": "...", "usage": {...}, "model": "...", "message_id": "..."}`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Any

from sessions_app.adapters.base import AdapterError, AdapterReply, AdapterRequest, usage_error, validate_timeout

DEFAULT_TIMEOUT_SECONDS = 600
STDERR_TAIL_CHARS = 2000


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

    def call(self, request: AdapterRequest) -> AdapterReply:
        payload = json.dumps(
            {
                "model": request.model,
                "system": request.system,
                "messages": request.messages,
                "metadata": request.metadata,
            }
        )
        timeout = float(request.config.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS))
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
                text=True,
            )
        except OSError as exc:
            raise AdapterError("process_start_failed", f"Could not start the agent command: {exc}") from None
        try:
            stdout, stderr = proc.communicate(payload, timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.communicate()
            raise AdapterError(
                "process_timeout", f"The agent command ran longer than {timeout:g} s and was killed."
            ) from None
        if proc.returncode != 0:
            tail = stderr[-STDERR_TAIL_CHARS:].strip()
            raise AdapterError("process_failed", f"The agent command exited with status {proc.returncode}: {tail}")
        try:
            answer = json.loads(stdout)
        except ValueError:
            raise AdapterError("process_malformed_response", "The agent command did not print a JSON object.") from None
        if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
            raise AdapterError("process_malformed_response", 'The agent command must print {"text": "...", ...}.')
        usage = answer.get("usage")
        if usage is not None and not isinstance(usage, dict):
            raise AdapterError("process_malformed_response", "`usage` must be an object.")
        if problem := usage_error(usage):
            raise AdapterError("process_malformed_response", problem)
        artifacts = answer.get("artifacts") or []
        if not isinstance(artifacts, list):
            raise AdapterError("process_malformed_response", "`artifacts` must be a list.")
        return AdapterReply(
            text=answer["text"],
            content=answer["text"],
            model=str(answer.get("model") or request.model),
            message_id=str(answer.get("message_id") or ""),
            stop_reason=str(answer.get("stop_reason") or "end_turn"),
            usage=usage,
            artifacts=artifacts,
        )


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
