"""The settings of the tool loop and context editing (`claude-code`'s API runtime).

- `memory`: true (the agent's default memory store) or a list of store names (the default
  store plus these, at /memories/<name>/); gives the agent the `memory_20250818` tool.
- `max_tool_rounds`: how many rounds of tool calls one heartbeat may carry out (default 8).
- `clear_tool_uses`: true, or {"trigger_input_tokens", "keep_tool_uses",
  "clear_at_least_tokens"}: the API clears old tool results from long requests
  (`clear_tool_uses_20250919`).
"""

from __future__ import annotations

import re
from typing import Any

TOOL_CONFIG_KEYS = {"memory", "max_tool_rounds", "clear_tool_uses"}
DEFAULT_MAX_TOOL_ROUNDS = 8
MAX_TOOL_ROUNDS = 50
CONTEXT_MANAGEMENT_BETA = "context-management-2025-06-27"
STORE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
CLEAR_DEFAULTS = {"trigger_input_tokens": 100_000, "keep_tool_uses": 3}
CLEAR_BOUNDS = {
    "trigger_input_tokens": (1_000, 2_000_000),
    "keep_tool_uses": (0, 1_000),
    "clear_at_least_tokens": (0, 2_000_000),
}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_tool_config(config: dict, errors: dict[str, str]) -> dict:
    clean: dict[str, Any] = {}
    if "memory" in config:
        memory = config["memory"]
        if isinstance(memory, list):
            bad = [name for name in memory if not isinstance(name, str) or not STORE_NAME.fullmatch(name)]
            if bad or len(memory) > 20 or len(set(memory)) != len(memory):
                errors["memory"] = (
                    "must be true, false or a list of up to 20 distinct store names "
                    f"(lowercase letters, digits, '-' and '_', at most 64), got {memory!r}"
                )
        elif not isinstance(memory, bool):
            errors["memory"] = f"must be true, false or a list of store names, got {memory!r}"
        clean["memory"] = memory
    if "max_tool_rounds" in config:  # unset: DEFAULT_MAX_TOOL_ROUNDS, without filling every agent's config
        rounds = config["max_tool_rounds"]
        if not _whole(rounds) or not 0 <= rounds <= MAX_TOOL_ROUNDS:
            errors["max_tool_rounds"] = f"must be a whole number in 0..{MAX_TOOL_ROUNDS}, got {rounds!r}"
        clean["max_tool_rounds"] = rounds
    if "clear_tool_uses" in config:
        clean["clear_tool_uses"] = _clear_tool_uses(config["clear_tool_uses"], errors)
    return clean


def _clear_tool_uses(value: Any, errors: dict[str, str]):
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, dict):
        errors["clear_tool_uses"] = f"must be true, false, null or an object of settings, got {value!r}"
        return value
    for key in sorted(set(value) - set(CLEAR_BOUNDS)):
        errors[f"clear_tool_uses.{key}"] = f"unknown setting; expected one of {', '.join(sorted(CLEAR_BOUNDS))}"
    for key, (low, high) in CLEAR_BOUNDS.items():
        if key in value and (not _whole(value[key]) or not low <= value[key] <= high):
            errors[f"clear_tool_uses.{key}"] = f"must be a whole number in {low}..{high}, got {value[key]!r}"
    return value


def clear_tool_uses_edit(config: dict) -> dict | None:
    """The `clear_tool_uses_20250919` edit the configuration asks for, or None."""
    wanted = config.get("clear_tool_uses")
    if not wanted:
        return None
    settings = {**CLEAR_DEFAULTS, **(wanted if isinstance(wanted, dict) else {})}
    edit: dict[str, Any] = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "input_tokens", "value": settings["trigger_input_tokens"]},
        "keep": {"type": "tool_uses", "value": settings["keep_tool_uses"]},
    }
    if settings.get("clear_at_least_tokens"):
        edit["clear_at_least"] = {"type": "input_tokens", "value": settings["clear_at_least_tokens"]}
    return edit
