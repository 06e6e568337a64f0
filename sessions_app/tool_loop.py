"""Step 6 with tools: call the model, carry out the tools it asks for, call again.

An agent with `memory` configured gets the memory tool (`memory_app.tool`). While the
model answers with tool_use blocks, each is carried out and answered with its tool_result,
and the model is called again with both, until it answers without tools. Bounds:

- `max_tool_rounds` (default 8): one round more fails the run `tool_rounds_exceeded`;
- the budget: every call after the first is reserved like any other (`reserve`); every
  call is billed as it returns (`sessions_app.run_calls`), so the next reservation counts
  it as spent and a failure later in the loop never loses it.

Nothing here holds a transaction across a call: each memory write commits on its own (a
version), between calls. The turns of the loop are returned on the final reply
(`exchanges`); the commit step records them in the session's history with the answer,
each tool_use beside its tool_result, or, when the run fails, records nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from costs_app.money import usd
from costs_app.pricing import token_counts
from memory_app.models import RunToolLoop
from memory_app.stores import Writer, memory_store_names, mounts_for
from sessions_app.adapters import AdapterReply, AdapterRequest
from sessions_app.adapters.tool_config import DEFAULT_MAX_TOOL_ROUNDS
from sessions_app.context import cache_marker
from sessions_app.errors import RunAbandoned, RunFailure
from sessions_app.models import Agent

if TYPE_CHECKING:
    # At run time imported by the loop itself: the memory tool is built on the anthropic
    # SDK, which start-up need not load (sessions_app.adapters.claude_code.sdk).
    from memory_app.tool import StoreMemoryTool


def memory_tool_for(beat) -> StoreMemoryTool | None:
    """The run's memory tool, or None when the agent has no memory configured (or its
    runtime is not the API's)."""
    agent = beat.agent
    if agent.adapter_type != "claude-code" or not memory_store_names(agent):
        return None
    if agent.adapter_config.get("runtime", "api") != "api":
        return None
    from memory_app.tool import StoreMemoryTool

    # Deleted since its claim, its memory with it: the run fails before sending a call.
    if Agent.is_gone(agent.pk):
        raise RunAbandoned("agent_deleted", "The agent was deleted, and its memory with it.")
    return StoreMemoryTool(mounts_for(agent), writer=Writer(run_id=beat.run.id))


def tool_uses(reply: AdapterReply) -> list[dict]:
    content = reply.content if isinstance(reply.content, list) else []
    return [block for block in content if isinstance(block, dict) and block.get("type") == "tool_use"]


class ToolLoop:
    """One run's loop: its calls, its rounds and what context editing cleared."""

    def __init__(self, beat, *, reserve: Callable[[AdapterRequest], None]) -> None:
        self.beat = beat
        self.reserve = reserve
        self.rounds = 0
        self.tool_calls = 0
        self.tool_errors = 0
        self.cleared_tool_uses = 0
        self.cleared_input_tokens = 0
        self.exchanges: list[dict] = []

    def run(self, request: AdapterRequest, tool: StoreMemoryTool) -> AdapterReply:
        limit = int(self.beat.agent.adapter_config.get("max_tool_rounds", DEFAULT_MAX_TOOL_ROUNDS))
        base = request.messages
        try:
            while True:
                reply = self.beat.calls.call(request)
                self.note_cleared(reply)
                uses = tool_uses(reply)
                if not uses:
                    return replace(reply, exchanges=self.exchanges, tool_rounds=self.rounds)
                if self.rounds >= limit:
                    raise RunFailure(
                        "tool_rounds_exceeded",
                        f"The model asked for tools after {limit} rounds (max_tool_rounds); the run stops here. "
                        "Memory written in earlier rounds is kept.",
                    )
                results = [self._carry_out(tool, block) for block in uses]
                self.rounds += 1
                self._record_exchange(reply, results)
                request = replace(request, messages=base + self._replayed())
                self.reserve(request)
        finally:
            self.save()

    def _carry_out(self, tool: StoreMemoryTool, block: dict) -> dict:
        self.tool_calls += 1
        if block.get("name") != "memory":
            result = {
                "type": "tool_result",
                "tool_use_id": block.get("id", ""),
                "content": f"Unknown tool {block.get('name')!r}: this agent has only the memory tool.",
                "is_error": True,
            }
        else:
            from memory_app.tool import tool_result

            result = tool_result(tool, block)
        self.tool_errors += bool(result.get("is_error"))
        return result

    def _record_exchange(self, reply: AdapterReply, results: list[dict]) -> None:
        at = self.beat.clock().isoformat()
        run_id = str(self.beat.run.id)
        counts = token_counts(reply.usage) if reply.usage is not None else None
        self.exchanges += [
            {
                "role": "assistant",
                "content": reply.content,
                "at": at,
                "run_id": run_id,
                "message_id": reply.message_id,
                "usage": counts.__dict__ if counts else None,
                "cost_usd": usd(reply.cost_usd) if reply.cost_usd is not None else None,
            },
            {"role": "user", "content": results, "at": at, "run_id": run_id},
        ]

    def _replayed(self) -> list[dict]:
        """The loop's turns as the next request sends them: the newest tool result marked
        for the prompt cache, so each round reads the rounds before it from the cache."""
        messages = [{"role": m["role"], "content": [dict(b) for b in m["content"]]} for m in self.exchanges]
        if self.beat.settings_.caching:
            last = messages[-1]["content"]
            last[-1] = {**last[-1], "cache_control": cache_marker(self.beat.settings_)}
        return messages

    def note_cleared(self, reply: AdapterReply) -> None:
        for edit in (reply.context_management or {}).get("applied_edits") or []:
            if isinstance(edit, dict) and str(edit.get("type", "")).startswith("clear_tool_uses"):
                self.cleared_tool_uses += int(edit.get("cleared_tool_uses") or 0)
                self.cleared_input_tokens += int(edit.get("cleared_input_tokens") or 0)

    def save(self) -> None:
        if not (self.rounds or self.tool_calls or self.cleared_tool_uses or self.cleared_input_tokens):
            return
        RunToolLoop.objects.update_or_create(
            run_id=self.beat.run.id,
            defaults={
                "rounds": self.rounds,
                "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors,
                "cleared_tool_uses": self.cleared_tool_uses,
                "cleared_input_tokens": self.cleared_input_tokens,
            },
        )


def offering(request: AdapterRequest, tool: StoreMemoryTool | None) -> AdapterRequest:
    """The request as it is sent: with the tool's definition when the run has one. The
    first call is reserved on this request, since the definition is input and a request
    with tools can only go direct (tools are a beta the Batches API is not sent)."""
    return request if tool is None else replace(request, tools=[tool.to_dict()])


def call_with_tools(beat, request: AdapterRequest, *, tool: StoreMemoryTool | None, reserve) -> AdapterReply:
    """The model's final answer to `request` (`offering` the tool), tools carried out on
    the way. Without tools, exactly one call, as before."""
    loop = ToolLoop(beat, reserve=reserve)
    if tool is not None:
        return loop.run(request, tool)
    reply = beat.calls.call(request)
    loop.note_cleared(reply)
    loop.save()
    return reply
