"""`claude-code` with `runtime: "cli"`: Claude Code itself, through `claude-agent-sdk`.

The agent acts in its workspace with Claude Code's tools; a persistent session is the CLI's
own, resumed by its id from the transcript kept here, which the engine hands each run
(`AdapterRequest.own_session`, `sessions_app.cli_transcripts.SessionTranscripts`): the
runtime itself reads and writes no model.

- Isolation: the CLI runs with a config directory of its own per agent under
  PAPERCLIP_HOME, no filesystem setting sources, and an environment built from an
  allow-list (`cli_environment`): nothing else of this service's environment (database
  URL, secret key, Redis URL) reaches it or the commands it runs.
- Time: the whole CLI run has `timeout_seconds`; then the CLI and every command it started
  are killed (`Watchdog`), held in a cgroup or found in the process tree
  (`sessions_app.adapters.cli_processes`), and whatever a run leaves behind when it ends.
- The SDK is asynchronous: `call` runs it on an event loop of its own, and nothing on
  that loop touches the ORM (the transcript is loaded before and written by the engine's
  commit after).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from functools import partial
from pathlib import Path
from typing import Any

from django.conf import settings

from paperclip import telemetry
from sessions_app.adapters.base import (
    Adapter,
    AdapterError,
    AdapterReply,
    AdapterRequest,
    CallMeter,
    QuotaRefused,
    is_int,
    is_number,
    usage_error,
    validate_model,
    validate_timeout,
)
from sessions_app.adapters.cli_home import (
    agent_home,
    config_dir,
    git_fence,
    local_copy_delete,
    workspace_for,
    workspace_prepare,
)
from sessions_app.adapters.cli_processes import RUN_MARK, RunProcesses
from sessions_app.adapters.cli_sandbox import sandbox_arguments
from sessions_app.adapters.rate_limits import USAGE_LIMIT, api_credential, cli_refusal
from sessions_app.text import storable

logger = logging.getLogger(__name__)

RUNTIME = "cli"
# File reading, editing and search, and the shell, inside the workspace; no web tools.
DEFAULT_ALLOWED_TOOLS = ["Read", "Edit", "Write", "Glob", "Grep", "Bash"]
PERMISSION_MODES = ("dontAsk", "default", "acceptEdits", "plan", "bypassPermissions")
DEFAULT_PERMISSION_MODE = "dontAsk"  # a tool not allowed is refused, never asked about
DEFAULT_MAX_TURNS = 25
DEFAULT_TIMEOUT_SECONDS = 600
MAX_BUDGET_USD = 1000
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# Seconds a killed CLI gets to be reaped and its SDK to wind down, on top of its timeout.
KILL_GRACE_SECONDS = 15
# At the timeout, what an answer streaming then gets to end before the kill (within the
# grace above): the provider bills it whether or not it is read.
STREAMING_GRACE_SECONDS = 8
TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*(\(.*\))?", re.DOTALL)
# A tool result kept in the session's history (the store keeps it whole).
RESULT_CHARS = 2000
LAUNCHER = Path(__file__).with_name("claude_cli_launch.sh")
# What the SDK itself sets for its child; the launcher keeps them beside our allow-list.
SDK_VARIABLES = (
    "CLAUDE_CODE_ENTRYPOINT",
    "CLAUDE_AGENT_SDK_VERSION",
    "CLAUDE_AGENT_SDK_CLIENT_APP",
    "CLAUDE_AGENT_SDK_DERIVED_CLIENT_APP",
    "CLAUDE_CODE_SDK_READS_SESSION_STATE",
    "PWD",
)
# From the worker's environment: the credentials and endpoint of the Messages API.
PASSED_VARIABLES = ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN")
# The credential a CLI without an API key uses: its own login (`credential`).
CLI_LOGIN = "claude-code:login"
CONFIG_KEYS = {
    "runtime",
    "model",
    "allowed_tools",
    "disallowed_tools",
    "permission_mode",
    "max_turns",
    "max_budget_usd",
    "workspace",
    "timeout_seconds",
    "effort",
    "thinking",
}


def bundled_cli() -> Path:
    import claude_agent_sdk

    return Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude"


def cli_binary() -> Path:
    configured = getattr(settings, "PAPERCLIP_CLAUDE_CLI", "")
    return Path(configured) if configured else bundled_cli()


# --- configuration ------------------------------------------------------------------------


def _tools(config: dict, key: str, errors: dict[str, str], default: list[str]) -> list[str]:
    tools = config.get(key, default)
    if not isinstance(tools, list) or not all(
        isinstance(name, str) and len(name) <= 200 and TOOL_NAME.fullmatch(name) for name in tools
    ):
        errors[key] = f"must be a list of Claude Code tool names such as 'Read' or 'Bash(git:*)', got {tools!r}"
    return tools


def validate_cli_config(config: dict, errors: dict[str, str]) -> dict:
    clean: dict[str, Any] = {"runtime": RUNTIME}
    validate_model(config, errors, clean)
    clean["allowed_tools"] = _tools(config, "allowed_tools", errors, DEFAULT_ALLOWED_TOOLS)
    clean["disallowed_tools"] = _tools(config, "disallowed_tools", errors, [])
    mode = config.get("permission_mode", DEFAULT_PERMISSION_MODE)
    if mode not in PERMISSION_MODES:
        errors["permission_mode"] = f"must be one of {', '.join(PERMISSION_MODES)}, got {mode!r}"
    clean["permission_mode"] = mode
    turns = config.get("max_turns", DEFAULT_MAX_TURNS)
    if not is_int(turns) or not 1 <= turns <= 1000:
        errors["max_turns"] = f"must be a whole number in 1..1000, got {turns!r}"
    clean["max_turns"] = turns
    if "max_budget_usd" in config:
        cap = config["max_budget_usd"]
        if cap is not None and (not is_number(cap) or not 0 < cap <= MAX_BUDGET_USD):
            errors["max_budget_usd"] = f"must be a number of dollars in (0, {MAX_BUDGET_USD}] or null, got {cap!r}"
        clean["max_budget_usd"] = cap
    if "workspace" in config:
        workspace = config["workspace"]
        if workspace is not None and (
            not isinstance(workspace, str) or not os.path.isabs(workspace) or len(workspace) > 1000
        ):
            errors["workspace"] = f"must be an absolute directory path or null, got {workspace!r}"
        clean["workspace"] = workspace
    validate_timeout(config, errors, clean, default=DEFAULT_TIMEOUT_SECONDS)
    for key, problem in authenticated_problems(
        clean, mode=settings.PAPERCLIP_DEPLOYMENT_MODE, permitted=settings.PAPERCLIP_CLI_TOOLS
    ).items():
        errors.setdefault(key, problem)  # a setting's own shape is said first
    if "effort" in config:
        effort = config["effort"]
        if effort is not None and effort not in EFFORTS:
            errors["effort"] = f"must be one of {', '.join(EFFORTS)} or null, got {effort!r}"
        clean["effort"] = effort
    if "thinking" in config:
        clean["thinking"] = _thinking(config["thinking"], errors)
    return clean


def authenticated_problems(config: dict, *, mode: str, permitted: tuple[str, ...]) -> dict[str, str]:
    """What an API key may not choose for a Claude Code agent in `authenticated` mode.

    The tools run as the worker's user, so the tools (the shell above all), a permission
    mode that lets unlisted tools run, and a working directory outside the agents' own are
    the operator's to grant, as `process` commands are (PAPERCLIP_CLI_TOOLS).
    """
    if mode != "authenticated":
        return {}
    problems = {}
    # What the run would be given, defaults included: a row written around validation may
    # lack the key, and the CLI is then offered the default tools, the shell among them.
    tools = config.get("allowed_tools", DEFAULT_ALLOWED_TOOLS)
    if not isinstance(tools, list):
        problems["allowed_tools"] = f"must be a list of tool names, got {tools!r}"
    elif refused := [name for name in tools if name not in permitted]:
        listed = ", ".join(permitted) if permitted else "none: the operator lists them"
        problems["allowed_tools"] = (
            f"{', '.join(map(repr, refused))} may not be used in authenticated mode; "
            f"PAPERCLIP_CLI_TOOLS permits {listed}"
        )
    if config.get("permission_mode", DEFAULT_PERMISSION_MODE) != DEFAULT_PERMISSION_MODE:
        problems["permission_mode"] = (
            f"must be {DEFAULT_PERMISSION_MODE!r} in authenticated mode (no tool outside allowed_tools runs)"
        )
    if config.get("workspace"):
        problems["workspace"] = "is PAPERCLIP_HOME/workspaces/{agent_id}/ in authenticated mode; leave it unset"
    return problems


# No model thinks past its window (1M tokens for the 5.x generation): a larger budget is no
# setting any run could honour, so it is refused on save rather than left to fail a run.
MAX_THINKING_BUDGET = 1_000_000


def _thinking(thinking, errors: dict[str, str]):
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    if thinking is None or (kind in ("adaptive", "disabled") and set(thinking) == {"type"}):
        return thinking
    if (
        kind == "enabled"
        and set(thinking) == {"type", "budget_tokens"}
        and is_int(budget)
        and 1024 <= budget <= MAX_THINKING_BUDGET
    ):
        return thinking
    errors["thinking"] = (
        "must be {'type': 'adaptive'}, {'type': 'disabled'}, {'type': 'enabled', 'budget_tokens': N} "
        f"with N from 1024 to {MAX_THINKING_BUDGET}, or null; got {thinking!r}"
    )
    return thinking


# --- isolation ----------------------------------------------------------------------------


def cli_environment(*, agent_id, workspace: Path, mark: str, traceparent: str | None = None) -> dict[str, str]:
    """Everything the CLI's environment holds: an allow-list, never the worker's own."""
    env = {
        RUN_MARK: mark,
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(agent_home(agent_id)),
        "CLAUDE_CONFIG_DIR": str(config_dir(agent_id)),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "LANG": "C.UTF-8",
    }
    env.update({name: os.environ[name] for name in PASSED_VARIABLES if os.environ.get(name)})
    if traceparent:
        # The trace context of the run's `call` step, for a CLI that joins it (W3C).
        env["TRACEPARENT"] = traceparent
    env.update(git_fence(workspace))  # git's search for a repository stops at the workspace
    return env


def launcher_environment(env: dict[str, str], *, processes: RunProcesses, sandbox: list[str]) -> dict[str, str]:
    """What the SDK passes to the launcher: the CLI's variables, which of them it keeps, how
    the run holds its processes (the pidfile, the cgroup to enter) and the sandbox it runs in."""
    names = sorted({*env, *SDK_VARIABLES})
    return {
        **env,
        **processes.launcher_environment(),
        "PAPERCLIP_CLI_ENV": " ".join(names),
        "PAPERCLIP_CLI_BIN": str(cli_binary()),
        "PAPERCLIP_CLI_PYTHON": sys.executable,
        "PAPERCLIP_CLI_SANDBOX": json.dumps(sandbox) if sandbox else "",
    }


class Watchdog:
    """Kills the CLI at its deadline, whatever the event loop is doing, and with it every
    process of the run (`RunProcesses`: its cgroup, or its process tree as recorded), once
    `finish` has returned; after the run, whatever it left behind."""

    def __init__(self, processes: RunProcesses, seconds: float, *, finish: Callable[[], None]) -> None:
        self.processes = processes
        self.finish = finish
        self.fired = False
        self.timer = threading.Timer(seconds, self.fire)
        self.timer.daemon = True

    def __enter__(self) -> Watchdog:
        self.processes.track()
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()
        # What the CLI started and left behind (a background command) goes with it.
        self.processes.close()

    def fire(self) -> None:
        self.fired = True
        self.finish()
        self.processes.kill()


# --- one heartbeat ------------------------------------------------------------------------


@dataclass
class Conversation:
    """What the CLI reported during one run."""

    messages: list = field(default_factory=list)
    result: Any = None
    stderr: list[str] = field(default_factory=list)


TOKEN_KEYS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
CACHE_WRITE_KEYS = ("ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens")
# The names the CLI's `modelUsage` gives the Messages API's counts.
CLI_USAGE_NAMES = {
    "input_tokens": "inputTokens",
    "output_tokens": "outputTokens",
    "cache_read_input_tokens": "cacheReadInputTokens",
    "cache_creation_input_tokens": "cacheCreationInputTokens",
    "ephemeral_5m_input_tokens": "cacheCreationEphemeral5mInputTokens",
    "ephemeral_1h_input_tokens": "cacheCreationEphemeral1hInputTokens",
}


def api_usage(counts: dict, cache_writes: dict) -> dict:
    """A usage in the Messages API's shape, every count present (`cache_writes`: the cache
    writes by lifetime; none reported means the default lifetime, five minutes)."""
    usage = {key: int(counts.get(key) or 0) for key in TOKEN_KEYS}
    split = {key: int(cache_writes.get(key) or 0) for key in CACHE_WRITE_KEYS}
    if not any(split.values()):
        split["ephemeral_5m_input_tokens"] = usage["cache_creation_input_tokens"]
    return usage | {"cache_creation": split}


def model_usage_as_api(usage: dict) -> dict:
    """A model's entry of the CLI's `modelUsage` as the Messages API reports usage."""
    named = {key: usage.get(name) for key, name in CLI_USAGE_NAMES.items()}
    return api_usage(named, named)


class StreamedCalls:
    """The model requests of one run, each billed through the engine's meter the moment
    Claude Code streams its end (`message_delta` carries its final output count; its start,
    the input and cache counts), so a worker killed at any moment leaves every answered
    request in the ledger. Requests of sub-agents stream beside the main loop's, told apart
    by the tool use that started them. What the result reports beyond these (requests
    Claude Code made without streaming them: a sub-agent's, this version of Claude Code
    streams only the main loop's) is billed when the result arrives (`bill_unstreamed`).
    The run is stopped once the ledger reaches `cap`; the tool uses a billed request asked
    for pass `tool_uses` only then (`ToolUseGate`)."""

    def __init__(self, meter: CallMeter, *, default_model: str, cap: Decimal) -> None:
        self.meter = meter
        self.default_model = default_model
        self.cap = cap
        self.open: dict[str | None, tuple[str, str, dict]] = {}
        self.open_tool_uses: dict[str | None, list[str]] = defaultdict(list)
        self.billed: dict[str, list[dict]] = defaultdict(list)
        self.billed_ids: set[str] = set()
        self.tool_uses = ToolUseGate()

    def see(self, message) -> None:
        event = message.event if isinstance(message.event, dict) else {}
        stream = message.parent_tool_use_id
        if event.get("type") == "message_start":
            started = event.get("message") if isinstance(event.get("message"), dict) else {}
            usage = started.get("usage") if isinstance(started.get("usage"), dict) else {}
            self.open[stream] = (str(started.get("id") or ""), storable(started.get("model") or ""), dict(usage))
            self.open_tool_uses[stream] = []
        elif event.get("type") == "content_block_start" and stream in self.open:
            block = event.get("content_block") if isinstance(event.get("content_block"), dict) else {}
            if block.get("type") == "tool_use":
                self.open_tool_uses[stream].append(str(block.get("id") or ""))
        elif event.get("type") == "message_delta" and stream in self.open:
            message_id, model, usage = self.open.pop(stream)
            if isinstance(event.get("usage"), dict):
                usage.update({key: value for key, value in event["usage"].items() if value is not None})
            self.bill(model or self.default_model, usage, message_id=message_id)
            # Not when the bill reached the cap (it raised): those tools wait for the stop.
            self.tool_uses.release(self.open_tool_uses.pop(stream, []))

    def bill(self, model: str, reported: dict, *, message_id: str = "") -> None:
        if message_id in self.billed_ids:
            return  # the same request reported again
        writes = reported.get("cache_creation")
        usage = api_usage(reported, writes if isinstance(writes, dict) else {})
        if not any(usage[key] for key in TOKEN_KEYS):
            return  # no tokens: nothing was billed (a message the CLI made up to report an error)
        if problem := usage_error(usage):
            raise AdapterError("cli_error", f"Claude Code reported an impossible usage for {model}: {problem}")
        self.meter.bill(usage=usage, model=model, message_id=message_id)
        self.billed[model].append(usage)
        if message_id:
            self.billed_ids.add(message_id)
        if self.meter.billed_usd >= self.cap:
            raise LedgerCapReached(self.meter.billed_usd)

    def streaming_finish(self, seconds: float) -> None:
        """At the run's deadline: no tool starts any more, and an answer streaming now gets
        `seconds` to end and be billed before the CLI is killed. Called from the watchdog's
        thread; `open` is the engine thread's, read only."""
        self.tool_uses.stop()
        deadline = time.monotonic() + seconds
        while self.open and time.monotonic() < deadline:
            time.sleep(0.05)

    def bill_unstreamed(self, totals: dict[str, dict]) -> None:
        """Bill, per model, what the result's `modelUsage` reports beyond the requests
        streamed (a request Claude Code made without streaming it)."""
        for model, total in totals.items():
            streamed = usage_total(self.billed.get(model, ())) or api_usage({}, {})
            rest = {key: total[key] - streamed[key] for key in TOKEN_KEYS}
            writes = {key: total["cache_creation"][key] - streamed["cache_creation"][key] for key in CACHE_WRITE_KEYS}
            if any(value < 0 for value in [*rest.values(), *writes.values()]):
                # Never billed below what was streamed: each streamed request is the API's own count.
                logger.warning("Claude Code's result reports less for %s than it streamed: %s", model, total)
                continue
            if any(rest.values()):
                self.bill(model, {**rest, "cache_creation": writes})

    def usage_by_model(self) -> dict[str, dict]:
        return {model: usage_total(usages) for model, usages in self.billed.items()}


class ToolUseGate:
    """Where Claude Code's tool uses wait for the engine to bill the request that asked for
    them (a PreToolUse hook, `CliRun.options`).

    Claude Code sends its next request as soon as a turn's tools are done, and the engine
    bills each request from the stream a moment after its end. Unheld, a run stopped at its
    cap could have a next request in flight, answered and billed by the provider, and never
    relayed to the ledger. Held here, the request that reaches the cap is billed before any
    tool it asked for runs, and the stop comes before anything is sent after it.
    Keyed by tool use id: the SDK can call a hook before it yields the stream events that
    came before it. The hook runs on the conversation's loop, the billing in the engine's
    thread: a set's add and membership test are atomic under the GIL."""

    POLL_SECONDS = 0.005
    # Far beyond a bill's time; past it a tool goes on unheld (as before the gate) rather
    # than a run waiting out its timeout on a tool use the stream never showed.
    WAIT_SECONDS = 30.0

    def __init__(self) -> None:
        self.billed: set[str] = set()
        self.stopped = False

    def release(self, tool_use_ids: Iterable[str]) -> None:
        self.billed.update(tool_use_ids)

    def stop(self) -> None:
        """The run is stopped (at its cap, or at its timeout): no tool starts any more."""
        self.stopped = True

    async def passes(self, tool_use_id: str) -> bool:
        """True once the request that asked for this tool use is billed; False when the run
        was stopped first."""
        deadline = time.monotonic() + self.WAIT_SECONDS
        while not self.stopped:
            if tool_use_id in self.billed:
                return True
            if time.monotonic() >= deadline:
                logger.warning("Claude Code's tool use %s went on before its request was billed", tool_use_id)
                return True
            await asyncio.sleep(self.POLL_SECONDS)
        return False


def _cancel(task: asyncio.Task, loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.call_soon_threadsafe(task.cancel)
    except RuntimeError:
        pass  # the loop is closed: the conversation ended while its last bills were made


class LedgerCapReached(Exception):
    """The run's billed total reached its cap: Claude Code is stopped."""

    def __init__(self, billed: Decimal) -> None:
        super().__init__(f"billed {billed}")
        self.billed = billed


def usage_total(usages: Iterable[dict]) -> dict | None:
    """The sum of usages in the Messages API's shape; None for none."""
    usages = list(usages)
    if not usages:
        return None
    return api_usage(
        {key: sum(usage[key] for usage in usages) for key in TOKEN_KEYS},
        {key: sum(usage["cache_creation"][key] for usage in usages) for key in CACHE_WRITE_KEYS},
    )


def _trimmed(value, *, blocks: bool = True) -> Any:
    """A tool result (or a tool input's value) as the history keeps it: text, at most
    RESULT_CHARS of it (a file written or read whole is in the store, not here)."""
    if blocks and isinstance(value, list):
        value = "".join(block.get("text", "") for block in value if isinstance(block, dict))
    if isinstance(value, str) and len(value) > RESULT_CHARS:
        return value[:RESULT_CHARS] + f"... [{len(value) - RESULT_CHARS} more characters]"
    return value


def content_blocks(messages: list) -> list[dict]:
    """The run's conversation as history content: the assistant's text, each tool call
    with its input, each tool result (trimmed), and the CLI's compaction boundaries."""
    from claude_agent_sdk import AssistantMessage, SystemMessage, TextBlock, ToolResultBlock, ToolUseBlock, UserMessage

    blocks: list[dict] = []
    for message in messages:
        if isinstance(message, AssistantMessage):
            for block in message.content:
                if isinstance(block, TextBlock) and block.text:
                    blocks.append({"type": "text", "text": block.text})
                elif isinstance(block, ToolUseBlock):
                    tool_input = {key: _trimmed(value, blocks=False) for key, value in (block.input or {}).items()}
                    blocks.append({"type": "tool_use", "id": block.id, "name": block.name, "input": tool_input})
        elif isinstance(message, UserMessage) and isinstance(message.content, list):
            for block in message.content:
                if isinstance(block, ToolResultBlock):
                    result = {
                        "type": "tool_result",
                        "tool_use_id": block.tool_use_id,
                        "content": _trimmed(block.content),
                    }
                    if block.is_error:
                        result["is_error"] = True
                    blocks.append(result)
        elif isinstance(message, SystemMessage) and message.subtype == "compact_boundary":
            metadata = message.data.get("compact_metadata") or {}
            blocks.append(
                {
                    "type": "compaction_boundary",
                    "trigger": metadata.get("trigger", ""),
                    "pre_tokens": metadata.get("pre_tokens"),
                }
            )
    return blocks


FAILURES = {
    "error_max_turns": ("cli_max_turns", "Claude Code stopped at max_turns before it finished."),
    "error_max_budget_usd": ("cli_budget_cap", "Claude Code stopped at max_budget_usd before it finished."),
}


class ClaudeCliAdapter(Adapter):
    type_name = "claude-code"
    keeps_own_session = True  # the CLI resumes its own session; the engine sends only the new turn
    own_session_store = "cli_transcripts"
    bills_while_running = True  # each model request Claude Code makes is billed as it ends
    config_keys = CONFIG_KEYS

    def validate_config(self, config: dict, errors: dict[str, str]) -> dict:
        return validate_cli_config(config, errors)

    def credential(self, config: dict) -> str | None:
        """The API key the CLI is given (the deployment's), or its own login when none is:
        one hold for every CLI agent logged in that way."""
        return (
            api_credential()
            if os.environ.get("ANTHROPIC_API_KEY") or os.environ.get("ANTHROPIC_AUTH_TOKEN")
            else CLI_LOGIN
        )

    def call_seconds(self, config: dict) -> float:
        return float(config.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS)) + KILL_GRACE_SECONDS

    def reservation_usd(self, config: dict) -> Decimal:
        """What a budgeted heartbeat holds before the CLI starts: its own cap, which the CLI
        enforces (it may overshoot by the call that crossed it)."""
        cap = config.get("max_budget_usd")
        if cap is None:
            raise AdapterError(
                "cli_budget_cap_required",
                "A budget applies to this agent: set adapter_config.max_budget_usd, the most one heartbeat "
                "of Claude Code may spend, so it can be held against the budget.",
            )
        return Decimal(str(cap))

    def call(self, request: AdapterRequest) -> AdapterReply:
        # Checked again here, with this worker's mode and list: the row may predate them,
        # or have been written around validation.
        problems = authenticated_problems(
            request.config, mode=settings.PAPERCLIP_DEPLOYMENT_MODE, permitted=settings.PAPERCLIP_CLI_TOOLS
        )
        if problems:
            detail = "; ".join(f"adapter_config.{key}: {message}" for key, message in problems.items())
            raise AdapterError("cli_not_allowed", f"This agent's Claude Code settings may not run here: {detail}")
        agent_id = request.metadata["agent_id"]
        run = CliRun(self, request, agent_id=agent_id)
        return run.execute()


class CliRun:
    """One heartbeat of the CLI: prepared (directories, environment, transcript) in the
    engine's thread, run on an event loop of its own, reported back as an AdapterReply."""

    def __init__(self, adapter: ClaudeCliAdapter, request: AdapterRequest, *, agent_id) -> None:
        self.request = request
        self.config = request.config
        self.agent_id = agent_id
        self.workspace = workspace_for(agent_id, self.config)
        self.sandbox: list[str] = []  # bubblewrap's command line, once the run starts (`cli_sandbox`)
        self.persistent = self.config.get("session_mode") == "persistent"
        # The engine's handle on the session this run resumes, or starts (`OwnSession`).
        self.own = request.own_session
        self.resume_id = self.own.resumed_id
        self.transcript = None
        self.session_id = ""
        self.cap = Decimal(str(self.config.get("max_budget_usd") or settings.PAPERCLIP_CLI_DEFAULT_BUDGET_USD))
        self.calls = StreamedCalls(request.meter, default_model=request.model, cap=self.cap)
        # Read here, in the engine's thread: the conversation runs on a loop of its own.
        self.traceparent = telemetry.traceparent()

    def execute(self) -> AdapterReply:
        try:
            config_dir(self.agent_id).mkdir(parents=True, exist_ok=True)
            workspace_prepare(self.workspace, home=agent_home(self.agent_id))
        except (OSError, subprocess.SubprocessError) as exc:
            raise AdapterError(
                "cli_start_failed", f"Could not create the workspace or config directory: {exc}"
            ) from None
        self.sandbox = sandbox_arguments(home=agent_home(self.agent_id), workspace=self.workspace, cli=cli_binary())
        if self.persistent:
            self.transcript = self.own.run_transcript()
            if self.resume_id and not self.transcript.loaded.get(""):
                # As for a missing history file: an agent resumed with no memory would
                # silently redo (and re-bill) its work.
                raise AdapterError(
                    "history_missing",
                    f"The transcript of Claude Code session {self.resume_id} is missing from the store; "
                    "heartbeat with force_fresh to start a new session.",
                )
        self.session_id = self.resume_id or str(uuid.uuid4())
        self.mark = uuid.uuid4().hex
        timeout = float(self.config.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS))
        conversation = Conversation()
        try:
            processes = RunProcesses.start(mark=self.mark, run_id=str(self.request.metadata.get("run_id") or ""))
        except OSError as exc:
            raise AdapterError("cli_start_failed", f"Could not record the run's processes: {exc}") from None
        finish = partial(self.calls.streaming_finish, STREAMING_GRACE_SECONDS)
        with Watchdog(processes, timeout, finish=finish) as watchdog:
            # Classified below, once the run's processes are gone.
            error = self.converse_and_bill(conversation, processes, seconds=timeout + KILL_GRACE_SECONDS)
        try:
            return self.reply(conversation, error, timed_out=watchdog.fired)
        except AdapterError:
            if not self.resume_id:  # a new session that is not kept: not even as a cache
                local_copy_delete(agent_id=self.agent_id, cli_session_id=self.session_id)
            raise
        finally:
            if not self.persistent:
                local_copy_delete(agent_id=self.agent_id, cli_session_id=self.session_id)

    def options(self, conversation: Conversation, processes: RunProcesses):
        from claude_agent_sdk import ClaudeAgentOptions, HookMatcher

        config = self.config
        allowed = list(config.get("allowed_tools", DEFAULT_ALLOWED_TOOLS))
        system: dict[str, Any] = {"type": "preset", "preset": "claude_code"}
        if self.request.system:
            system["append"] = self.request.system
        env = cli_environment(
            agent_id=self.agent_id, workspace=self.workspace, mark=self.mark, traceparent=self.traceparent
        )

        def stderr(line: str) -> None:
            conversation.stderr = [*conversation.stderr[-19:], line]

        async def after_tool(_input, _tool_use_id, _context) -> dict:
            # The CLI waits for this answer: a job the tool left running (`env -i job &`) is
            # under it now, whatever the tracker's poll and this loop's backlog are doing.
            processes.take_stock()
            return {}

        async def before_tool(hook_input, tool_use_id, _context) -> dict:
            # A sub-agent's requests are not streamed (billed from the result): not held.
            if "agent_id" in hook_input or not tool_use_id or await self.calls.tool_uses.passes(tool_use_id):
                return {}
            # Denied, not only stopped: `continue` false alone can let the tool run first.
            stopped = "The heartbeat was stopped at its cap or its timeout."
            return {
                "continue_": False,
                "stopReason": stopped,
                "hookSpecificOutput": {
                    "hookEventName": "PreToolUse",
                    "permissionDecision": "deny",
                    "permissionDecisionReason": stopped,
                },
            }

        hooks = {"PreToolUse": [HookMatcher(hooks=[before_tool])]}
        if processes.cgroup is None:  # without a cgroup, the run's processes are found after each tool too
            hooks |= {event: [HookMatcher(hooks=[after_tool])] for event in ("PostToolUse", "PostToolUseFailure")}

        options = ClaudeAgentOptions(
            model=self.request.model,
            cwd=str(self.workspace),
            cli_path=str(LAUNCHER),
            env=launcher_environment(env, processes=processes, sandbox=self.sandbox),
            # The tools the model is offered at all: those allowed, by name.
            tools=sorted({name.split("(", 1)[0] for name in allowed}),
            allowed_tools=allowed,
            disallowed_tools=list(config.get("disallowed_tools", [])),
            permission_mode=config.get("permission_mode", DEFAULT_PERMISSION_MODE),
            max_turns=config.get("max_turns", DEFAULT_MAX_TURNS),
            max_budget_usd=float(config.get("max_budget_usd") or settings.PAPERCLIP_CLI_DEFAULT_BUDGET_USD),
            setting_sources=[],  # never the host's or the workspace's settings, hooks or memory
            strict_mcp_config=True,
            system_prompt=system,
            stderr=stderr,
            effort=config.get("effort"),
            thinking=config.get("thinking"),
            session_store=self.transcript,
            # The API's own stream events: each model request's usage as it ends, billed then.
            include_partial_messages=True,
            hooks=hooks,
        )
        if self.resume_id:
            options.resume = self.resume_id
        else:
            options.session_id = self.session_id
        return options

    def converse_and_bill(
        self, conversation: Conversation, processes: RunProcesses, *, seconds: float
    ) -> BaseException | None:
        """Claude Code's conversation, on an event loop in a thread of its own, while this
        thread (the engine's, whose database connection the ledger uses; the loop never
        touches the ORM) bills each model request as its end is streamed. At the ledger's
        cap the CLI is killed. Returns what ended the conversation early, if anything."""
        reports: queue.SimpleQueue = queue.SimpleQueue()
        loop = asyncio.new_event_loop()
        conversing = loop.create_task(
            asyncio.wait_for(self.converse(conversation, processes, reports), seconds), name="claude-code"
        )

        def run() -> None:
            try:
                loop.run_until_complete(conversing)
                reports.put((None, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the engine's thread
                reports.put((None, exc))
            finally:
                loop.close()

        thread = threading.Thread(target=run, name=f"claude-code-{self.mark[:8]}", daemon=True)
        thread.start()
        stopped: BaseException | None = None
        while True:
            event, ended = reports.get()
            if event is None:
                break
            try:
                # Billed even while the CLI is being stopped: a request it streamed the end of
                # was answered, and the provider bills it (one in flight when the cap was
                # reached, on a loaded host).
                self.calls.see(event)
            except (LedgerCapReached, AdapterError) as exc:
                if stopped is None:
                    stopped = exc
                    processes.kill()
                    self.calls.tool_uses.stop()  # after the kill: a held tool never runs
                    _cancel(conversing, loop)
        thread.join()
        return stopped or ended

    async def converse(self, conversation: Conversation, processes: RunProcesses, reports: queue.SimpleQueue) -> None:
        from claude_agent_sdk import ResultMessage, StreamEvent, query

        prompt = self.prompt()
        async for message in query(prompt=prompt, options=self.options(conversation, processes)):
            if isinstance(message, StreamEvent):
                reports.put((message, None))
                continue
            conversation.messages.append(message)
            if isinstance(message, ResultMessage):
                conversation.result = message

    def prompt(self) -> str:
        content = self.request.messages[-1]["content"]
        if isinstance(content, str):
            return content
        return "\n\n".join(block.get("text", "") for block in content if isinstance(block, dict))

    def reply(self, conversation: Conversation, error: BaseException | None, *, timed_out: bool) -> AdapterReply:
        result = conversation.result
        if result is not None:
            totals = {
                storable(model): model_usage_as_api(usage)
                for model, usage in (result.model_usage or {}).items()
                if isinstance(usage, dict)
            }
            try:
                self.calls.bill_unstreamed(totals)
            except LedgerCapReached:
                pass  # the run is over: nothing more to stop
        usages = self.calls.usage_by_model()
        content = content_blocks(conversation.messages)
        session_id = result.session_id if result is not None and result.session_id else self.session_id
        report = {
            "runtime": RUNTIME,
            "cli_session_id": session_id,
            "num_turns": result.num_turns if result is not None else None,
            "tool_calls": [{"name": b["name"], "input": b["input"]} for b in content if b["type"] == "tool_use"],
            "cli_total_cost_usd": (
                str(result.total_cost_usd) if result is not None and result.total_cost_usd is not None else None
            ),
            "duration_ms": result.duration_ms if result is not None else None,
        }
        failure = self.failure(conversation, error, timed_out=timed_out)
        if failure is not None:
            failure.runtime_report = report
            raise failure
        return AdapterReply(
            text=(result.result or "") if result is not None else "",
            content=content,
            model=self.request.model,
            requested_model=self.request.model,
            message_id=(result.uuid or "") if result is not None else "",
            stop_reason=(result.stop_reason or result.subtype or "") if result is not None else "",
            usage=usage_total(usages.values()),
            usage_by_model=usages or None,
            runtime_report=report,
            on_commit=self.own.on_commit(self.transcript, session_id=session_id, report=report),
        )

    def failure(self, conversation: Conversation, error: BaseException | None, *, timed_out: bool):
        result = conversation.result
        stderr = "\n".join(conversation.stderr)[-1000:]
        if isinstance(error, AdapterError):
            return error
        if isinstance(error, LedgerCapReached):
            return AdapterError(
                "cli_budget_cap",
                f"Claude Code was stopped when this heartbeat's calls reached max_budget_usd (${self.cap}) in the "
                f"ledger: ${error.billed} billed.",
            )
        if timed_out or isinstance(error, (TimeoutError, asyncio.TimeoutError)):
            timeout = self.config.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS)
            return AdapterError("cli_timeout", f"Claude Code did not finish within {timeout} seconds; it was killed.")
        if error is not None and not conversation.messages:
            # Not even its first message: the CLI did not start (or died starting).
            detail = f"{error}" + (f"\n{stderr}" if stderr else "")
            return AdapterError("cli_start_failed", f"Claude Code could not be started: {detail}"[:2000])
        if result is not None and result.subtype in FAILURES:
            return AdapterError(*FAILURES[result.subtype])
        if refusal := usage_limit_refusal(conversation):
            return refusal
        if result is not None and result.is_error:
            detail = "; ".join(map(str, result.errors or [])) or result.result or result.subtype
            return AdapterError("cli_error", f"Claude Code failed: {detail}"[:2000])
        if error is not None:
            detail = f"{error.__class__.__name__}: {error}" + (f"\n{stderr}" if stderr else "")
            return AdapterError("cli_error", f"Claude Code failed: {detail}"[:2000])
        if result is None:
            return AdapterError("cli_error", "Claude Code ended without a result." + (f"\n{stderr}" if stderr else ""))
        return None


def usage_limit_refusal(conversation: Conversation) -> QuotaRefused | None:
    """A run Claude Code ended on a usage limit: its rate-limit event said `rejected` (with
    the reset), or its result says "usage limit reached ... resets at ..."."""
    from claude_agent_sdk import RateLimitEvent

    now = datetime.now(UTC)
    for message in conversation.messages:
        info = message.rate_limit_info if isinstance(message, RateLimitEvent) else None
        if info is not None and info.status == "rejected":
            reset = datetime.fromtimestamp(info.resets_at, UTC) if info.resets_at else None
            kind = info.rate_limit_type or "usage"
            return QuotaRefused(USAGE_LIMIT, f"Claude Code: {kind} usage limit reached", reset_at=reset)
    result = conversation.result
    if result is None or not result.is_error:
        return None
    return cli_refusal(" ".join([str(result.result or ""), *map(str, result.errors or [])]), now=now)


# --- the workspace, as operators see it ---------------------------------------------------

LISTED_FILES = 200
COUNTED_FILES = 10_000


@dataclass
class WorkspaceFile:
    name: str  # relative to the workspace
    size: int
    modified: datetime


@dataclass
class WorkspaceListing:
    root: Path
    missing: bool = False
    files: list[WorkspaceFile] = field(default_factory=list)
    count: int = 0
    truncated: bool = False


def workspace_listing(*, agent_id, config: dict) -> WorkspaceListing:
    """The workspace's files (the first LISTED_FILES by name, symlinks not followed)."""
    root = workspace_for(agent_id, config)
    listing = WorkspaceListing(root=root)
    if not root.is_dir():
        listing.missing = True
        return listing
    for folder, dirs, names in os.walk(root):
        # The workspace's own repository (cli_home.workspace_prepare) is not the agent's work.
        dirs[:] = sorted(d for d in dirs if not (d == ".git" and Path(folder) == root))
        for name in sorted(names):
            listing.count += 1
            if listing.count > COUNTED_FILES:
                listing.truncated = True
                return listing
            if len(listing.files) >= LISTED_FILES:
                listing.truncated = True
                continue
            path = Path(folder) / name
            try:
                stat = path.lstat()
            except OSError:
                continue
            modified = datetime.fromtimestamp(stat.st_mtime, tz=UTC)
            # A file name is whatever bytes the agent chose: made printable before display.
            listing.files.append(WorkspaceFile(storable(str(path.relative_to(root))), stat.st_size, modified))
    return listing
