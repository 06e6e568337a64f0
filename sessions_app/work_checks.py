"""Whether an agent has work, asked before any model call: its `work_check`.

An agent's adapter_config may hold

- `"work_check": {"command": "has-work", "args": [...], "timeout_seconds": 10}`: a command
  of the operator's PAPERCLIP_PROCESS_COMMANDS (a raw argv list only in local_trusted mode,
  as for the `process` adapter, whose rules and launcher it shares). Exit 0: there is work,
  and its stdout is appended to the task; exit 1: there is none; anything else, a timeout
  or too much output: the check failed.
- `"work_check": {"url": "https://tracker.example/agents/7/work", "timeout_seconds": 10}`:
  an HTTP GET. A 2xx with a body: there is work, and the body is appended to the task; 204
  (or any 2xx with an empty body): there is none; any other answer, or none in time: the
  check failed. Redirects are not followed. In authenticated mode the URL's host must be
  one of PAPERCLIP_WORK_CHECK_HOSTS: the answer is sent to the model and shown in the run,
  so an API user must not be able to read the worker's private network through it.

Also the nothing-to-do marker, and the back-off settings' validation. No model and no
database here: the adapters' validation uses it, and the engine side is `no_work`.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import settings

from paperclip.hosts import bounded_request, unlisted_host_problem
from sessions_app.adapters.process import (
    OutputTooLarge,
    command_launch,
    command_problems,
    exchange,
    launch_start,
    quoted,
    stop,
)
from sessions_app.errors import RunFailure
from sessions_app.text import storable
from sessions_app.wakes import backoff_factor

DEFAULT_CHECK_TIMEOUT_SECONDS = 30
MAX_CHECK_TIMEOUT_SECONDS = 300
MAX_URL_CHARS = 2000
MAX_MARKER_CHARS = 200
COMMAND_KEYS = {"command", "args", "cwd", "timeout_seconds"}
URL_KEYS = {"url", "timeout_seconds"}
STDERR_TAIL_CHARS = 500


class WorkCheckFailed(RunFailure):
    """The check could not say whether there is work: the run fails with this code and
    makes no model call (`work_check_failed`, `work_check_not_allowed`)."""


@dataclass(frozen=True)
class Found:
    """What a check that ran found: work (with the text to append to the task), or none."""

    work: bool
    output: str = ""


# Validation (when an agent is saved).


def validate_work_settings(config: dict, errors: dict[str, str], clean: dict) -> None:
    """`work_check`, `nothing_to_do_marker`, `backoff_after_runs`, `backoff_max_factor`."""
    if "work_check" in config:
        check = config["work_check"]
        if check is not None:
            errors.update({f"work_check{key}": message for key, message in check_problems(check).items()})
        clean["work_check"] = check
    if "nothing_to_do_marker" in config:
        marker = config["nothing_to_do_marker"]
        if marker is not None and (
            not isinstance(marker, str) or not marker.strip() or len(marker) > MAX_MARKER_CHARS or "\x00" in marker
        ):
            errors["nothing_to_do_marker"] = (
                f"must be a non-blank text of at most {MAX_MARKER_CHARS} characters, or null"
            )
        clean["nothing_to_do_marker"] = marker
    for key, high in (("backoff_after_runs", 1000), ("backoff_max_factor", 1024)):
        if key in config:
            value = config[key]
            low = 0 if key == "backoff_after_runs" else 1
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high
            ):
                errors[key] = f"must be a whole number in {low}..{high} or null, got {quoted(value)}"
            clean[key] = value


def check_problems(check: object, *, mode: str | None = None, commands: Mapping | None = None) -> dict[str, str]:
    """What is wrong with a work check, by key suffix ("" for the object, ".url", ...)."""
    mode = mode or settings.PAPERCLIP_DEPLOYMENT_MODE
    commands = settings.PAPERCLIP_PROCESS_COMMANDS if commands is None else commands
    if not isinstance(check, dict) or ("command" in check) == ("url" in check):
        return {"": 'must be an object with either "command" or "url" (and optionally "timeout_seconds"), or null'}
    allowed = COMMAND_KEYS if "command" in check else URL_KEYS
    problems = {f".{key}": "unknown setting of a work check" for key in sorted(set(check) - allowed)}
    timeout = check.get("timeout_seconds", DEFAULT_CHECK_TIMEOUT_SECONDS)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout <= MAX_CHECK_TIMEOUT_SECONDS
    ):
        problems[".timeout_seconds"] = (
            f"must be a number of seconds in (0, {MAX_CHECK_TIMEOUT_SECONDS}], got {quoted(timeout)}"
        )
    if "command" in check:
        problems.update(
            {f".{key}": message for key, message in command_problems(check, mode=mode, commands=commands).items()}
        )
    elif problem := url_problem(check["url"], mode=mode):
        problems[".url"] = problem
    return problems


def url_problem(url: object, *, mode: str) -> str | None:
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS or any(ord(c) < 33 for c in url):
        return f"must be an http(s) URL of at most {MAX_URL_CHARS} characters without spaces, got {quoted(url)}"
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return f"is not a valid URL: {quoted(url)}"
    if parts.scheme not in ("http", "https") or not host:
        return f"must be an http:// or https:// URL with a host, got {quoted(url)}"
    if parts.username is not None or parts.password is not None:
        # It would be stored in the agent's configuration and shown by the API.
        return "must not carry credentials (user:password@)"
    return unlisted_host_problem(parts, setting="PAPERCLIP_WORK_CHECK_HOSTS", mode=mode)


# Running a check (by the engine, outside any transaction).


def check_seconds(config: dict) -> float:
    """The longest the agent's work check may take (0 without one): the run's deadline covers it."""
    check = config.get("work_check")
    if not isinstance(check, dict):
        return 0.0
    try:
        return float(check.get("timeout_seconds", DEFAULT_CHECK_TIMEOUT_SECONDS))
    except (TypeError, ValueError):
        return 0.0


def work_check_run(check: dict) -> Found:
    """Run a work check; `WorkCheckFailed` when it cannot tell.

    Checked again here with this worker's allow-list and mode: the row may predate them."""
    problems = check_problems(check)
    if problems:
        detail = "; ".join(f"adapter_config.work_check{key}: {message}" for key, message in problems.items())
        raise WorkCheckFailed("work_check_not_allowed", f"This agent's work check may not run here: {detail}")
    timeout = float(check.get("timeout_seconds", DEFAULT_CHECK_TIMEOUT_SECONDS))
    if "command" in check:
        return _command_check(check, timeout=timeout)
    return _url_check(check["url"], timeout=timeout)


def _command_check(check: dict, *, timeout: float) -> Found:
    limit = settings.PAPERCLIP_WORK_CHECK_MAX_OUTPUT_BYTES
    # Only the base environment (and the entry's `env`): never the worker's secrets.
    launch = command_launch(check, commands=settings.PAPERCLIP_PROCESS_COMMANDS, environ=os.environ)
    try:
        proc = launch_start(launch)
    except OSError as exc:
        raise WorkCheckFailed("work_check_failed", f"Could not start the work check command: {exc}") from None
    try:
        stdout, stderr = exchange(proc, b"", timeout=timeout, limit=limit)
    except subprocess.TimeoutExpired:
        raise WorkCheckFailed(
            "work_check_failed", f"The work check command ran longer than {timeout:g} s and was killed."
        ) from None
    except OutputTooLarge:
        raise WorkCheckFailed(
            "work_check_failed",
            f"The work check command printed more than {limit} bytes (PAPERCLIP_WORK_CHECK_MAX_OUTPUT_BYTES) "
            "and was killed before its exit status said whether there is work.",
        ) from None
    finally:
        stop(proc)
    if proc.returncode == 0:
        return Found(work=True, output=_text(stdout))
    if proc.returncode == 1:
        return Found(work=False)
    tail = _text(stderr)[-STDERR_TAIL_CHARS:]
    raise WorkCheckFailed(
        "work_check_failed", f"The work check command exited with status {proc.returncode} (0: work, 1: none): {tail}"
    )


def _url_check(url: str, *, timeout: float) -> Found:
    limit = settings.PAPERCLIP_WORK_CHECK_MAX_OUTPUT_BYTES
    # The scheme was checked (http or https) by check_problems just before.
    request = urllib.request.Request(url, headers={"User-Agent": "paperclip-work-check"}, method="GET")  # noqa: S310
    try:
        # No proxy from the environment: the listed host is the one asked. The timeout
        # bounds the whole request, not each read.
        status, body = bounded_request(request, timeout=timeout, max_body=limit)
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(exc, TimeoutError) or isinstance(reason, TimeoutError):
            reason = f"no answer within {timeout:g} s"
        raise WorkCheckFailed("work_check_failed", f"The work check URL could not be read: {reason}") from None
    if not 200 <= status < 300:
        raise WorkCheckFailed(
            "work_check_failed", f"The work check URL answered {status} (2xx with a body: work, 204: none)."
        )
    # The status is known, so a long body is cut to the bound rather than failing the check.
    text = _text(body)
    if status == 204 or not text.strip():
        return Found(work=False)
    return Found(work=True, output=text)


def _text(raw: bytes) -> str:
    # A check's bytes are not always UTF-8: a bad byte (or a NUL) becomes U+FFFD.
    return storable(raw.decode("utf-8", errors="replace"))


def task_with_output(task: str, output: str) -> str:
    """The task the model sees: the run's task, then what the work check found."""
    output = output.strip()
    return f"{task}\n\nWork check output:\n{output}" if output else task


# The nothing-to-do marker.


def is_nothing_to_do(text: str, config: dict) -> bool:
    """Whether an answer is (or starts with) the agent's nothing-to-do marker."""
    marker = config.get("nothing_to_do_marker")
    return bool(marker) and isinstance(text, str) and text.strip().startswith(marker.strip())


# The back-off of a scheduled agent that keeps finding no work.


def backoff_settings(config: dict) -> tuple[int, int]:
    """(`backoff_after_runs`, `backoff_max_factor`): the agent's, else the deployment's."""
    after = config.get("backoff_after_runs")
    factor = config.get("backoff_max_factor")
    return (
        settings.PAPERCLIP_BACKOFF_AFTER_RUNS if after is None else after,
        settings.PAPERCLIP_BACKOFF_MAX_FACTOR if factor is None else factor,
    )


def agent_backoff(config: dict, idle_streak: int) -> int:
    """The factor the agent's wake interval is stretched by now (1: none)."""
    after, most = backoff_settings(config or {})
    return backoff_factor(idle_streak=idle_streak, after_runs=after, max_factor=most)
